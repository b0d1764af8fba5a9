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



def _prefix_line(nb_path, index_of_cell) -> dict:
    """Notebook 13 §3's printed numbers: token hit rate, entries, bytes."""
    import json
    import re

    cell = json.loads(Path(nb_path).read_text())["cells"][index_of_cell]
    text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
    rate = float(re.search(r"token hit rate ([\d.]+)", text).group(1))
    entries, size = re.search(r"entries (\d+), ([\d,]+) bytes", text).groups()
    return dict(rate=rate, entries=int(entries), bytes=int(size.replace(",", "")))


def _cell_index(nb_path, marker: str) -> int:
    import json

    cells = json.loads(Path(nb_path).read_text())["cells"]
    return next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and marker in "".join(c["source"]))


def test_notebook_13_smaller_blocks_same_hit_rate_more_bytes(tmp_path):
    """Notebook 13: "set block_tokens = 16 and doc_blocks = 32: the token hit rate stays (0.81), the cache holds more
    than 4x as many entries and about 3.6x the bytes" — against the committed run at the default parameters."""
    committed = Path(__file__).resolve().parent.parent / "notebooks" / "13_inference.ipynb"
    marker = "pc = PrefixCache(model, block_tokens=block_tokens)"
    base = _prefix_line(committed, _cell_index(committed, marker))
    out = _run(tmp_path, "13_inference", block_tokens=16, doc_blocks=32)
    small = _prefix_line(out, _cell_index(out, marker))
    assert small["rate"] == base["rate"] == 0.81
    assert small["entries"] > 4 * base["entries"]
    assert 3.3 < small["bytes"] / base["bytes"] < 3.9, (small, base)
