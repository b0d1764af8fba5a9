"""k3lab's Triton KDA kernels (k3lab.kernels) against the torch reference k3lab.mixers.chunk.kda_chunk.

Fresh random inputs per case, the K3 gate ``g = −5·σ(z)`` (docs/k3_reference.md §2.1), forward output, final
state and every gradient (q, k, v, g, beta, initial_state), against the reference in float64; also
packed sequences (``cu_seqlens``) against the reference run on each sequence separately.

On CPU the kernels run under Triton's interpreter, which has to be on before the kernels are
decorated (and another test module may import triton first): ``test_interpreter_suite`` re-runs
this file in a fresh process with ``TRITON_INTERPRET=1``, where the kernel tests run at tiny shapes.
On a CUDA machine they run directly, and the ``gpu`` tests add model-size shapes.
"""

from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F

from k3lab.config import KDA_GATE_LOWER_BOUND
from k3lab.kernels import triton_kda_chunk, kda_decode_step
from k3lab.kernels import kda as kernels_kda
from k3lab.mixers.chunk import kda_chunk as reference_chunk
from k3lab.mixers.lineage import kda_recurrent
from k3lab.testing import KERNELS_RUN_HERE, KERNEL_DEVICE, assert_close, run_interpreter_suite

DEVICE = KERNEL_DEVICE
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # relative error, K3 brief
GATE_LOWER_BOUND = KDA_GATE_LOWER_BOUND

needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="runs in test_interpreter_suite's subprocess")
# Heads of every K = 128 case on the GPU, as tests/test_kda.py's KDA layer on the triton backend. H, K, V, the dtype
# and packing are compile-time constants of the kernels (T is not), and a set of the twelve at K = 128 took 50-57 s
# (fp32) or 16-22 s (bf16) to compile for sm90 on a 2-core CPU: one H lets these cases share each set. With 16
# heads B·H reaches the state kernels' value blocks 32 and 64 (LAUNCH's min_programs), which B·H = 8 never did.
GPU_HEADS = 16


def kda_inputs(B, T, H, K, V, dtype, seed, with_state=True, num_states=None):
    """Random inputs with the layer's conventions: L2-normalised q, k; K3's bounded gate; σ(β); an initial
    state per batch row (or per packed sequence: ``num_states``)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    g = GATE_LOWER_BOUND * torch.sigmoid(randn(B, T, H, K) + 1.0)  # mean ≈ −3.6: a hard case for the tiles
    beta = torch.sigmoid(randn(B, T, H))
    h0 = randn(num_states or B, H, K, V) if with_state else None
    acts = [x.to(dtype).to(DEVICE) for x in (q, k, v, beta)]
    return acts[0], acts[1], acts[2], g.to(DEVICE), acts[3], None if h0 is None else h0.to(DEVICE)


def check_against_reference(B, T, H, K, V, dtype, seed, with_state=True, lengths=None):
    """Kernel vs the float64 reference; ``lengths``: B = 1 and T = sum(lengths) packed sequences."""
    cu_seqlens = None if lengths is None else torch.tensor([0, *accumulate(lengths)], device=DEVICE)
    q, k, v, g, beta, h0 = kda_inputs(B, T, H, K, V, dtype, seed, with_state, lengths and len(lengths))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    h0_leaf = None if h0 is None else h0.clone().requires_grad_()
    o, ht = triton_kda_chunk(*leaves, initial_state=h0_leaf, output_final_state=True, cu_seqlens=cu_seqlens)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=gen).to(o.dtype).to(DEVICE)
    dht = torch.randn(ht.shape, generator=gen).to(DEVICE)
    torch.autograd.backward([o, ht], [do, dht])

    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta)]
    ref_h0 = None if h0 is None else h0.double().requires_grad_()
    o_ref, ht_ref = reference_chunk(*ref_leaves, initial_state=ref_h0, output_final_state=True, cu_seqlens=cu_seqlens)
    torch.autograd.backward([o_ref, ht_ref], [do.double(), dht.double()])

    tol = TOL[dtype]
    assert o.dtype == v.dtype and ht.dtype == torch.float32
    assert_close("o", o_ref, o, tol)
    assert_close("final_state", ht_ref, ht, tol)
    for name, got, ref in zip(("dq", "dk", "dv", "dg", "dbeta"), leaves, ref_leaves):
        assert got.grad.dtype == got.dtype
        assert_close(name, ref.grad, got.grad, tol)
    if h0 is not None:
        assert_close("dh0", ref_h0.grad, h0_leaf.grad, tol)


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run directly here")
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under TRITON_INTERPRET=1 in a fresh interpreter; numpy's
    overflow warnings are errors there, so no kernel computes an exponent that overflows (even if masked)."""
    run_interpreter_suite(__file__, "-W", "error:overflow encountered:RuntimeWarning")


