"""MoonEP with fixed shapes: planned on the device, no host read, so a CUDA graph can capture it (issue 37).

:class:`k3lab.parallel.expert.ExpertParallelDispatcher` reads the all-gathered counts ``tpe [R, E]`` back to the host
once per MoE layer: ``all_to_all_single`` takes Python split lists, and the plan is cheapest in numpy. A CUDA-graph
capture forbids that read. MoonEP's own guarantee makes a fixed-shape form possible:

* every rank sends its S·K slots and **receives exactly CAP = S·K slots** (the plan balances every rank to CAP), so
  the rows a rank computes are a static ``[S·K, L]``; only how they split over the source ranks varies;
* every rank borrows from **one** donor, each lent expert once, so it holds at most ``El = E/R`` replicas;
* a donor fills at most R−1 receivers, one round each, and a round's water fill empties every expert it takes
  from except the last: a home rank lends at most ``El + R − 2`` (expert, receiver) pairs.

So the rows, the replica weights and their counts fit fixed buffers: ``[S·K, L]`` rows each way, ``[El + R − 2]``
weight rows out and ``[El]`` in (padding rows are zero and belong to no expert: their group counts are 0).

Here everything is computed on the device from ``tpe``: the plan (:func:`plan_moonep_torch`, the same greedy as
:func:`k3lab.parallel.expert.plan_moonep`, at most R−1 rounds of a few tensor ops, equal to it), the destination of
every slot, both row orders and the group counts. The only thing that still needs variable split sizes is the
exchange itself, which is a parameter (:data:`Exchange`):

* :func:`exchange_reference` reads the split sizes on the host and runs the autograd all-to-all of
  :mod:`k3lab.parallel.collectives` (any backend, gloo included; not capturable). With it this dispatcher equals
  one process (``tests/test_moonep_property.py``); the split sizes of a forward's three exchanges come to the host
  in one copy (one device sync a MoE layer, as the host-planned dispatcher's count read).
* A capturable exchange takes the split sizes as device tensors: NVSHMEM's device-initiated all-to-all
  (``torch.ops.symm_mem.all_to_all_vdev``), which needs real GPUs on one host; none was lent, so it is not here.
  ``kernels/predict_scaling.py`` times a fake-group rank with a fixed-size stand-in of the same bytes.

The experts run as one grouped call over ``2·El`` groups: the home experts, then the replica slots (padding groups
empty). Eager, the plan's rounds cost ~300 small kernels per forward more than the host plan; a graph launches them
at once. Under ``torch.compile`` only the collectives (the count all-gather and the three exchanges) run eager: the
plan, the row orders and the expert call are traced between them, so the experts' activation is fused as with the
local dispatcher (an earlier version ran the whole dispatcher eager: on one H100 its EP rank took 2.9× the FSDP
rank's step).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from k3lab.moe.latent import DispatchPlan, DispatchRows, LatentMoE, LocalDispatcher, RoutedExperts
from k3lab.moe.router import expert_load
from k3lab.parallel.collectives import ProcessGroup, all_gather, all_to_all, group_rank, group_size
from k3lab.parallel.expert import check_divisible, check_home_slice

# exchange(x [C_in, …], send [R], recv [R], rows_out, group) -> [rows_out, …]: the first send[d] rows of x (after the
# send[<d] before them) go to rank d; the result holds recv[s] rows from each rank s in rank order, then zero rows
# up to rows_out. send/recv are int64 tensors: on the host for an exchange whose ``host_splits`` attribute is True (the
# dispatcher reads all of a forward's split sizes in one device-to-host copy), else on the device. The backward is
# the reverse exchange. An exchange whose ``capturable`` attribute is True reads nothing on the host (a CUDA graph
# can record it). An exchange whose ``places_rows`` attribute is True also takes the keywords ``take`` and ``place``,
# each None or a pair ``(order, inverse)`` of a row permutation and its inverse: it sends ``x[take order]`` and returns
# ``got[place order]`` (``got`` the result above). These are the row orders a two-dimensional all-to-all writes as it
# moves the rows (``torch.ops.symm_mem.all_to_all_vdev_2d`` receives them expert-major, its ``_offset`` form sends
# them back from expert-major), so the dispatcher leaves its bank-major permutations to such an exchange; for any
# other exchange it permutes the rows itself, one gather each way and one more in each backward. An exchange whose
# ``reads_rows`` attribute is an int reads no more than the first ``reads_rows`` rows of ``x`` (the rows after them
# would get a zero gradient): as the replica weights' exchange it is handed only those rows. A device-initiated exchange
# reads the rows it sends where they lie; the send buffer of El + R − 2 rows (MoonEP's bound), which
# ``exchange_reference`` needs, would otherwise be filled and its gradient added on every step for rows no exchange
# reads (at K3's widths 118 experts' weights a forward, where a MoE layer lends a few).
Exchange = Callable[..., Tensor]


def permute_rows(x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
    """``x[order]`` ([M, …]; ``inverse`` the inverse permutation of ``order``), its backward the gather through
    ``inverse`` (:class:`~k3lab.moe.latent.DispatchRows` with k = 1), not ``index_select``'s ``index_add``."""
    return DispatchRows.apply(x, order, inverse, 1)


