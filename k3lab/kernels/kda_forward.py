"""Triton forward kernels of chunkwise KDA (K3 spec §2.3), one program per chunk, tile or block.

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

Six kernels:

1. :func:`kda_fwd_gate_kernel`, grid (key blocks, chunks, B·H): the in-chunk cumulative decay ``G``
   (fp32 scratch), ``qg = scale Γ ⊙ Q``, ``kg = exp(G_C − G) ⊙ K`` and ``G_C``.
2. :func:`kda_fwd_scores_kernel`, grid (chunks, 16-token tiles, B·H): one tile's rows of the score
   matrices ``P`` and ``M``, and the inverse of its 16×16 diagonal block of ``I + Diag(β) M``.
3. :func:`kda_fwd_solve_kernel`, grid (chunks, B·H): A⁻¹ from the diagonal inverses (a nilpotent series).
4. :func:`kda_fwd_wu_kernel`, grid (key + value blocks, chunks, B·H): W or U of one block.
5. :func:`kda_fwd_state_kernel`, grid (V blocks, N·H), N = B (packed: the sequences): the only
   sequential part, chunk after chunk: ``Ṽ = U − W S`` and ``S ← Diag(Γ_C) S + kgᵀ Ṽ``; stores the
   state entering every chunk.
6. :func:`kda_fwd_output_kernel`, grid (chunks, V blocks, B·H): ``O = qg S + (scale P) Ṽ``.

**Packed sequences** (``IS_VARLEN``, fla's ``cu_seqlens``): B = 1 and the token axis holds N sequences,
sequence n at rows ``cu_seqlens[n] .. cu_seqlens[n+1] − 1``, each cut into its own chunks (its last one
masked). The chunk axis of a grid then runs over all chunks of all sequences, ``chunk_indices[c] =
(n, chunk of n)``, and the state kernels' grid over (V blocks, N·H), chunk after chunk of their own
sequence (its first chunk is ``chunk_offsets[n]``); states never cross a sequence boundary.
:func:`packed_chunk_span` and :func:`packed_sequence_span` give a program the first token and the length
of its sequence; without ``IS_VARLEN`` these are the batch row's ``b·T`` and ``T``, and that path compiles
to the same code as before packing existed.

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
def decay_to_end(b_g):
    """``G_C − G_r = Σ_{r' > r} g_r'`` as a reverse cumsum, summed from the chunk end rather than taken as a
    difference of two chunk-level cumsums (which would carry the ~1e-5 absolute error of G ≈ −300)."""
    return tl.cumsum(b_g, 0, reverse=True) - b_g


@triton.jit
def packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT: tl.constexpr):
    """``(bos, T)`` of chunk ``i_t`` of packed sequences, for the chunk-parallel kernels.

    A kernel's chunk ``i_t`` of batch row ``b`` has tokens at rows ``bos + i_t·BT + r`` (``r < BT``) of the
    ``[B·T]`` token rows with ``bos = b·T``, valid where ``i_t·BT + r < T``, and row ``b·NT + i_t`` in the
    per-chunk buffers (``gl``, ``hs``, ``dhs``). Packed (B = 1), ``i_t`` counts the chunks of all sequences,
    ``chunk_indices[i_t] = (n, c)`` (chunk c of sequence n), and stays the buffer row; the token coordinates
    are shifted by ``s = (i_t − c)·BT`` so that the chunk still starts at ``i_t·BT``:
    ``bos = cu_seqlens[n] − s`` and ``T = cu_seqlens[n+1] − bos`` (the end of sequence n). The kernel
    bodies are then the same for both.
    """
    i_n = tl.load(chunk_indices + 2 * i_t)
    bos = tl.load(cu_seqlens + i_n) - (i_t - tl.load(chunk_indices + 2 * i_t + 1)) * BT
    return bos, (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)


@triton.jit
def packed_sequence_span(i_n, cu_seqlens, chunk_offsets, BT: tl.constexpr):
    """``(bos, T, NT, boc)`` of packed sequence ``i_n`` for the state kernels: its first token row, its
    length, its number of chunks and the row of its first chunk in the per-chunk buffers."""
    bos = tl.load(cu_seqlens + i_n)
    T = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
    return bos, T, tl.cdiv(T, BT), tl.load(chunk_offsets + i_n).to(tl.int64)


@triton.jit
def invert_unit_lower_16_in_place(p_D, row_stride, n_rows, D, BC: tl.constexpr):
    """Overwrite a strictly lower-triangular ``D [BC, BC]`` in global memory (row r at ``p_D + r·row_stride``,
    only its first ``n_rows`` rows exist) with ``(I + D)⁻¹``, by forward substitution.

    Row r of the inverse is ``x_r = e_r − Σ_{s<r} D_rs x_s``: 15 steps on a 16×16 tile; row r of D is read
    back from memory (L1) rather than extracted from registers, which saves a reduction per step.
    """
    o_c = tl.arange(0, BC)
    tl.store(p_D + o_c[:, None] * row_stride + o_c[None, :], D, mask=(o_c < n_rows)[:, None])
    tl.debug_barrier()  # every row of D stored before any is read back
    X = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    for r in range(1, BC):
        m_r = (o_c < r) & (tl.full([BC], r, tl.int32) < n_rows)
        d_r = tl.load(p_D + r * row_stride + o_c, mask=m_r, other=0.0)  # [BC] row r of D
        x_r = tl.where(o_c == r, 1.0, 0.0) - tl.sum(d_r[:, None] * X, 0)
        X = tl.where(o_c[:, None] == r, x_r[None, :], X)
    tl.debug_barrier()  # every row of D read before the inverse overwrites it
    tl.store(p_D + o_c[:, None] * row_stride + o_c[None, :], X, mask=(o_c < n_rows)[:, None])


@triton.jit(do_not_specialize=["T"])
def kda_fwd_gate_kernel(
    q, k, g,            # inputs [B, T, H, K]
    G, qg, kg, gl,      # outputs: G fp32 (scratch for the next kernels), qg, kg [B, T, H, K]; gl [B, NT, H, K]
    scale, T,
    cu_seqlens, chunk_indices,  # packed sequences (IS_VARLEN): [N + 1] int64, [NT, 2] int32
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """One key block of one chunk of one head, grid (key blocks, chunks, B·H): the in-chunk cumulative
    decay ``G_r = Σ_{r'≤r} g_r'`` (one scan, stored for :func:`kda_fwd_scores_kernel` and
    :func:`kda_fwd_wu_kernel`), ``qg = scale Γ ⊙ Q``, ``kg = exp(G_C − G) ⊙ K`` (a reverse scan,
    :func:`decay_to_end`) and ``gl = G_C``."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)  # chunks per batch row (packed: i_b = 0)
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    seq = bos * H + i_h
    o_t = i_t * BT + tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_tk = (o_t < T)[:, None] & (o_k < K)[None, :]
    p_tk = seq * K + o_t[:, None] * (H * K) + o_k[None, :]
    b_g = tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32)  # padding rows: g = 0 (no decay)
    b_G = tl.cumsum(b_g, 0)
    tl.store(G + p_tk, b_G, mask=m_tk)
    b_q = tl.load(q + p_tk, mask=m_tk, other=0.0).to(tl.float32)
    tl.store(qg + p_tk, (b_q * tl.exp(b_G) * scale).to(qg.dtype.element_ty), mask=m_tk)
    b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
    tl.store(kg + p_tk, (b_k * tl.exp(decay_to_end(b_g))).to(kg.dtype.element_ty), mask=m_tk)
    tl.store(gl + ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K + o_k, tl.sum(b_g, 0), mask=o_k < K)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_scores_kernel(
    q, k, G, beta,              # inputs [B, T, H, K] (G: in-chunk cumulative decay, fp32), beta [B, T, H]
    Aqk, Mkk, Akk_inv,          # outputs [B, T, H, BT] (Akk_inv: only the diagonal 16×16 blocks)
    scale, T,
    cu_seqlens, chunk_indices,  # packed sequences (IS_VARLEN)
    H: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """One 16-token tile ``I`` (rows ``a = 16I .. a+15``) of one chunk of one head: its rows of the scores
    and the inverse of its diagonal block, grid (chunks, tiles, B·H).

    All factors are anchored at the tile's first row ``a``, as differences of the fp32 in-chunk cumsum
    ``G`` (≥ −320 in a chunk: the exponents carry ~2e-5 absolute error, the same as fla; in fp32 the
    output error went from 1.4e-7 to 2.9e-7 against summing from the anchor outwards)::

        λ_i  = G_i − G_a ∈ (−75, 0]   rows i of the tile;     e_j = G_a − G_j ≤ 0   keys j < a
        q̂_i = q_i ⊙ exp(λ_i),   k̃_i = k_i ⊙ exp(λ_i)                              (≤ 1)
        P[I, <a]  = q̂ (k ⊙ exp(e))ᵀ,   M[I, <a] = k̃ (k ⊙ exp(e))ᵀ                [16, 64], ≤ 1 factors
        P_II = q̂ (k_I ⊙ exp(−λ))ᵀ,     M_II = k̃ (k_I ⊙ exp(−λ))ᵀ                 [16, 16], exp(−λ) ≤ e^75

    Stores ``Aqk = scale·P`` (j ≤ i), ``Mkk = M`` (j < i), zeros after the tile, and
    ``(I + Diag(β) M_II)⁻¹`` (forward substitution) into the diagonal block of ``Akk_inv``, which
    :func:`kda_fwd_solve_kernel` reads and then overwrites with the whole inverse.
    """
    i_t, i_i, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    t0 = i_t * BT
    a = i_i * BC  # anchor row of the tile
    if t0 + a >= T:
        return
    seq = bos * H + i_h  # row (bos, h) of the [B·T·H] token-head rows
    q, k, G, beta = q + seq * K, k + seq * K, G + seq * K, beta + seq
    Aqk, Mkk, Akk_inv = Aqk + seq * BT, Mkk + seq * BT, Akk_inv + seq * BT
    rows = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_t = t0 + rows
    o_i = t0 + a + o_c  # [BC] token index of the tile's rows
    m_i = o_i < T
    b_P = tl.zeros([BC, BT], dtype=tl.float32)  # columns j < a
    b_M = tl.zeros([BC, BT], dtype=tl.float32)
    b_Pd = tl.zeros([BC, BC], dtype=tl.float32)  # diagonal block
    b_Md = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_ik = o_i[:, None] * (H * K) + o_k[None, :]
        m_ik = m_i[:, None] & m_k[None, :]
        b_Ga = tl.load(G + (t0 + a) * (H * K) + o_k, mask=m_k, other=0.0)  # [BK] G at the anchor
        b_lam = tl.where(m_ik, tl.load(G + p_ik, mask=m_ik, other=0.0) - b_Ga[None, :], 0.0)  # [BC, BK]
        b_qi = tl.load(q + p_ik, mask=m_ik, other=0.0).to(tl.float32)
        b_ki = tl.load(k + p_ik, mask=m_ik, other=0.0).to(tl.float32)
        b_f = tl.exp(b_lam)
        b_qh = b_qi * b_f  # q̂
        b_kt = b_ki * b_f  # k̃
        b_kin = tl.trans(b_ki * tl.exp(-b_lam))  # [BK, BC] k_j exp(G_a − G_j) inside the tile, ≤ e^75
        b_Pd += mm_fp32(b_qh, b_kin, PREC)
        b_Md += mm_fp32(b_kt, b_kin, PREC)
        if a > 0:
            p_tk = o_t[:, None] * (H * K) + o_k[None, :]
            m_tk = (rows < a)[:, None] & m_k[None, :]
            b_e = tl.where(m_tk, b_Ga[None, :] - tl.load(G + p_tk, mask=m_tk, other=0.0), 0.0)  # [BT, BK] e_j
            b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
            b_kh = tl.trans(b_k * tl.exp(b_e))  # [BK, BT], 0 for keys j ≥ a
            b_P += mm_fp32(b_qh, b_kh, PREC)
            b_M += mm_fp32(b_kt, b_kh, PREC)
    # columns outside the diagonal block (before it: the products; after it: zeros) and the block itself
    m_off = m_i[:, None] & ((rows < a) | (rows >= a + BC))[None, :]
    p_iA = o_i[:, None] * (H * BT) + rows[None, :]
    tl.store(Aqk + p_iA, b_P * scale, mask=m_off)
    tl.store(Mkk + p_iA, b_M, mask=m_off)
    p_dA = o_i[:, None] * (H * BT) + (a + o_c)[None, :]
    tl.store(Aqk + p_dA, tl.where(o_c[:, None] >= o_c[None, :], b_Pd * scale, 0.0), mask=m_i[:, None])
    b_Md = tl.where(o_c[:, None] > o_c[None, :], b_Md, 0.0)
    tl.store(Mkk + p_dA, b_Md, mask=m_i[:, None])
    b_bi = tl.load(beta + o_i * H, mask=m_i, other=0.0).to(tl.float32)
    invert_unit_lower_16_in_place(Akk_inv + (t0 + a) * (H * BT) + a, H * BT, T - t0 - a, b_Md * b_bi[:, None], BC)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_solve_kernel(
    beta, Mkk,      # inputs; Akk_inv holds the diagonal blocks' inverses on entry
    Akk_inv,        # output [B, T, H, BT]: A⁻¹ (fp32, zeros above the diagonal)
    T,
    cu_seqlens, chunk_indices,  # packed sequences (IS_VARLEN)
    H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """The UT transform ``A⁻¹ = (I + Diag(β) M)⁻¹`` of one chunk of one head, grid (chunks, B·H).

    With ``L = Diag(β) M = L_d + L_o`` (its diagonal 16×16 blocks and the rest) and
    ``D⁻¹ = (I + L_d)⁻¹`` (block-diagonal, from :func:`kda_fwd_scores_kernel`),
    ``I + L = (I + L_d)(I + N)`` with ``N = D⁻¹ L_o`` strictly block-lower over 4 blocks, so ``N⁴ = 0`` and::

        A⁻¹ = (I − N + N² − N³) D⁻¹ = (I − N)(I + N²) D⁻¹          four 64×64 products, no serial chain

    — the same terms as block forward substitution ``X_I = D_I⁻¹ (E_I − L_{I,<I} X_{<I})``.
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    seq = bos * H + i_h
    beta, Akk_inv, Mkk = beta + seq, Akk_inv + seq * BT, Mkk + seq * BT
    rows = tl.arange(0, BT)
    o_t = i_t * BT + rows
    m_t = o_t < T
    blk = rows // BC
    p_tA = o_t[:, None] * (H * BT) + rows[None, :]  # [BT, BT] offsets into Akk_inv, Mkk
    b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_Dinv = tl.load(Akk_inv + p_tA, mask=m_t[:, None] & (blk[:, None] == blk[None, :]), other=0.0)
    b_Lo = tl.load(Mkk + p_tA, mask=m_t[:, None] & (blk[:, None] > blk[None, :]), other=0.0) * b_beta[:, None]
    b_N = mm_fp32(b_Dinv, b_Lo, PREC)  # [BT, BT]
    b_Y = b_Dinv + mm_fp32(mm_fp32(b_N, b_N, PREC), b_Dinv, PREC)  # (I + N²) D⁻¹
    tl.store(Akk_inv + p_tA, b_Y - mm_fp32(b_N, b_Y, PREC), mask=m_t[:, None])


@triton.jit(do_not_specialize=["T"])
def kda_fwd_wu_kernel(
    k, v, G, beta, Akk_inv,     # inputs (G: in-chunk cumulative decay, fp32)
    w, u,                       # outputs
    T,
    cu_seqlens, chunk_indices,  # packed sequences (IS_VARLEN)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """One key block or one value block of one chunk of one head, grid (key + value blocks, chunks, B·H):
    ``W = A⁻¹ (β Γ ⊙ K)`` (stored in the dtype of k) or ``U = A⁻¹ (β V)`` (fp32)."""
    i_blk, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NK = tl.cdiv(K, BK)
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    seq = bos * H + i_h
    rows = tl.arange(0, BT)
    o_t = i_t * BT + rows
    m_t = o_t < T
    b_beta = tl.load(beta + seq + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_Ai = tl.load(Akk_inv + seq * BT + o_t[:, None] * (H * BT) + rows[None, :], mask=m_t[:, None], other=0.0)
    if i_blk < NK:
        o_k = i_blk * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_tk = seq * K + o_t[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
        b_gam = tl.exp(tl.load(G + p_tk, mask=m_tk, other=0.0))  # Γ ≤ 1
        tl.store(w + p_tk, mm_fp32(b_Ai, b_k * b_beta[:, None] * b_gam, PREC).to(w.dtype.element_ty), mask=m_tk)
    else:
        o_v = (i_blk - NK) * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = seq * V + o_t[:, None] * (H * V) + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(u + p_tv, mm_fp32(b_Ai, b_v * b_beta[:, None], PREC), mask=m_tv)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_state_kernel(
    w, u, kg, gl, h0,          # inputs (h0 [B, H, K, V] fp32, read if HAS_H0)
    hs, v_new, ht,             # outputs: state entering each chunk [B, NT, H, K, V], Ṽ [B, T, H, V], final state
    T,
    cu_seqlens, chunk_offsets,  # packed sequences (IS_VARLEN): [N + 1] int64, first chunk of each [N + 1] int32
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """The recurrence across chunks, for a ``[K, BV]`` slice of the state (fp32 in registers)::

        for each chunk t:   hs[t] = S;   Ṽ = U − W S;   S ← Diag(Γ_C) S + kgᵀ Ṽ

    Value columns never mix, so the state splits along V into independent programs; grid (V blocks,
    N·H) over the N sequences (batch rows, or packed sequences with their initial/final states ``[N, H, K, V]``).
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    NT = tl.cdiv(T, BT)
    bos = i_n.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T, NT, boc = packed_sequence_span(i_n, cu_seqlens, chunk_offsets, BT)
    seq = bos * H + i_h
    w, kg, u, v_new = w + seq * K, kg + seq * K, u + seq * V, v_new + seq * V
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]  # [BK, BV] inside one [K, V] state
    if HAS_H0:
        b_h = tl.load(h0 + (i_n.to(tl.int64) * H + i_h) * K * V + p_kv, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_t in range(NT):
        i_c = i_n.to(tl.int64) * NT + i_t  # row of the chunk in the per-chunk buffers
        if IS_VARLEN:
            i_c = boc + i_t
        tl.store(hs + (i_c * H + i_h) * K * V + p_kv, b_h.to(hs.dtype.element_ty), mask=m_kv)
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
        b_gl = tl.load(gl + (i_c * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_h = b_h * tl.exp(b_gl)[:, None] + mm(tl.trans(b_kg), b_vn, DT, PREC)
    if STORE_HT:
        tl.store(ht + (i_n.to(tl.int64) * H + i_h) * K * V + p_kv, b_h, mask=m_kv)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_output_kernel(
    qg, hs, Aqk, v_new, o,
    T,
    cu_seqlens, chunk_indices,  # packed sequences (IS_VARLEN)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """``O = qg S + Aqk Ṽ`` for one chunk and one value block: the inter-chunk part reads the state
    entering the chunk, the intra-chunk part the (already scaled, lower-triangular) scores."""
    i_t, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)  # chunks per batch row (packed: i_b = 0)
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    seq = bos * H + i_h
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
