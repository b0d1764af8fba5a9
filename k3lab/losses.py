"""Cross-entropy through the LM head without materialising ``[N, V]`` fp32 logits for backward.

For hidden rows h_n [D], the head W [V, D] and labels y_n (``-100`` = ignored)::

    z_n    = W h_n                                 logits [V], upcast to fp32
    lse_n  = log Σ_v exp(z_nv)
    loss   = Σ_{n: y_n ≠ -100} (lse_n − z_{n,y_n}) / M        M = num_valid, or this call's valid count (≥ 1)

    dz_n   = g/M · (softmax(z_n) − onehot(y_n))   (0 for ignored rows; g = upstream grad of loss)
    dh_n   = W^T dz_n,      dW = Σ_n dz_n h_n^T

:func:`linear_cross_entropy` evaluates this in row chunks of ``chunk_size``: the forward keeps only
``hidden`` (in the compute dtype) and the labels; the backward recomputes each chunk's logits and
log-softmax (transient: a few ``[chunk, V]`` fp32 buffers). The reference path
``F.cross_entropy(F.linear(h, W).float(), y)`` keeps the fp32 log-softmax [N, V] for backward: 4 bytes
per token per vocab entry (640 KiB a token at K3's V = 163840; 16 KiB at the small preset's 4096).

Compute dtype: the autocast dtype when autocast is on for hidden's device (as ``F.linear`` would run),
else the inputs' dtype (hidden and weight must then agree). dhidden comes back in hidden's dtype, dW
in weight's dtype, accumulated over chunks in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
DEFAULT_CHUNK_ELEMENTS = 2 ** 26  # logits per chunk: 256 MiB in fp32 (K3's V: 409 rows; V = 4096: 16384 rows)


def loss_divisor(labels: Tensor, num_valid: int | Tensor | None) -> Tensor | int:
    """The divisor of the summed CE: ``num_valid`` (at least 1; an int, or a 0-d tensor that a captured step
    refills before each replay) or this call's labels != -100 (at least 1, a 0-d tensor: no host sync), as
    :func:`k3lab.model.masked_cross_entropy`."""
    if num_valid is None:
        return (labels != IGNORE_INDEX).sum().clamp_min(1)
    if isinstance(num_valid, Tensor):
        return num_valid.clamp_min(1)
    return max(int(num_valid), 1)


def _matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} != weight dtype {weight.dtype} (and autocast is off)")
    return hidden.dtype


def _accumulate(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc [M, K] fp32 += a [M, n] @ b [n, K]: on CUDA with bf16/fp16 operands one GEMM with an fp32 output
    (``addmm`` with ``out_dtype``, no bf16 rounding of the chunk's product), else ``acc += (a @ b).float()``."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    acc += (a @ b).float()


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Summed CE of ``hidden @ weight.T`` over labels != -100, chunked over rows (module docstring).

    forward(hidden [N, D], weight [V, D], labels [N] int64, chunk_size, dtype) -> loss sum (0-d fp32).
    Saves hidden (cast to ``dtype``), weight (the tensor given, a parameter: no copy) and labels. Each
    chunk runs the reference's own kernels (``log_softmax``, ``nll_loss``, ``_log_softmax_backward_data``),
    so per-row fp32 logit gradients equal ``F.cross_entropy``'s bit for bit; only the chunk sums of
    the loss and of dW round differently.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int, dtype: torch.dtype) -> Tensor:
        h, w = hidden.to(dtype), weight.to(dtype)                                   # [N, D], [V, D]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk_size):
            logp = torch.log_softmax(F.linear(h[s:s + chunk_size], w).float(), dim=-1)  # [n, V] fp32
            loss = loss + F.nll_loss(logp, labels[s:s + chunk_size], ignore_index=IGNORE_INDEX, reduction="sum")
        ctx.save_for_backward(h, weight, labels)
        ctx.chunk_size, ctx.dtype, ctx.hidden_dtype = chunk_size, dtype, hidden.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        h, weight, labels = ctx.saved_tensors
        C, dtype = ctx.chunk_size, ctx.dtype
        w = weight.to(dtype)                                                        # [V, D]
        valid = labels != IGNORE_INDEX                                              # [N]
        target = torch.where(valid, labels, 0)[:, None]                             # [N, 1] safe scatter index
        neg_g = torch.where(valid, -grad_loss.float(), 0.0)[:, None]                # [N, 1] d loss / d logp[y]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(h) if need_h else None                                # [N, D]
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None  # [V, D] fp32
        for s in range(0, h.shape[0], C):
            hc = h[s:s + C]                                                         # [n, D]
            logp = torch.log_softmax(F.linear(hc, w).float(), dim=-1)               # [n, V] recomputed
            dlogp = torch.zeros_like(logp).scatter_(1, target[s:s + C], neg_g[s:s + C])  # [n, V] −g·onehot(y)
            dz = torch.ops.aten._log_softmax_backward_data(dlogp, logp, 1, torch.float32)  # g·(softmax − onehot)
            del logp, dlogp
            dz = dz.to(dtype)                                                       # [n, V]
            if need_h:
                dh[s:s + C] = dz @ w                                                # [n, D]
            if need_w:
                _accumulate(dw, dz.T, hc)                                           # dW += dzᵀ h  [V, D] fp32
        return (None if dh is None else dh.to(ctx.hidden_dtype),
                None if dw is None else dw.to(weight.dtype), None, None, None)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, num_valid: int | None = None,
                         chunk_size: int | None = None) -> Tensor:
    """CE of ``F.linear(hidden, weight)`` (fp32 log-softmax) over labels != -100, summed and divided by
    ``num_valid`` (default: this call's valid labels; 0, not NaN, when none is valid) — the value and
    gradients of ``masked_cross_entropy(F.linear(hidden, weight), labels, num_valid)`` without keeping
    the ``[N, V]`` logits. hidden [N, D] (or [..., D]), weight [V, D], labels [N] (or hidden's leading
    shape). ``chunk_size``: rows per chunk (default: ~2^26 logits per chunk)."""
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [..., D] and weight {tuple(weight.shape)} [V, D]")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must have hidden's leading shape {tuple(hidden.shape[:-1])}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels dtype {labels.dtype}: must be an integer dtype")
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()         # [N, D], [N]
    loss = LinearCrossEntropyFunction.apply(h, weight, y, int(chunk_size), _matmul_dtype(hidden, weight))
    return loss / loss_divisor(y, num_valid)
