"""The MoE's two row-moving sums, fused: the backward of the dispatch and the combine, forward and backward
(:class:`k3lab.moe.latent.LocalDispatcher` takes them on backend ``triton``).

N tokens, k slots each (slot ``n·k + j``: token n's j-th expert), S = N·k slot rows of width L, sorted by
expert; ``inv`` [N·k] the inverse of the dispatch's sort (``inv[n·k + j]``: where slot ``n·k + j``'s row
sits among the sorted rows). In float32::

    dispatch backward   x̄[n]       = Σ_j ȳ[inv[n·k + j]]                      (gather_sum: ȳ [S, L] -> [N, L])
    combine             u[n]       = Σ_j p[n, j] · y[inv[n·k + j]]             (y [S, L], p [N, k] -> u [N, L])
    combine backward    ȳ[inv[n·k+j]] = p[n, j] · ū[n]                         (rounded to y's dtype)
                        p̄[n, j]    = Σ_l y[inv[n·k + j], l] · ū[n, l]

The reference (:meth:`LocalDispatcher.combine`, :class:`~k3lab.moe.latent.DispatchRows`) moves the rows
first — ``index_copy`` of y into a zeroed ``[N·k, L]`` slot-order copy, or ``index_select`` of ȳ — and
sums over k after. Here each program gathers its tokens' k rows straight from the sorted buffer: the
combine reads y once and writes u, its backward reads y and ū and writes ȳ and p̄, the dispatch's
backward reads ȳ and writes x̄ — no slot-order copy, no zero fill, no scatter (``inv`` is a
permutation: every row of ȳ is written exactly once). Sums run in float32 in the order j = 0..k-1
(the reference's may differ: equal within float32 rounding). What the combine saves for backward is y
itself, as the reference saves its slot-order copy: the same bytes.

Each op is a ``torch.library`` custom op (an opaque node for torch.compile, captured by CUDA graphs:
no host reads). bf16 outputs round to nearest even in integer ops (the same bits under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.kernels.rounding import DTYPES, bf16_round_if

Tensor = torch.Tensor
BLOCK_N = 16  # tokens a program


@triton.jit
def _gather_sum_kernel(G, INV, OUT, N, L, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
                       BF16: tl.constexpr):
    """OUT[n] = Σ_j G[INV[n·k + j]]: a grid of (token blocks, width blocks)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                       # [BLOCK_N] tokens
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)                       # [BLOCK_L]
    row_ok = rows < N
    mask = row_ok[:, None] & (cols < L)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_L), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        src = tl.load(INV + rows * TOP_K + j, mask=row_ok, other=0)                # [BLOCK_N] sorted row
        acc += tl.load(G + src[:, None] * L + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + rows[:, None] * L + cols[None, :], bf16_round_if(acc, BF16), mask=mask)


