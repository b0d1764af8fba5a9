r"""What every decoding path shares: the chunked prefill of rows of equal length, one MTP-head step,
the records they fill in, and the argument check they use.

:mod:`k3lab.infer` imports one way: :mod:`~k3lab.infer.cache` and :mod:`~k3lab.infer.sampling` (one model
step, the next-token rule) <- this module <- :mod:`~k3lab.infer.prefix` (the prefix cache) and
:mod:`~k3lab.infer.speculative` (MTP drafts, verify, rollback) <- :mod:`~k3lab.infer.generate` (the API).
No module imports one that imports it (tested: ``tests/test_infer_edges.py``).

**Prefill** (:func:`prefill_rows`) runs rows of equal length through the model ``chunk_size`` tokens at
a time; each chunk starts from the cache the previous one left (the KDA state and conv tails carry
over, the MLA latents grow). Optionally it also runs the MTP head over the prompt (:func:`mtp_step`),
and cuts chunks at block boundaries for the prefix cache's snapshots.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import torch

from k3lab.backend import synchronize
from k3lab.infer import cache as hcache
from k3lab.model import K3Cache
from k3lab.residual import PreNormStream

Tensor = torch.Tensor

DEFAULT_CHUNK_TOKENS = 1024  # prefill chunk: MLA scores of one chunk are [H, chunk, context] on the torch path


@dataclass
class GenerationStats:
    """What a generation call did and how long it took (filled in place; pass one to :func:`k3lab.infer.generate`).

    prompt_tokens / computed_tokens / cached_tokens: prompt tokens in all, run through the model, served
    by the prefix cache. new_tokens: tokens generated. prefill_s / decode_s: wall seconds (device
    synchronised). forwards: decode forwards of the main model (verify forwards under speculation).
    drafted / accepted: MTP draft tokens proposed / accepted. mtp_forwards: forwards of the MTP head.
    builds / captures / capture_s: the static/graphed decoder's buffer sets allocated, CUDA graphs captured and
    seconds of warm-up and capture during the call (0 when it replayed what an earlier call made).
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
    builds: int = 0
    captures: int = 0
    capture_s: float = 0.0
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


def check_int(name: str, value, low: int) -> int:
    """``value`` as an int, or ValueError ``"{name}={value!r}: must be an integer >= {low}"``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}={value!r}: must be an integer >= {low}")
    return int(value)


def check_prompt_context(rows: list[list[int]], config, allow_longer: bool, names=None) -> None:
    """Refuse a prompt longer than ``config.max_position_embeddings`` (the trained context) unless ``allow_longer``:
    ValueError ``"{name}: {n} tokens > max_position_embeddings={limit} ..."``, ``name`` = ``names[i]`` (default
    ``prompts[i]``), before anything is computed or allocated."""
    if not isinstance(allow_longer, bool):
        raise ValueError(f"allow_longer={allow_longer!r}: must be True or False")
    limit = getattr(config, "max_position_embeddings", None)
    if allow_longer or limit is None:
        return
    for i, row in enumerate(rows):
        if len(row) > limit:
            name = f"prompts[{i}]" if names is None else names[i]
            raise ValueError(f"{name}: {len(row)} tokens > max_position_embeddings={limit} (the trained "
                             f"context); pass allow_longer=True to run past it")


def mtp_step(mtp, next_embeddings: Tensor, residual: Tensor, cache=None):
    """:meth:`k3lab.model.MTPHead.forward` with its MLA layer's cache, for drafting::

        h' = eh_proj[ enorm(Emb(x_{t+1})) ; hnorm(h_t) ] -> block (cache) -> out;  hidden = norm(out)

    next_embeddings, residual: [B, T', D]. Returns ``(hidden [B, T', D], out [B, T', D], new cache)``;
    ``hidden`` equals ``mtp(next_embeddings, residual)`` when ``cache`` is None (tested)."""
    stream = PreNormStream(mtp.eh_proj(torch.cat([mtp.enorm(next_embeddings), mtp.hnorm(residual)], dim=-1)))
    new_cache = mtp.block(stream, cache)
    out = stream.output()
    return mtp.norm(out), out, new_cache


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
