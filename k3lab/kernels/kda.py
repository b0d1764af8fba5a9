"""k3lab's Triton KDA: chunked forward + backward with autograd, and the one-token decode step.

Same layout and semantics as the torch reference :func:`k3lab.mixers.chunk.kda_chunk` (docs/k3_reference.md §2.2,
§2.3): ``q, k [B, T, H, K]`` (L2-normalised by the caller), ``v [B, T, H, V]``, ``g [B, T, H, K]``
the per-channel log-decay, ``beta [B, T, H]`` (after the sigmoid), states ``[B, H, K, V]`` in fp32.
The kernels rely on K3's lower-bounded gate, ``g ∈ [−5, 0]`` (see :mod:`k3lab.kernels.kda_forward`
for why), take any ``T`` (the last chunk is masked), bf16/fp16/fp32 activations, and run on CUDA or,
for tests and notebooks, on CPU under ``TRITON_INTERPRET=1`` (set before importing this module).

Packed sequences as in fla: with ``cu_seqlens [N + 1]`` the inputs are ``[1, T, ...]`` holding N
sequences along T, each cut into its own chunks, with states ``[N, H, K, V]``. The host builds a chunk
index (:func:`pack_chunks`, fla's ``prepare_chunk_indices``) and the kernels take ``IS_VARLEN``
(a constexpr: without ``cu_seqlens`` the packed branches compile away).

Autograd: forward and backward are two ``torch.library`` custom ops (``k3lab::kda_chunk_fwd``,
``k3lab::kda_chunk_bwd``, with fake implementations), so ``torch.compile`` traces a KDA layer through
:func:`triton_kda_chunk` without a graph break.

Launch parameters are fixed — chosen from A/B timings on an H200 (``kernels/RESULTS.md``;
``kernels/bench_kda.py --tune`` re-times the candidates) and written into :data:`LAUNCH` — so the first
call compiles and runs, with no autotuning (12 s for forward+backward on the H200).

Size limits: token offsets inside the kernels are int32, so ``T·H·max(K, V, 64) < 2³¹``; batch rows times
heads (packed: sequences times heads) and the number of chunks are CUDA grid axes, at most 65535.
"""

import os
from itertools import accumulate
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from k3lab.kernels.kda_backward import (kda_bwd_dg_kernel, kda_bwd_dv_local_kernel, kda_bwd_intra_kernel,
                                        kda_bwd_state_kernel, kda_bwd_wy_key_kernel, kda_bwd_wy_value_kernel)
from k3lab.kernels.kda_decode import kda_decode_kernel
from k3lab.kernels.kda_forward import (kda_fwd_gate_kernel, kda_fwd_output_kernel, kda_fwd_scores_kernel,
                                      kda_fwd_solve_kernel, kda_fwd_state_kernel, kda_fwd_wu_kernel)
from k3lab.packing import check_cu_seqlens

Tensor = torch.Tensor

