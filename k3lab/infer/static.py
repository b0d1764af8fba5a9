r"""Decoding with preallocated caches: every step the same shapes and addresses, so on CUDA one step is
one CUDA graph replay (``decoder="graph"``); the same step runs eagerly anywhere (``decoder="static"``).

Why: the eager decode (:func:`k3lab.infer.generate.decode`) is bound by the host, not by memory. A
``small`` step launches about 2,000 kernels from Python, and the functional caches copy every MLA
latent once per step (``torch.cat``). At batch 1 the GPU finishes the step's kernels long before the
host has issued them. Captured once, the whole step is one ``graph.replay()``.

What a replay needs, and how this module provides it:

* **Fixed buffers.** The cache of every layer is allocated once, for ``S`` slots (prompt + new
  tokens, rounded up to :data:`LENGTH_BUCKET`):

  - KDA layers: :class:`k3lab.mixers.kda.StaticKDACache` (our Triton decode kernel
    writes the new state over the old one; the conv tails are copied in);
  - MLA layers: :class:`k3lab.mixers.mla.StaticMLACache` ``c_kv [B, S, R]``, ``k_rope [B, S, ρ]``,
    ``key_mask [B, S]`` and one shared slot counter ``length`` — a step writes one slot and attends to
    all of them under the mask (unwritten slots and the padding of shorter prompts weigh exactly 0).

* **Nothing read back to the host inside the step.** The next token is chosen on the device
  (:func:`k3lab.infer.sampling.sample_seeded`: argmax, or a seeded inverse-CDF draw for temperature /
  top-k / top-p), written into an output buffer at the step counter, and fed back as the next input. A
  row that produced a stop token is marked done on the device and from then on records the pad token.
  The host replays ``n − 1`` steps and reads ``done`` only every :data:`CHECK_EVERY` steps to end early.
  The MoE routes on the device (grouped GEMM with device-side group offsets; the padded expert path uses
  a fixed capacity while capturing).

* **One batch size per graph.** A batch of ``B`` rows runs in the bucket ``B' ≥ B`` of
  :data:`BATCH_BUCKETS`; the extra rows copy row 0's cache and start done. Graphs are kept per
  (bucket, slots, sampling, the caches' device and dtypes) and reused by later calls with the same shape
  (their buffers are refilled). All of them are dropped when the model's weights are no longer the tensors
  they were captured on (``model.float()``, ``model.to(...)``: a graph reads its weights by address).

* **Any grad mode.** The decoder works in normal (not inference) mode under ``torch.no_grad()`` whatever the
  caller's, so buffers made under ``torch.inference_mode()`` are never inference tensors that a later normal
  call cannot write. (``inference_mode(False)`` alone turns grad mode on: the ``no_grad`` after it matters.)

**Speculative decoding** (:meth:`StaticDecoder.speculate`, ``generate(..., decoder="static"|"graph", draft=k)``;
greedy only) is one captured step too (:meth:`StaticDecoder.spec_step`): the MTP head drafts ``d_1 … d_k`` on
its own static MLA cache, the model verifies ``[x_n, d_1 … d_k]`` in one forward on the static caches, the
accepted count ``j`` (longest prefix with ``d_i = argmax p_{i−1}``) stays a device tensor, the row emits
``argmax p_0 … p_j`` at its own output position and the caches roll back on the device:

* MLA (main and MTP): the ``k + 1`` latents were written at slots ``length_b … length_b + k``; per-row
  lengths (``StaticMLACache.length`` [B]) become ``length_b + j_b + 1``, the key mask is cleared beyond,
  and the rejected latents stay, masked, until the next step overwrites them;
* KDA: "keep per-step states" (:mod:`k3lab.infer.speculative`): the verify runs the recurrence one token at
  a time into ``states [k+1, B, H, K, V]`` (:class:`k3lab.mixers.kda.StaticKDAStepCache`), and each row
  keeps ``states[j_b]`` and the conv tail after token ``j_b``.

Rows of a batch accept different numbers of drafts (every length is per row); a done row keeps its caches.
Its tokens equal plain greedy decoding's and its drafted / accepted counts the eager speculative path's
(tested on CPU); that the graph replays it exactly is what the ``-m gpu`` test checks.

Exactness (tested): the static step computes the eager step's numbers — fp32 logits within rounding
(``1e-5``), the same greedy tokens, each row of a mixed batch equal to the row alone; the graph replays
the static step exactly. Sampled tokens depend on each row's seed and token index only, so they are
the same graphed or not, alone or batched (they differ from the eager path's ``torch.multinomial``
draws, which come from a stateful generator).
"""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass

