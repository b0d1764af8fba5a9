"""A small-batch GEMV for decoding: ``y = x Wᵀ + b`` for at most :data:`GEMV_MAX_ROWS` rows of x, in Triton.

For x [N, K] (N ≤ 16: the tokens of one decode step), W [M, K] (an ``nn.Linear`` weight) and b [M] or none::

    y[n, m] = round( Σ_k x[n, k] · W[m, k]  +  b[m] )        products and sums in float32,
                                                              one rounding to x's dtype (bf16, fp16 or fp32)

:func:`small_linear_reference` is the same math with plain torch ops (``x.float() @ W.float()ᵀ + b``, cast);
:func:`k3lab.linear.linear` is the entry the model calls (it sends calls here on backend ``triton``, CUDA, no
gradient needed, N ≤ 16, and to ``F.linear`` otherwise).

**Why.** A decode step of the ``small`` preset at batch 1 makes ~140 such products. cuBLAS runs each as a GEMM
of one row (~6.5 µs on an H100) where reading W once at full bandwidth takes ~1 µs. A decode GEMV is a
read of W: the arithmetic (N multiply-adds per weight element) is free next to it.

**Design.** Each program owns ``BLOCK_M`` outputs (rows of W) and one K-split: it walks its split in tiles of
``BLOCK_K``, loads each [BLOCK_M, BLOCK_K] tile of W **once** and multiplies it with all N rows of x at once —
N padded to ``N_PAD``, a power of two ≥ 1 and a compile-time constant, the padded rows masked — accumulating the
[N_PAD, BLOCK_M] dot products in float32. Every weight element is read from memory exactly once per call.

**Split-K.** A layer with few outputs (M = 512 at ``small``: 8 programs of 64 rows) would leave most of the
GPU's SMs idle, and one program would walk all of K. So K is cut into S splits, S chosen from M, K and the SM
count (:func:`num_k_splits`, a pure function of shapes) to give about ``programs_per_sm`` × SMs programs; where
even one K tile a split is not enough, :func:`launch_config` narrows ``BLOCK_M`` first.

**Deterministic.** With S > 1 each program writes its float32 partial sums to a buffer [S, N, M] and a second,
tiny kernel adds the S partials of each output in the fixed order s = 0..S-1, adds the bias and rounds once —
no atomics, so a call gives the same bits every time (and a graph replay the eager call's bits). With S = 1 the
first kernel adds the bias, rounds and writes y itself. The launch depends on N only through N_PAD, so a row's
bits are the same in every call of the same N_PAD: the static decoder, which pads a batch to a power-of-two
bucket, gets the eager decoder's numbers. bf16 outputs round to nearest even in integer ops
(:func:`k3lab.kernels.rounding.bf16_round_nearest_even`: the bits of ``Tensor.to(torch.bfloat16)``, on the GPU and
under ``TRITON_INTERPRET=1``).

**CUDA graphs and torch.compile.** The split count depends on shapes and the device's SM count only (read
once per device on the host); nothing is read back from the device, so the call is capturable (warm it up —
Triton compiles — before capture, as any Triton kernel). Under ``torch.compile`` :func:`small_linear` calls a
``torch.library`` custom op (``k3lab::small_linear``, with a fake implementation): one opaque node; eager calls
launch the kernels directly (no custom-op dispatch on the decode path).

**Inference only.** There is no backward: :func:`small_linear` refuses (ValueError) a call where autograd
would need one — grad mode on and x, W or b requiring grad — and :func:`k3lab.linear.linear` never sends one.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set before triton is imported): the tests.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from k3lab.kernels.mla_decode import sm_count
from k3lab.kernels.rounding import bf16_round_if

Tensor = torch.Tensor

ENABLED = True  # k3lab.linear.linear sends eligible calls here (on since the GPU suite and
# `kernels/bench_generate.py` ran with it on, issue 36); False: F.linear everywhere (the reference path)
GEMV_MAX_ROWS = 16  # rows of x (tokens) a call takes: a decode step's batch (× draft tokens)
GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # x, W and b share one of these
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Launch parameters (chosen without GPU timings yet; re-time on a GPU before trusting them):
#   product_elems:   N_PAD·BLOCK_M·BLOCK_K, the float32 products a program holds per tile (64 a thread at 4 warps)
#   block_k:         K a tile: 128 (bf16: 256-byte rows) for N_PAD ≤ 4, 64 above (the product budget)
#   max_block_m:     outputs a program at most
#   min_block_m:     outputs a program at least (BLOCK_M halves down to it while programs are too few)
#   programs_per_sm: split-K (and BLOCK_M) aim at about this many programs per SM
#   max_splits:      split-K at most this many ways
LAUNCH = dict(product_elems=8192, block_k_small_n=128, block_k_large_n=64, max_block_m=64, min_block_m=8,
              programs_per_sm=3, max_splits=64, num_warps=4, reduce_block=256)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def small_linear_kernel(X, W, BIAS, OUT, PART, N, M, K, stride_xn, split_k,
                        N_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BF16: tl.constexpr):
    """One (block of BLOCK_M outputs, K-split): acc[n, m] = Σ_{k in the split} x[n, k] · W[m, k] in float32.
    SPLIT: write acc to PART[split] (the reduce kernel finishes); else add the bias, round, write OUT."""
    i_m, i_s = tl.program_id(0), tl.program_id(1)
    offs_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)                                    # [BM] outputs
    offs_n = tl.arange(0, N_PAD)                                                      # [NP] rows of x
    m_ok, n_ok = offs_m < M, offs_n < N
    w_rows = W + offs_m.to(tl.int64)[:, None] * K                                     # [BM, 1] row starts of W
    x_rows = X + offs_n.to(tl.int64)[:, None] * stride_xn                             # [NP, 1]
    lo = i_s * split_k
    hi = tl.minimum(lo + split_k, K)
    acc = tl.zeros((N_PAD, BLOCK_M), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)                                           # [BK]
        k_ok = offs_k < hi
        w = tl.load(w_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]: once
        x = tl.load(x_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [NP, BK]
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]            # [NP, BM, BK]
        acc += tl.sum(prod, axis=2)                                                   # [NP, BM]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        part = PART + i_s.to(tl.int64) * N * M
        tl.store(part + offs_n[:, None] * M + offs_m[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_m, mask=m_ok, other=0.0).to(tl.float32)[None, :]
        y = bf16_round_if(acc, BF16).to(OUT.dtype.element_ty)
        tl.store(OUT + offs_n[:, None] * M + offs_m[None, :], y, mask=mask)


@triton.jit
def small_linear_reduce_kernel(PART, BIAS, OUT, NM, M, S, HAS_BIAS: tl.constexpr, BF16: tl.constexpr,
                               BLOCK: tl.constexpr):
    """OUT[i] = round(Σ_{s=0..S-1} PART[s, i] + bias[i mod M]) over the N·M outputs i, in the order s = 0, 1, …"""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                             # [BLOCK] flat n·M + m
    ok = offs < NM
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(PART + s * NM + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs % M, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + offs, bf16_round_if(acc, BF16).to(OUT.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------
# host side: shapes -> launch (no data read)
# ----------------------------------------------------------------------------------------------
def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def launch_config(N: int, M: int, K: int, sms: int) -> dict:
    """``N_PAD``, ``BLOCK_M``, ``BLOCK_K`` for x [N, K] and W [M, K] on ``sms`` SMs (shapes only): N padded to a
    power of two; ``BLOCK_K`` by N_PAD; ``BLOCK_M`` as wide as the product budget allows (N_PAD·BLOCK_M·BLOCK_K
    ≤ ``product_elems``), then halved (down to ``min_block_m``) while the output blocks times the K tiles — the
    most programs split-K can make — are fewer than the target ``programs_per_sm · sms``; blocks no wider than
    M and K need (tiny shapes: small tiles)."""
    n_pad = _pow2(N)
    block_k = LAUNCH["block_k_small_n"] if n_pad <= 4 else LAUNCH["block_k_large_n"]
    block_k = min(block_k, _pow2(K, 16))
    block_m = LAUNCH["product_elems"] // (n_pad * block_k)
    block_m = max(LAUNCH["min_block_m"], min(block_m, LAUNCH["max_block_m"], _pow2(M, LAUNCH["min_block_m"])))
    tiles, target = triton.cdiv(max(K, 1), block_k), LAUNCH["programs_per_sm"] * sms
    while block_m > LAUNCH["min_block_m"] and triton.cdiv(max(M, 1), block_m) * tiles < target:
        block_m //= 2
    return dict(N_PAD=n_pad, BLOCK_M=block_m, BLOCK_K=block_k)


@functools.lru_cache(maxsize=None)
def _nearest_splits(blocks: int, tiles: int, target: int, max_splits: int) -> int:
    best = 1
    for per_split in range(tiles, 0, -1):  # S = ⌈tiles / per_split⌉ grows as per_split falls
        splits = triton.cdiv(tiles, per_split)
        if splits > max_splits:
            break
        if abs(splits * blocks - target) < abs(best * blocks - target):  # ties: fewer splits
            best = splits
    return best


def num_k_splits(M: int, K: int, block_m: int, block_k: int, sms: int) -> tuple[int, int]:
    """(S, split_k): K cut into S splits of ``split_k`` (whole ``block_k`` tiles; the last may be shorter).

    A pure function of shapes and the SM count: with ``B = ⌈M / block_m⌉`` output blocks, ``T = ⌈K / block_k⌉``
    tiles and the target ``P = programs_per_sm · sms`` programs (3 per SM: between the 2 and 4 that fill an
    H100 without long tails), S is the split count — whole tiles a split, none empty, at most ``max_splits`` —
    whose program count S·B is nearest P (ties: fewer splits). So a layer with B ≥ 2P/3 output blocks runs
    unsplit, and one with few blocks is split as far as K's tiles allow. Cached: the host work of a call is a
    dictionary lookup."""
    blocks, tiles = triton.cdiv(max(M, 1), block_m), triton.cdiv(max(K, 1), block_k)
    splits = _nearest_splits(blocks, tiles, LAUNCH["programs_per_sm"] * sms, LAUNCH["max_splits"])
    per_split = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, per_split), per_split * block_k


def _forced_splits(K: int, block_k: int, splits: int) -> tuple[int, int]:
    """(S, split_k) for a requested ``splits`` (tests): whole tiles a split, no empty split."""
    split_k = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    return triton.cdiv(K, split_k), split_k


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, splits: int | None) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_MAX_ROWS or x.shape[1] < 1:
        raise ValueError(f"x must be a [N, K] tensor with 1 <= N <= GEMV_MAX_ROWS={GEMV_MAX_ROWS}, K >= 1; "
                         f"got {_describe(x)}")
    if x.dtype not in GEMV_DTYPES:
        raise ValueError(f"x dtype {x.dtype}: allowed values are {GEMV_DTYPES}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dim; got strides {x.stride()}")
    if (not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] < 1
            or weight.dtype != x.dtype or weight.device != x.device or not weight.is_contiguous()):
        raise ValueError(f"weight must be a contiguous [M, K={x.shape[1]}] {x.dtype} tensor on {x.device}, M >= 1; "
                         f"got {_describe(weight)}")
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (weight.shape[0],) or bias.dtype != x.dtype
                             or bias.device != x.device or not bias.is_contiguous()):
        raise ValueError(f"bias must be None or a contiguous [M={weight.shape[0]}] {x.dtype} tensor on {x.device}; "
                         f"got {_describe(bias)}")
    if splits is not None and (type(splits) is not int or splits < 1):
        raise ValueError(f"splits={splits!r}: must be None (automatic) or an int >= 1")
    if torch.is_grad_enabled():
        for name, t in (("x", x), ("weight", weight), ("bias", bias)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad with grad mode on: small_linear is inference-only (no "
                                 "backward); call it under torch.no_grad() or use torch.nn.functional.linear")
    if not (x.is_cuda or INTERPRET):
        raise ValueError(f"x on {x.device}: small_linear runs on CUDA (or on CPU under TRITON_INTERPRET=1)")


def _run(x: Tensor, weight: Tensor, bias: Tensor | None, splits: int) -> Tensor:
    N, K = x.shape
    M = weight.shape[0]
    out = torch.empty(N, M, dtype=x.dtype, device=x.device)                          # [N, M]
    sms = sm_count(x.device)
    cfg = launch_config(N, M, K, sms)
    if splits > 0:
        S, split_k = _forced_splits(K, cfg["BLOCK_K"], splits)
    else:
        S, split_k = num_k_splits(M, K, cfg["BLOCK_M"], cfg["BLOCK_K"], sms)
    part = torch.empty(S, N, M, dtype=torch.float32, device=x.device) if S > 1 else out  # [S, N, M] partials
    has_bias, bf16 = bias is not None, x.dtype == torch.bfloat16
    warps = {} if INTERPRET else dict(num_warps=LAUNCH["num_warps"])
    small_linear_kernel[(triton.cdiv(M, cfg["BLOCK_M"]), S)](
        x, weight, bias if has_bias else weight, out, part, N, M, K, x.stride(0), split_k,
        **cfg, HAS_BIAS=has_bias, SPLIT=S > 1, BF16=bf16, **warps)
    if S > 1:
        block = LAUNCH["reduce_block"]
        small_linear_reduce_kernel[(triton.cdiv(N * M, block),)](
            part, bias if has_bias else part, out, N * M, M, S, HAS_BIAS=has_bias, BF16=bf16, BLOCK=block, **warps)
    return out


@torch.library.custom_op("k3lab::small_linear", mutates_args=())
def _small_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None, splits: int) -> Tensor:
    return _run(x, weight, bias, splits)


@_small_linear_op.register_fake
def _(x, weight, bias, splits):
    return x.new_empty(x.shape[0], weight.shape[0])


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------
def small_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, splits: int | None = None) -> Tensor:
    """``x Wᵀ + b`` for a few rows (the module docstring has the math): x [N, K] with 1 ≤ N ≤ 16 (a contiguous
    last dim), weight [M, K] and bias [M] or None (contiguous), all one dtype of :data:`GEMV_DTYPES` on one CUDA
    device. Returns [N, M] in x's dtype: float32 products and sums, bias added in float32, one rounding.

    splits: None picks the K-split from the shapes and the SM count (:func:`num_k_splits`); an int forces
    about that many (tests). Inference only: a call that would need a backward raises ValueError."""
    _check(x, weight, bias, splits)
    if torch.compiler.is_compiling():  # an opaque node in the compiled graph
        return _small_linear_op(x, weight, bias, int(splits or 0))
    return _run(x, weight, bias, int(splits or 0))  # eager: the kernels directly


def small_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same math with plain torch ops (any device, any leading dims of x): ``(x.float() @ W.float()ᵀ + b)``,
    then cast to x's dtype.

    Rounding: bf16 and fp16 products are exact in float32 (significands of 8 and 11 bits: products of at most
    22); the sums run in float32 (the order is the library's: cuBLAS and the kernel sum in other orders, a few
    float32 ulps apart); the bias is added in float32; the result is rounded once, to nearest even, to x's dtype
    — within half an ulp of x's dtype (plus the float32 sum's error) of the exact value. Two such results can
    differ by one ulp of x's dtype where the float32 sum lies next to a rounding midpoint; in float32 they agree
    to float32 rounding."""
    out = x.float() @ weight.float().T                                               # [..., M] float32
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


__all__ = ["ENABLED", "GEMV_MAX_ROWS", "GEMV_DTYPES", "LAUNCH", "launch_config", "num_k_splits", "small_linear",
           "small_linear_reference"]
