r"""Speculative decoding with the MTP head: draft ``k`` tokens, verify them in one forward of the main
model, and roll the KDA state back to the last accepted token (docs/k3_reference.md §10).

**Draft.** The MTP head (:class:`k3lab.model.MTPHead`, depth 1) reads the main model's final
residual ``h_t`` and the embedding of ``x_{t+1}`` and predicts ``x_{t+2}``. At the pending token
``x_n`` (known, not yet fed) it drafts ``d_1`` from ``(h_{n-1}, x_n)``; for ``d_2 … d_k`` it reads its
own output (before its final norm) in place of ``h`` — an approximation, so deeper drafts are accepted
less often. The head is one MLA layer with its own latent cache over the context (prefilled with the
prompt); the entries made while chaining are thrown away after each step.

**Verify.** One forward of ``[x_n, d_1, …, d_k]`` on the cache gives the main model's logits
``p_0 … p_k`` at those positions. Greedy (``temperature=0``): accept the longest prefix with
``d_i = argmax p_{i-1}``, then add ``argmax p_j`` (the correction, or a bonus token when all ``k``
match), so every step yields ``j + 1 ≥ 1`` tokens, and they are exactly greedy decoding's tokens.
Sampling: accept ``d_i`` with probability ``min(1, p(d_i)/q(d_i))`` (``q``: the draft's distribution);
at the first rejection draw from ``norm(max(p − q, 0))``; the output follows the main model's
distribution exactly (Leviathan et al. 2023, Chen et al. 2023).

**Rollback.** After the verify forward the cache has taken in all ``k + 1`` tokens; only ``j + 1``
may stay. The MLA latents are cut to the accepted length. A KDA state cannot be cut: it has
folded every token in. Two correct schemes:

* *keep per-step states* (the static / graphed decoder, :meth:`k3lab.infer.static.StaticDecoder.speculate`):
  the verify runs the ``k + 1`` tokens through each KDA layer's recurrence one token at a time (the
  one-token decode step: our Triton kernel on CUDA, the torch recurrence on CPU), writing the state
  after every token (``(k+1)·H·K·V`` floats a layer, :class:`k3lab.mixers.kda.StaticKDAStepCache`) and
  the conv window ``[tail ; k+1 projected inputs]``; the step then keeps, per row b, state ``j_b`` and
  the window rows after token ``j_b`` (a gather on the device). One forward, no replay, no host read:
  what a CUDA graph needs. The MLA latents stay in their slots; the per-row length is set to the
  accepted one and the key mask cleared beyond it;
* *replay from the saved state* (this module, the eager decoder; as K3 does in serving): the cache before
  the verify is kept — free, because caches are functional (:mod:`k3lab.infer.cache`) — together with
  each KDA layer's input to the verify forward; on a rejection each KDA layer re-runs its first ``j + 1``
  inputs from the saved state (state and conv tails). Only the KDA mixers run again, not the MLA
  layers, MoE or head; when all drafts are accepted nothing is replayed. K3 goes one step further
  and caches the projected inputs ``q, k, v, g, β`` to replay in a fused kernel; we recompute the
  projections of the saved layer input.

This module decodes one row at a time with any sampling rule; the static decoder decodes a batch (rows
accept different numbers of drafts: per-row lengths) greedily, with :func:`accept_greedy_rows` on the
device, and gives the same tokens and the same drafted / accepted counts as this module.
"""

from __future__ import annotations

import time

import torch

from k3lab.backend import synchronize
from k3lab.infer import cache as hcache
from k3lab.infer.sampling import check_sampling, next_token_probs, sample_next
from k3lab.infer.step import GenerationStats, Prefilled, check_int, mtp_step  # noqa: F401  (mtp_step: also here)
from k3lab.mixers.kda import KDA
from k3lab.model import K3Cache

Tensor = torch.Tensor


