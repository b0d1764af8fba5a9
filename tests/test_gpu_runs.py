"""Issue 29's pieces: the code corpus, disjoint windows, the notebook scales and budget, and the ledger check of
the executed GPU notebooks (``notebooks/gpu_runs/check_ledger.py``)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from k3lab.data import (_code_corpus_encode, code_corpus_files, corpus_splits, get_tokenizer, is_code_val_file,
                        window_batches)
from k3lab.experiments.scales import SCALES, Budget, RunLog, claim_verdict, complete_seeds, resolve_scale, seed_major

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "notebooks" / "gpu_runs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_corpus_is_large_ordered_and_split_by_file():
    files = code_corpus_files()
    names = [n for n, _ in files]
    assert names[0].startswith("stdlib/") and len(set(names)) == len(names)
    by_package = {}
    for n in names:
        by_package.setdefault(n.split("/")[0], []).append(n)
    assert all(v == sorted(v) for v in by_package.values())  # sorted within each package
    assert sum(p.stat().st_size for _, p in files) > 20e6  # the stdlib alone is ~30 MB: far beyond the KJV's 4 MB
    assert not any("site-packages" in n or "__pycache__" in n for n in names)
    val = [n for n in names if is_code_val_file(n)]
    assert 0.002 < len(val) / len(names) < 0.03  # about 1% of the files, chosen by name


def test_code_corpus_encoding_separates_files_and_holds_out_val():
    tok = get_tokenizer("byte")
    files = list(code_corpus_files(("stdlib",)))[:40]
    train, val = _code_corpus_encode(tok, files)
    n_val = sum(is_code_val_file(n) for n, _ in files)
    assert (train == tok.eos_id).sum() == len(files) - n_val and (val == tok.eos_id).sum() == n_val
    first = files[0][1].read_bytes() if not is_code_val_file(files[0][0]) else None
    if first is not None:
        assert bytes(train[:len(first)].tolist()) == first  # a byte token is a byte
    with pytest.raises(ValueError, match="corpus="):
        corpus_splits(tok, corpus="wiki")


def test_window_batches_never_repeat_a_window():
    ids = torch.arange(10_000)
    batch = window_batches(ids, batch_size=4, seq_len=15, seed=3)
    starts = []
    for step in range(batch.capacity):
        x, y = batch(step)
        assert x.shape == (4, 15) and torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == torch.long
        starts += x[:, 0].tolist()
    assert len(set(starts)) == len(starts) == batch.capacity * 4  # disjoint windows, each used once
    assert all(s % 16 == 0 for s in starts)
    with pytest.raises(IndexError):
        batch(batch.capacity)
    assert not torch.equal(window_batches(ids, 4, 15, seed=4)(0)[0], batch(0)[0])  # the seed reorders


def test_scales_resolve_and_keep_given_values():
    ns = {"steps": None, "lr": 0.5}
    sizes = resolve_scale("06", "gpu", ns)
    assert ns["steps"] == SCALES["06"]["gpu"]["steps"] and ns["lr"] == 0.5 and sizes["lr"] == 0.5
    for nb in SCALES:
        assert set(SCALES[nb]) == {"cpu", "gpu", "smoke"} and set(SCALES[nb]["gpu"]) == set(SCALES[nb]["cpu"])
        assert SCALES[nb]["cpu"]["budget_s"] is None and SCALES[nb]["cpu"]["cuda_graph"] is False
    with pytest.raises(ValueError, match="scale="):
        resolve_scale("01", "tpu", {})


def test_budget_cuts_whole_seeds(tmp_path):
    budget = Budget(10.0)
    assert budget.allows(reserve=100)  # nothing measured yet
    budget.took(4.0)
    budget.start -= 4.0
    assert budget.allows() and not budget.allows(reserve=1)
    first = Budget(10.0)  # the first run also compiles: once a second run is measured, it no longer predicts
    first.took(6.0)
    first.start -= 6.0
    assert not first.allows()
    first.took(1.0)
    first.start -= 1.0
    assert first.allows(reserve=1) and not first.allows(reserve=2)
    jobs = seed_major(["a", "b"], [0, 1, 2])
    assert jobs[:2] == [("a", 0), ("b", 0)]
    assert complete_seeds({("a", 0), ("b", 0), ("a", 1)}, ["a", "b"], [0, 1, 2]) == [0]
    ok = {"x": {"status": "confirmed"}}
    assert claim_verdict(ok, 3, 3) == "confirmed" and claim_verdict(ok, 2, 3) == "not tested"
    assert claim_verdict({"x": {"status": "contradicted"}, "y": {"status": "confirmed"}}, 3, 3) == "contradicted"
    log = RunLog(tmp_path / "runs.jsonl", "06", "smoke")
    log.add("PreNorm", 0, val_loss=torch.tensor(2.5).item(), acc={1: 0.5})
    assert log.load()[0]["variant"] == "PreNorm" and RunLog(None, "06", "cpu").load() == []


def test_a_resumed_notebook_reuses_runs_logged_at_the_same_sizes_only(tmp_path):
    """run_claims.py --resume: RunLog.finished gives the runs of this notebook and scale logged at equal sizes (the
    time budget aside), the later record winning; their seconds inform the budget's prediction, not its elapsed time;
    an MQAR record reads back with int pair counts and float learning rates."""
    from k3lab.experiments.mqar import mqar_result_from_record
    from k3lab.experiments.scales import run_sizes

    sizes = dict(SCALES["01"]["gpu"])
    log = RunLog(tmp_path / "runs.jsonl", "01", "gpu")
    result = dict(accuracy={8: 0.5, 16: 0.25}, params=10, seconds=30.0, final_loss=1.0, lr=1e-3, sweep={1e-3: 0.4, 3e-3: 0.3})
    log.add("kda", 0, sizes=run_sizes(sizes), **result)
    log.add("kda", 1, sizes=run_sizes(dict(sizes, steps=999)), **result)            # other sizes: not reused
    log.add("mamba2", 0, **result)                                                  # no sizes recorded: not reused
    RunLog(tmp_path / "runs.jsonl", "05", "gpu").add("kda", 2, sizes=run_sizes(sizes), **result)  # another notebook
    log.add("kda", 0, sizes=run_sizes(dict(sizes, budget_s=1.0)), **dict(result, seconds=20.0))  # budget aside: later wins
    done = log.finished(run_sizes(sizes))
    assert list(done) == [("kda", 0)] and done[("kda", 0)]["seconds"] == 20.0
    back = mqar_result_from_record(done[("kda", 0)])
    assert back["accuracy"] == {8: 0.5, 16: 0.25} and back["sweep"] == {1e-3: 0.4, 3e-3: 0.3} and back["reused"]
    budget = Budget(100.0)
    budget.took_earlier(40.0, variant="kda")
    assert budget.allows(reserve=1) and not budget.allows(reserve=2) and budget.durations == []
    assert budget.by_variant == {"kda": 40.0}


def test_notebook_06_reuses_logged_runs_but_trains_the_heatmaps_models(tmp_path):
    """Notebook 06 with a runs file holding seeds 1 and 2 of every variant and seed 0 of PreNorm and 1 block at its
    sizes (made up: every loss 9.0) trains only seed 0 of the two variants whose models feed the heatmaps (full and
    the finest blocks) and judges on all three seeds: PreNorm's mean is the 9.0s alone."""
    import re

    import papermill

    from k3lab.experiments.scales import run_sizes

    runs_file = tmp_path / "06.runs.jsonl"
    log = RunLog(runs_file, "06", "smoke")
    sizes = dict(run_sizes(SCALES["06"]["smoke"]), preset="tiny")
    history = [dict(step=i, loss=9.0) for i in range(1, 4)] + [dict(step=4, loss=9.0, val_loss=9.0)]
    for seed in (0, 1, 2):
        for name in ("PreNorm", "AttnRes 1 block", "AttnRes 4 blocks", "AttnRes full"):
            log.add(name, seed, sizes=sizes, val_loss=9.0, final_loss=9.0, seconds=1.0, history=history)
    out = tmp_path / "06.ipynb"
    papermill.execute_notebook(str(ROOT / "notebooks" / "06_attention_residuals.ipynb"), str(out), kernel_name="python3",
                               parameters=dict(scale="smoke", runs_file=str(runs_file)), progress_bar=False,
                               cwd=str(ROOT / "notebooks"))
    text = out.read_text()
    assert "12 runs of" in text and "tokens; 2 runs in " in text
    assert "10 reused from the runs file; seeds every variant finished: [0, 1, 2]" in text
    prenorm = float(re.search(r"VERDICT AR-3: [^\n]*PreNorm ([\d.]+)±", text).group(1))
    full = float(re.search(r"VERDICT AR-3: [^\n]*AttnRes full ([\d.]+)±", text).group(1))
    assert prenorm == 9.0 and 7.0 < full < 9.0, (prenorm, full)  # full: (seed 0's trained ~5 + 9 + 9) / 3
    assert len(log.load()) == 14  # 12 made up + seed 0's full and 4 blocks, logged with their sizes and histories
    assert all(r["sizes"] == json.loads(json.dumps(sizes)) and r["history"][-1]["step"] == 4 for r in log.load())


