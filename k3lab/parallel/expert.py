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

**Host work, one sync.** ``all_to_all_single`` takes python split lists, so each layer's forward reads
the all-gathered ``tpe [R, E]`` back to the host once; everything that follows from it is planned
there, in numpy, identically on every rank (ties break to the lowest rank): the plan (at most R−1
rounds), the route counts, the split sizes, and the two row orders, which are block permutations
with host-known block sizes (one small host → device copy, then ``repeat_interleave`` on the device).
Planning on the device instead cost ~280 tiny kernel launches a layer (forward; 2026-12-04), and a
step that waits on the host once a layer is bound by its launches. The backward adds no sync (the
all-to-alls keep their split lists). The real MoonEP kernels avoid the sync with NVSHMEM; note that
the per-rank *received* total is always exactly S·K, a static shape. The padded expert path (CPU)
adds its own sync for the largest group. Replica weights travel in the parameters' dtype (at most
E/R experts × 3·I·L values per rank and layer).
:mod:`k3lab.parallel.expert_static` is the same MoonEP with fixed shapes, planned on the device with no host read
(what a CUDA-graph capture needs), its exchange a parameter.

Use :func:`apply_expert_parallel` on a model (or one LatentMoE) built with the same seed on every
rank: it slices ``experts.w1/w2/w3`` to the rank's home experts and installs the dispatcher. The
router, shared experts, W↓/W↑ and the balancer stay local to the rank's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from k3lab.moe.latent import DispatchPlan, LatentMoE, LocalDispatcher, RoutedExperts
from k3lab.moe.router import expert_load
from k3lab.parallel.collectives import ProcessGroup, all_gather, all_to_all, group_rank, group_size
from k3lab.parallel.dims import EP_KINDS


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


def check_home_slice(experts: RoutedExperts, num_experts: int, num_ranks: int, rank: int) -> None:
    """``experts`` must hold rank ``rank``'s home experts ``[rank·E/R, (rank+1)·E/R)`` of E (apply_expert_parallel)."""
    E, R, r, El = num_experts, num_ranks, rank, num_experts // num_ranks
    if (experts.num_experts, experts.num_local_experts, experts.expert_offset) != (E, El, r * El):
        raise ValueError(f"experts: holds experts [{experts.expert_offset}, +{experts.num_local_experts}) of "
                         f"{experts.num_experts}; rank {r} of {R} needs [{r * El}, +{El}) of {E} "
                         "(use apply_expert_parallel)")


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
    return _plan(tpe, _counts_np(tpe), "ep")


def plan_moonep(tpe: Tensor, top_k: int, check: bool = True) -> MoonEPPlan:
    """MoonEP's balanced plan from the all-gathered counts ``tpe [R, E]`` (module docstring, steps 1–3).

    Host work: at most R−1 rounds of a few numpy ops on R × E integers (the dispatcher reads ``tpe``
    back once per forward anyway, for the all-to-all split sizes, so planning on the device would only
    add ~200 tiny kernel launches a layer). ``check`` validates equal S·K per rank. Every rank computes
    exactly ``CAP = S·K = tpe[r].sum()`` slots. The plan's tensors live on ``tpe``'s device.
    """
    counts = _counts_np(tpe)
    if check:
        check_equal_tokens(counts.sum(1).tolist(), top_k)
    return _plan(tpe, counts, "moonep")


def route_counts(plan: MoonEPPlan) -> Tensor:
    """[R(s), E, R(d)] int64 slots of expert e that source rank s sends to destination rank d.

    Expert e's slots in global (source, position) order are intervals ``[start_s, end_s)`` of
    ``cumsum_s tpe[s, e]``; destinations take the intervals ``[start_d, end_d)`` of
    ``cumsum_d alloc[e, d]``; the count is the overlap (module docstring, step 4).
    """
    n = _route_counts_np(_counts_np(plan.tpe), plan.alloc.cpu().numpy())
    return torch.from_numpy(n).to(plan.tpe.device)


