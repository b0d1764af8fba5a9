"""Triton kernel for one KDA decoding step (docs/k3_reference.md §2.2): the recurrence itself, fused, for T = 1."""

import triton
import triton.language as tl


@triton.jit
def kda_decode_kernel(
    q, k, v, g, beta, state, o, new_state,   # q, k, g [B, H, K]; v, o [B, H, V]; beta [B, H]; states [B, H, K, V]
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_STATE: tl.constexpr,
):
    """One token, one head, a ``[K, BV]`` slice of the fp32 state (value columns are independent)::

        S ← Diag(exp(g)) S                 (per-channel decay)
        S ← S + k ⊗ β (v − Sᵀ k)           (delta rule: replace what the key currently reads)
        o = scale · Sᵀ q
    """
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    if HAS_STATE:
        b_s = tl.load(state + p_kv, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    b_q = tl.load(q + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = tl.load(g + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_bh * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + i_bh).to(tl.float32)
    b_s = b_s * tl.exp(b_g)[:, None]
    b_read = tl.sum(b_k[:, None] * b_s, 0)  # [BV] what key k reads from the decayed state
    b_s = b_s + b_k[:, None] * (b_beta * (b_v - b_read))[None, :]
    b_o = tl.sum(b_q[:, None] * b_s, 0) * scale
    tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(new_state + p_kv, b_s, mask=m_kv)