class _CastAndPick(torch.autograd.Function):
    """``(bank, low[pick])`` with ``low = w.to(dtype)`` written into the first ``El`` rows of ``bank`` (``[El + spare,
    …]``; the ``spare`` rows left for :func:`fill_replicas`): the bank's home weights, cast once a forward straight
    into the bank the expert call reads, and the rows this rank may lend picked from them. One gradient for ``w``: the
    cast's (``∂bank[:El]`` in ``w``'s dtype; the spare rows' gradient is not ``w``'s), into which the picked rows'
    gradients are index-added in ``w``'s dtype. The values are those of ``w.to(dtype)`` and
    ``w.index_select(0, pick).to(dtype)``, and so is the gradient where no row is picked twice with a nonzero gradient
    (where one is, the same fp32 terms are summed in another order). Spared: the picked rows' copy in ``w``'s dtype,
    a second ``w``-sized gradient (at K3's widths 118 experts' fp32 weights and 112 experts' fp32 gradient, 15.6 and
    14.8 GB each forward and backward), and a copy of the cast home weights into the bank."""

    @staticmethod
    def forward(ctx, w: Tensor, pick: Tensor, dtype: torch.dtype, spare: int) -> tuple[Tensor, Tensor]:
        El = w.shape[0]
        bank = w.new_empty((El + spare, *w.shape[1:]), dtype=dtype)                       # [El + spare, …]
        bank[:El].copy_(w)                                                                # the cast, once
        ctx.save_for_backward(pick)
        ctx.shape, ctx.dtype = w.shape, w.dtype
        return bank, bank[:El].index_select(0, pick)                                      # [El + spare, …], [P, …]

    @staticmethod
    def backward(ctx, g_bank: Tensor | None, g_picked: Tensor | None):
        (pick,) = ctx.saved_tensors
        El = ctx.shape[0]
        if g_bank is None:
            grad = torch.zeros(ctx.shape, dtype=ctx.dtype, device=pick.device)
        else:
            grad = g_bank[:El].to(ctx.dtype, copy=True)
        if g_picked is not None:
            grad.index_add_(0, pick, g_picked.to(ctx.dtype))
        return grad, None, None, None


def cast_and_pick(w: Tensor, pick: Tensor, dtype: torch.dtype, spare: int = 0) -> tuple[Tensor, Tensor]:
    """``(torch.cat([w.to(dtype), <spare rows>]), w.index_select(0, pick).to(dtype))`` as one op with one gradient for
    ``w`` (:class:`_CastAndPick`); the ``spare`` rows are left unset, for :func:`fill_replicas`."""
    return _CastAndPick.apply(w, pick, dtype, spare)


