"""The one loop (k3lab.train.fit) under a parallel plan against one process: FSDP2 gradients, losses, router
biases, Muon, every switch that runs on CPU, CLI."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.data import batch_iterator
from k3lab.model import IGNORE_INDEX, K3ForCausalLM
from k3lab.moe.router import SigmoidRouter
from k3lab.parallel.dims import ParallelDims, init_groups
from k3lab.parallel.parallelize import ParallelOptions, local_batch, parallelize
from k3lab.parallel.run import main as run_main
from k3lab.parallel.spawn import run_ranks
from k3lab.testing import rel_err
from k3lab.train import TrainConfig, fit

STEPS = 3


def fit_under_plan(cfg, train_cfg, opts, batches, **kw) -> dict:
    """fit under the plan ``opts`` on the model K3ForCausalLM(cfg) built from the run's seed: the summary dict."""
    return fit(lambda: K3ForCausalLM(cfg), batches, train_cfg, parallel=opts, **kw).summary()


def _batches(seed=0):
    ids = torch.randint(0, 4096, (20000,), generator=torch.Generator().manual_seed(seed))
    return batch_iterator(ids, 4, 64, seed=seed)


def _train_cfg(optimizer, balancer_cfg=None):
    okw = {"ns_dtype": "float32"} if optimizer == "muon" else {}
    return TrainConfig(steps=STEPS, lr=1e-2, optimizer=optimizer, optimizer_kwargs=okw, progress=False, device="cpu")


def _biases(model):
    return [m.e_score_correction_bias.detach().clone() for m in model.modules() if isinstance(m, SigmoidRouter)]


def _collectives_smoke(rank, world):
    """The autograd collectives with uneven and zero splits: values and the adjoint (backward) exchanges (the
    reduce-scatter's too: an all-gather)."""
    from k3lab.parallel.collectives import all_gather, all_reduce_sum, all_to_all, reduce_scatter

    x = (torch.arange(3.0) + 10 * rank).requires_grad_()                      # [3] on every rank
    g = all_gather(x)                                                         # [W·3]
    assert g.tolist() == [float(v + 10 * r) for r in range(world) for v in range(3)]
    (g * torch.arange(float(g.numel()))).sum().backward()
    # d/dx_r of Σ_s Σ_i c_i g_i = Σ_s (c[r·3 : r·3+3]) summed over the W ranks' losses
    assert x.grad.tolist() == [float(world * (rank * 3 + i)) for i in range(3)]
    splits = [rank + r for r in range(world)]                                  # rank r sends r+s rows to s
    splits[0] = 0 if rank == 0 else splits[0]                                  # a zero split
    y = torch.full((sum(splits), 2), float(rank), requires_grad=True)
    out_splits = [(0 if (s == 0 and rank == 0) else s + rank) for s in range(world)]
    z = all_to_all(y, out_splits, splits)
    assert z[:, 0].tolist() == [float(s) for s in range(world) for _ in range(out_splits[s])]
    (z * (rank + 1)).sum().backward()
    assert y.grad[:, 0].tolist() == [float(s + 1) for s in range(world) for _ in range(splits[s])]
    v = (torch.arange(2.0 * world) + 100 * rank).requires_grad_()             # [W·2]: block s goes to rank s
    got = reduce_scatter(v)                                                    # [2] Σ over ranks of block `rank`
    assert got.tolist() == [float(sum(2 * rank + i + 100 * s for s in range(world))) for i in range(2)]
    (got * torch.tensor([1.0, 2.0]) * (rank + 1)).sum().backward()
    # d/dv_r of Σ_s (s+1)·(c · y_s): block s of v_r gets rank s's weights (all-gather)
    assert v.grad.tolist() == [float((s + 1) * c) for s in range(world) for c in (1.0, 2.0)]
    w = torch.tensor([float(rank)], requires_grad=True)
    total = all_reduce_sum(w)
    total.sum().backward()
    assert total.item() == sum(range(world)) and w.grad.item() == world
    return True


