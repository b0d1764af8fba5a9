"""SiTU-GLU, the sigmoid router, the balancers (aux loss, loss-free, Quantile Balancing) and LatentMoE
(docs/k3_reference.md §5, §6, §7)."""
import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.moe.latent import DispatchRows, LatentMoE, inverse_permutation, LocalDispatcher, RoutedExperts, merge_expert_weights, split_expert_weights
from k3lab.moe.router import (AuxLossBalancer, LossFreeBalancer, QuantileBalancer, SigmoidRouter, expert_load,
                              make_balancer, max_violation, route_scores)
from k3lab.experiments.moe_simulate import FIG5_SCORES, sharded_histogram_update, simulate_balancing, skewed_scores
from k3lab.moe.situ import SiTUMLP, situ_glu, swiglu
from k3lab.testing import assert_close

FP32 = 1e-5
FP64 = 1e-10
BF16 = 1e-2


# ---------------------------------------------------------------------------------------------- SiTU
def test_situ_formula_matches_equation_in_float64():
    torch.manual_seed(0)
    g, u = torch.randn(1000, dtype=torch.float64) * 10, torch.randn(1000, dtype=torch.float64) * 50
    ref = (4 * torch.tanh(g / 4) * torch.sigmoid(g)) * (25 * torch.tanh(u / 25))
    assert_close("situ", ref, situ_glu(g, u).double(), FP32)  # the nonlinearity runs in fp32 by design


def test_situ_bound_and_bf16_dtype():
    big = torch.tensor([-1e4, -30.0, 0.0, 30.0, 1e4], dtype=torch.bfloat16)
    g, u = torch.meshgrid(big, big, indexing="ij")
    out = situ_glu(g, u)
    assert out.dtype == torch.bfloat16
    assert out.float().abs().max().item() <= 4.0 * 25.0
    assert situ_glu(torch.tensor([1e4]), torch.tensor([1e4])).item() == pytest.approx(100.0, rel=1e-6)


def test_situ_matches_swiglu_near_zero_and_for_large_beta():
    torch.manual_seed(0)
    g, u = torch.randn(256) * 0.05, torch.randn(256) * 0.05
    assert_close("situ~swiglu near 0", swiglu(g, u), situ_glu(g, u), 1e-3)
    g, u = torch.randn(256) * 3, torch.randn(256) * 3
    assert_close("situ(beta->inf)", swiglu(g, u), situ_glu(g, u, beta=1e4, linear_beta=1e4), 1e-5)


def test_situ_mlp_shapes_and_bad_act():
    mlp = SiTUMLP(16, 32, act="swiglu")
    assert mlp(torch.randn(2, 3, 16)).shape == (2, 3, 16)
    assert {n for n, _ in mlp.named_parameters()} == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    with pytest.raises(ValueError, match="act"):
        SiTUMLP(16, 32, act="gelu")


# ---------------------------------------------------------------------------------------------- router
def test_router_weights_use_raw_scores_not_biased():
    torch.manual_seed(0)
    router = SigmoidRouter(8, 6, top_k=2)
    router.e_score_correction_bias.data = torch.tensor([0.0, 5.0, 0.0, 0.0, 5.0, 0.0])  # forces experts 1, 4
    x = torch.randn(5, 8)
    out = router(x)
    assert sorted(out.topk_idx[0].tolist()) == [1, 4]
    s = torch.sigmoid(x @ router.weight.T)
    raw = s.gather(1, out.topk_idx)
    assert_close("weights", raw / raw.sum(-1, keepdim=True), out.topk_weight, FP32)
    third = (s + router.e_score_correction_bias).sort(-1, descending=True).values[:, 2]
    assert_close("cutoff", third, out.cutoff, FP32)


