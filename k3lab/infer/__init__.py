"""Inference with the hybrid cache (docs/inference.md).

* :mod:`k3lab.infer.generate` — :func:`generate` / :func:`stream`: a batch of prompts of any lengths,
  chunked prefill, batched decoding, sampling (temperature, top-k, top-p, stop, EOS);
* :mod:`k3lab.infer.step` — what the decoding paths share: :func:`prefill_rows`, the MTP step,
  :class:`Prefilled`, :class:`GenerationStats` (imports run one way: step <- prefix, speculative <- generate);
* :mod:`k3lab.infer.static` — :class:`StaticDecoder`: preallocated caches of a fixed capacity, tokens chosen on
  the device, one CUDA graph replay a step, captured once per batch bucket (``generate(decoder="graph")``, what
  the default ``decoder="auto"`` runs on CUDA);
* :mod:`k3lab.infer.prefix` — :class:`PrefixCache`: KDA states and MLA pages per prompt block, LRU,
  host tier;
* :mod:`k3lab.infer.speculative` — MTP drafts, one verify forward, KDA state rollback by replay (the
  static/graphed decoder keeps per-step states instead, :mod:`k3lab.infer.static`);
* :mod:`k3lab.infer.sampling`, :mod:`k3lab.infer.cache` — the next-token rule, cache rows;
* :mod:`k3lab.infer.measure` — the three costs of inference measured, per-token losses.
"""

from k3lab.infer.generate import decode, generate, prefill, stream
from k3lab.infer.measure import measure_inference, token_losses
from k3lab.infer.prefix import PrefixCache
from k3lab.infer.sampling import check_sampling, next_token_probs, sample_next
from k3lab.infer.speculative import speculative_decode
from k3lab.infer.static import DECODERS, StaticDecoder
from k3lab.infer.step import DEFAULT_CHUNK_TOKENS, GenerationStats, Prefilled, prefill_rows

__all__ = ["DECODERS", "DEFAULT_CHUNK_TOKENS", "StaticDecoder", "GenerationStats", "Prefilled", "PrefixCache", "check_sampling", "decode",
           "generate", "measure_inference", "next_token_probs", "prefill", "prefill_rows", "sample_next",
           "speculative_decode", "stream", "token_losses"]