def _materialize_check(rank, world):
    """Meta-device model, parallelized (EP 2 + FSDP2), filled from rank 0's seeded copy: every weight
    and buffer equals the one-process model's exactly."""
    from k3lab.parallel.materialize import materialize_from_rank0
    from k3lab.parallel.parallelize import expert_parameters

    cfg = ModelConfig.preset("tiny")
    torch.manual_seed(0)
    one = K3ForCausalLM(cfg)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    groups = init_groups(ParallelDims(world, ep=2))
    model, _ = parallelize(model, groups, torch.device("cpu"))
    model.to_empty(device="cpu")
    materialize_from_rank0(model, one if rank == 0 else None, torch.device("cpu"), groups.world)
    ref = dict(one.named_parameters())
    slices = {id(p) for p in expert_parameters(model)}
    for name, p in model.named_parameters():
        if id(p) in slices:  # this rank's home experts
            e = next(m for m in model.modules() if any(q is p for q in m.parameters(recurse=False)))
            want = ref[name][e.expert_offset:e.expert_offset + e.num_local_experts]
        else:
            want = ref[name]
        got = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert torch.equal(got, want), name
    return True


def _edge_units(rank, world):
    """For each model (plain tiny, with MTP, tied) and ParallelOptions.edges: the names of the embedding and head
    modules that are FSDP units of their own, or the refusal's message."""
    from torch.distributed.fsdp import FSDPModule

    groups = init_groups(ParallelDims(world))
    found = {}
    for name, kw in (("plain", {}), ("mtp", dict(num_nextn_predict_layers=1)), ("tied", dict(tie_word_embeddings=True))):
        for edges in ("root", "units", "vocab"):
            try:
                model, _ = parallelize(K3ForCausalLM(ModelConfig.preset("tiny").replace(**kw)), groups,
                                       torch.device("cpu"), edges=edges)
            except ValueError as err:
                found[name, edges] = str(err)
                continue
            found[name, edges] = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)
                                        and n in ("model.embed_tokens", "lm_head"))
    return found


def _fsdp_worker(rank, world, balancers):
    out = {"collectives": _collectives_smoke(rank, world), "materialize": _materialize_check(rank, world),
           "edge_units": _edge_units(rank, world)}
    for balancer in balancers:
        cfg = ModelConfig.preset("tiny").replace(balancer=balancer)
        # gradients of one step: the sharded model against the whole model in this process
        x, y = _batches()(0)
        torch.manual_seed(0)
        ref = K3ForCausalLM(cfg)
        ref(x, labels=y).loss.backward()
        dims = ParallelDims(world)
        torch.manual_seed(0)
        model, _ = parallelize(K3ForCausalLM(cfg), init_groups(dims), torch.device("cpu"))
        xs, ys, shard = local_batch(x, y, dims, rank, int((y != IGNORE_INDEX).sum()),
                                    int((y[:, 1:] != IGNORE_INDEX).sum()))
        model(xs, labels=ys, shard=shard).loss.backward()
        ref_grads = dict(ref.named_parameters())
        res = {"grad_err": max(rel_err(p.grad.full_tensor(), ref_grads[n].grad) for n, p in model.named_parameters()
                               if p.grad is not None)}
        for optimizer in ("adamw", "muon") if balancer == balancers[0] else ("muon",):  # AdamW once: CI time
            metrics = fit_under_plan(cfg, _train_cfg(optimizer), ParallelOptions(), _batches())
            res[optimizer] = metrics["losses"]
        res["loads"] = metrics["expert_loads"]
        out[balancer] = res
    return out


BALANCERS_TESTED = ("quantile_hist", "loss_free", "aux_loss")


@pytest.fixture(scope="module")
def fsdp_runs():
    ranks = run_ranks(_fsdp_worker, 2, BALANCERS_TESTED)
    assert all(r["collectives"] and r["materialize"] for r in ranks)
    return {b: [r[b] for r in ranks] for b in BALANCERS_TESTED}, [r["edge_units"] for r in ranks]


