"""Packed sequences (fla's ``cu_seqlens`` convention): the one check that the torch reference
(:mod:`k3lab.mixers.chunk`) and our Triton kernels (:mod:`k3lab.kernels`) share. It sits below both
so that kernels never import mixers."""

import torch

Tensor = torch.Tensor


def check_cu_seqlens(cu_seqlens: Tensor, q: Tensor, v: Tensor, initial_state: Tensor | None) -> list[int]:
    """Check packed-sequence offsets (fla's convention) and return them as a list (one host sync).

    ``cu_seqlens``: int32/int64 ``[N + 1]`` on q's device with ``0 = cu_seqlens[0] < ... < cu_seqlens[N] = T``,
    for inputs ``[1, T, H, ·]`` (B == 1); ``initial_state``, if given, is ``[N, H, K, V]``.
    """
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-d tensor [N + 1] with N >= 1, "
                         f"got {getattr(cu_seqlens, 'shape', cu_seqlens)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64 (a LongTensor), got {cu_seqlens.dtype}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
    B, T, H, K = q.shape
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed along T: q must be [1, T, H, K], got B = {B}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {bounds[0]} .. {bounds[-1]}")
    if any(end <= start for start, end in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty sequence), got {bounds}")
    N, V = len(bounds) - 1, v.shape[-1]
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)} for N = {N} packed sequences, "
                         f"got {tuple(initial_state.shape)}")
    return bounds
