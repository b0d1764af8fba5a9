"""FSDP2 for the K3 model: ``fully_shard`` per sublayer (``self_attn``, the MLP/MoE), the embedding, the head
and the root.

Why per sublayer and not per ``K3DecoderLayer``: a decoder layer returns its output through the
residual-stream object (:mod:`k3lab.residual`), not as a tensor, so FSDP2's backward hooks on the
layer's outputs never fire and the layer's parameters are never re-gathered for backward. Each
``self_attn`` and MLP module returns plain tensors, so wrapping those works (the norms and AttnRes
queries belong to the root).

Where the embedding and the head live (``ParallelOptions.edges``, :data:`EDGES`): ``"root"`` (default) in the root
unit, whose all-gather opens the step and whose reduce-scatter closes it with nothing to hide under; ``"units"``
FSDP2 units of their own (torchtitan's layout), so only the embedding's and the root's (its norms and AttnRes
queries) stay at the step's edges and the head's hide under the layers' compute like a sublayer's; ``"vocab"`` the
head a unit and the table sharded by rows, the tokens sent to them (:mod:`k3lab.parallel.vocab`). At K3's
163,840-token vocabulary each of the two is 1.17 B parameters. A unit runs once a forward (a unit called twice
reduce-scatters twice): with an MTP head, which runs both again, ``"units"`` is refused and ``"vocab"`` keeps the
head in the root; tied weights take ``"root"``. The fused loss reads the head's weight through
:meth:`k3lab.model.LMHead.cross_entropy`, registered as a forward of the unit so the weight is gathered for it.

Left out of sharding (``ignored_params``):

* each router's ``e_score_correction_bias``: the balancer updates it in place every step; a
  sharded copy would be re-gathered from a stale shard and the module's bias would silently stay 0;
* expert slices under expert parallelism: already split by EP (each rank holds its own experts);
  their gradients are summed over the ranks that hold the same slice (:func:`sum_expert_grads_`).
* the table of a :class:`~k3lab.parallel.vocab.ShardedEmbedding` (``edges="vocab"``): already sharded by rows, its
  shard's gradient holds every rank's tokens already, from the lookup's own exchanges.

Gradients: every rank's loss is its share of the *global* loss (divided by the global token count,
:class:`k3lab.model.LossShard`), so the ranks' gradients must be **summed**, not averaged: the
gradient divide factor is set to 1.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

from k3lab.moe.router import SigmoidRouter
from k3lab.parallel.vocab import ShardedEmbedding


def ignored_parameters(model: nn.Module, expert_params: set[nn.Parameter]) -> set[nn.Parameter]:
    """Router biases (always) and the EP expert slices (when expert parallel)."""
    ignored = {m.e_score_correction_bias for m in model.modules() if isinstance(m, SigmoidRouter)}
    return ignored | set(expert_params)


def sublayers(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer's ``self_attn`` and MLP module (the MTP block's too), in forward order."""
    layers = list(model.model.layers) + ([model.mtp.block] if getattr(model, "mtp", None) is not None else [])
    return [m for layer in layers for m in (layer.self_attn, getattr(layer, layer.mlp_name))]


EDGES = ("root", "units", "vocab")  # ParallelOptions.edges: where the embedding and the head live (module docstring)


def check_edges(cfg, edges: str) -> None:
    """ValueError naming ``ParallelOptions.edges`` where the model cannot take the layout."""
    if edges not in EDGES:
        raise ValueError(f"ParallelOptions.edges={edges!r}: allowed values are {EDGES}")
    if edges != "root" and cfg.tie_word_embeddings:
        raise ValueError(f"ParallelOptions.edges={edges!r}: the head shares the embedding's weight "
                         "(tie_word_embeddings=True); use 'root'")
    if edges == "units" and cfg.num_nextn_predict_layers:
        raise ValueError("ParallelOptions.edges='units': the MTP head runs the embedding and the head twice a forward "
                         "(a unit called twice reduce-scatters twice); use 'root' or 'vocab'")


def edge_units(model: nn.Module, edges: str) -> list[nn.Module]:
    """The embedding and head modules that are FSDP2 units of their own under ``edges`` (module docstring)."""
    head = [model.lm_head] if getattr(model, "mtp", None) is None else []
    return {"root": [], "units": [model.model.embed_tokens, model.lm_head], "vocab": head}[edges]


def exposed_calls(edges: str) -> int:
    """How many FSDP all-gathers open a step, and reduce-scatters close it, with no compute to hide under: the
    root's, and the embedding's where it is a unit of its own (``edges="units"``): nothing runs before its forward
    or after its backward."""
    return 2 if edges == "units" else 1