def test_budget_predicts_each_variant_by_its_own_runs():
    """Notebook 01 on an H200: KDA runs took 60 s, Mamba2 20 s; the lineage's extra mixers at seed 0 may run only if
    the seeds still to come fit, each at its own speed (the longest run alone would under- or over-reserve)."""
    budget = Budget(200.0)
    for variant, seconds in (("kda", 60.0), ("mamba2", 20.0), ("linear", 18.0)):
        budget.took(seconds, variant=variant)
        budget.start -= seconds                                                         # 98 s elapsed
    assert budget.allows(variant="mamba2", upcoming=["kda"])                            # 98 + 20 + 60 = 178
    assert not budget.allows(variant="mamba2", upcoming=["kda", "kda"])                 # 98 + 20 + 120 = 238
    assert not budget.allows(variant="kda", upcoming=["kda"])                           # 98 + 120 = 218
    assert budget.allows(upcoming=["mamba2"]) and not budget.allows(upcoming=["kda", "kda"])  # unnamed: 20 s


def test_ledger_check_reads_verdicts_and_finds_disagreements(tmp_path):
    check_ledger = _load("check_ledger")
    nb = {"cells": [{"cell_type": "code", "outputs": [{"output_type": "stream", "name": "stdout", "text": [
        "x\n", "VERDICT AR-3: confirmed — 3 seeds\n", "VERDICT NOPE-2: not tested — budget\n", "HEADLINE: h\n"]}]}]}
    assert check_ledger.verdicts(nb) == {"AR-3": ("confirmed", "3 seeds"), "NOPE-2": ("not yet tested", "budget")}
    assert check_ledger.headline(nb) == "h"
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "06_x.ipynb").write_text(json.dumps(nb))
    ledger = tmp_path / "claims.md"
    ledger.write_text("| AR-3 | c | s | e | r (06_x.ipynb) | **not reproduced at this scale** |\n"
                      "| NOPE-2 | c | s | e | r | **not yet tested** |\n")
    problems = check_ledger.check(folder, ledger)
    assert len(problems) == 2 and any("'confirmed' in the notebook" in p for p in problems)
    # "not tested" (too few seeds) sets no status: a row that cites the run keeps its other evidence's status
    ledger.write_text("| AR-3 | c | s | e | r (06_x.ipynb) | **confirmed** |\n"
                      "| NOPE-2 | c | s | e | CPU 3 seeds; GPU 1 seed (06_x.ipynb) | **not reproduced at this scale** |\n")
    assert check_ledger.check(folder, ledger) == []


