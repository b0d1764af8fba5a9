"""The hybrid cache as the inference engine handles it: one model step, and rows of caches padded,
stacked, selected, cut and copied.

A :class:`k3lab.model.K3Cache` holds one entry per decoder layer:

* KDA layer: :class:`k3lab.mixers.kda.KDACache` — the state ``[B, H, K, V]`` and three conv tails
  ``[B, H·K, W-1]``: fixed size, one per row, nothing to align between rows;
* MLA layer: :class:`k3lab.mixers.mla.MLACache` — the latent ``c_kv [B, S, R]``, ``k_rope [B, S, ρ]``
  and an optional ``key_mask [B, S]``.

Rows whose prompts have different lengths are prefilled on their own (a recurrent state must not
see padding: a pad token would decay and overwrite the KDA state and shift the conv tails), then
stacked for batched decoding: every MLA latent is padded at its end to the longest row and the
padded slots are masked (``key_mask``); new tokens are appended after the padding, so row ``b``
holds ``[its prompt | padding | its generated tokens]``. NoPE attention does not see positions at
all; under RoPE a row's position is its count of real keys (``GatedMLA.forward``).

The caches are *functional*: a forward returns new tensors and leaves the cache it was given
untouched, so keeping a reference to a cache is a free snapshot (speculative decoding rolls back
by keeping the pre-verify cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3lab.mixers.kda import KDACache
from k3lab.mixers.mla import MLACache
from k3lab.model import K3Cache, K3ForCausalLM

Tensor = torch.Tensor


@dataclass
class Step:
    """One forward of the main model on a piece of tokens.

    logits:   [B, T', V] for the last T' positions asked for (float32)
    residual: [B, T, D] the final residual stream before ``model.norm`` (the MTP head's ``h_t``)
    cache:    the updated cache
    """

    logits: Tensor
    residual: Tensor
    cache: K3Cache


def check_model(model) -> None:
    """The engine drives :class:`k3lab.model.K3ForCausalLM` (it reads the residual for MTP and the cache layout)."""
    if not isinstance(model, K3ForCausalLM):
        raise ValueError(f"model: k3lab.infer needs a k3lab.model.K3ForCausalLM, got {type(model).__name__}")


def forward(model: K3ForCausalLM, ids: Tensor, cache: K3Cache | None, last: int | None = 1) -> Step:
    """``ids [B, T]`` through the model on top of ``cache``; logits only for the last ``last`` positions
    (None: all), so a long prompt chunk never builds ``[B, T, V]`` logits."""
    out = model.model(ids, cache)
    hidden = out.last_hidden_state if last is None else out.last_hidden_state[:, -last:]
    return Step(model.lm_head(hidden).float(), out.residual, out.cache)


def map_rows(cache: K3Cache, fn_kda, fn_mla, offset: int | None = None) -> K3Cache:
    """A new cache with ``fn_kda(KDACache)`` / ``fn_mla(MLACache)`` applied to every layer entry."""
    layers = [fn_kda(e) if isinstance(e, KDACache) else fn_mla(e) for e in cache.layers]
    return K3Cache(layers, cache.offset if offset is None else offset)


def select_rows(cache: K3Cache, rows: Tensor) -> K3Cache:
    """The cache of batch rows ``rows`` (a LongTensor of row indices), in that order."""
    def kda(e):
        return KDACache(*(t.index_select(0, rows) for t in (e.recurrent, e.conv_q, e.conv_k, e.conv_v)))

    def mla(e):
        mask = None if e.key_mask is None else e.key_mask.index_select(0, rows)
        return MLACache(e.c_kv.index_select(0, rows), e.k_rope.index_select(0, rows), mask)

    return map_rows(cache, kda, mla)


def truncate(cache: K3Cache, length: int) -> K3Cache:
    """Keep the first ``length`` cache slots of every MLA layer (KDA entries untouched); offset = length."""
    if not 0 <= length <= cache.offset:
        raise ValueError(f"length={length}: must be in [0, cache offset={cache.offset}]")

    def mla(e):
        mask = None if e.key_mask is None else e.key_mask[:, :length]
        return MLACache(e.c_kv[:, :length], e.k_rope[:, :length], mask)

    return map_rows(cache, lambda e: e, mla, offset=length)


def clone(cache: K3Cache, device: torch.device | str | None = None) -> K3Cache:
    """A deep copy owning its memory (a slice or view of a larger tensor would keep all of it alive),
    optionally on another device."""
    def copy(t):
        return None if t is None else (t.to(device, copy=True) if device is not None else t.clone())

    return map_rows(cache, lambda e: KDACache(*(copy(t) for t in (e.recurrent, e.conv_q, e.conv_k, e.conv_v))),
                    lambda e: MLACache(copy(e.c_kv), copy(e.k_rope), copy(e.key_mask)))


def compact(cache: K3Cache) -> K3Cache:
    """The same cache with every KDA conv tail in its own memory: a tail is a slice of the last
    ``[B, D, W-1+T]`` conv window of a prefill chunk and would keep the whole window alive."""
    return map_rows(cache, lambda e: KDACache(e.recurrent, *(t.contiguous() for t in (e.conv_q, e.conv_k, e.conv_v))),
                    lambda e: e)


def stack(caches: list[K3Cache]) -> K3Cache:
    """Rows of several caches in one batch (their rows in order). MLA latents of different lengths are
    padded at the end to the longest and the padding masked (module docstring); equal lengths and no
    masks give no mask."""
    if not caches:
        raise ValueError("caches: need at least one cache to stack")
    if len({len(c.layers) for c in caches}) != 1:
        raise ValueError("caches: all must come from one model (different numbers of layers)")
    if len(caches) == 1:
        return caches[0]
    S = max(c.offset for c in caches)
    masked = any(c.offset != S for c in caches) or any(
        isinstance(e, MLACache) and e.key_mask is not None for c in caches for e in c.layers)
    layers = []
    for i, first in enumerate(caches[0].layers):
        entries = [c.layers[i] for c in caches]
        if isinstance(first, KDACache):
            layers.append(KDACache(*(torch.cat([getattr(e, f) for e in entries], 0)
                                     for f in ("recurrent", "conv_q", "conv_k", "conv_v"))))
            continue
        c_kv = torch.cat([F.pad(e.c_kv, (0, 0, 0, S - e.c_kv.shape[1])) for e in entries], 0)  # [B, S, R]
        k_rope = torch.cat([F.pad(e.k_rope, (0, 0, 0, S - e.k_rope.shape[1])) for e in entries], 0)
        mask = None
        if masked:
            rows = []
            for e in entries:
                B, n = e.c_kv.shape[:2]
                m = e.key_mask if e.key_mask is not None else torch.ones(B, n, dtype=torch.bool, device=e.c_kv.device)
                rows.append(F.pad(m, (0, S - n), value=False))
            mask = torch.cat(rows, 0)  # [B, S]
        layers.append(MLACache(c_kv, k_rope, mask))
    return K3Cache(layers, S)


def rows(cache: K3Cache) -> int:
    """Batch rows of a cache."""
    first = cache.layers[0]
    return (first.recurrent if isinstance(first, KDACache) else first.c_kv).shape[0]
