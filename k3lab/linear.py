"""The model's linear layers: ``y = x Wᵀ + b`` by ``F.linear``, or — decoding on CUDA — by k3lab's Triton GEMV.

:func:`linear` (x [..., K], W [M, K], b [M] or None -> [..., M]) is the one entry: on backend ``triton``
(``auto`` on CUDA) a call with at most :data:`k3lab.kernels.gemv.GEMV_MAX_ROWS` rows (the leading dims
flattened: a decode step's tokens), no gradient needed, no autocast and one dtype of bf16 / fp16 / fp32 runs
:func:`k3lab.kernels.gemv.small_linear` (each weight element read once, split-K, deterministic; the kernel
module's docstring); every other call runs ``torch.nn.functional.linear``. Both compute float32 sums rounded
once to x's dtype (:func:`k3lab.kernels.gemv.small_linear_reference` has the rounding). The rule is
:func:`small_linear_applies`, a pure function of the call's facts; :data:`k3lab.kernels.gemv.ENABLED` switches the
kernel on (on by default since the GPU suite and ``kernels/bench_generate.py`` ran with it;
False: every call runs ``F.linear``).

:class:`Linear` is ``nn.Linear`` with a ``backend`` attribute (default ``"torch"``; the layers set it from
``cfg.backend``) and that forward. Being a subclass, it keeps ``nn.Linear``'s parameter names, state dict,
initialisation (the same random draws) and ``isinstance(m, nn.Linear)`` (Muon's grouping, the model's init,
FSDP, the Hugging Face import and export); its class name is ``Linear`` too.

Triton is imported only on the CUDA path (:func:`small_linear_applies` imports the kernel module once the
backend resolves to ``triton``), so building and running the model on CPU never imports it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3lab.backend import resolve_backend
from k3lab.config import BACKENDS


def small_linear_applies(backend: str, device: torch.device | str, rows: int, dtype: torch.dtype, *,
                         matching: bool = True, contiguous: bool = True, needs_grad: bool = False,
                         autocast: bool = False) -> bool:
    """Whether :func:`linear` sends a call to the Triton GEMV: ``backend`` resolves to ``"triton"`` on ``device``
    (:func:`k3lab.backend.resolve_backend`: an unknown backend, or ``triton`` off CUDA, raises ValueError), the
    device is CUDA, ``1 <= rows <= GEMV_MAX_ROWS`` and ``dtype`` is one of ``GEMV_DTYPES``, and

    * ``matching``: W (and b) have x's dtype and device, W is [M, K] for x's K (and b [M]), M, K >= 1;
    * ``contiguous``: x's last dim, W and b are contiguous;
    * ``needs_grad``: grad mode is on and x, W or b requires grad (the kernel has no backward) — not taken;
    * ``autocast``: autocast is on for the device (F.linear's autocast casts would not apply) — not taken.
    """
    if resolve_backend(backend, device) != "triton" or torch.device(device).type != "cuda":
        return False
    from k3lab.kernels.gemv import GEMV_DTYPES, GEMV_MAX_ROWS  # triton: imported on the CUDA path only

    return (1 <= rows <= GEMV_MAX_ROWS and dtype in GEMV_DTYPES and matching and contiguous and not needs_grad
            and not autocast)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, backend: str = "torch") -> Tensor:
    """``F.linear(x, weight, bias)`` — x [..., K], weight [M, K], bias [M] or None -> [..., M] in x's dtype — run by
    the Triton GEMV where :func:`small_linear_applies` (decode-sized calls on backend ``triton`` / ``auto`` on
    CUDA), by ``F.linear`` everywhere else. ``backend``: one of ``k3lab.config.BACKENDS``."""
    if x.dim() == 0 or resolve_backend(backend, x.device) != "triton":  # CPU and backend "torch": no more checks
        return F.linear(x, weight, bias)
    K, rows = x.shape[-1], x.shape[:-1].numel()
    if small_linear_applies(
            backend, x.device, rows, x.dtype,
            matching=(K >= 1 and weight.dim() == 2 and weight.shape[1] == K and weight.shape[0] >= 1
                      and weight.dtype == x.dtype
                      and weight.device == x.device
                      and (bias is None or (bias.shape == weight.shape[:1] and bias.dtype == x.dtype
                                            and bias.device == x.device))),
            contiguous=x.stride(-1) == 1 and weight.is_contiguous() and (bias is None or bias.is_contiguous()),
            needs_grad=torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                    or (bias is not None and bias.requires_grad)),
            autocast=torch.is_autocast_enabled(x.device.type)):
        import k3lab.kernels.gemv as gemv

        if gemv.ENABLED:  # the switch (on by default; False: F.linear everywhere)
            out = gemv.small_linear(x.reshape(rows, K), weight, bias)                 # [N, M]
            return out.view(*x.shape[:-1], weight.shape[0])                          # [..., M]
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` on ``self.backend`` (``"torch"``: exactly ``nn.Linear``;
    ``"triton"`` / ``"auto"`` on CUDA: decode-sized no-grad calls by the Triton GEMV). Parameters, state dict,
    initialisation and ``isinstance(m, nn.Linear)`` are ``nn.Linear``'s."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 backend: str = "torch"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: allowed values are {BACKENDS}")
        self.backend = backend

    def forward(self, input: Tensor) -> Tensor:
        return linear(input, self.weight, self.bias, self.backend)


__all__ = ["Linear", "linear", "small_linear_applies"]