CHUNK = 64  # BT: tokens per chunk
TILE = 16  # BC: tokens per sub-chunk tile (16 × g ≥ −5 keeps every rescaling factor below e^80)
MAX_HEAD_DIM = 256
GRID_MAX = 65535  # CUDA's limit on grid axes 1 and 2
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # triton reads it when the kernels are decorated
ACTIVATION_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# Launch parameters per kernel, chosen by A/B timings on an H200 (triton 3.6; the timings and the
# alternatives are in kernels/RESULTS.md, "Launch parameters"; `kernels/bench_kda.py --tune` re-times
# candidates, `--launch` overrides entries). "BV"/"BK": value/key block; the state kernels take the widest
# value block that still gives at least `min_programs` programs, so long single sequences (few B·H) still
# spread over the GPU's 132 SMs (bwd_state with num_stages=1 hit an illegal memory access on triton 3.6;
# with 3 stages its fp32 compile needs 256 KB of shared memory, past the H200's 227 KB: fp32 takes 2).
# fwd_wu: `per_chunk` runs one program per chunk looping over its key then value blocks (else one per
# block); `solve` (needs per_chunk) folds kda_fwd_solve_kernel into it. bwd_intra: `diag_precision` is the
# dot precision of the diagonal-tile products on the bf16 path (fp32 inputs: exact) — bf16x3 rather than
# tf32 cut the bf16 dg error from 8.9e-3 to 1.8e-3 for ≈1% of forward+backward time.
LAUNCH = {
    "fwd_gate": dict(BK=32, num_warps=4, num_stages=1),
    "fwd_scores": dict(BK=32, num_warps=1, num_stages=1),
    "fwd_solve": dict(num_warps=4, num_stages=1),
    "fwd_wu": dict(BK=64, BV=64, per_chunk=True, solve=False, num_warps=4, num_stages=2),
    "fwd_state": dict(BV=(64, 32, 16), min_programs=128, num_warps=4, num_stages=2),
    "fwd_output": dict(BK=64, BV=64, num_warps=4, num_stages=2),
    "bwd_dv_local": dict(BV=64, num_warps=4, num_stages=2),
    "bwd_state": dict(BV=(64, 32, 16), min_programs=128, num_warps=4, num_stages=3, num_stages_fp32=2),
    "bwd_wy_key": dict(BK=32, BV=64, num_warps=4, num_stages=3),
    "bwd_wy_value": dict(BV=64, num_warps=4, num_stages=1),
    "bwd_intra": dict(BK=32, num_warps=2, num_stages=1, diag_precision="bf16x3"),
    "bwd_dg": dict(BK=32, num_warps=2, num_stages=1),
    "decode": dict(BV=32, num_warps=4, num_stages=1),
}


def _launch(name: str, fp32: bool = False) -> dict:
    """``num_warps``/``num_stages`` for a kernel launch (the interpreter takes none); fp32 inputs take
    ``num_stages_fp32`` where a kernel has one (their pipeline buffers are twice as large)."""
    cfg = LAUNCH[name]
    stages = cfg.get("num_stages_fp32", cfg["num_stages"]) if fp32 else cfg["num_stages"]
    return {} if INTERPRET else {"num_warps": cfg["num_warps"], "num_stages": stages}


def _state_block_v(name: str, BH: int, V: int) -> int:
    """Widest value block with ``≥ min_programs`` programs for a sequential state kernel."""
    cfg = LAUNCH[name]
    choices = [bv for bv in cfg["BV"] if bv <= max(16, triton.next_power_of_2(V))]
    for bv in choices:
        if BH * triton.cdiv(V, bv) >= cfg["min_programs"]:
            return bv
    return choices[-1]


def _block(size: int, limit: int) -> int:
    """A power-of-two block of at least 16 (tensor-core minimum) and at most ``limit`` covering ``size``."""
    return min(max(16, triton.next_power_of_2(size)), limit)


class Packing(NamedTuple):
    """Packed sequences as the kernels read them (all on the inputs' device)."""

    cu_seqlens: Tensor  # [N + 1] int64: sequence n is token rows cu_seqlens[n] .. cu_seqlens[n + 1] − 1
    chunk_indices: Tensor  # [NT, 2] int32: (sequence n, chunk inside n) of every chunk, in token order
    chunk_offsets: Tensor  # [N + 1] int32: the first chunk of every sequence (NT at the end)


def pack_chunks(bounds: list[int], device: torch.device) -> Packing:
    """The chunk index of sequences packed at ``bounds`` (``cu_seqlens`` as a list): every sequence is cut
    into chunks of :data:`CHUNK` tokens of its own, the last one masked."""
    counts = [triton.cdiv(eos - bos, CHUNK) for bos, eos in zip(bounds[:-1], bounds[1:])]  # [N]
    chunk_indices = [(n, c) for n, count in enumerate(counts) for c in range(count)]
    return Packing(torch.tensor(bounds, dtype=torch.int64, device=device),
                   torch.tensor(chunk_indices, dtype=torch.int32, device=device),
                   torch.tensor([0, *accumulate(counts)], dtype=torch.int32, device=device))


