"""Every committed notebook is byte-identical to what JupyterLab would save for it (tools/normalize_notebooks.py), so
opening one in Lab does not mark it modified. Fix a failure with ``python tools/normalize_notebooks.py <notebook>``."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import normalize_notebooks  # noqa: E402

# Notebooks other sessions are still editing: reported (xfail) until the lead runs
# `python tools/normalize_notebooks.py` over all of them; then empty this set.
PENDING: set[str] = set()  # notebooks allowed to differ from JupyterLab's save for now (none)


def _params():
    for path in normalize_notebooks.default_notebooks():
        marks = [pytest.mark.xfail(reason="not normalised yet (issue 29 item 6): run tools/normalize_notebooks.py",
                                   strict=False)] if path.stem in PENDING else []
        yield pytest.param(path, id=str(path.relative_to(ROOT)), marks=marks)


@pytest.mark.parametrize("path", list(_params()))
def test_notebook_is_normalized(path):
    raw = path.read_bytes().decode("utf-8")
    assert normalize_notebooks.normalized(raw) == raw, (
        f"{path.name} is not what JupyterLab saves: run `python tools/normalize_notebooks.py {path.relative_to(ROOT)}`")


def test_normalizer_is_idempotent_and_merges_streams():
    import json

    nb = {"cells": [{"cell_type": "code", "execution_count": 1, "metadata": {}, "source": "print(1)",
                     "outputs": [{"output_type": "stream", "name": "stderr", "text": "bar:   0%|  | 0/2\r"},
                                 {"output_type": "stream", "name": "stderr", "text": "bar: 100%|##| 2/2\n"},
                                 {"output_type": "stream", "name": "stdout", "text": ["a\n", "b\n"]}]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 4}
    once = normalize_notebooks.normalized(json.dumps(nb, indent=2))
    assert normalize_notebooks.normalized(once) == once and once.endswith("}\n")
    saved = json.loads(once)
    assert saved["nbformat_minor"] == 5 and "id" in saved["cells"][0]
    assert [o["text"] for o in saved["cells"][0]["outputs"]] == [["bar: 100%|##| 2/2\n"], ["a\n", "b\n"]]


def test_normalizer_writes_ipykernels_kernelspec_and_javascripts_numbers():
    """What Lab changes once the kernel starts and the browser has held the JSON: ipykernel's display name, and
    integral floats without their ``.0`` (the learner's ``budget_s 195.0 → 195``); other numbers stay."""
    import json

    nb = {"cells": [], "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                       "papermill": {"parameters": {"budget_s": 195.0, "lr": 3e-4, "big": 1e21, "steps": 10}}}}
    saved = json.loads(normalize_notebooks.normalized(json.dumps(nb)))
    assert saved["metadata"]["kernelspec"] == normalize_notebooks.KERNELSPEC
    params = saved["metadata"]["papermill"]["parameters"]
    assert params == {"budget_s": 195, "lr": 3e-4, "big": 1e21, "steps": 10}
    assert type(params["budget_s"]) is int and type(params["big"]) is float


def test_kernelspec_is_ipykernels():
    kernelspec = pytest.importorskip("ipykernel.kernelspec")
    spec = kernelspec.get_kernel_dict()
    assert {k: spec[k] for k in ("display_name", "language")} == {
        k: normalize_notebooks.KERNELSPEC[k] for k in ("display_name", "language")}