class _FillReplicas(torch.autograd.Function):
    """Write the replica rows ``got [El, Σ rows of a weight]`` into the spare rows ``[El:]`` of the banks (in place;
    each bank ``[El + El, …]``): the expert call then reads one bank a weight, home experts then replicas, with no
    concatenation (at K3's widths each forward's three concatenations wrote and read 14.8 GB). Backward: each bank's
    gradient passes on whole (:class:`_CastAndPick` reads its home rows), and ``got``'s is its spare rows'."""

    @staticmethod
    def forward(ctx, got: Tensor, *banks: Tensor) -> tuple[Tensor, ...]:
        El = got.shape[0]
        for bank, part in zip(banks, got.split([b[0].numel() for b in banks], 1)):
            bank[El:].copy_(part.view(El, *bank.shape[1:]))
        ctx.mark_dirty(*banks)
        ctx.rows = El
        return banks

    @staticmethod
    def backward(ctx, *g_banks: Tensor):
        El = ctx.rows
        g_got = torch.cat([g[El:].flatten(1) for g in g_banks], 1)                       # [El, Σ rows]
        return (g_got, *g_banks)


@torch.compiler.disable  # an in-place autograd Function: eager between the compiled pieces (or captured by a graph)
def fill_replicas(banks: tuple[Tensor, ...], got: Tensor) -> tuple[Tensor, ...]:
    """The banks of :func:`cast_and_pick` (``spare = El``) with the replica rows ``got`` written into their spare rows
    (:class:`_FillReplicas`): ``(w1, w3, w2)`` of the ``2·El`` banks, home experts then replicas."""
    return _FillReplicas.apply(got, *banks)


