"""The embedding sharded by vocabulary rows over the data-parallel ranks, looked up where its rows live.

FSDP2 all-gathers a unit's whole weight before its forward and reduce-scatters its whole gradient after its
backward. For the embedding nothing hides either: nothing runs before its forward, and its gradient is complete only
when the whole backward is (with Attention Residuals every depth mix reads the embedding). At K3's 163,840 × 7,168
table that is 2.35 GB gathered in bf16 and 4.7 GB reduced in fp32 a step, for the 8,192 tokens a rank holds. Here
the table stays sharded, in the layout FSDP2 gives it (a ``DTensor`` placed ``Shard(0)`` on the same mesh, so the
optimizer, the gradient norm, the checkpoint and the materialisation see no difference), and the tokens travel:

    forward   ids* = all_gather(ids)                                 [R·N]       every rank's tokens
              part[j] = W_r[ids*[j] − lo_r]  if lo_r ≤ ids*[j] < hi_r, else 0                    [R·N, D]
              h = reduce_scatter(part)                               [N, D]      Σ over ranks: one term is nonzero
    backward  g* = all_gather(∂L/∂h)                                 [R·N, D]
              ∂L/∂W_r[v] = Σ_{j : ids*[j] = lo_r + v} g*[j]          (index_add, in the reduction dtype)

Rank r holds rows [lo_r, hi_r) (``torch.chunk``'s split, as FSDP2's). Every rank looks up the same number of tokens
N (its equal part of the data-parallel batch). A rank moves about 2·R·N·D activations a step instead of V·D weights
and V·D gradients: fewer where 2·R·N·(their bytes a value) is below V·(the weights' + the reduction's bytes a value),
as at K3's vocabulary (``ParallelOptions.edges="vocab"``). The forward sum is exact in any dtype (one nonzero term
per element); the gradient sums the same terms as one process, in another order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k3lab.parallel.collectives import ProcessGroup, group_rank, group_size


class _ShardedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, ids: Tensor, lo: int, dtype: torch.dtype, grad_dtype: torch.dtype,
                group: ProcessGroup) -> Tensor:
        R, (V_r, D) = group_size(group), local.shape
        flat = ids.reshape(-1).contiguous()                                         # [N]
        every = flat.new_empty(R * flat.numel())                                    # [R·N]
        dist.all_gather_into_tensor(every, flat, group=group)
        rows = every - lo                                                           # [R·N]
        mine = (rows >= 0) & (rows < V_r)                                           # [R·N]
        rows = rows.clamp(0, max(V_r - 1, 0))
        if V_r:
            part = torch.where(mine[:, None], local[rows].to(dtype), 0)             # [R·N, D]
        else:                                                                       # a rank past the last row
            part = local.new_zeros(R * flat.numel(), D, dtype=dtype)
        out = part.new_empty(flat.numel(), D)                                       # [N, D]
        dist.reduce_scatter_tensor(out, part.contiguous(), op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(rows, mine)
        ctx.shape, ctx.grad_dtype, ctx.group, ctx.local = (V_r, D), grad_dtype, group, (local.dtype, local.device)
        return out.view(*ids.shape, D)                                              # [B, T, D]

    @staticmethod
    def backward(ctx, dh: Tensor):
        rows, mine = ctx.saved_tensors
        (V_r, D), R = ctx.shape, group_size(ctx.group)
        g = dh.reshape(-1, D).contiguous()                                          # [N, D]
        every = g.new_empty(R * g.shape[0], D)                                      # [R·N, D]
        dist.all_gather_into_tensor(every, g, group=ctx.group)
        grad = torch.zeros(V_r, D, dtype=ctx.grad_dtype, device=ctx.local[1])       # [V_r, D]
        if V_r:
            grad.index_add_(0, rows, torch.where(mine[:, None], every, 0).to(ctx.grad_dtype))
        return grad.to(ctx.local[0]), None, None, None, None, None


class ShardedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` (the optimizer's grouping and the state dict see one) whose weight is a ``Shard(0)``
    DTensor on a 1-D mesh, looked up by :class:`_ShardedLookup` (module docstring). ``dtype``: the lookup's output
    dtype (None: the weight's); ``grad_dtype``: the dtype the gradient rows are summed in (None: the weight's)."""

    def __init__(self, embedding: nn.Embedding, mesh, dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype | None = None):
        nn.Module.__init__(self)  # not nn.Embedding's: the weight is the given one's, sharded
        from torch.distributed.tensor import Shard, distribute_tensor

        if mesh.ndim != 1:
            raise ValueError(f"ShardedEmbedding: the mesh must be 1-D, got {mesh.ndim} axes")
        if (embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse
                or embedding.scale_grad_by_freq):
            raise ValueError("ShardedEmbedding: padding_idx, max_norm, scale_grad_by_freq and sparse are not supported")
        for name in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                     "sparse"):
            setattr(self, name, getattr(embedding, name))
        w = embedding.weight
        # each rank keeps its chunk of the same tensor (every rank built it from the run's seed, or on meta)
        self.weight = nn.Parameter(distribute_tensor(w.detach(), mesh, [Shard(0)], src_data_rank=None),
                                   requires_grad=w.requires_grad)
        self.dtype, self.grad_dtype = dtype, grad_dtype
        self.group = mesh.get_group()

    def row_range(self) -> tuple[int, int]:
        """The rows [lo, hi) this rank holds (torch.chunk's split of the vocabulary)."""
        R, r = group_size(self.group), group_rank(self.group)
        size = -(-self.num_embeddings // R)
        lo = min(r * size, self.num_embeddings)
        return lo, min(lo + size, self.num_embeddings)

    def forward(self, ids: Tensor) -> Tensor:
        local = self.weight.to_local()                                              # [V_r, D]
        lo, hi = self.row_range()
        if local.shape[0] != hi - lo:
            raise RuntimeError(f"ShardedEmbedding: the local shard holds {local.shape[0]} rows, rows [{lo}, {hi}) "
                               "expected (an uneven DTensor layout this lookup does not know)")
        dtype = self.dtype or local.dtype
        return _ShardedLookup.apply(local, ids, lo, dtype, self.grad_dtype or local.dtype, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, sharded by rows over {group_size(self.group)} ranks"


__all__ = ["ShardedEmbedding"]
