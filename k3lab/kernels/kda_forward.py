"""Triton forward kernels of chunkwise KDA (K3 spec §2.3), one program per chunk or per value block.

Notation (one batch row b, one head h; the sequence is cut into chunks of C = BT = 64 tokens, the
last one masked). Inside a chunk, rows r = 0..C-1, ``G_r = Σ_{i≤r} g_i`` is the in-chunk cumulative
log-decay (per key channel), ``Γ_r = exp(G_r)``, and ``S`` the state entering the chunk::

    M_ij  = Σ_d k_id k_jd exp(G_id − G_jd)      j < i           (key-key scores)
    P_ij  = Σ_d q_id k_jd exp(G_id − G_jd)      j ≤ i           (query-key scores)
    A⁻¹   = (I + Diag(β) M)⁻¹                                   (UT transform, unit lower-triangular)
    W     = A⁻¹ Diag(β) (Γ ⊙ K)       U = A⁻¹ Diag(β) V
    Ṽ     = U − W S                                              (pseudo-values, "v_new")
    O     = scale (Γ ⊙ Q) S + scale P Ṽ
    S'    = Diag(Γ_C) S + (exp(G_C − G) ⊙ K)ᵀ Ṽ

Three kernels:

1. :func:`kda_fwd_intra_kernel`, grid (chunks, B·H): everything that stays inside one chunk — G, the
   score matrices on 16-token tiles, A⁻¹ by block forward substitution, W, U and the rescaled
   ``qg = scale Γ ⊙ Q`` and ``kg = exp(G_C − G) ⊙ K``.
2. :func:`kda_fwd_state_kernel`, grid (V blocks, B·H): the only sequential part, chunk after chunk:
   ``Ṽ = U − W S`` and ``S ← Diag(Γ_C) S + kgᵀ Ṽ``; stores the state entering every chunk.
3. :func:`kda_fwd_output_kernel`, grid (chunks, V blocks, B·H): ``O = qg S + (scale P) Ṽ``.

**Why the bounded gate matters here (the e^80 argument).** ``exp(G_i − G_j)`` cannot be split as
``exp(G_i) · exp(−G_j)`` over a whole chunk: with ``g`` down to −5, ``−G_j`` reaches 315 and
``e^315`` overflows. Anchoring at the first row ``a`` of each 16-token tile,
``exp(G_i − G_j) = exp(G_i − G_a) · exp(G_a − G_j)``: for a key in an earlier tile both factors are
≤ 1; for a key in the same tile the key factor is ``exp(−Σ_{a<r≤j} g_r) ≤ e^{15·5} = e^75``, inside
fp32/bf16 range (max ≈ e^88.7) — only because K3 bounds ``g ≥ −5``. So the diagonal tiles are dense
matrix products on tensor cores too; with an unbounded gate they need a per-position-pair path.
The kernels require ``g ∈ [−5, 0]`` (more precisely ``g > −5.9``).
"""

import os

import triton
import triton.language as tl

# Triton's interpreter (3.9) multiplies the raw bits of bf16 operands in tl.dot; under it, mm rounds the
# operands to DT and multiplies in fp32 instead — the same numbers the tensor cores produce.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def mm(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    """Tensor-core product in the activation dtype ``DT`` (fp32 accumulate), for operands stored in DT
    (then the product is exact); a state held in fp32 registers is rounded to DT, as fla does."""
    if INTERPRET:
        return tl.dot(a.to(DT).to(tl.float32), b.to(DT).to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def mm_fp32(a, b, PREC: tl.constexpr):
    """Product of operands computed in fp32 inside a kernel (gate-rescaled q/k, A⁻¹, scores, their
    gradients): tf32 tensor cores on the bf16 path (3 more mantissa bits than bf16; rounding these to
    bf16 made the bf16 error ~5x larger), exact fp32 on the fp32 path."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def decay_from_anchor(b_g, rows, a):
    """``z_j = G_j − G_a`` for every row j of a chunk tile ``b_g [BT, BK]``, summed outwards from the
    anchor row ``a`` rather than as a difference of two chunk-level cumsums: ``G`` itself reaches −300
    in fp32, and ``G_j − G_a`` taken from it would carry an absolute error of ~1e-5 into every factor."""
    after = tl.cumsum(tl.where(rows[:, None] > a, b_g, 0.0), 0)  # Σ_{a<r≤j} g_r
    before = tl.cumsum(tl.where(rows[:, None] <= a, b_g, 0.0), 0, reverse=True) - b_g  # Σ_{j<r≤a} g_r
    return tl.where(rows[:, None] >= a, after, -before)