def _packing_args(packing: Packing | None, B: int) -> tuple[dict, dict, int]:
    """Keyword arguments locating the chunks for the chunk-parallel kernels and the sequences for the
    state kernels, and the number of sequences ``N`` (= B without packing)."""
    varlen = packing is not None
    cu_seqlens, chunk_indices, chunk_offsets = packing if varlen else (None, None, None)
    return (dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, IS_VARLEN=varlen),
            dict(cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, IS_VARLEN=varlen),
            len(chunk_offsets) - 1 if varlen else B)


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens=None) -> list[int] | None:
    """Raise ValueError naming the argument that does not fit the layout, dtype or device; returns the
    sequence boundaries of ``cu_seqlens`` as a list (None without packing)."""
    for name, x, dim in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        if not isinstance(x, Tensor) or x.dim() != dim:
            raise ValueError(f"{name} must be a {dim}-d tensor, got {getattr(x, 'shape', type(x))}")
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} and g {tuple(g.shape)} must match q [B, T, H, K] = {tuple(q.shape)}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"v {tuple(v.shape)} must be [B, T, H, V] and beta {tuple(beta.shape)} [B, T, H] "
                         f"with B, T, H = {B, T, H}")
    if T < 1 or K > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"need T >= 1 and head dims K, V <= {MAX_HEAD_DIM}; got T={T}, K={K}, V={v.shape[-1]}")
    if q.dtype not in ACTIVATION_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype in {tuple(ACTIVATION_DTYPES)}; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if not g.is_floating_point() or not beta.is_floating_point():
        raise ValueError(f"g and beta must be floating point; got {g.dtype}, {beta.dtype}")
    if cu_seqlens is None and initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}, "
                         f"got {tuple(initial_state.shape)}")
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q, v, initial_state)
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if x is not None and x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}: all inputs must share one device")
    V = v.shape[-1]
    if T * H * max(K, V, CHUNK) >= 2**31:
        raise ValueError(f"T·H·max(K, V, {CHUNK}) = {T * H * max(K, V, CHUNK):,} must be < 2^31 (the kernels' "
                         f"token offsets are int32); got T={T}, H={H}, K={K}, V={V}: split the sequence")
    rows = H * (B if bounds is None else len(bounds) - 1)
    if rows > GRID_MAX or triton.cdiv(T, CHUNK) > GRID_MAX:
        raise ValueError(f"{'N' if bounds else 'B'}·H = {rows} and the number of 64-token chunks "
                         f"{triton.cdiv(T, CHUNK)} must each be <= {GRID_MAX} (CUDA grid limit)")
    if not q.is_cuda and not INTERPRET:
        raise ValueError(f"k3lab.kernels need CUDA tensors (got device {q.device}); on CPU set TRITON_INTERPRET=1 "
                         "before importing k3lab.kernels, or use the torch reference k3lab.mixers.chunk.kda_chunk")
    return bounds


def _sizes(q: Tensor, v: Tensor, packing: Packing | None):
    """``B, T, H, K, V``, the number of chunks per batch row (packed: of all sequences), the full key block,
    and the dot dtype/precision: fp32 inputs multiply exactly (``ieee``), bf16/fp16 ones use tf32 where
    operands are computed in fp32."""
    B, T, H, K = q.shape
    NT = triton.cdiv(T, CHUNK) if packing is None else len(packing.chunk_indices)
    PREC = "ieee" if q.dtype == torch.float32 else "tf32"
    return B, T, H, K, v.shape[-1], NT, _block(K, MAX_HEAD_DIM), ACTIVATION_DTYPES[q.dtype], PREC


