"""The committed notebooks as a reader sees them: JupyterLab in headless Chromium (tools/check_notebooks_render.py).

The browser run is ``slow`` (about 15 s for JupyterLab to start, then ~5 s a notebook, twice: untrusted and
trusted, then ~1 min to run notebook 04 in the browser); run it with ``pytest -m slow tests/test_notebooks_render.py``. It is skipped when Chromium,
chromedriver or JupyterLab is missing. The detector itself is tested on strings, in the default suite.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "check_notebooks_render.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("check_notebooks_render", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unfinished_bar_detector():
    """What a reader saw in issue 15 is caught; finished bars and ordinary numbers are not."""
    tool = load_tool()
    assert tool.unfinished_bars("K3 · Muon:   0%|          | 0/30 [00:00<?, ?it/s]") == ["0%|", "0/30 ["]
    assert tool.unfinished_bars("decode:  47%|████▋     | 15/32 [00:01<00:01, 9.1it/s]") == ["47%|", "15/32 ["]
    assert tool.unfinished_bars("Loading widget...") == ["Loading widget"]
    finished = "mixers: 100%|██████████| 7/7 [00:21<00:00,  3.02s/it, loss=0.12]"
    assert tool.unfinished_bars(finished) == []
    assert tool.unfinished_bars("recall 0.53 at 16/32 pairs; 50% of rows; ratio 3/4") == []


def test_saved_widget_views_are_found(tmp_path):
    """A saved widget-view output (no widget state in the file) is reported by cell index."""
    tool = load_tool()
    nb = {"cells": [{"cell_type": "markdown", "source": "x", "metadata": {}},
                    {"cell_type": "code", "source": "", "metadata": {}, "outputs": [
                        {"output_type": "display_data", "metadata": {},
                         "data": {tool.WIDGET_VIEW: {"model_id": "m"}, "text/plain": "0%|"}}]},
                    {"cell_type": "code", "source": "", "metadata": {}, "outputs": [
                        {"output_type": "stream", "name": "stdout", "text": "ok"}]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "w.ipynb"
    path.write_text(json.dumps(nb))
    assert tool.widget_view_outputs(path) == [1]


@pytest.mark.slow
def test_committed_notebooks_render_finished(tmp_path):
    """Every committed notebook, untrusted and trusted, shows no unfinished progress bar or widget; notebook 04,
    run in JupyterLab, shows its explorer's sliders and redraws the plot after a slider step."""
    tool = load_tool()
    chromium, driver, lab = tool.find_tools()
    if not (chromium and driver and lab):
        pytest.skip(f"needs Chromium, chromedriver and JupyterLab (found: chromium={chromium}, "
                    f"chromedriver={driver}, jupyterlab={lab})")
    out = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path), "--explorers", "04"],
                         capture_output=True, text=True, timeout=2400, cwd=ROOT)
    if out.returncode == tool.SKIP:
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    n = len(list((ROOT / "notebooks").glob("*.ipynb")))
    assert len(report) == 2 * n + 1  # every notebook in both modes, and notebook 04 run with its sliders
    assert all(Path(shot).exists() for r in report.values() for shot in r["screenshots"])
