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

**Seeded draws on the device** (:func:`sample_seeded`, used by the static/graphed decoder): one uniform
``u`` per row, 52 random bits in float64 (never 0, never 1), from a counter-based hash of (row seed, step)
rather than a stateful generator, so a row's draws depend on its own seed and step only: the same inside
a CUDA graph and out of it, alone or in any batch (and on CPU and CUDA up to the rounding of a sum).
The token is the inverse CDF at ``u``: the first ``i`` with ``c_i > u · c_V``, ``c = cumsum(p)`` in float64
over the distribution of :func:`next_token_probs` (the eager sampler's, exactly). A token outside top-k /
top-p has ``p_i = 0``, so ``c_i = c_{i-1}`` and it is never the first to exceed anything: no draw can land
on it, whatever ``u`` (the threshold is kept below ``c_V``). ``top_k=1`` is the argmax, as greedy.

(Before: Gumbel-max on ``log p`` with 24-bit float32 uniforms. ``(2^24 − 0.5) / 2^24`` rounds to 1.0 in
float32, the noise ``−log(−log 1) = +inf`` and ``−inf + inf = NaN``, which argmax takes: about
``n·(V − k) / 2^24`` of ``n`` draws fell outside top-k — 1% at K3's vocabulary.)
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
LANE_KEYS = (0x243F6A88, 0x85A308D3)  # pi's digits: two hash lanes of 32 bits, 52 of them kept
UNIFORM_BITS = 52  # float64 holds (bits + 0.5) / 2^52 exactly: (0, 1) with both ends excluded


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 tensors holding values in [0, 2^32)."""
    x = x & MASK32
    for m in HASH_MULTIPLIERS:
        x = ((x ^ (x >> 16)) * m) & MASK32
    return x ^ (x >> 16)


def counter_bits(seeds: Tensor, step: Tensor, ids: Tensor | None = None) -> Tensor:
    """``UNIFORM_BITS`` hashed bits (int64) of (seed, step[, id]), shaped like the broadcast of the int64 tensors
    ``seeds``, ``step`` (and ``ids``). Two lanes ``j`` of ``mix32(mix32(mix32(s ^ key_j) ^ step) ^ id)``, ``s`` the
    seed folded to 32 bits: for one seed and step they differ (other keys), so the 52 bits come from 64 hashed
    ones, not from one 32-bit hash stretched. A handful of kernels on [B] (or [B, V]) tensors: cheap in a graph.
    Every product stays below 2^63 (no int64 wrap)."""
    seeds = seeds.long()
    k0, k1 = LANE_KEYS  # [2] made on the device by a kernel: no host-to-device copy inside a graph capture
    keys = torch.arange(2, dtype=torch.long, device=seeds.device) * (k1 - k0) + k0
    x = mix32((seeds ^ (seeds >> 32))[..., None] ^ keys)  # [..., 2]
    x = mix32(x ^ (step.long() & MASK32)[..., None])
    if ids is not None:
        x = mix32(x ^ ids.long()[..., None])
    return (x[..., 0] << (UNIFORM_BITS - 32)) | (x[..., 1] >> (64 - UNIFORM_BITS))  # [...] in [0, 2^52)


def bits_to_uniform(bits: Tensor) -> Tensor:
    """52-bit integers -> float64 in (0, 1): ``(bits + 0.5) / 2^52``, exact; the smallest 2^-53, the largest
    1 − 2^-53."""
    return (bits.double() + 0.5) * (0.5 ** UNIFORM_BITS)


def counter_uniform(seeds: Tensor, step: Tensor, vocab: int) -> Tensor:
    """Uniforms in (0, 1) [B, V] float64 from :func:`counter_bits` of (seed_b, step, i); seeds [B] int64,
    step: an int64 tensor broadcasting to [B] (the row's token index). 52 random bits each."""
    seeds, step = torch.broadcast_tensors(seeds.long().reshape(-1), step.long().reshape(-1))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.long)  # [V]
    return bits_to_uniform(counter_bits(seeds[:, None], step[:, None], ids[None, :]))


def next_token_probs_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """:func:`next_token_probs` with the sampling parameters as device tensors, one value per row (what a captured
    decode step reads, so one CUDA graph serves every temperature / top-k / top-p):

    logits [B, V]; temperature [B] float32 > 0; top_k [B] int64 in [1, V] (V: off); top_p [B] float32 in (0, 1]
    (1: off). Returns [B, V] float32, row b equal to ``next_token_probs(logits[b:b+1], τ_b, k_b, p_b)`` bit for bit
    on CPU (tested; the same float32 division and comparisons as with Python numbers). On CUDA a Python-number
    temperature is applied as a multiplication by its reciprocal, a tensor one as a division: the two may differ
    in the last bit there. The k-th largest value comes from a sort (``topk`` needs a Python ``k``): the same
    value, ties at it kept as with ``topk``. No host read; the shapes do not depend on the values."""
    z = logits.float()
    V = z.shape[-1]
    z = (z - z.amax(dim=-1, keepdim=True)) / temperature[:, None]  # [B, V] <= 0
    kth = z.sort(dim=-1, descending=True).values.gather(-1, (top_k.clamp(1, V) - 1)[:, None])  # [B, 1]
    z = z.masked_fill(z < kth, float("-inf"))  # top_k = V: kth = the smallest, nothing masked
    probs = z.softmax(dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked above each
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < top_p[:, None])
    nucleus = probs * keep
    nucleus = nucleus / nucleus.sum(dim=-1, keepdim=True)
    return torch.where((top_p < 1.0)[:, None], nucleus, probs)  # top_p = 1: untouched, as next_token_probs


def sample_seeded(logits: Tensor, temperature: float | Tensor, top_k: int | None | Tensor,
                  top_p: float | None | Tensor, seeds: Tensor, step: Tensor) -> Tensor:
    """logits [B, V] -> next token ids [B]: greedy at temperature 0 or ``top_k=1``, else the inverse-CDF draw
    from :func:`next_token_probs` at one 52-bit uniform per row (module docstring). No host sync; the shapes do
    not depend on the values (CUDA graphs). ``seeds`` [B] int64 and ``step`` (broadcasting to [B]): the row's
    seed and token index. ``logits`` [1, V] with N seeds or steps: N draws from that one distribution.
    ``temperature`` a tensor: the three parameters are per-row device tensors (:func:`next_token_probs_rows`,
    every row sampled — the caller picks greedy before), ``logits`` [B, V] with one row per draw."""
    n = torch.broadcast_shapes(seeds.reshape(-1).shape, step.reshape(-1).shape, logits.shape[:1])[0]
    if isinstance(temperature, Tensor):
        probs = next_token_probs_rows(logits, temperature, top_k, top_p)
    elif temperature == 0 or top_k == 1:
        tok = logits.argmax(dim=-1)  # top_k=1: the largest logit, as greedy (ties: the first, as argmax)
        return tok if tok.shape[0] == n else tok.expand(n)
    else:
        probs = next_token_probs(logits, temperature, top_k, top_p)  # [B, V] float32, 0 outside top-k/top-p
    cdf = probs.double().cumsum(dim=-1)  # [B, V] non-decreasing, flat across every excluded token
    total = cdf[:, -1:]  # [B, 1] > 0 (the largest logit's token is always kept)
    u = bits_to_uniform(counter_bits(*torch.broadcast_tensors(seeds.reshape(-1), step.reshape(-1))))  # [n]
    target = torch.minimum(u.reshape(cdf.shape[0], -1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).reshape(-1)  # the first c_i > target: p_i > 0, i < V
