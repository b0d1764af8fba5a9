r"""Batched generation with the hybrid cache: chunked prefill, then decoding, as a list or a stream.

**Prefill** (:func:`prefill`) runs a prompt through the model ``chunk_size`` tokens at a time. Each
chunk starts from the cache the previous one left: the KDA layers carry their recurrent state and
the three short-conv tails (the last ``W-1`` projected inputs), the MLA layers append the chunk's
latents ``[c_kv ; k_rope]`` and attend to all of them (docs/k3_reference.md §2.5, §3). Feeding a
prompt in chunks gives the same logits as one forward (fp32 rounding; tested). Memory is bounded
by the chunk, not the prompt: the only part that grows is the MLA latent.

**Prompts of different lengths.** Left-padding a batch is wrong for a recurrent layer: a pad token
still decays and writes the KDA state and enters the conv tails. Here the rows of equal length are
prefilled together and rows of different lengths apart (nothing crosses rows, so this is exact);
the caches are then stacked for one batched decode, the MLA latents padded at the end with a key
mask (:mod:`k3lab.infer.cache`). Greedy output for a batch equals each prompt generated alone.

**Decode** feeds one token per row per step: a KDA layer does a fixed amount of work on its
``[H, K, V]`` state (our Triton decode step on CUDA, ``backend="auto"``; the torch recurrence on CPU), an MLA
layer attends to the latents in the absorbed form (work and cache growing with the context).
Rows that stop (a ``stop`` token, or ``max_new_tokens``) leave the batch.

:func:`stream` yields ``(row, token)`` as tokens are produced; :func:`generate` collects them.
``draft=k`` decodes with the model's MTP head drafting ``k`` tokens per step
(:mod:`k3lab.infer.speculative`); ``prefix_cache`` reuses the cached blocks of shared prompt
prefixes (:mod:`k3lab.infer.prefix`).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from k3lab.backend import synchronize
from k3lab.infer import cache as hcache
from k3lab.infer.sampling import check_sampling, sample_next
from k3lab.model import K3Cache

Tensor = torch.Tensor

DEFAULT_CHUNK_TOKENS = 1024  # prefill chunk: MLA scores of one chunk are [H, chunk, context] on the torch path


@dataclass
class GenerationStats:
    """What a generation call did and how long it took (filled in place; pass one to :func:`generate`).

    prompt_tokens / computed_tokens / cached_tokens: prompt tokens in all, run through the model, served
    by the prefix cache. new_tokens: tokens generated. prefill_s / decode_s: wall seconds (device
    synchronised). forwards: decode forwards of the main model (verify forwards under speculation).
    drafted / accepted: MTP draft tokens proposed / accepted. mtp_forwards: forwards of the MTP head.
    """

    prompt_tokens: int = 0
    computed_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    mtp_forwards: int = 0
    per_row: list = field(default_factory=list)  # speculative decoding: (drafted, accepted) per row

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (NaN without drafts)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_forward(self) -> float:
        """Decoded tokens per main-model forward (1 for plain decoding of one row)."""
        return self.new_tokens / self.forwards if self.forwards else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class Prefilled:
    """Rows after prefill, in prompt order: what decoding starts from.

    cache: the hybrid cache after each row's prompt (rows stacked, :func:`k3lab.infer.cache.stack`).
    logits: [B, V] float32 at each row's last prompt token; residual: [B, D] the model's final residual
    there (the MTP head's ``h_t``). mtp_cache: the MTP block's MLA cache over positions ``0..T-2`` (when
    prefilled with ``mtp=True``; one row). lengths: each row's prompt length.
    """

    cache: K3Cache
    logits: Tensor
    residual: Tensor
    lengths: list
    mtp_cache: object = None


def model_device(model) -> torch.device:
    return next(model.parameters()).device


# ----------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------
def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}={value!r}: must be an integer >= {low}")
    return int(value)


def normalize_prompts(prompts, vocab_size: int, max_prompt_tokens: int | None = None) -> tuple[list[list[int]], str]:
    """Prompts as lists of token ids, and their kind: "tensor" (a [B, T] LongTensor), "lists" (a list of
    lists of ints) or "tensors" (a list of 1-D LongTensors). Raises ValueError naming ``prompts`` (or
    ``prompts[i]``) for an empty batch, an empty prompt, a non-integer or out-of-range id, or a prompt
    longer than ``max_prompt_tokens``."""
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2 or prompts.dtype in (torch.bool,) or prompts.is_floating_point():
            raise ValueError(f"prompts: a tensor must be [B, T] of integer token ids, got {prompts.dtype} "
                             f"{tuple(prompts.shape)}")
        rows, kind = prompts.tolist(), "tensor"
    elif isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in prompts):
            raise ValueError("prompts: got a flat list of ints; pass a list of prompts, e.g. [prompt] for one")
        rows, kind = [], "tensors" if prompts and all(isinstance(p, Tensor) for p in prompts) else "lists"
        for i, p in enumerate(prompts):
            if isinstance(p, Tensor):
                if p.dim() != 1 or p.is_floating_point() or p.dtype == torch.bool:
                    raise ValueError(f"prompts[{i}]: a tensor prompt must be 1-D integer ids, got {p.dtype} "
                                     f"{tuple(p.shape)}")
                p = p.tolist()
            if not isinstance(p, (list, tuple)):
                raise ValueError(f"prompts[{i}]: must be a list of token ids or a 1-D tensor, got {type(p).__name__}")
            rows.append(list(p))
    else:
        raise ValueError(f"prompts: must be a [B, T] tensor or a list of prompts, got {type(prompts).__name__}")
    if not rows:
        raise ValueError("prompts: empty batch (no prompts)")
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompts[{i}]: empty prompt (at least one token is needed)")
        bad = [t for t in row if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}]: token ids must be integers in [0, vocab_size={vocab_size}); got {bad[:3]}")
        if max_prompt_tokens is not None and len(row) > max_prompt_tokens:
            raise ValueError(f"prompts[{i}]: {len(row)} tokens > max_prompt_tokens={max_prompt_tokens}")
    return [[int(t) for t in row] for row in rows], kind


def normalize_stop(stop, vocab_size: int) -> frozenset:
    """``stop``: None, a token id, or a collection of token ids -> a frozenset (ValueError naming ``stop``)."""
    if stop is None:
        return frozenset()
    items = [stop] if isinstance(stop, numbers.Integral) else stop
    try:
        items = list(items)
    except TypeError:
        raise ValueError(f"stop={stop!r}: must be None, a token id or a collection of token ids") from None
    for t in items:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size:
            raise ValueError(f"stop={stop!r}: token ids must be integers in [0, vocab_size={vocab_size})")
    return frozenset(int(t) for t in items)


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------
def _cuts(start: int, end: int, chunk_size: int, block_tokens: int | None) -> list[int]:
    """Chunk ends in (start, end]: every ``chunk_size`` tokens and every multiple of ``block_tokens``."""
    ends = set(range(start + chunk_size, end, chunk_size)) | {end}
    if block_tokens:
        ends |= set(range((start // block_tokens + 1) * block_tokens, end, block_tokens))
    return sorted(ends)


@torch.no_grad()
def prefill_rows(model, ids: Tensor, chunk_size: int = DEFAULT_CHUNK_TOKENS, cache: K3Cache | None = None,
                 mtp: bool = False, block_tokens: int | None = None, on_block=None) -> Prefilled:
    """Chunked prefill of rows of equal length ``ids [B, T]``, on top of ``cache`` (None: an empty one).

    ``mtp``: also run the MTP head over the prompt (position t reads ``h_t`` and ``x_{t+1}``), so
    drafting starts with its MLA cache over positions ``0..T-2`` (needs ``cache=None``).
    ``block_tokens`` / ``on_block(end, cache, seconds)``: cut chunks at every multiple of
    ``block_tokens`` (absolute positions, counting the cache) and call ``on_block`` there with the
    cache and the seconds spent since the previous cut point (the prefix cache's snapshots).
    """
    from k3lab.infer.speculative import mtp_step  # speculative imports this module

    if mtp and cache is not None:
        raise ValueError("prefill_rows: mtp=True needs cache=None (the MTP head reads the residual of every position)")
    device = model_device(model)
    start = 0 if cache is None else cache.offset
    T = ids.shape[1]
    ends = _cuts(start, start + T, chunk_size, block_tokens)
    mtp_cache, prev_h, step = None, None, None
    pos, t0 = start, time.perf_counter()
    for end in ends:
        piece = ids[:, pos - start:end - start]  # [B, t]
        step = hcache.forward(model, piece, cache, last=1)
        cache = step.cache
        if mtp:
            h = step.residual if prev_h is None else torch.cat([prev_h, step.residual], 1)  # h_{t} paired with x_{t+1}
            x_next = piece[:, 1:] if prev_h is None else piece
            if x_next.shape[1] > 0:
                _, _, mtp_cache = mtp_step(model.mtp, model.model.embed_tokens(x_next), h[:, :x_next.shape[1]], mtp_cache)
            prev_h = step.residual[:, -1:]
        if on_block is not None and block_tokens and end % block_tokens == 0:
            synchronize(device)
            now = time.perf_counter()
            on_block(end, cache, now - t0)
            t0 = now
        pos = end
    return Prefilled(hcache.compact(cache), step.logits[:, -1], step.residual[:, -1], [T] * ids.shape[0], mtp_cache)


@torch.no_grad()
def prefill(model, prompts, chunk_size: int = DEFAULT_CHUNK_TOKENS, prefix_cache=None, mtp: bool = False,
            stats: GenerationStats | None = None, max_prompt_tokens: int | None = None) -> Prefilled:
    """Prefill a batch of prompts of any lengths (see the module docstring) and stack their caches.

    Rows of equal length run together; with ``prefix_cache`` every row runs alone, starting from its
    longest cached block (at most ``len - 1`` tokens: the last token's logits are always computed) and
    leaving a snapshot at every block boundary it computes. ``mtp`` (one prompt only) also builds the
    MTP head's cache for speculative decoding.
    """
    hcache.check_model(model)
    _int("chunk_size", chunk_size, 1)
    rows, _ = normalize_prompts(prompts, model.config.vocab_size, max_prompt_tokens)
    if mtp and (len(rows) != 1 or prefix_cache is not None):
        raise ValueError("prefill: mtp=True takes one prompt and no prefix_cache")
    if prefix_cache is not None and prefix_cache.model is not model:
        raise ValueError("prefix_cache: it was built for another model (PrefixCache(model, ...))")
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        synchronize(device)
        t0 = time.perf_counter()
        parts: dict[int, Prefilled] = {}
        if prefix_cache is not None:
            for i, row in enumerate(rows):
                parts[i], hit = prefix_cache.prefill(row, chunk_size)
                if stats is not None:
                    stats.cached_tokens += hit
                    stats.computed_tokens += len(row) - hit
        else:
            groups: dict[int, list[int]] = {}
            for i, row in enumerate(rows):
                groups.setdefault(len(row), []).append(i)
            for length, members in groups.items():
                ids = torch.tensor([rows[i] for i in members], dtype=torch.long, device=device)
                part = prefill_rows(model, ids, chunk_size, mtp=mtp)
                for j, i in enumerate(members):
                    sel = torch.tensor([j], device=device)
                    parts[i] = part if len(members) == 1 else Prefilled(
                        hcache.select_rows(part.cache, sel), part.logits[j:j + 1], part.residual[j:j + 1], [length])
                if stats is not None:
                    stats.computed_tokens += length * len(members)
        order = [parts[i] for i in range(len(rows))]
        out = Prefilled(hcache.stack([p.cache for p in order]), torch.cat([p.logits for p in order]),
                        torch.cat([p.residual for p in order]), [len(r) for r in rows], order[0].mtp_cache)
        synchronize(device)
        if stats is not None:
            stats.prompt_tokens += sum(len(r) for r in rows)
            stats.prefill_s += time.perf_counter() - t0
        return out
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------------------------
# decoding
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def decode(model, pre: Prefilled, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, stop=frozenset(), generator: torch.Generator | None = None,
           stats: GenerationStats | None = None) -> Iterator[tuple[int, int]]:
    """Batched decoding from a :class:`Prefilled` batch: yields ``(row, token)`` per row per step.

    The first token of each row comes from the prefill's logits; each further step feeds the
    batch's last tokens ``[B, 1]`` with the cache. A row ends after a ``stop`` token or
    ``max_new_tokens`` tokens and leaves the batch (its cache rows are dropped).
    """
    device = pre.logits.device
    active = list(range(pre.logits.shape[0]))  # original row index of each batch row
    cache, logits = pre.cache, pre.logits
    counts = [0] * len(active)
    was_training = model.training
    model.eval()
    try:
        synchronize(device)
        t0 = time.perf_counter()
        while active and max_new_tokens > 0:
            nxt = sample_next(logits, temperature, top_k, top_p, generator)  # [B]
            keep = []
            for j, (row, tok) in enumerate(zip(active, nxt.tolist())):
                counts[row] += 1
                if stats is not None:
                    stats.new_tokens += 1
                yield row, tok
                if tok not in stop and counts[row] < max_new_tokens:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=device)
                cache, nxt = hcache.select_rows(cache, idx), nxt.index_select(0, idx)
                active = [active[j] for j in keep]
            step = hcache.forward(model, nxt[:, None], cache, last=1)
            cache, logits = step.cache, step.logits[:, -1]
            if stats is not None:
                stats.forwards += 1
        synchronize(device)
        if stats is not None:
            stats.decode_s += time.perf_counter() - t0
    finally:
        model.train(was_training)


def stream(model, prompts, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, stop=None, generator: torch.Generator | None = None, draft: int | None = None,
           prefix_cache=None, chunk_size: int = DEFAULT_CHUNK_TOKENS, max_prompt_tokens: int | None = None,
           stats: GenerationStats | None = None) -> Iterator[tuple[int, int]]:
    """The streaming form of :func:`generate`: yields ``(row, token)`` as each token is produced
    (rows interleaved step by step; under speculative decoding one row after another). Arguments are
    checked before the first token (ValueError naming the argument)."""
    hcache.check_model(model)
    vocab = model.config.vocab_size
    if max_prompt_tokens is not None:
        _int("max_prompt_tokens", max_prompt_tokens, 1)
    rows, _ = normalize_prompts(prompts, vocab, max_prompt_tokens)
    _int("max_new_tokens", max_new_tokens, 0)
    _int("chunk_size", chunk_size, 1)
    check_sampling(temperature, top_k, top_p)
    stop = normalize_stop(stop, vocab)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator={generator!r}: must be None or a torch.Generator")
    if draft is not None:
        _int("draft", draft, 1)
        if model.mtp is None:
            raise ValueError(f"draft={draft}: the model has no MTP head (config.num_nextn_predict_layers="
                             f"{model.config.num_nextn_predict_layers}; drafting needs 1)")
        if prefix_cache is not None:
            raise ValueError("draft and prefix_cache: speculative decoding does not read the prefix cache yet "
                             "(its MTP head needs the residual of every prompt position); pass one of them")
    from k3lab.infer.prefix import PrefixCache

    if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
        raise ValueError(f"prefix_cache: must be None or a k3lab.infer.PrefixCache, got {type(prefix_cache).__name__}")
    return _stream(model, rows, max_new_tokens, temperature, top_k, top_p, stop, generator, draft, prefix_cache,
                   chunk_size, stats)


def _stream(model, rows, max_new_tokens, temperature, top_k, top_p, stop, generator, draft, prefix_cache,
            chunk_size, stats):
    if max_new_tokens == 0:
        return
    if draft is None:
        pre = prefill(model, rows, chunk_size, prefix_cache=prefix_cache, stats=stats)
        yield from decode(model, pre, max_new_tokens, temperature, top_k, top_p, stop, generator, stats)
        return
    from k3lab.infer.speculative import speculative_decode

    for i, row in enumerate(rows):
        pre = prefill(model, [row], chunk_size, mtp=True, stats=stats)
        for tok in speculative_decode(model, pre, draft, max_new_tokens, temperature, top_k, top_p, stop,
                                      generator, stats):
            yield i, tok


def generate(model, prompts, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, stop=None, generator: torch.Generator | None = None, draft: int | None = None,
             prefix_cache=None, chunk_size: int = DEFAULT_CHUNK_TOKENS, max_prompt_tokens: int | None = None,
             stats: GenerationStats | None = None):
    """Continue each prompt by up to ``max_new_tokens`` tokens with the hybrid cache.

    prompts: a ``[B, T]`` LongTensor, or a list of prompts (lists of token ids or 1-D tensors) of any
    lengths. Sampling: ``temperature`` 0 = greedy, else softmax at that temperature over ``top_k``
    tokens / the ``top_p`` nucleus, drawn with ``generator``; ``stop``: token id(s) that end a row
    (kept in the output). ``draft=k``: speculative decoding with the MTP head, ``k`` drafts a step
    (greedy output unchanged). ``prefix_cache``: a :class:`k3lab.infer.PrefixCache` for this model.
    ``chunk_size``: prefill chunk. ``max_prompt_tokens``: refuse longer prompts. ``stats``: a
    :class:`GenerationStats` filled in place.

    Returns each prompt followed by its continuation, in the prompts' form: a ``[B, T + max_new_tokens]``
    tensor on the prompts' device (rows that stopped early padded with ``config.pad_token_id``), or a
    list of lists of ints / 1-D tensors.
    """
    hcache.check_model(model)
    rows, kind = normalize_prompts(prompts, model.config.vocab_size)
    new = [[] for _ in rows]
    for row, tok in stream(model, prompts, max_new_tokens, temperature, top_k, top_p, stop, generator, draft,
                           prefix_cache, chunk_size, max_prompt_tokens, stats):
        new[row].append(tok)
    if kind == "tensor":
        width = prompts.shape[1] + max_new_tokens
        pad = model.config.pad_token_id
        out = torch.tensor([r + n + [pad] * (width - len(r) - len(n)) for r, n in zip(rows, new)], dtype=prompts.dtype)
        return out.to(prompts.device)
    if kind == "tensors":
        return [torch.tensor(r + n, dtype=p.dtype, device=p.device) for r, n, p in zip(rows, new, prompts)]
    return [r + n for r, n in zip(rows, new)]