def test_router_bias_never_gets_a_gradient_and_stays_fp32():
    router = SigmoidRouter(8, 6, top_k=2)
    out = router(torch.randn(5, 8))
    AuxLossBalancer(router.e_score_correction_bias, 2).observe(out).backward()
    assert router.weight.grad is not None
    assert router.e_score_correction_bias.grad is None and not router.e_score_correction_bias.requires_grad
    router.to(torch.bfloat16)
    assert router.e_score_correction_bias.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- balancers
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "hist"])
def test_qb_worked_example_4310_to_2222(exact):
    bias = torch.zeros(4)
    qb = QuantileBalancer(bias, top_k=1, exact=exact)
    first = route_scores(FIG5_SCORES, bias, 1)
    assert expert_load(first.topk_idx, 4).tolist() == [4, 3, 1, 0]
    qb.observe(first)
    qb.update()
    assert abs(bias.sum().item()) < 1e-6  # mean-centred
    second = route_scores(FIG5_SCORES, bias, 1)
    assert expert_load(second.topk_idx, 4).tolist() == [2, 2, 2, 2]
    assert second.topk_idx[:, 0].tolist() == [0, 1, 3, 0, 3, 1, 2, 2]
    assert qb.metrics()["max_violation"] == pytest.approx(1.0)  # the observed step: 4 / 2 - 1


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "hist"])
def test_qb_brings_max_violation_below_half_within_5_steps(exact):
    n, k, m = 64, 4, 4096
    bias = torch.zeros(n)
    qb = QuantileBalancer(bias, top_k=k, exact=exact)
    vios = []
    for step in range(6):  # each step: a fresh batch routed with the bias of the previous steps
        route = route_scores(skewed_scores(m, n, step=step), bias, k)
        qb.observe(route)
        qb.update()
        vios.append(qb.metrics()["max_violation"])
    assert vios[0] > 3.0
    assert min(vios[1:]) < 0.5 and vios[-1] < 0.5


def test_histogram_matches_exact_within_one_bin():
    n, k, m = 32, 4, 8192
    bias = torch.randn(n) * 0.1
    route = route_scores(skewed_scores(m, n), bias, k)
    exact, hist = QuantileBalancer(bias, k, exact=True), QuantileBalancer(bias, k, exact=False, num_bins=1000)
    exact.observe(route)
    hist.observe(route)
    _, w = hist.bin_range()
    r = (route.cutoff[:, None] - route.scores).sort(0).values  # [m, n]
    q = m * k // n
    gap = r[q] - r[q - 1]  # between the q-th and (q+1)-th smallest: where any exact quantile may land
    err = (hist.histogram_quantile() - exact.exact_quantile()).abs()
    assert (err <= w + gap + 1e-6).all(), f"max err {err.max():.2e}, bin width {w:.2e}"
    assert err.max().item() < 5 * w


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_histogram_is_exactly_shard_invariant(ranks):
    n, k, m = 64, 4, 4096
    scores = skewed_scores(m, n, step=3)
    single = torch.zeros(n)
    qb = QuantileBalancer(single, k)
    qb.observe(route_scores(scores, single, k))
    qb.update()
    sharded = sharded_histogram_update(scores, torch.zeros(n), k, ranks, micro_batches=2, seed=ranks)
    assert torch.equal(sharded, single)


def test_simulated_balancers_on_skewed_scores():
    vio = {b: simulate_balancing(b, n=32, k=4, m=2048, steps=8) for b in ("none", "loss_free", "quantile_hist")}
    assert vio["none"][-1] > 2.0
    assert vio["quantile_hist"][-1] < 0.5 < vio["loss_free"][-1]  # γ = 1e-3 needs far more than 8 steps


def test_loss_free_moves_bias_toward_balance():
    bias = torch.zeros(4)
    lf = LossFreeBalancer(bias, top_k=1, gamma=1e-3)
    lf.observe(route_scores(FIG5_SCORES, bias, 1))  # loads (4, 3, 1, 0), mean 2
    lf.update()
    assert bias.tolist() == pytest.approx([-1e-3, -1e-3, 1e-3, 1e-3])