@needs_kernels
@pytest.mark.parametrize(
    "B, T, H, K, V, with_state",
    [(1, 64, 1, 16, 16, True), (2, 37, 2, 16, 32, False), (1, 130, 1, 32, 16, True),
     # K = 128: the interpreter's slowest case; on the GPU with GPU_HEADS, reusing the model-size cases' kernels
     pytest.param(2, 80, GPU_HEADS, 128, 128, True, marks=pytest.mark.gpu)],
    ids=["B1-T64-H1-K16-V16-h0", "B2-T37-H2-K16-V32", "B1-T130-H1-K32-V16-h0", "B2-T80-H16-K128-V128-h0"],
)
def test_chunk_fp32(B, T, H, K, V, with_state):
    check_against_reference(B, T, H, K, V, torch.float32, seed=T, with_state=with_state)


@needs_kernels
def test_chunk_bf16():
    check_against_reference(1, 100, 2, 16, 32, torch.bfloat16, seed=7)


PACKED = [[37, 64, 1, 100], [130]]  # sequence lengths: partial, full, one-token and two-chunk sequences


@needs_kernels
@pytest.mark.parametrize(
    "lengths, H, K, V, with_state",
    [(PACKED[0], 2, 16, 32, True), (PACKED[1], 1, 32, 16, False),
     pytest.param([20, 70], GPU_HEADS, 128, 128, True, marks=pytest.mark.gpu)],
    ids=["N4-T202-H2-K16-V32-h0", "N1-T130-H1-K32-V16", "N2-T90-H16-K128-V128-h0"],
)
def test_chunk_packed_fp32(lengths, H, K, V, with_state):
    check_against_reference(1, sum(lengths), H, K, V, torch.float32, seed=len(lengths), with_state=with_state,
                            lengths=lengths)


@needs_kernels
def test_chunk_packed_bf16():
    check_against_reference(1, sum(PACKED[0]), 2, 16, 32, torch.bfloat16, seed=11, lengths=PACKED[0])


@needs_kernels
@pytest.mark.parametrize("lengths, B, T, H, K, V", [
    ([20, 70], 1, 90, 1, 16, 32),
    pytest.param(None, 2, 4096, GPU_HEADS, 128, 128, marks=pytest.mark.gpu),
], ids=["packed-N2-T90", "B2-T4096-H16-K128"])
def test_chunk_recompute_equals_saving_variant(lengths, B, T, H, K, V):
    """``recompute=True`` keeps only the inputs and re-runs the forward kernels in backward: the output,
    final state and every gradient are bit-identical to the saving variant's (deterministic kernels)."""
    cu_seqlens = None if lengths is None else torch.tensor([0, *accumulate(lengths)], device=DEVICE)
    inputs = kda_inputs(B, T, H, K, V, torch.bfloat16, seed=3, num_states=lengths and len(lengths))
    runs = []
    for recompute in (False, True):
        leaves = [x.clone().requires_grad_() for x in inputs]
        o, ht = triton_kda_chunk(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu_seqlens,
                          recompute=recompute)
        gen = torch.Generator().manual_seed(9)
        do = torch.randn(o.shape, generator=gen).to(o.dtype).to(DEVICE)
        torch.autograd.backward([o, ht], [do, torch.randn(ht.shape, generator=gen).to(DEVICE)])
        runs.append([o, ht, *(x.grad for x in leaves)])
    for name, a, b in zip(("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"), *runs):
        assert torch.equal(a, b), f"{name}: recompute differs from the saving variant"


def test_reference_packed_is_per_sequence():
    """The chunked reference with cu_seqlens equals the token-by-token recurrence run on each sequence
    on its own (float64): an independent check of the packing."""
    lengths = PACKED[0]
    q, k, v, g, beta, h0 = (None if x is None else x.double().cpu()
                            for x in kda_inputs(1, sum(lengths), 2, 16, 32, torch.float32, 5, num_states=len(lengths)))
    cu_seqlens = torch.tensor([0, *accumulate(lengths)])
    o, ht = reference_chunk(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens)
    for n, (bos, eos) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        o_n, ht_n = kda_recurrent(*(x[:, bos:eos] for x in (q, k, v, g, beta)), initial_state=h0[n:n + 1])
        assert_close(f"o of sequence {n}", o_n, o[:, bos:eos], 1e-12)
        assert_close(f"final state of sequence {n}", ht_n, ht[n:n + 1], 1e-12)