import torch

from k3lab.backend import synchronize
from k3lab.infer import cache as hcache
from k3lab.infer.sampling import sample_seeded
from k3lab.infer.speculative import accept_greedy_rows
from k3lab.infer.step import GenerationStats, Prefilled, check_int, mtp_step
from k3lab.mixers.kda import KDACache, StaticKDACache, StaticKDAStepCache
from k3lab.mixers.mla import MLACache, StaticMLACache
from k3lab.model import K3Cache

Tensor = torch.Tensor

DECODERS = ("eager", "static", "graph")  # generate(decoder=...): functional caches | preallocated | + CUDA graph
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # a graph is captured per bucket; larger batches: their own size
LENGTH_BUCKET = 256  # cache slots are allocated in multiples of this
CHECK_EVERY = 16  # decode steps between the host's reads of the done flags
MAX_KEPT = 4  # buffer sets (and graphs) a decoder keeps; the least recently used goes first
COMPILE_GRAPHED = False  # generate(decoder="graph") compiles the step first (torch.compile; measured in bench_infer)
WARMUP_STEPS = 1  # eager steps before the capture (Triton compiles, libraries initialise there)


def check_decoder(decoder: str, device: torch.device) -> None:
    """ValueError naming ``decoder`` for an unknown value, or "graph" off CUDA."""
    if decoder not in DECODERS:
        raise ValueError(f"decoder={decoder!r}: allowed values are {DECODERS}")
    if decoder == "graph" and device.type != "cuda":
        raise ValueError(f"decoder='graph' needs a CUDA device, the model is on {device}; use decoder='static' "
                         "(the same preallocated step without the graph) or 'eager'")


def batch_bucket(rows: int) -> int:
    """The smallest bucket of :data:`BATCH_BUCKETS` that holds ``rows`` (``rows`` itself past the last)."""
    return next((b for b in BATCH_BUCKETS if b >= rows), rows)


