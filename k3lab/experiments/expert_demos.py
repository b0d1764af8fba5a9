r"""Module-level workers for the expert-parallel notebook (10) and its test, run through
:func:`k3lab.parallel.spawn.run_ranks` (a notebook cannot hand its own functions to spawned processes).

:func:`ep_vs_one_process` is ``fn(rank, world, ...)`` inside an initialized gloo group. Every rank builds
the same :class:`~k3lab.moe.latent.LatentMoE` from a fixed seed (optionally with a skewed router,
:func:`build_moe`) and the same global batch, runs the one-process reference on all the tokens itself,
then a copy sharded by :func:`~k3lab.parallel.expert.apply_expert_parallel` on its own rows, and returns
plain floats and ints (picklable): the relative errors of the output and of every parameter gradient
(expert slices all-gathered, the replicated parameters' gradients summed over the group, as the trainer
does), and the load numbers of the step (slots each rank computed, the plain-EP home sums, MoonEP's
replicas). ``ep_sizes`` lets one spawn serve several EP group sizes: the ``world`` processes split into
``world / G`` groups of ``G`` consecutive ranks, each running the whole demo (each new process imports torch and k3lab:
about 4 s of CPU).
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist

from k3lab.config import ModelConfig
from k3lab.moe.latent import LatentMoE
from k3lab.parallel.collectives import all_gather, all_reduce_sum
from k3lab.parallel.expert import EP_KINDS, apply_expert_parallel
from k3lab.testing import rel_err

ROUTER_SKEWS = ("none", "zipf", "one_home")


def build_moe(preset: str = "tiny", skew: str = "none", seed: int = 0) -> LatentMoE:
    """``LatentMoE(ModelConfig.preset(preset))`` in train mode, seeded (the same module on every rank).

    ``skew``: ``"none"`` (the initial router, nearly balanced), ``"zipf"`` (router weights ×10 and a bias
    ``−0.3·ln(1 + e)``: hot experts on the first home ranks), ``"one_home"`` (bias +10 on experts
    0..K−1: every token picks the same K experts, all on home rank 0 for EP sizes up to E/K).
    """
    if skew not in ROUTER_SKEWS:
        raise ValueError(f"skew={skew!r}: allowed values are {ROUTER_SKEWS}")
    torch.manual_seed(seed)
    moe = LatentMoE(ModelConfig.preset(preset)).train()
    E, K = moe.num_experts, moe.top_k
    with torch.no_grad():
        if skew == "zipf":
            moe.gate.weight.mul_(10)
            moe.gate.e_score_correction_bias.copy_(-0.3 * torch.log1p(torch.arange(E, dtype=torch.float32)))
        elif skew == "one_home":
            moe.gate.e_score_correction_bias[:K] = 10.0
    return moe


_SUBGROUPS: dict = {}


def ep_group(size: int):
    """The EP group of ``size`` consecutive ranks holding this rank (None: the whole world). Every rank
    must call it with the same ``size`` (creating subgroups is collective)."""
    world = dist.get_world_size()
    if size == world:
        return None
    if size < 1 or world % size:
        raise ValueError(f"ep size {size}: must be a positive divisor of the world size {world}")
    key = (id(dist.group.WORLD), size)
    if key not in _SUBGROUPS:
        _SUBGROUPS[key] = dist.new_subgroups(group_size=size)[0]
    return _SUBGROUPS[key]


def compare(kind: str, skew: str, group, preset: str = "tiny", batch_per_rank: int = 2, seq_len: int = 16,
            seed: int = 0) -> dict:
    """One EP copy (``kind``) on this rank's ``batch_per_rank`` rows vs the one-process module on the
    whole group's batch. Returns errors (``y``, ``grad``: worst parameter, ``grads``: each) and loads."""
    R = dist.get_world_size(group)
    r = dist.get_rank(group)
    ref = build_moe(preset, skew, seed)
    ep = apply_expert_parallel(copy.deepcopy(ref), group, kind)
    D = ref.gate.weight.shape[1]
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(R * batch_per_rank, seq_len, D, generator=g)       # the group's global batch
    gy = torch.randn(x.shape, generator=g)                             # a random cotangent
    rows = slice(r * batch_per_rank, (r + 1) * batch_per_rank)
    y_ref = ref(x)
    (y_ref * gy).sum().backward()
    y = ep(x[rows])
    (y * gy[rows]).sum().backward()

    grads = {}
    ref_params = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        if p.requires_grad:
            grad = all_gather(p.grad, group) if name.startswith("experts.") else all_reduce_sum(p.grad, group)
            grads[name] = rel_err(grad, ref_params[name].grad)
    E = ref.num_experts
    load = torch.bincount(ref.gate(x.reshape(-1, D)).topk_idx.reshape(-1), minlength=E)  # [E] one process
    plan = ep.dispatcher.last_plan
    return dict(y=rel_err(all_gather(y.detach(), group), y_ref), grad=max(grads.values()), grads=grads,
                slots=ep.dispatcher.last_slots_per_rank.tolist(), home_sums=load.view(R, -1).sum(1).tolist(),
                replicas=plan.num_replicas.tolist(), moved=int(plan.moved), target=batch_per_rank * seq_len * ref.top_k,
                num_local=ep.experts.w1.shape[0], ep_rank=r, ep_size=R)


def ep_vs_one_process(rank: int, world: int, skews=ROUTER_SKEWS, kinds=EP_KINDS, ep_sizes=None, preset: str = "tiny",
                      batch_per_rank: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """``{G: {(skew, kind): compare(...)}}`` for every EP group size G in ``ep_sizes`` (default: the world)
    and every router skew and EP kind: this rank's view (its group's errors are the same on every rank)."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's all_gather_into_tensor rename
    sizes = list(ep_sizes) if ep_sizes is not None else [world]
    groups = {G: ep_group(G) for G in sizes}  # collective: the same order on every rank
    return {G: {(skew, kind): compare(kind, skew, group, preset, batch_per_rank, seq_len, seed)
                for skew in skews for kind in kinds}
            for G, group in groups.items()}