@needs_kernels
def test_decode_step_continues_the_chunked_prefill():
    """Prefill T tokens with triton_kda_chunk, decode token T+1 with kda_decode_step: same as one pass."""
    q, k, v, g, beta, h0 = kda_inputs(2, 21, 2, 16, 32, torch.float32, seed=3)
    o_all, s_all = reference_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    _, s_prefix = triton_kda_chunk(q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta[:, :-1], initial_state=h0,
                            output_final_state=True)
    o_step, s_step = kda_decode_step(q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:], beta[:, -1:], s_prefix)
    assert o_step.shape == (2, 1, 2, 32) and s_step.dtype == torch.float32
    assert_close("decode o", o_all[:, -1:], o_step, TOL[torch.float32])
    assert_close("decode state", s_all, s_step, TOL[torch.float32])
    o_zero, _ = kda_decode_step(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], None)
    o_ref, _ = reference_chunk(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1])
    assert_close("decode from zero state", o_ref, o_zero, TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1000, 4096], ids=["T1000", "T4096"])
def test_chunk_gpu_model_size(T, dtype):
    check_against_reference(2, T, GPU_HEADS, 128, 128, dtype, seed=T)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunk_packed_gpu_model_size(dtype):
    lengths = [1000, 37, 3059, 64, 1]  # chunk-aligned, mid-chunk and one-token documents
    check_against_reference(1, sum(lengths), GPU_HEADS, 128, 128, dtype, seed=7, lengths=lengths)


def test_bad_inputs_raise():
    q = torch.zeros(1, 8, 2, 16)
    v, beta = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2)
    with pytest.raises(ValueError, match="beta"):
        triton_kda_chunk(q, q, v, q, beta[..., None])
    with pytest.raises(ValueError, match=r"k \(1, 4, 2, 16\)"):
        triton_kda_chunk(q, q[:, :4], v, q, beta)
    with pytest.raises(ValueError, match="v is on meta but q is on cpu"):
        triton_kda_chunk(q, q, v.to("meta"), q, beta)
    with pytest.raises(ValueError, match="initial_state"):
        triton_kda_chunk(q, q, v, q, beta, initial_state=torch.zeros(1, 2, 16, 8))
    with pytest.raises(ValueError, match="T == 1"):
        kda_decode_step(q, q, v, q, beta, None)


def test_sizes_past_the_kernel_limits_raise():
    """int32 token offsets and CUDA grid axes: refused before any launch (meta tensors allocate nothing)."""
    def inputs(B, T, H, K):
        x = torch.empty(B, T, H, K, device="meta")
        return x, x, x, x, torch.empty(B, T, H, device="meta")

    with pytest.raises(ValueError, match=r"must be < 2\^31"):
        triton_kda_chunk(*inputs(1, 2**20, 16, 128))  # T·H·K = 2^31
    with pytest.raises(ValueError, match="CUDA grid limit"):
        triton_kda_chunk(*inputs(4097, 1, 16, 16))  # B·H = 65552


@needs_kernels
def test_chunk_training_path_wide_state_blocks(monkeypatch):
    """What training runs: no final state (so no dht), B > 1 with an initial state (dh0 summed per row), T an
    exact multiple of 64, V not a power of two; and the state kernels' widest value block (BV = 64), which
    the tiny shapes above never reach because B·H is small."""
    for name in ("fwd_state", "bwd_state"):
        monkeypatch.setitem(kernels_kda.LAUNCH, name, dict(kernels_kda.LAUNCH[name], min_programs=1))
    q, k, v, g, beta, h0 = kda_inputs(2, 128, 1, 64, 48, torch.float32, seed=13)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = triton_kda_chunk(*leaves[:5], initial_state=leaves[5])
    assert ht is None
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    o.backward(do)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o_ref, _ = reference_chunk(*ref[:5], initial_state=ref[5], output_final_state=False)
    o_ref.backward(do.double())
    assert_close("o", o_ref, o, TOL[torch.float32])
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), leaves, ref):
        assert_close(name, want.grad, got.grad, TOL[torch.float32])


@needs_kernels
@pytest.mark.parametrize("wu", [dict(per_chunk=True, solve=True), dict(per_chunk=False, solve=False)],
                         ids=["solve_in_wu", "wu_per_block"])
@pytest.mark.parametrize("lengths", [None, [37, 64, 27]], ids=["rows", "packed"])
def test_chunk_other_wu_layouts(monkeypatch, wu, lengths):
    """The two other layouts of ``kda_fwd_wu_kernel`` that ``LAUNCH["fwd_wu"]`` selects (timed slower on
    the H200, kernels/RESULTS.md): the UT solve folded into it, and one program per key/value block."""
    monkeypatch.setitem(kernels_kda.LAUNCH, "fwd_wu", dict(kernels_kda.LAUNCH["fwd_wu"], **wu))
    if lengths is None:
        check_against_reference(2, 80, 2, 32, 32, torch.float32, seed=21)
    else:
        check_against_reference(1, sum(lengths), 2, 32, 32, torch.float32, seed=22, lengths=lengths)