@triton.jit
def _combine_fwd_kernel(Y, INV, P, U, N, L, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    """U[n] = Σ_j P[n, j] · Y[INV[n·k + j]] in float32."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < N
    mask = row_ok[:, None] & (cols < L)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_L), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        src = tl.load(INV + rows * TOP_K + j, mask=row_ok, other=0)
        p = tl.load(P + rows * TOP_K + j, mask=row_ok, other=0.0)                   # [BLOCK_N] float32
        y = tl.load(Y + src[:, None] * L + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += p[:, None] * y
    tl.store(U + rows[:, None] * L + cols[None, :], acc, mask=mask)


@triton.jit
def _combine_bwd_kernel(Y, INV, P, DU, DY, DP, N, L, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BF16: tl.constexpr):
    """DY[INV[n·k + j]] = P[n, j] · DU[n];  DP[n, j] = Σ_l Y[INV[n·k + j], l] · DU[n, l]: one program per
    token block, walking the width (the k dot products stay in registers)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    slots = tl.arange(0, BLOCK_K)                                                    # [BLOCK_K] j
    dp = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        mask = row_ok[:, None] & (cols < L)[None, :]
        du = tl.load(DU + rows[:, None] * L + cols[None, :], mask=mask, other=0.0)  # [BLOCK_N, BLOCK_L] float32
        for j in tl.static_range(TOP_K):
            src = tl.load(INV + rows * TOP_K + j, mask=row_ok, other=0)
            p = tl.load(P + rows * TOP_K + j, mask=row_ok, other=0.0)
            offs = src[:, None] * L + cols[None, :]
            y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
            dp += tl.where(slots[None, :] == j, tl.sum(y * du, 1)[:, None], 0.0)
            tl.store(DY + offs, bf16_round_if(p[:, None] * du, BF16), mask=mask)
    tl.store(DP + rows[:, None] * TOP_K + slots[None, :], dp, mask=row_ok[:, None] & (slots < TOP_K)[None, :])


def _block_l(L: int) -> int:
    return min(triton.next_power_of_2(L), 256)


def _grid(N: int, L: int):
    return (triton.cdiv(N, BLOCK_N), triton.cdiv(L, _block_l(L)))


# ----------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile) and their autograd
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("k3lab::moe_gather_sum", mutates_args=())
def _gather_sum(rows: Tensor, inverse: Tensor, top_k: int) -> Tensor:
    S, L = rows.shape
    N = S // top_k
    out = rows.new_empty(N, L)
    if N:
        _gather_sum_kernel[_grid(N, L)](rows, inverse, out, N, L, TOP_K=top_k, BLOCK_N=BLOCK_N,
                                        BLOCK_L=_block_l(L), BF16=rows.dtype == torch.bfloat16)
    return out


@_gather_sum.register_fake
def _(rows, inverse, top_k):
    return rows.new_empty(rows.shape[0] // top_k, rows.shape[1])


@torch.library.custom_op("k3lab::moe_combine", mutates_args=())
def _combine(rows: Tensor, inverse: Tensor, weight: Tensor) -> Tensor:
    N, k = weight.shape
    L = rows.shape[1]
    out = rows.new_empty(N, L, dtype=torch.float32)
    if N:
        _combine_fwd_kernel[_grid(N, L)](rows, inverse, weight, out, N, L, TOP_K=k, BLOCK_N=BLOCK_N,
                                         BLOCK_L=_block_l(L))
    return out


@_combine.register_fake
def _(rows, inverse, weight):
    return rows.new_empty(weight.shape[0], rows.shape[1], dtype=torch.float32)


@torch.library.custom_op("k3lab::moe_combine_bwd", mutates_args=())
def _combine_bwd(rows: Tensor, inverse: Tensor, weight: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    N, k = weight.shape
    L = rows.shape[1]
    d_rows, d_weight = torch.empty_like(rows), torch.empty_like(weight)
    if N:
        _combine_bwd_kernel[(triton.cdiv(N, BLOCK_N),)](
            rows, inverse, weight, grad.contiguous(), d_rows, d_weight, N, L, TOP_K=k,
            BLOCK_K=triton.next_power_of_2(k), BLOCK_N=BLOCK_N, BLOCK_L=_block_l(L), BF16=rows.dtype == torch.bfloat16)
    return d_rows, d_weight


@_combine_bwd.register_fake
def _(rows, inverse, weight, grad):
    return torch.empty_like(rows), torch.empty_like(weight)


def _combine_setup_context(ctx, inputs, output):
    rows, inverse, weight = inputs
    ctx.save_for_backward(rows, inverse, weight)


def _combine_backward(ctx, grad):
    rows, inverse, weight = ctx.saved_tensors
    d_rows, d_weight = _combine_bwd(rows, inverse, weight, grad)
    return d_rows, None, d_weight


_combine.register_autograd(_combine_backward, setup_context=_combine_setup_context)


# ----------------------------------------------------------------------------------------------
# entry points (checked inputs)
# ----------------------------------------------------------------------------------------------
def _check_rows(rows: Tensor, inverse: Tensor, top_k: int) -> None:
    if not isinstance(rows, Tensor) or rows.dim() != 2 or rows.dtype not in DTYPES or not rows.is_contiguous():
        got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, Tensor) else type(rows).__name__
        raise ValueError(f"rows must be a contiguous [S, L] tensor of dtype in {DTYPES}; got {got}")
    if not isinstance(top_k, int) or top_k < 1 or rows.shape[0] % top_k:
        raise ValueError(f"top_k={top_k!r}: must be an int >= 1 dividing the {rows.shape[0]} rows")
    if (not isinstance(inverse, Tensor) or inverse.dtype != torch.int64 or inverse.shape != (rows.shape[0],)
            or inverse.device != rows.device or not inverse.is_contiguous()):
        got = f"{inverse.dtype} {tuple(inverse.shape)} on {inverse.device}" if isinstance(inverse, Tensor) else type(inverse).__name__
        raise ValueError(f"inverse must be a contiguous int64 permutation [{rows.shape[0]}] on {rows.device}; got {got}")


def gather_sum(rows: Tensor, inverse: Tensor, top_k: int) -> Tensor:
    """``out[n] = Σ_j rows[inverse[n·k + j]]`` in float32, in ``rows``' dtype: rows [S, L] sorted by expert,
    inverse [S] int64 (slot -> sorted row), k = ``top_k`` -> [S / k, L]. Not differentiable (the dispatch's backward)."""
    _check_rows(rows, inverse, top_k)
    return _gather_sum(rows, inverse, top_k)


def combine_rows(rows: Tensor, inverse: Tensor, weight: Tensor) -> Tensor:
    """``u[n] = Σ_j weight[n, j] · rows[inverse[n·k + j]]`` in float32: rows [S, L] (bf16 or float32, sorted
    by expert), inverse [S] int64, weight [N, k] float32 -> u [N, L] float32. Differentiable w.r.t. rows and weight."""
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.dtype != torch.float32:
        got = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a float32 [N, k] tensor; got {got}")
    _check_rows(rows, inverse, weight.shape[1])
    if weight.shape[0] * weight.shape[1] != rows.shape[0] or weight.device != rows.device:
        raise ValueError(f"weight {tuple(weight.shape)} on {weight.device}: needs N·k = {rows.shape[0]} rows' "
                         f"slots, on {rows.device}")
    return _combine(rows, inverse, weight.contiguous())
