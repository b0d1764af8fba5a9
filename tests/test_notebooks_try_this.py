"""The notebooks' "Try this" suggestions, run: each applies the suggested change through papermill parameters and
the notebook's own asserts check the outcome its sentence predicts."""
from pathlib import Path

import papermill


def _run(tmp_path, name: str, **parameters):
    out = tmp_path / f"{name}.ipynb"
    notebooks = Path(__file__).resolve().parent.parent / "notebooks"
    papermill.execute_notebook(str(notebooks / f"{name}.ipynb"), str(out), parameters=parameters,
                               kernel_name="python3", progress_bar=False, cwd=str(notebooks))
    return out


def test_notebook_12_plain_ep_gives_unequal_slots(tmp_path):
    """Notebook 12: "set ep_kind = 'ep': the losses stay the same, but the slots_per_rank lists of that run become
    unequal" — the notebook asserts the losses against one process (1e-5) and, for a plain-EP run, unequal slots."""
    import json

    out = _run(tmp_path, "12_scaling_up", ep_kind="ep")
    text = json.dumps(json.loads(out.read_text())["cells"])
    assert "[ep]: slots per EP rank" in text and "[moonep]: slots per EP rank" in text

