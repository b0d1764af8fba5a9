"""The parallel plan: how a run is split (:class:`ParallelOptions`), the one function that turns a
one-process K3 model into this rank's part of it (:func:`parallelize`), and this rank's share of each
global batch (:func:`local_batch`). :func:`k3lab.train.fit` applies it; there is no other loop.

The order is fixed (each step needs the previous one's layout; torchtitan's order too)::

    EP         slice each MoE's experts to this rank's home experts, install the EP/MoonEP dispatcher
    CP         hand every KDA and MLA layer the context-parallel context (KCP; latent all-gather)
    recompute  TrainConfig.recompute (k3lab.memory): what a step keeps for backward
    compile    TrainConfig.compile (k3lab.compile): each mixer and MLP compiled, before sharding
    FSDP       fully_shard each sublayer and the root on the flat dp_shard·cp mesh (fsdp.py), with
               FSDP2's MixedPrecisionPolicy for TrainConfig.param_dtype="bfloat16" (bf16 compute,
               the fp32 sharded parameters as the masters, fp32 gradient reduction); with
               moment_dtype="bfloat16" or master_format="split" the parameters are bf16 shards
               and the masters the optimizer's, on the local shards (k3lab.train)

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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from k3lab.compile import compile_model
from k3lab.memory import apply_recompute
from k3lab.mixers.kda import KDA
from k3lab.mixers.mla import GatedMLA
from k3lab.model import IGNORE_INDEX, LossShard
from k3lab.moe.latent import LatentMoE, RoutedExperts
from k3lab.parallel.context import CP_LAYOUTS
from k3lab.parallel.dims import DEFAULT_TIMEOUT_S, EP_KINDS, EP_PLANS, ParallelDims, ParallelGroups, check_timeout
from k3lab.parallel.fsdp import EDGES, apply_fsdp


@dataclass
class ParallelOptions:
    """How a run is split over the ranks (the mesh); every training switch is :class:`k3lab.train.TrainConfig`'s.
    Validated on construction (ValueError names the field); the degrees again against the world size by
    :class:`~k3lab.parallel.dims.ParallelDims`."""

    dp_shard: int = -1                 # data-parallel (FSDP2) degree; -1 = world_size / cp
    cp: int = 1                        # context-parallel degree (KCP for KDA, latent all-gather for MLA)
    ep: int = 1                        # expert-parallel degree (borrows the dp_shard·cp ranks)
    ep_kind: str = "moonep"            # EP_KINDS: "moonep" (balanced replicas) | "ep" (plain home experts)
    ep_plan: str = "host"              # EP_PLANS: MoonEP planned on the host (counts read back) | on the device (its
    # expert call compiled with the sublayers; the same plan and result: docs/scaling.md, section 4f); the fast
    # profile chooses "device" on CUDA when compiled (k3lab.train.resolve_ep_plan)
    cp_layout: str = "contiguous"      # CP_LAYOUTS: how a sequence is cut over the CP ranks
    timeout: float = DEFAULT_TIMEOUT_S  # seconds every process group waits before it fails the run
    ep_chunks: int = 1                 # with ep_plan="device": each MoE layer's tokens cut into this many chunks, each
    # planned and exchanged alone; on CUDA the exchanges run on a communication stream, so a chunk's exchange runs
    # beside another chunk's experts (the same result: tests/test_moonep_property.py). 1 by default: two chunks were
    # not faster (a graphed EP rank of 8 on one H100, 190.3 ms a step against 189.6: docs/scaling.md, section 4h)
    shared_overlap: bool = False       # EP on CUDA: each LatentMoE's shared expert on a side stream, beside the
    # dispatcher's all-to-alls (the same result), compiled there with the sublayers. Off by default; the fast profile
    # turns it on with ep_plan="device" (k3lab.train.resolve_ep_plan): a graphed EP rank of 8 on one H200 took 172.8
    # and 172.2 ms a step against 194.1 and 186.6 in line (docs/scaling.md, section 4i)
    reshard_after_forward: bool = True  # FSDP2: free a sublayer's gathered weights after its forward and gather them
    # again for its backward; False keeps them until the backward (one all-gather a sublayer a step instead of two,
    # fewer hooks and copies; the gathered weights of every sublayer stay in memory through the step)
    edges: str = "root"                # EDGES: where the embedding and the head live (k3lab.parallel.fsdp): in the
    # root unit; "units" of their own (the head's gather and reduction hide under the layers'); "vocab": the head a
    # unit, the table sharded by rows with the tokens sent to them (k3lab.parallel.vocab; fewer bytes where ranks ·
    # tokens a rank is small against the vocabulary, as at K3's). "root" by default: the others are predicted faster
    # at K3's vocabulary (docs/scaling.md, section 4k), not yet measured on a GPU

    CHOICES = {"ep_kind": EP_KINDS, "ep_plan": EP_PLANS, "cp_layout": CP_LAYOUTS, "edges": EDGES}

    def __post_init__(self):
        def need(ok: bool, name: str, rule: str):
            if not ok:
                raise ValueError(f"ParallelOptions.{name}={getattr(self, name)!r}: {rule}")

        for name in ("cp", "ep", "ep_chunks"):
            need(type(getattr(self, name)) is int and getattr(self, name) >= 1, name, "must be an int >= 1")
        need(self.ep_chunks == 1 or self.ep_plan == "device", "ep_chunks",
             "chunks need MoonEP planned on the device: set ep_plan='device'")
        need(type(self.dp_shard) is int and (self.dp_shard >= 1 or self.dp_shard == -1), "dp_shard",
             "must be an int >= 1, or -1 for world_size / cp")
        for name, allowed in self.CHOICES.items():
            need(getattr(self, name) in allowed, name, f"allowed values are {allowed}")
        need(self.ep_plan == "host" or self.ep_kind == "moonep", "ep_plan",
             f"'device' plans MoonEP only: with ep_kind={self.ep_kind!r} use 'host'")
        for name in ("reshard_after_forward", "shared_overlap"):
            need(type(getattr(self, name)) is bool, name, "must be True or False")
        try:
            check_timeout(self.timeout)  # the rule, defined once (k3lab.parallel.dims)
        except ValueError as err:
            need(False, "timeout", str(err).split(": ", 1)[-1])


def local_batch(x: torch.Tensor, y: torch.Tensor, dims: ParallelDims, rank: int, lm_tokens: int,
                mtp_tokens: int, cp_layout: str = "contiguous") -> tuple[torch.Tensor, torch.Tensor, LossShard]:
    """This rank's rows and sequence part(s) of the global batch ``[B, T]``, and its LossShard.

    Under context parallelism the shard also carries, for each local position, the global batch's
    next token and next label (MTP); the last position of the sequence gets a pad labelled -100."""
    at = dims.coords(rank)
    B, T = x.shape
    rows = slice(at["dp_shard"] * B // dims.dp_shard, (at["dp_shard"] + 1) * B // dims.dp_shard)
    x, y = x[rows], y[rows]
    if dims.cp == 1:
        return x, y, LossShard(lm_tokens, mtp_tokens, dims.world_size)
    from k3lab.parallel.context import CPContext

    pos = CPContext(group=None, rank=at["cp"], world=dims.cp, layout=cp_layout).positions(T // dims.cp)  # [T_local]
    ahead = (pos + 1).clamp_max(T - 1)
    last = (pos == T - 1)[None, :]                                                                      # [1, T_local]
    mtp_x = x[:, ahead].masked_fill(last, 0)
    mtp_y = y[:, ahead].masked_fill(last, IGNORE_INDEX)
    return x[:, pos], y[:, pos], LossShard(lm_tokens, mtp_tokens, dims.world_size, mtp_x, mtp_y)


def global_label_counts(y: torch.Tensor) -> tuple[int, int]:
    """Valid labels of a global batch ``[B, T]`` for the main loss and for the MTP loss (one ahead)."""
    return int((y != IGNORE_INDEX).sum()), int((y[:, 1:] != IGNORE_INDEX).sum())


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed-expert weights (the EP slices once expert parallel is applied)."""
    return [p for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()]