def slots_for(tokens: int) -> int:
    """Cache slots for ``tokens`` tokens: rounded up to a multiple of :data:`LENGTH_BUCKET`."""
    return -(-tokens // LENGTH_BUCKET) * LENGTH_BUCKET


@dataclass
class Buffers:
    """Everything one graph reads and writes (fixed addresses).

    cache: the static cache; length: int64 [1] next MLA slot (shared by the MLA entries); step: int64 [1]
    the index of the token being produced (0 = the one from the prefill's logits); tokens: [B] last token
    of each row; out: [B, N] the tokens produced; done: [B] bool; seeds: [B] int64; stop: [n_stop] int64.
    """

    cache: K3Cache
    length: Tensor
    step: Tensor
    tokens: Tensor
    out: Tensor
    done: Tensor
    seeds: Tensor
    stop: Tensor


def allocate(pre: Prefilled, rows: int, slots: int, new_tokens: int, stop: Tensor) -> Buffers:
    """Buffers for ``rows`` rows and ``slots`` MLA slots shaped like the prefilled cache ``pre.cache``."""
    device = pre.logits.device
    length = torch.zeros(1, dtype=torch.long, device=device)
    layers = []
    for e in pre.cache.layers:
        if isinstance(e, KDACache):
            layers.append(StaticKDACache(*(t.new_zeros((rows,) + t.shape[1:]) for t in
                                           (e.recurrent, e.conv_q, e.conv_k, e.conv_v))))
        else:
            layers.append(StaticMLACache(e.c_kv.new_zeros(rows, slots, e.c_kv.shape[2]),
                                         e.k_rope.new_zeros(rows, slots, e.k_rope.shape[2]),
                                         torch.zeros(rows, slots, dtype=torch.bool, device=device), length))
    zeros = dict(dtype=torch.long, device=device)
    return Buffers(K3Cache(layers, 0), length, torch.zeros(1, **zeros), torch.zeros(rows, **zeros),
                   torch.zeros(rows, new_tokens, **zeros), torch.zeros(rows, dtype=torch.bool, device=device),
                   torch.zeros(rows, **zeros), stop.to(device))


def copy_kda_rows(dst: KDACache, src: KDACache, fill: Tensor) -> None:
    """``dst``'s state and conv tails (in place) = ``src``'s rows ``fill`` [rows]."""
    for d, s in zip((dst.recurrent, dst.conv_q, dst.conv_k, dst.conv_v),
                    (src.recurrent, src.conv_q, src.conv_k, src.conv_v)):
        d.copy_(s.index_select(0, fill))


def load(buf: Buffers, pre: Prefilled, seeds: Tensor) -> None:
    """Copy the prefilled rows into the buffers (extra rows: copies of row 0, marked done)."""
    B, rows = pre.logits.shape[0], buf.tokens.shape[0]
    fill = torch.cat([torch.arange(B), torch.zeros(rows - B, dtype=torch.long)]).to(pre.logits.device)  # [rows]
    S0 = pre.cache.offset
    for dst, src in zip(buf.cache.layers, pre.cache.layers):
        if isinstance(dst, KDACache):
            copy_kda_rows(dst, src, fill)
            continue
        assert isinstance(src, MLACache)
        dst.c_kv[:, :S0].copy_(src.c_kv.index_select(0, fill))
        dst.k_rope[:, :S0].copy_(src.k_rope.index_select(0, fill))
        dst.key_mask.zero_()
        dst.key_mask[:, :S0] = True if src.key_mask is None else src.key_mask.index_select(0, fill)
    buf.length.fill_(S0)
    buf.step.zero_()
    buf.out.fill_(0)
    buf.seeds.copy_(seeds.to(buf.seeds.device).index_select(0, fill.to(buf.seeds.device)))
    buf.done.copy_(torch.arange(rows, device=buf.done.device) >= B)


@dataclass
class SpecBuffers:
    """Everything one speculative graph reads and writes (fixed addresses): B rows, ``k`` drafts a step.

    cache: the main model's static cache — KDA layers :class:`StaticKDAStepCache` (a state per verify token),
    MLA layers :class:`StaticMLACache` sharing ``length`` [B] (positions held per row) and one key mask;
    mla: one of those MLA entries (None without MLA layers), for the rollback of the shared length and mask;
    mtp: the MTP head's :class:`StaticMLACache` (its own length [B] and key mask).
    tokens [B]: the pending token ``x_n`` (known, not yet fed); pend_h [B, k+1, D], pend_x [B, k+1], pend_n [B]:
    the MTP head's next entries ``(h_t, x_{t+1})``, the first ``pend_n`` real (the verify's residuals and tokens).
    out [B, N + 2k + 1]: the tokens emitted, ``emitted`` [B] of them per row (<= N + k; a step writes k + 1 from
    there, a done row too: what lies past ``emitted`` is not read);
    done [B] bool; stop [n_stop]; drafted / accepted / verifies [B]: GenerationStats' counts per row, as the eager
    path counts them. rows = arange(B), iota = arange(k + 1); max_new: N.
    """

    cache: K3Cache
    mla: StaticMLACache | None
    mtp: StaticMLACache
    k: int
    max_new: int
    tokens: Tensor
    pend_h: Tensor
    pend_x: Tensor
    pend_n: Tensor
    out: Tensor
    emitted: Tensor
    done: Tensor
    stop: Tensor
    drafted: Tensor
    accepted: Tensor
    verifies: Tensor
    rows: Tensor
    iota: Tensor


def stack_speculative(model, pres: list[Prefilled]) -> Prefilled:
    """Rows prefilled alone with ``mtp=True`` (one :class:`Prefilled` each) as one batch: main caches stacked
    (:func:`k3lab.infer.cache.stack`), the MTP head's MLA caches too (a one-token prompt has none: an empty one)."""
    mla = model.mtp.block.self_attn
    device = pres[0].logits.device
    mtp = []
    for p in pres:
        m = p.mtp_cache
        if m is None:  # a one-token prompt: no (h_t, x_{t+1}) pair yet
            zeros = dict(dtype=p.residual.dtype, device=device)
            m = MLACache(torch.zeros(1, 0, mla.kv_lora_rank, **zeros), torch.zeros(1, 0, mla.qk_rope_head_dim, **zeros))
        mtp.append(K3Cache([m], m.offset))
    return Prefilled(hcache.stack([p.cache for p in pres]), torch.cat([p.logits for p in pres]),
                     torch.cat([p.residual for p in pres]), [n for p in pres for n in p.lengths],
                     hcache.stack(mtp).layers[0])


def allocate_spec(pre: Prefilled, rows: int, slots: int, new_tokens: int, k: int, stop: Tensor) -> SpecBuffers:
    """:class:`SpecBuffers` for ``rows`` rows, ``slots`` MLA slots (main and MTP) and ``k`` drafts, shaped like
    ``pre``."""
    device = pre.logits.device
    zeros = dict(dtype=torch.long, device=device)
    length = torch.zeros(rows, **zeros)
    key_mask = torch.zeros(rows, slots, dtype=torch.bool, device=device)
    layers = []
    for e in pre.cache.layers:
        if isinstance(e, KDACache):
            rec, tails = e.recurrent, (e.conv_q, e.conv_k, e.conv_v)
            layers.append(StaticKDAStepCache(
                rec.new_zeros((rows,) + rec.shape[1:]), *(t.new_zeros((rows,) + t.shape[1:]) for t in tails),
                rec.new_zeros((k + 1, rows) + rec.shape[1:]),  # states [k+1, B, H, K, V]
                *(t.new_zeros(rows, t.shape[2] + k + 1, t.shape[1]) for t in tails)))  # windows [B, W-1+k+1, D]
        else:
            layers.append(StaticMLACache(e.c_kv.new_zeros(rows, slots, e.c_kv.shape[2]),
                                         e.k_rope.new_zeros(rows, slots, e.k_rope.shape[2]), key_mask, length))
    m = pre.mtp_cache
    mtp = StaticMLACache(m.c_kv.new_zeros(rows, slots, m.c_kv.shape[2]),
                         m.k_rope.new_zeros(rows, slots, m.k_rope.shape[2]),
                         torch.zeros(rows, slots, dtype=torch.bool, device=device), torch.zeros(rows, **zeros))
    mla = next((e for e in layers if isinstance(e, StaticMLACache)), None)
    D = pre.residual.shape[-1]
    return SpecBuffers(K3Cache(layers, 0), mla, mtp, k, new_tokens, tokens=torch.zeros(rows, **zeros),
                       pend_h=pre.residual.new_zeros(rows, k + 1, D), pend_x=torch.zeros(rows, k + 1, **zeros),
                       pend_n=torch.zeros(rows, **zeros), out=torch.zeros(rows, new_tokens + 2 * k + 1, **zeros),
                       emitted=torch.zeros(rows, **zeros), done=torch.zeros(rows, dtype=torch.bool, device=device),
                       stop=stop.to(device), drafted=torch.zeros(rows, **zeros), accepted=torch.zeros(rows, **zeros),
                       verifies=torch.zeros(rows, **zeros), rows=torch.arange(rows, device=device),
                       iota=torch.arange(k + 1, device=device))


def load_spec(buf: SpecBuffers, pre: Prefilled) -> None:
    """Copy the prefilled rows into ``buf`` (extra rows: copies of row 0, marked done) and emit token 0 of each
    row, ``argmax`` of the prefill's logits; it is the pending token and the MTP head's first pending entry
    pairs it with the prompt's last residual."""
    B, rows = pre.logits.shape[0], buf.tokens.shape[0]
    device = pre.logits.device
    fill = torch.cat([torch.arange(B), torch.zeros(rows - B, dtype=torch.long)]).to(device)  # [rows]
    lengths = torch.tensor(pre.lengths, dtype=torch.long, device=device).index_select(0, fill)  # [rows]
    mla_done = False
    for dst, src in zip(buf.cache.layers, pre.cache.layers):
        if isinstance(dst, KDACache):
            copy_kda_rows(dst, src, fill)
            continue
        S0 = src.c_kv.shape[1]
        dst.c_kv[:, :S0].copy_(src.c_kv.index_select(0, fill))
        dst.k_rope[:, :S0].copy_(src.k_rope.index_select(0, fill))
        if not mla_done:  # one key mask and length for every MLA layer
            dst.key_mask.zero_()
            dst.key_mask[:, :S0] = True if src.key_mask is None else src.key_mask.index_select(0, fill)
            dst.rollback(lengths)
            mla_done = True
    m, M0 = pre.mtp_cache, pre.mtp_cache.c_kv.shape[1]
    buf.mtp.c_kv[:, :M0].copy_(m.c_kv.index_select(0, fill))
    buf.mtp.k_rope[:, :M0].copy_(m.k_rope.index_select(0, fill))
    buf.mtp.key_mask.zero_()
    buf.mtp.key_mask[:, :M0] = True if m.key_mask is None else m.key_mask.index_select(0, fill)
    buf.mtp.rollback(lengths - 1)  # (h_t, x_{t+1}) for t < T - 1
    first = pre.logits.float().argmax(-1).index_select(0, fill)  # [rows] token 0 of each row
    buf.tokens.copy_(first)
    buf.out.zero_()
    buf.out[:, 0] = first
    buf.emitted.fill_(1)
    buf.pend_x.zero_()
    buf.pend_x[:, 0] = first
    buf.pend_h.zero_()
    buf.pend_h[:, 0] = pre.residual.index_select(0, fill)
    buf.pend_n.fill_(1)
    buf.done.copy_((torch.arange(rows, device=device) >= B) | torch.isin(first, buf.stop) | (buf.max_new <= 1))
    for t in (buf.drafted, buf.accepted, buf.verifies):
        t.zero_()


_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {graph: StaticDecoder}


def decoder_for(model, graph: bool) -> "StaticDecoder":
    """The model's :class:`StaticDecoder` (one per model and mode, so later calls reuse its graphs)."""
    per_model = _DECODERS.setdefault(model, {})
    if graph not in per_model:
        per_model[graph] = StaticDecoder(model, graph, compile=graph and COMPILE_GRAPHED)
    return per_model[graph]


def cache_dtypes(*entries) -> tuple:
    """The dtypes of every tensor of the cache entries (KDA / MLA caches, or tensors): part of a buffer key, so
    buffers made for bf16 caches are not refilled with fp32 ones."""
    out = []
    for e in entries:
        if isinstance(e, Tensor):
            out.append(e.dtype)
        elif e is not None:
            out.append(tuple(t.dtype for t in vars(e).values() if isinstance(t, Tensor)))
    return tuple(out)


def cut_at_stop(rows: list[list[int]], stop) -> list[list[int]]:
    """Each row up to and including its first ``stop`` token (the rest recorded pad after it)."""
    stops = set(stop)
    return [row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in rows]


class StaticDecoder:
    """Batched decoding on preallocated caches for one model; ``graph=True`` replays each step as a CUDA graph.

    ``decode(pre, max_new_tokens, ...)`` -> per row the list of new tokens (stop token kept, nothing after).
    Graphs and buffers are kept per (batch bucket, slots, new-token width, sampling, stop set, device, cache dtypes)
    and reused; at most :data:`MAX_KEPT` of them (least recently used dropped); all dropped when the model's
    weights change tensors (:meth:`check_weights`). The decoder runs in normal mode under ``torch.no_grad`` whatever
    the caller's mode (``torch.inference_mode()`` included). A capture that fails raises RuntimeError naming
    ``decoder='static'`` as the way round.
    """

    def __init__(self, model, graph: bool = False, compile: bool = False):
        hcache.check_model(model)
        self.model, self.graph = model, graph
        self.logits = self.step_logits if not compile else torch.compile(self.step_logits, dynamic=False)
        self.kept: dict[tuple, tuple[Buffers, torch.cuda.CUDAGraph | None]] = {}
        self.weights: tuple | None = None  # (address, dtype, device, shape) of every weight the kept graphs read
        self.captures = 0  # graphs captured so far
        self.capture_s = 0.0  # seconds spent in warmup + capture

    def step(self, buf: Buffers, temperature: float, top_k: int | None, top_p: float | None, pad: int) -> None:
        """One decode step on ``buf`` (what the graph holds): feed ``tokens``, choose the next on the device."""
        buf.step.add_(1)
        self.record(buf, self.logits(buf.tokens, buf.cache), temperature, top_k, top_p, pad)
        buf.length.add_(1)

    def step_logits(self, tokens: Tensor, cache: K3Cache) -> Tensor:
        """tokens [B] through the model on the static cache (written in place) -> logits [B, V] float32."""
        return hcache.forward(self.model, tokens[:, None], cache, last=1).logits[:, -1]

    @staticmethod
    def record(buf: Buffers, logits: Tensor, temperature, top_k, top_p, pad: int) -> None:
        """Choose each row's token at ``buf.step`` from ``logits [B, V]``; done rows record ``pad``."""
        tok = sample_seeded(logits, temperature, top_k, top_p, buf.seeds, buf.step)  # [B]
        tok = torch.where(buf.done, torch.full_like(tok, pad), tok)
        buf.out.index_copy_(1, buf.step, tok[:, None])
        buf.done.logical_or_(torch.isin(tok, buf.stop))
        buf.tokens.copy_(tok)

    def capture(self, buf: Buffers, *args) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (real decode steps), capture one step; the captured step has not run yet."""
        return self.capture_step(lambda: self.step(buf, *args), buf.tokens.device, "decode step")

    def capture_step(self, run, device: torch.device, what: str) -> torch.cuda.CUDAGraph:
        """``run()`` :data:`WARMUP_STEPS` times on a side stream (real steps), then captured once (not run)."""
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                run()
        except Exception as err:  # an op that reads back to the host, or one CUDA graphs do not take
            raise RuntimeError(f"decoder='graph': capturing the {what} failed ({type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else ''}); use decoder='static' (the same "
                               "step without the graph) or 'eager'") from err
        self.captures += 1
        return graph

    def check_weights(self) -> None:
        """Drop every kept buffer set and graph when the model's parameters or buffers are not the tensors they were
        made with (``model.float()``, ``model.to(device)``, a replaced parameter): a captured graph reads them by
        address. In-place updates (``load_state_dict``, an optimizer step) keep the addresses and the graphs."""
        weights = tuple((t.data_ptr(), t.dtype, t.device, tuple(t.shape))
                        for t in itertools.chain(self.model.parameters(), self.model.buffers()))
        if weights != self.weights:
            self.kept.clear()
            self.weights = weights

    def buffers(self, key: tuple, make):
        """The kept (buffers, graph) under ``key`` (``make()`` builds the buffers when new), now most recently used."""
        if key not in self.kept:
            while len(self.kept) >= MAX_KEPT:  # drop the least recently used buffers and graph
                self.kept.pop(next(iter(self.kept)))
            self.kept[key] = (make(), None)
        self.kept[key] = self.kept.pop(key)  # most recently used last
        return self.kept[key]

    @torch.no_grad()
    def decode(self, pre: Prefilled, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, stop=frozenset(), seeds: Tensor | None = None,
               stats: GenerationStats | None = None) -> list[list[int]]:
        """Up to ``max_new_tokens`` tokens per prefilled row (the first from ``pre.logits``); a row ends after a
        ``stop`` token. ``seeds`` [B] int64: each row's sampling seed (None: the row index)."""
        with torch.inference_mode(False), torch.no_grad():  # normal tensors, writable by a later call in any mode
            return self._decode(pre, max_new_tokens, temperature, top_k, top_p, stop, seeds, stats)

    def _decode(self, pre, max_new_tokens, temperature, top_k, top_p, stop, seeds, stats):
        model, device = self.model, pre.logits.device
        B = pre.logits.shape[0]
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
        if max_new_tokens < 1:
            return [[] for _ in range(B)]
        seeds = torch.arange(B) if seeds is None else torch.as_tensor(seeds, dtype=torch.long).reshape(-1)
        if seeds.numel() != B:
            raise ValueError(f"seeds: need one per row ({B}), got {seeds.numel()}")
        pad = model.config.pad_token_id
        pad = 0 if pad is None else int(pad)
        stop_ids = torch.tensor(sorted(stop), dtype=torch.long)
        rows, slots = batch_bucket(B), slots_for(pre.cache.offset + max_new_tokens)
        key = (rows, slots, max_new_tokens, temperature, top_k, top_p, tuple(stop_ids.tolist()), device,
               cache_dtypes(*pre.cache.layers, pre.logits))
        self.check_weights()
        was_training = model.training
        model.eval()
        try:
            synchronize(device)
            t0 = time.perf_counter()
            buf, graph = self.buffers(key, lambda: allocate(pre, rows, slots, max_new_tokens, stop_ids))
            load(buf, pre, seeds)
            logits0 = torch.cat([pre.logits, pre.logits[:1].expand(rows - B, -1)]) if rows > B else pre.logits
            self.record(buf, logits0.float(), temperature, top_k, top_p, pad)  # token 0, from the prefill
            args = (temperature, top_k, top_p, pad)
            done_steps = 0
            while done_steps < max_new_tokens - 1:
                if self.graph and graph is None and max_new_tokens - 1 - done_steps > WARMUP_STEPS:
                    c0 = time.perf_counter()
                    graph = self.capture(buf, *args)  # runs WARMUP_STEPS real steps, records one more
                    self.kept[key] = (buf, graph)
                    done_steps += WARMUP_STEPS
                    synchronize(device)
                    self.capture_s += time.perf_counter() - c0
                    if stats is not None:
                        stats.forwards += WARMUP_STEPS
                    continue
                if graph is not None:
                    graph.replay()
                else:
                    self.step(buf, *args)
                done_steps += 1
                if stats is not None:
                    stats.forwards += 1
                if done_steps % CHECK_EVERY == 0 and bool(buf.done[:B].all()):
                    break
            out = buf.out[:B, :done_steps + 1].tolist()  # the one read back of the tokens
            synchronize(device)
            if stats is not None:
                stats.decode_s += time.perf_counter() - t0
        finally:
            model.train(was_training)
        result = cut_at_stop(out, stop)
        if stats is not None:
            stats.new_tokens += sum(len(r) for r in result)
        return result

    # ------------------------------------------------------------------------------------------
    # speculative decoding: MTP drafts, one verify forward, acceptance and rollback on the device
    # ------------------------------------------------------------------------------------------
    def spec_step(self, buf: SpecBuffers) -> None:
        """One speculative step on ``buf`` (what the graph holds); greedy. Row b, pending token ``x_n``:

        1. the MTP head takes its ``pend_n`` pending entries (all k + 1 written, the rest masked off by the
           rollback of its length), drafts ``d_1`` from the last real one and chains ``d_2 … d_k`` on its own
           output (those k − 1 entries are dropped again: its length is set back);
        2. verify: ``[x_n, d_1 … d_k]`` through the model on the static caches, logits ``p_0 … p_k``; the KDA
           layers keep the state after each of the k + 1 tokens (:meth:`k3lab.mixers.kda.KDA.forward_steps`);
        3. accept: ``j = longest prefix with d_i = argmax p_{i−1}`` (:func:`accept_greedy_rows`); the row emits
           ``argmax p_0 … p_j`` (= d_1 … d_j and the correction or bonus) at its ``emitted`` position;
        4. roll back: MLA ``length_b += j_b + 1`` and the key mask cleared beyond it (the rejected slots stay,
           masked, and are overwritten next step); KDA state and conv tails = those after token ``j_b``
           (:meth:`k3lab.mixers.kda.StaticKDAStepCache.keep`); the next pending MTP entries are the verify's
           residuals and tokens, ``pend_n = j + 1``; the next pending token is ``argmax p_j``.

        Done rows keep their caches, lengths, pending entries, ``emitted`` and counts (what the step writes for them
        lies past their lengths, masked, or is not read). The counts are the
        eager path's: a step of a row with ``emitted`` tokens drafts ``k_eff = min(k, N − emitted − 1)`` there
        and accepts ``min(j, k_eff)`` (the drafts and their verify logits are the same: causal)."""
        model, k = self.model, buf.k
        emb = model.model.embed_tokens
        active = ~buf.done  # [B]
        mtp = buf.mtp
        hidden, out, _ = mtp_step(model.mtp, emb(buf.pend_x), buf.pend_h, mtp)  # [B, k+1, D]
        last = buf.pend_n - 1  # [B] the last real pending entry
        mtp.rollback(mtp.length + torch.where(active, buf.pend_n, 0))
        h, o = hidden[buf.rows, last], out[buf.rows, last][:, None]  # [B, D], [B, 1, D]
        drafts = []
        for i in range(k):
            d = model.lm_head(h).float().argmax(dim=-1)  # [B]
            drafts.append(d)
            if i + 1 < k:  # chain on the head's own output (entries dropped below)
                hidden, o, _ = mtp_step(model.mtp, emb(d[:, None]), o, mtp)  # [B, 1, D]
                mtp.length.add_(1)
                h = hidden[:, -1]
        if k > 1:
            mtp.rollback(mtp.length - (k - 1))
        drafts = torch.stack(drafts, dim=1)  # [B, k]
        step = hcache.forward(model, torch.cat([buf.tokens[:, None], drafts], dim=1), buf.cache, last=None)
        best = step.logits.argmax(dim=-1)  # [B, k+1]
        j = accept_greedy_rows(best, drafts)  # [B]
        buf.out.scatter_(1, buf.emitted[:, None] + buf.iota, best)  # [B, N + 2k + 1]; only the first j + 1 count
        k_eff = (buf.max_new - 1 - buf.emitted).clamp(0, k)  # [B] the drafts the eager path would make
        buf.drafted.add_(torch.where(active, k_eff, 0))
        buf.accepted.add_(torch.where(active, torch.minimum(j, k_eff), 0))
        buf.verifies.add_(active.long())
        adv = torch.where(active, j + 1, 0)  # [B]
        hit = (torch.isin(best, buf.stop) & (buf.iota <= j[:, None])).any(dim=1)  # a stop among the emitted
        buf.emitted.add_(adv)
        buf.done.logical_or_(active & (hit | (buf.emitted >= buf.max_new)))
        if buf.mla is not None:
            buf.mla.rollback(buf.mla.length + adv)
        for e in buf.cache.layers:
            if isinstance(e, StaticKDAStepCache):
                e.keep(j, active)
        buf.pend_h.copy_(torch.where(active[:, None, None], step.residual, buf.pend_h))  # [B, k+1, D]
        buf.pend_x.copy_(torch.where(active[:, None], best, buf.pend_x))  # [B, k+1]
        buf.pend_n.copy_(torch.where(active, j + 1, buf.pend_n))
        buf.tokens.copy_(torch.where(active, best.gather(1, j[:, None])[:, 0], buf.tokens))

    @torch.no_grad()
    def speculate(self, pres: Prefilled | list[Prefilled], k: int, max_new_tokens: int, stop=frozenset(),
                  stats: GenerationStats | None = None) -> list[list[int]]:
        """Greedy speculative decoding with the MTP head, ``k`` drafts a step, on the static caches (one CUDA graph
        replay a step when ``graph``): up to ``max_new_tokens`` tokens per row, the same tokens as plain greedy
        decoding (:meth:`spec_step`). ``pres``: rows prefilled alone with ``mtp=True`` (a list; or one
        :class:`Prefilled` of them stacked by :func:`stack_speculative`). Rows of a batch accept different numbers
        of drafts: the lengths are per row. ``stats``: drafted / accepted per row as the eager path counts them,
        ``forwards`` the verify forwards of the longest row. ``k`` is clamped to ``max(1, max_new_tokens − 1)``
        before anything is allocated: no step can use more drafts (the eager path drafts
        ``min(k, N − emitted − 1)``), so the tokens and counts are those of ``k`` itself."""
        with torch.inference_mode(False), torch.no_grad():  # normal tensors, writable by a later call in any mode
            return self._speculate(pres, k, max_new_tokens, stop, stats)

    def _speculate(self, pres, k, max_new_tokens, stop, stats):
        model = self.model
        k = check_int("k", k, 1)
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
        k = max(1, min(k, max_new_tokens - 1))  # the most drafts a step can use (the first token is not drafted)
        if model.mtp is None:
            raise ValueError("model: has no MTP head (config.num_nextn_predict_layers=0); speculative decoding needs 1")
        pre = stack_speculative(model, pres) if isinstance(pres, list) else pres
        if pre.mtp_cache is None:
            raise ValueError("pres: rows prefilled with mtp=True are needed (the MTP head's cache)")
        B, device = pre.logits.shape[0], pre.logits.device
        if max_new_tokens < 1:
            return [[] for _ in range(B)]
        stop_ids = torch.tensor(sorted(stop), dtype=torch.long)
        rows, slots = batch_bucket(B), slots_for(max(pre.lengths) + max_new_tokens + k)
        key = ("spec", rows, slots, max_new_tokens, k, tuple(stop_ids.tolist()), device,
               cache_dtypes(*pre.cache.layers, pre.mtp_cache, pre.residual))
        self.check_weights()
        check = max(1, CHECK_EVERY // (k + 1))  # steps between the host's reads of the done flags
        was_training = model.training
        model.eval()
        try:
            synchronize(device)
            t0 = time.perf_counter()
            buf, graph = self.buffers(key, lambda: allocate_spec(pre, rows, slots, max_new_tokens, k, stop_ids))
            load_spec(buf, pre)
            steps, limit = 0, max_new_tokens - 1  # every step emits >= 1 token per active row
            while steps < limit:
                if self.graph and graph is None and limit - steps > WARMUP_STEPS:
                    c0 = time.perf_counter()
                    graph = self.capture_step(lambda: self.spec_step(buf), device, "speculative step")
                    self.kept[key] = (buf, graph)
                    steps += WARMUP_STEPS
                    synchronize(device)
                    self.capture_s += time.perf_counter() - c0
                    continue
                if graph is not None:
                    graph.replay()
                else:
                    self.spec_step(buf)
                steps += 1
                if steps % check == 0 and bool(buf.done[:B].all()):
                    break
            out = buf.out[:B].tolist()  # the one read back of the tokens
            emitted, drafted, accepted, verifies = torch.stack(
                [buf.emitted[:B], buf.drafted[:B], buf.accepted[:B], buf.verifies[:B]]).tolist()
            synchronize(device)
            if stats is not None:
                stats.decode_s += time.perf_counter() - t0
        finally:
            model.train(was_training)
        result = cut_at_stop([row[:min(n, max_new_tokens)] for row, n in zip(out, emitted)], stop)
        if stats is not None:
            stats.new_tokens += sum(len(r) for r in result)
            stats.forwards += max(verifies)
            stats.drafted += sum(drafted)
            stats.accepted += sum(accepted)
            stats.mtp_forwards += sum(drafted)
            stats.per_row.extend(zip(drafted, accepted))
        return result
