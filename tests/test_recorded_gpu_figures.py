"""The GPU figures the docs and notebook 12 quote for the EP rank with the emulated all-to-all (docs/scaling.md,
section 4g) are the raw rows' (kernels/results/2026-12-07-fit-ep-rank-emulated-exchange-h100.json), recomputed here:
a transcription error fails."""
import json
import sys
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


PLACED = ROOT / "kernels" / "results" / "2026-12-07-ep-rank-placed-exchange-h100.json"


def test_the_recorded_placed_exchange_figures_are_the_raw_rows():
    """docs/scaling.md section 4h, kernels/TRAIN_RESULTS.md and notebook 12 quote the EP rank whose exchange places
    the rows (two calls): its share of ``fit``'s best step, its margin under the 85% line, and what placing saved
    against ``placed=false`` in the same call. Recomputed from the raw rows."""
    raw = json.loads(PLACED.read_text())
    got = {}
    for call in ("first", "repeat"):
        rows = raw[call]["rows"]
        fit = next(r for r in rows if r["via"] == "fit")
        placed = next(r for r in rows if "exchange=emulated," in r["config"] and "placed" not in r["config"]
                      and "chunks" not in r["config"])
        unplaced = next(r for r in rows if "placed=false" in r["config"])
        got[call] = dict(pct=f"{100 * fit['ms_per_step'] / placed['predicted_ms']:.1f}%",
                         ms=f"{placed['ms_per_step']:.1f}",
                         margin=f"{fit['ms_per_step'] / 0.85 - placed['predicted_ms']:.1f}",
                         saved=f"{unplaced['ms_per_step'] - placed['ms_per_step']:.1f}",
                         unplaced=f"{100 * fit['ms_per_step'] / unplaced['predicted_ms']:.1f}%")
    chunks = next(r for r in raw["first"]["rows"] if "chunks=2" in r["config"])
    fit = raw["first"]["rows"][0]
    assert fit["via"] == "fit" and f"{100 * fit['ms_per_step'] / chunks['predicted_ms']:.1f}%" == "84.7%"
    first, repeat = got["first"], got["repeat"]
    assert (first["pct"], repeat["pct"], first["ms"], repeat["ms"]) == ("85.2%", "85.1%", "189.6", "190.3")
    assert (first["margin"], repeat["margin"], first["saved"], repeat["saved"]) == ("0.5", "0.3", "4.0", "3.4")
    assert (first["unplaced"], repeat["unplaced"]) == ("83.5%", "83.6%")
    docs = (ROOT / "docs" / "scaling.md").read_text()
    results = (ROOT / "kernels" / "TRAIN_RESULTS.md").read_text()
    notebook = "".join(json.loads((ROOT / "notebooks" / "12_scaling_up.ipynb").read_text())["cells"][12]["source"])
    for text in (docs, results, notebook):
        for figure in ("85.2%", "85.1%", "189.6", "190.3"):
            assert figure in text, figure
    assert f"predicts {first['pct']} and {repeat['pct']}" in " ".join(docs.split())
    assert "0.5 and 0.3 ms under the 85% line" in docs and "saves 4.0 and 3.4 ms a step" in docs
    assert "0.3–0.5 ms under the 85% line" in notebook and "saves 4.0 and 3.4 ms a step" in results


OVERLAP = ROOT / "kernels" / "results" / "2026-12-07-ep-shared-overlap-h200.json"