def parallelize(model: nn.Module, groups: ParallelGroups, device: torch.device, *, ep_kind: str = "moonep",
                ep_plan: str = "host", cp_layout: str = "contiguous", recompute: str = "none",
                recompute_layers: int | None = None, compile: str = "none", param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None,
                reshard_after_forward: bool = True, shared_overlap: bool = False,
                ep_chunks: int = 1, edges: str = "root") -> tuple[nn.Module, set[nn.Parameter]]:
    """EP -> CP -> recompute -> compile -> FSDP on ``model`` (in place); returns ``(model, EP expert
    parameters)`` (a meta model's ``to_empty`` replaces those Parameter objects: collect them again after it).
    ``recompute``/``recompute_layers``/``compile`` as in :class:`k3lab.train.TrainConfig`; ``param_dtype``:
    FSDP2's compute dtype (bf16 with fp32 masters and fp32 gradient reduction; None: the parameters' own);
    ``ep_plan``: "device" swaps MoonEP's dispatchers for
    :class:`k3lab.parallel.expert_static.StaticMoonEPDispatcher` (:class:`ParallelOptions`); ``reduce_dtype``:
    FSDP2's gradient-reduction dtype, ``reshard_after_forward`` whether a sublayer's weights are gathered again for
    its backward (:func:`k3lab.parallel.fsdp.apply_fsdp`; :class:`ParallelOptions`); ``shared_overlap``: with EP on
    CUDA, every LatentMoE's shared expert on one side stream (:attr:`k3lab.moe.latent.LatentMoE.shared_stream`);
    ``ep_chunks``: the device-planned dispatcher's token chunks, their exchanges on one communication stream (CUDA);
    ``edges``: where the embedding and the head live (:class:`ParallelOptions`).

    World size 1 without a process group: the model is only moved (recompute and compile applied)."""
    dims = groups.dims
    experts: set[nn.Parameter] = set()
    if dims.ep > 1:
        from k3lab.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, groups.ep, kind=ep_kind)
        if ep_plan == "device":
            from k3lab.parallel.expert_static import apply_static_moonep

            comm = torch.cuda.Stream(device) if ep_chunks > 1 and device.type == "cuda" else None
            apply_static_moonep(model, groups.ep, chunks=ep_chunks, comm_stream=comm)
        experts = set(expert_parameters(model))
        if shared_overlap and device.type == "cuda":
            side = torch.cuda.Stream(device)
            for m in model.modules():
                if isinstance(m, LatentMoE) and m.shared_experts is not None:
                    m.shared_stream = side
    if dims.cp > 1:
        from k3lab.parallel.context import CPContext

        ctx = CPContext(group=groups.cp, rank=dist.get_rank(groups.cp), world=dims.cp, layout=cp_layout)
        for m in model.modules():
            if isinstance(m, (KDA, GatedMLA)):
                m.cp = ctx
    apply_recompute(model, recompute, recompute_layers)  # before compiling: the checkpoint wrappers are traced too
    compile_model(model, compile)  # per sublayer, before fully_shard (torchtitan's order): FSDP's hooks stay eager
    if not next(model.parameters()).is_meta:  # a meta model is allocated after sharding (materialize.py)
        model.to(device)
    if groups.world is not None:
        for m in model.modules():
            if isinstance(m, LatentMoE):
                m.balancer.all_reduce = functools.partial(dist.all_reduce, group=groups.world)
                m.balancer.all_gather = functools.partial(_gather, group=groups.world)
        apply_fsdp(model, groups.mesh, experts, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=reshard_after_forward, edges=edges)
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


def expert_layout(model: nn.Module, experts: set, groups: ParallelGroups) -> dict | None:
    """EP expert slices as DCP must see them: ``Shard(0)`` (experts) over "ep", replicated over "edp"."""
    if not experts:
        return None
    from torch.distributed.tensor import Replicate, Shard

    return {name: (groups.expert_mesh, [Replicate(), Shard(0)]) for name, p in model.named_parameters()
            if p in experts}


FAULT_ENV = "K3LAB_FAULT_RANK_STEP"  # "R:S": rank R exits at step S; "R:S:stop": it stops (SIGSTOP) there


def maybe_inject_fault(rank: int, step: int) -> None:
    """When :data:`FAULT_ENV` names this rank and step: exit this process (code 17; a dead rank) or, with ``:stop``,
    stop it (SIGSTOP; a rank that stops responding): tests of the no-hang guarantee."""
    import os
    import signal

    spec = os.environ.get(FAULT_ENV, "")
    if spec == f"{rank}:{step}":
        os._exit(17)
    if spec == f"{rank}:{step}:stop":
        os.kill(os.getpid(), signal.SIGSTOP)
