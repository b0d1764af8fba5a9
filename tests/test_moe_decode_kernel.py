"""The fused small-batch routed-expert kernel (k3lab.kernels.moe_decode) against its plain-torch reference, the
reference against the sorted path (dispatch -> RoutedExperts.forward_reference -> combine), bad inputs, LatentMoE's
choice of path (:func:`k3lab.moe.latent.use_decode_kernel`); on the GPU a LatentMoE of ``small``'s MoE widths
against the sorted path, and a CUDA-graph capture.

On CPU the kernels run under Triton's interpreter, which must be on before triton is imported:
``test_interpreter_suite`` re-runs this file in a fresh process with ``TRITON_INTERPRET=1`` (the pattern of
tests/test_moe_rows.py), where the kernel tests run at tiny shapes (E = 6, I = 16, L = 8).

Tolerances (relative error ‖got − ref‖ / ‖ref‖), the kernel and the sorted path rounding at the same points:

* float32: the same float32 products summed in another order (and tanh from exp in the kernel): 1e-5;
* bf16: gate, up, h and each expert's output rounded to bf16 in both; a float32 sum in another order can move a
  value across a bf16 rounding boundary (2⁻⁸ relative for that element): 1e-2.
"""

import types

import pytest
import torch

from k3lab.config import HIDDEN_ACTS, ModelConfig
from k3lab.kernels import moe_decode
from k3lab.kernels.moe_decode import MAX_SLOTS, routed_experts_decode, routed_experts_decode_reference
from k3lab.moe import latent
from k3lab.moe.latent import DECODE_MAX_SLOTS, LatentMoE, LocalDispatcher, RoutedExperts, use_decode_kernel
from k3lab.testing import INTERPRETED, KERNEL_DEVICE, KERNELS_RUN_HERE, assert_close, run_interpreter_suite

DEVICE = KERNEL_DEVICE
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # by compute dtype (module docstring)
E, I, L = 6, 16, 8  # the interpreter's tiny experts
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="runs in test_interpreter_suite's subprocess")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def kernel_switched_on(monkeypatch):
    """The kernel is on by default (``k3lab.kernels.moe_decode.ENABLED``); these tests set it on regardless."""
    from k3lab.kernels import moe_decode as module

    monkeypatch.setattr(module, "ENABLED", True)


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run directly here")
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreter_suite(__file__)