def test_max_violation_metric_and_make_balancer_names():
    assert max_violation(torch.tensor([4, 3, 1, 0])) == pytest.approx(1.0)
    assert max_violation(torch.tensor([2, 2, 2, 2])) == 0.0
    router = SigmoidRouter(4, 8, 2)
    for kind in ("quantile_hist", "quantile_exact", "loss_free", "aux_loss", "none"):
        assert make_balancer(kind, router).bias is router.e_score_correction_bias
    with pytest.raises(ValueError, match="balancer"):
        make_balancer("sinkhorn", router)


# ---------------------------------------------------------------------------------------------- LatentMoE
def tiny_cfg(**kw):
    return ModelConfig.preset("tiny").replace(**kw)


def test_dispatch_combine_roundtrip():
    torch.manual_seed(0)
    x = torch.randn(7, 5)
    idx = torch.stack([torch.randperm(4)[:3] for _ in range(7)])  # [N, k=3]
    d = LocalDispatcher()
    xs, plan = d.dispatch(x, idx, 4)
    assert plan.counts.tolist() == torch.bincount(idx.reshape(-1), minlength=4).tolist()
    experts_sorted = idx.reshape(-1)[plan.order]
    assert (experts_sorted.diff() >= 0).all()  # contiguous groups by expert
    u = d.combine(xs, plan, torch.full((7, 3), 1 / 3))
    assert_close("combine(dispatch(x))", x, u, FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_backward_sums_each_tokens_slots(dtype):
    """DispatchRows' atomic-free backward (gather into slot order, float32 sum over k) against autograd
    on ``index_select`` in float64: exact in fp32 up to rounding, one bf16 rounding in bf16."""
    torch.manual_seed(0)
    N, k, E, L = 37, 3, 5, 8
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])  # [N, k]
    x = torch.randn(N, L, dtype=dtype, requires_grad=True)
    _, plan = LocalDispatcher().dispatch(x.detach(), idx, E)  # the CPU takes index_select; CUDA DispatchRows
    xs = DispatchRows.apply(x, plan.order, inverse_permutation(plan.order), k)
    grad = torch.randn(N * k, L, dtype=dtype)
    xs.backward(grad)
    x64 = x.detach().double().requires_grad_()
    ref = x64.index_select(0, plan.order // k)
    ref.backward(grad.double())
    assert torch.equal(xs, ref.detach().to(dtype))  # forward: a copy
    assert_close("dispatch dx", x64.grad, x.grad.double(), FP32 if dtype == torch.float32 else 4e-3)


def test_grouped_expert_path_matches_reference_forward_cpu():
    torch.manual_seed(0)
    experts = RoutedExperts(4, 16, 24)
    x, counts = torch.randn(20, 16), torch.tensor([6, 0, 9, 5])
    assert_close("grouped fwd", experts.forward_reference(x, counts), experts.forward_grouped(x, counts), FP32)


def test_padded_expert_path_matches_reference_forward_and_backward():
    torch.manual_seed(0)
    experts = RoutedExperts(4, 16, 24, act="swiglu")
    x, counts = torch.randn(20, 16, requires_grad=True), torch.tensor([6, 0, 9, 5])
    grads = {}
    for impl in ("reference", "padded"):
        experts.zero_grad()
        x.grad = None
        y = getattr(experts, f"forward_{impl}")(x, counts)
        y.pow(3).sum().backward()
        grads[impl] = [y.detach(), x.grad.clone()] + [p.grad.clone() for p in experts.parameters()]
    for name, ref, got in zip(("y", "dx", "dw1", "dw3", "dw2"), grads["reference"], grads["padded"]):
        assert_close(name, ref, got, FP32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_expert_path_matches_reference_bf16_cuda():
    torch.manual_seed(0)
    experts = RoutedExperts(8, 64, 128).cuda()
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = torch.tensor([40, 0, 64, 8, 16, 56, 32, 40], device="cuda")
    outs = {}
    for impl in ("reference", "grouped"):
        experts.zero_grad()
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = getattr(experts, f"forward_{impl}")(x, counts)
        y.float().square().sum().backward()
        outs[impl] = (y.float(), x.grad.float(), experts.w1.grad.clone(), experts.w2.grad.clone())
    for name, ref, got in zip(("y", "dx", "dw1", "dw2"), outs["reference"], outs["grouped"]):
        assert_close(name, ref, got, BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["latent_moe", "moe"])
def test_moe_auto_impl_matches_reference_under_cuda_autocast(kind):
    torch.manual_seed(0)
    cfg = tiny_cfg(mlp_kind=kind, balancer="none", n_routed_experts=16, num_experts_per_tok=4)
    moe = LatentMoE(cfg).cuda()
    x = torch.randn(4, 32, cfg.hidden_size, device="cuda")
    ys = {}
    for impl in ("reference", "auto"):
        moe.experts.impl = impl
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ys[impl] = moe(x).float()
    assert_close(f"{kind} auto vs reference", ys["reference"], ys["auto"], BF16)


@pytest.mark.parametrize("kind", ["latent_moe", "moe"])
def test_moe_forward_backward_shapes_and_gradient_flow(kind):
    torch.manual_seed(0)
    cfg = tiny_cfg(mlp_kind=kind)
    moe = LatentMoE(cfg).train()
    x = torch.randn(2, 5, cfg.hidden_size, requires_grad=True)
    y = moe(x)
    assert y.shape == x.shape and moe.aux_loss is None
    y.square().mean().backward()
    for name, p in moe.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    names = {n for n, _ in moe.named_parameters()}
    latent = {"routed_expert_down_proj.weight", "routed_expert_norm.weight", "routed_expert_up_proj.weight"}
    assert (latent <= names) == (kind == "latent_moe")
    width = cfg.routed_expert_hidden_size if kind == "latent_moe" else cfg.hidden_size
    assert moe.experts.w1.shape == (cfg.n_routed_experts, cfg.moe_intermediate_size, width)
    assert moe.experts.w2.shape == (cfg.n_routed_experts, width, cfg.moe_intermediate_size)
    assert moe.shared_experts.gate_proj.weight.shape == (cfg.n_shared_experts * cfg.moe_intermediate_size, cfg.hidden_size)


def test_moe_equals_its_equation():
    """y = shared(x) + W↑ RMSNorm(Σ_j p_j E_j(W↓ x)), token by token."""
    torch.manual_seed(0)
    cfg = tiny_cfg(balancer="none")
    moe = LatentMoE(cfg).eval()
    x = torch.randn(1, 3, cfg.hidden_size)
    y = moe(x)[0]
    route = moe.gate(x[0])
    for i in range(3):
        z = moe.routed_expert_down_proj(x[0, i])
        u = 0
        for e, p in zip(route.topk_idx[i].tolist(), route.topk_weight[i]):
            w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
            u = u + p * (w2 @ situ_glu(w1 @ z, w3 @ z))
        ref = moe.shared_experts(x[0, i]) + moe.routed_expert_up_proj(moe.routed_expert_norm(u))
        assert_close(f"token {i}", ref, y[i], FP32)


def test_moe_balancer_observes_in_training_and_updates_after_step():
    torch.manual_seed(0)
    moe = LatentMoE(tiny_cfg(balancer="aux_loss")).train()
    moe(torch.randn(2, 8, 64))
    assert moe.aux_loss is not None and moe.aux_loss.requires_grad
    moe2 = LatentMoE(tiny_cfg(balancer="quantile_hist")).train()
    bias = moe2.gate.e_score_correction_bias
    moe2(torch.randn(2, 8, 64))
    assert torch.count_nonzero(bias) == 0  # no leakage: the step's own routing used the old bias
    moe2.after_optimizer_step()
    assert torch.count_nonzero(bias) > 0 and abs(bias.sum().item()) < 1e-5
    assert moe2.balancer.metrics()["load"].sum().item() == 16 * moe2.top_k
    moe2.eval()
    moe2(torch.randn(2, 8, 64))
    assert moe2.balancer.load.sum().item() == 0  # frozen at inference


def test_hf_expert_names_roundtrip():
    cfg = tiny_cfg()
    moe = LatentMoE(cfg)
    sd = moe.hf_expert_state_dict()
    E = cfg.n_routed_experts
    assert f"experts.{E - 1}.w2.weight" in sd and "experts.w1" not in sd
    assert sd["experts.3.w1.weight"].shape == (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size)
    other = LatentMoE(cfg)
    other.load_hf_expert_state_dict(sd)
    for k, v in moe.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k
    prefixed = {f"model.layers.1.block_sparse_moe.{k}": v for k, v in moe.state_dict().items()}
    assert merge_expert_weights(split_expert_weights(prefixed)).keys() == prefixed.keys()


def test_bad_mlp_kind_raises():
    with pytest.raises(ValueError, match="mlp_kind"):
        LatentMoE(tiny_cfg(mlp_kind="dense"))


def test_update_all_reduces_stats_through_the_hook():
    bias = torch.zeros(4)
    qb = QuantileBalancer(bias, top_k=1)
    seen = []
    qb.all_reduce = lambda t: seen.append((t.dtype, tuple(t.shape)))
    qb.observe(route_scores(FIG5_SCORES, bias, 1))
    qb.update()
    assert seen == [(torch.int64, (4,)), (torch.int64, (4, 1000))]


def test_recorders_follow_training_forwards_only():
    from k3lab.experiments.moe_simulate import MaxViolationRecorder
    from k3lab.moe.situ import GLUOutputRecorder

    torch.manual_seed(0)
    moe = LatentMoE(tiny_cfg()).train()
    vio, glu = MaxViolationRecorder(moe), GLUOutputRecorder(moe, threshold=0.0)
    moe(torch.randn(2, 8, 64))
    moe.after_optimizer_step()
    moe.eval()(torch.randn(2, 8, 64))
    assert list(vio.history) == [""] and len(vio.history[""]) == 1
    assert vio.history[""][0] == pytest.approx(moe.balancer.metrics()["max_violation"])
    stats = glu.history["shared_experts"]
    assert len(stats) == 1 and stats[0]["max_abs"] > 0 and stats[0]["frac_over"] == 1.0
    vio.remove()
    glu.remove()
    moe.train()(torch.randn(2, 8, 64))
    assert len(vio.history[""]) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_shared_expert_beside_the_routed_path_equals_in_line(compiled):
    """``LatentMoE.shared_stream`` (what an expert-parallel run sets on CUDA, ParallelOptions.shared_overlap): the
    shared expert's forward, and so its backward, on a side stream give the in-line module's output and every
    gradient within 1e-6 (fp32), eager (the same kernels) and compiled (the side-stream expert through its own
    compiled call, ``shared_side``, as compile_sublayers sets it: the fork itself runs outside the MoE's graph)."""
    from k3lab.compile import call_module
    from k3lab.testing import eager_and_compiled

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=8, num_experts_per_tok=2)
    assert cfg.n_shared_experts > 0
    side = torch.cuda.Stream()

    def build(stream, shared_side=None):
        def make():
            moe = LatentMoE(cfg).cuda()
            moe.shared_stream, moe.shared_side = stream, shared_side
            return moe
        return make

    def make_input():
        return torch.randn(2, 64, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).cuda()

    pick = 1 if compiled else 0
    in_line = eager_and_compiled(build(None), make_input, "inductor")[pick]
    shared_side = torch.compile(call_module, backend="inductor") if compiled else None
    beside = eager_and_compiled(build(side, shared_side), make_input, "inductor")[pick]
    assert [k for k, g in in_line.items() if g is None] == [k for k, g in beside.items() if g is None]
    for key, want in in_line.items():
        if want is not None:
            assert_close(key, want, beside[key], 1e-6)
