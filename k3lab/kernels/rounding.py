"""Rounding to bf16 inside Triton kernels, in integer operations: the bits ``Tensor.to(torch.bfloat16)`` gives,
on the GPU and also under ``TRITON_INTERPRET=1`` (whose own float32 -> bf16 conversion truncates). Shared by the
fused AdamW, the AttnRes mix, the MoE row kernels and the decode kernels."""

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float32)  # what the kernels read and write: bf16 (rounded as below) or float32


@triton.jit
def bf16_round_nearest_even(x):
    """float32 -> bf16, round to nearest even (as ``Tensor.to(torch.bfloat16)``), in integer ops: the same
    bits as the hardware conversion, and also under TRITON_INTERPRET=1 (whose own conversion truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def bf16_round_if(x, BF16: tl.constexpr):
    """float32 ``x`` rounded to nearest even bf16 when ``BF16`` (a bf16 output), else ``x`` as it is."""
    if BF16:
        return bf16_round_nearest_even(x)
    else:
        return x


@triton.jit
def bf16_round_if_f32(x, BF16: tl.constexpr):
    """float32 ``x`` rounded to nearest even bf16 and held in float32 when ``BF16`` (a rounding point inside a kernel
    that goes on computing in float32), else ``x`` as it is."""
    if BF16:
        return bf16_round_nearest_even(x).to(tl.float32)
    else:
        return x