def _plan(tpe: Tensor, counts: np.ndarray, kind: str) -> MoonEPPlan:
    alloc, quota, home_load = (_plan_moonep_np if kind == "moonep" else _plan_ep_np)(counts)
    dev = tpe.device
    return MoonEPPlan(kind, tpe, *(torch.from_numpy(a).to(dev) for a in (alloc, quota, home_load)))


def _counts_np(tpe: Tensor) -> np.ndarray:
    """The host copy of ``tpe [R, E]`` (validated) as int64 numpy."""
    _check_tpe(tpe)
    return tpe.detach().cpu().numpy().astype(np.int64, copy=False)


def _plan_ep_np(tpe: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(alloc [E, R], quota [R, R], home_load [R]) of plain EP: ``alloc[e, home(e)] = count_e``."""
    R, E = tpe.shape
    count = tpe.sum(0)                                                                    # [E]
    alloc = np.zeros((E, R), dtype=np.int64)
    alloc[np.arange(E), np.arange(E) // (E // R)] = count
    return alloc, np.zeros((R, R), dtype=np.int64), count.reshape(R, E // R).sum(1)


def _plan_moonep_np(tpe: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(alloc [E, R], quota [R, R], home_load [R]) of MoonEP (module docstring, steps 1–3), on the host."""
    R, E = tpe.shape
    El = E // R
    cap = int(tpe[0].sum())                                                               # S·K per rank
    remaining = tpe.sum(0).reshape(R, El).copy()                                          # [R, El] home slots kept
    home_load = remaining.sum(1)                                                          # [R]
    balance = home_load - cap                                                             # [R] surplus > 0 > deficit
    moved = np.zeros((R, El, R), dtype=np.int64)                                          # [h, e_local, u]
    for _ in range(R - 1):
        u, h = int(balance.argmin()), int(balance.argmax())                               # most under / overloaded
        need = max(-int(balance[u]), 0)                                                   # u's deficit (0: done)
        if need == 0:
            break
        balance[u] += need
        balance[h] -= need
        rem = remaining[h]                                                                # [El] (a view)
        idx = np.argsort(-rem, kind="stable")                                             # largest expert first
        vals = rem[idx]
        before = np.cumsum(vals) - vals                                                   # [El]
        take = np.zeros_like(rem)
        take[idx] = np.minimum(np.maximum(need - before, 0), vals)                       # [El] water fill
        rem -= take
        moved[h, :, u] += take
    alloc = moved.reshape(E, R).copy()                                                    # [E, R] lent slots
    alloc[np.arange(E), np.arange(E) // El] += remaining.reshape(E)                       # + kept at home
    return alloc, moved.sum(1), home_load


def _route_counts_np(tpe: np.ndarray, alloc: np.ndarray) -> np.ndarray:
    """[R(s), E, R(d)] slots of expert e that source rank s sends to destination rank d (:func:`route_counts`)."""
    src_end, dst_end = tpe.cumsum(0), alloc.cumsum(1)                                    # [R, E], [E, R]
    src, dst = (src_end - tpe)[:, :, None], (dst_end - alloc)[None]
    return (np.minimum(src_end[:, :, None], dst_end[None]) - np.maximum(src, dst)).clip(min=0)


def _replicas_np(alloc: np.ndarray) -> np.ndarray:
    """[E, R] bool: rank d computes slots of expert e away from its home (so needs its weights)."""
    E, R = alloc.shape
    away = (np.arange(E) // (E // R))[:, None] != np.arange(R)[None, :]
    return (alloc > 0) & away


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

    @torch.compiler.disable  # host planning on values read back every forward: eager (compiled it recompiled per step)
    def run(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, experts: RoutedExperts) -> Tensor:
        R, r, E, El = self.num_ranks, self.rank, self.num_experts, self.num_local
        check_home_slice(experts, E, R, r)
        S, K = topk_idx.shape
        dev = z.device
        flat = topk_idx.reshape(-1)                                                       # [S·K]
        counts = expert_load(flat, E)                                                     # [E]
        tpe = all_gather(counts[None], self.group)                                        # [R, E]
        tpe_host, ready = _to_host(tpe)
        order = flat.argsort(stable=True)                                                 # [S·K] slots by expert
        if ready is not None:
            ready.synchronize()
        tpe_np = tpe_host.numpy()                                                         # the one host sync
        if self.kind == "moonep":
            check_equal_tokens(tpe_np.sum(1).tolist(), K)
        alloc, quota, home_load = (_plan_moonep_np if self.kind == "moonep" else _plan_ep_np)(tpe_np)
        n = _route_counts_np(tpe_np, alloc)                                               # [R(s), E, R(d)]
        n_out, n_in = n[r], n[:, :, r]                                                    # [E, R(d)], [R(s), E]
        send, recv = n_out.sum(0).tolist(), n_in.sum(1).tolist()
        rep = _replicas_np(alloc)                                                         # [E, R]
        w_rows = rep.reshape(R, El, R).sum(1)                                             # [R(h), R(d)]
        w_send, w_recv = w_rows[r].tolist(), w_rows[:, r].tolist()
        rep_ids = np.flatnonzero(rep[:, r]) if w_rows.any() else np.zeros(0, dtype=np.int64)  # [n_rep] ascending
        bank_ids = np.concatenate([np.arange(r * El, (r + 1) * El), rep_ids])            # [G] home experts, replicas

        # Both row orders are block permutations with host-known block sizes, moved to the device in one copy.
        # Source: my slots sorted by expert are blocks (e, d) of n_out[e, d] rows (expert e's slots in global
        # (source, position) order go to destinations in rank order, step 4); they are sent d-major (d, e).
        # Destination: received rows come in blocks (s, e) of n_in[s, e]; the experts take them bank-major (g, s).
        send_shift, send_sizes = _block_shift(n_out)                                      # [R·E] each, d-major
        bank_shift, bank_sizes = _block_shift(n_in, bank_ids)                              # [G·R] each, g-major
        bank_counts = n_in[:, bank_ids].sum(0)                                            # [G]
        dev_ints = torch.from_numpy(np.concatenate([send_shift, send_sizes, bank_shift, bank_sizes, bank_counts]))
        if z.is_cuda:  # pinned (the caching host allocator), so that the copy does not wait on the stream
            dev_ints = dev_ints.pin_memory()
        send_shift, send_sizes, bank_shift, bank_sizes, bank_counts_d = dev_ints.to(dev, non_blocking=True).split(
            [R * E, R * E, len(bank_shift), len(bank_sizes), len(bank_counts)])
        i = torch.arange(S * K, device=dev) + send_shift.repeat_interleave(send_sizes, output_size=S * K)  # [S·K]
        send_slots = order.index_select(0, i)                                             # [S·K] by (d, e, p)
        x_send = z.index_select(0, send_slots // K)                                       # [S·K, L] by (d, e, p)
        x_recv = all_to_all(x_send, recv, send, self.group)                               # [Σ recv, L] (s, e, p)

        # destination side: rows grouped by bank expert [home experts; replicas]
        n_recv, n_home = sum(recv), int(bank_counts[:El].sum())
        perm = torch.arange(n_recv, device=dev) + bank_shift.repeat_interleave(bank_sizes, output_size=n_recv)
        x_sorted = x_recv.index_select(0, perm)                                           # [Σ recv, L] by bank
        y = experts(x_sorted[:n_home], bank_counts_d[:El])                                # home experts, own weights
        # The weight all-to-all is a collective of the whole group, so whether it runs is decided from w_rows,
        # which every rank computed from the same gathered tpe: a rank that neither lends nor borrows this step
        # still takes part (with empty splits), or the others' all-to-all would meet a different collective.
        if w_rows.any():  # the replicas, on weights fetched from their homes (MoonEP only)
            rep_weights = self._replicas(experts, rep, w_send, w_recv, experts.matmul_dtype(z))
            if len(rep_ids):
                y = torch.cat([y, experts(x_sorted[n_home:], bank_counts_d[El:], rep_weights)])
            else:  # lends only, or neither: autograd must still reach its all-to-all (the backward is a collective)
                y = y + sum(w.sum() for w in rep_weights) * 0
        y_recv = torch.zeros_like(y).index_copy(0, perm, y)                               # (s, e, p) order
        y_back = all_to_all(y_recv, send, recv, self.group)                               # [S·K, L] send order

        plan = MoonEPPlan(self.kind, *(torch.from_numpy(a) for a in (tpe_np, alloc, quota, home_load)))
        self.last_plan, self.last_slots_per_rank = plan, plan.slots
        dplan = DispatchPlan(send_slots, counts, S, K, data=dict(plan=plan, send=send, recv=recv))
        return self._local.combine(y_back, dplan, topk_weight)                            # [S, L] fp32

    def _replicas(self, experts: RoutedExperts, rep: np.ndarray, w_send: list[int], w_recv: list[int],
                  dtype: torch.dtype):
        """(w1, w3, w2) of the experts this rank computes away from their home (ascending global ids), fetched
        by an autograd all-to-all whose backward returns the replicas' gradients home. Called on every rank
        when any rank of the group has a replica. Only the lent experts' rows are gathered, one weight at a
        time (at K3 widths the home experts of one rank are 112 × 3 × 11.0M values: flattening them into one
        tensor made 3.7G elements). They cross in ``dtype``, the one the expert matmuls read them in
        (:meth:`~k3lab.moe.latent.RoutedExperts.matmul_dtype`: bf16 under autocast, the same values)."""
        r, El = self.rank, self.num_local
        own = (experts.w1, experts.w3, experts.w2)                                        # [El, I, L] ×2, [El, L, I]
        pick = np.flatnonzero(rep[r * El:(r + 1) * El].T.reshape(-1)) % El              # [Σ w_send] d-major
        pick = torch.from_numpy(pick).to(own[0].device, non_blocking=True)
        rows = torch.cat([w.index_select(0, pick).flatten(1) for w in own], 1).to(dtype)  # [Σ w_send, 3·I·L]
        got = all_to_all(rows, w_recv, w_send, self.group)                               # [n_rep, 3·I·L]
        n_rep = sum(w_recv)
        parts = got.split([w[0].numel() for w in own], 1)
        return tuple(p.view(n_rep, *w.shape[1:]) for w, p in zip(own, parts))


def _to_host(x: Tensor) -> tuple[Tensor, "torch.cuda.Event | None"]:
    """A host copy of a small device tensor, started without blocking (CUDA: wait on the event before reading)."""
    if not x.is_cuda:
        return x, None
    host, ready = x.to("cpu", non_blocking=True), torch.cuda.Event()
    ready.record()
    return host, ready


def _block_shift(sizes: np.ndarray, columns: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows in blocks ``(a, b)`` of ``sizes [A, B]`` rows, laid out a-major, re-laid b-major with the columns
    taken in the order ``columns`` (default all, ascending; a column left out must hold no rows). Returns
    ``(shift, n)`` over the blocks in the new order such that the row at new position j comes from a-major
    position ``j + shift[block of j]`` (``n`` = the blocks' sizes, for ``repeat_interleave``)."""
    A, B = sizes.shape
    a_start = (np.cumsum(sizes.reshape(-1)) - sizes.reshape(-1)).reshape(A, B)          # [A, B]
    cols = np.arange(B) if columns is None else columns
    t = sizes[:, cols].T                                                                  # [G, A]
    b_start = (np.cumsum(t.reshape(-1)) - t.reshape(-1)).reshape(t.shape)                 # [G, A]
    return (a_start[:, cols].T - b_start).reshape(-1), t.reshape(-1).copy()


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
