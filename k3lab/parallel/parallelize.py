"""One function that turns a one-process K3 model into this rank's part of a parallel run.

The order is fixed (each step needs the previous one's layout, torchtitan's order too)::

    EP    slice each MoE's experts to this rank's home experts, install the EP/MoonEP dispatcher
    CP    hand every KDA and MLA layer the context-parallel context (KCP; latent all-gather)
    AC    activation checkpointing per sublayer (optional)
    FSDP  fully_shard each sublayer and the root on the flat dp_shard·cp mesh (fsdp.py)

plus the per-step glue a parallel run needs: the balancers' statistics all-reduced over all ranks
(so every rank moves the router bias exactly as one process would), QK-Clip's max logits
all-reduced with MAX before clipping.

The distributed trainer builds the model on the meta device and parallelizes it there; each rank's
shards are then allocated and filled from rank 0's seeded one-process copy
(:mod:`k3lab.parallel.materialize`), so the weights equal the one-process model's. A model that is
already materialised (tests) is moved to the device instead.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from k3lab.memory import checkpoint_module, checkpoint_targets
from k3lab.mixers.kda import KDA
from k3lab.mixers.mla import GatedMLA
from k3lab.moe.latent import LatentMoE, RoutedExperts
from k3lab.parallel.dims import ParallelGroups
from k3lab.parallel.fsdp import apply_fsdp


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed-expert weights (the EP slices once expert parallel is applied)."""
    return [p for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()]


def parallelize(model: nn.Module, groups: ParallelGroups, device: torch.device, *, ep_kind: str = "moonep",
                cp_layout: str = "contiguous", activation_checkpointing: bool = False,
                param_dtype: torch.dtype | None = None) -> tuple[nn.Module, set[nn.Parameter]]:
    """EP -> CP -> AC -> FSDP on ``model`` (in place); returns ``(model, EP expert parameters)``
    (a meta model's ``to_empty`` replaces those Parameter objects: collect them again after it).

    World size 1 without a process group: the model is only moved (and checkpointed if asked)."""
    dims = groups.dims
    experts: set[nn.Parameter] = set()
    if dims.ep > 1:
        from k3lab.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, groups.ep, kind=ep_kind)
        experts = set(expert_parameters(model))
    if dims.cp > 1:
        from k3lab.parallel.context import CPContext

        ctx = CPContext(group=groups.cp, rank=dist.get_rank(groups.cp), world=dims.cp, layout=cp_layout)
        for m in model.modules():
            if isinstance(m, (KDA, GatedMLA)):
                m.cp = ctx
    if activation_checkpointing:
        for m in checkpoint_targets(model):
            checkpoint_module(m)
    if not next(model.parameters()).is_meta:  # a meta model is allocated after sharding (materialize.py)
        model.to(device)
    if groups.world is not None:
        for m in model.modules():
            if isinstance(m, LatentMoE):
                m.balancer.all_reduce = functools.partial(dist.all_reduce, group=groups.world)
                m.balancer.all_gather = functools.partial(_gather, group=groups.world)
        apply_fsdp(model, groups.mesh, experts, param_dtype=param_dtype)
    return model, experts


@torch.no_grad()
def _gather(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


@torch.no_grad()
def reduce_max_logits_(model: nn.Module, group) -> None:
    """QK-Clip reads each MLA head's max logit over the *global* batch: MAX over all ranks."""
    if group is None:
        return
    for m in model.modules():
        if isinstance(m, GatedMLA) and m.track_max_logit:
            dist.all_reduce(m.max_logit, op=dist.ReduceOp.MAX, group=group)