def test_edges_put_the_embedding_and_head_where_they_say(fsdp_runs):
    """ParallelOptions.edges: "root" keeps both in the root unit; "units" makes each a unit of its own (the root's
    unhideable all-gather then holds the norms only), refused by name with MTP (each runs twice a forward: two
    reduce-scatters) or tied weights; "vocab" makes the head a unit (not with MTP) and shards the table by rows
    (tests/test_parallel_vocab.py); the losses and gradients above are taken with "root", the other layouts'
    in tests/test_parallel_vocab.py."""
    for found in fsdp_runs[1]:
        for key in (("plain", "root"), ("mtp", "root"), ("tied", "root"), ("mtp", "vocab")):
            assert found[key] == [], (key, found[key])
        assert found["plain", "units"] == ["lm_head", "model.embed_tokens"] and found["plain", "vocab"] == ["lm_head"]
        assert "ParallelOptions.edges='units'" in found["mtp", "units"] and "MTP" in found["mtp", "units"]
        for edges in ("units", "vocab"):
            assert f"ParallelOptions.edges={edges!r}" in found["tied", edges], found["tied", edges]
            assert "tie_word_embeddings=True" in found["tied", edges]


def _one_process(balancer, optimizer):
    cfg = ModelConfig.preset("tiny").replace(balancer=balancer)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    res = fit(model, _batches(), _train_cfg(optimizer))
    return [r["loss"] for r in res.history], model


def test_fsdp_gradients_equal_one_process(fsdp_runs):
    for balancer, ranks in fsdp_runs[0].items():
        for r in ranks:
            assert r["grad_err"] < 1e-5, (balancer, r["grad_err"])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp_losses_equal_one_process(fsdp_runs, optimizer):
    for balancer, ranks in fsdp_runs[0].items():
        if optimizer not in ranks[0]:
            continue
        ref, _ = _one_process(balancer, optimizer)
        assert ranks[0][optimizer] == ranks[1][optimizer]  # every rank reports the same global loss
        for a, b in zip(ranks[0][optimizer], ref):
            assert abs(a - b) / abs(b) < 1e-6, (balancer, optimizer, ranks[0][optimizer], ref)


def test_balancer_loads_equal_one_process(fsdp_runs):
    """The all-reduced expert loads of the last step are the whole batch's: equal on every rank and
    to one process, for Quantile Balancing and the loss-free balancer (whose biases steer them) and
    the auxiliary loss (whose f is all-reduced in the forward)."""
    for balancer, ranks in fsdp_runs[0].items():
        _, model = _one_process(balancer, "muon")
        ref = [m.balancer.metrics()["load"].tolist() for m in model.modules() if hasattr(m, "balancer")]
        assert ranks[0]["loads"] == ranks[1]["loads"] == ref, balancer


def test_world_size_one_equals_fit():
    cfg = ModelConfig.preset("tiny")
    for optimizer in ("adamw", "muon"):
        ref, _ = _one_process(cfg.balancer, optimizer)
        got = fit_under_plan(cfg, _train_cfg(optimizer), ParallelOptions(), _batches())["losses"]
        assert got == ref, optimizer


def test_world_size_one_fused_loss_equals_fit(monkeypatch):
    """fused_loss is honoured under the plan (the chunked loss runs, and world size 1 equals fit with it)."""
    import k3lab.model

    calls = []
    fused = k3lab.model.linear_cross_entropy
    monkeypatch.setattr(k3lab.model, "linear_cross_entropy", lambda *a, **k: calls.append(1) or fused(*a, **k))
    cfg = ModelConfig.preset("tiny")
    train_cfg = dataclasses.replace(_train_cfg("adamw"), steps=2, fused_loss=True)
    torch.manual_seed(0)
    ref = [r["loss"] for r in fit(K3ForCausalLM(cfg), _batches(), train_cfg).history]
    calls.clear()
    assert fit_under_plan(cfg, train_cfg, ParallelOptions(), _batches())["losses"] == ref
    assert len(calls) == 2  # one chunked loss per step (tiny has no MTP head)


