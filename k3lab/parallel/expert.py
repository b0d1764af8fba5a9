"""Expert parallelism for LatentMoE: plain EP (torchtitan-style) and MoonEP (K3 report §5.2.1).

R ranks form an EP group; each holds E/R *home* experts, expert e on rank ``home(e) = e // (E/R)``
(E divisible by R). Rank r routes its own S tokens (top-K), so it owns S·K token slots; the
all-gathered counts ``tpe [R, E]`` (``tpe[s, e]`` = slots of rank s routed to expert e) say everything
about the step's load::

    count_e = Σ_s tpe[s, e]            slots of expert e over the group
    load_h  = Σ_{e: home(e)=h} count_e  slots rank h computes in plain EP
    CAP     = S·K = (Σ_h load_h) / R    the mean: what a perfectly balanced rank computes

**Why plain-EP loads are unequal.** ``load_h`` sums the counts of E/R particular experts over every
rank's tokens. Even a router that is balanced on average is not balanced in every micro-batch and
layer (counts fluctuate, and a router in training has hot experts: Zipf-like counts), so
``max_h load_h > CAP``. The all-to-all back is a barrier: every rank waits for the most loaded one,
so the step time and the activation memory are set by ``max_h load_h``, not by CAP. In the worst
case (every token to the experts of one home rank) one rank computes R·CAP while the others idle.

**MoonEP: every rank computes exactly CAP slots**, by lending the overloaded ranks' tokens *and the
weights of their experts* to the underloaded ones. Every step and layer, on the all-gathered ``tpe``
(so every rank computes the same plan, with no further communication):

1. ``balance_h = load_h − CAP`` (Σ_h balance_h = 0).
2. Quotas (at most R−1 rounds): the most underloaded rank u (argmin balance) is filled *exactly* to
   CAP from the most overloaded home h (argmax balance): ``z[h, u] = −balance_u``,
   ``balance_h −= z[h, u]``. When h's surplus is smaller than u's deficit, h goes negative and is
   itself filled in a later round; it never sends again. Each round zeroes u and leaves h non-zero or
   zero, so the number of unbalanced ranks drops by at least one per round.
3. Within home h, each quota z[h, u] is met from h's local experts with the most remaining slots
   first (a water fill: the largest expert alone if it has enough) → ``alloc[e, d]`` = slots of expert
   e computed on rank d; what is not lent stays at home.
4. Expert e's ``count_e`` slots, in global (source rank, position) order, go to destinations in rank
   order, split at ``cumsum_d alloc[e, d]``.
5. A rank computing slots of a remote expert fetches that expert's weights from the home rank with
   an autograd all-to-all; its backward returns the replica's weight gradient to the home rank,
   where it adds into the local parameter's gradient ("reduced back home").

What the greedy guarantees (``tests/test_parallel_expert.py`` checks each on random, Zipf and
adversarial counts):

* every rank computes exactly CAP = S·K slots; Σ_d alloc[e, d] = count_e; alloc ≥ 0;
* every rank receives its remote slots from **one** home rank (its donor) — a receiver is filled
  completely in the round that picks it and is never picked again — hence holds at most E/R
  replicas (the report's bound);
* locality: a rank with load_h ≤ CAP keeps all its home slots and lends nothing; only overloaded
  ranks lend; an overloaded rank keeps exactly CAP of its own slots, except a donor whose surplus
  was smaller than the receiver it filled (it keeps CAP + surplus − deficit ≥ 1 and is filled by its
  own donor);
* the cost of one home per receiver: the greedy may move more than the minimum Σ_h max(balance_h, 0)
  slots (chains h' → h → u); ``MoonEPPlan.moved`` reports it.

Plain EP uses the same machinery with the trivial plan ``alloc[e, home(e)] = count_e``
(:func:`plan_ep`): receive counts per rank are the uneven ``load_h``, no replicas.

**Host syncs.** ``all_to_all_single`` takes python split lists, so each layer's forward copies one
small ``[5, R]`` tensor of split sizes device → host (the dispatcher's only sync; the planner itself
is pure torch on the device, loops over R only, and ties break to the lowest rank, identically on
every rank). The backward adds none (the all-to-alls keep their split lists). The real MoonEP
kernels avoid the sync with NVSHMEM; note that the per-rank *received* total is always exactly S·K,
a static shape. The padded expert path (CPU) adds its own sync for the largest group. Replica
weights travel in the parameters' dtype (at most E/R experts × 3·I·L values per rank and layer).

Use :func:`apply_expert_parallel` on a model (or one LatentMoE) built with the same seed on every
rank: it slices ``experts.w1/w2/w3`` to the rank's home experts and installs the dispatcher. The
router, shared experts, W↓/W↑ and the balancer stay local to the rank's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3lab.moe.latent import DispatchPlan, LatentMoE, LocalDispatcher, RoutedExperts
from k3lab.parallel.collectives import ProcessGroup, all_gather, all_to_all, group_rank, group_size

EP_KINDS = ("moonep", "ep")  # MoonEP (balanced, replicas) and plain EP (experts at home only)


# ----------------------------------------------------------------------------------------------
# the plan (pure torch, no processes)
# ----------------------------------------------------------------------------------------------
@dataclass
class MoonEPPlan:
    """Which rank computes which slots. R ranks, E experts, El = E/R home experts per rank.

    Identical on every rank (computed from the all-gathered ``tpe``). Also the plain-EP plan
    (``kind="ep"``), where ``alloc`` is at home only.
    """

    kind: str          # "moonep" or "ep"
    tpe: Tensor        # [R, E] int64 slots per (source rank, expert)
    alloc: Tensor      # [E, R] int64 slots of expert e computed on rank d
    quota: Tensor      # [R, R] int64 z[h, u]: slots of home h's experts computed on rank u ≠ h
    home_load: Tensor  # [R] int64 load_h = Σ_{e home h} count_e (what plain EP computes)

    @property
    def num_ranks(self) -> int:
        return self.tpe.shape[0]

    @property
    def slots(self) -> Tensor:
        """[R] int64 slots each rank computes (MoonEP: all S·K)."""
        return self.alloc.sum(0)

    @property
    def replicas(self) -> Tensor:
        """[E, R] bool: rank d computes slots of expert e away from its home (so needs its weights)."""
        R, E = self.tpe.shape
        home = torch.arange(E, device=self.alloc.device) // (E // R)                      # [E]
        away = home[:, None] != torch.arange(R, device=self.alloc.device)[None, :]        # [E, R]
        return (self.alloc > 0) & away

    @property
    def num_replicas(self) -> Tensor:
        """[R] int64 remote experts each rank computes (MoonEP: ≤ E/R)."""
        return self.replicas.sum(0)

    @property
    def donors(self) -> Tensor:
        """[R] int64 the home rank each rank receives remote slots from, −1 for none."""
        has = self.quota > 0                                                              # [R(h), R(u)]
        return torch.where(has.any(0), has.to(torch.int8).argmax(0), torch.full_like(has[0], -1, dtype=torch.int64))

    @property
    def moved(self) -> Tensor:
        """0-d int64: slots computed away from their home rank (≥ Σ_h max(balance_h, 0))."""
        return self.quota.sum()


def tokens_per_expert(topk_idx: Tensor, num_experts: int) -> Tensor:
    """``topk_idx [R, S, K]`` (each simulated rank's top-K choices) -> ``tpe [R, E]`` int64, the counts
    the dispatcher all-gathers (for planning without processes, e.g. notebook 10)."""
    R = topk_idx.shape[0]
    flat = topk_idx.reshape(R, -1)                                                        # [R, S·K]
    tpe = torch.zeros(R, num_experts, dtype=torch.int64, device=flat.device)
    return tpe.scatter_add_(1, flat, torch.ones_like(flat))


def check_divisible(num_experts: int, num_ranks: int) -> None:
    """Every rank holds E/R home experts: E must be divisible by R."""
    if num_experts % num_ranks != 0:
        raise ValueError(f"n_routed_experts={num_experts}: must be divisible by the EP group size R={num_ranks} "
                         f"(allowed R: {[d for d in range(1, num_experts + 1) if num_experts % d == 0]})")


def _check_tpe(tpe: Tensor) -> tuple[int, int]:
    if tpe.dim() != 2 or tpe.dtype != torch.int64:
        raise ValueError(f"tpe: expected an [R, E] int64 tensor, got shape {tuple(tpe.shape)} dtype {tpe.dtype}")
    R, E = tpe.shape
    check_divisible(E, R)
    return R, E


def check_equal_tokens(slots_per_rank: list[int], top_k: int) -> None:
    """MoonEP needs the same S on every rank: ``slots_per_rank[r] = S_r·K`` (host ints)."""
    if len(set(slots_per_rank)) > 1:
        raise ValueError(f"tokens per rank S = {[s // top_k for s in slots_per_rank]} (top_k={top_k}): MoonEP "
                         "needs the same S on every rank of the EP group; use kind='ep' for uneven shards")


def plan_ep(tpe: Tensor) -> MoonEPPlan:
    """Plain EP: every expert computed on its home rank, ``alloc[e, home(e)] = count_e``."""
    R, E = _check_tpe(tpe)
    home = torch.arange(E, device=tpe.device) // (E // R)                                 # [E]
    count = tpe.sum(0)                                                                    # [E]
    alloc = torch.zeros(E, R, dtype=torch.int64, device=tpe.device).scatter_(1, home[:, None], count[:, None])
    quota = torch.zeros(R, R, dtype=torch.int64, device=tpe.device)
    return MoonEPPlan("ep", tpe, alloc, quota, count.view(R, E // R).sum(1))


def plan_moonep(tpe: Tensor, top_k: int, check: bool = True) -> MoonEPPlan:
    """MoonEP's balanced plan from the all-gathered counts ``tpe [R, E]`` (module docstring, steps 1–3).

    Pure torch on ``tpe``'s device, R−1 rounds of a few small ops, no host sync unless ``check``
    (which validates equal S·K per rank on the host; the dispatcher checks from its own host copy).
    Every rank computes exactly ``CAP = S·K = tpe[r].sum()`` slots.
    """
    R, E = _check_tpe(tpe)
    El, dev = E // R, tpe.device
    cap = tpe.sum(1)                                                                      # [R] S·K per rank
    if check:
        check_equal_tokens(cap.tolist(), top_k)
    remaining = tpe.sum(0).view(R, El).clone()                                            # [R, El] home slots kept
    home_load = remaining.sum(1)                                                          # [R]
    balance = home_load - cap[:1]                                                         # [R] surplus > 0 > deficit
    moved = torch.zeros(R * El * R, dtype=torch.int64, device=dev)                        # [h, e_local, u] flat
    local = torch.arange(El, device=dev)                                                  # [El]
    for _ in range(R - 1):
        u = balance.argmin().view(1)                                                      # [1] most underloaded
        h = balance.argmax().view(1)                                                      # [1] most overloaded
        need = (-balance.index_select(0, u)).clamp_min(0)                                 # [1] u's deficit (0: done)
        balance = balance.index_add(0, u, need).index_add(0, h, -need)
        rem = remaining.index_select(0, h)[0]                                             # [El]
        vals, idx = rem.sort(descending=True, stable=True)                                # largest expert first
        before = vals.cumsum(0) - vals                                                    # [El]
        take = torch.zeros_like(rem).scatter_(0, idx, (need - before).clamp_min(0).minimum(vals))  # [El]
        remaining = remaining.index_add(0, h, -take[None])
        moved.index_add_(0, (h * El + local) * R + u, take)
    moved = moved.view(R, El, R)
    alloc = moved.reshape(E, R).clone()                                                   # [E, R] lent slots
    home = torch.arange(E, device=dev) // El                                              # [E]
    alloc.scatter_add_(1, home[:, None], remaining.view(E, 1))                            # + kept at home
    return MoonEPPlan("moonep", tpe, alloc, moved.sum(1), home_load)


def _overlap(a0: Tensor, a1: Tensor, b0: Tensor, b1: Tensor) -> Tensor:
    """Length of [a0, a1) ∩ [b0, b1), elementwise with broadcasting."""
    return (torch.minimum(a1, b1) - torch.maximum(a0, b0)).clamp_min(0)


def route_counts(plan: MoonEPPlan) -> Tensor:
    """[R(s), E, R(d)] int64 slots of expert e that source rank s sends to destination rank d.

    Expert e's slots in global (source, position) order are intervals ``[start_s, end_s)`` of
    ``cumsum_s tpe[s, e]``; destinations take the intervals ``[start_d, end_d)`` of
    ``cumsum_d alloc[e, d]``; the count is the overlap (module docstring, step 4).
    """
    src_end, dst_end = plan.tpe.cumsum(0), plan.alloc.cumsum(1)                          # [R, E], [E, R]
    src, dst = (src_end - plan.tpe)[:, :, None], (dst_end - plan.alloc)[None]
    return _overlap(src, src_end[:, :, None], dst, dst_end[None])


# ----------------------------------------------------------------------------------------------
# the dispatcher
# ----------------------------------------------------------------------------------------------
def _check_kind(kind: str) -> None:
    if kind not in EP_KINDS:
        raise ValueError(f"kind={kind!r}: allowed values are {EP_KINDS}")


class ExpertParallelDispatcher:
    """LatentMoE's dispatcher over an EP group (``kind`` in :data:`EP_KINDS`); see the module docstring.

    ``run(z [S, L], topk_idx [S, K], topk_weight [S, K], experts)`` -> u [S, L] fp32, with ``experts``
    holding this rank's home slice (:func:`apply_expert_parallel`). Per forward, on rank r:

    1. sort the S·K local slots by expert, all-gather the counts → ``tpe [R, E]``, plan;
    2. each slot's destination from its global position (step 4); all-to-all the rows there;
    3. (MoonEP) all-to-all the replica weights from their home ranks;
    4. group the received rows by expert, home experts first, then the replicas; run the home experts on their
       rows with their own weights and (MoonEP) the replicas on theirs with the fetched weights; all-to-all the
       outputs back, combine ``Σ_j p_j·y_j``.

    One host sync per forward (the split sizes), taken after the source side is queued. When no rank of the
    group lends an expert (balanced routing) no weight moves and step 3 is skipped on every rank.

    Records ``last_plan`` (:class:`MoonEPPlan`) and ``last_slots_per_rank`` ([R] int64).
    """

    def __init__(self, group: ProcessGroup | None, kind: str, num_experts: int):
        _check_kind(kind)
        self.group, self.kind, self.num_experts = group, kind, num_experts
        self.num_ranks, self.rank = group_size(group), group_rank(group)
        check_divisible(num_experts, self.num_ranks)
        self.num_local = num_experts // self.num_ranks
        self._local = LocalDispatcher()  # its combine
        self.last_plan: MoonEPPlan | None = None
        self.last_slots_per_rank: Tensor | None = None

    def run(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, experts: RoutedExperts) -> Tensor:
        R, r, E, El = self.num_ranks, self.rank, self.num_experts, self.num_local
        if (experts.num_experts, experts.num_local_experts, experts.expert_offset) != (E, El, r * El):
            raise ValueError(f"experts: holds experts [{experts.expert_offset}, +{experts.num_local_experts}) of "
                             f"{experts.num_experts}; rank {r} of {R} needs [{r * El}, +{El}) of {E} "
                             "(use apply_expert_parallel)")
        S, K = topk_idx.shape
        dev = z.device
        flat = topk_idx.reshape(-1)                                                       # [S·K]
        order = flat.argsort(stable=True)                                                 # [S·K] slots by expert
        counts = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))  # [E]
        tpe = all_gather(counts[None], self.group)                                        # [R, E]
        plan = plan_moonep(tpe, K, check=False) if self.kind == "moonep" else plan_ep(tpe)

        # split sizes: this rank's rows to / from every rank, replica weights to / from every rank
        src_end, dst_end = tpe.cumsum(0), plan.alloc.cumsum(1)                           # [R, E], [E, R]
        src_start, dst_start = src_end - tpe, dst_end - plan.alloc
        n_out = _overlap(src_start[r][:, None], src_end[r][:, None], dst_start, dst_end)  # [E, R(d)] from me
        n_in = _overlap(src_start, src_end, dst_start[:, r], dst_end[:, r])               # [R(s), E] to me
        rep = plan.replicas                                                               # [E, R]
        w_rows = rep.view(R, El, R).sum(1)                                                # [R(h), R(d)]
        n_home = n_in[:, r * El:(r + 1) * El].sum()                                       # my rows of home experts
        sizes = torch.cat([n_out.sum(0), n_in.sum(1), w_rows[r], w_rows[:, r], tpe.sum(1),
                           torch.stack([n_home, w_rows.sum()])])                          # [5·R + 2]
        if sizes.is_cuda:  # copy to pinned memory without blocking; the source side below needs no host value
            host, ready = sizes.to("cpu", non_blocking=True), torch.cuda.Event()
            ready.record()
        else:
            host, ready = sizes, None

        # source side: slot i (sorted by expert e, position p among my slots of e) sits at global
        # position g = start_r(e) + p of expert e's slots; its destination d is where g falls in cumsum(alloc[e])
        e_sorted = flat.index_select(0, order)                                            # [S·K]
        pos = torch.arange(S * K, device=dev) - (counts.cumsum(0) - counts).index_select(0, e_sorted)
        g = src_start[r].index_select(0, e_sorted) + pos                                  # [S·K]
        dst = (g[:, None] >= dst_end.index_select(0, e_sorted)).sum(1)                    # [S·K] destination
        send_slots = order.index_select(0, dst.argsort(stable=True))                      # [S·K] by (d, e, p)
        x_send = z.index_select(0, send_slots // K)                                       # [S·K, L] by (d, e, p)

        if ready is not None:
            ready.synchronize()
        host = host.tolist()                                                              # the one host sync
        send, recv, w_send, w_recv, slots_in = (host[i * R:(i + 1) * R] for i in range(5))
        n_home, n_replica_rows = host[5 * R:]
        if self.kind == "moonep":
            check_equal_tokens(slots_in, K)
        x_recv = all_to_all(x_send, recv, send, self.group)                               # [Σ recv, L] (s, e, p)

        # destination side: rows grouped by bank expert [home experts; replicas]
        rep_ids, rep_weights = self._replicas(experts, rep, w_send, w_recv) if n_replica_rows else (None, None)
        bank_ids = torch.arange(r * El, (r + 1) * El, device=dev)                         # [El] home experts
        if rep_ids is not None:
            bank_ids = torch.cat([bank_ids, rep_ids])                                     # [El + n_rep]
        bank_of = torch.full((E,), -1, dtype=torch.int64, device=dev)
        bank_of.scatter_(0, bank_ids, torch.arange(bank_ids.numel(), device=dev))       # [E] expert -> bank row
        row_expert = torch.arange(E, device=dev).repeat(R).repeat_interleave(n_in.reshape(-1), output_size=sum(recv))
        row_bank = bank_of.index_select(0, row_expert)                                    # [Σ recv]
        perm = row_bank.argsort(stable=True)                                              # [Σ recv] by bank expert
        bank_counts = torch.zeros(bank_ids.numel(), dtype=torch.int64, device=dev).index_add_(
            0, row_bank, torch.ones_like(row_bank))                                       # [El + n_rep]
        x_sorted = x_recv.index_select(0, perm)                                           # [Σ recv, L]
        y = experts(x_sorted[:n_home], bank_counts[:El])                                  # home experts, own weights
        if rep_weights is not None:  # the replicas with the fetched weights: no copy of the home experts' weights
            if sum(w_recv):
                y = torch.cat([y, experts(x_sorted[n_home:], bank_counts[El:], rep_weights)])
            else:  # a rank that only lends: autograd must still reach its all-to-all (the backward is a collective)
                y = y + sum(w.sum() for w in rep_weights) * 0
        y_recv = torch.zeros_like(y).index_copy(0, perm, y)                               # (s, e, p) order
        y_back = all_to_all(y_recv, send, recv, self.group)                               # [S·K, L] send order

        self.last_plan, self.last_slots_per_rank = plan, plan.slots
        dplan = DispatchPlan(send_slots, counts, S, K, data=dict(plan=plan, send=send, recv=recv))
        return self._local.combine(y_back, dplan, topk_weight)                            # [S, L] fp32

    def _replicas(self, experts: RoutedExperts, rep: Tensor, w_send: list[int], w_recv: list[int]):
        """(rep_ids [n_rep] global expert ids ascending, (w1, w3, w2) of those experts): the weights of the
        experts this rank computes away from their home, fetched by an autograd all-to-all whose backward
        returns the replicas' gradients home. Called on every rank when any rank of the group has a replica.
        Only the lent experts' rows are gathered, one weight at a time (at K3 widths the home experts of
        one rank are 112 × 3 × 11.0M values: flattening them into one tensor made 3.7G elements)."""
        R, r, El = self.num_ranks, self.rank, self.num_local
        own = (experts.w1, experts.w3, experts.w2)                                        # [El, I, L] ×2, [El, L, I]
        mine = rep[r * El:(r + 1) * El].T.reshape(-1)                                    # [R·El] (d, local e) lent
        pick = mine.logical_not().to(torch.int32).argsort(stable=True)[:sum(w_send)] % El  # [Σ w_send] d-major
        rows = torch.cat([w.index_select(0, pick).flatten(1) for w in own], 1)           # [Σ w_send, 3·I·L]
        got = all_to_all(rows, w_recv, w_send, self.group)                               # [n_rep, 3·I·L]
        n_rep = sum(w_recv)
        rep_ids = rep[:, r].logical_not().to(torch.int32).argsort(stable=True)[:n_rep]   # [n_rep] ascending
        parts = got.split([w[0].numel() for w in own], 1)
        return rep_ids, tuple(p.view(n_rep, *w.shape[1:]) for w, p in zip(own, parts))


# ----------------------------------------------------------------------------------------------
# applying it to a model
# ----------------------------------------------------------------------------------------------
def apply_expert_parallel(model_or_moe: nn.Module, ep_group: ProcessGroup | None, kind: str = "moonep") -> nn.Module:
    """Shard every :class:`LatentMoE` in ``model_or_moe`` over ``ep_group`` (``kind`` in :data:`EP_KINDS`).

    On rank r of R: ``experts.w1/w3 [E, I, L]``, ``w2 [E, L, I]`` become new Parameters holding the
    home slice ``[r·E/R, (r+1)·E/R)`` (copies: a model built with the same seed on every rank keeps
    the single-process global weights), and the dispatcher becomes an
    :class:`ExpertParallelDispatcher`. Build optimizers after this call. Returns ``model_or_moe``
    (unchanged when it has no LatentMoE).
    """
    _check_kind(kind)
    R, r = group_size(ep_group), group_rank(ep_group)
    for moe in [m for m in model_or_moe.modules() if isinstance(m, LatentMoE)]:
        ex = moe.experts
        E = ex.num_experts
        check_divisible(E, R)
        if ex.num_local_experts != E:
            raise ValueError(f"experts: already sharded ({ex.num_local_experts} of {E} local); apply once")
        El = E // R
        for name in ("w1", "w3", "w2"):
            full = getattr(ex, name)
            part = full.detach()[r * El:(r + 1) * El].clone()                            # [E/R, …]
            setattr(ex, name, nn.Parameter(part, requires_grad=full.requires_grad))
        ex.expert_offset, ex.num_local_experts = r * El, El
        moe.dispatcher = ExpertParallelDispatcher(ep_group, kind, E)
    return model_or_moe
