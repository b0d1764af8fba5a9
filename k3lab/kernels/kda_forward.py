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
def tile_local_decay(b_g, BT: tl.constexpr, BC: tl.constexpr):
    """``λ3 [BT/BC, BC, BK]``: ``λ_i = G_i − G_a = Σ_{a<r≤i} g_r`` for every row i, with ``a`` the first
    row of its 16-token tile; always in (−75, 0] for g ≥ −5.

    Summed inside the tile rather than taken as a difference of chunk-level cumsums: ``G`` itself
    reaches −300 in fp32, and ``G_i − G_a`` taken from it would carry an absolute error of ~1e-5
    into every rescaling factor."""
    g3 = tl.reshape(b_g, [BT // BC, BC, b_g.shape[1]])
    return tl.cumsum(tl.where(tl.arange(0, BC)[None, :, None] == 0, 0.0, g3), 1)


@triton.jit
def anchor_steps(b_g, b_lam3, BT: tl.constexpr, BC: tl.constexpr):
    """``s [NC, BK]``: ``s_L = G_{a(L+1)} − G_{a(L)}``, the decay from the anchor of tile L to the next
    one (the last row is unused), from the tile-local sums: ``λ`` at the tile's last row plus the next
    tile's first gate."""
    NC: tl.constexpr = BT // BC
    o_n = tl.arange(0, NC)
    o_c = tl.arange(0, BC)
    g3 = tl.reshape(b_g, [NC, BC, b_g.shape[1]])
    lam_end = tl.sum(tl.where(o_c[None, :, None] == BC - 1, b_lam3, 0.0), 1)  # [NC, BK]
    first = tl.sum(tl.where(o_c[None, :, None] == 0, g3, 0.0), 1)  # [NC, BK] g at each anchor
    first_next = tl.sum(tl.where(o_n[:, None, None] + 1 == o_n[None, :, None], first[None, :, :], 0.0), 1)
    return lam_end + first_next


@triton.jit
def rows_of_tiles(E, BT: tl.constexpr, BC: tl.constexpr):
    """``[NC, N]`` per-tile values repeated over each tile's BC rows: ``[BT, N]``."""
    return tl.reshape(tl.broadcast_to(E[:, None, :], [BT // BC, BC, E.shape[1]]), [BT, E.shape[1]])


@triton.jit
def keys_to_anchor(b_s, I: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """``F [BT, BK]`` with ``F_j = exp(G_a − G_{a(J)})`` for a key j in tile J ≤ I (``a`` the anchor of tile
    I; ≤ 1), 0 for keys after tile I. Times ``exp(−λ_j)`` it rescales key j to tile I's anchor."""
    o_n = tl.arange(0, BT // BC)
    D = tl.cumsum(tl.where(o_n[:, None] < I, b_s, 0.0), 0, reverse=True)  # D_J = Σ_{J≤L<I} s_L ≤ 0
    return rows_of_tiles(tl.where(o_n[:, None] <= I, tl.exp(D), 0.0), BT, BC)


@triton.jit
def queries_from_anchor(b_s, J: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """``F [BT, BK]`` with ``F_i = exp(G_{a(L)} − G_a)`` for a row i in tile L ≥ J (``a`` the anchor of tile
    J; ≤ 1), 0 for rows before tile J. Times ``exp(λ_i)`` it is ``exp(G_i − G_a)``."""
    o_n = tl.arange(0, BT // BC)
    s = tl.where(o_n[:, None] >= J, b_s, 0.0)
    D = tl.cumsum(s, 0) - s  # D_L = Σ_{J≤L'<L} s_L' ≤ 0
    return rows_of_tiles(tl.where(o_n[:, None] >= J, tl.exp(D), 0.0), BT, BC)


@triton.jit
def tile_of(x3, I: tl.constexpr):
    """Tile ``I`` of ``x3 [BT/BC, BC, N]`` as ``[BC, N]``, exactly (a masked sum over the tile axis)."""
    return tl.sum(tl.where(tl.arange(0, x3.shape[0])[:, None, None] == I, x3, 0.0), 0)


@triton.jit
def decay_to_end(b_g):
    """``G_C − G_r = Σ_{r' > r} g_r'`` (reverse cumsum, same accuracy argument as :func:`tile_local_decay`)."""
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


@triton.jit
def tile_scores(P, M, D, I: tl.constexpr, q, k, b_lam3, b_kl, b_s, t0, T, o_k,
                H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Add one block of key channels to tile I's score rows ``P[I], M[I] [BC, BT]`` and diagonal tile ``D``."""
    o_i = t0 + I * BC + tl.arange(0, BC)
    m_ik = (o_i < T)[:, None] & (o_k < K)[None, :]
    p_ik = o_i[:, None] * (H * K) + o_k[None, :]
    b_qi = tl.load(q + p_ik, mask=m_ik, other=0.0).to(tl.float32)
    b_ki = tl.load(k + p_ik, mask=m_ik, other=0.0).to(tl.float32)
    b_lam = tile_of(b_lam3, I)  # [BC, BK] G_i − G_a for the tile's own rows
    b_qf = tl.exp(b_lam)  # ≤ 1
    # k̂_j = k_j exp(G_a − G_j) = k_j exp(−λ_j) · exp(G_a − G_{a(J)}), 0 for keys after the tile
    b_kh = b_kl * keys_to_anchor(b_s, I, BT, BC)
    P += mm_fp32(b_qi * b_qf, tl.trans(b_kh), PREC)
    M += mm_fp32(b_ki * b_qf, tl.trans(b_kh), PREC)
    D += mm_fp32(b_ki * b_qf, tl.trans(b_ki * tl.exp(-b_lam)), PREC)
    return P, M, D


@triton.jit
def solve_block_row(P, M, D, I: tl.constexpr, beta, Aqk, Akk_inv, Mkk, scale, t0, T,
                    H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Store tile I's scores and its block row of ``A⁻¹``: ``X_I = (I + L_II)⁻¹ (E_I − L_{I,<I} X_{<I})``
    with ``L = Diag(β) M``; the rows ``X_{<I}`` finished by earlier tiles are read back from ``Akk_inv``."""
    a = I * BC
    rows = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_t = t0 + rows
    o_i = t0 + a + o_c
    m_i = o_i < T
    p_iA = o_i[:, None] * (H * BT) + rows[None, :]
    tl.store(Aqk + p_iA, tl.where((a + o_c)[:, None] >= rows[None, :], P * scale, 0.0), mask=m_i[:, None])
    M = tl.where((a + o_c)[:, None] > rows[None, :], M, 0.0)
    tl.store(Mkk + p_iA, M, mask=m_i[:, None])
    b_bi = tl.load(beta + o_i * H, mask=m_i, other=0.0).to(tl.float32)
    b_Dinv = invert_unit_lower_16(tl.where(o_c[:, None] > o_c[None, :], D * b_bi[:, None], 0.0), BC)
    b_R = tl.where((a + o_c)[:, None] == rows[None, :], 1.0, 0.0)  # E_I [BC, BT]
    if I > 0:
        b_L = tl.where(rows[None, :] < a, M * b_bi[:, None], 0.0)  # L_{I,<I}
        b_Xp = tl.load(Akk_inv + o_t[:, None] * (H * BT) + rows[None, :],
                       mask=(o_t < T)[:, None] & (rows < a)[:, None], other=0.0)
        b_R = b_R - mm_fp32(b_L, b_Xp, PREC)
    tl.store(Akk_inv + p_iA, mm_fp32(b_Dinv, b_R, PREC), mask=m_i[:, None])
    tl.debug_barrier()  # the next tile (and W, U) read these rows back


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

    ``exp(G_a − G_j)`` is built from tile-local sums (see :func:`tile_local_decay`): ``exp(−λ_j)`` inside
    key j's tile (≤ e^75) times ``exp(G_a − G_{a(J)})`` between anchors (≤ 1).
    The inverse ``A⁻¹ = (I + L)⁻¹`` (``L = Diag(β) M``) is built one 16-row block at a time
    (:func:`solve_block_row`). Then ``W = A⁻¹ (β Γ ⊙ K)``, ``U = A⁻¹ (β V)``.
    Stores: ``Aqk = scale·P`` (fp32), ``Mkk = M`` (fp32, for dβ in the backward), ``Akk_inv`` (fp32),
    ``gl = G_C`` per chunk, ``qg = scale Γ ⊙ Q``, ``kg = exp(G_C − G) ⊙ K``, ``w`` (dtype DT), ``u`` (fp32).
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
    # score rows P[I], M[I] [BC, BT] and diagonal tiles D[I] [BC, BC] of the four tiles, summed over key blocks
    b_P0 = tl.zeros([BC, BT], dtype=tl.float32)
    b_P1, b_P2, b_P3, b_M0, b_M1, b_M2, b_M3 = b_P0, b_P0, b_P0, b_P0, b_P0, b_P0, b_P0
    b_D0 = tl.zeros([BC, BC], dtype=tl.float32)
    b_D1, b_D2, b_D3 = b_D0, b_D0, b_D0
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_tk = o_t[:, None] * (H * K) + o_k[None, :]
        b_g = tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32)  # padding rows: g = 0 (no decay)
        b_lam3 = tile_local_decay(b_g, BT, BC)  # [NC, BC, BK] λ = G − G_anchor, inside each tile
        b_s = anchor_steps(b_g, b_lam3, BT, BC)  # [NC, BK] G_{a(L+1)} − G_{a(L)}
        # k_j exp(−λ_j): key j rescaled to its own tile's anchor, ≤ e^75 (g ≥ −5)
        b_kl = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32) * tl.exp(-tl.reshape(b_lam3, [BT, BK]))
        b_P0, b_M0, b_D0 = tile_scores(b_P0, b_M0, b_D0, 0, q, k, b_lam3, b_kl, b_s, t0, T, o_k, H, K, BT, BC, PREC)
        b_P1, b_M1, b_D1 = tile_scores(b_P1, b_M1, b_D1, 1, q, k, b_lam3, b_kl, b_s, t0, T, o_k, H, K, BT, BC, PREC)
        b_P2, b_M2, b_D2 = tile_scores(b_P2, b_M2, b_D2, 2, q, k, b_lam3, b_kl, b_s, t0, T, o_k, H, K, BT, BC, PREC)
        b_P3, b_M3, b_D3 = tile_scores(b_P3, b_M3, b_D3, 3, q, k, b_lam3, b_kl, b_s, t0, T, o_k, H, K, BT, BC, PREC)
    solve_block_row(b_P0, b_M0, b_D0, 0, beta, Aqk, Akk_inv, Mkk, scale, t0, T, H, BT, BC, PREC)
    solve_block_row(b_P1, b_M1, b_D1, 1, beta, Aqk, Akk_inv, Mkk, scale, t0, T, H, BT, BC, PREC)
    solve_block_row(b_P2, b_M2, b_D2, 2, beta, Aqk, Akk_inv, Mkk, scale, t0, T, H, BT, BC, PREC)
    solve_block_row(b_P3, b_M3, b_D3, 3, beta, Aqk, Akk_inv, Mkk, scale, t0, T, H, BT, BC, PREC)

    b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_Ai = tl.load(Akk_inv + o_t[:, None] * (H * BT) + rows[None, :], mask=m_t[:, None], other=0.0)  # A⁻¹
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
