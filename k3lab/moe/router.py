"""Sigmoid router with a balancing bias, and the balancers that maintain the bias (docs/k3_reference.md §5, §7).

Routing (docs/k3_reference.md §5, Eq. moe-routing), per token i over E experts::

    s_i  = σ(W_r x_i)                           fp32, on the full-width x
    T_i  = argtop_k(s_i + b)                    b = e_score_correction_bias, no gradient
    p_ij = s_ij / Σ_{r∈T_i} s_ir · scale        raw scores: the bias only selects, it never weighs

The router also returns the cutoff ``α_i`` = the (k+1)-th largest *biased* score, which Quantile
Balancing needs.

Balancers share one interface:

* ``observe(route) -> aux_loss | None`` during the step (once per micro-batch, in training only);
* ``update()`` after the optimizer step: all-reduce ``stats()`` through the ``all_reduce`` hook
  (``None`` = single process; e.g. ``torch.distributed.all_reduce`` in a distributed run; exact QB
  all-gathers its margins through the ``all_gather`` hook), then move the bias, which the *next*
  step uses; every rank then holds the bias one process would compute;
* ``metrics()``: per-expert load of the last completed step and its max violation
  ``max_j load_j/target − 1``, target = (tokens·k)/E.

Quantile Balancing (docs/k3_reference.md §7), m tokens in the step, target load q = mk/E::

    b̂_j = quantile_{k/E}( r_{:,j} ),  r_ij = α_i − s_ij    (the "required bias": j enters T_i iff b_j > r_ij)
    b   = b̂ − mean(b̂)

It is the exact coordinate minimiser over β = −b of the dual of the balanced-assignment LP
``L(α, β) = Σ_ij max(0, s_ij − α_i − β_j) + kΣα_i + qΣβ_j``; the loss-free update
``b_j += γ·sign(mean load − load_j)`` is a SignSGD step on the same dual
(∂L/∂β_j = q − load_j).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3lab.config import BACKENDS, BALANCERS
from k3lab.linear import linear


@dataclass
class RouterOutput:
    """What the router hands to dispatch and to the balancer. N tokens, E experts, top-k."""

    scores: Tensor        # [N, E] fp32 σ(W_r x), carries the router's gradient
    topk_idx: Tensor      # [N, k] int64 chosen experts (by biased score, descending)
    topk_weight: Tensor   # [N, k] fp32 renormalised raw scores × routed_scaling_factor
    cutoff: Tensor        # [N] fp32 (k+1)-th largest biased score α_i (−inf when k = E), no gradient


class SigmoidRouter(nn.Module):
    """``weight [E, D]`` and ``e_score_correction_bias [E]`` (fp32, ``requires_grad=False``).

    forward(x [N, D]) -> RouterOutput. The float32 scores ``x W^T`` go through :func:`k3lab.linear.linear` on
    ``backend`` (``triton``: decode-sized no-grad calls by the Triton GEMV; the MoE passes ``cfg.backend``).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, routed_scaling_factor: float = 1.0,
                 renormalize: bool = True, init_std: float = 0.02, backend: str = "torch"):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k}: must be in [1, num_experts={num_experts}]")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: allowed values are {BACKENDS}")
        self.num_experts, self.top_k, self.backend = num_experts, top_k, backend
        self.routed_scaling_factor, self.renormalize = routed_scaling_factor, renormalize
        self.weight = nn.Parameter(torch.randn(num_experts, hidden_size) * init_std)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def _apply(self, fn, recurse=True):
        # the bias stays fp32 under model.to(bf16): its QB/loss-free steps (~1e-3) would vanish in bf16
        super()._apply(fn, recurse)
        self.e_score_correction_bias.data = self.e_score_correction_bias.data.float()
        return self

    def forward(self, x: Tensor) -> RouterOutput:
        scores = torch.sigmoid(linear(x.float(), self.weight.float(), None, self.backend))  # [N, E]
        return route_scores(scores, self.e_score_correction_bias, self.top_k, self.routed_scaling_factor,
                            self.renormalize)


def route_scores(scores: Tensor, bias: Tensor, top_k: int, routed_scaling_factor: float = 1.0,
                 renormalize: bool = True) -> RouterOutput:
    """Top-k of ``scores + bias`` (bias detached), weights from the raw scores, cutoff α = (k+1)-th biased score.

    scores: [N, E] fp32 in (0, 1); bias: [E]. Split out of the router so synthetic score matrices
    (notebook 08, tests) route exactly as the model does.
    """
    N, E = scores.shape
    biased = scores.detach() + bias.detach().float()                  # [N, E]
    top_vals, top_idx = biased.topk(min(top_k + 1, E), dim=-1)        # [N, k(+1)]
    cutoff = top_vals[:, top_k] if top_k < E else torch.full((N,), -math.inf, device=scores.device)
    topk_idx = top_idx[:, :top_k]                                     # [N, k]
    weight = scores.gather(1, topk_idx)                               # [N, k] raw scores, with grad
    if renormalize:
        weight = weight / weight.sum(-1, keepdim=True)
    return RouterOutput(scores, topk_idx, weight * routed_scaling_factor, cutoff)


def expert_load(topk_idx: Tensor, num_experts: int) -> Tensor:
    """Token slots per expert: topk_idx [N, k] -> [E] int64 (``bincount(minlength=E)``'s values).

    A ``scatter_add_`` into E zeros, not ``torch.bincount``: bincount's output length depends on the
    largest index, so on CUDA it reads ``max`` back to the host (a sync in every MoE layer's forward)
    and ``torch.compile`` breaks its graph there; this has a static shape and stays on the device.
    Integer adds: exact and deterministic."""
    flat = topk_idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int64))


def max_violation(load: Tensor) -> float:
    """``max_j load_j/target − 1`` with target = Σ load / E = N·k/E (0 = perfectly balanced)."""
    target = load.sum().item() / load.numel()
    return float(load.max().item() / target - 1.0) if target > 0 else 0.0


class Balancer:
    """Base balancer: counts per-expert load; ``update()`` leaves the bias alone ("none").

    ``bias`` is the router's ``e_score_correction_bias`` Parameter (or any [E] tensor), updated in
    place under ``no_grad``; holding the Parameter (not its ``.data``) survives ``model.to(device)``.
    """

    def __init__(self, bias: Tensor, top_k: int):
        self.bias, self.top_k = bias, top_k
        self.num_experts = bias.numel()
        self.load = torch.zeros(self.num_experts, dtype=torch.int64, device=bias.device)  # this step, [E]
        self.last_load = self.load.clone()                                                # last completed step
        self.all_reduce: Callable[[Tensor], None] | None = None       # in-place Σ over ranks
        self.all_gather: Callable[[Tensor], Tensor] | None = None     # [n, ...] -> [W·n, ...] rank-major

    def _follow_device(self) -> None:
        """Keep the statistics on the bias's device (the model may have been moved after construction)."""
        for name, value in vars(self).items():
            if isinstance(value, Tensor) and value is not self.bias and value.device != self.bias.device:
                setattr(self, name, value.to(self.bias.device))

    def observe(self, route: RouterOutput) -> Tensor | None:
        """Accumulate the step's statistics from one micro-batch; return an auxiliary loss or None."""
        self._follow_device()
        self.load += expert_load(route.topk_idx, self.num_experts)
        return None

    def stats(self) -> list[Tensor]:
        """The tensors a distributed run sums over ranks before ``update()`` moves the bias."""
        return [self.load]

    def _reduce(self) -> None:
        if self.all_reduce is not None:
            for t in self.stats():
                self.all_reduce(t)

    @torch.no_grad()
    def update(self) -> None:
        """All-reduce the statistics, move the bias (subclasses), reset the step's statistics."""
        self._reduce()
        self._move_bias()
        self.last_load = self.load.clone()
        self.load.zero_()

    def _move_bias(self) -> None:
        """Balancer-specific bias update; the base class keeps the bias fixed."""

    def metrics(self) -> dict:
        """``{"load": [E] int64, "max_violation": float}`` of the last completed step."""
        return {"load": self.last_load, "max_violation": max_violation(self.last_load)}


class AuxLossBalancer(Balancer):
    """Switch-style auxiliary loss, bias untouched: ``L = coef · E · Σ_j f_j · P_j``.

    f_j = slots routed to j / (N·k) (no gradient), P_j = mean_i s_ij / Σ_l s_il (gradient into W_r).
    Equals ``coef`` when both the loads and the mean scores are uniform. In a distributed run (the
    ``all_reduce`` hook set) f is all-reduced over the ranks in the forward, while each rank's P is
    the mean over its own N tokens: with equal N per rank, the ranks' losses averaged
    (:class:`k3lab.model.LossShard` divides by the rank count) are exactly the whole batch's.
    """

    def __init__(self, bias: Tensor, top_k: int, coef: float = 1e-2):
        super().__init__(bias, top_k)
        self.coef = coef

    def observe(self, route: RouterOutput) -> Tensor:
        super().observe(route)
        N, E = route.scores.shape
        counts = expert_load(route.topk_idx, E)                                     # [E]
        if self.all_reduce is not None:  # distributed: f over the global batch (P stays local, see below)
            counts = counts.clone()
            self.all_reduce(counts)
        f = counts.float() / counts.sum().clamp_min(1)                              # [E] = load / (N·k)
        P = (route.scores / route.scores.sum(-1, keepdim=True)).mean(0)           # [E]
        return self.coef * E * (f * P).sum()


class LossFreeBalancer(Balancer):
    """DeepSeek's auxiliary-loss-free update ``b_j += γ·sign(mean load − load_j)`` (γ = 1e-3)."""

    def __init__(self, bias: Tensor, top_k: int, gamma: float = 1e-3):
        super().__init__(bias, top_k)
        self.gamma = gamma

    def _move_bias(self) -> None:
        load = self.load.float()
        self.bias.add_((self.gamma * torch.sign(load.mean() - load)).to(self.bias.dtype))