def apply_fsdp(model: nn.Module, mesh, expert_params: set[nn.Parameter], param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True, reduce_dtype: torch.dtype | None = None,
               edges: str = "root") -> nn.Module:
    """``fully_shard`` each sublayer, the embedding and head where ``edges`` makes them units (:func:`edge_units`;
    kept gathered from forward to backward, as the root), then the root, on the flat 1-D mesh over dp_shard·cp.

    ``param_dtype``: FSDP2 mixed precision (e.g. bf16 compute from the parameters' own fp32 shards); None: the
    parameters' own dtype. ``reduce_dtype``: the dtype gradients are reduce-scattered in (then cast to the
    parameters' dtype); None: float32 with a ``param_dtype``, else the gradients' own. bf16 parameters kept bf16
    (``TrainConfig.moment_dtype="bfloat16"`` / ``master_format="split"``: their masters on the local shards) take
    ``param_dtype=None, reduce_dtype=torch.float32``: the ranks' bf16 partial gradients summed in float32, the sum
    rounded to bf16 once. ``edges``: where the embedding and the head live (:data:`EDGES`, module docstring;
    ``"vocab"``: :class:`k3lab.parallel.vocab.ShardedEmbedding` on the same mesh).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if mesh.ndim != 1:
        raise ValueError(f"apply_fsdp: mesh must be 1-D (a 2-D mesh means HSDP), got {mesh.ndim} axes")
    check_edges(model.config, edges)
    ignored = ignored_parameters(model, expert_params)
    if reduce_dtype is None and param_dtype is not None:
        reduce_dtype = torch.float32
    if edges == "vocab":
        table = ShardedEmbedding(model.model.embed_tokens, mesh, dtype=param_dtype, grad_dtype=reduce_dtype)
        model.model.embed_tokens = table
        ignored.add(table.weight)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mesh=mesh, mp_policy=mp)
    for module in sublayers(model):
        own = {p for p in module.parameters() if p in ignored}
        fully_shard(module, reshard_after_forward=reshard_after_forward, ignored_params=own or None, **kw)
    for module in edge_units(model, edges):
        fully_shard(module, reshard_after_forward=False, **kw)
    if model.lm_head in edge_units(model, edges):
        register_fsdp_forward_method(model.lm_head, "cross_entropy")
    fully_shard(model, reshard_after_forward=False, ignored_params=ignored or None, **kw)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)      # Σ over ranks, not the mean
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    # K3's sublayers return views (``y.view(B, T, D)``); nothing here modifies them in place
    # (the residual stream adds out of place), which is the case FSDP2's warning is about
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return model


@torch.no_grad()
def sum_expert_grads_(expert_params: list[nn.Parameter], group) -> None:
    """Σ the EP expert-slice gradients over the ranks holding the same slice (one flat all-reduce, in float32:
    bf16 gradients are summed as FSDP2 reduces them, rounded to bf16 once)."""
    grads = [p.grad for p in expert_params if p.grad is not None]
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def sum_of_squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """Σ_t ‖t‖² as a 0-d float64 tensor: one ``_foreach_norm`` over the list, each tensor's norm accumulated in
    float64, squared and summed in float64, so a tensor cut into shards gives the whole tensor's sum to ~1e-16
    relative (its float32 rounding, what the clip reads, the same). A few kernels for the whole list, where a loop
    launches four per tensor (on one H100, 2026-12-07: 452 gradients, 1,800 kernels, 6.4 ms of a fake EP rank's
    step)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float64)).square().sum()


@torch.no_grad()
def grad_norm(params: list[nn.Parameter], expert_params: set[nn.Parameter], replicas: int, group) -> torch.Tensor:
    """Global gradient 2-norm over FSDP shards and EP slices (a 0-d float64 tensor on the gradients' device,
    not read back: the caller's one host sync reads it). An FSDP shard counts once over all ranks; an expert
    slice is held by ``replicas`` ranks, so its square is divided by that."""
    grads = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, p in expert_params)
             for p in params if p.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    shards = [g for g, expert in grads if not expert]
    slices = [g for g, expert in grads if expert]
    total = sum_of_squares(shards, device) + sum_of_squares(slices, device) / replicas   # 0-d float64
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, expert_params: set[nn.Parameter],
                    replicas: int, group) -> torch.Tensor:
    """:func:`grad_norm`, and every gradient scaled by ``min(1, max_norm/(norm + 1e-6))`` (torch's rule)."""
    norm = grad_norm(params, expert_params, replicas, group)
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if grads and max_norm and max_norm < math.inf:
        # no clip when the norm is not finite: the caller stops the run before the update
        coef = torch.where(norm.isfinite(), (max_norm / (norm + 1e-6)).clamp(max=1.0), torch.ones_like(norm))
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm
