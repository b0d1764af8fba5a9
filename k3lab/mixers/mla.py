"""Gated Multi-head Latent Attention, K3's global-attention layer (docs/k3_reference.md §3).

DeepSeek-V2 MLA with NO positional encoding (NoPE) and a full-rank sigmoid output gate::

    c^Q   = RMSNorm(W^DQ x)                                   q_a_proj, q_a_layernorm (eps 1e-6)
    q^h   = W^UQ,h c^Q = [q^C,h (nope) ; q^R,h (rope)]         q_b_proj [H*(nope+rope), q_lora]
            (q_lora_rank None: q^h = W^Q,h x, one plain q_proj [H*(nope+rope), D], as Kimi-Linear-48B)
    [c^KV ; k^R] = W^DKV x,   c^KV <- RMSNorm(c^KV)            kv_a_proj_with_mqa, kv_a_layernorm (eps 1e-6)
    [k^C,h ; v^h] = W^UKV,h c^KV                               kv_b_proj [H*(nope+v), kv_lora]
    k^h   = [k^C,h ; k^R]                                      k^R shared by all heads, NOT rotated
    o^h   = sum_j softmax_j(q^h . k^h_j / sqrt(nope+rope)) v^h_j      causal
    y     = W^O [ sigmoid(W_g x) * concat_h o^h ]             g_proj (no bias), o_proj

Two exact forms of the same attention:

* **naive** — expand the cached latent into per-head keys and values (training, prefill; a prefill chunk on a
  cache, on CUDA without grad, attends to the prefix and to itself apart and merges the two by their
  log-sum-exp: :func:`prefill_chunk_attention`);
* **absorbed** — fold ``W^UK`` into the query and ``W^UV`` after the sum, so attention is a
  single-KV-head MQA over the cached ``[c^KV ; k^R]`` (kv_lora + rope numbers a token; 576 in K3)
  with 512-wide values (decode)::

      score_hj = (W^UK,hᵀ q^C,h) . c^KV_j + q^R,h . k^R_j,      o^h = W^UV,h sum_j p_hj c^KV_j

The cache (:class:`MLACache`) holds only ``c^KV`` (post-norm) and ``k^R``.
``mla_use_nope=False`` rotates ``q^R`` and ``k^R`` with RoPE at absolute positions: an
experiment switch (notebook 05), not K3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from k3lab.config import ModelConfig
from k3lab.linear import Linear

Tensor = torch.Tensor

MLA_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm class default in the HF code


def latent_norm(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """``norm(x)`` for a latent that bf16 autocast left in bf16 while the weight is fp32: computed in the
    promoted dtype and returned in x's dtype, bit-equal to torch's mixed-dtype fallback without its
    "Mismatch dtype between input and weight" UserWarning. Same dtypes: ``norm(x)`` itself."""
    if x.dtype == norm.weight.dtype:
        return norm(x)
    dtype = torch.promote_types(x.dtype, norm.weight.dtype)
    return F.rms_norm(x.to(dtype), norm.normalized_shape, norm.weight.to(dtype), norm.eps).to(x.dtype)
ATTN_FORMS = ("auto", "naive", "absorbed")
ABSORBED_MAX_QUERIES = 16  # "auto": a call with a cache and at most this many new tokens decodes in absorbed form
MAX_LOGIT_QUERY_CHUNK = 1024  # query rows per matmul when max_logit is computed beside a fused kernel
# A prefill chunk on a cache (CUDA, bf16/fp16, no grad; GatedMLA.attend_naive): "sdpa" is one SDPA call with the
# lower-right causal mask (memory-efficient kernel); the others split it in two parts merged by their log-sum-exp
# (prefill_chunk_attention) on that backend; "math" is the plain-PyTorch reference (any device)
LSE_BACKENDS = ("cudnn", "flash", "efficient", "math")  # chunk_attention_lse: kernels returning the log-sum-exp
PREFILL_ATTENTION_BACKENDS = ("sdpa",) + LSE_BACKENDS
PREFILL_ATTENTION = "cudnn"


@dataclass
class MLACache:
    """One MLA layer's decode cache: the compressed KV of every past token.

    c_kv:   [B, T_past, kv_lora_rank]      post-norm latent (K3: 512)
    k_rope: [B, T_past, qk_rope_head_dim]  the key part shared by all heads (K3: 64); rotated iff RoPE is on
    key_mask: [B, T_past] bool or None     True where a cached slot holds a real token (None: all do). Rows of
            a batch whose prompts had different lengths are padded to one length (k3lab.infer); the padded
            slots are masked out of attention and a row's RoPE position is its count of real keys.
    """

    c_kv: Tensor
    k_rope: Tensor
    key_mask: Tensor | None = None

    @property
    def offset(self) -> int:
        """Absolute position of the next token (= number of cached tokens)."""
        return self.c_kv.shape[1]

    def nbytes(self) -> int:
        return self.c_kv.numel() * self.c_kv.element_size() + self.k_rope.numel() * self.k_rope.element_size()


@dataclass
class StaticMLACache:
    """One MLA layer's preallocated decode cache, written in place (graphed decoding, :mod:`k3lab.infer.static`).

    c_kv:     [B, S, kv_lora_rank]      slots for every token the decode will ever hold (S fixed)
    k_rope:   [B, S, qk_rope_head_dim]
    key_mask: [B, S] bool               True where a slot holds a real token (padding and unwritten slots False)
    length:   int64 [1] or [B], on the device  the slot the next token is written to: [1] one counter
              shared by every row (plain static decoding), [B] one per row (speculative decoding, where
              rows accept different numbers of drafts). All MLA layers of a cache share this one tensor;
              the decoder advances it after each step (and may set it back: a rollback).

    A step writes its tokens' latents at slots ``length_b, length_b + 1, …`` of every row and attends to the
    whole buffer under ``key_mask`` (and, among the new tokens, causally): the shapes and addresses never
    change, so a CUDA graph can replay the step. The math is :class:`MLACache`'s: the same keys, the masked
    slots weigh exactly 0 after softmax. A rollback to ``length_b`` sets ``length`` and clears the key mask
    from that slot on (:meth:`rollback`); the rejected latents stay in their slots, masked, until overwritten.
    """

    c_kv: Tensor
    k_rope: Tensor
    key_mask: Tensor
    length: Tensor

    def rollback(self, length: Tensor) -> None:
        """Keep slots ``< length_b`` of each row (length: int64 [B] or [1], on the device; no host read):
        ``self.length = length``; ``key_mask[b, s] &= s < length_b``."""
        if length is not self.length:
            self.length.copy_(length)
        slots = torch.arange(self.key_mask.shape[1], device=self.key_mask.device)  # [S]
        self.key_mask.logical_and_(slots < self.length[:, None])  # [B, S]

    def nbytes(self) -> int:
        return self.c_kv.numel() * self.c_kv.element_size() + self.k_rope.numel() * self.k_rope.element_size()


def rope_rotate(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary position embedding (rotate-half layout) at absolute ``positions`` [T] (or [B, T]: per row).

    x: [B, T, ..., P] with P even; pairs (x_i, x_{i+P/2}) rotate by angle pos * theta^(-2i/P).
    """
    P = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, P, 2, device=x.device, dtype=torch.float64) / P)  # [P/2]
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [T, P/2] or [B, T, P/2]
    rows = x.shape[0] if positions.dim() == 2 else 1
    shape = (rows, x.shape[1]) + (1,) * (x.dim() - 3) + (P // 2,)
    cos = angles.cos().to(x.dtype).view(shape)
    sin = angles.sin().to(x.dtype).view(shape)
    x1, x2 = x[..., : P // 2], x[..., P // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def causal_mask(T: int, S: int, offset: int, device) -> Tensor:
    """[T, S] bool, True where query i (absolute position offset+i) may attend key j (j <= offset+i)."""
    q_pos = torch.arange(T, device=device)[:, None] + offset
    return torch.arange(S, device=device)[None, :] <= q_pos


def attention_math(q: Tensor, k: Tensor, v: Tensor, scale: float, offset: int,
                   key_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Causal softmax attention in float32 (float64 if q is float64).

    q: [B, H, T, K], k: [B, Hk, S, K], v: [B, Hk, S, V] with Hk = H or 1 (MQA broadcasts).
    Query i sits at absolute position offset + i; key j at position j.
    key_mask: [B, S] bool or None; False hides key j from every query of that row (padded cache slots).
    Returns (o [B, H, T, V] float32/64, max logit per head [H]).
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(q.device.type, enabled=False):  # fp32 even inside a bf16 autocast region
        scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale  # [B, H, T, S]
        mask = causal_mask(q.shape[2], k.shape[2], offset, q.device)
        if key_mask is not None:
            mask = mask & key_mask[:, None, None, :]  # [B, 1, T, S]
        scores = scores.masked_fill(~mask, float("-inf"))
        max_logit = scores.detach().amax(dim=(0, 2, 3))  # [H]
        return torch.matmul(scores.softmax(dim=-1), v.to(dtype)), max_logit


def latent_attention_lowp(q_latent: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, scale: float, offset: int,
                          key_mask: Tensor | None = None, limit: Tensor | None = None) -> Tensor:
    """The absorbed form's attention reading a bf16/fp16 latent cache where it lies (CUDA decoding)::

        s_hj = (q^lat_h . c_j + q^R_h . k^R_j) * scale     bf16 GEMMs, float32 accumulation and output
        p_hj = softmax_j(s_hj)  (causal + key mask)         float32
        o_h  = sum_j p_hj c_j                               p rounded to bf16, float32 accumulation

    No concatenated or float32 copy of the cache is made (:func:`attention_math` casts ``[c ; k^R]`` to float32
    every call: at 1M tokens that is gigabytes a layer a step). Rounding q and p to bf16 is what
    FlashAttention-style kernels do; the result is within bf16 tolerance of the float32 math (tested).

    Decode-like calls (T·H ≤ 64, no gradient needed) run the split-K Triton kernel
    :func:`k3lab.kernels.mla_decode.mla_decode_attention` when ``k3lab.kernels.mla_decode.ENABLED`` (default):
    each cache tile is read once for both products, no ``[B, H·T, S]`` score matrix is materialised, and the
    call stays CUDA-graph capturable. The two bf16 ``bmm`` calls below are the other calls' path and the
    kernel's reference. They differ only where a query sees no slot at all (the kernel: 0; softmax: NaN), which
    the layer never produces — each query sees at least its own token.

    q_latent: [B, T, H, R] float32; q_rope: [B, T, H, ρ]; c_kv: [B, S, R]; k_rope: [B, S, ρ] (one KV head);
    key_mask: [B, S] bool or None; limit: [B, T] int64 or None — query t of row b also sees only slots
    ``j ≤ limit[b, t]`` (on top of the causal ``j ≤ offset + t``; a per-row limit such as the static cache's
    ``length_b + t``). Returns o_latent [B, H, T, R] float32.
    """
    B, T, H, R = q_latent.shape
    S, lp = c_kv.shape[1], c_kv.dtype
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_latent, q_rope, c_kv, k_rope))
    if c_kv.is_cuda and lp in (torch.bfloat16, torch.float16) and not needs_grad:
        from k3lab.kernels import mla_decode  # triton: imported on the CUDA path only

        if mla_decode.ENABLED and T * H <= mla_decode.MAX_QUERY_ROWS:
            if offset < S - 1:  # the causal limit cuts into the cache: j <= offset + t
                causal = (torch.arange(T, device=c_kv.device) + offset).expand(B, T)  # [B, T], no host read
                limit = causal if limit is None else torch.minimum(limit, causal)
            return mla_decode.mla_decode_attention(q_latent, q_rope, c_kv, k_rope, scale, key_mask, limit)
    ql = q_latent.to(lp).transpose(1, 2).reshape(B, H * T, R)  # [B, H·T, R]: every head a row of one GEMM (MQA)
    qr = q_rope.to(lp).transpose(1, 2).reshape(B, H * T, -1)  # [B, H·T, ρ]
    scores = torch.bmm(ql, c_kv.mT, out_dtype=torch.float32) + torch.bmm(qr, k_rope.to(lp).mT, out_dtype=torch.float32)
    scores = scores.view(B, H, T, S) * scale  # [B, H, T, S]
    mask = causal_mask(T, S, offset, c_kv.device)  # [T, S]
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]  # [B, 1, T, S]
    if limit is not None:
        mask = mask & (torch.arange(S, device=c_kv.device) <= limit[:, :, None])[:, None]  # [B, 1, T, S]
    p = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.bmm(p.to(lp).view(B, H * T, S), c_kv, out_dtype=torch.float32).view(B, H, T, R)


def attention_lse_math(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Softmax attention and its log-sum-exp in float32 (float64 if q is float64), the plain-PyTorch reference of
    :func:`chunk_attention_lse`::

        s_ij  = scale · q_i · k_j
        lse_i = log Σ_j e^{s_ij}                  over the keys query i sees
        o_i   = Σ_j e^{s_ij − lse_i} v_j

    ``causal=False``: every key; ``causal=True``: keys j <= i + S − T (the mask aligned bottom-right; for T = S the
    ordinary causal mask). q: [B, H, T, K], k: [B, H, S, K], v: [B, H, S, V].
    Returns (o [B, H, T, V], lse [B, H, T]).
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    T, S = q.shape[2], k.shape[2]
    with torch.autocast(q.device.type, enabled=False):
        scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale  # [B, H, T, S]
        if causal:
            scores = scores.masked_fill(~causal_mask(T, S, S - T, q.device), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, T]
        return torch.matmul(torch.exp(scores - lse[..., None]), v.to(dtype)), lse


def chunk_attention_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                        backend: str) -> tuple[Tensor, Tensor]:
    """Softmax attention with its log-sum-exp ``lse_i = log Σ_j e^{scale · q_i · k_j}`` (natural log) on one backend.

    ``causal``: the ordinary causal mask, which needs T = S (square: upper-left = lower-right); else no mask.
    backend: "cudnn" (``aten._scaled_dot_product_cudnn_attention``: qk and v head dims may differ), "flash"
    (``aten._scaled_dot_product_flash_attention``: one head dim for q, k, v, so v is zero-padded to qk's — an
    extra ``[B, H, S, K − V]`` copy and (K + K)/(K + V) of the FLOPs, 1.2× at 192/128 — and the padded output
    columns, all 0, dropped), "efficient" (``aten._scaled_dot_product_efficient_attention``) or "math"
    (:func:`attention_lse_math`). The fused ones need CUDA and bf16/fp16; each returns its lse in its own layout
    ([B, H, T], [B, H, T, 1] or [B, H, ⌈T/32⌉·32]), read here as [B, H, T].
    q: [B, H, T, K], k: [B, H, S, K], v: [B, H, S, V]. Returns (o [B, H, T, V] in q's dtype, float32 for "math";
    lse [B, H, T] float32/64).
    """
    if backend not in LSE_BACKENDS:
        raise ValueError(f"backend={backend!r}: allowed values are {LSE_BACKENDS}")
    B, H, T, K = q.shape
    if causal and k.shape[2] != T:
        raise ValueError(f"causal=True: needs as many keys as queries (square mask), got T={T}, S={k.shape[2]}")
    if backend == "math":
        return attention_lse_math(q, k, v, scale, causal)
    if backend == "cudnn":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        o, lse = out[0], out[1]
    elif backend == "flash":
        V = v.shape[-1]
        if V > K:
            raise ValueError(f"v: flash pads v to qk's head dim, needs V <= K, got V={V}, K={K}")
        vp = F.pad(v, (0, K - V)) if V < K else v  # [B, H, S, K]: zero columns give zero output columns
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, vp, 0.0, causal, False, scale=scale)
        o, lse = out[0][..., :V], out[1]
    else:
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        o, lse = out[0], out[1]
    return o, lse.reshape(B, H, -1)[..., :T].float()  # [B, H, T]