def kda_forward(q, k, v, g, beta, scale, initial_state, output_final_state, packing=None, need_output=True):
    """Run the forward kernels (six; five when ``LAUNCH["fwd_wu"]`` folds the solve in); returns
    ``(o, final_state or None, saved)`` with ``saved`` the tensors the backward reads (nothing sequential
    is recomputed there). ``need_output=False`` (the recompute in backward) skips the output kernel: o is None."""
    B, T, H, K, V, NT, BK, DT, PREC = _sizes(q, v, packing)
    chunks, seqs, N = _packing_args(packing, B)
    f32 = dict(dtype=torch.float32, device=q.device)
    qg, kg, w = torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
    u = torch.empty_like(v, dtype=torch.float32)  # fp32: Ṽ = U − W S cancels; U in bf16 doubled the error
    gl = torch.empty(B, NT, H, K, **f32)  # G_C per chunk
    Aqk, Akk_inv, Mkk = (torch.empty(B, T, H, CHUNK, **f32) for _ in range(3))
    G2 = torch.empty(B, T, H, K, **f32)  # in-chunk cumulative decay in log2 units (log₂(e)·G), saved
    BKg = _block(K, LAUNCH["fwd_gate"]["BK"])
    kda_fwd_gate_kernel[(triton.cdiv(K, BKg), NT, B * H)](
        q, k, g, G2, qg, kg, gl, scale, T, H=H, K=K, BT=CHUNK, BK=BKg, **chunks, **_launch("fwd_gate"))
    kda_fwd_scores_kernel[(NT, CHUNK // TILE, B * H)](
        q, k, G2, beta, Aqk, Mkk, Akk_inv, scale, T,
        H=H, K=K, BT=CHUNK, BC=TILE, BK=_block(K, LAUNCH["fwd_scores"]["BK"]), PREC=PREC, **chunks,
        **_launch("fwd_scores"))
    wu = LAUNCH["fwd_wu"]
    solve_in_wu = wu["per_chunk"] and wu["solve"]  # A⁻¹ inside the one wu program of each chunk
    if not solve_in_wu:
        kda_fwd_solve_kernel[(NT, B * H)](
            beta, Mkk, Akk_inv, T, H=H, BT=CHUNK, BC=TILE, PREC=PREC, **chunks, **_launch("fwd_solve"))
    BKw, BVw = _block(K, wu["BK"]), _block(V, wu["BV"])
    n_blocks = triton.cdiv(K, BKw) + triton.cdiv(V, BVw)  # key blocks then value blocks of a chunk
    per_program = n_blocks if wu["per_chunk"] else 1
    kda_fwd_wu_kernel[(triton.cdiv(n_blocks, per_program), NT, B * H)](
        k, v, G2, beta, Mkk, Akk_inv, w, u, T, H=H, K=K, V=V, BT=CHUNK, BC=TILE, BK=BKw, BV=BVw,
        BLOCKS=per_program, SOLVE=solve_in_wu, PREC=PREC, **chunks, **_launch("fwd_wu"))
    hs = q.new_empty(B, NT, H, K, V)  # state entering each chunk
    v_new = torch.empty_like(v)
    final_state = torch.empty(N, H, K, V, **f32) if output_final_state else None
    BV = _state_block_v("fwd_state", N * H, V)
    kda_fwd_state_kernel[(triton.cdiv(V, BV), N * H)](
        w, u, kg, gl, initial_state, hs, v_new, final_state, T,
        H=H, K=K, V=V, BT=CHUNK, BK=BK, BV=BV, HAS_H0=initial_state is not None,
        STORE_HT=output_final_state, DT=DT, PREC=PREC, **seqs, **_launch("fwd_state"))
    if not need_output:
        return None, final_state, (G2, qg, kg, w, gl, Aqk, Akk_inv, Mkk, hs, v_new)
    o = torch.empty_like(v)
    BV = _block(V, LAUNCH["fwd_output"]["BV"])
    kda_fwd_output_kernel[(NT, triton.cdiv(V, BV), B * H)](
        qg, hs, Aqk, v_new, o, T, H=H, K=K, V=V, BT=CHUNK, BK=_block(K, LAUNCH["fwd_output"]["BK"]), BV=BV,
        DT=DT, PREC=PREC, **chunks, **_launch("fwd_output"))
    return o, final_state, (G2, qg, kg, w, gl, Aqk, Akk_inv, Mkk, hs, v_new)


def kda_backward(q, k, v, g, beta, scale, initial_state, saved, do, dht, packing=None):
    """Run the six backward kernels; returns ``(dq, dk, dv, dg, dbeta, dh0 or None)``."""
    G2, qg, kg, w, gl, Aqk, Akk_inv, Mkk, hs, v_new = saved
    B, T, H, K, V, NT, BK, DT, PREC = _sizes(q, v, packing)
    chunks, seqs, N = _packing_args(packing, B)
    f32 = dict(dtype=torch.float32, device=q.device)
    dP, dM = (torch.empty(B, T, H, CHUNK, **f32) for _ in range(2))
    dv_new = torch.empty_like(v, dtype=torch.float32)  # fp32: in bf16 it doubled the error of dv and dβ
    kda_bwd_dv_local_kernel[(NT, B * H)](
        Aqk, do, v_new, dP, dv_new, scale, T, H=H, V=V, BT=CHUNK, BV=_block(V, LAUNCH["bwd_dv_local"]["BV"]),
        DT=DT, PREC=PREC, **chunks, **_launch("bwd_dv_local"))
    dhs = q.new_empty(B, NT, H, K, V)  # gradient of the state leaving each chunk
    dh0 = torch.empty(N, H, K, V, **f32) if initial_state is not None else None
    BV = _state_block_v("bwd_state", N * H, V)
    kda_bwd_state_kernel[(triton.cdiv(V, BV), N * H)](
        qg, kg, w, gl, do, dht, dhs, dv_new, dh0, T,
        H=H, K=K, V=V, BT=CHUNK, BK=BK, BV=BV, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None,
        DT=DT, PREC=PREC, **seqs, **_launch("bwd_state", fp32=q.dtype == torch.float32))
    dq_p, dk_p, dG_p = (torch.empty(B, T, H, K, **f32) for _ in range(3))
    cfg = LAUNCH["bwd_wy_key"]
    BKw = _block(K, cfg["BK"])
    NK = triton.cdiv(K, BKw)
    dbeta_p = torch.empty(B, T, H, NK, **f32)  # dβ of each key block
    kda_bwd_wy_key_kernel[(NK, NT, B * H)](
        q, k, G2, gl, beta, Akk_inv, hs, dhs, do, v_new, dv_new, dq_p, dk_p, dG_p, dbeta_p, scale, T,
        H=H, K=K, V=V, BT=CHUNK, BK=BKw, BV=_block(V, cfg["BV"]), DT=DT, PREC=PREC, **chunks,
        **_launch("bwd_wy_key"))
    dv, dbeta = torch.empty_like(v), torch.empty_like(beta)
    kda_bwd_wy_value_kernel[(NT, B * H)](
        v, beta, Akk_inv, Mkk, v_new, dv_new, dbeta_p, dv, dbeta, dM, T,
        H=H, V=V, NK=NK, BT=CHUNK, BV=_block(V, LAUNCH["bwd_wy_value"]["BV"]), PREC=PREC, **chunks,
        **_launch("bwd_wy_value"))
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g)
    BKi = _block(K, LAUNCH["bwd_intra"]["BK"])
    kda_bwd_intra_kernel[(triton.cdiv(K, BKi) * (CHUNK // TILE), NT, B * H)](  # a chunk's programs side by side
        q, k, G2, dP, dM, dq_p, dk_p, dG_p, dq, dk, T,  # adds the score terms to dG_p in place
        H=H, K=K, BT=CHUNK, BC=TILE, BK=BKi, PREC=PREC,
        PREC_DIAG=PREC if PREC == "ieee" else LAUNCH["bwd_intra"]["diag_precision"], **chunks, **_launch("bwd_intra"))
    BKg = _block(K, LAUNCH["bwd_dg"]["BK"])
    kda_bwd_dg_kernel[(triton.cdiv(K, BKg), NT, B * H)](
        dG_p, dg, T, H=H, K=K, BT=CHUNK, BK=BKg, **chunks, **_launch("bwd_dg"))
    return dq, dk, dv, dg, dbeta, dh0


# ----------------------------------------------------------------------------------------------
# autograd, as two torch.library custom ops: torch.compile (dynamo, AOTAutograd, inductor) treats
# each as one opaque node with a shape-only fake implementation, so a compiled KDA layer traces
# through the kernels without a graph break (torch >= 2.4: custom_op, register_fake, register_autograd).
# ----------------------------------------------------------------------------------------------
SAVED = ("G2", "qg", "kg", "w", "gl", "Aqk", "Akk_inv", "Mkk", "hs", "v_new")  # what kda_forward saves
_FWD_OUT = tuple[(Tensor,) * (2 + len(SAVED))]  # the schema needs every output spelled out


def _op_packing(cu_seqlens, chunk_indices, chunk_offsets) -> Packing | None:
    return None if cu_seqlens is None else Packing(cu_seqlens, chunk_indices, chunk_offsets)


def _empty(x: Tensor) -> Tensor:
    """The op's stand-in for an absent tensor output (custom ops return no None)."""
    return x.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("k3lab::kda_chunk_fwd", mutates_args=())
def _kda_chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                   initial_state: Optional[Tensor], output_final_state: bool, cu_seqlens: Optional[Tensor],
                   chunk_indices: Optional[Tensor], chunk_offsets: Optional[Tensor]) -> _FWD_OUT:
    """``(o, final_state or an empty tensor, *saved)`` (saved: :data:`SAVED`)."""
    packing = _op_packing(cu_seqlens, chunk_indices, chunk_offsets)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o, final_state, saved = kda_forward(q, k, v, g, beta, scale, initial_state, output_final_state, packing)
    return (o, _empty(q) if final_state is None else final_state, *saved)


@_kda_chunk_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices, chunk_offsets):
    B, H, K, V = q.shape[0], q.shape[2], q.shape[3], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final_state = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else _empty(q)
    return (torch.empty_like(v, memory_format=torch.contiguous_format), final_state,
            *_fake_saved(q, v, chunk_indices))


