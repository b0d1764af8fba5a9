"""KDA-9's hard regime (notebook 16): the verdict rule, the training harness, the notebook's smoke scale and its
Try this (a second call on the same runs file trains nothing)."""
import json
import math
from pathlib import Path

import pytest
import torch

from k3lab.experiments.scales import SCALES, RunLog, run_sizes
from k3lab.experiments.synthetic import (TASKS, kda9_verdict, mqar_chance, task_batches, task_rows, task_sizes,
                                         train_task, train_task_best_lr)

ROOT = Path(__file__).resolve().parents[1]


def test_kda9_rule():
    lead = {"kda": [0.9, 0.92], "gated_deltanet": [0.5, 0.6], "linear": [0.3, 0.35]}  # KDA beyond the spread
    tie = {"kda": [0.5, 0.7], "gated_deltanet": [0.55, 0.65], "linear": [0.5, 0.6]}    # within it
    behind = {"kda": [0.3, 0.31], "gated_deltanet": [0.8, 0.82], "linear": [0.5, 0.6]}
    assert kda9_verdict({t: {64: lead, 128: tie} for t in TASKS}) == ("confirmed", {t: "KDA best" for t in TASKS})
    overall, per = kda9_verdict({"mqar": {64: lead}, "palindrome": {64: tie}, "stack": {64: lead}})
    assert overall == "not reproduced at this scale" and per["palindrome"] == "no separation"
    # ahead at one width but behind at another: the task goes to the other mixer, and the claim is contradicted
    overall, per = kda9_verdict({"mqar": {64: lead, 128: behind}, "palindrome": {64: lead}, "stack": {64: lead}})
    assert overall == "contradicted" and per["mqar"] == "other best"
    # ahead of one mixer only is not "best"
    half = {"kda": [0.9, 0.92], "gated_deltanet": [0.88, 0.95], "linear": [0.3, 0.35]}
    assert kda9_verdict({"stack": {64: half}})[1] == {"stack": "no separation"}
    with pytest.raises(ValueError, match="need >= 2 seeds"):
        kda9_verdict({"stack": {64: {"kda": [0.9], "linear": [0.3]}}})


def test_task_rows_dispatch_and_refuse():
    for task in TASKS:
        x, y = task_rows(task, 16, 3, 16, 2, seed=0)
        assert x.shape == y.shape == (3, 16) and (y != -100).any()
    with pytest.raises(ValueError, match="task='copy'"):
        task_rows("copy", 16, 3, 16, 2, seed=0)


def test_train_task_is_seeded_and_scores_against_fresh_rows():
    kw = dict(d_model=16, seq_len=12, vocab_size=8, difficulty=0, n_layers=1, steps=6, batch_size=4,
              test_examples=8, chunk_size=4)
    a = train_task("palindrome", "linear", **kw)
    b = train_task("palindrome", "linear", **kw)
    assert a["accuracy"] == b["accuracy"] and a["final_loss"] == b["final_loss"] and 0.0 <= a["accuracy"] <= 1.0
    best = train_task_best_lr("palindrome", "linear", [1e-3, 1e-2], **kw)
    assert best["lr"] in (1e-3, 1e-2) and best["accuracy"] == max(best["sweep"].values())
    with pytest.raises(ValueError, match="lrs"):
        train_task_best_lr("palindrome", "linear", [], **kw)


def test_training_mix_cycles_difficulties_and_one_difficulty_is_the_plain_run():
    kw = dict(batch_size=4, pool_batches=6, seed=3)
    mixed = task_batches("mqar", 32, 16, 3, train_difficulty=[1, 2, 3], **kw)
    for step in range(8):  # batch s has 1, 2, 3 pairs in turn: one scored query per pair and row
        _, y = mixed(step)
        assert ((y != -100).sum(1) == [1, 2, 3][step % 3]).all(), step
    plain, one = task_batches("mqar", 32, 16, 3, **kw), task_batches("mqar", 32, 16, 3, train_difficulty=[3], **kw)
    assert all(torch.equal(plain(s)[0], one(s)[0]) and torch.equal(plain(s)[1], one(s)[1]) for s in range(7))
    assert not torch.equal(plain(0)[0], plain(1)[0]) and torch.equal(plain(0)[0], plain(6)[0])  # 6 batches, cycled
    kw = dict(d_model=16, seq_len=16, vocab_size=32, difficulty=3, n_layers=1, steps=4, batch_size=4, test_examples=8,
              chunk_size=4)
    a, b = train_task("mqar", "linear", **kw), train_task("mqar", "linear", train_difficulty=[3], **kw)
    assert a["final_loss"] == b["final_loss"] and a["accuracy"] == b["accuracy"]
    assert train_task("mqar", "linear", train_difficulty=[1, 3], **kw)["final_loss"] != a["final_loss"]
    with pytest.raises(ValueError, match="palindrome has no difficulty"):
        task_batches("palindrome", 8, 12, 0, train_difficulty=[0, 2], **dict(batch_size=2, pool_batches=2, seed=0))


