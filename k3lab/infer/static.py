r"""Decoding with preallocated caches: every step the same shapes and addresses, so on CUDA one step is
one CUDA graph replay (``decoder="graph"``, what ``generate``'s default ``decoder="auto"`` runs on CUDA); the same
step runs eagerly anywhere (``decoder="static"``; "auto" off CUDA is "eager": on a CPU this step is not faster).

Why: the eager decode (:func:`k3lab.infer.generate.decode`) is bound by the host, not by memory. A
``small`` step launches about 2,000 kernels from Python, and the functional caches copy every MLA
latent once per step (``torch.cat``). At batch 1 the GPU finishes the step's kernels long before the
host has issued them. Captured once, the whole step is one ``graph.replay()``.

What a replay needs, and how this module provides it:

* **Fixed buffers, sized once.** The cache of every layer is allocated once per batch bucket, for the
  decoder's ``capacity`` slots (``StaticDecoder(model, capacity=...)``; default
  ``config.max_position_embeddings``, the trained context): any prompt and any ``max_new_tokens`` with
  ``prompt + new <= capacity`` runs on the same buffers. A call past it is refused, naming ``max_new_tokens``
  and ``capacity``, before anything is allocated; a capacity whose caches would not fit the device's free memory
  is refused naming ``capacity`` (at construction for one row, at each new bucket for its rows).

  - KDA layers: :class:`k3lab.mixers.kda.StaticKDACache` (our Triton decode kernel
    writes the new state over the old one; the conv tails are copied in);
  - MLA layers: :class:`k3lab.mixers.mla.StaticMLACache` ``c_kv [B, S, R]``, ``k_rope [B, S, ρ]``,
    ``key_mask [B, S]`` and one shared slot counter ``length`` — a step writes one slot and attends to
    all of them under the mask (unwritten slots and the padding of shorter prompts weigh exactly 0). On CUDA
    the bf16/fp16 latent kernel also gets ``length`` as a limit and reads no tile past it, so the work follows
    the context, not the capacity. On CPU (no graph there) the step attends to a window of the buffers, the first
    ``prompt + new`` slots rounded up to :data:`LENGTH_BUCKET` (views: the same storage; ``cpu_window``).

* **Per-call values are device tensors.** Everything a call changes is written into the buffers before the
  first step, and the step reads it there: the slot counter and token index (``length``, ``step``), the
  tokens, the per-row seeds, the sampling parameters (``temperature``, ``top_k``, ``top_p``: one value per row,
  :func:`k3lab.infer.sampling.next_token_probs_rows`), the stop set (``is_stop [V]``, a flag per token) and, when
  speculating, ``max_new_tokens``. No Python number of a call is baked into a captured step.

* **Nothing read back to the host inside the step.** The next token is chosen on the device
  (:func:`k3lab.infer.sampling.sample_seeded`: argmax, or a seeded inverse-CDF draw for temperature /
  top-k / top-p), written into an output buffer at the step counter, and fed back as the next input. A
  row that produced a stop token is marked done on the device and from then on records the pad token.
  The host replays ``n − 1`` steps and reads ``done`` only every :data:`CHECK_EVERY` steps to end early.
  The MoE routes on the device (grouped GEMM with device-side group offsets; the padded expert path uses
  a fixed capacity while capturing).

* **One graph per batch bucket.** A batch of ``B`` rows runs in the bucket ``B' ≥ B`` of
  :data:`BATCH_BUCKETS`; the extra rows copy row 0's cache and start done. Buffers are kept per
  :class:`BufferKey` — (kind, bucket, drafts ``k``, device, the caches' dtypes) — and each buffer set holds at
  most two graphs: the greedy step and the sampling step (the key's one sampling choice: a greedy graph
  without the sampler's sorts and float64 cumsum over the vocabulary is cheaper; temperature, top-k and
  top-p are tensors inside the sampling graph). So a bucket is built and captured once, then every prompt
  length, ``max_new_tokens``, stop set and sampling value replays it (:attr:`StaticDecoder.builds`,
  :attr:`StaticDecoder.captures`, ``GenerationStats.builds`` / ``captures``). At most :data:`MAX_KEPT` buffer
  sets are kept (least recently used dropped: each holds ``capacity`` slots a row). All of them are dropped
  when the model's weights are no longer the tensors they were captured on (``model.float()``,
  ``model.to(...)``: a graph reads its weights by address).

* **Any grad mode.** The decoder works in normal (not inference) mode under ``torch.no_grad()`` whatever the
  caller's, so buffers made under ``torch.inference_mode()`` are never inference tensors that a later normal
  call cannot write. (``inference_mode(False)`` alone turns grad mode on: the ``no_grad`` after it matters.)

**Speculative decoding** (:meth:`StaticDecoder.speculate`, ``generate(..., decoder="static"|"graph", draft=k)``;
greedy only) is one captured step too (:meth:`StaticDecoder.spec_step`): the MTP head drafts ``d_1 … d_k`` on
its own static MLA cache, the model verifies ``[x_n, d_1 … d_k]`` in one forward on the static caches, the
accepted count ``j`` (longest prefix with ``d_i = argmax p_{i−1}``) stays a device tensor, the row emits
``argmax p_0 … p_j`` at its own output position and the caches roll back on the device (its buffers hold
``capacity + 2k + 2`` slots: a finished row's last drafts may lie past its end):

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

import dataclasses
import itertools
import numbers
import os
import time
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from k3lab.backend import synchronize
from k3lab.infer import cache as hcache
from k3lab.infer.sampling import check_sampling, sample_seeded
from k3lab.infer.speculative import accept_greedy_rows
from k3lab.infer.step import GenerationStats, Prefilled, check_int, mtp_step
from k3lab.mixers.kda import KDACache, StaticKDACache, StaticKDAStepCache
from k3lab.mixers.mla import MLACache, StaticMLACache
from k3lab.model import K3Cache

Tensor = torch.Tensor

DECODERS = ("auto", "eager", "static", "graph")  # generate(decoder=...): resolve_decoder | functional | static | graph
AUTO_OFF_CUDA = "eager"  # decoder="auto" off CUDA: on CPU (tiny preset) the static step measured 3-5% slower than
# eager, not faster (docs/inference.md, section 6b), so "auto" stays eager there; "static" is one switch away
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # a graph is captured per bucket; larger batches: their own size
LENGTH_BUCKET = 256  # the CPU window and the capacity of a call past the context: multiples of this
CHECK_EVERY = 16  # decode steps between the host's reads of the done flags
MAX_KEPT = 4  # buffer sets (each with its graphs) a decoder keeps; the least recently used goes first
COMPILE_GRAPHED = False  # generate(decoder="graph") compiles the step first (torch.compile; measured in bench_infer)
WARMUP_STEPS = 1  # eager steps before the capture (Triton compiles, libraries initialise there)


def check_decoder(decoder: str, device: torch.device) -> None:
    """ValueError naming ``decoder`` for a value not in :data:`DECODERS`, or "graph" off CUDA."""
    if not isinstance(decoder, str) or decoder not in DECODERS:
        raise ValueError(f"decoder={decoder!r}: allowed values are {DECODERS}")
    if decoder == "graph" and device.type != "cuda":
        raise ValueError(f"decoder='graph' needs a CUDA device, the model is on {device}; use decoder='static' "
                         "(the same preallocated step without the graph), 'auto' or 'eager'")


def resolve_decoder(decoder: str, device: torch.device, draft: int | None = None, temperature: float = 0.0,
                    in_context: bool = True) -> str:
    """The decoder that runs for ``decoder`` (checked by :func:`check_decoder`): "auto" is "graph" on CUDA and
    :data:`AUTO_OFF_CUDA` elsewhere, except "eager" with ``draft`` and ``temperature > 0`` (the static
    speculative step is greedy only) and for a call past the trained context (not ``in_context``: allowed by
    ``allow_longer``; the static caches are sized for the context, the eager ones grow with the rows that run);
    any other value is itself."""
    check_decoder(decoder, device)
    if decoder != "auto":
        return decoder
    if (draft is not None and temperature != 0) or not in_context:
        return "eager"
    return "graph" if device.type == "cuda" else AUTO_OFF_CUDA


def batch_bucket(rows: int) -> int:
    """The smallest bucket of :data:`BATCH_BUCKETS` that holds ``rows`` (``rows`` itself past the last)."""
    return next((b for b in BATCH_BUCKETS if b >= rows), rows)


def slots_for(tokens: int) -> int:
    """Cache slots for ``tokens`` tokens: rounded up to a multiple of :data:`LENGTH_BUCKET`."""
    return -(-tokens // LENGTH_BUCKET) * LENGTH_BUCKET


def spec_scratch(k: int) -> int:
    """Slots past ``capacity`` a speculative buffer set holds for ``k`` drafts: a row that finished with
    ``max_new_tokens + k`` emitted tokens still writes ``k + 1`` verify latents a step while others run."""
    return 2 * k + 2


class BufferKey(NamedTuple):
    """What a buffer set (and its graphs) is kept under: everything that fixes a shape, a dtype or a device.

    kind: "decode" (plain) or "spec" (speculative); rows: the batch bucket; k: drafts a step (0 for "decode": the
    verify's k + 1 tokens are a shape); device; dtypes: the caches' (:func:`cache_dtypes`). Not in it: the prompt
    lengths and ``max_new_tokens`` (the buffers hold ``capacity`` slots), seeds, sampling values, stop tokens
    (device tensors the step reads)."""

    kind: str
    rows: int
    k: int
    device: torch.device
    dtypes: tuple


@dataclass
class Buffers:
    """Everything one graph reads and writes (fixed addresses).

    cache: the static cache; length: int64 [1] next MLA slot (shared by the MLA entries); step: int64 [1]
    the index of the token being produced (0 = the one from the prefill's logits); tokens: [B] last token
    of each row; out: [B, N] the tokens produced (N = the capacity: any max_new_tokens fits); done: [B] bool;
    seeds: [B] int64; temperature [B] float32, top_k [B] int64, top_p [B] float32: the sampling parameters
    (read by the sampling graph only); is_stop: [V] bool, True at the stop tokens.
    """

    cache: K3Cache
    length: Tensor
    step: Tensor
    tokens: Tensor
    out: Tensor
    done: Tensor
    seeds: Tensor
    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    is_stop: Tensor


def allocate(pre: Prefilled, rows: int, slots: int) -> Buffers:
    """Buffers for ``rows`` rows and ``slots`` MLA slots (and up to ``slots`` new tokens) shaped like the
    prefilled cache ``pre.cache`` and its vocabulary ``pre.logits [B, V]``."""
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
    f32 = dict(dtype=torch.float32, device=device)
    return Buffers(K3Cache(layers, 0), length, torch.zeros(1, **zeros), torch.zeros(rows, **zeros),
                   torch.zeros(rows, slots, **zeros), torch.zeros(rows, dtype=torch.bool, device=device),
                   torch.zeros(rows, **zeros), torch.ones(rows, **f32), torch.ones(rows, **zeros),
                   torch.ones(rows, **f32), torch.zeros(pre.logits.shape[-1], dtype=torch.bool, device=device))


def buffer_bytes(pre: Prefilled, rows: int, slots: int, k: int | None = None) -> int:
    """Bytes of the buffers :func:`allocate` (``k`` None) or :func:`allocate_spec` (``k`` drafts) makes for ``rows``
    rows and ``slots`` slots: the MLA latents and key masks, the KDA states and tails (``k + 2`` states a row when
    speculating), the MTP head's latents, the output tokens. Counted before allocating (:func:`check_memory`)."""
    total = rows * slots * 8  # out [rows, slots] int64
    mla = [e for e in pre.cache.layers if not isinstance(e, KDACache)]
    if k is not None and pre.mtp_cache is not None:
        mla.append(pre.mtp_cache)
    for e in pre.cache.layers:
        if isinstance(e, KDACache):
            per_row = sum(t[0].numel() * t.element_size() for t in (e.recurrent, e.conv_q, e.conv_k, e.conv_v))
            total += rows * per_row * (1 if k is None else k + 3)
    for e in mla:
        total += rows * slots * (e.c_kv.shape[2] * e.c_kv.element_size() + e.k_rope.shape[2] * e.k_rope.element_size()
                                 + 1)  # + the key mask's bool
    return total


def free_bytes(device: torch.device) -> int | None:
    """Memory an allocation on ``device`` can still get: CUDA — free on the device plus what PyTorch's caching
    allocator holds unused; CPU — the available physical memory (``MemAvailable``); None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:  # MemAvailable: free pages plus the page cache the kernel can reclaim
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


class CapacityError(ValueError):
    """The static caches of a capacity do not fit in the device's free memory (:func:`check_memory`)."""


def check_memory(nbytes: int, device: torch.device, capacity: int, rows: int) -> None:
    """:class:`CapacityError` (a ValueError) naming ``capacity`` when ``nbytes`` (the static caches of ``rows``
    rows) exceed :func:`free_bytes` of ``device`` — before anything is allocated."""
    free = free_bytes(device)
    if free is not None and nbytes > free:
        raise CapacityError(f"capacity={capacity}: the static caches of {rows} row(s) need {nbytes / 2**30:.3g} GiB, more "
                         f"than the {free / 2**30:.3g} GiB free on {device}; pass a smaller capacity "
                         "(StaticDecoder(model, capacity=...)) or fewer rows")


def check_stop(stop, vocab: int) -> frozenset:
    """``stop`` (a collection of token ids) as a frozenset, or ValueError naming ``stop`` (ids in [0, vocab))."""
    ids = frozenset(stop)
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab for t in ids):
        raise ValueError(f"stop={set(stop)!r}: token ids must be integers in [0, vocab_size={vocab})")
    return frozenset(int(t) for t in ids)


def fill_stop(is_stop: Tensor, stop: frozenset) -> None:
    """``is_stop [V]`` (in place) = True at the ``stop`` tokens, False elsewhere."""
    is_stop.zero_()
    if stop:
        is_stop[torch.tensor(sorted(stop), dtype=torch.long, device=is_stop.device)] = True


def window(cache: K3Cache, slots: int) -> K3Cache:
    """The first ``slots`` slots of every :class:`StaticMLACache` of ``cache`` (views: the same storage and slot
    counter), the KDA entries as they are — the CPU step attends to what the call can use, not the capacity."""
    return K3Cache([StaticMLACache(e.c_kv[:, :slots], e.k_rope[:, :slots], e.key_mask[:, :slots], e.length)
                    if isinstance(e, StaticMLACache) else e for e in cache.layers], cache.offset)


def copy_kda_rows(dst: KDACache, src: KDACache, fill: Tensor) -> None:
    """``dst``'s state and conv tails (in place) = ``src``'s rows ``fill`` [rows]."""
    for d, s in zip((dst.recurrent, dst.conv_q, dst.conv_k, dst.conv_v),
                    (src.recurrent, src.conv_q, src.conv_k, src.conv_v)):
        d.copy_(s.index_select(0, fill))


def load(buf: Buffers, pre: Prefilled, seeds: Tensor, temperature: float = 0.0, top_k: int | None = None,
         top_p: float | None = None, stop=frozenset()) -> None:
    """Copy the prefilled rows into the buffers (extra rows: copies of row 0, marked done) and this call's
    values: seeds, sampling parameters (``top_k`` None: V; ``top_p`` None: 1; read by the sampling graph only),
    the stop flags."""
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
        dst.key_mask.zero_()  # the whole capacity: what an earlier, longer call wrote stays hidden
        dst.key_mask[:, :S0] = True if src.key_mask is None else src.key_mask.index_select(0, fill)
    buf.length.fill_(S0)
    buf.step.zero_()
    buf.out.fill_(0)
    buf.seeds.copy_(seeds.to(buf.seeds.device).index_select(0, fill.to(buf.seeds.device)))
    buf.done.copy_(torch.arange(rows, device=buf.done.device) >= B)
    V = buf.is_stop.shape[0]
    buf.temperature.fill_(float(temperature) if temperature else 1.0)
    buf.top_k.fill_(V if top_k is None else min(int(top_k), V))
    buf.top_p.fill_(1.0 if top_p is None else float(top_p))
    fill_stop(buf.is_stop, stop)


@dataclass
class SpecBuffers:
    """Everything one speculative graph reads and writes (fixed addresses): B rows, ``k`` drafts a step.

    cache: the main model's static cache — KDA layers :class:`StaticKDAStepCache` (a state per verify token),
    MLA layers :class:`StaticMLACache` sharing ``length`` [B] (positions held per row) and one key mask;
    mla: one of those MLA entries (None without MLA layers), for the rollback of the shared length and mask;
    mtp: the MTP head's :class:`StaticMLACache` (its own length [B] and key mask).
    tokens [B]: the pending token ``x_n`` (known, not yet fed); pend_h [B, k+1, D], pend_x [B, k+1], pend_n [B]:
    the MTP head's next entries ``(h_t, x_{t+1})``, the first ``pend_n`` real (the verify's residuals and tokens).
    out [B, C + 2k + 1]: the tokens emitted (C the capacity), ``emitted`` [B] of them per row (<= N + k; a step
    writes k + 1 from there, a done row too: what lies past ``emitted`` is not read);
    done [B] bool; is_stop [V] bool; drafted / accepted / verifies [B]: GenerationStats' counts per row, as the
    eager path counts them. rows = arange(B), iota = arange(k + 1); max_new: int64 [1], this call's N.
    """

    cache: K3Cache
    mla: StaticMLACache | None
    mtp: StaticMLACache
    k: int
    max_new: Tensor
    tokens: Tensor
    pend_h: Tensor
    pend_x: Tensor
    pend_n: Tensor
    out: Tensor
    emitted: Tensor
    done: Tensor
    is_stop: Tensor
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


def allocate_spec(pre: Prefilled, rows: int, slots: int, new_tokens: int, k: int) -> SpecBuffers:
    """:class:`SpecBuffers` for ``rows`` rows, ``slots`` MLA slots (main and MTP), up to ``new_tokens`` new tokens
    and ``k`` drafts, shaped like ``pre`` (and its vocabulary, ``pre.logits [B, V]``)."""
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
    return SpecBuffers(K3Cache(layers, 0), mla, mtp, k, torch.zeros(1, **zeros), tokens=torch.zeros(rows, **zeros),
                       pend_h=pre.residual.new_zeros(rows, k + 1, D), pend_x=torch.zeros(rows, k + 1, **zeros),
                       pend_n=torch.zeros(rows, **zeros), out=torch.zeros(rows, new_tokens + 2 * k + 1, **zeros),
                       emitted=torch.zeros(rows, **zeros), done=torch.zeros(rows, dtype=torch.bool, device=device),
                       is_stop=torch.zeros(pre.logits.shape[-1], dtype=torch.bool, device=device),
                       drafted=torch.zeros(rows, **zeros), accepted=torch.zeros(rows, **zeros),
                       verifies=torch.zeros(rows, **zeros), rows=torch.arange(rows, device=device),
                       iota=torch.arange(k + 1, device=device))


def window_spec(buf: SpecBuffers, slots: int) -> SpecBuffers:
    """``buf`` with its main and MTP MLA caches cut to their first ``slots`` slots (views, :func:`window`)."""
    cache = window(buf.cache, slots)
    m = buf.mtp
    return dataclasses.replace(buf, cache=cache, mla=next((e for e in cache.layers if isinstance(e, StaticMLACache)),
                                                          None),
                               mtp=StaticMLACache(m.c_kv[:, :slots], m.k_rope[:, :slots], m.key_mask[:, :slots],
                                                  m.length))


def load_spec(buf: SpecBuffers, pre: Prefilled, max_new_tokens: int, stop=frozenset()) -> None:
    """Copy the prefilled rows into ``buf`` (extra rows: copies of row 0, marked done), this call's
    ``max_new_tokens`` and stop flags, and emit token 0 of each row, ``argmax`` of the prefill's logits; it is the
    pending token and the MTP head's first pending entry pairs it with the prompt's last residual."""
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
    buf.max_new.fill_(max_new_tokens)
    fill_stop(buf.is_stop, stop)
    buf.done.copy_((torch.arange(rows, device=device) >= B) | buf.is_stop[first] | (buf.max_new <= 1))
    for t in (buf.drafted, buf.accepted, buf.verifies):
        t.zero_()


_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {graph: StaticDecoder}


def decoder_for(model, graph: bool) -> "StaticDecoder":
    """The model's :class:`StaticDecoder` (one per model and mode, so later calls reuse its buffers and graphs),
    with the default capacity (``config.max_position_embeddings``)."""
    per_model = _DECODERS.setdefault(model, {})
    if graph not in per_model:
        per_model[graph] = StaticDecoder(model, graph, compile=graph and COMPILE_GRAPHED)
    return per_model[graph]


def cache_dtypes(*entries) -> tuple:
    """The dtypes of the floating-point tensors of the cache entries (KDA / MLA caches, or tensors): part of a
    buffer key, so buffers made for bf16 caches are not refilled with fp32 ones. (Not the key mask, which a batch
    of equal-length prompts has not and a mixed one has: both fill the same buffers.)"""
    out = []
    for e in entries:
        if isinstance(e, Tensor):
            out.append(e.dtype)
        elif e is not None:
            out.append(tuple(t.dtype for t in vars(e).values() if isinstance(t, Tensor) and t.is_floating_point()))
    return tuple(out)


def cut_at_stop(rows: list[list[int]], stop) -> list[list[int]]:
    """Each row up to and including its first ``stop`` token (the rest recorded pad after it)."""
    stops = set(stop)
    return [row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in rows]


def config_bytes(config, rows: int, capacity: int, element_size: int) -> int:
    """A lower bound of :func:`buffer_bytes` from the model's config alone: the MLA latents and key masks of
    ``rows`` rows at ``capacity`` slots, ``element_size`` bytes a number (the check at construction)."""
    per_slot = len(config.full_attn_layers) * ((config.kv_lora_rank + config.qk_rope_head_dim) * element_size + 1)
    return rows * capacity * per_slot


class StaticDecoder:
    """Batched decoding on preallocated caches for one model; ``graph=True`` replays each step as a CUDA graph.

    ``decode(pre, max_new_tokens, ...)`` -> per row the list of new tokens (stop token kept, nothing after).
    ``capacity``: the slots of every MLA cache (prompt + new tokens of a call, at most), chosen once (None: the
    model's ``config.max_position_embeddings``); a call past it is refused naming ``max_new_tokens``, a capacity
    whose caches do not fit in memory naming ``capacity``. Buffers and graphs are kept per :class:`BufferKey`
    (batch bucket, drafts, device, cache dtypes) — the greedy and the sampling graph of a bucket share one buffer
    set — and reused by every later call in that bucket, whatever its prompt lengths, ``max_new_tokens``,
    sampling values and stop tokens; at most :data:`MAX_KEPT` buffer sets (least recently used dropped); all
    dropped when the model's weights change tensors (:meth:`check_weights`). ``builds`` / ``captures`` /
    ``capture_s``: buffer sets allocated, graphs captured, seconds of warm-up and capture, so far. ``cpu_window``:
    on CPU the step attends to the slots the call can use (False: the whole capacity, the graph's shapes). The
    decoder runs in normal mode under ``torch.no_grad`` whatever the caller's mode (``torch.inference_mode()``
    included). A capture that fails raises RuntimeError naming ``decoder='static'`` as the way round.
    """

    def __init__(self, model, graph: bool = False, compile: bool = False, capacity: int | None = None):
        hcache.check_model(model)
        config = model.config
        self.capacity = int(config.max_position_embeddings) if capacity is None else check_int("capacity", capacity, 1)
        weight = next(model.parameters())
        check_memory(config_bytes(config, 1, self.capacity, weight.element_size()), weight.device, self.capacity, 1)
        self.model, self.graph = model, graph
        self.logits = self.step_logits if not compile else torch.compile(self.step_logits, dynamic=False)
        self.kept: dict[BufferKey, tuple[Buffers | SpecBuffers, dict[bool, torch.cuda.CUDAGraph]]] = {}
        self.weights: tuple | None = None  # (address, dtype, device, shape) of every weight the kept graphs read
        self.builds = 0  # buffer sets allocated so far
        self.captures = 0  # graphs captured so far
        self.capture_s = 0.0  # seconds spent in warmup + capture
        self.cpu_window = True

    def step(self, buf: Buffers, sampled: bool, pad: int) -> None:
        """One decode step on ``buf`` (what the graph holds): feed ``tokens``, choose the next on the device."""
        buf.step.add_(1)
        self.record(buf, self.logits(buf.tokens, buf.cache), sampled, pad)
        buf.length.add_(1)

    def step_logits(self, tokens: Tensor, cache: K3Cache) -> Tensor:
        """tokens [B] through the model on the static cache (written in place) -> logits [B, V] float32."""
        return hcache.forward(self.model, tokens[:, None], cache, last=1).logits[:, -1]

    @staticmethod
    def record(buf: Buffers, logits: Tensor, sampled: bool, pad: int) -> None:
        """Choose each row's token at ``buf.step`` from ``logits [B, V]`` — argmax, or (``sampled``) a seeded draw
        with the buffers' temperature / top-k / top-p — done rows record ``pad``."""
        if sampled:
            tok = sample_seeded(logits, buf.temperature, buf.top_k, buf.top_p, buf.seeds, buf.step)  # [B]
        else:
            tok = logits.argmax(dim=-1)  # [B]
        tok = torch.where(buf.done, torch.full_like(tok, pad), tok)
        buf.out.index_copy_(1, buf.step, tok[:, None])
        buf.done.logical_or_(buf.is_stop[tok])
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

    def check_room(self, prompt: int, max_new_tokens: int) -> None:
        """ValueError naming ``max_new_tokens`` and ``capacity`` when ``prompt + max_new_tokens`` tokens do not fit
        the caches' slots (``prompt``: the longest row) — before anything is allocated."""
        if prompt + max_new_tokens > self.capacity:
            raise ValueError(f"max_new_tokens={max_new_tokens}: the longest prompt ({prompt} tokens) + max_new_tokens "
                             f"> capacity={self.capacity} (the static caches' slots, StaticDecoder(model, "
                             f"capacity=...)); at most {max(0, self.capacity - prompt)} here")

    def buffers(self, key: BufferKey, nbytes: int, make):
        """The kept (buffers, graphs) under ``key``, now most recently used; new: ``nbytes`` checked against the free
        memory (naming ``capacity``), the least recently used set dropped first, then ``make()``."""
        if key not in self.kept:
            while len(self.kept) >= MAX_KEPT:  # drop the least recently used buffers and graphs
                self.kept.pop(next(iter(self.kept)))
            check_memory(nbytes, key.device, self.capacity, key.rows)
            self.kept[key] = (make(), {})
            self.builds += 1
        self.kept[key] = self.kept.pop(key)  # most recently used last
        return self.kept[key]

    def windowed(self, buf, slots: int, spec: bool = False):
        """``buf`` itself, or on CPU (``cpu_window``) a copy whose MLA caches are its first ``slots`` slots."""
        if not self.cpu_window or buf.tokens.device.type != "cpu":
            return buf
        full = buf.mtp if spec else next((e for e in buf.cache.layers if isinstance(e, StaticMLACache)), None)
        if full is None or slots >= full.c_kv.shape[1]:
            return buf
        return window_spec(buf, slots) if spec else dataclasses.replace(buf, cache=window(buf.cache, slots))

    @torch.no_grad()
    def decode(self, pre: Prefilled, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, stop=frozenset(), seeds: Tensor | None = None,
               stats: GenerationStats | None = None) -> list[list[int]]:
        """Up to ``max_new_tokens`` tokens per prefilled row (the first from ``pre.logits``); a row ends after a
        ``stop`` token. ``seeds`` [B] int64: each row's sampling seed (None: the row index). The longest prompt
        plus ``max_new_tokens`` must fit ``capacity`` (ValueError naming both)."""
        with torch.inference_mode(False), torch.no_grad():  # normal tensors, writable by a later call in any mode
            return self._decode(pre, max_new_tokens, temperature, top_k, top_p, stop, seeds, stats)

    def _decode(self, pre, max_new_tokens, temperature, top_k, top_p, stop, seeds, stats):
        model, device = self.model, pre.logits.device
        B, V = pre.logits.shape
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
        if max_new_tokens < 1:
            return [[] for _ in range(B)]
        check_sampling(temperature, top_k, top_p)
        seeds = torch.arange(B) if seeds is None else torch.as_tensor(seeds, dtype=torch.long).reshape(-1)
        if seeds.numel() != B:
            raise ValueError(f"seeds: need one per row ({B}), got {seeds.numel()}")
        stop = check_stop(stop, V)
        S0 = pre.cache.offset
        self.check_room(S0, max_new_tokens)
        pad = model.config.pad_token_id
        pad = 0 if pad is None else int(pad)
        rows = batch_bucket(B)
        sampled = temperature != 0 and top_k != 1  # the graph with the sampler; greedy (top_k=1 too): argmax
        key = BufferKey("decode", rows, 0, device, cache_dtypes(*pre.cache.layers, pre.logits))
        self.check_weights()
        builds, captures = self.builds, self.captures
        was_training = model.training
        model.eval()
        try:
            synchronize(device)
            t0 = time.perf_counter()
            buf, graphs = self.buffers(key, buffer_bytes(pre, rows, self.capacity),
                                       lambda: allocate(pre, rows, self.capacity))
            load(buf, pre, seeds, temperature, top_k, top_p, stop)
            run = self.windowed(buf, slots_for(S0 + max_new_tokens))
            logits0 = torch.cat([pre.logits, pre.logits[:1].expand(rows - B, -1)]) if rows > B else pre.logits
            self.record(run, logits0.float(), sampled, pad)  # token 0, from the prefill
            graph = graphs.get(sampled)
            done_steps = 0
            while done_steps < max_new_tokens - 1:
                if self.graph and graph is None and max_new_tokens - 1 - done_steps > WARMUP_STEPS:
                    c0 = time.perf_counter()
                    graph = graphs[sampled] = self.capture(run, sampled, pad)  # WARMUP_STEPS real steps, one recorded
                    done_steps += WARMUP_STEPS
                    synchronize(device)
                    spent = time.perf_counter() - c0
                    self.capture_s += spent
                    if stats is not None:
                        stats.forwards += WARMUP_STEPS
                        stats.capture_s += spent
                    continue
                if graph is not None:
                    graph.replay()
                else:
                    self.step(run, sampled, pad)
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
            stats.builds += self.builds - builds
            stats.captures += self.captures - captures
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
        hit = (buf.is_stop[best] & (buf.iota <= j[:, None])).any(dim=1)  # a stop among the emitted
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
        stop = check_stop(stop, pre.logits.shape[-1])
        longest = max(pre.lengths)
        self.check_room(longest, max_new_tokens)
        rows, slots = batch_bucket(B), self.capacity + spec_scratch(k)
        key = BufferKey("spec", rows, k, device, cache_dtypes(*pre.cache.layers, pre.mtp_cache, pre.residual))
        self.check_weights()
        builds, captures = self.builds, self.captures
        check = max(1, CHECK_EVERY // (k + 1))  # steps between the host's reads of the done flags
        was_training = model.training
        model.eval()
        try:
            synchronize(device)
            t0 = time.perf_counter()
            buf, graphs = self.buffers(key, buffer_bytes(pre, rows, slots, k),
                                       lambda: allocate_spec(pre, rows, slots, self.capacity, k))
            load_spec(buf, pre, max_new_tokens, stop)
            run = self.windowed(buf, slots_for(longest + max_new_tokens + spec_scratch(k)), spec=True)
            graph = graphs.get(False)  # greedy only
            steps, limit = 0, max_new_tokens - 1  # every step emits >= 1 token per active row
            while steps < limit:
                if self.graph and graph is None and limit - steps > WARMUP_STEPS:
                    c0 = time.perf_counter()
                    graph = graphs[False] = self.capture_step(lambda: self.spec_step(run), device, "speculative step")
                    steps += WARMUP_STEPS
                    synchronize(device)
                    spent = time.perf_counter() - c0
                    self.capture_s += spent
                    if stats is not None:
                        stats.capture_s += spent
                    continue
                if graph is not None:
                    graph.replay()
                else:
                    self.spec_step(run)
                steps += 1
                if steps % check == 0 and bool(buf.done[:B].all()):
                    break
            out = buf.out[:B, :max_new_tokens].tolist()  # the one read back of the tokens
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
            stats.builds += self.builds - builds
            stats.captures += self.captures - captures
        return result
