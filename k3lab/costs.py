r"""The three costs of inference for a config: prefill FLOPs, decode FLOPs per token, cache bytes.

A model's layers are mixers of one of three kinds, each followed by its MLP (docs/k3_reference.md §1):

* ``"kda"``  KDA (§2): a fixed-size recurrent state per layer, no cache that grows with the context;
* ``"mla"``  Gated MLA (§3): caches ``kv_lora_rank + qk_rope_head_dim`` numbers (K3: 512 + 64 = 576)
  per token per layer;
* ``"gqa"``  standard grouped-query attention (counterfactual only; not in K3): ``H`` query heads of
  ``head_dim``, ``G`` shared key/value heads; caches ``2 G head_dim`` numbers per token per layer.

Three architectures from the same config (:data:`ARCHS`):

* ``"k3"``       the config's own schedule (K3: 69 KDA + 24 MLA layers, ``full_attn_layers``);
* ``"all_mla"``  every layer Gated MLA (the config with ``full_attn_layers = [1..L]``);
* ``"all_gqa"``  every layer GQA with ``num_attention_heads`` query heads (``gqa_kv_heads`` ×
  ``gqa_head_dim`` for keys and values, default 8 × 128 as in typical dense models), no output gate.
  MLPs, norms and the LM head stay as in the config.

Counting rules (batch 1, one sequence; FLOPs = 2 × multiply-accumulates):

* **Linear layers**: ``2 P`` FLOPs per token, with ``P`` the active parameters of
  :meth:`ModelConfig.param_counts` (LM head counted, input embedding not: a table lookup; top-k of
  the routed experts). Its few element-wise weights (norms, AttnRes queries, ``dt_bias``) are counted
  the same way: < 0.01 % of ``P`` at K3 size. For GQA layers ``P_gqa = 2 D H d + 2 D G d``
  (q, o and k, v projections).
* **Token mixing**, the work that is not a weight multiply, with ``N`` the context length:

  - KDA, per token per head, recurrent form (§2.2): decay ``Diag(α) S`` (K·V multiplies), read
    ``kᵀS`` (K·V MACs), rank-1 write (K·V MACs), read ``qᵀS`` (K·V MACs):
    ``F_kda = 7 H K V`` per token per layer, the same at every position. Prefill counts the same work
    per token; the chunkwise kernel (§2.3) does a constant factor more per token (C×C in-chunk
    blocks), still linear in N.
  - MLA prefill, expanded form (decompress ``kv_b_proj`` once per token, then attention over heads of
    ``d_qk = nope + rope`` and ``d_v``): each causal (query, key) pair costs ``2 H (d_qk + d_v)``,
    and there are ``N(N+1)/2`` pairs: ``F = H (d_qk + d_v) N (N+1)``.
  - MLA decode at context N, absorbed form (§3: ``W^{UK}`` folded into the query, ``W^{UV}`` after
    the value sum; these two multiplies cost exactly ``kv_b_proj``'s parameters, already in ``2 P``):
    MQA over a ``(r + ρ)``-dim key and an ``r``-dim value, ``r = kv_lora_rank``, ``ρ = qk_rope_head_dim``:
    ``F = 2 H (2 r + ρ) N``.
  - GQA: pairs cost ``2 H (d + d)``; prefill ``F = 2 H d N (N+1)``, decode ``F = 4 H d N``.
  - Softmax, norms, gates and activations (O(N H) or O(D) element-wise) are not counted.

  "Decode at context N" is the token at position N: it attends to N keys (the N-1 cached and its
  own), so for KDA and GQA ``prefill_flops(N) = Σ_{t=1..N} decode_flops(t)`` exactly.

* **Cache bytes** after N tokens (decode state, batch 1):

  - KDA layer: recurrent state ``H K V`` in fp32 (``state_bytes = 4``; K3: 96·128·128·4 = 6 MiB) plus
    the three short-conv tails ``3 H K (W-1)`` in the activation dtype (``kv_bytes``), fixed in N;
  - MLA layer: ``N (r + ρ)`` numbers in bf16 (``kv_bytes = 2``; K3: 576 · 2 = 1152 B per token);
  - GQA layer: ``N · 2 G d`` numbers in bf16 (8 × 128: 4096 B per token).

MTP heads are not counted (a training-time / drafting module).
"""

