"""Parallel dimensions of a run and the process groups they make (one place that validates them).

Three axes, torchtitan's convention (EP *borrows* ranks, it is not an extra factor)::

    world_size = dp_shard · cp                   every rank holds a different slice of the data
    ep | dp_shard · cp,   ep | n_routed_experts   expert parallelism groups ``ep`` consecutive ranks

* ``dp_shard``: data parallel with FSDP2 sharding (each rank a slice of the batch rows);
* ``cp``:       context parallel (each rank a slice of every sequence: KCP for KDA, latent
  all-gather for MLA); ranks of one CP group are consecutive;
* ``ep``:       expert parallel (each rank computes the experts of ``E/ep`` home experts, plus
  MoonEP's replicas); ranks of one EP group are consecutive; the ``world/ep`` groups of equal EP
  index replicate the same expert slice ("edp") and sum their expert gradients.

Rank ``r`` sits at ``(dp, c) = divmod(r, cp)`` of the ``[dp_shard, cp]`` data mesh and at
``(edp, e) = divmod(r, ep)`` of the ``[world/ep, ep]`` expert mesh. "axis" names a mesh axis;
"dim" is kept for tensor dimensions.

Every group of a run waits at most the run's ``--timeout`` (:func:`check_timeout`) before it fails it:
the default group (:func:`init_process_group_from_env`), the cp/ep/edp groups and the groups behind the
two device meshes (:func:`init_groups`). ``init_device_mesh`` would create the mesh's sub-groups itself,
with torch's default timeout (30 min for gloo, 10 for NCCL), so a rank that stops in an FSDP or expert
collective would hang the others for half an hour; the meshes are built from the groups made here instead.
"""
from __future__ import annotations

import datetime
import math
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

AXES = ("dp_shard", "cp", "ep")
EP_KINDS = ("moonep", "ep")  # MoonEP (balanced, replicas) and plain EP (experts at home only): k3lab.parallel.expert
EP_PLANS = ("host", "device")  # where MoonEP plans: counts read back each MoE layer (k3lab.parallel.expert), or on the
# device with fixed shapes, traced by torch.compile between its collectives (k3lab.parallel.expert_static)
DEFAULT_TIMEOUT_S = 120.0  # every process group's timeout: a dead rank ends the run, nothing hangs


