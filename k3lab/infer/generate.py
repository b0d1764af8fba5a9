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
Rows that stop (a ``stop`` token, the config's EOS unless ``eos_token_id=None``, or ``max_new_tokens``)
leave the batch.

:func:`stream` yields ``(row, token)`` as tokens are produced; :func:`generate` collects them.
``draft=k`` decodes with the model's MTP head drafting ``k`` tokens per step
(:mod:`k3lab.infer.speculative`); ``prefix_cache`` reuses the cached blocks of shared prompt
prefixes (:mod:`k3lab.infer.prefix`). The chunked prefill of equal-length rows and the shared records
live in :mod:`k3lab.infer.step` (imported by both of those, so nothing imports this module back).
"""

from __future__ import annotations

import numbers
import time
from typing import Iterator

import torch

from k3lab.backend import synchronize
from k3lab.infer import cache as hcache
from k3lab.infer.prefix import PrefixCache
from k3lab.infer.sampling import check_sampling, sample_next
from k3lab.infer.speculative import speculative_decode
from k3lab.infer.static import (DECODERS, CapacityError, StaticDecoder, decoder_for, resolve_decoder,  # noqa: F401
                                slots_for)
from k3lab.infer.step import (DEFAULT_CHUNK_TOKENS, GenerationStats, Prefilled, check_int,  # noqa: F401
                              check_prompt_context, model_device, prefill_rows)

Tensor = torch.Tensor

EOS_FROM_CONFIG = "config"  # the default of ``eos_token_id``: stop at ``model.config.eos_token_id``


# ----------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------
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


def resolve_eos(eos_token_id, config) -> frozenset:
    """``eos_token_id``: ``"config"`` (the default: ``config.eos_token_id``), None (no EOS stop) or a token
    id -> the EOS stop set (ValueError naming ``eos_token_id``)."""
    if isinstance(eos_token_id, str) and eos_token_id == EOS_FROM_CONFIG:
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, numbers.Integral) \
            or not 0 <= eos_token_id < config.vocab_size:
        raise ValueError(f"eos_token_id={eos_token_id!r}: must be 'config' (the model config's, the default), None "
                         f"(no EOS stop) or a token id in [0, vocab_size={config.vocab_size})")
    return frozenset([int(eos_token_id)])


def check_context(rows: list[list[int]], max_new_tokens: int, config, allow_longer: bool) -> None:
    """Refuse a prompt, or a prompt plus ``max_new_tokens``, longer than ``config.max_position_embeddings``
    (the trained context) unless ``allow_longer`` (ValueError naming ``prompts[i]`` / ``max_new_tokens``)."""
    check_prompt_context(rows, config, allow_longer)
    limit = getattr(config, "max_position_embeddings", None)
    if allow_longer or limit is None:
        return
    longest = max(len(row) for row in rows)
    if longest + max_new_tokens > limit:
        raise ValueError(f"max_new_tokens={max_new_tokens}: the longest prompt ({longest} tokens) + max_new_tokens > "
                         f"max_position_embeddings={limit} (the trained context); at most {limit - longest}, or "
                         f"pass allow_longer=True")


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def prefill(model, prompts, chunk_size: int = DEFAULT_CHUNK_TOKENS, prefix_cache=None, mtp: bool = False,
            stats: GenerationStats | None = None, max_prompt_tokens: int | None = None,
            allow_longer: bool = False) -> Prefilled:
    """Prefill a batch of prompts of any lengths (see the module docstring) and stack their caches.

    Rows of equal length run together; with ``prefix_cache`` every row runs alone, starting from its
    longest cached block (at most ``len - 1`` tokens: the last token's logits are always computed) and
    leaving a snapshot at every block boundary it computes. ``mtp`` (one prompt only) also builds the
    MTP head's cache for speculative decoding. A prompt longer than ``config.max_position_embeddings``
    is refused (ValueError naming ``prompts[i]`` and the limit, as :func:`generate`) unless ``allow_longer``.
    """
    hcache.check_model(model)
    check_int("chunk_size", chunk_size, 1)
    rows, _ = normalize_prompts(prompts, model.config.vocab_size, max_prompt_tokens)
    check_prompt_context(rows, model.config, allow_longer)
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
                parts[i], hit = prefix_cache.prefill(row, chunk_size, allow_longer=allow_longer)
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
           stats: GenerationStats | None = None, eos_token_id=EOS_FROM_CONFIG,
           allow_longer: bool = False, decoder: str = "eager") -> Iterator[tuple[int, int]]:
    """The streaming form of :func:`generate`: yields ``(row, token)`` as each token is produced
    (rows interleaved step by step; under speculative decoding one row after another; with
    ``decoder="static"``/``"graph"``/``"auto"`` the tokens stay on the device until the decode ends, then come row
    by row — so the default here stays "eager", the decoder that streams).
    Arguments are checked before the first token (ValueError naming the argument)."""
    hcache.check_model(model)
    vocab = model.config.vocab_size
    if max_prompt_tokens is not None:
        check_int("max_prompt_tokens", max_prompt_tokens, 1)
    rows, _ = normalize_prompts(prompts, vocab, max_prompt_tokens)
    check_int("max_new_tokens", max_new_tokens, 0)
    check_context(rows, max_new_tokens, model.config, allow_longer)
    check_int("chunk_size", chunk_size, 1)
    check_sampling(temperature, top_k, top_p)
    stop = normalize_stop(stop, vocab) | resolve_eos(eos_token_id, model.config)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator={generator!r}: must be None or a torch.Generator")
    if draft is not None:
        check_int("draft", draft, 1)
        if model.mtp is None:
            raise ValueError(f"draft={draft}: the model has no MTP head (config.num_nextn_predict_layers="
                             f"{model.config.num_nextn_predict_layers}; drafting needs 1)")
        if prefix_cache is not None:
            raise ValueError("draft and prefix_cache: speculative decoding does not read the prefix cache yet "
                             "(its MTP head needs the residual of every prompt position); pass one of them")
    if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
        raise ValueError(f"prefix_cache: must be None or a k3lab.infer.PrefixCache, got {type(prefix_cache).__name__}")
    limit = getattr(model.config, "max_position_embeddings", None)
    in_context = limit is None or max(len(r) for r in rows) + max_new_tokens <= limit
    fit = decoder == "auto"  # the static caches may shrink to the call where the whole context does not fit
    decoder = resolve_decoder(decoder, model_device(model), draft, temperature, in_context)
    if draft is not None and decoder != "eager" and temperature != 0:
        raise ValueError(f"temperature={temperature!r} with decoder={decoder!r} and draft={draft}: the static/graphed "
                         "speculative step is greedy only (temperature=0); use decoder='eager' to sample with drafts")
    return _stream(model, rows, max_new_tokens, temperature, top_k, top_p, stop, generator, draft, prefix_cache,
                   chunk_size, stats, decoder, allow_longer, fit)


def static_decoder(model, graph: bool, tokens: int) -> StaticDecoder:
    """The model's kept static/graphed decoder (capacity: the trained context), or — for a call of ``tokens``
    prompt + new tokens past it, which ``allow_longer=True`` lets through — a decoder of its own for that call,
    its capacity ``tokens`` rounded up to :data:`k3lab.infer.static.LENGTH_BUCKET` (built and captured anew)."""
    dec = decoder_for(model, graph)
    return dec if tokens <= dec.capacity else StaticDecoder(model, graph, capacity=slots_for(tokens))


def static_run(model, graph: bool, tokens: int, fit: bool, run):
    """``run(decoder)`` on :func:`static_decoder`'s decoder. ``fit`` (the caller asked for ``decoder="auto"``): where
    the static caches of the model's whole context do not fit in memory (:class:`CapacityError`, e.g. a 1M-token
    model on one GPU), the call runs on a decoder sized for its own ``tokens`` instead (built and captured for this
    call); an explicit "static"/"graph" raises the error naming ``capacity``."""
    try:
        return run(static_decoder(model, graph, tokens))
    except CapacityError:
        if not fit:
            raise
        return run(StaticDecoder(model, graph, capacity=slots_for(tokens)))


def _stream(model, rows, max_new_tokens, temperature, top_k, top_p, stop, generator, draft, prefix_cache,
            chunk_size, stats, decoder="eager", allow_longer=False, fit=False):
    if max_new_tokens == 0:
        return
    need = max(len(r) for r in rows) + max_new_tokens  # cache slots the static decoders need
    if draft is None and decoder != "eager":
        pre = prefill(model, rows, chunk_size, prefix_cache=prefix_cache, stats=stats, allow_longer=allow_longer)
        seeds = torch.randint(0, 2 ** 31 - 1, (len(rows),), generator=generator,
                              device=generator.device if generator is not None else "cpu")
        new = static_run(model, decoder == "graph", need, fit, lambda dec: dec.decode(
            pre, max_new_tokens, temperature, top_k, top_p, stop, seeds, stats))
        for i, tokens in enumerate(new):
            for tok in tokens:
                yield i, tok
        return
    if draft is None:
        pre = prefill(model, rows, chunk_size, prefix_cache=prefix_cache, stats=stats, allow_longer=allow_longer)
        yield from decode(model, pre, max_new_tokens, temperature, top_k, top_p, stop, generator, stats)
        return
    if decoder != "eager":  # every row prefilled alone with its MTP cache, then decoded as one batch
        pres = [prefill(model, [row], chunk_size, mtp=True, stats=stats, allow_longer=allow_longer) for row in rows]
        new = static_run(model, decoder == "graph", need, fit,
                         lambda dec: dec.speculate(pres, draft, max_new_tokens, stop, stats))
        for i, tokens in enumerate(new):
            for tok in tokens:
                yield i, tok
        return
    for i, row in enumerate(rows):
        pre = prefill(model, [row], chunk_size, mtp=True, stats=stats, allow_longer=allow_longer)
        for tok in speculative_decode(model, pre, draft, max_new_tokens, temperature, top_k, top_p, stop,
                                      generator, stats):
            yield i, tok


def generate(model, prompts, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, stop=None, generator: torch.Generator | None = None, draft: int | None = None,
             prefix_cache=None, chunk_size: int = DEFAULT_CHUNK_TOKENS, max_prompt_tokens: int | None = None,
             stats: GenerationStats | None = None, eos_token_id=EOS_FROM_CONFIG, allow_longer: bool = False,
             decoder: str = "auto"):
    """Continue each prompt by up to ``max_new_tokens`` tokens with the hybrid cache.

    prompts: a ``[B, T]`` LongTensor, or a list of prompts (lists of token ids or 1-D tensors) of any
    lengths. Sampling: ``temperature`` 0 = greedy, else softmax at that temperature over ``top_k``
    tokens / the ``top_p`` nucleus, drawn with ``generator``; ``stop``: token id(s) that end a row
    (kept in the output). ``eos_token_id``: ``"config"`` (default) also stops a row at
    ``model.config.eos_token_id`` (kept, as in transformers), None turns that off, an id stops at that id.
    ``draft=k``: speculative decoding with the MTP head, ``k`` drafts a step
    (greedy output unchanged; with ``decoder="static"``/``"graph"`` greedy only, the whole batch in one
    captured step: :meth:`k3lab.infer.static.StaticDecoder.speculate`). ``prefix_cache``: a
    :class:`k3lab.infer.PrefixCache` for this model.
    ``chunk_size``: prefill chunk. ``max_prompt_tokens``: refuse longer prompts. ``stats``: a
    :class:`GenerationStats` filled in place. A prompt plus ``max_new_tokens`` longer than
    ``config.max_position_embeddings`` (the trained context; the model is NoPE and would run, untested)
    is refused unless ``allow_longer=True``. ``decoder`` (one of :data:`k3lab.infer.static.DECODERS`):
    "auto" (the default: "graph" on CUDA, :data:`k3lab.infer.static.AUTO_OFF_CUDA` elsewhere — "eager", as the
    static step measured a little slower on CPU; "eager" also for ``draft`` with ``temperature > 0`` and past the
    context under ``allow_longer``), "eager" (functional caches, rows leave the batch as they stop: the reference path),
    "static" (preallocated caches, the step chooses tokens on the device) or "graph" (the static step as one CUDA
    graph replay; CUDA only) — :mod:`k3lab.infer.static`; the static decoders give the eager decoder's greedy
    tokens and draw sampled tokens from per-row seeds taken from ``generator`` (other draws than "eager"'s, from
    the same distribution). They keep their buffers and graphs per batch bucket for the model's context: the
    first call of a bucket builds (and on CUDA captures), later calls of any prompt length and ``max_new_tokens``
    replay (``stats.builds`` / ``stats.captures``).

    Returns each prompt followed by its continuation, in the prompts' form: a ``[B, T + n]`` tensor on
    the prompts' device, ``n`` the longest continuation (``<= max_new_tokens``; rows that stopped earlier
    padded with ``config.pad_token_id``), or a list of lists of ints / 1-D tensors.
    """
    hcache.check_model(model)
    rows, kind = normalize_prompts(prompts, model.config.vocab_size)
    new = [[] for _ in rows]
    for row, tok in stream(model, prompts, max_new_tokens, temperature, top_k, top_p, stop, generator, draft,
                           prefix_cache, chunk_size, max_prompt_tokens, stats, eos_token_id, allow_longer, decoder):
        new[row].append(tok)
    if kind == "tensor":
        width = prompts.shape[1] + max(len(n) for n in new)  # not + max_new_tokens: no padding past the longest row
        pad = model.config.pad_token_id
        out = torch.tensor([r + n + [pad] * (width - len(r) - len(n)) for r, n in zip(rows, new)], dtype=prompts.dtype)
        return out.to(prompts.device)
    if kind == "tensors":
        return [torch.tensor(r + n, dtype=p.dtype, device=p.device) for r, n, p in zip(rows, new, prompts)]
    return [r + n for r, n in zip(rows, new)]
