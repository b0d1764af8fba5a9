"""TrainConfig(cuda_graph=True): forward + backward + norm, then the update, captured as two CUDA graphs (k3lab.cuda_graph).

On the GPU: a graphed run of fit equals the eager run step for step (losses, gradient norms, weights,
the balancer's bias), with compiled sublayers, bf16 weights and the fused master AdamW. Everywhere: the
configurations it cannot run are refused, naming the field.
"""
import dataclasses
from pathlib import Path
import math

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.cuda_graph import GraphedForwardBackward, GraphedOptimizerStep
from k3lab.model import K3ForCausalLM
from k3lab.testing import assert_close
from k3lab.train import TrainConfig, fit

ROOT = Path(__file__).resolve().parents[1]


def batches(vocab, B=2, T=64, device="cpu"):
    gen = torch.Generator().manual_seed(5)
    data = [torch.randint(0, vocab, (B, T + 1), generator=gen) for _ in range(8)]
    return lambda step: (data[step % 8][:, :-1].to(device), data[step % 8][:, 1:].to(device))


def mla_layers(model):
    return [m for m in model.modules() if hasattr(m, "max_logit") and hasattr(m, "q_b_proj")]


def test_refusals_name_the_field():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="TrainConfig.cuda_graph=True needs a CUDA device"):
        fit(K3ForCausalLM(cfg), batches(cfg.vocab_size), TrainConfig(steps=1, device="cpu", cuda_graph=True, progress=False))
    exact = dataclasses.replace(cfg, balancer="quantile_exact")
    with pytest.raises(ValueError, match="cuda_graph=True: the 'quantile_exact' balancer"):
        GraphedForwardBackward(K3ForCausalLM(exact))
    with pytest.raises(ValueError, match="TrainConfig.cuda_graph=True: with param_dtype='bfloat16' needs optimizer='adamw'"):
        TrainConfig(dtype="bfloat16", param_dtype="bfloat16", optimizer="muon", cuda_graph=True)
    with pytest.raises(ValueError, match="TrainConfig.cuda_graph='yes': must be a bool"):
        TrainConfig(cuda_graph="yes")
    model = K3ForCausalLM(cfg)
    with pytest.raises(ValueError, match="GraphedOptimizerStep: needs a MasterWeightOptimizer with the fused AdamW"):
        GraphedOptimizerStep(model, torch.optim.AdamW(model.parameters()), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_mode,qk_clip_tau,master_format", [
    ("none", 100.0, "float32"), ("sublayer", 100.0, "float32"), ("none", 0.02, "float32"), ("none", 0.02, "split")])