class QuantileBalancer(Balancer):
    """Quantile Balancing (docs/k3_reference.md §7): ``b ← b̂ − mean(b̂)``, ``b̂_j = quantile_{k/E}(α_i − s_ij over i)``.

    exact=True keeps every margin ``r = α − s`` of the step ([m, E] fp32) and takes the linear-interpolated
    (k/E)-quantile per expert (single-process reference: the margins would need an all-gather).

    exact=False is the histogram estimator K3 runs: with the step's old bias fixed, ``r`` lies in
    ``(b_min − 1, b_max + 1)`` (s ∈ (0,1), α ∈ (b_min, 1 + b_max)); ``r`` is binned into ``num_bins``
    uniform bins of width ``w = (b_max − b_min + 2)/B``, counts accumulate over micro-batches in an
    integer ``[E, B]`` tensor (the only thing to all-reduce). At update, with q = m·k/E, take per expert
    the first bin β_j whose cumulative count reaches ⌈q⌉, c_j = count before it, h_j = count inside::

        b̂_j = b_min − 1 + (β_j + clip((q − c_j)/h_j, 0, 1))·w

    Error ≤ one bin width, and the result is exactly invariant to how the tokens were sharded.

    With k = E (``num_experts_per_tok == n_routed_experts``, which transformers' Kimi Linear runs too) every
    token takes every expert: each load is the target m·k/E = m whatever the bias (∂L/∂β_j = q − load_j = 0,
    and α = −inf), so there is nothing to balance and the bias stays as it is; the load is still counted.
    """

    def __init__(self, bias: Tensor, top_k: int, exact: bool = False, num_bins: int = 1000):
        super().__init__(bias, top_k)
        if not 1 <= top_k <= self.num_experts:
            raise ValueError(f"QuantileBalancer: top_k={top_k} must be in [1, num_experts={self.num_experts}]")
        self.every_expert = top_k == self.num_experts  # k = E: nothing to balance (class docstring)
        if num_bins < 1:
            raise ValueError(f"QuantileBalancer: num_bins={num_bins} must be >= 1")
        self.exact, self.num_bins = exact, num_bins
        self.margins: list[Tensor] = []
        self.counts = torch.zeros(self.num_experts, num_bins, dtype=torch.int64, device=bias.device)  # [E, B]

    def bin_range(self) -> tuple[Tensor, Tensor]:
        """``(lo, w)`` as 0-d fp32 tensors on the bias's device (no host sync in the forward): left edge
        ``b_min − 1`` and bin width ``(b_max − b_min + 2)/B`` for the current bias."""
        b = self.bias.detach().float()
        lo = b.min() - 1.0
        return lo, (b.max() + 1.0 - lo) / self.num_bins

    def observe(self, route: RouterOutput) -> None:
        super().observe(route)
        if self.every_expert:
            return None
        r = route.cutoff.detach()[:, None] - route.scores.detach()             # [N, E] required bias
        if self.exact:
            self.margins.append(r)
            return None
        lo, w = self.bin_range()
        # non-finite scores (diverged weights) land in bin 0: the step's loss is non-finite too, and the
        # training loop stops before the update (an out-of-range index would crash it here first)
        bins = ((r - lo) / w).nan_to_num_(0.0).floor().clamp_(0, self.num_bins - 1).long()  # [N, E]
        self.counts.scatter_add_(1, bins.T.contiguous(), torch.ones_like(bins.T))
        return None

    def stats(self) -> list[Tensor]:
        return [self.load] if self.exact else [self.load, self.counts]

    def _reduce(self) -> None:
        """The histogram is additive (summed with the load); the exact margins are not, so a
        distributed run gathers every rank's ``[m_r, E]`` margins (equal m_r) instead."""
        super()._reduce()
        if self.exact and self.margins and self.all_gather is not None:
            self.margins = [self.all_gather(torch.cat(self.margins))]

    def _move_bias(self) -> None:
        if self.every_expert:
            return
        b_hat = self.exact_quantile() if self.exact else self.histogram_quantile()
        if b_hat is None:
            return
        moved = (b_hat - b_hat.mean()).to(self.bias.dtype)
        if not self.exact:  # no token seen (an empty histogram): keep the bias, decided on the device (no sync)
            moved = torch.where(self.counts[0].sum() > 0, moved, self.bias.detach())
        self.bias.copy_(moved)
        self.margins.clear()
        self.counts.zero_()

    def exact_quantile(self) -> Tensor | None:
        """Per-expert (k/E)-quantile of the step's margins, linear interpolation (numpy's default). [E]."""
        if not self.margins:
            return None
        r = torch.cat(self.margins)                                            # [m, E]
        return sorted_quantile(r, self.top_k / self.num_experts)

    def histogram_quantile(self) -> Tensor | None:
        """Per-expert (k/E)-quantile read off the ``[E, B]`` counts (see the class docstring). [E].
        All on the device (no host sync); with no token counted the result is meaningless and
        :meth:`_move_bias` keeps the bias."""
        m = self.counts[0].sum().double()     # every token adds one r per expert; 0-d, stays on the device
        q = m * self.top_k / self.num_experts
        lo, w = self.bin_range()
        cum = self.counts.cumsum(1)                                             # [E, B]
        first = (cum < torch.ceil(q)).sum(1)                                    # [E] first bin with cum >= ⌈q⌉
        h = self.counts.gather(1, first[:, None])[:, 0].double()                # [E] inside the bin
        c = cum.gather(1, first[:, None])[:, 0].double() - h                    # [E] before the bin
        frac = ((q - c) / h.clamp_min(1)).clamp(0, 1)
        return (lo.double() + (first.double() + frac) * w.double()).float()


def sorted_quantile(r: Tensor, p: float) -> Tensor:
    """Linear-interpolated p-quantile along dim 0 (numpy's default; no torch.quantile size limit). [m, E] -> [E]."""
    s = r.sort(dim=0).values                                                    # [m, E]
    pos = (r.shape[0] - 1) * p
    i = int(math.floor(pos))
    j = min(i + 1, r.shape[0] - 1)
    return s[i] + (pos - i) * (s[j] - s[i])



def make_balancer(kind: str, router: SigmoidRouter, num_bins: int = 1000, aux_loss_coef: float = 1e-2,
                  gamma: float = 1e-3) -> Balancer:
    """The balancer named by ``cfg.balancer`` for ``router`` (shares its bias tensor)."""
    bias, k = router.e_score_correction_bias, router.top_k
    if kind == "quantile_hist":
        return QuantileBalancer(bias, k, exact=False, num_bins=num_bins)
    if kind == "quantile_exact":
        return QuantileBalancer(bias, k, exact=True)
    if kind == "loss_free":
        return LossFreeBalancer(bias, k, gamma=gamma)
    if kind == "aux_loss":
        return AuxLossBalancer(bias, k, coef=aux_loss_coef)
    if kind == "none":
        return Balancer(bias, k)
    raise ValueError(f"balancer={kind!r}: allowed values are {BALANCERS}")