import numbers
from dataclasses import dataclass

from k3lab.config import ModelConfig

ARCHS = ("k3", "all_mla", "all_gqa")


@dataclass(frozen=True)
class InferenceCosts:
    """The three costs of inference of one architecture built from ``cfg`` (see the module docstring).

    cfg: the model config; arch: one of :data:`ARCHS`; gqa_kv_heads / gqa_head_dim: the KV heads and
    head dim of the ``"all_gqa"`` counterfactual; kv_bytes: bytes per cached key/value/latent number
    and per conv-tail number (bf16 = 2); state_bytes: bytes per KDA state number (fp32 = 4).
    """

    cfg: ModelConfig
    arch: str = "k3"
    gqa_kv_heads: int = 8
    gqa_head_dim: int = 128
    kv_bytes: int = 2
    state_bytes: int = 4

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r}: allowed values are {ARCHS}")
        for name in ("gqa_kv_heads", "gqa_head_dim", "kv_bytes", "state_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if self.arch == "all_gqa" and self.cfg.num_attention_heads % self.gqa_kv_heads:
            raise ValueError(f"gqa_kv_heads={self.gqa_kv_heads}: must divide num_attention_heads="
                             f"{self.cfg.num_attention_heads}")

    # --- structure ------------------------------------------------------------------------------
    def layer_kinds(self) -> list[str]:
        """Mixer kind of each layer, 0-based: "kda" | "mla" | "gqa"."""
        cfg = self.cfg
        if self.arch == "all_gqa":
            return ["gqa"] * cfg.num_hidden_layers
        if self.arch == "all_mla":
            return ["mla"] * cfg.num_hidden_layers
        return ["mla" if cfg.is_mla_layer(i) else "kda" for i in range(cfg.num_hidden_layers)]

    def gqa_layer_params(self) -> int:
        """``P_gqa = D·H d (q) + 2·D·G d (k, v) + H d·D (o)``: weights of one GQA layer."""
        D, H, G, d = self.cfg.hidden_size, self.cfg.num_attention_heads, self.gqa_kv_heads, self.gqa_head_dim
        return 2 * D * H * d + 2 * D * G * d

    def active_params(self) -> int:
        """``P``: parameters a token multiplies with (ModelConfig.param_counts' "active")."""
        cfg = self.cfg
        if self.arch == "all_mla":
            cfg = cfg.replace(full_attn_layers=list(range(1, cfg.num_hidden_layers + 1)))
        counts = cfg.param_counts()
        if self.arch != "all_gqa":
            return counts["active"]
        by = counts["by_component"]
        mixers = by["kda"]["active"] + by["mla"]["active"]
        return counts["active"] - mixers + cfg.num_hidden_layers * self.gqa_layer_params()

    # --- token mixing per layer -------------------------------------------------------------------
    def _kda_flops_per_token(self) -> int:
        """``7 H K V``: decay, kᵀS, rank-1 write, qᵀS over one head's K×V state."""
        return 7 * self.cfg.kda_heads * self.cfg.kda_head_dim * self.cfg.kda_head_dim

    def _pair_flops(self, kind: str, absorbed: bool) -> int:
        """FLOPs of one (query, key) pair summed over heads: score plus value accumulation."""
        cfg = self.cfg
        H = cfg.num_attention_heads
        if kind == "gqa":
            return 2 * H * 2 * self.gqa_head_dim
        if absorbed:  # MQA over [c_kv ; k_rope] (r + ρ) keys and c_kv (r) values
            return 2 * H * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        return 2 * H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)

    # --- the three costs -----------------------------------------------------------------------------
    def prefill_flops(self, n_tokens: int) -> int:
        r"""FLOPs to process a prompt of N tokens (causal): ``2 P N + Σ_layers F_mix(N)``.

        ``F_mix``: KDA ``7 H K V · N``; MLA (expanded) ``2 H (d_qk + d_v) · N(N+1)/2``;
        GQA ``2 H · 2 d · N(N+1)/2``.
        """
        N = _check_tokens("n_tokens", n_tokens)
        pairs = N * (N + 1) // 2
        mix = sum(self._kda_flops_per_token() * N if kind == "kda" else self._pair_flops(kind, absorbed=False) * pairs
                  for kind in self.layer_kinds())
        return 2 * self.active_params() * N + mix

    def training_flops(self, n_tokens: int, seq_len: int) -> int:
        r"""FLOPs to train on ``n_tokens`` tokens in sequences of ``seq_len``: forward + backward = 3 × forward,
        ``C = 3 · (n_tokens / T) · prefill_flops(T) = 6 P D + 3 (D / T) Σ_layers F_mix(T)`` — Kaplan's ``6 N D`` with
        the LM head in ``P`` and the token mixing (MLA's causal pairs, KDA's ``7 H K V`` a token) added, the same rule
        for every architecture (the scaling-law harness, ``k3lab.experiments.scaling``)."""
        T = _check_tokens("seq_len", seq_len)
        D = _check_tokens("n_tokens", n_tokens)
        return 3 * D * self.prefill_flops(T) // T

    def decode_flops(self, context: int) -> int:
        r"""FLOPs to generate the token at position N (attending to N keys): ``2 P + Σ_layers F_mix(N)``.

        ``F_mix``: KDA ``7 H K V`` (constant); MLA (absorbed) ``2 H (2 r + ρ) · N``; GQA ``2 H · 2 d · N``.
        """
        N = _check_tokens("context", context)
        mix = sum(self._kda_flops_per_token() if kind == "kda" else self._pair_flops(kind, absorbed=True) * N
                  for kind in self.layer_kinds())
        return 2 * self.active_params() + mix

    def cache_bytes_per_token(self) -> int:
        """Bytes the cache grows by per token: MLA ``(r + ρ)·kv_bytes``, GQA ``2 G d·kv_bytes`` per layer."""
        cfg = self.cfg
        per_layer = {"kda": 0, "mla": (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * self.kv_bytes,
                     "gqa": 2 * self.gqa_kv_heads * self.gqa_head_dim * self.kv_bytes}
        return sum(per_layer[kind] for kind in self.layer_kinds())

    def cache_fixed_bytes(self) -> int:
        """Bytes that do not grow with N: per KDA layer ``H K V·state_bytes + 3 H K (W-1)·kv_bytes``."""
        cfg = self.cfg
        H, K, W = cfg.kda_heads, cfg.kda_head_dim, cfg.linear_attn_config["short_conv_kernel_size"]
        kda_layer = H * K * K * self.state_bytes + 3 * H * K * (W - 1) * self.kv_bytes
        return kda_layer * self.layer_kinds().count("kda")

    def cache_bytes(self, context: int) -> int:
        """Decode cache after N tokens: ``fixed + N · per_token``."""
        return self.cache_fixed_bytes() + _check_tokens("context", context) * self.cache_bytes_per_token()


def _check_tokens(name: str, n) -> int:
    """A token count as a Python int (numpy integers accepted: the FLOP counts stay exact)."""
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name}={n!r}: must be an integer >= 1")
    return int(n)


def cost_table(cfg: ModelConfig, contexts, archs=ARCHS, **kw) -> list[dict]:
    """One row per (arch, N): prefill FLOPs, decode FLOPs per token and cache bytes at N.

    ``kw`` goes to :class:`InferenceCosts` (gqa_kv_heads, gqa_head_dim, kv_bytes, state_bytes).
    """
    rows = []
    for arch in archs:
        costs = InferenceCosts(cfg, arch, **kw)
        for N in contexts:
            rows.append(dict(arch=arch, context=N, prefill_flops=costs.prefill_flops(N),
                             decode_flops=costs.decode_flops(N), cache_bytes=costs.cache_bytes(N),
                             cache_bytes_per_token=costs.cache_bytes(N) / N))
    return rows
