"""The three costs of inference measured on a model, and per-token losses for long-context curves.

The cache a K3 model carries between calls is fixed-size for KDA layers (a [H, K, V] state and
three short-conv tails) and grows by kv_lora_rank + qk_rope_head_dim numbers a token per MLA
layer (the absorbed-form latent). A decode step costs O(1) in KDA and O(context) in MLA
(docs/k3_reference.md §2, §3; the predicted costs: k3lab.costs).
"""

from __future__ import annotations

import time

import torch

from k3lab.backend import synchronize

Tensor = torch.Tensor


@torch.no_grad()
def measure_inference(model, context: int, decode_tokens: int = 16, batch_size: int = 1, seed: int = 0) -> dict:
    """The three costs of inference, measured: prefill seconds for `context` random tokens, mean
    seconds per decoded token for the next `decode_tokens` (greedy, with the cache), and the bytes
    the cache holds after the prefill (``cache.nbytes()``).

    Returns dict(context, prefill_s, decode_s_per_token, cache_bytes).
    """
    if context < 1 or decode_tokens < 1:
        raise ValueError(f"context={context} and decode_tokens={decode_tokens}: both must be >= 1")
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, context), generator=g).to(device)
    model.eval()
    synchronize(device)
    t0 = time.perf_counter()
    out = model(ids)
    synchronize(device)
    prefill_s = time.perf_counter() - t0
    cache_bytes = out.cache.nbytes()
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        out = model(out.logits[:, -1:].argmax(-1), cache=out.cache)
    synchronize(device)
    decode_s = (time.perf_counter() - t0) / decode_tokens
    return dict(context=context, prefill_s=prefill_s, decode_s_per_token=decode_s, cache_bytes=cache_bytes)


@torch.no_grad()
def token_losses(model, input_ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token cross-entropy and greedy correctness, for per-position curves beyond a training length.

    input_ids, labels: [B, T] (pre-aligned, -100 = no label). Returns (ce [B, T] float32 with NaN where
    the label is -100, correct [B, T] bool, False there), on the CPU. One forward pass, eval mode.
    """
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids).logits.float()  # [B, T, vocab]
    finally:
        model.train(was_training)
    valid = labels != -100
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")
    correct = (logits.argmax(-1) == labels) & valid
    return ce.masked_fill(~valid, float("nan")).cpu(), correct.cpu()