@triton.jit
def tile_rows(x, I, BT: tl.constexpr, BC: tl.constexpr):
    """Rows ``I·BC .. I·BC + BC − 1`` of a register tile ``x [BT, N]`` as ``[BC, N]``, exactly (a reshape
    and a masked sum), so that a tile's factors match the chunk-wide ones bit for bit."""
    x3 = tl.reshape(x, [BT // BC, BC, x.shape[1]])
    return tl.sum(tl.where(tl.arange(0, BT // BC)[:, None, None] == I, x3, 0.0), 0)


@triton.jit
def decay_to_end(b_g):
    """``G_C − G_r = Σ_{r' > r} g_r'`` (reverse cumsum, same accuracy argument as :func:`decay_from_anchor`)."""
    return tl.cumsum(b_g, 0, reverse=True) - b_g


@triton.jit
def invert_unit_lower_16(D, BC: tl.constexpr):
    """``(I + D)⁻¹`` for a strictly lower-triangular ``D [BC, BC]`` by forward substitution.

    Row r of the inverse is ``x_r = e_r − Σ_{s<r} D_rs x_s``: 15 steps on a 16×16 tile.
    """
    o_c = tl.arange(0, BC)
    X = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    for r in range(1, BC):
        d_r = tl.sum(tl.where(o_c[:, None] == r, D, 0.0), 0)  # [BC] row r of D (entries s < r)
        x_r = tl.where(o_c == r, 1.0, 0.0) - tl.sum(d_r[:, None] * X, 0)
        X = tl.where(o_c[:, None] == r, x_r[None, :], X)
    return X


@triton.jit(do_not_specialize=["T"])
def kda_fwd_intra_kernel(
    q, k, v, g, beta,                      # inputs [B, T, H, K|V], beta [B, T, H]
    qg, kg, w, u, gl, Aqk, Akk_inv, Mkk,   # outputs
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):
    """One chunk of one head: scores on 16-token tiles, the UT transform, W, U, qg, kg.

    Tile ``I`` (rows ``a = 16I .. a+15``) against all keys of the chunk, anchored at row ``a``::

        k̂_j   = k_j ⊙ exp(G_a − G_j)         for j < a + 16 (0 after the tile: those keys are in the future)
        q̂_i   = q_i ⊙ exp(G_i − G_a)         for i in the tile (≤ 1)
        P[I]  = q̂ k̂ᵀ,   M[I] = (k ⊙ exp(G − G_a))[I] k̂ᵀ            [16, 64] row blocks, tensor cores

    The inverse ``A⁻¹ = (I + L)⁻¹`` (``L = Diag(β) M``) is built one 16-row block at a time:
    ``X_I = (I + L_II)⁻¹ (E_I − L_{I,<I} X_{<I})``, with the 16×16 diagonal inverse by forward
    substitution; finished rows go to ``Akk_inv`` in global memory and are read back (L1/L2) by the
    next block after a barrier. Then ``W = A⁻¹ (β Γ ⊙ K)``, ``U = A⁻¹ (β V)``.
    Stores: ``Aqk = scale·P`` (fp32), ``Mkk = M`` (fp32, for dβ in the backward), ``Akk_inv`` (fp32),
    ``gl = G_C`` per chunk, ``qg = scale Γ ⊙ Q``, ``kg = exp(G_C − G) ⊙ K``, ``w`` (dtype DT) and ``u`` (fp32).
    All exponents are differences of sums taken from the anchor outwards (:func:`decay_from_anchor`).
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    t0 = i_t * BT
    seq = i_b.to(tl.int64) * T * H + i_h  # row (b, t=0, h) of the [B·T·H] token-head rows
    q, k, g, qg, kg, w = q + seq * K, k + seq * K, g + seq * K, qg + seq * K, kg + seq * K, w + seq * K
    v, u, beta = v + seq * V, u + seq * V, beta + seq
    Aqk, Akk_inv, Mkk = Aqk + seq * BT, Akk_inv + seq * BT, Mkk + seq * BT
    gl += ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K
    rows = tl.arange(0, BT)
    o_t = t0 + rows
    m_t = o_t < T
    o_c = tl.arange(0, BC)
    p_tA = o_t[:, None] * (H * BT) + rows[None, :]  # [BT, BT] offsets into Aqk, Akk_inv, Mkk
    b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)

    for I in tl.static_range(BT // BC):
        a = I * BC  # anchor row of the tile
        o_i = t0 + a + o_c  # [BC] token index of the tile's rows
        m_i = o_i < T
        b_P = tl.zeros([BC, BT], dtype=tl.float32)
        b_M = tl.zeros([BC, BT], dtype=tl.float32)
        b_D = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k < K)[None, :]
            m_ik = m_i[:, None] & (o_k < K)[None, :]
            p_tk = o_t[:, None] * (H * K) + o_k[None, :]
            p_ik = o_i[:, None] * (H * K) + o_k[None, :]
            b_g = tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32)  # padding rows: g = 0 (no decay)
            b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
            b_qi = tl.load(q + p_ik, mask=m_ik, other=0.0).to(tl.float32)
            b_ki = tl.load(k + p_ik, mask=m_ik, other=0.0).to(tl.float32)
            b_z = decay_from_anchor(b_g, rows, a)  # [BT, BK] G_j − G_a
            b_lc = tile_rows(b_z, I, BT, BC)  # [BC, BK] G_i − G_a for the tile's own rows
            b_qf = tl.exp(b_lc)  # ≤ 1
            # k̂_j = k_j exp(G_a − G_j): ≤ e^75 inside the tile (g ≥ −5), exactly 0 for keys after it
            b_kh = b_k * tl.exp(tl.where(rows[:, None] < a + BC, -b_z, float("-inf")))
            b_P += mm_fp32(b_qi * b_qf, tl.trans(b_kh), PREC)  # [BC, BT]
            b_M += mm_fp32(b_ki * b_qf, tl.trans(b_kh), PREC)  # [BC, BT]
            b_D += mm_fp32(b_ki * b_qf, tl.trans(b_ki * tl.exp(-b_lc)), PREC)  # [BC, BC] diagonal tile of M
        b_P = tl.where((a + o_c)[:, None] >= rows[None, :], b_P * scale, 0.0)
        b_M = tl.where((a + o_c)[:, None] > rows[None, :], b_M, 0.0)
        p_iA = o_i[:, None] * (H * BT) + rows[None, :]
        tl.store(Aqk + p_iA, b_P, mask=m_i[:, None])
        tl.store(Mkk + p_iA, b_M, mask=m_i[:, None])

        # UT transform, block row I: X_I = (I + L_II)⁻¹ (E_I − L_{I,<I} X_{<I}),  L = Diag(β) M
        b_bi = tl.load(beta + o_i * H, mask=m_i, other=0.0).to(tl.float32)
        b_D = tl.where(o_c[:, None] > o_c[None, :], b_D * b_bi[:, None], 0.0)
        b_Dinv = invert_unit_lower_16(b_D, BC)
        b_R = tl.where((a + o_c)[:, None] == rows[None, :], 1.0, 0.0)  # E_I [BC, BT]
        if I > 0:
            b_L = tl.where(rows[None, :] < a, b_M * b_bi[:, None], 0.0)  # L_{I,<I}
            b_Xp = tl.load(Akk_inv + p_tA, mask=m_t[:, None] & (rows < a)[:, None], other=0.0)
            b_R = b_R - mm_fp32(b_L, b_Xp, PREC)
        b_X = mm_fp32(b_Dinv, b_R, PREC)  # [BC, BT]
        tl.store(Akk_inv + p_iA, b_X, mask=m_i[:, None])
        tl.debug_barrier()  # the next tile (and W, U below) read these rows back

    b_Ai = tl.load(Akk_inv + p_tA, mask=m_t[:, None], other=0.0)  # [BT, BT] A⁻¹
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_tk = o_t[:, None] * (H * K) + o_k[None, :]
        b_g = tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
        b_gam = tl.exp(tl.cumsum(b_g, 0))  # Γ ≤ 1
        b_w = mm_fp32(b_Ai, b_k * b_beta[:, None] * b_gam, PREC)
        tl.store(w + p_tk, b_w.to(w.dtype.element_ty), mask=m_tk)
        tl.store(kg + p_tk, (b_k * tl.exp(decay_to_end(b_g))).to(kg.dtype.element_ty), mask=m_tk)
        b_q = tl.load(q + p_tk, mask=m_tk, other=0.0).to(tl.float32)
        tl.store(qg + p_tk, (b_q * b_gam * scale).to(qg.dtype.element_ty), mask=m_tk)
        tl.store(gl + o_k, tl.sum(b_g, 0), mask=o_k < K)  # G_C (padding rows add 0)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = o_t[:, None] * (H * V) + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_u = mm_fp32(b_Ai, b_v * b_beta[:, None], PREC)
        tl.store(u + p_tv, b_u.to(u.dtype.element_ty), mask=m_tv)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_state_kernel(
    w, u, kg, gl, h0,          # inputs (h0 [B, H, K, V] fp32, read if HAS_H0)
    hs, v_new, ht,             # outputs: state entering each chunk [B, NT, H, K, V], Ṽ [B, T, H, V], final state
    T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """The recurrence across chunks, for a ``[K, BV]`` slice of the state (fp32 in registers)::

        for each chunk t:   hs[t] = S;   Ṽ = U − W S;   S ← Diag(Γ_C) S + kgᵀ Ṽ

    Value columns never mix, so the state splits along V into independent programs.
    """
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    seq = i_b.to(tl.int64) * T * H + i_h
    w, kg, u, v_new = w + seq * K, kg + seq * K, u + seq * V, v_new + seq * V
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]  # [BK, BV] inside one [K, V] state
    if HAS_H0:
        b_h = tl.load(h0 + (i_b.to(tl.int64) * H + i_h) * K * V + p_kv, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_t in range(NT):
        tl.store(hs + ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V + p_kv, b_h.to(hs.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        p_tk = o_t[:, None] * (H * K) + o_k[None, :]
        p_tv = o_t[:, None] * (H * V) + o_v[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
        b_u = tl.load(u + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_vn = b_u - mm(b_w, b_h, DT, PREC)  # [BT, BV]
        tl.store(v_new + p_tv, b_vn.to(v_new.dtype.element_ty), mask=m_tv)
        b_kg = tl.load(kg + p_tk, mask=m_tk, other=0.0)
        b_gl = tl.load(gl + ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_h = b_h * tl.exp(b_gl)[:, None] + mm(tl.trans(b_kg), b_vn, DT, PREC)
    if STORE_HT:
        tl.store(ht + (i_b.to(tl.int64) * H + i_h) * K * V + p_kv, b_h, mask=m_kv)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_output_kernel(
    qg, hs, Aqk, v_new, o,
    T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):
    """``O = qg S + Aqk Ṽ`` for one chunk and one value block: the inter-chunk part reads the state
    entering the chunk, the intra-chunk part the (already scaled, lower-triangular) scores."""
    i_t, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    seq = i_b.to(tl.int64) * T * H + i_h
    qg, Aqk, v_new, o = qg + seq * K, Aqk + seq * BT, v_new + seq * V, o + seq * V
    rows = tl.arange(0, BT)
    o_t = i_t * BT + rows
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_qg = tl.load(qg + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                       other=0.0)
        b_h = tl.load(hs + ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & (o_v < V)[None, :], other=0.0)
        b_o += mm(b_qg, b_h, DT, PREC)
    b_A = tl.load(Aqk + o_t[:, None] * (H * BT) + rows[None, :], mask=m_t[:, None], other=0.0)
    p_tv = o_t[:, None] * (H * V) + o_v[None, :]
    b_vn = tl.load(v_new + p_tv, mask=m_tv, other=0.0)
    b_o += mm_fp32(b_A, b_vn, PREC)
    tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