def test_committed_gpu_runs_mqar_at_chance_and_reuse_per_task():
    """The committed GPU runs (one H100, 2026-12-06 and 07): MQAR trained on 128 pairs alone (21 runs) and on the GPU
    scale's mix of 16 to 128 pairs (24 runs, 3 seeds) sits at the uniform guess among the 4,096 values in every run (the
    sentence in docs/claims.md and notebooks/GPU_RUNS.md). Notebook 16 reuses, per task, the runs logged at its
    current sizes: the mixed MQAR runs and every palindrome and stack run, never the 128-pair-only MQAR runs."""
    path = ROOT / "notebooks" / "gpu_runs" / "16_mixers_hard_regime.runs.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    gpu = SCALES["16"]["gpu"]
    assert mqar_chance(gpu["vocab"]["mqar"]) == 1 / 4096
    mqar_runs = [r for r in records if r["variant"].startswith("mqar|")]
    mixed = [r for r in mqar_runs if (r["sizes"].get("train_difficulty") or {}).get("mqar")]
    alone = [r for r in mqar_runs if r not in mixed]
    assert len(alone) == 21 and len(mixed) == 24
    assert {tuple(r["sizes"]["train_difficulty"]["mqar"]) for r in mixed} == {(16, 32, 64, 128)}
    assert {r["sizes"]["difficulty"]["mqar"] for r in mqar_runs} == {128}  # both tested on 128 pairs
    for r in mqar_runs:
        assert abs(r["final_loss"] - math.log(4096)) < 0.01 and r["accuracy"] <= 2 * mqar_chance(8192), r["variant"]
    log, sizes = RunLog(path, "16", "gpu"), run_sizes(gpu)
    reusable = {t: log.finished_where(lambda got, t=t: task_sizes(got, t) == task_sizes(sizes, t)) for t in TASKS}
    reusable = {t: [v for v, _ in runs if v.startswith(f"{t}|")] for t, runs in reusable.items()}
    assert len(reusable["mqar"]) == len(mixed)
    assert len(reusable["palindrome"]) + len(reusable["stack"]) == len(records) - len(mqar_runs)
    # the training mix is what differs: without it every 128-pair-only run matches its task again
    old = dict(sizes, train_difficulty=None)
    assert all(task_sizes(r["sizes"], r["variant"].split("|")[0]) == task_sizes(old, r["variant"].split("|")[0])
               for r in records if r not in mixed)


def test_gpu_scale_is_zoologys_hard_regime():
    g = SCALES["16"]["gpu"]
    assert g["seq_len"]["mqar"] >= 1024 and g["difficulty"]["mqar"] >= 128 and g["vocab"]["mqar"] >= 2 * 128 + 2
    assert g["difficulty"]["stack"] == 64 and min(g["widths"]) >= 64 and max(g["widths"]) <= 128
    assert g["mixers"][0] == "kda" and {"gated_deltanet", "mamba2", "linear"} <= set(g["mixers"])
    assert len(g["seeds"]) == 3 and g["n_layers"] == 2 and g["num_heads"] == 2
    for task in TASKS:  # the sizes are valid rows
        task_rows(task, g["vocab"][task], 1, g["seq_len"][task], g["difficulty"][task], seed=0)
    mix = g["train_difficulty"]["mqar"]  # MQAR trains on a mix that ends at the tested difficulty
    assert max(mix) == g["difficulty"]["mqar"] and min(mix) < max(mix)
    for d in mix:
        task_rows("mqar", g["vocab"]["mqar"], 1, g["seq_len"]["mqar"], d, seed=0)


def test_smoke_scale_and_try_this_resume(tmp_path):
    """Notebook 16 at the smoke scale through papermill (every GPU mixer, 2 seeds, 2 lrs), then its Try this: the same
    call on the same runs file trains nothing and prints the same table."""
    papermill = pytest.importorskip("papermill")
    runs = tmp_path / "16.runs.jsonl"
    outs = []
    for name in ("a", "b"):
        out = tmp_path / f"16{name}.ipynb"
        papermill.execute_notebook(str(ROOT / "notebooks" / "16_mixers_hard_regime.ipynb"), str(out),
                                   cwd=str(ROOT / "notebooks"), parameters=dict(scale="smoke", runs_file=str(runs)),
                                   progress_bar=False, kernel_name="python3")
        outs.append(out.read_text())
    smoke = SCALES["16"]["smoke"]
    n = len(smoke["tasks"]) * len(smoke["mixers"]) * len(smoke["widths"]) * len(smoke["seeds"])
    assert f"{n} runs trained, 0 reused" in outs[0] and f"0 runs trained, {n} reused" in outs[1]
    assert "VERDICT KDA-9:" in outs[1] and len(runs.read_text().splitlines()) == n

    def table(text):
        nb = json.loads(text)
        return [line for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "stream"
                for line in "".join(o["text"]).splitlines() if line.split()[:1] and line.split()[0] in TASKS and " D = " in line]
    assert table(outs[0]) == table(outs[1]) and len(table(outs[0])) == len(smoke["tasks"]) * len(smoke["widths"])
