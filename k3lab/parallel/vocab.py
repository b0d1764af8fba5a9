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
from torch import Tensor, nn

from k3lab.parallel.collectives import all_gather, group_rank, group_size, reduce_scatter


class _OwnRows(torch.autograd.Function):
    """``part[j] = local[rows[j]]`` (in ``dtype``) where ``mine[j]``, else 0: this rank's rows of every rank's
    tokens. Backward: ``∂local = Σ_j e_{rows[j]} ∂part[j]`` over ``mine``, an ``index_add`` in ``grad_dtype`` (fp32
    for bf16 weights, rounded once), where autograd's own indexing would sum in the weights' dtype."""

    @staticmethod
    def forward(ctx, local: Tensor, rows: Tensor, mine: Tensor, dtype: torch.dtype, grad_dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(rows, mine)
        ctx.grad_dtype, ctx.local = grad_dtype, (local.shape, local.dtype, local.device)
        if not local.shape[0]:                                                      # a rank past the last row
            return local.new_zeros(rows.shape[0], local.shape[1], dtype=dtype)
        return torch.where(mine[:, None], local[rows].to(dtype), 0)                 # [R·N, D]

    @staticmethod
    def backward(ctx, g: Tensor):
        rows, mine = ctx.saved_tensors
        shape, dtype, device = ctx.local
        grad = torch.zeros(shape, dtype=ctx.grad_dtype, device=device)              # [V_r, D]
        if shape[0]:
            grad.index_add_(0, rows, torch.where(mine[:, None], g, 0).to(ctx.grad_dtype))
        return grad.to(dtype), None, None, None, None


class ShardedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` (the optimizer's grouping and the state dict see one) whose weight is a ``Shard(0)``
    DTensor on a 1-D mesh, looked up as the module docstring says (:class:`_OwnRows` between the collectives of
    :mod:`k3lab.parallel.collectives`). ``dtype``: the lookup's output
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
        every = all_gather(ids.reshape(-1), self.group)                             # [R·N] every rank's tokens
        rows = every - lo                                                           # [R·N]
        mine = (rows >= 0) & (rows < hi - lo)                                       # [R·N] the rows held here
        part = _OwnRows.apply(local, rows.clamp(0, max(hi - lo - 1, 0)), mine, self.dtype or local.dtype,
                              self.grad_dtype or local.dtype)                       # [R·N, D]
        return reduce_scatter(part, self.group).view(*ids.shape, -1)                # [B, T, D]: one term nonzero

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, sharded by rows over {group_size(self.group)} ranks"


__all__ = ["ShardedEmbedding"]