def exchange_reference(x: Tensor, send: Tensor, recv: Tensor, rows_out: int, group: ProcessGroup | None,
                       take: tuple[Tensor, Tensor] | None = None, place: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """:data:`Exchange` by the autograd all-to-all, split sizes read on the host (any backend; not capturable); its
    ``take``/``place`` orders are gathers before and after the all-to-all."""
    send_l, recv_l = send.tolist(), recv.tolist()
    if sum(recv_l) > rows_out:
        raise ValueError(f"exchange: {sum(recv_l)} rows to receive, the fixed buffer holds {rows_out}")
    if take is not None:
        x = permute_rows(x, *take)
    got = all_to_all(x[: sum(send_l)], recv_l, send_l, group)                           # [Σ recv, …]
    got = torch.cat([got, got.new_zeros(rows_out - got.shape[0], *got.shape[1:])])      # [rows_out, …]
    return got if place is None else permute_rows(got, *place)


exchange_reference.host_splits = True  # its split sizes come to the host anyway: one read a forward, not three
exchange_reference.capturable = False
exchange_reference.places_rows = True

_DEFAULT_EXCHANGE: list[Exchange] = [exchange_reference]  # a stack: default_exchange() pushes and pops


def current_exchange() -> Exchange:
    """The exchange :func:`apply_static_moonep` uses when it is given none: :func:`exchange_reference`, or what an
    enclosing :func:`default_exchange` set."""
    return _DEFAULT_EXCHANGE[-1]


@contextlib.contextmanager
def default_exchange(exchange: Exchange) -> Iterator[None]:
    """Within the block, models laid out with ``ep_plan="device"`` (``fit``, ``parallelize``) use ``exchange``: how a
    timing harness gives ``fit`` a capturable stand-in (``kernels/predict_scaling.py``'s ``fixed_size_exchange``),
    and where a device-initiated exchange would plug in."""
    _DEFAULT_EXCHANGE.append(exchange)
    try:
        yield
    finally:
        _DEFAULT_EXCHANGE.pop()


def capturable(exchange: Exchange) -> bool:
    """Whether ``exchange`` reads nothing on the host (its ``capturable`` attribute), so a CUDA graph can record it."""
    return bool(getattr(exchange, "capturable", False))


def plan_moonep_torch(tpe: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(alloc [E, R], quota [R, R], home_load [R]) int64 from ``tpe [R, E]`` on its device, with no host read.

    The greedy of :func:`k3lab.parallel.expert.plan_moonep` (module docstring there, steps 1–3), round for round:
    the most underloaded rank u is filled from the most overloaded home h (ties to the lowest rank), h's experts
    with the most remaining slots first. It always runs R−1 rounds; a round with nothing left to fill moves 0."""
    R, E = tpe.shape
    El = E // R
    dev = tpe.device
    ranks = torch.arange(R, device=dev)                                                   # [R]
    cap = tpe[0].sum()                                                                    # 0-d S·K
    remaining = tpe.sum(0).view(R, El).clone()                                            # [R, El] home slots kept
    home_load = remaining.sum(1)                                                          # [R]
    balance = home_load - cap                                                             # [R]
    moved = torch.zeros(R, El, R, dtype=torch.int64, device=dev)                          # [h, e_local, u]
    for _ in range(R - 1):
        u, h = balance.argmin(), balance.argmax()                                         # 0-d each
        need = (-balance.gather(0, u[None])).clamp(min=0)                                 # [1] u's deficit
        at_u, at_h = (ranks == u).long(), (ranks == h).long()                             # [R] one-hot
        balance = balance + need * at_u - need * at_h
        rem = remaining.index_select(0, h[None])[0]                                       # [El]
        vals, idx = rem.sort(descending=True, stable=True)                                # largest expert first
        before = vals.cumsum(0) - vals                                                    # [El]
        take = torch.zeros_like(rem).scatter(0, idx, torch.minimum((need - before).clamp(min=0), vals))  # [El]
        remaining = remaining - at_h[:, None] * take[None]
        moved = moved + at_h[:, None, None] * take[None, :, None] * at_u[None, None, :]
    kept = torch.zeros(E, R, dtype=torch.int64, device=dev).scatter(
        1, (torch.arange(E, device=dev) // El)[:, None], remaining.reshape(E, 1))        # [E, R] at home
    alloc = moved.reshape(E, R) + kept                                                    # lent + kept at home
    return alloc, moved.sum(1), home_load


def route_counts_torch(tpe: Tensor, alloc: Tensor) -> Tensor:
    """[R(s), E, R(d)] slots of expert e that source s sends to destination d (as :func:`~k3lab.parallel.expert.
    route_counts`): the overlap of s's interval of e's slots with d's."""
    src_end, dst_end = tpe.cumsum(0), alloc.cumsum(1)                                    # [R, E], [E, R]
    lo = torch.maximum((src_end - tpe)[:, :, None], (dst_end - alloc)[None])             # [R, E, R]
    return (torch.minimum(src_end[:, :, None], dst_end[None]) - lo).clamp(min=0)


class StaticMoonEPDispatcher:
    """MoonEP's dispatch with fixed shapes and no host read (module docstring); ``run`` as
    :class:`k3lab.parallel.expert.ExpertParallelDispatcher`'s: ``z [S, L]``, ``topk_idx [S, K]``,
    ``topk_weight [S, K]``, ``experts`` (this rank's home slice) -> ``u [S, L]`` fp32.

    Per forward on rank r (M = S·K slots):

    1. count the slots per expert, all-gather → ``tpe [R, E]``; plan on the device; ``n [R, E, R]`` route counts;
    2. each sorted slot's global position in its expert's list picks its destination d (``searchsorted`` in
       ``cumsum_d alloc[e, d]``); the slots are sent (d, e, p)-ordered: ``[M, L]`` out, ``[M, L]`` in;
    3. received rows, in blocks (s, e), are grouped by bank: home experts, then the ≤ El replicas in global id
       order (padded to El groups), by the exchange itself where it places rows (:data:`Exchange`);
    4. the replica weights come from their donor in one exchange (``[El + R − 2]`` rows out, ``[El]`` in);
    5. one grouped expert call over the 2·El groups, rows back to received order, exchanged back, combined.

    Records ``last_alloc`` ([E, R] int64) and ``last_slots_per_rank`` ([R] int64: the rows each rank receives by the
    plan, S·K on every rank), both on the device, after each forward.

    ``weight_exchange``: the exchange of step 4 (None: ``exchange``; a timing harness gives it a stand-in that moves
    a stated number of weight rows, ``kernels/predict_scaling.py``'s ``lent=``).

    ``chunks`` (``ParallelOptions.ep_chunks``): the S tokens cut into equal chunks, each planned and exchanged alone
    (S·K/chunks slots a rank each; ``last_alloc`` is then the sum of the chunks' plans). Every chunk is planned and
    sent before any is computed; with ``comm_stream`` (CUDA) the exchanges run there and each chunk's experts wait on
    that chunk's exchanges alone, so one chunk's exchange runs beside another chunk's experts.
    """

    def __init__(self, group: ProcessGroup | None, num_experts: int, exchange: Exchange = exchange_reference,
                 backend: str = "torch", weight_exchange: Exchange | None = None):
        self.group, self.num_experts, self.exchange = group, num_experts, exchange
        self.weight_exchange = exchange if weight_exchange is None else weight_exchange  # step 4's
        self.num_ranks, self.rank = group_size(group), group_rank(group)
        check_divisible(num_experts, self.num_ranks)
        self.num_local = num_experts // self.num_ranks
        self._local = LocalDispatcher(backend)  # its combine (the fused row kernels on "triton"/"auto" + CUDA)
        self.last_alloc: Tensor | None = None
        self.last_slots_per_rank: Tensor | None = None
        self._host: tuple[Tensor, Tensor] | None = None  # (the forward's split sizes, their host copy)
        self.host_reads = 0  # device-to-host copies of split sizes so far (one a forward with exchange_reference)
        self.chunks = 1  # ParallelOptions.ep_chunks: the tokens cut into this many chunks, each planned and sent alone
        self.comm_stream: torch.cuda.Stream | None = None  # CUDA with chunks > 1: where the exchanges run
        self._done: dict[tuple[int, int], torch.cuda.Event] = {}  # (chunk, exchange) -> its end on comm_stream

    def run(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, experts: RoutedExperts) -> Tensor:
        R, r, E, C = self.num_ranks, self.rank, self.num_experts, self.chunks
        check_home_slice(experts, E, R, r)
        S = topk_idx.shape[0]
        if S % C:
            raise ValueError(f"StaticMoonEPDispatcher: {S} tokens do not split into ParallelOptions.ep_chunks={C} "
                             "equal chunks (the chunks' buffers have fixed shapes)")
        # every chunk planned and sent before any is computed: with a communication stream (CUDA, chunks > 1) the
        # next chunk's exchange runs beside this chunk's experts, and this chunk's return beside the next one's
        flights = [self._send(zc, ic, experts, c) for c, (zc, ic) in enumerate(zip(z.chunk(C), topk_idx.chunk(C)))]
        for c, f in enumerate(flights):
            self._compute(f, experts, c)
        out = [self._combine(f, wc, c) for c, (f, wc) in enumerate(zip(flights, topk_weight.chunk(C)))]
        self.last_alloc = sum(f["alloc"] for f in flights)                                # [E, R]
        self.last_slots_per_rank = sum(f["n"].sum((0, 1)) for f in flights)              # [R]
        return out[0] if C == 1 else torch.cat(out)                                      # [S, L] fp32

    def _send(self, z: Tensor, topk_idx: Tensor, experts: RoutedExperts, c: int) -> dict:
        """Steps 1–2 and 4 of the class docstring for one chunk: the plan, the rows out and the replica weights in
        (the exchanges started); the state the later steps read."""
        R, r, E, El = self.num_ranks, self.rank, self.num_experts, self.num_local
        S, K = topk_idx.shape
        M, dev = S * K, z.device
        ar = torch.arange(M, device=dev)                                                  # [M]
        flat = topk_idx.reshape(-1)                                                       # [M]
        counts = expert_load(flat, E)                                                     # [E]
        tpe = self._gather(counts[None])                                                  # [R, E]
        alloc, _, _ = plan_moonep_torch(tpe)                                              # [E, R]
        n = route_counts_torch(tpe, alloc)                                                # [R(s), E, R(d)]

        # source side: destination of each slot, then (d, e, p) order
        order = flat.argsort(stable=True)                                                 # [M] slots by expert
        e_sorted = flat.index_select(0, order)                                            # [M]
        first_local = (counts.cumsum(0) - counts).index_select(0, e_sorted)               # [M]
        first_global = (tpe.cumsum(0) - tpe)[r].index_select(0, e_sorted)                 # [M] ranks < r before
        position = first_global + ar - first_local                                        # [M] in e's global list
        bounds = alloc.cumsum(1).index_select(0, e_sorted)                                # [M, R]
        d = torch.searchsorted(bounds, position[:, None], right=True)[:, 0]               # [M] destination rank
        # (d, e, p) order without a sort: block (d, e) starts after every block before it, and within a block the
        # slots keep their order in e's list; a slot's rank in its block is its rank in e less the slots of e that
        # r sends to ranks before d
        mine = n[r]                                                                       # [E, R(d)] r's slots
        block_start = (mine.T.reshape(-1).cumsum(0) - mine.T.reshape(-1)).view(R, E)      # [R(d), E]
        before_d = mine.cumsum(1) - mine                                                  # [E, R(d)]
        at = block_start[d, e_sorted] + ar - first_local - before_d[e_sorted, d]          # [M] place in the send rows
        send_slots = torch.empty_like(order).scatter_(0, at, order)                       # [M] by (d, e, p)
        send_inv = torch.empty_like(order).scatter_(0, order, at)                         # [M] its inverse
        home = torch.arange(E, device=dev) // El                                          # [E]
        rep = (alloc > 0) & (home[:, None] != torch.arange(R, device=dev)[None])         # [E, R] replicas
        splits = torch.stack([n[r].sum(0), n[:, :, r].sum(1),                             # rows out, in
                              rep[r * El:(r + 1) * El].sum(0), rep[:, r].view(R, El).sum(1)])  # weights out, in
        bank_counts, bank_order = self._banks(n, rep, home, M)                            # [2·El], ([M], [M])
        place = bank_order if self._places_rows else None
        x_recv = self._exchange(self._rows(z, send_slots, send_inv, K), splits, 0, 1, M, (c, 0),
                                place=place)                                              # [M, L] by bank or (s, e, p)
        pick = self._lent_rows(rep)                                                       # [P ≤ El + R − 2]
        banks, picked = zip(*[cast_and_pick(w, pick, experts.matmul_dtype(z), El)
                              for w in (experts.w1, experts.w3, experts.w2)])             # the home weights cast once
        replicas = self._replicas(picked, splits, (c, 1))                                 # [El, 3·I·L]
        return dict(S=S, K=K, M=M, n=n, alloc=alloc, counts=counts, splits=splits, send_slots=send_slots,
                    send_inv=send_inv, x_recv=x_recv, replicas=replicas, banks=banks, bank_counts=bank_counts,
                    bank_order=bank_order)

    def _banks(self, n: Tensor, rep: Tensor, home: Tensor, M: int) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Step 3: the rows each of the 2·El banks gets (``[2·El]``) and the bank-major order of the received rows
        with its inverse (``perm``, ``perm_inv``, ``[M]`` each: bank-major row j is received row ``perm[j]``).
        Without a sort: the rows of bank b are its expert's blocks (s, e) in source order."""
        R, r, E, El = self.num_ranks, self.rank, self.num_experts, self.num_local
        dev = n.device
        ar = torch.arange(M, device=dev)                                                  # [M]
        to_me = n[:, :, r]                                                                # [R(s), E] blocks in
        n_in = to_me.reshape(-1)                                                          # [R·E] (s, e) order
        block = torch.searchsorted(n_in.cumsum(0), ar, right=True)                        # [M] block of each row
        rep_rank = rep[:, r].long().cumsum(0) - 1                                         # [E] slot among mine
        bank_of = torch.where(home == r, torch.arange(E, device=dev) - r * El, El + rep_rank)  # [E] (where held)
        rows_of = to_me.sum(0)                                                            # [E] rows of e here
        bank_counts = torch.zeros(2 * El, dtype=torch.int64, device=dev).scatter_add_(
            0, bank_of.clamp(0, 2 * El - 1), torch.where(rows_of > 0, rows_of, 0))      # [2·El] rows a group
        bank_start = bank_counts.cumsum(0) - bank_counts                                  # [2·El]
        dest = (bank_start.index_select(0, bank_of.clamp(0, 2 * El - 1))[None]
                + to_me.cumsum(0) - to_me)                                                # [R(s), E] block starts
        perm_inv = dest.reshape(-1).index_select(0, block) + ar - (n_in.cumsum(0) - n_in).index_select(0, block)
        perm = torch.empty_like(perm_inv).scatter_(0, perm_inv, ar)                        # [M] bank-major
        return bank_counts, (perm, perm_inv)

    def _compute(self, f: dict, experts: RoutedExperts, c: int) -> None:
        """Step 5 for one chunk: the received rows bank-major (by the exchange where it places rows), the grouped
        expert call, the rows back (exchange started). Sets ``f["y_back"]``."""
        M = f["M"]
        self._wait((c, 0))
        self._wait((c, 1))
        weights = fill_replicas(f["banks"], f["replicas"])                                 # [2·El, …] ×3
        perm, perm_inv = f["bank_order"]
        if self._places_rows:  # the exchange placed them bank-major and takes them back from that order
            y = experts(f["x_recv"], f["bank_counts"], weights)                           # [M, L] by bank
            f["y_back"] = self._exchange(y, f["splits"], 1, 0, M, (c, 2), take=(perm_inv, perm))  # (d, e, p) order
        else:
            y = experts(permute_rows(f["x_recv"], perm, perm_inv), f["bank_counts"], weights)  # [M, L] by bank
            y_recv = permute_rows(y, perm_inv, perm)                                      # [M, L] (s, e, p) order
            f["y_back"] = self._exchange(y_recv, f["splits"], 1, 0, M, (c, 2))            # [M, L] (d, e, p) order

    def _combine(self, f: dict, topk_weight: Tensor, c: int) -> Tensor:
        """The chunk's rows back in token order, weighted and summed: ``[S, L]`` fp32."""
        self._wait((c, 2))
        plan = DispatchPlan(f["send_slots"], f["counts"], f["S"], f["K"], inverse=f["send_inv"])
        return self._local.combine(f["y_back"], plan, topk_weight)

    def _rows(self, x: Tensor, order: Tensor, inverse: Tensor, k: int) -> Tensor:
        """``x[order // k]`` ([M, L]; ``inverse`` the inverse permutation of ``order``), as the local dispatcher's
        :class:`~k3lab.moe.latent.DispatchRows`: its backward gathers through ``inverse`` and sums the k slots of a
        row in float32 (fused on "triton" + CUDA), where ``index_select``'s backward is an ``index_add`` with atomics
        on CUDA (measured on one H100, 2026-12-07: its two kernels took 43 ms of a 258 ms EP rank step)."""
        return DispatchRows.apply(x, order, inverse, k, self._local.fused(x))

    @property
    def _places_rows(self) -> bool:
        """Whether the exchange writes the bank-major order itself (its ``places_rows``, :data:`Exchange`)."""
        return bool(getattr(self.exchange, "places_rows", False))

    @torch.compiler.disable  # a collective: eager between the compiled pieces (or captured by a CUDA graph)
    def _gather(self, counts: Tensor) -> Tensor:
        return all_gather(counts, self.group)

    @torch.compiler.disable  # the exchange may read its split sizes on the host (exchange_reference): eager
    def _exchange(self, x: Tensor, splits: Tensor, i_send: int, i_recv: int, rows_out: int,
                  key: tuple[int, int], exchange: Exchange | None = None,
                  **orders: tuple[Tensor, Tensor] | None) -> Tensor:
        """The exchange of ``x`` with rows ``splits[i_send]`` out and ``splits[i_recv]`` in (``splits [4, R]``: rows
        out, rows in, weight rows out, weight rows in); ``orders``: ``take``/``place`` for an exchange that places
        rows (:data:`Exchange`), passed on where given. For an exchange with ``host_splits`` the first call of a
        chunk's forward copies ``splits`` to the host and the next ones reuse it (one device-to-host read a chunk).
        With :attr:`comm_stream` the exchange runs on it (after what the caller's stream has queued; autograd runs its
        backward there too) and :meth:`_wait` with the same ``key`` makes the caller's stream wait for it.
        ``exchange``: None for :attr:`exchange`, else the one given (:attr:`weight_exchange`)."""
        exchange = self.exchange if exchange is None else exchange
        if getattr(exchange, "host_splits", False):
            if self._host is None or self._host[0] is not splits:
                self._host, self.host_reads = (splits, splits.cpu()), self.host_reads + 1
            splits = self._host[1]
        orders = {name: o for name, o in orders.items() if o is not None}
        if self.comm_stream is None or not x.is_cuda:
            return exchange(x, splits[i_send], splits[i_recv], rows_out, self.group, **orders)
        caller = torch.cuda.current_stream(x.device)
        self.comm_stream.wait_stream(caller)
        with torch.cuda.stream(self.comm_stream):
            out = exchange(x, splits[i_send], splits[i_recv], rows_out, self.group, **orders)
            self._done[key] = torch.cuda.Event()
            self._done[key].record()
        for t in (x, *[i for o in orders.values() for i in o]):
            t.record_stream(self.comm_stream)      # x and the orders are not reused before the exchange has read them
        out.record_stream(caller)                  # nor out before the caller's stream has
        return out

    @torch.compiler.disable
    def _wait(self, key: tuple[int, int]) -> None:
        """The caller's stream waits for exchange ``key`` alone (not for the later ones queued on the stream)."""
        done = self._done.pop(key, None)
        if done is not None:
            torch.cuda.current_stream().wait_event(done)

    def _lent_rows(self, rep: Tensor) -> Tensor:
        """Which home experts fill the weight exchange's fixed send buffer (``[P]`` local indices): the (expert,
        receiver) pairs this rank lends, receiver-major, then padding rows (an expert not sent). ``P = El + R − 2``,
        the most pairs a home rank lends, or the weight exchange's ``reads_rows`` where it has one and it is fewer
        (:data:`Exchange`: an exchange that reads no more than its first ``reads_rows`` rows gets no others)."""
        R, r, El = self.num_ranks, self.rank, self.num_local
        lent = rep[r * El:(r + 1) * El].T.reshape(-1)                                     # [R·El] (d, e_local)
        cap_out = min(El + R - 2, R * El)
        reads = getattr(self.weight_exchange, "reads_rows", None)
        if reads is not None:
            cap_out = min(cap_out, int(reads))
        return (~lent).to(torch.int8).argsort(stable=True)[:cap_out] % El                 # [cap_out] lent first

    def _replicas(self, picked: tuple[Tensor, Tensor, Tensor], splits: Tensor, key: tuple[int, int]) -> Tensor:
        """This rank's replicas' weights fetched from their donor in ascending global id, zero-padded to El: ``[El,
        3·I·L]`` rows (w1, w3, w2 flattened; :func:`fill_replicas` puts them after the home experts). ``picked``: the
        rows of :meth:`_lent_rows` from each home weight (``[P, …]`` ×3, :func:`cast_and_pick`), sent
        receiver-major (padding rows not sent); the backward returns each replica's gradient home, where it is added
        into the local parameter's. The rows travel in the dtype the expert matmuls read them in
        (:meth:`~k3lab.moe.latent.RoutedExperts.matmul_dtype`: bf16 under autocast, half the bytes of the fp32
        parameters, the same values; their gradients come back in it, as the matmuls produce them)."""
        rows = torch.cat([p.flatten(1) for p in picked], 1)                               # [P, 3·I·L]
        return self._exchange(rows, splits, 2, 3, self.num_local, key, self.weight_exchange)  # [El, 3·I·L]



def apply_static_moonep(model_or_moe: nn.Module, ep_group: ProcessGroup | None,
                        exchange: Exchange | None = None, chunks: int = 1,
                        comm_stream: "torch.cuda.Stream | None" = None,
                        weight_exchange: Exchange | None = None) -> nn.Module:
    """Swap every expert-parallel :class:`LatentMoE`'s dispatcher (after
    :func:`k3lab.parallel.expert.apply_expert_parallel` with ``kind="moonep"``) for a
    :class:`StaticMoonEPDispatcher` over ``ep_group`` with ``exchange`` (None: :func:`current_exchange`), cutting
    each MoE layer's tokens into ``chunks`` (``ParallelOptions.ep_chunks``), its exchanges on ``comm_stream`` (CUDA;
    None: on the caller's stream); the replica weights through ``weight_exchange`` (None: ``exchange``). Returns
    ``model_or_moe``."""
    exchange = current_exchange() if exchange is None else exchange
    for moe in [m for m in model_or_moe.modules() if isinstance(m, LatentMoE)]:
        if getattr(moe.dispatcher, "kind", None) != "moonep":
            raise ValueError("apply_static_moonep: apply_expert_parallel(..., kind='moonep') first")
        moe.dispatcher = StaticMoonEPDispatcher(ep_group, moe.experts.num_experts, exchange, moe.gate.backend,
                                                weight_exchange)
        moe.dispatcher.chunks, moe.dispatcher.comm_stream = chunks, comm_stream
    return model_or_moe