def test_the_recorded_side_stream_figures_are_the_raw_rows():
    """docs/scaling.md section 4i, kernels/TRAIN_RESULTS.md, notebook 12 and the fast profile's docstring quote the
    H200 calls: the EP rank with the shared expert on a side stream against in line, each as a share of ``fit``'s
    best step in the same call, and the time the side stream saved. Recomputed from the raw rows."""
    raw = json.loads(OVERLAP.read_text())
    assert raw["device"] == "NVIDIA H200"
    got = {}
    for call in ("first", "repeat"):
        rows = raw[call]["rows"]
        fit = next(r for r in rows if r["via"] == "fit")
        side = next(r for r in rows if "overlap=true," in r["config"] and "chunks" not in r["config"])
        line = next(r for r in rows if r["via"] != "fit" and "overlap" not in r["config"])
        chunks = next(r for r in rows if "chunks=2" in r["config"])
        pct = lambda r: f"{100 * fit['ms_per_step'] / r['predicted_ms']:.1f}%"  # noqa: E731
        got[call] = dict(side=pct(side), line=pct(line), chunks=pct(chunks), side_ms=f"{side['ms_per_step']:.1f}",
                         line_ms=f"{line['ms_per_step']:.1f}", saved=f"{line['ms_per_step'] - side['ms_per_step']:.1f}")
    first, repeat = got["first"], got["repeat"]
    assert (first["side"], repeat["side"], first["line"], repeat["line"]) == ("83.9%", "85.3%", "74.7%", "78.8%")
    assert (first["side_ms"], repeat["side_ms"], first["line_ms"], repeat["line_ms"]) == ("172.8", "172.2", "194.1",
                                                                                          "186.6")
    assert (first["saved"], repeat["saved"], first["chunks"], repeat["chunks"]) == ("21.4", "14.5", "85.2%", "84.2%")
    docs = " ".join((ROOT / "docs" / "scaling.md").read_text().split())
    results = (ROOT / "kernels" / "TRAIN_RESULTS.md").read_text()
    notebook = " ".join("".join(json.loads((ROOT / "notebooks" / "12_scaling_up.ipynb").read_text())["cells"][12]
                                ["source"]).split())
    train = " ".join((ROOT / "k3lab" / "train.py").read_text().split())
    assert "saves 21.4 and 14.5 ms a step" in docs and "**83.9% and 85.3%**" in docs
    assert "saves 21.4 and 14.5 ms a step" in results and "83.9% and 85.3% with the side stream" in results
    assert "saves 21.4 and 14.5 ms a step" in notebook and "**83.9% and 85.3%**" in notebook
    assert "took 172.8 and 172.2 ms a step against 194.1 and 186.6 in line" in train


K3SLICE = ROOT / "kernels" / "results" / "2026-12-07-k3slice-static-ep-h200.json"
LENDING = ROOT / "kernels" / "results" / "2026-12-07-moonep-lending-k3-cpu.json"