def inputs(N, k, dtype=torch.float32, w_dtype=None, E=E, I=I, L=L, seed=0, idx=None, device=DEVICE):
    """z [N, L], topk_idx [N, k] (k distinct experts a token, repeated across tokens), p [N, k] float32, and
    w1, w3 [E, I, L], w2 [E, L, I] scaled so that gate and up reach SiTU's non-linear range."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=gen)
    if idx is None:
        idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])  # [N, k]
    p = torch.rand(N, k, generator=gen) + 0.1
    w1, w3 = (torch.randn(E, I, L, generator=gen) * 2 / L ** 0.5 for _ in range(2))
    w2 = torch.randn(E, L, I, generator=gen) / I ** 0.5
    wd = w_dtype or dtype
    return (z.to(device, dtype), idx.to(device), p.to(device), w1.to(device, wd), w3.to(device, wd),
            w2.to(device, wd))


# ----------------------------------------------------------------------------------------------
# the reference against the sorted path
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", ["situ", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_sorted_path(act, dtype):
    """routed_experts_decode_reference against LocalDispatcher.dispatch -> RoutedExperts.forward_reference ->
    combine on the same weights (torch on CPU): float32 to 1e-6, bf16 (the same rounding points) to 1e-2."""
    z, idx, p, w1, w3, w2 = inputs(5, 3, dtype, E=6, I=24, L=16, seed=1, device="cpu")  # 15 slots on 6 experts
    experts = RoutedExperts(6, 16, 24, act=act, impl="reference").to(dtype)
    with torch.no_grad():
        for param, w in zip((experts.w1, experts.w3, experts.w2), (w1, w3, w2)):
            param.copy_(w)
        d = LocalDispatcher("torch")
        z_sorted, plan = d.dispatch(z, idx, 6)
        want = d.combine(experts.forward_reference(z_sorted, plan.counts), plan, p)  # [N, L] fp32
        got = routed_experts_decode_reference(z, idx, p, w1, w3, w2, act, experts.beta, experts.linear_beta)
    assert got.dtype == torch.float32 and got.shape == (5, 16)
    assert_close("u", want, got, 1e-6 if dtype == torch.float32 else TOL[torch.bfloat16])


# ----------------------------------------------------------------------------------------------
# the kernels against the reference (interpreter on CPU, directly on CUDA)
# ----------------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("N, k", [(1, 2), (2, 3), (4, 2), (4, 3)])
@pytest.mark.parametrize("act", ["situ", "swiglu"])
@pytest.mark.parametrize("dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "bf16-fp32weights"])
def test_kernel_matches_reference(N, k, act, dtype, w_dtype):
    """u against the reference; float32 weights with bf16 z are rounded to bf16 as read (autocast's case).
    Two calls give the same bits (no atomics)."""
    args = inputs(N, k, dtype, w_dtype, seed=10 * N + k)
    with torch.no_grad():
        got = routed_experts_decode(*args, act)
        want = routed_experts_decode_reference(*args, act)
        assert torch.equal(got, routed_experts_decode(*args, act))
    assert got.dtype == torch.float32 and got.shape == (N, L)
    assert_close("u", want, got, TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_with_shared_experts_and_loops(dtype, monkeypatch):
    """Every token on the same experts (in different slot orders), I and L no powers of two and blocks forced small,
    so that the kernels loop over several masked blocks; strided (transposed-copy) weights are read in place."""
    monkeypatch.setattr(moe_decode, "LAUNCH",
                        dict(up_block_i=8, up_block_l=4, down_block_l=4, down_block_i=8, combine_block_l=4))
    idx = torch.tensor([[0, 5, 2], [2, 0, 5], [5, 2, 0]])
    z, idx, p, w1, w3, w2 = inputs(3, 3, dtype, idx=idx, I=20, L=12, seed=3)
    w2 = w2.mT.contiguous().mT  # [E, L, I] with stride 1 along L
    with torch.no_grad():
        for act in HIDDEN_ACTS:
            got = routed_experts_decode(z, idx, p, w1, w3, w2, act, 2.0, 3.0)
            assert_close(f"u {act}", routed_experts_decode_reference(z, idx, p, w1, w3, w2, act, 2.0, 3.0), got,
                         TOL[dtype])
        empty = routed_experts_decode(z[:0], idx[:0], p[:0], w1, w3, w2)
    assert empty.shape == (0, 12) and empty.dtype == torch.float32


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_moe_takes_the_kernel_when_allowed(dtype, monkeypatch):
    """The wiring: LatentMoE (tiny preset) with the predicate forced true runs the kernel (counted) and gives the
    sorted path's output (DECODE_MAX_SLOTS = 0: the kernel is never taken)."""
    cfg = ModelConfig.preset("tiny")
    torch.manual_seed(0)
    moe = LatentMoE(cfg).to(DEVICE, dtype).eval()
    x = torch.randn(2, 3, cfg.hidden_size, device=DEVICE, dtype=dtype)
    calls = []
    kernel = moe_decode.routed_experts_decode
    monkeypatch.setattr(moe_decode, "routed_experts_decode", lambda *a: calls.append(1) or kernel(*a))
    with torch.no_grad():
        monkeypatch.setattr(latent, "DECODE_MAX_SLOTS", 0)  # the sorted path, on CUDA too
        want = moe(x)
        assert calls == []
        monkeypatch.setattr(latent, "use_decode_kernel", lambda *a: True)
        got = moe(x)
    assert calls == [1]
    assert_close("y", want.float(), got.float(), TOL[dtype])


# ----------------------------------------------------------------------------------------------
# inputs and the path choice (no kernels run)
# ----------------------------------------------------------------------------------------------
def test_bad_inputs_are_refused_by_name():
    z, idx, p, w1, w3, w2 = inputs(4, 2)
    bad = [
        ((z[None], idx, p, w1, w3, w2), "z must be a"),
        ((z.double(), idx, p, w1, w3, w2), "z must be a"),
        ((z, idx.int(), p, w1, w3, w2), "topk_idx must be int64"),
        ((z, idx[:3], p, w1, w3, w2), "topk_idx must be int64 .* N = 4"),
        ((z.new_zeros(17, L), idx.new_zeros(17, 8), p.new_zeros(17, 8), w1, w3, w2),
         f"N·k = 136 slots exceeds MAX_SLOTS = {MAX_SLOTS}"),
        ((z, idx, p.bfloat16(), w1, w3, w2), "topk_weight must be float32"),
        ((z, idx, p[:, :1], w1, w3, w2), "topk_weight must be float32"),
        ((z, idx, p, w1[..., :4], w3, w2), "w1 must be"),
        ((z, idx, p, w1.half(), w3, w2), "w1 must be"),
        ((z, idx, p, w1, w3[:3], w2), "w3 must be"),
        ((z, idx, p, w1, w3, w2.mT), "w2 must be"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            routed_experts_decode(*args)
    with pytest.raises(ValueError, match="act='gelu'"):
        routed_experts_decode(z, idx, p, w1, w3, w2, "gelu")
    with pytest.raises(ValueError, match="forward only"):
        routed_experts_decode(z, idx, p, w1.clone().requires_grad_(), w3, w2)
    if not INTERPRETED and DEVICE == "cpu":
        with pytest.raises(ValueError, match="kernels run on CUDA"):
            routed_experts_decode(z, idx, p, w1, w3, w2)
    assert DECODE_MAX_SLOTS <= MAX_SLOTS  # LatentMoE never asks for more than the entry takes
    assert HIDDEN_ACTS == ("situ", "swiglu")  # the kernel's two activations


def test_use_decode_kernel_conditions():
    """The fused path only with: the plain LocalDispatcher, CUDA, a backend resolving to triton there, no gradient,
    N·k ≤ DECODE_MAX_SLOTS, bf16/float32 compute and weights. (Pure: no GPU needed to decide.)"""
    bf, f32 = torch.bfloat16, torch.float32
    ok = dict(dispatcher=LocalDispatcher("auto"), device="cuda", num_slots=DECODE_MAX_SLOTS, needs_grad=False,
              dtypes=(bf, bf, bf, bf))
    assert use_decode_kernel(**ok)
    allowed = [dict(dispatcher=LocalDispatcher("triton")), dict(device=torch.device("cuda", 1)), dict(num_slots=1),
               dict(dtypes=(f32, f32, f32, f32)), dict(dtypes=(bf, f32, f32, f32))]  # autocast over fp32 weights
    refused = [dict(dispatcher=LocalDispatcher("torch")), dict(dispatcher=LocalDispatcher("fla")),
               dict(dispatcher=types.SimpleNamespace(backend="auto", run=None)),  # an expert-parallel dispatcher
               dict(dispatcher=type("Sub", (LocalDispatcher,), {})("auto")),  # a subclass may replace run
               dict(device="cpu"), dict(device="cpu", dispatcher=LocalDispatcher("triton")),  # no raise: CPU first
               dict(num_slots=DECODE_MAX_SLOTS + 1), dict(needs_grad=True),
               dict(dtypes=(torch.float16, bf, bf, bf)), dict(dtypes=(bf, bf, torch.float64, bf))]
    for change in allowed:
        assert use_decode_kernel(**{**ok, **change}), change
    for change in refused:
        assert not use_decode_kernel(**{**ok, **change}), change


def test_cpu_forward_keeps_the_dispatcher(monkeypatch):
    """On CPU (and whenever the predicate says no) LatentMoE calls dispatcher.run once, as before; the balancer
    still observes in training mode only."""
    cfg = ModelConfig.preset("tiny")
    moe = LatentMoE(cfg)
    runs = []
    run = moe.dispatcher.run
    monkeypatch.setattr(moe.dispatcher, "run", lambda *a: runs.append(1) or run(*a))
    x = torch.randn(1, 2, cfg.hidden_size)
    with torch.no_grad():
        moe.eval()(x)
        load = moe.balancer.load.clone()
        moe.train()(x)
    assert runs == [1, 1]
    assert torch.equal(load, torch.zeros_like(load)) and moe.balancer.load.sum() == 2 * cfg.num_experts_per_tok


# ----------------------------------------------------------------------------------------------
# GPU: small's MoE widths against the sorted path, and graph capture
# ----------------------------------------------------------------------------------------------
def small_moe(dtype):
    cfg = ModelConfig.preset("small")
    torch.manual_seed(0)
    return cfg, LatentMoE(cfg).cuda().to(dtype).eval()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 4, 16])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_latent_moe_matches_sorted_path_gpu(N, mode, monkeypatch):
    """LatentMoE at small's widths (E = 64, k = 8, L = 512, I = 1024), N decode tokens: the kernel (counted) against
    the sorted path (DECODE_MAX_SLOTS = 0) on the same weights, and the kernel against its reference on the same z.
    fp32 with full-precision matmuls (no TF32); autocast: fp32 weights rounded to bf16 as read."""
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    cfg, moe = small_moe(torch.float32 if mode != "bf16" else torch.bfloat16)
    x = torch.randn(N, 1, cfg.hidden_size, device="cuda", dtype=moe.experts.w1.dtype)
    calls = []
    kernel = moe_decode.routed_experts_decode
    monkeypatch.setattr(moe_decode, "routed_experts_decode", lambda *a: calls.append(1) or kernel(*a))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=mode == "autocast"):
            got = moe(x)
            assert calls == [1]
            monkeypatch.setattr(latent, "DECODE_MAX_SLOTS", 0)
            want = moe(x)
            assert calls == [1]
            h = x.view(N, -1)
            route = moe.gate(h)
            z = moe.routed_expert_down_proj(h).to(dtype)
            e = moe.experts
            args = (z, route.topk_idx, route.topk_weight, e.w1, e.w3, e.w2, e.act, e.beta, e.linear_beta)
            u, u_ref = kernel(*args), routed_experts_decode_reference(*args)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert_close("u", u_ref, u, TOL[dtype])
    assert_close("y", want.float(), got.float(), TOL[dtype])


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture_gpu():
    """LatentMoE (bf16, N = 4) captured in a CUDA graph with the kernel inside: replayed on new tokens (copied into
    the captured input) it gives the eager call's result (the same kernels; cuBLAS may pick other GEMM algorithms
    in capture: bf16 tolerance); the kernel call alone, on new z and expert ids, replays bit for bit."""
    cfg, moe = small_moe(torch.bfloat16)
    x = torch.randn(4, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    fresh = torch.randn_like(x)
    e = moe.experts
    with torch.no_grad():
        h = x.view(4, -1)
        route = moe.gate(h)
        z = moe.routed_expert_down_proj(h)
        args = (z, route.topk_idx, route.topk_weight, e.w1, e.w3, e.w2, e.act, e.beta, e.linear_beta)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(x), routed_experts_decode(*args)  # compile before capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = moe(x)
            u = routed_experts_decode(*args)
        x.copy_(fresh)
        z.copy_(torch.randn_like(z))
        route.topk_idx.copy_(route.topk_idx.flip(0))  # expert ids are read on the device
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(u, routed_experts_decode(*args))
        assert_close("y replayed", moe(fresh).float(), y.float(), TOL[torch.bfloat16])
