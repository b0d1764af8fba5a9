"""The GPU figures the docs and notebook 12 quote for the EP rank with the emulated all-to-all (docs/scaling.md,
section 4g) are the raw rows' (kernels/results/2026-12-07-fit-ep-rank-emulated-exchange-h100.json), recomputed here:
a transcription error fails."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "kernels" / "results" / "2026-12-07-fit-ep-rank-emulated-exchange-h100.json"


def _figures() -> dict:
    rows = json.loads(RAW.read_text())["bench_train"]["rows"]
    fit, fsdp, ep, beside = rows
    assert fit["via"] == "fit" and "ep=" not in fsdp["config"]
    assert "exchange=emulated,overlap=false" in ep["config"]  # the shared expert in line
    assert "exchange=emulated" in beside["config"] and "overlap" not in beside["config"]  # on its side stream: the
    # switch's default when this ran (off by default since, after these rows)
    pct = {k: 100 * fit["ms_per_step"] / r["predicted_ms"] for k, r in (("fsdp", fsdp), ("ep", ep), ("beside", beside))}
    return dict(fit=fit, fsdp=fsdp, ep=ep, beside=beside, pct=pct,
                short=ep["predicted_ms"] - fit["ms_per_step"] / 0.85, slower=beside["ms_per_step"] - ep["ms_per_step"])


def test_the_recorded_ep_figures_are_the_raw_rows():
    f = _figures()
    quoted = [f"{f['pct']['ep']:.1f}%", f"{f['ep']['ms_per_step']:.1f}", f"{f['beside']['ms_per_step']:.1f}",
              f"{f['slower']:.1f} ms", f"{f['short']:.1f} ms"]
    assert quoted == ["82.9%", "193.9", "220.4", "26.5 ms", "4.8 ms"]
    assert f"{f['pct']['fsdp']:.1f}%" == "85.1%" and f"{f['pct']['beside']:.1f}%" == "73.0%"
    assert round(f["ep"]["in_compute_ms"], 1) == 25.7  # the all-to-alls' modelled time, inside the step
    notebook = "".join(json.loads((ROOT / "notebooks" / "12_scaling_up.ipynb").read_text())["cells"][12]["source"])
    docs = [(ROOT / "docs" / "scaling.md").read_text(), (ROOT / "kernels" / "TRAIN_RESULTS.md").read_text()]
    for text, figures in [(d, quoted) for d in docs] + [(notebook, [quoted[0], quoted[1], quoted[3], quoted[4]])]:
        for figure in figures:
            assert figure in text, figure
