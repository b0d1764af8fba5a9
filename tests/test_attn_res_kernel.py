"""The fused AttnRes depth mix + RMSNorm (k3lab.kernels.attn_res.attn_res_mix) against its reference,
``k3lab.residual.attn_res_normed``: the output and the gradients of every source and weight; the residual
stream's choice between the two; and the whole model on the GPU with and without it.

On CPU the kernels run under Triton's interpreter, which must be on before triton is imported:
``test_interpreter_suite`` re-runs this file in a fresh process with ``TRITON_INTERPRET=1``.
"""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3lab.kernels.attn_res import MAX_FAST_WIDTH, MAX_SOURCES, attn_res_mix
from k3lab.residual import AttnResStream, attn_res_normed, attn_res_normed_triton
from k3lab.testing import KERNELS_RUN_HERE, KERNEL_DEVICE, assert_close, run_interpreter_suite, saved_bytes

DEVICE = KERNEL_DEVICE
FP32 = 1e-5  # relative: the same float32 formula, summed in another order
BF16 = 2e-2  # the reference rounds ∂h to bf16 before the depth mix's backward; the kernel keeps it in float32
CASES = [(1, 64), (2, 48), (5, 64)]  # (S sources, D width): D=48 is no power of two
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="runs in test_interpreter_suite's subprocess")


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run directly here")
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreter_suite(__file__)


def modules(D, weight_dtype=torch.float32, seed=0):
    """proj, norm (eps 1e-6) and post_norm (eps None) with random weights (not the zero / one init)."""
    torch.manual_seed(seed)
    proj, norm, post = nn.Linear(D, 1, bias=False), nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D)
    with torch.no_grad():
        for m, mean in ((proj, 0.0), (norm, 1.0), (post, 1.0)):
            m.weight.copy_(mean + 0.5 * torch.randn_like(m.weight))
    return [m.to(DEVICE, weight_dtype) for m in (proj, norm, post)]


def make_sources(S, D, dtype, rows=(2, 3), seed=1):
    """S sources [*rows, D] of different scales (so that the depth softmax is not uniform)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*rows, D, generator=gen) * (1 + i)).to(DEVICE, dtype).requires_grad_() for i in range(S)]


def fused(sources, proj, norm, post):
    return attn_res_mix(sources, proj.weight, norm.weight, norm.eps,
                        None if post is None else post.weight, None if post is None else post.eps)


def reference(sources, proj, norm, post):
    return attn_res_normed(sources, proj, norm, post)[0]


def outputs_and_grads(fn, sources, proj, norm, post, seed=2):
    """fn's output and the gradients of the sources and weights for a random ∂L/∂out."""
    out = fn(sources, proj, norm, post)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, out.dtype)
    weights = [proj.weight, norm.weight] + ([] if post is None else [post.weight])
    names = [f"d sources[{i}]" for i in range(len(sources))] + ["d proj.weight", "d norm.weight", "d post.weight"]
    return out, dict(zip(names, torch.autograd.grad(out, [*sources, *weights], d_out)))


def assert_matches_reference(sources, proj, norm, post, tol):
    ref_out, ref_grads = outputs_and_grads(reference, sources, proj, norm, post)
    out, grads = outputs_and_grads(fused, sources, proj, norm, post)
    assert out.dtype == ref_out.dtype == sources[0].dtype
    assert_close("out", ref_out, out, tol)
    for name, ref in ref_grads.items():
        assert grads[name].dtype == ref.dtype, name
        assert_close(name, ref, grads[name], tol)


@needs_kernels
@pytest.mark.parametrize("S, D", CASES)
@pytest.mark.parametrize("post_norm", [True, False])
def test_fp32_matches_reference(S, D, post_norm):
    proj, norm, post = modules(D)
    assert_matches_reference(make_sources(S, D, torch.float32), proj, norm, post if post_norm else None, FP32)