@needs_kernels
def test_decode_step_several_value_blocks():
    """V = 80: three value blocks of the decode kernel (BV = 32), the last one partial."""
    q, k, v, g, beta, h0 = kda_inputs(1, 1, 2, 16, 80, torch.float32, seed=17)
    o, s = kda_decode_step(q, k, v, g, beta, h0)
    o_ref, s_ref = reference_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close("decode o", o_ref, o, TOL[torch.float32])
    assert_close("decode state", s_ref, s, TOL[torch.float32])


@pytest.mark.parametrize("chunk", [triton_kda_chunk, reference_chunk], ids=["kernels", "reference"])
@pytest.mark.parametrize(
    "cu_seqlens, B, h0_shape, match",
    [
        (torch.tensor([0.0, 8.0]), 1, None, "cu_seqlens must be int32 or int64"),
        (torch.tensor([[0, 8]]), 1, None, r"cu_seqlens must be a 1-d tensor \[N \+ 1\]"),
        (torch.tensor([8]), 1, None, r"cu_seqlens must be a 1-d tensor \[N \+ 1\]"),
        (torch.tensor([1, 8]), 1, None, "cu_seqlens must start at 0 and end at T"),
        (torch.tensor([0, 5]), 1, None, "cu_seqlens must start at 0 and end at T"),
        (torch.tensor([0, 5, 3, 8]), 1, None, "cu_seqlens must be strictly increasing"),
        (torch.tensor([0, 5, 5, 8]), 1, None, "cu_seqlens must be strictly increasing"),
        (torch.tensor([0, 8]), 2, None, "cu_seqlens .* B = 2"),
        (torch.tensor([0, 3, 8]), 1, (1, 2, 16, 16), r"initial_state must be \[N, H, K, V\] = \(2, 2, 16, 16\)"),
    ],
    ids=["float", "2d", "one-entry", "start", "end", "decreasing", "empty-sequence", "batch", "initial-state"],
)
def test_packed_bad_inputs_raise(chunk, cu_seqlens, B, h0_shape, match):
    q, v, beta = torch.zeros(B, 8, 2, 16), torch.zeros(B, 8, 2, 16), torch.zeros(B, 8, 2)
    h0 = None if h0_shape is None else torch.zeros(h0_shape)
    with pytest.raises(ValueError, match=match):
        chunk(q, q, v, q, beta, initial_state=h0, cu_seqlens=cu_seqlens)


@needs_kernels
@pytest.mark.parametrize("K, V, H", [(16, 16, 2), (32, 16, 2),
                                     pytest.param(128, 128, GPU_HEADS, marks=pytest.mark.gpu)],  # GPU_HEADS: shares the
                         ids=["K16-V16", "K32-V16", "K128-V128"])                # fp32 key-side kernels of the cases above
def test_kcp_augmented_call(K, V, H):
    """KCP's summary call (k3lab.parallel.context): values ``[v | 0_K]`` (width V+K ≤ 256) from the state
    ``[0 | I]`` give the final state ``[S̃ | M]`` and output columns ``[o⁰ | r]`` — on the Triton kernels
    as on the reference, gradients included (the backward of the whole KCP step runs through it)."""
    T = 80 if K == 128 else 70
    q, k, v, g, beta, _ = kda_inputs(1, T, H, K, V, torch.float32, seed=K + V, with_state=False)
    v_aug = torch.cat([v, torch.zeros(*v.shape[:-1], K, device=DEVICE)], -1)                 # [B, T, H, V+K]
    h0 = torch.cat([torch.zeros(1, H, K, V), torch.eye(K).expand(1, H, K, K)], -1).to(DEVICE)  # [B, H, K, V+K]
    leaves = [x.clone().requires_grad_() for x in (q, k, v_aug, g, beta)]
    o, ht = triton_kda_chunk(*leaves, initial_state=h0, output_final_state=True)
    gen = torch.Generator().manual_seed(3)
    do, dht = torch.randn(o.shape, generator=gen).to(DEVICE), torch.randn(ht.shape, generator=gen).to(DEVICE)
    torch.autograd.backward([o, ht], [do, dht])
    ref = [x.detach().double().requires_grad_() for x in (q, k, v_aug, g, beta)]
    o_ref, ht_ref = reference_chunk(*ref, initial_state=h0.double(), output_final_state=True)
    torch.autograd.backward([o_ref, ht_ref], [do.double(), dht.double()])
    assert_close("o", o_ref, o, TOL[torch.float32])
    assert_close("[S~ | M]", ht_ref, ht, TOL[torch.float32])
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta"), leaves, ref):
        assert_close(name, want.grad, got.grad, TOL[torch.float32])