def _fake_saved(q, v, chunk_indices) -> list[Tensor]:
    """Empty tensors shaped like :data:`SAVED` (the fake implementations' share)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, CHUNK) if chunk_indices is None else chunk_indices.shape[0]
    f32 = dict(dtype=torch.float32, device=q.device)
    scores = [q.new_empty(B, T, H, CHUNK, **f32) for _ in range(3)]  # Aqk, Akk_inv, Mkk
    return [q.new_empty(B, T, H, K, **f32),  # G2
            *(torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(3)),  # qg, kg, w
            q.new_empty(B, NT, H, K, **f32), *scores, q.new_empty(B, NT, H, K, V),  # gl, A.., hs
            torch.empty_like(v, memory_format=torch.contiguous_format)]  # v_new


@torch.library.custom_op("k3lab::kda_chunk_bwd", mutates_args=())
def _kda_chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                   initial_state: Optional[Tensor], saved: list[Tensor], do: Tensor, dht: Optional[Tensor],
                   cu_seqlens: Optional[Tensor], chunk_indices: Optional[Tensor],
                   chunk_offsets: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg, dbeta, dh0 or an empty tensor)``."""
    packing = _op_packing(cu_seqlens, chunk_indices, chunk_offsets)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    saved = [x.contiguous() for x in saved]
    dq, dk, dv, dg, dbeta, dh0 = kda_backward(q, k, v, g, beta, scale, initial_state, tuple(saved),
                                              do.contiguous(), dht, packing)
    return dq, dk, dv, dg, dbeta, _empty(q) if dh0 is None else dh0


