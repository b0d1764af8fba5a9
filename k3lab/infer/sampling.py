r"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), and the checks of
those arguments (one place, so `generate`, the streaming form and speculative decoding agree).

With logits ``z [V]`` and temperature ``τ > 0``::

    p_i ∝ exp(z_i / τ)                              softmax at temperature τ
    top-k:  p_i = 0 unless z_i is among the k largest (ties at the k-th value kept)
    top-p:  keep the smallest prefix of tokens sorted by p (descending) whose mass reaches p_top
            (the most likely token always stays), renormalise

``τ = 0`` is greedy: ``argmax_i z_i`` (top-k and top-p do not change the argmax).

The division is done in float32 as ``(z − max z) / τ``: every term is ``<= 0`` so a tiny ``τ`` gives
``0`` for the largest logit(s) and a large negative number or ``−inf`` for the rest — finite
probabilities (the distribution concentrates on the argmax) where ``z / τ`` would overflow to ``inf``
and softmax give NaN. ``τ`` must itself be a float32 normal number: ``0 < τ < 1.2e-38``
(``torch.finfo(torch.float32).tiny``) is refused, naming ``temperature``.

**Seeded draws on the device** (:func:`sample_seeded`, used by the static/graphed decoder): the
Gumbel-max trick ``argmax_i (log p_i + G_i)``, ``G_i = −log(−log u_i)``, draws exactly from ``p``. The
uniforms come from a counter-based hash of (row seed, step, token id) rather than a stateful generator,
so a row's draws depend on its own seed and step only: the same on CPU and CUDA, inside a CUDA graph
and out of it, alone or in any batch.
"""

from __future__ import annotations

import math
import numbers

import torch

Tensor = torch.Tensor


MIN_TEMPERATURE = torch.finfo(torch.float32).tiny  # the smallest positive temperature: float32's smallest normal


def check_sampling(temperature, top_k, top_p) -> None:
    """Raise ValueError naming the argument: temperature 0 (greedy) or a finite number >= MIN_TEMPERATURE
    (1.2e-38), top_k None or an int >= 1, top_p None or a number in (0, 1]."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) \
            or temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature={temperature!r}: must be 0 (greedy) or a finite number >= "
                         f"{MIN_TEMPERATURE:.2g} (the smallest normal float32)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k={top_k!r}: must be None or an integer >= 1")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p={top_p!r}: must be None or a number in (0, 1]")


def next_token_probs(logits: Tensor, temperature: float, top_k: int | None = None,
                     top_p: float | None = None) -> Tensor:
    """logits [..., V] -> the sampling distribution [..., V] float32 (temperature > 0; see the module docstring)."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("temperature=0: greedy decoding has no distribution; use argmax")
    z = logits.float()
    z = (z - z.amax(dim=-1, keepdim=True)) / temperature  # <= 0: finite however small the temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = z.softmax(dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked above each
        keep_sorted = before < top_p  # the first token always (before = 0)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_next(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """logits [B, V] -> next token ids [B]: greedy at temperature 0, else a draw from
    :func:`next_token_probs` (``generator`` on the logits' device, or None)."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = next_token_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


MASK32 = 0xFFFFFFFF
HASH_MULTIPLIERS = (0x7FEB352D, 0x5BD1E995)  # odd, < 2^31: a product with a 32-bit value fits int64 exactly


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 tensors holding values in [0, 2^32)."""
    x = x & MASK32
    for m in HASH_MULTIPLIERS:
        x = ((x ^ (x >> 16)) * m) & MASK32
    return x ^ (x >> 16)


def counter_uniform(seeds: Tensor, step: Tensor, vocab: int) -> Tensor:
    """Uniforms in (0, 1) [B, V] float32 from ``hash(hash(hash(seed_b) ^ step) ^ i)``; seeds [B] int64,
    step: an int64 tensor broadcasting to [B] (the row's token index). 24 random bits each."""
    row = mix32(mix32(seeds.long()) ^ (step.long() & MASK32))  # [B]
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.long)  # [V]
    bits = mix32(row[:, None] ^ ids[None, :]) >> 8  # [B, V] in [0, 2^24)
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def sample_seeded(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, seeds: Tensor,
                  step: Tensor) -> Tensor:
    """logits [B, V] -> next token ids [B]: greedy at temperature 0, else the Gumbel-max draw from
    :func:`next_token_probs` with :func:`counter_uniform` noise (module docstring). No host sync."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = next_token_probs(logits, temperature, top_k, top_p)  # [B, V]
    gumbel = -torch.log(-torch.log(counter_uniform(seeds, step, probs.shape[-1])))
    return (probs.log() + gumbel).argmax(dim=-1)
