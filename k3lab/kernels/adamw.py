"""One fused AdamW step on float32 master weights from bf16 gradients, writing the bf16 weights back
(``TrainConfig.param_dtype="bfloat16"``: :class:`k3lab.precision.MasterWeightOptimizer` uses it on CUDA).

Per element, with ``c`` the gradient-clip coefficient (a 0-d float32 tensor on the device: no host read),
learning rate ``lr``, betas ``β1, β2``, ``ε``, weight decay ``λ`` and the parameter's step ``t``::

    g ← c · float32(ĝ)                                  ĝ: the bf16 gradient of the bf16 weight p
    w ← w · (1 − lr·λ)
    m ← β1·m + (1 − β1)·g
    v ← β2·v + (1 − β2)·g²
    w ← w − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + ε)
    p ← bf16(w)                                         round to nearest even

— ``torch.optim.AdamW``'s update, in the order of operations of its fused CUDA kernel, applied to the
master ``w`` after ``w.grad = c·float32(ĝ)``. One pass: it reads ĝ, w, m, v and writes w, m, v, p
(28 bytes a parameter), where converting the gradient, clipping it, stepping and copying back are four
passes over 40 bytes a parameter. Equal to that reference path within float32 rounding (tested under
``TRITON_INTERPRET=1`` on the CPU and on CUDA).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor
BLOCK = 2048  # elements per program (8 per thread at 8 warps)


@triton.jit
def _master_adamw_kernel(w_ptr, g_ptr, m_ptr, v_ptr, p_ptr, clip_ptr, n, decay, beta1, beta2, eps, step_size,
                         bc2_sqrt, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(clip_ptr)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0) * decay
    m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + (1.0 - beta1) * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0) + (1.0 - beta2) * g * g
    w = w - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(w_ptr + offs, w, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(p_ptr + offs, _bf16_round_nearest_even(w), mask=mask)


@triton.jit
def _bf16_round_nearest_even(x):
    """float32 -> bf16, round to nearest even (as ``Tensor.to(torch.bfloat16)``), in integer ops: the same
    bits as the hardware conversion, and also under TRITON_INTERPRET=1 (whose own conversion truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


def master_adamw_step_(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, param: Tensor,
                       clip: Tensor, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                       step: int) -> None:
    """The update of the module docstring, in place on ``master``, ``exp_avg``, ``exp_avg_sq`` (float32)
    and ``param`` (bf16), from ``grad`` (bf16) and ``clip`` (0-d float32); ``step`` = t, counted from 1.

    All five tensors must have one shape, be contiguous and on ``clip``'s device (ValueError naming the
    argument otherwise).
    """
    if step < 1:
        raise ValueError(f"step={step}: AdamW steps count from 1")
    for name, t, dtype in (("master", master, torch.float32), ("exp_avg", exp_avg, torch.float32),
                           ("exp_avg_sq", exp_avg_sq, torch.float32), ("grad", grad, torch.bfloat16),
                           ("param", param, torch.bfloat16)):
        if t.shape != master.shape or t.dtype != dtype or not t.is_contiguous() or t.device != clip.device:
            raise ValueError(f"master_adamw_step_: {name} must be a contiguous {dtype} tensor of shape "
                             f"{tuple(master.shape)} on {clip.device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    if clip.numel() != 1 or clip.dtype != torch.float32:
        raise ValueError(f"master_adamw_step_: clip must be a one-element float32 tensor, got {clip.dtype} "
                         f"{tuple(clip.shape)}")
    n = master.numel()
    if n == 0:
        return
    _master_adamw_kernel[(triton.cdiv(n, BLOCK),)](
        master, grad, exp_avg, exp_avg_sq, param, clip, n, 1.0 - lr * weight_decay, beta1, beta2, eps,
        lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step), BLOCK=BLOCK, num_warps=8)