def test_gpu_run_notebooks_are_never_collected_by_nbval():
    """testpaths holds notebooks/: the executed GPU records must not run on a CPU CI machine (their conftest)."""
    import fnmatch

    spec = importlib.util.spec_from_file_location("gpu_runs_conftest", ROOT / "notebooks" / "gpu_runs" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    for path in list((ROOT / "notebooks" / "gpu_runs").glob("*.ipynb")) + [ROOT / "notebooks" / "gpu_runs" / "x.ipynb"]:
        assert any(fnmatch.fnmatch(path.name, g) for g in conftest.collect_ignore_glob), path


def test_measured_seconds_match_the_runs_files_and_each_notebook_fits_a_call():
    run_claims = _load("run_claims")
    for nb, m in run_claims.MEASURED.items():
        if not m["runs_file"] or not (ROOT / "notebooks" / "gpu_runs" / m["runs_file"]).is_file():
            continue
        records = [json.loads(line) for line in (ROOT / "notebooks" / "gpu_runs" / m["runs_file"]).read_text().splitlines()]
        seconds = [r["seconds"] for r in records]
        assert abs(seconds[0] - m["first"]) < 0.5 and abs(sum(seconds[1:]) / len(seconds[1:]) - m["per_run"]) < 0.5, (
            nb, seconds)
    for nb in run_claims.NOTEBOOKS:
        p = run_claims.plan_seconds(nb, SCALES[nb]["gpu"])
        if nb in run_claims.MULTI_CALL:  # resumed over calls: more than one budget, and says so
            assert p["alone"] > SCALES[nb]["gpu"]["budget_s"] and "more than one call" in run_claims.plan([nb])
        else:
            assert p["alone"] <= SCALES[nb]["gpu"]["budget_s"], (nb, p)  # 3 seeds fit the budget at the measured speed
        assert SCALES[nb]["gpu"]["budget_s"] + run_claims.OVERHEAD_S <= run_claims.CALL_S - 60
    assert run_claims.runs_for_three_seeds("06", SCALES["06"]["cpu"]) == 3 * (2 + 3)  # cpu: 1, 2, 4 blocks
    assert run_claims.runs_for_three_seeds("07", SCALES["07"]["cpu"]) == 12  # MoE pair and SiTU pair x 3 seeds
    assert run_claims.runs_for_three_seeds("07", SCALES["07"]["gpu"]) == 6  # the GPU scale runs §3 only
    assert run_claims.NOTEBOOKS["07"] == "07_latent_moe_and_situ" and "07" in run_claims.plan()
    assert "06" in run_claims.plan()
    assert run_claims.runs_for_three_seeds("16", SCALES["16"]["gpu"]) == 72  # 3 tasks x 4 mixers x 2 widths x 3 seeds


def test_resume_only_for_the_notebooks_that_reuse_logged_runs(tmp_path, capsys):
    """``run_claims.py --resume`` copies the committed runs file in; a notebook that does not look its runs up there
    would train them all again and log each twice (notebook 06 did, 2026-12-06), so it is refused by name."""
    run_claims = _load("run_claims")
    for nb, name in run_claims.NOTEBOOKS.items():
        source = (ROOT / "notebooks" / f"{name}.ipynb").read_text()
        assert ("log.finished(" in source or "log.finished_where(" in source) == (nb in run_claims.RESUMABLE), nb
    with pytest.raises(SystemExit) as exit_:
        run_claims.main(["--only", "07", "--resume", "notebooks/gpu_runs", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "--resume: notebook 07 does not reuse logged runs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_executed_gpu_notebooks_agree_with_the_ledger():
    """The committed executed notebooks under notebooks/gpu_runs/ and docs/claims.md say the same."""
    check_ledger = _load("check_ledger")
    if not check_ledger.executed_notebooks():
        pytest.skip("no executed GPU notebooks committed yet")
    assert check_ledger.check() == []


def test_best_lr_keeps_the_run_with_the_highest_mean_recall():
    from k3lab.experiments.mqar import train_mqar, train_mqar_best_lr

    kw = dict(vocab_size=16, seq_len=16, d_model=8, steps=6, batch_size=4, test_examples=8, chunk_size=8)
    best = train_mqar_best_lr("kda", (1, 2), [1e-3, 3e-2], seed=0, **kw)
    alone = {lr: train_mqar("kda", (1, 2), lr=lr, seed=0, **kw) for lr in (1e-3, 3e-2)}
    means = {lr: sum(r["accuracy"].values()) / 2 for lr, r in alone.items()}
    assert best["sweep"] == means and best["lr"] == max(means, key=means.get)  # ties: the first
    assert best["accuracy"] == alone[best["lr"]]["accuracy"]
    with pytest.raises(ValueError, match="lrs"):
        train_mqar_best_lr("kda", (1,), [], **kw)


FULL_GRID = [(w, s) for w in (64, 96, 128, 192) for s in (0, 1, 2)]


@pytest.mark.parametrize("name,claim,baseline,variant,paper,missing", [
    ("15_scale3", "SCALE-3", "mla", "hybrid", 1.16, []),
    ("15_scale3rope", "SCALE-3", "mla+rope", "hybrid", 1.16, []),
    ("15_ar3", "AR-3", "hybrid", "hybrid+attnres", 1.25, []),
])
def test_scaling_verdicts_are_recomputed_from_the_committed_runs(name, claim, baseline, variant, paper, missing):
    """SCALE-3's and AR-3's ledger rows re-read from their runs: the multiplier and interval fitted again from the
    committed runs file (the notebook's fit, bootstrap seed and draws) equal what the executed GPU notebook printed,
    and the ledger row and notebook 15's text quote that number; the runs present are the grid less the ones named
    as missing."""
    from k3lab.experiments.scaling import fit_runs
    from k3lab.experiments.scaling_fit import PFLOPS_DAY, compute_multiplier, verdict

    folder = ROOT / "notebooks" / "gpu_runs"
    records = [json.loads(line) for line in (folder / f"{name}.runs.jsonl").read_text().splitlines()]
    data = {}
    for v in (baseline, variant):
        data[v] = [dict(r, compute=r["compute"] / PFLOPS_DAY) for r in fit_runs(records, v)]
        expected = [p for p in FULL_GRID if v == baseline or p not in missing]
        assert sorted({(r["size"], r["seed"]) for r in data[v]}) == expected
    M = compute_multiplier(data[baseline], data[variant], n_boot=1000, seed=2)
    line = f"VERDICT {claim}: {verdict(M, paper)} — {M.summary()} (paper {paper}x), 3 seeds x 4 widths"
    assert line in (folder / f"{name}.ipynb").read_text(), line
    quoted = M.summary().split(" at ")[0]  # e.g. "1.82× [1.46, 2.25]"
    assert quoted in (ROOT / "docs" / "claims.md").read_text()
    assert quoted in (ROOT / "notebooks" / "15_scaling_laws.ipynb").read_text()
    assert quoted in (ROOT / "docs" / "scaling_laws.md").read_text()
