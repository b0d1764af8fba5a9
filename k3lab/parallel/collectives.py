"""Autograd-aware collectives on ``torch.distributed``, the only ones k3lab's parallel code calls.

Every function here runs on gloo (CPU, CI) and NCCL (GPU) with the vocabulary both support:
``all_gather_into_tensor`` with the concatenated ``[W·n, …]`` output, ``reduce_scatter_tensor`` with
SUM, ``all_to_all_single`` with (uneven, possibly zero) splits, ``all_reduce`` SUM/MAX. No ``AVG`` or
``PREMUL_SUM`` (gloo lacks them or got them late), no stacked all-gather, no list ``all_to_all``.

Each is an ``autograd.Function`` whose backward calls the adjoint collective **unconditionally**:

    all_gather:   y = [x_0; x_1; …; x_{W-1}]          dx_r = Σ_s (dy_s)_r   (reduce-scatter SUM)
    reduce_scatter: y_r = Σ_s (x_s)_r                  dx = [dy_0; …; dy_{W-1}]  (all-gather)
    all_to_all:   y = a2a(x, out_splits, in_splits)   dx = a2a(dy, in_splits, out_splits)
    all_reduce:   y = Σ_r x_r                          dx_r = Σ_s dy_s      (all-reduce SUM)

A rank whose loss does not depend on the output of one of these would skip the backward
collective while the others wait in it (a hang until the timeout). Callers keep every rank's
output in its graph — :func:`keep_in_graph` adds ``0·Σ y`` for that.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        W = group_size(group)
        x = x.contiguous()
        out = x.new_empty((W * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        W = group_size(ctx.group)
        dy = dy.contiguous()
        dx = dy.new_empty((dy.shape[0] // W, *dy.shape[1:]))
        dist.reduce_scatter_tensor(dx, dy, op=dist.ReduceOp.SUM, group=ctx.group)
        return dx, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        W = group_size(group)
        y = x.new_empty((x.shape[0] // W, *x.shape[1:]))
        dist.reduce_scatter_tensor(y, x.contiguous(), op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        W = group_size(ctx.group)
        dy = dy.contiguous()
        dx = dy.new_empty((W * dy.shape[0], *dy.shape[1:]))
        dist.all_gather_into_tensor(dx, dy, group=ctx.group)
        return dx, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup | None) -> Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=group)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        dx = dy.new_empty((sum(ctx.in_splits), *dy.shape[1:]))
        dist.all_to_all_single(dx, dy.contiguous(), output_split_sizes=ctx.in_splits,
                               input_split_sizes=ctx.out_splits, group=ctx.group)
        return dx, None, None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        dx = dy.clone()
        dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=ctx.group)
        return dx, None


def all_gather(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """``x [n, …]`` on each of W ranks -> ``[W·n, …]``, rank-major; backward reduce-scatters (SUM)."""
    return _AllGather.apply(x, group)


def reduce_scatter(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """``x [W·n, …]`` on each of W ranks -> ``[n, …]``: rank r gets Σ over ranks of block r; backward all-gathers."""
    if x.shape[0] % group_size(group):
        raise ValueError(f"reduce_scatter: {x.shape[0]} rows do not split into {group_size(group)} equal blocks")
    return _ReduceScatter.apply(x, group)


def all_to_all(x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group: ProcessGroup | None = None) -> Tensor:
    """Rows ``x [Σ in_splits, …]``: the ``in_splits[s]`` rows of block s go to rank s; returns
    ``[Σ out_splits, …]`` with ``out_splits[s]`` rows from rank s. Backward is the reverse exchange."""
    out_splits, in_splits = [int(s) for s in out_splits], [int(s) for s in in_splits]
    if x.shape[0] != sum(in_splits):
        raise ValueError(f"all_to_all: x has {x.shape[0]} rows, in_splits sum to {sum(in_splits)}")
    return _AllToAll.apply(x, out_splits, in_splits, group)


def all_reduce_sum(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Σ over ranks with gradient (the adjoint of a sum over ranks is a sum over ranks)."""
    return _AllReduceSum.apply(x, group)


def keep_in_graph(out: Tensor, *gathered: Tensor) -> Tensor:
    """``out + 0·Σ gathered``: makes ``out`` depend on each gathered tensor, so this rank's backward
    joins the collective's backward even where its value does not need it (rank 0 in a prefix fold)."""
    for g in gathered:
        out = out + 0.0 * g.sum().to(out.dtype)
    return out


@torch.no_grad()
def all_reduce_(x: Tensor, op: str = "sum", group: ProcessGroup | None = None) -> Tensor:
    """In-place all-reduce without gradient; ``op`` in ("sum", "max")."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"all_reduce_: op={op!r}: allowed values are {tuple(ops)}")
    dist.all_reduce(x, op=ops[op], group=group)
    return x