def merge_attention_lse(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention over two disjoint key sets, exactly, from each set's result and log-sum-exp::

        o   = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b})
        lse = log(e^{lse_a} + e^{lse_b})

    computed stably in float32 (float64 if any input is): with m = max(lse_a, lse_b), w_a = e^{lse_a − m} and
    w_b = e^{lse_b − m} (both in [0, 1], one of them 1), o = (w_a o_a + w_b o_b) / (w_a + w_b) and
    lse = m + log(w_a + w_b). An empty set (lse = −inf) weighs 0; every row must see a key in one of them.
    The merge is associative: merging the returned (o, lse) with a third set's gives the three-set result.
    o_a, o_b: [B, H, T, V]; lse_a, lse_b: [B, H, T]. Returns (o [B, H, T, V], lse [B, H, T]).
    """
    dtype = torch.float64 if torch.float64 in (o_a.dtype, o_b.dtype, lse_a.dtype, lse_b.dtype) else torch.float32
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    m = torch.maximum(lse_a, lse_b)  # [B, H, T]
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # [B, H, T]
    total = w_a + w_b
    o = (w_a[..., None] * o_a.to(dtype) + w_b[..., None] * o_b.to(dtype)) / total[..., None]  # [B, H, T, V]
    return o, m + torch.log(total)


def prefill_chunk_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str) -> Tensor:
    """Causal attention of a prefill chunk on a cache — T queries at positions P .. S − 1 (P = S − T) against the
    S keys of the cached prefix and the chunk — as two parts merged exactly (:func:`merge_attention_lse`)::

        (a) o_a, lse_a = attention(q, k[:P], v[:P])              no mask: every query sees the whole prefix
        (b) o_b, lse_b = attention(q, k[P:], v[P:], causal)      square T × T: upper-left mask = lower-right
        o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b})

    equal to ``attention_math(q, k, v, scale, offset=P)`` (tests/test_mla_prefill_merge.py). Each part runs on a
    kernel that returns its log-sum-exp (:func:`chunk_attention_lse`, ``backend``), so no [T, S] mask or score
    matrix is built and the fused kernels' fast unmasked / square-causal forms are used instead of a lower-right
    mask. P = 0 is part (b) alone.
    q: [B, H, T, K], k: [B, H, S, K], v: [B, H, S, V] with S >= T. Returns o [B, H, T, V] float32 (float64 in).
    """
    T, S = q.shape[2], k.shape[2]
    if S < T:
        raise ValueError(f"k: a chunk on a cache needs S >= T keys, got S={S}, T={T}")
    P = S - T
    o_b, lse_b = chunk_attention_lse(q, k[:, :, P:], v[:, :, P:], scale, True, backend)  # [B, H, T, V], [B, H, T]
    if P == 0:
        return o_b.to(torch.promote_types(o_b.dtype, torch.float32))
    o_a, lse_a = chunk_attention_lse(q, k[:, :, :P], v[:, :, :P], scale, False, backend)
    return merge_attention_lse(o_a, lse_a, o_b, lse_b)[0]


@torch.no_grad()
def causal_max_logit(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """max_{b, i, j<=i} q_i . k_j * scale per head [H] (QK-Clip's S_max), in query chunks.

    q: [B, H, T, K], k: [B, H, T, K]. Used beside a fused kernel that does not return its logits.
    """
    B, H, T, K = q.shape
    best = torch.full((H,), float("-inf"), device=q.device, dtype=torch.float32)
    # bf16 q, k on CUDA: a tensor-core GEMM with float32 output — each product of two bf16 values is exact in
    # float32 and the sums are float32 either way, so this is the float32 GEMM's value up to summation order
    # (the float32 path ran on the CUDA cores: 1.2 ms a `small` MLA layer, ~10x the bf16 one)
    low = q.is_cuda and q.dtype == k.dtype == torch.bfloat16
    with torch.autocast(q.device.type, enabled=False):
        for start in range(0, T, MAX_LOGIT_QUERY_CHUNK):
            stop = min(T, start + MAX_LOGIT_QUERY_CHUNK)
            if low:
                scores = torch.bmm(q[:, :, start:stop].reshape(B * H, stop - start, K),
                                   k[:, :, :stop].reshape(B * H, stop, K).transpose(-1, -2),
                                   out_dtype=torch.float32).view(B, H, stop - start, stop) * scale
            else:
                scores = torch.matmul(q[:, :, start:stop].float(), k[:, :, :stop].float().transpose(-1, -2)) * scale
            scores = scores.masked_fill(~causal_mask(stop - start, stop, start, q.device), float("-inf"))
            best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


class GatedMLA(nn.Module):
    """K3 Gated MLA layer (docs/k3_reference.md §3; checkpoint names §1.2).

    forward(x [B, T, D], cache: MLACache | None) -> (y [B, T, D], MLACache of all tokens so far).

    ``attn_form``: "auto" (absorbed for a short step on top of a cache, naive otherwise),
    "naive" or "absorbed" — the two agree to fp32 rounding.
    ``max_logit`` [H]: the max pre-softmax logit (scale included) of the last training-mode
    forward, detached, for QK-Clip; updated when ``self.training and self.track_max_logit``.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        D = cfg.hidden_size
        self.num_heads = H = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.scale = self.qk_head_dim ** -0.5  # 192^-1/2 in K3: the rope part counts even without rotation
        self.use_rope = not cfg.mla_use_nope
        self.rope_theta = cfg.rope_theta
        self.use_output_gate = cfg.mla_use_output_gate

        be = cfg.backend  # the projections' GEMV backend (k3lab.linear: Triton for decode-sized calls on CUDA)
        if cfg.q_lora_rank is None:  # Kimi Linear: one full-rank query projection, no latent
            self.q_proj = Linear(D, H * self.qk_head_dim, bias=False, backend=be)
        else:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, bias=False, backend=be)
            self.q_a_layernorm = nn.RMSNorm(cfg.q_lora_rank, eps=MLA_LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * self.qk_head_dim, bias=False, backend=be)
        self.kv_a_proj_with_mqa = Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False, backend=be)
        self.kv_a_layernorm = nn.RMSNorm(cfg.kv_lora_rank, eps=MLA_LATENT_NORM_EPS)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, backend=be)
        if self.use_output_gate:
            self.g_proj = Linear(D, H * cfg.v_head_dim, bias=False, backend=be)
        self.o_proj = Linear(H * cfg.v_head_dim, D, bias=False, backend=be)

        self.muon_head_splits = {"q_proj" if cfg.q_lora_rank is None else "q_b_proj": H, "kv_b_proj": H}
        self.attn_form = "auto"
        self.track_max_logit = cfg.qk_clip_tau is not None  # only QK-Clip reads it (an extra QK^T pass on the fused path)
        self.register_buffer("max_logit", torch.zeros(H), persistent=False)
        self.cp = None  # a k3lab.parallel.context.CPContext: context-parallel forward (gathered latent)

    # ---------------------------------------------------------------------------------------
    def project(self, x: Tensor, offset: int, positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [B, T, D] -> q_nope [B, T, H, nope], q_rope [B, T, H, rope], c_kv [B, T, R], k_rope [B, T, rope].

        positions: RoPE positions [B, T] per row (None: ``offset .. offset+T-1`` for every row)."""
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(latent_norm(self.q_a_layernorm, self.q_a_proj(x)))
        q = q.view(B, T, self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = latent_norm(self.kv_a_layernorm, c_kv)
        if self.use_rope:
            if positions is None:
                positions = torch.arange(offset, offset + T, device=x.device) if self.cp is None else \
                    self.cp.positions(T, x.device)  # context parallel: global positions
            q_rope = rope_rotate(q_rope, positions, self.rope_theta)
            k_rope = rope_rotate(k_rope, positions, self.rope_theta)
        return q_nope, q_rope, c_kv, k_rope

    def kv_b_weights(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj split per head: W_UK [H, nope, R] and W_UV [H, V, R]."""
        W = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return W[:, : self.qk_nope_head_dim], W[:, self.qk_nope_head_dim:]

    def attend_naive(self, q_nope: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, offset: int,
                     key_mask: Tensor | None = None) -> Tensor:
        """Per-head keys/values expanded from the latent. Returns o [B, T, H, V] in float32 (float64 in).

        key_mask: [B, S] bool or None (see :class:`MLACache`)."""
        B, S, _ = c_kv.shape
        H = self.num_heads
        kv = self.kv_b_proj(c_kv).view(B, S, H, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(B, S, H, self.qk_rope_head_dim)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T|S, K|V]
        low_precision = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and key_mask is None
        fused = low_precision and offset == 0 and q.shape[2] == S
        if low_precision and offset > 0 and q.shape[2] + offset == S and not (self.training and self.track_max_logit):
            # a prompt chunk on top of a cache (chunked prefill): the causal mask aligns bottom-right
            if PREFILL_ATTENTION not in PREFILL_ATTENTION_BACKENDS:
                raise ValueError(f"PREFILL_ATTENTION={PREFILL_ATTENTION!r}: allowed values are "
                                 f"{PREFILL_ATTENTION_BACKENDS}")
            if PREFILL_ATTENTION != "sdpa" and not torch.is_grad_enabled():
                # inference: prefix (no mask) and chunk (square causal) apart, merged by log-sum-exp, on a fast kernel
                return prefill_chunk_attention(q, k, v, self.scale, PREFILL_ATTENTION).transpose(1, 2)
            # SDPA's memory-efficient kernel takes the lower-right mask without materialising [T, S] (qk 192 / v 128
            # allowed; flash refuses them)
            from torch.nn.attention.bias import causal_lower_right  # here: importing it imports dynamo (2 s)

            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], S), scale=self.scale)
            return o.float().transpose(1, 2)
        if fused:
            # flash refuses qk 192 / v 128; cuDNN runs it (efficient-attention backward is ~10x slower)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).float()
            if self.training and self.track_max_logit:
                self.max_logit = causal_max_logit(q, k, self.scale)
        else:
            o, max_logit = attention_math(q, k, v, self.scale, offset, key_mask)
            if self.training and self.track_max_logit:
                self.max_logit = max_logit.float()
        return o.transpose(1, 2)

    def attend_absorbed(self, q_nope: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, offset: int,
                        key_mask: Tensor | None = None, limit: Tensor | None = None) -> Tensor:
        """MQA over the latent [c_kv ; k_rope] (one KV head). Returns o [B, T, H, V] in float32 (float64 in).

        key_mask: [B, S] bool or None (see :class:`MLACache`). limit: [B, T] int64 or None, a bound on the work:
        the bf16/fp16 CUDA path (:func:`latent_attention_lowp`) reads no slot past ``limit[b, t]``; the slots past
        it must already be hidden (key mask or causal), so the result is the same with or without it."""
        W_UK, W_UV = self.kv_b_weights()  # [H, nope, R], [H, V, R]
        dtype = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
        track = self.training and self.track_max_logit
        with torch.autocast(q_nope.device.type, enabled=False):
            q_latent = torch.einsum("bthn,hnr->bthr", q_nope.to(dtype), W_UK.to(dtype))  # [B, T, H, R]
            if c_kv.is_cuda and c_kv.dtype in (torch.bfloat16, torch.float16) and not track:
                o_latent = latent_attention_lowp(q_latent, q_rope, c_kv, k_rope, self.scale, offset, key_mask, limit)
            else:
                q = torch.cat([q_latent, q_rope.to(dtype)], dim=-1).transpose(1, 2)  # [B, H, T, R + rope]
                k = torch.cat([c_kv, k_rope], dim=-1)[:, None]  # [B, 1, S, R + rope]
                o_latent, max_logit = attention_math(q, k, c_kv[:, None], self.scale, offset, key_mask)  # [B, H, T, R]
            o = torch.einsum("bhtr,hvr->bthv", o_latent, W_UV.to(dtype))  # [B, T, H, V]
        if track:
            self.max_logit = max_logit.float()
        return o

    def forward(self, x: Tensor, cache: MLACache | StaticMLACache | None = None) -> tuple[Tensor, MLACache]:
        if self.attn_form not in ATTN_FORMS:
            raise ValueError(f"attn_form={self.attn_form!r}: allowed values are {ATTN_FORMS}")
        if isinstance(cache, StaticMLACache):
            return self.forward_static(x, cache)
        B, T, _ = x.shape
        offset = 0 if cache is None else cache.offset
        key_mask = positions = None
        if cache is not None and cache.key_mask is not None:  # rows padded to one length (batched decoding)
            positions = cache.key_mask.sum(1, keepdim=True) + torch.arange(T, device=x.device)  # [B, T] real positions
            key_mask = torch.cat([cache.key_mask, cache.key_mask.new_ones(B, T)], dim=1)  # [B, S]
        q_nope, q_rope, c_kv, k_rope = self.project(x, offset, positions)
        if self.cp is not None:  # context parallel: gathered latent, global-position mask (cache must be None)
            o, c_kv, k_rope = self.cp.mla_attend(self, q_nope, q_rope, c_kv, k_rope, cache)
            o = o.flatten(2)  # [B, T, H*V]; c_kv, k_rope: the whole sequence
        else:
            if cache is not None:
                c_kv = torch.cat([cache.c_kv, c_kv], dim=1)  # [B, S, R]
                k_rope = torch.cat([cache.k_rope, k_rope], dim=1)  # [B, S, rope]
            absorbed = self.attn_form == "absorbed" or (
                self.attn_form == "auto" and cache is not None and T <= ABSORBED_MAX_QUERIES)
            attend = self.attend_absorbed if absorbed else self.attend_naive
            o = attend(q_nope, q_rope, c_kv, k_rope, offset, key_mask).flatten(2)  # [B, T, H*V], fp32: K3 keeps it so
        return self.output(x, o), MLACache(c_kv, k_rope, key_mask)

    def output(self, x: Tensor, o: Tensor) -> Tensor:
        """y = W^O [sigmoid(W_g x) * o] (the gate when ``mla_use_output_gate``); x [B, T, D], o [B, T, H*V] fp32."""
        if self.use_output_gate:
            o = torch.sigmoid(self.g_proj(x).to(o.dtype)) * o  # G1 gate: elementwise, from the layer input
        return self.o_proj(o.to(x.dtype))

    def forward_static(self, x: Tensor, cache: StaticMLACache) -> tuple[Tensor, StaticMLACache]:
        """``T`` tokens per row on a :class:`StaticMLACache`: write their latents at slots ``length_b + i``
        (i < T), attend (absorbed form) to every slot under the key mask. x [B, T, D] -> (y [B, T, D], the same
        cache); ``cache.length`` is not advanced (the decoder does that).

        * T = 1 with one shared counter (``length`` [1]; plain static decoding): the query sits after every slot
          and the key mask alone decides what it sees;
        * otherwise (the speculative verify of ``k + 1`` tokens, the MTP head's pending entries, per-row
          counters ``length`` [B]): query i of row b sees ``mask[b, i, s] = key_mask[b, s] ∧ s ≤ length_b + i``
          (:meth:`attend_static`) — the new tokens causally, and the slots of rejected drafts of an earlier step
          that lie beyond them not at all. Under RoPE token i of row b sits at position (real keys before it) + i.
        """
        B, T, _ = x.shape
        if self.cp is not None:
            raise ValueError("StaticMLACache: decoding does not run under context parallelism (layer.cp is set)")
        if T == 1 and cache.length.numel() == 1:
            positions = cache.key_mask.sum(1, keepdim=True) if self.use_rope else None  # [B, 1] real keys before it
            q_nope, q_rope, c_kv, k_rope = self.project(x, 0, positions)
            cache.c_kv.index_copy_(1, cache.length, c_kv.to(cache.c_kv.dtype))  # [B, S, R], slot `length`
            cache.k_rope.index_copy_(1, cache.length, k_rope.to(cache.k_rope.dtype))
            cache.key_mask.index_fill_(1, cache.length, True)
            S = cache.c_kv.shape[1]  # the query sits after every slot: the key mask alone decides what it sees
            last = cache.length.expand(B)[:, None]  # [B, 1] the slot just written: no later one is real (CUDA kernel's
            # work bound, so a cache of many slots costs what its written ones do)
            o = self.attend_absorbed(q_nope, q_rope, cache.c_kv, cache.k_rope, S - 1, cache.key_mask, last).flatten(2)
            return self.output(x, o), cache
        new = torch.arange(T, device=x.device)  # [T]
        positions = cache.key_mask.sum(1, keepdim=True) + new if self.use_rope else None  # [B, T]
        q_nope, q_rope, c_kv, k_rope = self.project(x, 0, positions)
        slots = cache.length.expand(B)[:, None] + new  # [B, T] the slot of each new token
        R, P, S = c_kv.shape[-1], k_rope.shape[-1], cache.c_kv.shape[1]
        cache.c_kv.scatter_(1, slots[:, :, None].expand(B, T, R), c_kv.to(cache.c_kv.dtype))  # [B, S, R]
        cache.k_rope.scatter_(1, slots[:, :, None].expand(B, T, P), k_rope.to(cache.k_rope.dtype))  # [B, S, ρ]
        cache.key_mask.scatter_(1, slots, True)
        o = self.attend_static(q_nope, q_rope, cache.c_kv, cache.k_rope, cache.key_mask, slots)
        return self.output(x, o.flatten(2)), cache

    def attend_static(self, q_nope: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, key_mask: Tensor,
                      limit: Tensor) -> Tensor:
        """The absorbed form (:meth:`attend_absorbed`) where query i of row b sees the slots ``s`` with
        ``key_mask[b, s] ∧ s ≤ limit[b, i]``::

            s_bhis = (W^UK,hᵀ q^C_bhi · c_bs + q^R_bhi · k^R_bs) · scale,   −∞ where the slot is hidden
            o_bhi  = W^UV,h Σ_s softmax_s(s_bhis) c_bs

        A bf16/fp16 cache on CUDA runs :func:`latent_attention_lowp` (its ``limit``; the split-K kernel for
        decode-sized calls); otherwise float32 math (float64 in). Every query must see at least one slot.
        q_nope [B, T, H, nope], q_rope [B, T, H, ρ], c_kv [B, S, R], k_rope [B, S, ρ], key_mask [B, S] bool,
        limit [B, T] int64. Returns o [B, T, H, V]."""
        W_UK, W_UV = self.kv_b_weights()  # [H, nope, R], [H, V, R]
        S = c_kv.shape[1]
        dtype = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
        with torch.autocast(q_nope.device.type, enabled=False):
            q_latent = torch.einsum("bthn,hnr->bthr", q_nope.to(dtype), W_UK.to(dtype))  # [B, T, H, R]
            if c_kv.is_cuda and c_kv.dtype in (torch.bfloat16, torch.float16):
                o_latent = latent_attention_lowp(q_latent, q_rope, c_kv, k_rope, self.scale, S - 1, key_mask, limit)
            else:
                seen = key_mask[:, None, :] & (torch.arange(S, device=c_kv.device) <= limit[:, :, None])  # [B, T, S]
                q = torch.cat([q_latent, q_rope.to(dtype)], dim=-1).transpose(1, 2)  # [B, H, T, R + ρ]
                k = torch.cat([c_kv, k_rope], dim=-1)[:, None].to(dtype)  # [B, 1, S, R + ρ]
                scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # [B, H, T, S]
                p = scores.masked_fill(~seen[:, None], float("-inf")).softmax(dim=-1)
                o_latent = torch.matmul(p, c_kv[:, None].to(dtype))  # [B, H, T, R]
            return torch.einsum("bhtr,hvr->bthv", o_latent, W_UV.to(dtype))  # [B, T, H, V]

    def cache_numbers_per_token(self) -> int:
        """Numbers cached per token by this layer: kv_lora_rank + qk_rope_head_dim (576 in K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def extra_repr(self) -> str:
        pos = "RoPE" if self.use_rope else "NoPE"
        return f"heads={self.num_heads}, qk={self.qk_nope_head_dim}+{self.qk_rope_head_dim}, v={self.v_head_dim}, {pos}, gate={self.use_output_gate}"


# ----------------------------------------------------------------------------------------------
# QK-Clip (MuonClip, K2 §2.1)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def qk_clip_(mla: nn.Module, tau: float = 100.0) -> Tensor:
    """Rescale an MLA layer's query/key weights so that no head's max pre-softmax logit exceeds τ.

    Reads ``mla.max_logit [H]`` (max over the last batch of ``q·k/sqrt(d_qk)``). For each head with
    ``S_max^h > τ``: ``γ_h = τ/S_max^h``; the head's q-nope rows of ``q_b_proj`` and k-nope rows of
    ``kv_b_proj`` are scaled by ``sqrt(γ_h)`` (their product by γ_h), its q-rope rows by γ_h, and the
    shared k-rope (from ``kv_a_proj_with_mqa``) is untouched, so every logit of head h scales by γ_h.
    Row layout per head: ``q_b_proj`` = [q_nope; q_rope], ``kv_b_proj`` = [k_nope; v] (v untouched);
    with ``q_lora_rank`` None the rows of ``q_proj`` (same layout).
    Returns γ [H] (1 where no clip). ``mla.max_logit`` is updated to the clipped value.
    """
    H, dn, dr, dv = mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    s_max = mla.max_logit.float()                                               # [H]
    if s_max.shape != (H,):
        raise ValueError(f"qk_clip_: mla.max_logit must have shape [{H}], got {tuple(s_max.shape)}")
    gamma = torch.where(s_max > tau, tau / s_max.clamp_min(1e-30), torch.ones_like(s_max))  # [H]
    sq = gamma.sqrt()[:, None]                                                  # [H, 1]
    q_rows = torch.cat([sq.expand(H, dn), gamma[:, None].expand(H, dr)], 1)     # [H, dn+dr] per q_b_proj row
    kv_rows = torch.cat([sq.expand(H, dn), torch.ones(H, dv, device=gamma.device)], 1)  # [H, dn+dv]
    q_weight = mla.q_b_proj.weight if hasattr(mla, "q_b_proj") else mla.q_proj.weight  # q_lora_rank None: q_proj
    scale_rows_(q_weight, q_rows.reshape(-1))
    scale_rows_(mla.kv_b_proj.weight, kv_rows.reshape(-1))
    mla.max_logit.copy_(torch.minimum(s_max, torch.full_like(s_max, tau)).to(mla.max_logit.dtype))
    return gamma


@torch.no_grad()
def scale_rows_(weight: Tensor, row_scale: Tensor) -> None:
    """``weight[i, :] *= row_scale[i]`` in place; for an FSDP2 DTensor (``Shard(0)``, torch.chunk rows)
    only this rank's rows are touched, so no gather is needed."""
    if hasattr(weight, "to_local"):
        local = weight.to_local()
        (mesh_axis,) = [i for i, p in enumerate(weight.placements) if p.is_shard()] or [None]
        if mesh_axis is None:
            start = 0
        else:
            W, r = weight.device_mesh.size(mesh_axis), weight.device_mesh.get_local_rank(mesh_axis)
            start = min(r * -(-weight.shape[0] // W), weight.shape[0])
        local.mul_(row_scale[start:start + local.shape[0], None].to(local.device, local.dtype))
    else:
        weight.mul_(row_scale[:, None].to(weight.dtype))


def qk_clip_model_(model: nn.Module, tau: float = 100.0) -> dict[str, Tensor]:
    """Apply :func:`qk_clip_` to every module that has ``max_logit`` and ``kv_b_proj`` (the MLA layers)."""
    return {name: qk_clip_(m, tau) for name, m in model.named_modules()
            if hasattr(m, "max_logit") and hasattr(m, "kv_b_proj")}