@_kda_chunk_bwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, saved, do, dht, cu_seqlens, chunk_indices, chunk_offsets):
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)]
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32) if initial_state is not None else _empty(q)
    return (*grads, dh0)


def _kda_chunk_setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, output_final_state, *packing = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, *output[2:], *packing)
    ctx.scale = scale
    ctx.mark_non_differentiable(*output[2:])  # the saved intermediates are outputs only to reach the backward
    if not output_final_state:
        ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _kda_chunk_backward(ctx, do, dht, *_):
    q, k, v, g, beta, initial_state, *rest = ctx.saved_tensors
    saved, packing = rest[:len(SAVED)], rest[len(SAVED):]
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = _kda_chunk_bwd(
        q, k, v, g, beta, ctx.scale, initial_state, list(saved), do,
        None if dht is None else dht.float().contiguous(), *packing)
    return dq, dk, dv, dg, dbeta, None, dh0 if initial_state is not None else None, None, None, None, None


_kda_chunk_fwd.register_autograd(_kda_chunk_backward, setup_context=_kda_chunk_setup_context)


# The recompute variant: the forward keeps only its inputs (q, k, v, g, β, S₀: ~1.3 KB a token and head
# at K = V = 128 in bf16, against ~4 KB with the intermediates), and the backward re-runs the forward
# kernels but the output one to rebuild :data:`SAVED` before the six backward kernels. Deterministic,
# so the gradients are bit-identical to the saving variant's; it costs one more forward pass of the kernels.
@torch.library.custom_op("k3lab::kda_chunk_fwd_recompute", mutates_args=())
def _kda_chunk_fwd_recompute(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                             initial_state: Optional[Tensor], output_final_state: bool,
                             cu_seqlens: Optional[Tensor], chunk_indices: Optional[Tensor],
                             chunk_offsets: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(o, final_state or an empty tensor)``; nothing else outlives the call."""
    packing = _op_packing(cu_seqlens, chunk_indices, chunk_offsets)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o, final_state, _ = kda_forward(q, k, v, g, beta, scale, initial_state, output_final_state, packing)
    return o, _empty(q) if final_state is None else final_state


@_kda_chunk_fwd_recompute.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices, chunk_offsets):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    final_state = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else _empty(q)
    return torch.empty_like(v, memory_format=torch.contiguous_format), final_state


@torch.library.custom_op("k3lab::kda_chunk_fwd_saved", mutates_args=())
def _kda_chunk_fwd_saved(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                         initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                         chunk_indices: Optional[Tensor], chunk_offsets: Optional[Tensor]) -> list[Tensor]:
    """:data:`SAVED` rebuilt from the inputs (the forward kernels but the output one)."""
    packing = _op_packing(cu_seqlens, chunk_indices, chunk_offsets)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    return list(kda_forward(q, k, v, g, beta, scale, initial_state, False, packing, need_output=False)[2])


@_kda_chunk_fwd_saved.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_indices, chunk_offsets):
    return _fake_saved(q, v, chunk_indices)


def _kda_recompute_setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, output_final_state, *packing = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, *packing)
    ctx.scale = scale
    if not output_final_state:
        ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _kda_recompute_backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, *packing = ctx.saved_tensors
    saved = _kda_chunk_fwd_saved(q, k, v, g, beta, ctx.scale, initial_state, *packing)
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = _kda_chunk_bwd(
        q, k, v, g, beta, ctx.scale, initial_state, saved, do,
        None if dht is None else dht.float().contiguous(), *packing)
    return dq, dk, dv, dg, dbeta, None, dh0 if initial_state is not None else None, None, None, None, None


_kda_chunk_fwd_recompute.register_autograd(_kda_recompute_backward, setup_context=_kda_recompute_setup_context)


def triton_kda_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: Tensor | None = None,
    recompute: bool = False,
) -> tuple[Tensor, Tensor | None]:
    r"""Chunkwise KDA on Triton kernels, differentiable in q, k, v, g, beta and initial_state.

    Computes, per head, ``S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ`` and
    ``o_t = scale · S_tᵀ q_t`` (docs/k3_reference.md §2.2) in chunks of 64 tokens with 16-token tiles (§2.3).

    Args:
        q, k: ``[B, T, H, K]``, L2-normalised. v: ``[B, T, H, V]`` (same dtype: bf16, fp16 or fp32).
        g: ``[B, T, H, K]`` log-decay in ``[−5, 0]`` (K3's lower-bounded gate; not checked here, to keep the
            call free of host syncs: below about −5.9 the tile factors overflow and the outputs are NaN —
            the KDA layer guarantees the bound). beta: ``[B, T, H]`` in (0, 1).
        scale: defaults to ``K ** -0.5``. initial_state: ``[B, H, K, V]`` (read in fp32).
        output_final_state: also return the state after the last token.
        cu_seqlens: packed sequences (fla's convention), int32/int64 ``[N + 1]`` on the inputs' device with
            ``0 = cu_seqlens[0] < ... < cu_seqlens[N] = T``: the inputs are ``[1, T, ...]`` and sequence n is
            tokens ``cu_seqlens[n] .. cu_seqlens[n+1] − 1``, chunked on its own; no state crosses a boundary.
            ``initial_state`` and the final state are then ``[N, H, K, V]`` (one host sync to build the chunk index).
        recompute: keep only the inputs for backward and re-run the forward kernels there (saves ~2.8 KB a
            token and head at K = V = 128 in bf16; same gradients bit for bit, one more kernel forward).
    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] (packed: [N, H, K, V]) fp32 or None)``.
    """
    bounds = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    packing = None if bounds is None else pack_chunks(bounds, q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    op = _kda_chunk_fwd_recompute if recompute else _kda_chunk_fwd
    o, final_state, *_ = op(q, k, v, g, beta, scale, initial_state, bool(output_final_state),
                            *(packing if packing is not None else (None, None, None)))
    return o, final_state if output_final_state else None


def kda_decode_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None,
    scale: float | None = None,
    out_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""One fused recurrent step for generation (forward only): ``T`` must be 1.

    Args:
        q, k, g: ``[B, 1, H, K]``; v: ``[B, 1, H, V]``; beta: ``[B, 1, H]``; state: ``[B, H, K, V]``
        or None (zeros). Same conventions as :func:`triton_kda_chunk`.
        out_state: where to write the new state (contiguous fp32 ``[B, H, K, V]``); it may be ``state``
        itself — each program loads its ``[K, BV]`` tile before storing it, so the step runs in place
        (graphed decoding keeps one state buffer). None: a new tensor.
    Returns:
        ``(o [B, 1, H, V] in v.dtype, new_state [B, H, K, V] fp32)``; ``state`` is not modified unless it
        is ``out_state``.
    """
    if isinstance(q, Tensor) and q.dim() == 4 and q.shape[1] != 1:
        raise ValueError(f"kda_decode_step takes one token, q [B, 1, H, K] (T == 1); got {tuple(q.shape)}; "
                         "use triton_kda_chunk for prefill")
    _check_inputs(q, k, v, g, beta, state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if state is not None:
        state = state.float().contiguous()
    o = torch.empty_like(v)
    if out_state is None:
        new_state = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    elif out_state.shape != (B, H, K, V) or out_state.dtype != torch.float32 or not out_state.is_contiguous():
        raise ValueError(f"out_state must be a contiguous float32 [B, H, K, V] = {(B, H, K, V)} tensor, got "
                         f"{out_state.dtype} {tuple(out_state.shape)}")
    else:
        new_state = out_state
    BV = _block(V, LAUNCH["decode"]["BV"])
    kda_decode_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, beta, state, o, new_state, scale,
        H=H, K=K, V=V, BK=_block(K, MAX_HEAD_DIM), BV=BV, HAS_STATE=state is not None, **_launch("decode"))
    return o, new_state