def test_graphed_fit_equals_eager_fit(compile_mode, qk_clip_tau, master_format):
    """Six steps (two eager, the captures, three replays of both graphs: forward-backward-norm, then AdamW with
    the balancer and QK-Clip) against six eager steps of the same model: the same losses and grad norms (the
    same kernels; 1e-5 allows atomics' order), weights and router biases after. The cosine schedule changes the
    learning rate every step (the replayed AdamW reads it from the device); ``qk_clip_tau=0.02`` (the fresh model's logits reach about 0.07) makes QK-Clip
    rescale MLA rows every step (taken into the fp32 masters inside the graph); ``master_format="split"``: the
    masters as the bf16 weights' low halves (both runs)."""
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), qk_clip_tau=qk_clip_tau)
    runs = {}
    for graph in (False, True):
        torch.manual_seed(0)
        model = K3ForCausalLM(cfg)
        train = TrainConfig(steps=6, lr=3e-3, device="cuda", dtype="bfloat16", param_dtype="bfloat16",
                            compile=compile_mode, recompute="selective", fused_loss=True, cuda_graph=graph,
                            master_format=master_format, progress=False)
        result = fit(model, batches(cfg.vocab_size, device="cuda"), train)
        runs[graph] = (result, model)
    (eager, m_eager), (graphed, m_graph) = runs[False], runs[True]
    for key in ("loss", "grad_norm"):
        a, b = torch.tensor(eager.column(key)[1]), torch.tensor(graphed.column(key)[1])
        assert_close(key, a, b, 1e-5)
    assert len(set(graphed.column("loss")[1])) == 6  # each replay saw its own batch (eight different ones)
    biases = 0
    for (name, p), q in zip(m_eager.named_parameters(), m_graph.parameters()):
        assert_close(name, p.float(), q.float(), 1e-2)  # bf16 weights: a rounding flip is 1 ulp
        biases += name.endswith("e_score_correction_bias") and bool(p.abs().sum() > 0)  # the balancer moved them
    assert biases > 0
    if qk_clip_tau < 1.0:  # QK-Clip was active: the first batch's logits pass tau, every head ends clipped to it
        torch.manual_seed(0)
        fresh = K3ForCausalLM(cfg).cuda()
        with torch.no_grad():
            fresh(batches(cfg.vocab_size, device="cuda")(0)[0])
        mla = mla_layers(fresh)
        assert mla and max(float(m.max_logit.max()) for m in mla) > qk_clip_tau
        for a, b in zip(mla_layers(m_eager), mla_layers(m_graph), strict=True):
            assert float(b.max_logit.max()) <= qk_clip_tau * (1 + 1e-6)
            assert_close("max_logit", a.max_logit.float(), b.max_logit.float(), 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capture_collects_an_earlier_runs_cycles():
    """A graphed run kept alive only by a reference cycle (an earlier run's model, step and pool) is collected
    before the next capture, not left to pin its memory until Python's next full collection."""
    import gc
    import weakref

    cfg = ModelConfig.preset("tiny")
    tc = TrainConfig(steps=4, device="cuda", dtype="bfloat16", param_dtype="bfloat16", optimizer="adamw",
                     cuda_graph=True, progress=False)
    gc.collect()
    gc.disable()  # no automatic collection between the runs: only the capture's may free the cycle
    try:
        torch.manual_seed(0)
        held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MiB, in a cycle below
        alive = weakref.ref(held)
        cycle = [held]
        cycle.append(cycle)
        del held, cycle
        assert alive() is not None  # only a collection frees it
        model = K3ForCausalLM(cfg).cuda()
        fit(model, batches(cfg.vocab_size, device="cuda"), tc)
        assert alive() is None, "the cycle's 256 MiB survived the capture"
    finally:
        gc.enable()


def _fake_batch(cfg, step):
    """The harness's batch of ``step``: 4 × 64, a few labels ignored, more in some steps (the global label counts
    change between batches)."""
    gen = torch.Generator().manual_seed(step % 4)
    x = torch.randint(0, cfg.vocab_size, (4, 64), generator=gen)
    y = torch.roll(x, -1, 1)
    y[: step % 3, :7] = -100
    return x, y


def _fake_group_fit(cfg, train_cfgs, ep=1, results=False, edges="root"):
    """``fit`` at world size 2 as rank 0 of PyTorch's fake process group (one process, no second GPU: its
    collectives return this rank's own data; ``kernels/predict_scaling.py``'s ``fake_rank`` fills what an older
    torch's fake group leaves empty, such as the scatter that gives the shards their weights), once per
    TrainConfig: FSDP alone, or with ``ep=2`` MoonEP planned on the device with the script's capturable stand-in
    exchange; ``edges``: ``ParallelOptions.edges``. The losses of each run (``results``: fit's results)."""
    import contextlib

    from k3lab.parallel.expert_static import default_exchange
    from k3lab.parallel.parallelize import ParallelOptions
    from k3lab.testing import load_script

    ps = load_script(ROOT / "kernels" / "predict_scaling.py", "predict_scaling")
    parallel = ParallelOptions(timeout=300, ep=ep, edges=edges, **({"ep_plan": "device"} if ep > 1 else {}))
    exchange = default_exchange(ps.fixed_size_exchange) if ep > 1 else contextlib.nullcontext()
    with ps.fake_rank(2, 0, torch.device(train_cfgs[0].device)), exchange:
        out = []
        for train_cfg in train_cfgs:
            torch.manual_seed(0)
            result = fit(lambda: K3ForCausalLM(cfg), lambda step: _fake_batch(cfg, step), train_cfg, parallel=parallel)
            out.append(result if results else result.losses)
        return out


def test_a_shards_label_counts_may_be_device_tensors():
    """A captured sharded step reads the global label counts from 0-d device tensors (k3lab.train refills them before
    each replay): the loss and its gradients equal those with the counts as ints, for the model's loss (main and
    MTP, fused and not)."""
    from k3lab.model import LossShard

    cfg = ModelConfig.preset("tiny").replace(num_nextn_predict_layers=1)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    y = torch.roll(x, -1, 1)
    y[0, :5] = -100
    for fused in (False, True):
        model.fused_loss = fused
        grads = []
        for lm, mtp in ((300, 290), (torch.tensor(300), torch.tensor(290))):
            model.zero_grad(set_to_none=True)
            loss = model(x, labels=y, shard=LossShard(lm, mtp, 2)).loss
            loss.backward()
            grads.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        (a, ga), (b, gb) = grads
        assert torch.equal(a, b) and all(torch.equal(u, v) for u, v in zip(ga, gb)), fused


def test_static_capacity_compiles_the_padded_experts_without_a_break():
    """What GraphedForwardBackward sets on the experts (RoutedExperts.static_capacity): the padded path (fp32) takes
    capacity S instead of reading the largest group back, so torch.compile traces it whole, with no graph break
    whose resumed code could recompile in the middle of a capture (the GPU failure of 2026-12-07: "operation not
    permitted when stream is capturing"), and computes the same rows as the read-back capacity."""
    from k3lab.moe.latent import RoutedExperts

    torch.manual_seed(0)
    experts = RoutedExperts(4, 16, 24, impl="padded")
    x = torch.randn(20, 16)
    counts = torch.tensor([9, 0, 6, 5])
    reference = experts(x, counts)
    experts.static_capacity = True
    assert_close("padded rows, capacity S", reference, experts(x, counts), 1e-6)  # fp32: the same rows
    torch._dynamo.reset()
    explained = torch._dynamo.explain(experts)(x, counts)
    assert explained.graph_break_count == 0, explained.break_reasons
    experts.static_capacity = False
    torch._dynamo.reset()
    assert torch._dynamo.explain(experts)(x, counts).graph_break_count >= 1  # the read-back breaks the graph


def test_fake_group_harness_runs_fit_as_a_sharded_rank():
    """The harness of the GPU test below, on the CPU: fit runs as rank 0 of a 2-rank fake group (FSDP2 wraps the
    model, the heartbeat and the collectives run) and is deterministic run to run. Its first loss is that of the
    weights the fake group gives it: rank 0's shards hold the one-process weights (materialized from rank 0), every
    all-gather returns this rank's shard in both slots, and the all-reduce does not sum, so the rank reports the
    loss of its rows over the global label counts, computed with each parameter's first half repeated. (On torch
    2.11's fake group, which leaves a scatter's output empty, the shards were zeros: the rank reported exactly
    ln V / 2 whatever its rows.)"""
    from k3lab.model import LossShard
    from k3lab.parallel.parallelize import global_label_counts

    cfg = ModelConfig.preset("tiny")
    train_cfg = TrainConfig(steps=3, lr=1e-2, device="cpu", progress=False)
    a, b = _fake_group_fit(cfg, [train_cfg] * 2)
    assert a == b and len(a) == 3
    torch.manual_seed(train_cfg.seed)  # fit draws the one-process initial weights from its seed
    model = K3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # what the fake all-gather of FSDP2's dim-0 shards gives rank 0
            rows, half = p.shape[0], math.ceil(p.shape[0] / 2)
            p.copy_(torch.cat([p[:half], p[:half]])[:rows])
        x, y = _fake_batch(cfg, 0)
        share = model(x[:2], labels=y[:2], shard=LossShard(*global_label_counts(y), 2)).loss  # rank 0: rows 0, 1
    assert a[0] == pytest.approx(float(share), rel=1e-6)
    assert abs(a[0] - 0.5 * math.log(cfg.vocab_size)) > 1e-3  # not the loss of zero weights


@pytest.mark.gpu
def test_sharded_rank_graphed_equals_eager():
    """fit at world size 2 (FSDP alone; rank 0 of the fake group on one GPU), cuda_graph=True against the same rank
    eager, fp32, compiled sublayers: the same losses step by step through the two eager steps, the capture and the
    replays (1e-4 relative), with label counts that change between batches, which the captured loss reads from
    device tensors refilled before each replay (a count baked into the capture would be off by about 6 %)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = ModelConfig.preset("tiny")
    base = dict(steps=7, lr=1e-2, device="cuda", progress=False, compile="sublayer")
    eager, graphed = _fake_group_fit(cfg, [TrainConfig(**base), TrainConfig(**base, cuda_graph=True)])
    assert len(eager) == len(graphed) == 7 and graphed[-1] < graphed[0]
    assert graphed == pytest.approx(eager, rel=1e-4), (eager, graphed)


@pytest.mark.gpu
@pytest.mark.parametrize("ep,edges", [(1, "root"), (2, "root"), (1, "units"), (2, "vocab")])
def test_sharded_rank_graphed_update_equals_eager(ep, edges):
    """A sharded rank's update as a CUDA graph too: fit at world size 2 (rank 0 of the fake group on one GPU) with
    bf16 weights, split masters and bf16 moments, compiled sublayers, cuda_graph=True against the same rank eager:
    the same losses and gradient norms step by step through the eager steps, the captures and the replays (1e-5,
    as the one-GPU graphed test), so the replayed update (the fused AdamW on the local shards, QK-Clip's max
    all-reduce, the balancers' update) is the eager one. ``qk_clip_tau=0.02`` makes QK-Clip rescale every step.
    ``ep=2``: MoonEP planned on the device with the capturable stand-in exchange, its expert slices stepped in the
    same graph. ``edges``: "units", the embedding and head units of their own (the fused loss through the head's
    registered method); "vocab", the table sharded by rows, its lookup's exchanges captured too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = ModelConfig.preset("tiny").replace(qk_clip_tau=0.02)
    base = dict(steps=6, lr=3e-3, device="cuda", dtype="bfloat16", param_dtype="bfloat16", moment_dtype="bfloat16",
                master_format="split", compile="sublayer", fused_loss=True, progress=False)
    eager, graphed = _fake_group_fit(cfg, [TrainConfig(**base), TrainConfig(**base, cuda_graph=True)], ep=ep,
                                     results=True, edges=edges)
    for key in ("loss", "grad_norm"):
        a, b = torch.tensor(eager.column(key)[1]), torch.tensor(graphed.column(key)[1])
        assert_close(key, a, b, 1e-5)
    assert len(set(graphed.column("loss")[1])) == 6 and graphed.losses[-1] < graphed.losses[0]
