"""The fused MoE row sums (k3lab.kernels.moe_rows) against the torch dispatch/combine of
``k3lab.moe.latent.LocalDispatcher``: the combine's output and both its gradients, the dispatch's backward,
bad inputs; on the GPU a whole LatentMoE (eager and compiled) with and without them.

On CPU the kernels run under Triton's interpreter, which must be on before triton is imported:
``test_interpreter_suite`` re-runs this file in a fresh process with ``TRITON_INTERPRET=1``.
"""

import pytest
import torch

from k3lab.kernels.moe_rows import combine_rows, gather_sum
from k3lab.moe.latent import DispatchRows, LocalDispatcher, inverse_permutation
from k3lab.testing import KERNELS_RUN_HERE, KERNEL_DEVICE, assert_close, run_interpreter_suite

DEVICE = KERNEL_DEVICE
FP32 = 1e-6  # relative: the same float32 sums in another order
BF16 = 4e-3  # one bf16 rounding of a float32 sum
CASES = [(37, 3, 48), (20, 8, 300), (5, 1, 16)]  # (N tokens, k, L): L=48 no power of two, 300 > one width block
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="runs in test_interpreter_suite's subprocess")


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run directly here")
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreter_suite(__file__)


def routing(N, k, E=None, seed=0):
    """topk_idx [N, k] (k distinct experts a token) and the dispatch's plan from the torch dispatcher."""
    E = E or 2 * k + 1
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    _, plan = LocalDispatcher().dispatch(torch.zeros(N, 1), idx, E)
    plan.order = plan.order.to(DEVICE)
    return plan, inverse_permutation(plan.order)


def leaf(*shape, dtype=torch.float32, seed=1, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype).requires_grad_()


def combine_and_grads(fn, rows, weight, seed=2):
    u = fn(rows, weight)
    du = torch.randn(u.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return (u, *torch.autograd.grad(u, [rows, weight], du))


@needs_kernels
@pytest.mark.parametrize("N, k, L", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_matches_torch(N, k, L, dtype):
    """u, ∂rows and ∂weight against LocalDispatcher.combine (index_copy into slot order, weighted sum over k);
    ∂rows is one product rounded to the rows' dtype in both: bit for bit."""
    plan, inverse = routing(N, k)
    rows, weight = leaf(N * k, L, dtype=dtype), leaf(N, k, seed=3).detach().abs().requires_grad_()
    ref = combine_and_grads(lambda r, w: LocalDispatcher("torch").combine(r, plan, w), rows, weight)
    got = combine_and_grads(lambda r, w: combine_rows(r, inverse, w), rows, weight)
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype
    assert_close("u", ref[0], got[0], FP32)
    assert torch.equal(got[1], ref[1]), "∂rows"
    assert_close("∂weight", ref[2], got[2], FP32)


@needs_kernels
@pytest.mark.parametrize("N, k, L", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_backward_matches_torch(N, k, L, dtype):
    """DispatchRows with the fused gather-sum against its torch backward and against float64 autograd
    on index_select; the forward (a copy) is the same either way."""
    plan, inverse = routing(N, k)
    x = leaf(N, L, dtype=dtype)
    grad = torch.randn(N * k, L, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    outs = {}
    for fused in (False, True):
        xs = DispatchRows.apply(x, plan.order, inverse, k, fused)
        outs[fused] = (xs.detach(), torch.autograd.grad(xs, x, grad)[0])
    x64 = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(x64.index_select(0, plan.order // k), x64, grad.double())
    assert torch.equal(outs[True][0], outs[False][0])
    assert outs[True][1].dtype == dtype
    tol = FP32 if dtype == torch.float32 else BF16
    assert_close("∂x fused vs torch", outs[False][1], outs[True][1], tol)
    assert_close("∂x fused vs float64", ref, outs[True][1], tol)


@needs_kernels
def test_gather_sum_is_the_sum_of_each_tokens_rows():
    """gather_sum directly: integer-valued rows sum exactly."""
    N, k, L = 9, 4, 20
    plan, inverse = routing(N, k)
    rows = torch.randint(-8, 8, (N * k, L), generator=torch.Generator().manual_seed(5)).float().to(DEVICE)
    want = rows.index_select(0, inverse).view(N, k, L).sum(1)
    assert torch.equal(gather_sum(rows, inverse, k), want)


@needs_kernels
def test_bad_inputs_are_refused_by_name():
    plan, inverse = routing(6, 2)
    rows, weight = torch.randn(12, 8, device=DEVICE), torch.rand(6, 2, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be a float32"):
        combine_rows(rows, inverse, weight.double())
    with pytest.raises(ValueError, match="rows must be a contiguous"):
        combine_rows(rows.t(), inverse, weight)
    with pytest.raises(ValueError, match="rows must be a contiguous"):
        combine_rows(rows.half(), inverse, weight)
    with pytest.raises(ValueError, match="inverse must be a contiguous int64"):
        combine_rows(rows, inverse.int(), weight)
    with pytest.raises(ValueError, match="top_k=5"):
        gather_sum(rows, inverse, 5)
    with pytest.raises(ValueError, match="needs N·k = 12"):
        combine_rows(rows, inverse, torch.rand(4, 2, device=DEVICE))


def test_dispatcher_backend_choice():
    """The fused rows run where the backend resolves to triton; a bad backend is refused by name."""
    assert not LocalDispatcher("auto").fused(torch.zeros(1))
    assert not LocalDispatcher("torch").fused(torch.zeros(1))
    with pytest.raises(ValueError, match="backend='cuda'"):
        LocalDispatcher("cuda")
    if torch.cuda.is_available():
        assert LocalDispatcher("auto").fused(torch.zeros(1, device="cuda"))
        assert not LocalDispatcher("torch").fused(torch.zeros(1, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_latent_moe_with_and_without_fused_rows(compiled):
    """A LatentMoE of the small preset's shape on 4096 tokens, bf16 autocast: backend "auto" (fused rows)
    against "torch", the same weights — output and every gradient within bf16 rounding; eager and compiled."""
    from k3lab.config import ModelConfig
    from k3lab.moe.latent import LatentMoE

    cfg = ModelConfig.preset("small")
    torch.manual_seed(0)
    moe = LatentMoE(cfg).cuda()
    x = torch.randn(4, 1024, cfg.hidden_size, device="cuda", requires_grad=True)
    d_out = torch.randn(4, 1024, cfg.hidden_size, device="cuda")
    runs = {}
    for backend in ("torch", "auto"):
        moe.dispatcher = LocalDispatcher(backend)
        fn = torch.compile(moe) if compiled else moe
        moe.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            y = fn(x)
        params = [p for p in moe.parameters() if p.requires_grad]  # not the router bias (the balancer moves it)
        grads = torch.autograd.grad(y, [x, *params], d_out.to(y.dtype), allow_unused=True)
        runs[backend] = (y.float(), grads)
    assert_close("y", runs["torch"][0], runs["auto"][0], 1e-2)
    names = ["x", *(n for n, p in moe.named_parameters() if p.requires_grad)]
    for name, ref, got in zip(names, runs["torch"][1], runs["auto"][1]):
        if ref is not None:
            assert_close(f"∂{name}", ref.float(), got.float(), 2e-2)