class record_kda_inputs:
    """Within ``with record_kda_inputs(model) as rec:``, every KDA layer's forward records its input
    ``(x, cache)`` in ``rec.inputs[layer index]`` (forward hooks, removed on exit)."""

    def __init__(self, model):
        self.kda = {i: layer.self_attn for i, layer in enumerate(model.model.layers) if isinstance(layer.self_attn, KDA)}
        self.inputs: dict = {}
        self._handles = []

    def __enter__(self):
        def hook(i):
            def record(module, args, kwargs, output):
                x = args[0] if args else kwargs["x"]
                cache = args[1] if len(args) > 1 else kwargs.get("cache")
                self.inputs[i] = (x, cache)
            return record

        self._handles = [m.register_forward_hook(hook(i), with_kwargs=True) for i, m in self.kda.items()]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []


def rollback(model, before: K3Cache, after: K3Cache, kda_inputs: dict, keep: int) -> K3Cache:
    """The cache as if only the first ``keep`` of the tokens fed between ``before`` and ``after`` had
    been fed: MLA latents cut, KDA layers replayed from ``before`` over their first ``keep`` recorded
    inputs (:class:`record_kda_inputs`)."""
    if not 1 <= keep <= after.offset - before.offset:
        raise ValueError(f"keep={keep}: must be in [1, {after.offset - before.offset}] (tokens fed since the snapshot)")
    length = before.offset + keep
    cut = hcache.truncate(after, length)
    layers = list(cut.layers)
    for i, (x, saved) in kda_inputs.items():
        _, layers[i] = model.model.layers[i].self_attn(x[:, :keep], saved)  # replay: state + conv tails
    return K3Cache(layers, length)


def accept_greedy(logits: Tensor, drafts: list[int]) -> tuple[int, int]:
    """logits [k+1, V] of the verify forward, drafts (k ids) -> (accepted j, next token = argmax logits[j])."""
    best = logits.argmax(dim=-1)  # [k+1]
    j = int(accept_greedy_rows(best[None], torch.tensor(drafts, dtype=torch.long, device=best.device)[None]))
    return j, int(best[j])


def accept_greedy_rows(best: Tensor, drafts: Tensor) -> Tensor:
    """:func:`accept_greedy` for a batch on the device (no host read; the static decoder's step)::

        j_b = Σ_{i<k} Π_{i'≤i} [d_{b,i'} = best_{b,i'}]      (the longest matching prefix)

    best: [B, k+1] the verify's argmax tokens; drafts: [B, k]. Returns j [B] int64; row b emits
    ``best[b, :j_b + 1]`` (``d_1 … d_j`` and the correction or bonus token)."""
    return (drafts == best[:, :drafts.shape[1]]).long().cumprod(dim=1).sum(dim=1)  # [B]


