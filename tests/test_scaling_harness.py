"""The scaling-law harness (k3lab.experiments.scaling, notebook 15): the family's shape rule, the FLOPs rule against a
count by hand, the plan, a grid that resumes from its runs file (a cut call loses at most the run in flight), the
HYB-2 rule, and the smoke scale's whole pipeline through papermill."""
import json
import math
from pathlib import Path

import pytest

from k3lab.costs import InferenceCosts
from k3lab.data import get_tokenizer
from k3lab.experiments import scaling
from k3lab.experiments.scales import SCALES
from k3lab.experiments.scaling import (EXPERIMENTS, RunsFile, experiment_variants, family_config, flops_per_token,
                                       hyb2_verdict, mla_layers, params_of, plan_runs, run_grid, sweep_runs)

ROOT = Path(__file__).resolve().parents[1]
V = 259  # the byte tokenizer
TINY = dict(depth=4, seq_len=16, batch_size=2, tokens_per_param=0.01, lr0=1e-2, vocab_size=V, min_steps=2)


def test_family_shape_rule():
    for width in (64, 128, 192):
        cfg = family_config("hybrid", width, 8, V, 512)
        assert cfg.hidden_size == width and cfg.num_hidden_layers == 8 and cfg.full_attn_layers == [4, 8]
        assert cfg.num_attention_heads == width // 64 == cfg.kda_heads and cfg.kda_head_dim == 64
        assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (3 * width // 4, width // 2, 32)
    assert family_config("mla", 64, 8, V, 512).full_attn_layers == list(range(1, 9))
    assert family_config("kda7:1", 64, 8, V, 512).full_attn_layers == [8]
    assert family_config("kda1:1", 64, 8, V, 512).full_attn_layers == [2, 4, 6, 8]
    assert family_config("hybrid+attnres", 64, 8, V, 512).residual == "attnres"
    assert family_config("hybrid", 64, 8, V, 512).residual == "prenorm"
    # SCALE-3's control: all-MLA with RoPE on the rope part; every other variant NoPE (K3)
    assert family_config("mla+rope", 64, 8, V, 512).mla_use_nope is False
    assert family_config("mla+rope", 64, 8, V, 512).full_attn_layers == list(range(1, 9))
    assert all(family_config(v, 64, 8, V, 512).mla_use_nope for v in ("mla", "hybrid", "kda1:1", "kda7:1"))
    with pytest.raises(ValueError, match="variant 'gqa'"):
        family_config("gqa", 64, 8, V, 512)
    with pytest.raises(ValueError, match="width=20"):
        family_config("mla", 20, 8, V, 512)
    with pytest.raises(ValueError, match="depth=6"):
        mla_layers(6, 3)


def test_training_flops_counted_by_hand():
    """All-MLA at D = 64, T = 512: C per token = 6 P + 3 · L · 2 H (d_qk + d_v) (T + 1) / 2 (causal pairs), P with the
    LM head; a hybrid replaces the pair term of its KDA layers by 3 · 7 H K V."""
    T = 512
    mla = family_config("mla", 64, 8, V, T)
    P = mla.param_counts()["active"]
    H, dqk, dv = mla.num_attention_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    per_token = 6 * P + 3 * 8 * 2 * H * (dqk + dv) * (T + 1) / 2
    assert flops_per_token(mla, T) == pytest.approx(per_token, rel=1e-9)
    hyb = family_config("hybrid", 64, 8, V, T)
    Ph = hyb.param_counts()["active"]
    per_token_h = 6 * Ph + 3 * 2 * 2 * H * (dqk + dv) * (T + 1) / 2 + 3 * 6 * 7 * hyb.kda_heads * 64 * 64
    assert flops_per_token(hyb, T) == pytest.approx(per_token_h, rel=1e-9)
    assert InferenceCosts(mla).training_flops(10 * T, T) == pytest.approx(10 * T * per_token, rel=1e-9)
    p = params_of(mla)
    assert p["active"] - p["nonemb"] == V * 64


def test_gpu_plan_spans_30x_and_reads_under_4_epochs():
    """The GPU scale's grid: >= 4 sizes spanning >= 30x in training compute, tokens from the stated rule, lr by
    sqrt(D0/D), seed-major order; the largest run reads well under one epoch of the 88 M-token code corpus."""
    g = SCALES["15"]["gpu"]
    shape = dict(depth=g["depth"], seq_len=g["seq_len"], batch_size=g["batch_size"],
                 tokens_per_param=g["tokens_per_param"], lr0=g["lr0"], vocab_size=V, min_steps=g["min_steps"])
    variants, base = experiment_variants("SCALE-3")
    runs = plan_runs(variants, g["widths"], [0, 1], **shape)
    assert base == "mla" and len({r.width for r in runs}) >= 4
    flops = [r.flops for r in runs]
    assert max(flops) / min(flops) >= 30
    for r in runs:
        assert abs(r.tokens - g["tokens_per_param"] * r.params) <= g["batch_size"] * g["seq_len"]
        assert r.lr == pytest.approx(g["lr0"] * math.sqrt(min(g["widths"]) / r.width))
    assert [r.seed for r in runs] == sorted(r.seed for r in runs)  # seed-major
    assert max(r.tokens for r in runs) < 88e6
    sweep = sweep_runs(base, g["widths"], g["lr_sweep"], **shape)
    assert [s.lr / sweep[1].lr for s in sweep] == pytest.approx(g["lr_sweep"]) and {s.kind for s in sweep} == {"sweep"}


def test_experiments_and_their_variants():
    assert experiment_variants("SCALE-3") == (["mla", "hybrid"], "mla")
    assert experiment_variants("AR-3") == (["hybrid", "hybrid+attnres"], "hybrid")
    assert experiment_variants("HYB-2")[0] == ["mla", "kda1:1", "hybrid", "kda7:1"]
    assert experiment_variants("AR-3", ["mla", "mla+attnres"]) == (["mla", "mla+attnres"], "mla")
    assert EXPERIMENTS["SCALE-3"]["paper"] == 1.16 and EXPERIMENTS["AR-3"]["paper"] == 1.25
    with pytest.raises(ValueError, match="experiment='bogus'"):
        experiment_variants("bogus")


def test_hyb2_rule():
    assert hyb2_verdict({"hybrid": (2.0, 1.98, 2.02), "mla": (2.1, 2.0, 2.2), "kda7:1": (2.05, 2.0, 2.1)},
                        "hybrid") == "reproduced"
    assert hyb2_verdict({"hybrid": (2.0, 1.9, 2.1), "mla": (2.05, 2.0, 2.1)}, "hybrid") == "not reproduced at this scale"
    assert hyb2_verdict({"hybrid": (2.2, 2.15, 2.25), "mla": (2.0, 1.95, 2.05)}, "hybrid") == "contradicted"


@pytest.fixture(scope="module")
def data():
    tok = get_tokenizer("byte")
    train, vals = scaling.validation_sets("kjv", tok)
    return train, vals


def _train_kw(data):
    train, vals = data
    return dict(depth=4, seq_len=16, batch_size=2, train_ids=train, val_sets=vals, device="cpu", dtype="float32",
                cuda_graph=False, eval_batches=1, vocab_size=V)


def test_grid_resumes_and_a_cut_call_loses_only_the_run_in_flight(tmp_path, data, monkeypatch):
    runs = plan_runs(["mla", "mla+attnres"], [16, 24, 32], [0], **TINY)
    path = tmp_path / "runs.jsonl"
    real = scaling.train_run
    calls = []

    def cut_at_the_fourth(run, **kw):  # the call's limit kills the 4th run
        calls.append(run.key)
        if len(calls) == 4:
            raise KeyboardInterrupt("device call cut")
        return real(run, **kw)

    monkeypatch.setattr(scaling, "train_run", cut_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        run_grid(runs, RunsFile(path, "smoke"), budget_s=None, run_budget_s=None, **_train_kw(data))
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["key"] for r in kept] == [r.key for r in runs[:3]]
    monkeypatch.setattr(scaling, "train_run", real)
    again = run_grid(runs, RunsFile(path, "smoke"), budget_s=None, run_budget_s=None, **_train_kw(data))
    assert (again["trained"], again["reused"]) == (3, 3) and len(again["records"]) == 6
    third = run_grid(runs, RunsFile(path, "smoke"), budget_s=None, run_budget_s=None, **_train_kw(data))
    assert (third["trained"], third["reused"]) == (0, 6)
    by_key = {r["key"]: r for r in third["records"]}
    assert by_key[runs[0].key]["val_loss"] == kept[0]["val_loss"]
    assert RunsFile(path, "gpu").done() == {}  # another scale's records are not reused
    # a changed shape is another run: nothing reused
    other = plan_runs(["mla"], [16], [0], **dict(TINY, seq_len=8))
    assert other[0].key not in RunsFile(path, "smoke").done()


def test_same_seed_same_run(data):
    """A run is a function of its plan: the same seed trains to the same losses (what makes reuse honest)."""
    run = plan_runs(["mla"], [16], [3], **TINY)[0]
    a = scaling.train_run(run, **_train_kw(data))
    b = scaling.train_run(run, **_train_kw(data))
    assert a["val_loss"] == b["val_loss"] and a["val_losses"] == b["val_losses"] and math.isfinite(a["val_loss"])
    assert set(a["val_losses"]) == {"in-distribution", "out-of-distribution"}
    assert a["flops"] == pytest.approx(flops_per_token(family_config("mla", 16, 4, V, 16), 16) * a["tokens"])


def test_budget_skips_runs_predicted_past_it(tmp_path, data):
    runs = plan_runs(["mla"], [16, 24, 32], [0, 1], **TINY)
    out = run_grid(runs, RunsFile(None, "smoke"), budget_s=None, run_budget_s=1e-9, **_train_kw(data))
    assert out["trained"] == 1 and len(out["skipped"]) == 5  # the first run measures; the rest predict > 1e-9 s


def test_smoke_scale_runs_the_whole_pipeline(tmp_path):
    """Notebook 15 at the smoke scale (the GPU scale's SCALE-3 variants — KDA included — and code path at tiny sizes,
    on a CPU), through papermill: the sweep, the grid, the fits, the multiplier and its VERDICT line."""
    papermill = pytest.importorskip("papermill")
    out = tmp_path / "15.ipynb"
    runs_file = tmp_path / "runs.jsonl"
    papermill.execute_notebook(str(ROOT / "notebooks" / "15_scaling_laws.ipynb"), str(out), cwd=str(ROOT / "notebooks"),
                               parameters=dict(scale="smoke", experiment="SCALE-3", runs_file=str(runs_file),
                                               n_boot=200),
                               progress_bar=False, kernel_name="python3")
    text = out.read_text()
    assert "VERDICT SCALE-3:" in text and "hybrid vs mla" in text
    records = [json.loads(line) for line in runs_file.read_text().splitlines()]
    smoke = SCALES["15"]["smoke"]
    assert len([r for r in records if r["kind"] == "grid"]) == 2 * len(smoke["widths"]) * 3  # 3 seeds
    assert {r["variant"] for r in records} == {"mla", "hybrid"}
    # Try-this #2: the same call again on the same runs file trains nothing and reuses every run — here through
    # notebooks/gpu_runs/run_scaling.py, the GPU calls' wrapper: --resume copies the runs file, a record cell goes first
    run_scaling = _load_script("run_scaling")
    resume = tmp_path / "resume"
    resume.mkdir()
    (resume / "15_scale3.runs.jsonl").write_text(runs_file.read_text())
    assert run_scaling.main(["--experiment", "SCALE-3", "--smoke", "--out", str(tmp_path / "again"), "--resume",
                             str(resume), "--commit", "abc1234", "--budget", "600"]) == 0
    again = json.loads((tmp_path / "again" / "15_scale3.ipynb").read_text())
    first = "".join(again["cells"][0]["source"])
    assert "run_scaling.py" in first and "| commit | abc1234 |" in first and "experiment='SCALE-3'" in first
    grid = len(records) - len(smoke["lr_sweep"])
    text = json.dumps(again)
    assert f"0 runs trained, {grid} reused from the runs file" in text and "VERDICT SCALE-3:" in text
    assert len((tmp_path / "again" / "15_scale3.runs.jsonl").read_text().splitlines()) == len(records)


def _load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "notebooks" / "gpu_runs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_try_this_fewer_tokens_per_param():
    """Notebook 15's Try-this #1: tokens_per_param 0.15 -> 0.05 at the cpu scale: D = 48 trains 13 steps instead of
    38, the three smaller widths the floor of min_steps = 10 (D = 32 from 18), the compute span 21x -> 7x."""
    g = SCALES["15"]["cpu"]

    def plan(tpp):
        runs = plan_runs(g["variants"], g["widths"], [0], depth=g["depth"], seq_len=g["seq_len"],
                         batch_size=g["batch_size"], tokens_per_param=tpp, lr0=g["lr0"], vocab_size=V,
                         min_steps=g["min_steps"])
        flops = [r.flops for r in runs]
        return {r.width: r.steps for r in runs if r.variant == "mla"}, round(max(flops) / min(flops))

    assert g["tokens_per_param"] == 0.15 and g["min_steps"] == 10
    assert plan(0.15) == ({16: 10, 24: 10, 32: 18, 48: 38}, 21)
    assert plan(0.05) == ({16: 10, 24: 10, 32: 10, 48: 13}, 7)


def test_fit_graphed_retries_eagerly_and_returns_a_model_without_gradients(monkeypatch):
    """A failed capture is remembered and the run restarts eagerly from the same seed; the returned model holds no
    gradients (a graphed run's live in the graph's memory pool, which a kept model would pin)."""
    import torch
    from torch import nn

    import k3lab.train
    from k3lab.experiments import scales
    from k3lab.train import TrainConfig

    seen = []

    def fake_fit(model, batches, cfg, val_batches=None):
        seen.append((cfg.cuda_graph, model.weight.detach().clone()))
        model.weight.grad = torch.ones_like(model.weight)  # what a run leaves behind
        if cfg.cuda_graph:
            raise RuntimeError("capture invalidated")
        return "result"

    monkeypatch.setattr(k3lab.train, "fit", fake_fit)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(scales, "GRAPH_FAILURES", {})
    torch.manual_seed(3)
    model, result = scales.fit_graphed(lambda: nn.Linear(4, 4), None, TrainConfig(steps=1), variant="v")
    assert result == "result" and model.weight.grad is None
    assert "v" not in scales.GRAPH_FAILURES  # cuda_graph=False: one eager run
    torch.manual_seed(3)
    seen.clear()
    model, result = scales.fit_graphed(lambda: nn.Linear(4, 4), None,
                                       TrainConfig(steps=1, cuda_graph=True, device="cpu"),
                                       variant="v")
    assert [graphed for graphed, _ in seen] == [True, False] and torch.equal(seen[0][1], seen[1][1])  # same seed
    assert "capture invalidated" in scales.GRAPH_FAILURES["v"] and result == "result" and model.weight.grad is None