@needs_kernels
@pytest.mark.parametrize("S, D", CASES)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_bf16_matches_reference(S, D, weight_dtype):
    """bf16 sources, the reference run on them directly (no autocast): it mixes in float32, rounds h to bf16,
    and its RMSNorm returns bf16(h · ρ · g) — the kernel's rounding, so the outputs agree to a bf16 ulp."""
    proj, norm, post = modules(D, weight_dtype)
    assert_matches_reference(make_sources(S, D, torch.bfloat16), proj, norm, post, BF16)


@needs_kernels
def test_checkpoint_gives_the_same_gradients():
    """Under torch.utils.checkpoint (non-reentrant) the forward runs again in backward: the same bits."""
    proj, norm, post = modules(48)
    sources = make_sources(3, 48, torch.bfloat16)
    direct = outputs_and_grads(fused, sources, proj, norm, post)
    recomputed = outputs_and_grads(lambda *a: checkpoint(fused, *a, use_reentrant=False), sources, proj, norm, post)
    assert torch.equal(direct[0], recomputed[0])
    for name, grad in direct[1].items():
        assert torch.equal(grad, recomputed[1][name]), name


@needs_kernels
def test_saves_only_the_inputs():
    """Autograd keeps the sources and weights, and q = γ·w [D]: no [N, D] intermediate, no statistics."""
    proj, norm, post = modules(64)
    sources = make_sources(5, 64, torch.bfloat16)
    _, seen = saved_bytes(lambda: fused(sources, proj, norm, post),
                          exclude=[*sources, proj.weight, norm.weight, post.weight])
    assert sorted(seen.values(), key=str) == [(64 * 4, torch.float32, (64,))], seen