def accept_sampled(p: Tensor, q: Tensor, drafts: list[int], generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling. p [k+1, V] target and q [k, V] draft distributions, drafts d_i ~ q_i.

    Accept d_i while ``u < p_i(d_i) / q_i(d_i)`` (u uniform); at the first rejection draw from
    ``norm(max(p_i − q_i, 0))``; after k acceptances draw from ``p_k``. Returns (accepted j, next token)."""
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[i, d] < p[i, d]:  # u < p/q without dividing by a zero q
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        if residual.sum() <= 0:  # p == q on the support: a rejection has probability 0; guard rounding
            residual = p[i]
        return i, torch.multinomial(residual / residual.sum(), 1, generator=generator).item()
    return len(drafts), torch.multinomial(p[len(drafts)], 1, generator=generator).item()


def draft_tokens(model, pend_x: Tensor, pend_h: Tensor, mtp_cache, k: int, temperature: float, top_k, top_p,
                 generator) -> tuple[list[int], Tensor | None, object]:
    """Draft k tokens after the last of ``pend_x [1, m]``: the MTP head first takes the m pending
    positions (``h`` = ``pend_h [1, m, D]``, the next tokens ``pend_x``) — real entries, kept in the
    returned cache — then chains on its own output. Returns (drafts, q [k, V] or None when greedy,
    the MTP cache after the real entries)."""
    emb = model.model.embed_tokens
    hidden, out, kept = mtp_step(model.mtp, emb(pend_x), pend_h, mtp_cache)
    drafts, probs, cache = [], [], kept
    for i in range(k):
        logits = model.lm_head(hidden[:, -1]).float()  # [1, V]
        if temperature == 0:
            d = logits.argmax(-1)
        else:
            q = next_token_probs(logits, temperature, top_k, top_p)
            probs.append(q[0])
            d = torch.multinomial(q, 1, generator=generator)[:, 0]
        drafts.append(int(d.item()))
        if i + 1 < k:
            hidden, out, cache = mtp_step(model.mtp, emb(d[:, None]), out[:, -1:], cache)
    return drafts, (torch.stack(probs) if probs else None), kept


def speculative_decode(model, pre: Prefilled, k: int, max_new_tokens: int, temperature: float = 0.0,
                       top_k: int | None = None, top_p: float | None = None, stop=frozenset(),
                       generator: torch.Generator | None = None, stats: GenerationStats | None = None):
    """Decode one row (``pre`` from ``prefill(..., mtp=True)``) with MTP drafts; yields tokens.

    ``k``: drafts a step, an integer >= 1; ``max_new_tokens`` >= 0 (ValueError naming them, checked
    before anything runs, as are the sampling arguments).

    Invariant between steps: the cache holds positions ``0..n-1``; ``x_n`` is known but not fed;
    the MTP cache holds positions ``0..n-m-1`` and ``pend_h``/``pend_x`` its next ``m`` entries.
    """
    check_int("k", k, 1)
    check_int("max_new_tokens", max_new_tokens, 0)
    check_sampling(temperature, top_k, top_p)
    if model.mtp is None:
        raise ValueError("model: has no MTP head (config.num_nextn_predict_layers=0); speculative_decode needs 1")
    if pre.logits.shape[0] != 1 or pre.mtp_cache is None and pre.lengths[0] > 1:
        raise ValueError("speculative_decode: needs one row prefilled with mtp=True")
    return _speculative_decode(model, pre, k, max_new_tokens, temperature, top_k, top_p, stop, generator, stats)


@torch.no_grad()
def _speculative_decode(model, pre, k, max_new_tokens, temperature, top_k, top_p, stop, generator, stats):
    if max_new_tokens == 0:
        return
    device = pre.logits.device
    was_training = model.training
    model.eval()
    drafted = accepted = 0
    try:
        synchronize(device)
        t0 = time.perf_counter()
        cache, mtp_cache = pre.cache, pre.mtp_cache
        x = int(sample_next(pre.logits, temperature, top_k, top_p, generator).item())
        pend_h, pend_x = pre.residual[:, None], [x]  # [1, 1, D]: h_{n-1} pairs with x_n
        emitted = 0
        new = [x]
        while True:
            for tok in new:
                emitted += 1
                if stats is not None:
                    stats.new_tokens += 1
                yield tok
                if tok in stop or emitted >= max_new_tokens:
                    return
            k_eff = min(k, max_new_tokens - emitted - 1)  # the step yields up to k_eff + 1 tokens
            ids = torch.tensor([pend_x], device=device)  # [1, m]
            if k_eff > 0:
                drafts, q, mtp_cache = draft_tokens(model, ids, pend_h, mtp_cache, k_eff, temperature, top_k, top_p,
                                                    generator)
            else:
                drafts, q = [], None
            with record_kda_inputs(model) as rec:
                step = hcache.forward(model, torch.tensor([[pend_x[-1]] + drafts], device=device), cache,
                                      last=None)
            logits = step.logits[0]  # [k_eff + 1, V]
            if temperature == 0:
                j, nxt = accept_greedy(logits, drafts)
            else:
                j, nxt = accept_sampled(next_token_probs(logits, temperature, top_k, top_p), q, drafts, generator)
            cache = step.cache if j == k_eff else rollback(model, cache, step.cache, rec.inputs, j + 1)
            new = drafts[:j] + [nxt]
            if k_eff > 0:  # the MTP cache now holds the pending entries; next come h at x_n, d_1..d_j
                pend_h, pend_x = step.residual[:, :j + 1], new
            else:
                pend_h, pend_x = torch.cat([pend_h, step.residual[:, :1]], 1), pend_x + new
            drafted, accepted = drafted + k_eff, accepted + j
            if stats is not None:
                stats.forwards += 1
                stats.drafted += k_eff
                stats.accepted += j
                stats.mtp_forwards += k_eff
    finally:
        synchronize(device)
        if stats is not None:
            stats.decode_s += time.perf_counter() - t0
            stats.per_row.append((drafted, accepted))
        model.train(was_training)