def test_bad_dims_name_the_field():
    for kw, field in ((dict(world_size=4, cp=3), "cp="), (dict(world_size=4, ep=3), "ep="),
                      (dict(world_size=4, dp_shard=3, cp=2), "dp_shard="), (dict(world_size=0), "world_size=")):
        with pytest.raises(ValueError, match=field):
            ParallelDims(**kw)
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="n_routed_experts"):
        ParallelDims(6, ep=3).check_model(cfg, 6, 64)  # tiny has 8 experts
    with pytest.raises(ValueError, match="batch_size"):
        ParallelDims(4).check_model(cfg, 6, 64)
    with pytest.raises(ValueError, match="seq_len"):
        ParallelDims(4, cp=4).check_model(cfg, 8, 66)
    with pytest.raises(ValueError, match="torchrun"):
        init_groups(ParallelDims(2))


def _torchrun(nproc, *args, env=None, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "k3lab.parallel.run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def test_cli_under_torchrun_and_alone(tmp_path):
    common = ["--steps", "2", "--data", "random", "--batch-size", "4", "--seq-len", "32"]
    run = _torchrun(2, *common, "--metrics", str(tmp_path / "m2.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    m2 = json.loads((tmp_path / "m2.json").read_text())
    alone = subprocess.run([sys.executable, "-m", "k3lab.parallel.run", *common, "--metrics", str(tmp_path / "m1.json")],
                           capture_output=True, text=True, timeout=240)
    assert alone.returncode == 0, alone.stderr[-3000:]
    m1 = json.loads((tmp_path / "m1.json").read_text())
    assert (m2["world_size"], m1["world_size"]) == (2, 1)
    assert len(m2["losses"]) == 2 and all(math.isfinite(v) for v in m2["losses"])
    for a, b in zip(m2["losses"], m1["losses"]):
        assert abs(a - b) / b < 1e-6
    with pytest.raises(SystemExit) as exit_:  # alone = world size 1: cp=2 cannot divide it
        run_main(["--cp", "2", "--data", "random"])
    assert exit_.value.code == 2


def test_dead_rank_ends_the_run_with_an_error(tmp_path):
    """Rank 1 exits at step 1; rank 0 is inside a collective. torchrun must end the run, naming
    the failed rank, well within the process-group timeout (no hang)."""
    t0 = time.monotonic()
    run = _torchrun(2, "--steps", "3", "--data", "random", "--batch-size", "4", "--seq-len", "32", "--timeout", "30",
                    env={"K3LAB_FAULT_RANK_STEP": "1:1"}, timeout=120)
    took = time.monotonic() - t0
    assert run.returncode != 0
    assert re.search(r"Root Cause[\s\S]*?rank\s*:\s*1 ", run.stderr), run.stderr[-2000:]
    assert took < 90, took


QK_TAU = 0.07  # below the tiny model's max logits (0.066–0.09 at init): QK-Clip clips


def _e2e_worker(rank, world, ep_kind, layout):
    cfg = ModelConfig.preset("tiny").replace(num_nextn_predict_layers=1, qk_clip_tau=QK_TAU, balancer="quantile_exact")
    opts = ParallelOptions(cp=2, ep=2, ep_kind=ep_kind, cp_layout=layout)
    return fit_under_plan(cfg, _train_cfg("muon"), opts, _batches())


def test_ep_cp_fsdp_end_to_end_equals_one_process():
    """4 ranks = dp_shard 2 × cp 2 (zigzag), experts over ep 2 (MoonEP), MTP on, exact Quantile Balancing
    (every rank's margins all-gathered), Muon with fp32
    Newton–Schulz, QK-Clip active (a low τ: each rank clips from the MAX-reduced logits of the whole
    batch, scaling only its own rows): 3 steps give the one-process losses within 1e-5, and MoonEP computes exactly S·K
    token slots on every EP rank (S = 2 rows × 32 tokens of a rank, K = 2). (Plain EP's parity is
    tested layer by layer in test_parallel_expert.py.)"""
    cfg = ModelConfig.preset("tiny").replace(num_nextn_predict_layers=1, qk_clip_tau=QK_TAU, balancer="quantile_exact")
    torch.manual_seed(0)
    one = K3ForCausalLM(cfg)
    ref = [r["loss"] for r in fit(one, _batches(), _train_cfg("muon")).history]
    clipped = [m.max_logit for m in one.modules() if hasattr(m, "q_b_proj")]
    assert any(torch.isclose(t, torch.tensor(QK_TAU)).any() for t in clipped)  # QK-Clip did clip
    moon = run_ranks(_e2e_worker, 4, "moonep", "zigzag")
    assert all(r["losses"] == moon[0]["losses"] for r in moon)
    for a, b in zip(moon[0]["losses"], ref):
        assert abs(a - b) / b < 1e-5, (moon[0]["losses"], ref)
    S_K = 2 * 32 * cfg.num_experts_per_tok
    assert moon[0]["slots_per_rank"] and all(slots == [S_K, S_K] for slots in moon[0]["slots_per_rank"])


def _resume_worker(rank, world, run_dir, ep, cp, mode):
    """mode "first": the uninterrupted 3 steps, then 2 steps saved to run_dir and resumed in the same
    processes to step 3; mode "resume": this world size resumes run_dir's step-2 checkpoint to step 3."""
    cfg = ModelConfig.preset("tiny")
    opts = ParallelOptions(ep=ep, cp=cp)
    tc = _train_cfg("muon")
    if mode == "resume":
        return fit_under_plan(cfg, tc, opts, _batches(), resume_from=run_dir)["losses"]
    full = fit_under_plan(cfg, tc, opts, _batches())["losses"]
    saved = dataclasses.replace(tc, out_dir=run_dir)
    first = fit_under_plan(cfg, saved, opts, _batches(), stop_at=2)["losses"]
    resumed = fit_under_plan(cfg, saved, opts, _batches(), resume_from=run_dir)["losses"]
    return full, first, resumed


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("dcp-run"))
    full, first, resumed = run_ranks(_resume_worker, 2, run_dir, 2, 1, "first")[0]
    return run_dir, full, first, resumed


def test_dcp_resume_same_world_size_is_exact(saved_run):
    """2 ranks with EP 2 (expert slices saved as DTensors over the (edp, ep) mesh): stopping after step 2
    and resuming gives the uninterrupted run's step 3 exactly (weights, optimizer, RNG, data position)."""
    _, full, first, resumed = saved_run
    assert first == full[:2]
    assert resumed == full  # the history comes back with the checkpoint; step 3 is recomputed
    assert sorted(os.listdir(saved_run[0])) == ["ckpt-00000002", "ckpt-00000003", "latest", "metrics.jsonl"]


@pytest.mark.slow  # ~50 s of spawns; the same-world-size resume (exact) stays in the default suite
def test_dcp_resume_at_other_world_sizes(saved_run):
    """The EP-2 checkpoint resumed by one process (2 → 1: whole experts) and by 4 ranks with EP 4 and CP 2
    (2 → 4: re-sharded experts and FSDP shards): step 3 equals the uninterrupted run within 1e-5."""
    run_dir, full, _, _ = saved_run
    step2 = os.path.join(run_dir, "ckpt-00000002")
    one = fit_under_plan(ModelConfig.preset("tiny"), _train_cfg("muon"), ParallelOptions(), _batches(),
                         resume_from=step2)["losses"]
    four = run_ranks(_resume_worker, 4, step2, 4, 2, "resume")[0]
    for got in (one, four):
        assert got[:2] == full[:2] and abs(got[2] - full[2]) / full[2] < 1e-5, (got, full)