def test_bad_inputs_are_refused_by_name():
    x = torch.zeros(2, 8)
    w, g = torch.zeros(1, 8), torch.ones(8)
    with pytest.raises(ValueError, match=f"1 to MAX_SOURCES={MAX_SOURCES} tensors, got {MAX_SOURCES + 1} sources"):
        attn_res_mix([x] * (MAX_SOURCES + 1), w, g, None, g, None)
    with pytest.raises(ValueError, match="got 0 sources"):
        attn_res_mix([], w, g, None, g, None)
    with pytest.raises(ValueError, match=r"sources\[1\] must be a tensor of shape \(2, 8\).*got .*32 \(3, 8\)"):
        attn_res_mix([x, torch.zeros(3, 8)], w, g, None, g, None)
    with pytest.raises(ValueError, match=r"sources\[2\] must be .*dtype in \(torch.float32,\).* got torch.bfloat16"):
        attn_res_mix([x, x, x.bfloat16()], w, g, None, g, None)
    with pytest.raises(ValueError, match=r"sources\[0\] must be .*dtype in \(torch.bfloat16, torch.float32\)"):
        attn_res_mix([x.half()], w, g, None, g, None)
    with pytest.raises(ValueError, match=r"sources\[1\] must be contiguous"):
        attn_res_mix([x, torch.zeros(8, 2).t()], w, g, None, g, None)
    with pytest.raises(ValueError, match=r"proj_weight must be a tensor of shape \(1, 8\)"):
        attn_res_mix([x], g, g, None, g, None)
    with pytest.raises(ValueError, match=r"norm_weight must be a tensor of shape \(8,\)"):
        attn_res_mix([x], w, torch.ones(7), None, g, None)
    with pytest.raises(ValueError, match=r"post_weight must be a tensor of shape \(8,\)"):
        attn_res_mix([x], w, g, None, w, None)
    with pytest.raises(ValueError, match=r"post_eps=1e-06: allowed values without a post_weight are \(None,\)"):
        attn_res_mix([x], w, g, None, None, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_realistic_size_on_gpu():
    """N=16384 rows, D=1024, S=5 bf16 sources, bf16 weights: within bf16 rounding of the reference."""
    proj, norm, post = [m.cuda() for m in modules(1024, torch.bfloat16)]
    sources = [s.cuda().detach().requires_grad_() for s in make_sources(5, 1024, torch.bfloat16, rows=(4, 4096))]
    assert_matches_reference(sources, proj, norm, post, BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture():
    """Forward and backward captured in one CUDA graph: a replay on new source values gives eager's result."""
    proj, norm, post = [m.cuda() for m in modules(1024)]
    sources = [s.cuda().detach().requires_grad_() for s in make_sources(3, 1024, torch.bfloat16, rows=(512,))]
    d_out = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    inputs = [*sources, proj.weight, norm.weight, post.weight]

    def step():
        out = fused(sources, proj, norm, post)
        return (out, *torch.autograd.grad(out, inputs, d_out))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for s in sources:
            s.copy_(torch.randn_like(s))
    graph.replay()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)


def run_stream(sources, proj, norm, post, fused_mix, recorder=None):
    """Mix ``sources`` (the completed blocks and the partial sum) the way a decoder layer's sublayer does."""
    stream = AttnResStream(sources[0], sublayers_per_block=1, recorder=recorder, fused_mix=fused_mix)
    stream.blocks, stream.prefix_sum = list(sources[:-1]), sources[-1]
    return stream._mix(proj, norm, "test", post)


@needs_kernels
def test_stream_takes_the_fused_mix_where_it_applies():
    """AttnResStream with ``fused_mix``: the same output and source gradients as the reference mix (fp32); the
    reference where the fused mix does not apply — more than MAX_SOURCES sources, sources of two dtypes, rows
    wider than MAX_FAST_WIDTH, a depth-weight recorder — so those calls equal the reference bit for bit."""
    proj, norm, post = modules(48)
    sources = make_sources(3, 48, torch.float32)
    ref = run_stream(sources, proj, norm, post, None)
    got = run_stream(sources, proj, norm, post, attn_res_normed_triton)
    assert_close("stream output", ref, got, FP32)
    g_ref = torch.autograd.grad(ref.square().sum(), sources)
    g_got = torch.autograd.grad(got.square().sum(), sources)
    for i, (a, b) in enumerate(zip(g_ref, g_got)):
        assert_close(f"d source {i}", a, b, FP32)

    def must_not_run(*args):
        raise AssertionError("the fused mix ran where it does not apply")

    many = make_sources(MAX_SOURCES + 1, 48, torch.float32)
    mixed = [sources[0].detach().double().float(), *[x.detach().bfloat16() for x in sources[1:]]]
    for case in (many, mixed):
        assert torch.equal(run_stream(case, proj, norm, post, must_not_run), run_stream(case, proj, norm, post, None))
    wide = make_sources(2, MAX_FAST_WIDTH + 16, torch.float32, rows=(1,))
    wide_modules = modules(MAX_FAST_WIDTH + 16)
    assert torch.equal(run_stream(wide, *wide_modules, must_not_run), run_stream(wide, *wide_modules, None))
    records = []
    assert torch.equal(run_stream(sources, proj, norm, post, must_not_run, records), ref)
    assert len(records) == 1 and records[0][1].shape == (3,)  # the depth weights need the reference path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_with_and_without_the_fused_mix(monkeypatch):
    """The tiny K3 model on CUDA (fp32, backend "auto": our KDA kernels either way): loss and every gradient
    with the fused depth mixes equal those with the reference mixes."""
    import k3lab.model
    from k3lab.config import ModelConfig
    from k3lab.model import K3ForCausalLM

    cfg = ModelConfig.preset("tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).cuda()
    with torch.no_grad():  # non-trivial pseudo-queries (their init is zero: uniform depth weights)
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0.0, 0.5)
    x = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(k3lab.model, "attn_res_normed_triton", None)
        model.zero_grad(set_to_none=True)
        loss = model(x, labels=x).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_f, grads_f), (loss_r, grads_r) = runs
    assert_close("loss", loss_r, loss_f, FP32)
    for name, g in grads_r.items():
        assert_close(name, g, grads_f[name], 1e-4)
