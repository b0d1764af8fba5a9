"""One switch for where ops run: the device, and which implementation runs an op.

backends: "torch" (plain-PyTorch reference, runs everywhere), "triton" (k3lab's own kernels,
CUDA), "fla" (flash-linear-attention, the peer; CUDA), "auto" (triton on CUDA, torch elsewhere).
"""

import torch

from k3lab.config import BACKENDS, DEVICES  # noqa: F401 (defined once, in k3lab.config)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; nothing to wait for elsewhere): before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" -> cuda when available, else cpu. Asking for cuda without a GPU is an error."""
    if isinstance(device, torch.device):
        return device
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ValueError(f"device={device!r}: allowed values are {DEVICES} (or 'cuda:N')")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA GPU is visible; use 'cpu' or 'auto'")
    return torch.device(device)


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Map a requested backend to the one that runs on `device`; never falls back silently."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: allowed values are {BACKENDS}")
    dev_type = torch.device(device).type if not isinstance(device, torch.device) else device.type
    if backend == "auto":
        return "triton" if dev_type == "cuda" else "torch"
    if backend in ("triton", "fla") and dev_type != "cuda":
        raise ValueError(
            f"backend={backend!r} needs a CUDA device (got {dev_type!r}); use backend='torch' or 'auto'"
        )
    return backend