def test_the_recorded_k3_slice_figures_are_the_raw_rows():
    """docs/scaling.md section 4j: the K3 slice's first graphed EP rank (its share, its all-to-all bytes and the
    weights' part of them), the lending counts at K3's shape, and what bf16 weights at lent=8 predict from the
    measured compute, each recomputed from the raw rows with the script's own step model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("predict_scaling", ROOT / "kernels" / "predict_scaling.py")
    ps = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("predict_scaling", ps)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules["predict_scaling"])
    ps = sys.modules["predict_scaling"]
    base, rank = json.loads(K3SLICE.read_text())["before"]["rows"]
    assert base["world"] == 1 and rank["world"] == 8 and rank["ep"] == 8
    docs = " ".join((ROOT / "docs" / "scaling.md").read_text().split())
    a2a = next(c for c in rank["comm"] if c["kind"] == "all_to_all")
    one = 3 * 3072 * 3584                                                  # one expert's w1, w3, w2 values
    weights = 2 * 112 * one * 4                                            # the bound, fp32, forward and backward
    rows = a2a["bytes"] - weights
    assert rows == 4 * 8192 * 16 * 3584 * 2                                # the rows: S·K × L bf16, four times
    assert f"{a2a['bytes'] / 1e9:.2f} GB" == "33.35 GB" and f"{100 * weights / a2a['bytes']:.0f}%" == "89%"
    assert f"{100 * rank['scaling_efficiency']:.1f}%" == "72.5%" and "**72.5%**" in docs
    comm = [dict(c, bytes=rows + 2 * 8 * one * 2) if c["kind"] == "all_to_all" else c for c in rank["comm"]]
    link = ps.LINKS[rank["link"]]
    after = ps.predict_step(rank["compute_ms"] / 1e3, comm, link, rank["fsdp_edges"])
    assert f"{sum(c['bytes'] for c in comm if c['kind'] == 'all_to_all') / 1e9:.2f}" == "4.82"
    assert f"{1e3 * after['blocking']:.1f}" == "12.0" and f"{1e3 * after['realistic']:.1f}" == "578.8"
    assert f"{100 * base['compute_ms'] / (1e3 * after['realistic']):.1f}%" == "80.9%"
    no_edges = rank["compute_ms"] + 1e3 * after["blocking"]
    assert f"{100 * base['compute_ms'] / no_edges:.1f}%" == "85.9%"
    for figure in ("80.9%", "85.9%", "from 33.35 to 4.82 GB", "from 79.4 to 12.0 ms", "578.8 ms"):
        assert figure in docs, figure
    runs = json.loads(LENDING.read_text())["runs"]
    assert (max(max(r["borrowed"]) for r in runs), max(max(r["lent"]) for r in runs)) == (4, 8)
    assert all(r["bound"] == 112 for r in runs) and "At most 4 borrowed and 8 lent, against the bound of 112" in docs
    notebook = " ".join("".join(json.loads((ROOT / "notebooks" / "12_scaling_up.ipynb").read_text())["cells"][12]
                                ["source"]).split())
    for figure in ("**72.5%**", "89% of its all-to-all bytes", "borrowed at most 4 experts and a home lent at most 8",
                   "**80.9%**"):
        assert figure in notebook, figure


def test_the_predicted_edge_rows_are_the_arithmetic_on_the_raw_rows():
    """docs/scaling.md section 4k's predicted table: the section 4j rank's compute and counted bytes (bf16 replica
    weights at lent=8), with the embedding's and head's gathers and reductions moved as each layout moves them, through
    the script's own step model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("predict_scaling", ROOT / "kernels" / "predict_scaling.py")
    sys.modules.setdefault("predict_scaling", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(sys.modules["predict_scaling"])
    ps = sys.modules["predict_scaling"]
    base, rank = json.loads(K3SLICE.read_text())["before"]["rows"]
    V, D, R, N = 163_840, 7_168, 8, 8_192
    bf16, fp32 = V * D * 2, V * D * 4                                      # one table gathered, one reduced
    one = 3 * 3072 * 3584
    rows = 4 * N * 16 * 3584 * 2
    comm = [dict(c, bytes=rows + 2 * 8 * one * 2) if c["kind"] == "all_to_all" else c for c in rank["comm"]]
    (ag,), (rs,) = [[e for e in rank["fsdp_edges"] if e["kind"] == k] for k in ("all_gather", "reduce_scatter")]
    root_ag, root_rs = ag["bytes"] - 2 * bf16, rs["bytes"] - 2 * fp32      # the root's own: norms, AttnRes queries
    assert root_ag == 716_800
    edge = lambda kind, b: dict(kind=kind, n=R, bytes=b)  # noqa: E731
    apart = [edge("all_gather", root_ag), edge("all_gather", bf16), edge("reduce_scatter", root_rs),
             edge("reduce_scatter", fp32)]
    vocab_comm = [dict(c, bytes=c["bytes"] - (bf16 if c["kind"] == "all_gather" else fp32))
                  if c["source"] == "fsdp" else c for c in comm]
    vocab_comm += [dict(source="other", kind="all_gather", n=R, bytes=R * N * 8 + R * N * D * 2, calls=2),
                   dict(source="other", kind="reduce_scatter", n=R, bytes=R * N * D * 2, calls=1)]
    link, c = ps.LINKS[rank["link"]], rank["compute_ms"] / 1e3
    docs = " ".join((ROOT / "docs" / "scaling.md").read_text().split())
    for label, (cm, edges) in {"`edges=units`": (comm, apart),
                               "`edges=vocab`":
                                   (vocab_comm, [edge("all_gather", root_ag), edge("reduce_scatter", root_rs)])}.items():
        p = {k: 1e3 * v for k, v in ps.predict_step(c, cm, link, edges).items()}
        line = (f"| {label} | {p['fsdp_exposed']:.1f} | {p['blocking']:.1f} | {p['realistic']:.1f} "
                f"| {100 * base['compute_ms'] / p['realistic']:.1f}% |")
        assert line in docs, line
        if label == "`edges=vocab`":
            assert f"{100 * base['compute_ms'] / p['realistic']:.1f}" == "85.2"
    notebook = " ".join("".join(json.loads((ROOT / "notebooks" / "12_scaling_up.ipynb").read_text())["cells"][12]
                                ["source"]).split())
    assert "**83.3%** with both as FSDP units of their own and **85.2%** with the head a unit" in notebook
    assert "1.88 GB against 7.05 GB (3.75× fewer)" in docs and f"{2 * R * N * D * 2 / 1e9:.2f}" == "1.88"
    assert f"{V * D * 6 / 1e9:.2f}" == "7.05" and f"{V * D * 6 / (2 * R * N * D * 2):.2f}" == "3.75"


K3_H100 = ROOT / "kernels" / "results" / "2026-12-07-k3slice-vocab4096-h100.json"


def test_the_k3_slice_h100_figures_are_the_raw_rows():
    """docs/scaling.md section 4l and kernels/TRAIN_RESULTS.md quote the K3 slice at ``vocab=4096`` on one H100
    (two calls): the baseline's and the rank's times, the share per GPU, the counted all-to-all and the gap in the
    forward and backward. Recomputed from the raw rows; the full-vocabulary rows are the out-of-memory ones."""
    raw = json.loads(K3_H100.read_text())
    assert [r.get("error") for r in raw["full_vocab_oom"]["rows"]] == ["OOM", "OOM"]
    assert [r.get("error") for r in raw["vocab4096_default_allocator_oom"]["rows"]] == [None, "OOM"]
    got = {}
    for call in ("vocab4096", "vocab4096_profiled"):
        base, rank = raw[call]["rows"]
        assert base["world"] == 1 and rank["world"] == 8
        assert "lent=8" in rank["config"] and "vocab=4096" in rank["config"]
        realistic = rank["predicted"]["nvlink8"]["realistic"]
        got[call] = dict(base=f"{base['compute_ms']:.1f}", rank=f"{rank['compute_ms']:.1f}",
                         realistic=f"{realistic:.1f}", share=f"{100 * base['compute_ms'] / realistic:.1f}%",
                         gap=rank["fwd_bwd_ms"] - base["fwd_bwd_ms"], a2a=sum(c["bytes"] for c in rank["comm"]
                                                                           if c["kind"] == "all_to_all") / 1e9)
    first, again = got["vocab4096"], got["vocab4096_profiled"]
    assert (first["base"], first["rank"], first["realistic"], first["share"]) == ("277.6", "340.4", "353.3", "78.6%")
    assert (again["base"], again["rank"], again["realistic"], again["share"]) == ("277.5", "339.6", "352.5", "78.7%")
    assert (round(first["gap"]), round(again["gap"])) == (71, 70) and round(first["a2a"], 2) == 4.82
    docs = " ".join((ROOT / "docs" / "scaling.md").read_text().split())
    results = " ".join((ROOT / "kernels" / "TRAIN_RESULTS.md").read_text().split())
    for text in (docs, results):
        for figure in ("277.6", "340.4", "353.3", "78.6%", "4.82 GB", "70"):
            assert figure in text, figure
    assert "277.5 / 339.6" in docs and "352.5" in docs and "78.7%" in docs and "71 and 70 ms (28%) more" in docs
    assert "70–71 ms longer than the one GPU's" in results
    notebook = " ".join("".join(json.loads((ROOT / "notebooks" / "12_scaling_up.ipynb").read_text())["cells"][12]
                                ["source"]).split())
    assert f"measured **{first['share']}** of its one-GPU step per GPU" in notebook
    assert "forward and backward 70–71 ms longer than the one GPU's" in notebook
