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
  (:func:`k3lab.infer.sampling.sample_seeded`: argmax, or a seeded Gumbel-max draw for temperature /
  top-k / top-p), written into an output buffer at the step counter, and fed back as the next input. A
  row that produced a stop token is marked done on the device and from then on records the pad token.
  The host replays ``n − 1`` steps and reads ``done`` only every :data:`CHECK_EVERY` steps to end early.
  The MoE routes on the device (grouped GEMM with device-side group offsets; the padded expert path uses
  a fixed capacity while capturing).

* **One batch size per graph.** A batch of ``B`` rows runs in the bucket ``B' ≥ B`` of
  :data:`BATCH_BUCKETS`; the extra rows copy row 0's cache and start done. Graphs are kept per
  (bucket, slots, sampling) and reused by later calls with the same shape (their buffers are refilled).

Exactness (tested): the static step computes the eager step's numbers — fp32 logits within rounding
(``1e-5``), the same greedy tokens, each row of a mixed batch equal to the row alone; the graph replays
the static step exactly. Sampled tokens depend on each row's seed and token index only, so they are
the same graphed or not, alone or batched (they differ from the eager path's ``torch.multinomial``
draws, which come from a stateful generator).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from k3lab.backend import synchronize
from k3lab.infer import cache as hcache
from k3lab.infer.sampling import sample_seeded
from k3lab.infer.step import GenerationStats, Prefilled
from k3lab.mixers.kda import KDACache, StaticKDACache
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


def load(buf: Buffers, pre: Prefilled, seeds: Tensor) -> None:
    """Copy the prefilled rows into the buffers (extra rows: copies of row 0, marked done)."""
    B, rows = pre.logits.shape[0], buf.tokens.shape[0]
    fill = torch.cat([torch.arange(B), torch.zeros(rows - B, dtype=torch.long)]).to(pre.logits.device)  # [rows]
    S0 = pre.cache.offset
    for dst, src in zip(buf.cache.layers, pre.cache.layers):
        if isinstance(dst, KDACache):
            for d, s in zip((dst.recurrent, dst.conv_q, dst.conv_k, dst.conv_v),
                            (src.recurrent, src.conv_q, src.conv_k, src.conv_v)):
                d.copy_(s.index_select(0, fill))
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


_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {graph: StaticDecoder}


def decoder_for(model, graph: bool) -> "StaticDecoder":
    """The model's :class:`StaticDecoder` (one per model and mode, so later calls reuse its graphs)."""
    per_model = _DECODERS.setdefault(model, {})
    if graph not in per_model:
        per_model[graph] = StaticDecoder(model, graph, compile=graph and COMPILE_GRAPHED)
    return per_model[graph]


class StaticDecoder:
    """Batched decoding on preallocated caches for one model; ``graph=True`` replays each step as a CUDA graph.

    ``decode(pre, max_new_tokens, ...)`` -> per row the list of new tokens (stop token kept, nothing after).
    Graphs and buffers are kept per (batch bucket, slots, new-token width, sampling, stop set) and reused; at most
    :data:`MAX_KEPT` of them (least recently used dropped). A capture that fails raises RuntimeError naming
    ``decoder='static'`` as the way round.
    """

    def __init__(self, model, graph: bool = False, compile: bool = False):
        hcache.check_model(model)
        self.model, self.graph = model, graph
        self.logits = self.step_logits if not compile else torch.compile(self.step_logits, dynamic=False)
        self.kept: dict[tuple, tuple[Buffers, torch.cuda.CUDAGraph | None]] = {}
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
        stream = torch.cuda.Stream(buf.tokens.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                self.step(buf, *args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.step(buf, *args)
        except Exception as err:  # an op that reads back to the host, or one CUDA graphs do not take
            raise RuntimeError(f"decoder='graph': capturing the decode step failed ({type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else ''}); use decoder='static' (the same "
                               "step without the graph) or 'eager'") from err
        self.captures += 1
        return graph

    @torch.no_grad()
    def decode(self, pre: Prefilled, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, stop=frozenset(), seeds: Tensor | None = None,
               stats: GenerationStats | None = None) -> list[list[int]]:
        """Up to ``max_new_tokens`` tokens per prefilled row (the first from ``pre.logits``); a row ends after a
        ``stop`` token. ``seeds`` [B] int64: each row's sampling seed (None: the row index)."""
        model, device = self.model, pre.logits.device
        B = pre.logits.shape[0]
        if max_new_tokens < 1:
            return [[] for _ in range(B)]
        seeds = torch.arange(B) if seeds is None else torch.as_tensor(seeds, dtype=torch.long).reshape(-1)
        if seeds.numel() != B:
            raise ValueError(f"seeds: need one per row ({B}), got {seeds.numel()}")
        pad = model.config.pad_token_id
        pad = 0 if pad is None else int(pad)
        stop_ids = torch.tensor(sorted(stop), dtype=torch.long)
        rows, slots = batch_bucket(B), slots_for(pre.cache.offset + max_new_tokens)
        key = (rows, slots, max_new_tokens, temperature, top_k, top_p, tuple(stop_ids.tolist()))
        was_training = model.training
        model.eval()
        try:
            synchronize(device)
            t0 = time.perf_counter()
            if key not in self.kept:
                while len(self.kept) >= MAX_KEPT:  # drop the least recently used buffers and graph
                    self.kept.pop(next(iter(self.kept)))
                self.kept[key] = (allocate(pre, rows, slots, max_new_tokens, stop_ids), None)
            buf, graph = self.kept.pop(key)
            self.kept[key] = (buf, graph)  # most recently used last
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
        stops = set(stop)
        result = []
        for row in out:
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            result.append(row[:end])
        if stats is not None:
            stats.new_tokens += sum(len(r) for r in result)
        return result
