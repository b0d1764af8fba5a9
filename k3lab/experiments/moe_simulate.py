"""Balancing experiments without a language model: synthetic router scores, simulated data-parallel
ranks, and a recorder of the max violation inside a training model (notebook 08, docs/k3_reference.md §7).

Synthetic scores for m tokens and n experts at step t::

    s_ij = σ( z_ij + o_j + t·drift·d_j ),   z, o, d ~ N(0, 1),  o scaled by `skew`

(a few "hot" experts that every token likes, plus a slow drift of which experts are hot).
The router of the aux-loss run is modelled as a learnable per-expert logit offset θ added to the
logits and trained by Adam on the auxiliary loss alone; the other balancers only move the bias.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from k3lab.moe.router import AuxLossBalancer, QuantileBalancer, make_balancer, max_violation, route_scores

# K3 report Fig. 5 as numbers: 8 tokens, 4 experts, top-1. Raw routing loads (4, 3, 1, 0); one
# Quantile-Balancing step re-routes t3, t5 -> E4 and t7 -> E3 and balances the same batch to (2, 2, 2, 2).
FIG5_SCORES = torch.tensor([
    [0.90, 0.50, 0.30, 0.20],
    [0.40, 0.80, 0.30, 0.20],
    [0.30, 0.60, 0.20, 0.55],
    [0.85, 0.40, 0.30, 0.20],
    [0.60, 0.30, 0.20, 0.55],
    [0.30, 0.75, 0.20, 0.40],
    [0.60, 0.20, 0.55, 0.30],
    [0.30, 0.40, 0.70, 0.20],
])


def skewed_scores(m: int, n: int, step: int = 0, skew: float = 2.0, drift: float = 0.0, seed: int = 0) -> Tensor:
    """[m, n] sigmoid router scores: per-expert offsets ~ skew·N(0,1) (fixed by ``seed``), fresh
    token noise every ``step``, offsets drifting by ``drift`` per step along a fixed random direction."""
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(n, generator=g) * skew
    direction = torch.randn(n, generator=g)
    g.manual_seed(seed * 100_003 + step + 1)
    return torch.sigmoid(torch.randn(m, n, generator=g) + offset + step * drift * direction)


class _BiasHolder(nn.Module):
    """Stand-in router for synthetic runs: the bias, and a learnable logit offset θ for the aux loss."""

    def __init__(self, n: int, k: int):
        super().__init__()
        self.top_k = k
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.theta = nn.Parameter(torch.zeros(n))


def simulate_balancing(balancer: str, n: int, k: int, m: int, steps: int, skew: float = 2.0, drift: float = 0.0,
                       seed: int = 0, gamma: float = 1e-3, aux_loss_coef: float = 1e-2, aux_lr: float = 1e-2,
                       num_bins: int = 1000) -> list[float]:
    """Max violation per step of ``balancer`` (a ``cfg.balancer`` name) on synthetic scores.

    Each step routes a fresh batch with the bias of the previous steps, records that batch's
    ``max_j load_j/target − 1``, then lets the balancer update (QB / loss-free move the bias; the
    aux loss takes one Adam step on θ).
    """
    holder = _BiasHolder(n, k)
    bal = make_balancer(balancer, holder, num_bins=num_bins, aux_loss_coef=aux_loss_coef, gamma=gamma)
    opt = torch.optim.Adam([holder.theta], lr=aux_lr) if isinstance(bal, AuxLossBalancer) else None
    vios = []
    for step in range(steps):
        logits = torch.logit(skewed_scores(m, n, step, skew, drift, seed))
        scores = torch.sigmoid(logits + holder.theta) if opt is not None else torch.sigmoid(logits)
        route = route_scores(scores, holder.e_score_correction_bias, k)
        aux = bal.observe(route)
        if opt is not None:
            opt.zero_grad()
            aux.backward()
            opt.step()
        bal.update()
        vios.append(bal.metrics()["max_violation"])
    return vios


def sharded_histogram_update(scores: Tensor, bias: Tensor, k: int, ranks: int, micro_batches: int = 1,
                             num_bins: int = 1000, seed: int = 0) -> Tensor:
    """One histogram-QB update of ``bias`` from ``scores`` [m, n] split over ``ranks`` simulated
    data-parallel ranks (a random token permutation, then ``micro_batches`` per rank). Each rank
    observes only its shard; the integer counts are summed (the all-reduce) and every rank updates.
    Returns the new bias, after checking that all ranks agree bit for bit."""
    perm = torch.randperm(scores.shape[0], generator=torch.Generator().manual_seed(seed))
    biases = [bias.clone() for _ in range(ranks)]
    bals = [QuantileBalancer(b, k, exact=False, num_bins=num_bins) for b in biases]
    for bal, b, shard in zip(bals, biases, scores[perm].chunk(ranks)):
        for micro in shard.chunk(micro_batches):
            bal.observe(route_scores(micro, b, k))
    for tensors in zip(*(bal.stats() for bal in bals)):  # all_reduce(SUM), simulated
        total = sum(tensors)
        for t in tensors:
            t.copy_(total)
    for bal in bals:
        bal.update()
    if not all(torch.equal(b, biases[0]) for b in biases):
        raise AssertionError("sharded_histogram_update: ranks disagree after the all-reduce")
    return biases[0]


class MaxViolationRecorder:
    """Forward hooks on every MoE layer (a module with a ``balancer``) of ``model``: after each
    training-mode forward, append that layer's max violation of the step so far (one micro-batch per
    step: the batch's own routing). ``history[name]`` is a list of floats; ``remove()`` drops the hooks."""

    def __init__(self, model: nn.Module):
        self.history: dict[str, list[float]] = {}
        self.handles = []
        for name, module in model.named_modules():
            if hasattr(module, "balancer") and hasattr(module, "after_optimizer_step"):
                self.history[name] = []
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(module, args, output):
            if module.training:
                self.history[name].append(max_violation(module.balancer.load))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def moonep_lending(balancer: str, n: int, k: int, ranks: int, tokens_per_rank: int, steps: int, warmup: int,
                   skew: float = 2.0, drift: float = 0.0, seed: int = 0, num_bins: int = 1000) -> dict:
    """How many experts MoonEP lends on synthetic routings under ``balancer``: what the replica-weight exchange moves.

    Each step routes ``ranks · tokens_per_rank`` fresh tokens (:func:`skewed_scores`) with the bias of the previous
    steps, rank r holding tokens ``[r·S, (r+1)·S)``; the step's counts ``tpe [R, E]`` are planned as MoonEP plans
    them (:func:`k3lab.parallel.expert_static.plan_moonep_torch`), then the balancer updates on the whole batch (the
    all-reduced statistics). From step ``warmup`` on, per step: ``borrowed`` = the most experts one rank borrows
    (replicas it fetches: the rows its weight exchange receives; MoonEP bounds it by E/R), ``lent`` = the most
    (expert, receiver) pairs one home rank sends, and ``max_violation`` (the batch's ``max_j load_j/target − 1``).
    Returns lists of those, one entry a step, and ``bound`` = E/R."""
    from k3lab.parallel.expert_static import plan_moonep_torch

    if n % ranks:
        raise ValueError(f"moonep_lending: ranks={ranks} must divide n={n} experts")
    holder = _BiasHolder(n, k)
    bal = make_balancer(balancer, holder, num_bins=num_bins)
    El, out = n // ranks, dict(borrowed=[], lent=[], max_violation=[], bound=n // ranks)
    home = torch.arange(n)[:, None] // El == torch.arange(ranks)[None]                    # [E, R] home pairs
    for step in range(steps):
        route = route_scores(skewed_scores(ranks * tokens_per_rank, n, step, skew, drift, seed),
                             holder.e_score_correction_bias, k)
        idx = route.topk_idx.reshape(ranks, tokens_per_rank * k)                           # [R, S·K]
        tpe = torch.zeros(ranks, n, dtype=torch.int64).scatter_add_(1, idx, torch.ones_like(idx))  # [R, E]
        alloc, _, _ = plan_moonep_torch(tpe)                                               # [E, R]
        replica = alloc.gt(0) & ~home                                                      # [E, R] (e, borrower)
        bal.observe(route)
        bal.update()  # (its metrics are the observed batch's, as in simulate_balancing)
        if step >= warmup:
            out["borrowed"].append(int(replica.sum(0).max()))
            out["lent"].append(int(replica.view(ranks, El, ranks).sum((1, 2)).max()))
            out["max_violation"].append(bal.metrics()["max_violation"])
    return out