@dataclass(frozen=True)
class ParallelDims:
    """Validated degrees; ``dp_shard=-1`` means "the ranks that remain" (world / cp)."""

    world_size: int
    dp_shard: int = -1
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        def need(ok: bool, name: str, rule: str):
            if not ok:
                raise ValueError(f"parallel dims: {name}={getattr(self, name)!r}: {rule}")

        for name in ("world_size", "cp", "ep"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an int >= 1")
        need(isinstance(self.dp_shard, int) and (self.dp_shard >= 1 or self.dp_shard == -1), "dp_shard",
             "must be an int >= 1, or -1 for world_size / cp")
        if self.dp_shard == -1:
            need(self.world_size % self.cp == 0, "cp", f"must divide world_size={self.world_size}")
            object.__setattr__(self, "dp_shard", self.world_size // self.cp)
        need(self.dp_shard * self.cp == self.world_size, "dp_shard",
             f"dp_shard·cp = {self.dp_shard}·{self.cp} must equal world_size={self.world_size}")
        need(self.world_size % self.ep == 0, "ep",
             f"must divide the dp_shard·cp = {self.world_size} ranks it borrows "
             f"(allowed: {[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]})")

    def check_model(self, cfg, batch_size: int, seq_len: int, chunk: int = 1) -> None:
        """Errors naming the field when the model or batch cannot be split this way."""
        if cfg.mlp_kind != "dense" and cfg.n_routed_experts % self.ep != 0:
            raise ValueError(f"parallel dims: ep={self.ep}: must divide the model's n_routed_experts "
                             f"{cfg.n_routed_experts}")
        if self.ep > 1 and cfg.mlp_kind == "dense":
            raise ValueError(f"parallel dims: ep={self.ep}: needs a MoE model (the model's mlp_kind is "
                             f"{cfg.mlp_kind!r})")
        if batch_size % self.dp_shard != 0:
            raise ValueError(f"parallel dims: dp_shard={self.dp_shard}: must divide batch_size={batch_size} (each "
                             "data-parallel rank takes an equal share of the global batch's rows)")
        if seq_len % (self.cp * chunk) != 0:
            raise ValueError(f"parallel dims: cp={self.cp}: must split seq_len={seq_len} into equal parts"
                             + (f" of whole multiples of {chunk}" if chunk > 1 else ""))

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index on each axis: dp, cp (data mesh) and ep, edp (expert mesh)."""
        dp, c = divmod(rank, self.cp)
        edp, e = divmod(rank, self.ep)
        return {"dp_shard": dp, "cp": c, "edp": edp, "ep": e}


@dataclass
class ParallelGroups:
    """The process groups of one run (None where an axis has degree 1 or there is no process group)."""

    dims: ParallelDims
    rank: int
    world: dist.ProcessGroup | None     # all ranks: FSDP, loss and balancer statistics
    cp: dist.ProcessGroup | None        # this rank's context-parallel group
    ep: dist.ProcessGroup | None        # this rank's expert-parallel group
    edp: dist.ProcessGroup | None       # ranks holding the same expert slice
    mesh: object | None = None          # 1-D DeviceMesh over all ranks (FSDP2 wants a flat dp_shard·cp mesh)
    expert_mesh: object | None = None   # 2-D ("edp", "ep") DeviceMesh: how EP expert slices are laid out (DCP)


def check_timeout(timeout_s) -> float:
    """``timeout_s`` as float seconds, or ValueError: a process-group timeout must be a finite number > 0
    (``timedelta`` would take 0 or a negative number, and a group that times out at once or never is
    not what a run asks for; ``inf``/``nan`` would fail later inside ``timedelta`` with no flag named)."""
    if not (isinstance(timeout_s, numbers.Real) and not isinstance(timeout_s, bool)
            and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"--timeout={timeout_s!r}: must be a finite number of seconds > 0")
    return float(timeout_s)


def _subgroups(world: int, size: int, consecutive: bool, timeout: datetime.timedelta, rank: int):
    """Every rank creates every group (a torch.distributed rule); return the one holding ``rank``."""
    mine = None
    for start in range(world // size if consecutive else size):
        ranks = (list(range(start * size, (start + 1) * size)) if consecutive
                 else list(range(start, world, size)))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def init_groups(dims: ParallelDims, device_type: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelGroups:
    """Process groups for ``dims`` on the already-initialised default group (torchrun or a test).

    Without an initialised default group, or with a group of one rank (``torchrun --nproc_per_node 1``),
    the run is one process: every group is None and nothing is wrapped or communicated.

    Every group made here waits ``timeout_s``; the meshes are views of them (``DeviceMesh.from_group``):
    the FSDP mesh is the default group (whose timeout :func:`init_process_group_from_env` set from the
    same ``--timeout``), the expert mesh's axes are the edp and ep groups (``init_device_mesh`` would make
    its own groups with torch's default timeout)."""
    timeout_s = check_timeout(timeout_s)
    if not dist.is_initialized():
        if dims.world_size != 1:
            raise ValueError(f"parallel dims: world_size={dims.world_size} but torch.distributed is not "
                             "initialised (launch with torchrun)")
        return ParallelGroups(dims, 0, None, None, None, None)
    if dims.world_size == 1 and dist.get_world_size() == 1:
        return ParallelGroups(dims, 0, None, None, None, None)
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"parallel dims: world_size={dims.world_size} but the process group has "
                         f"{dist.get_world_size()} ranks")
    from torch.distributed.device_mesh import DeviceMesh

    rank, W = dist.get_rank(), dims.world_size
    timeout = datetime.timedelta(seconds=timeout_s)
    cp = _subgroups(W, dims.cp, True, timeout, rank) if dims.cp > 1 else None
    ep = _subgroups(W, dims.ep, True, timeout, rank) if dims.ep > 1 else None
    edp = _subgroups(W, dims.ep, False, timeout, rank) if dims.ep < W else None
    mesh = DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("fsdp",))
    expert_mesh = None
    if dims.ep > 1:
        # ep == W: the edp axis has one rank; the mesh still wants a group for it (one per rank)
        edp_axis = edp if edp is not None else _subgroups(W, dims.ep, False, timeout, rank)
        expert_mesh = DeviceMesh.from_group([edp_axis, ep], device_type,
                                            mesh=torch.arange(W).view(W // dims.ep, dims.ep),
                                            mesh_dim_names=("edp", "ep"))
    return ParallelGroups(dims, rank, dist.group.WORLD, cp, ep, edp, mesh, expert_mesh)


def init_process_group_from_env(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, store=None,
                                rank: int | None = None, world_size: int | None = None) -> bool:
    """Under torchrun (``WORLD_SIZE`` set): init the default group (nccl on CUDA, gloo on CPU) with a
    timeout, pin this rank's GPU; returns True. Alone: returns False and starts nothing. A bad
    ``timeout_s`` raises ValueError (:func:`check_timeout`) either way. ``store`` (with ``rank`` and
    ``world_size``): a store the caller already met the others on (``dist.rendezvous("env://")``, prefixed
    ``default_pg`` as torch's own rendezvous does), instead of a rendezvous here."""
    import os

    timeout_s = check_timeout(timeout_s)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and "RANK" not in os.environ:
        return False
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    given = {} if store is None else dict(store=store, rank=rank, world_size=world_size)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **given)
    return True
