"""Triton forward kernels of chunkwise KDA (docs/k3_reference.md §2.3), one program per chunk, tile or block.

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
   (fp32 in log2 units, ``G₂ = log₂(e)·G``, also saved for the backward), ``qg = scale Γ ⊙ Q``,
   ``kg = exp(G_C − G) ⊙ K`` and ``G_C``.
2. :func:`kda_fwd_scores_kernel`, grid (chunks, 16-token tiles, B·H): one tile's rows of the score
   matrices ``P`` and ``M``, and the inverse of its 16×16 diagonal block of ``I + Diag(β) M``.
3. :func:`kda_fwd_solve_kernel`, grid (chunks, B·H): A⁻¹ from the diagonal inverses (a nilpotent series).
4. :func:`kda_fwd_wu_kernel`, grid (block groups, chunks, B·H): W and/or U of one chunk, one or all of its
   blocks; with one program per chunk it can do step 3 itself first (``SOLVE``: then 3 is not launched).
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
of its sequence; without ``IS_VARLEN`` these are the batch row's ``b·T`` and ``T`` (the packed branches
compile away).

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

LOG2E = tl.constexpr(1.4426950408889634)  # log₂(e): exp(x) = exp2(LOG2E·x)

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
    if INTERPRET:  # the interpreter multiplies in fp32 whatever the precision, and knows no "bf16x3"
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
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
def invert_unit_lower_16(L, BC: tl.constexpr):
    """``(I + L)⁻¹`` of a strictly lower-triangular ``L [BC, BC]`` (BC = 16) in registers, by 4×4 blocks::

        L = L_d + L_o       L_d: the four 4×4 diagonal blocks, L_o: the rest (strictly block-lower)
        X = (I + L_d)⁻¹     3 steps t = 1, 2, 3: rows r ≡ t (mod 4) of X ← e_r − L_d[r, :] X
        N = X L_o           strictly block-lower over 4 blocks, N⁴ = 0
        (I + L)⁻¹ = (I + N)⁻¹ X = (I − N)(I + N²) X

    Seven ``[16, 16] × [16, 16]`` products in exact fp32 (``ieee``: FMAs, ~900 per thread with one warp),
    one after the other, in place of 15 serial row steps of forward substitution (each a load from memory
    and a cross-thread reduction) and no round trip through global memory. The same terms as block
    forward substitution over 4×4 blocks; relative error against the float64 inverse ≤ 1e-7 (as forward
    substitution) on test matrices with entries in [−1, 1].
    """
    o_c = tl.arange(0, BC)
    blk = o_c // 4
    L_d = tl.where(blk[:, None] == blk[None, :], L, 0.0)
    X = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)  # I
    for t in tl.static_range(1, 4):
        X -= tl.dot(tl.where((o_c % 4 == t)[:, None], L_d, 0.0), X, input_precision="ieee")
    N = tl.dot(X, L - L_d, input_precision="ieee")
    Y = X + tl.dot(tl.dot(N, N, input_precision="ieee"), X, input_precision="ieee")
    return Y - tl.dot(N, Y, input_precision="ieee")


@triton.jit(do_not_specialize=["T"])
def kda_fwd_gate_kernel(
    q, k, g,            # inputs [B, T, H, K]
    G2, qg, kg, gl,     # outputs [B, T, H, K] (G2 = log₂(e)·G fp32, read by scores, wu, backward); gl [B, NT, H, K]
    scale, T,
    cu_seqlens, chunk_indices,  # packed sequences (IS_VARLEN): [N + 1] int64, [NT, 2] int32
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """One key block of one chunk of one head, grid (key blocks, chunks, B·H): the in-chunk cumulative
    decay ``G_r = Σ_{r'≤r} g_r'`` (the one scan; stored as ``G₂ = log₂(e)·G`` for
    :func:`kda_fwd_scores_kernel` and :func:`kda_fwd_wu_kernel`, whose factors ``exp(G_i − G_j) =
    exp2(G₂_i − G₂_j)`` are then one ``ex2`` each, without the multiply by log₂(e) that ``tl.exp`` adds),
    ``gl = G_C`` (natural units, for the state kernels and the backward), ``qg = scale Γ ⊙ Q`` and
    ``kg = exp(G_C − G) ⊙ K``. ``G_C − G_r ∈ [−320, 0]`` is taken as the difference of two fp32 sums
    (absolute error ~ulp(460) ≈ 3e-5 in log2 units, a ~2e-5 relative error of the factor, as fla) rather
    than by a second, reverse scan."""
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
    b_g2 = b_g * LOG2E
    b_G2 = tl.cumsum(b_g2, 0)  # log₂(e)·G, summed in log2 units (no extra rounding of the sum)
    b_GC2 = tl.sum(b_g2, 0)  # [BK] log₂(e)·G_C
    tl.store(G2 + p_tk, b_G2, mask=m_tk)
    b_q = tl.load(q + p_tk, mask=m_tk, other=0.0).to(tl.float32)
    tl.store(qg + p_tk, (b_q * tl.exp2(b_G2) * scale).to(qg.dtype.element_ty), mask=m_tk)
    b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
    tl.store(kg + p_tk, (b_k * tl.exp2(b_GC2[None, :] - b_G2)).to(kg.dtype.element_ty), mask=m_tk)
    tl.store(gl + ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K + o_k, b_GC2 / LOG2E, mask=o_k < K)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_scores_kernel(
    q, k, G2, beta,             # inputs [B, T, H, K] (G2: in-chunk cumulative decay, log2 units), beta [B, T, H]
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
    output error went from 1.4e-7 to 2.9e-7 against summing from the anchor outwards). With ``J`` one of
    the tiles before ``I`` (keys ``j ∈ J``, all ``j < a``)::

        λ_i  = G_i − G_a ∈ (−75, 0]   rows i of the tile;     e_j = G_a − G_j ≤ 0   keys j ∈ J
        q̂_i = q_i ⊙ exp(λ_i),   k̃_i = k_i ⊙ exp(λ_i)                              [16, K], ≤ 1 factors
        P_IJ = q̂ (k_J ⊙ exp(e))ᵀ,     M_IJ = k̃ (k_J ⊙ exp(e))ᵀ                  [16, 16], ≤ 1 factors
        P_II = q̂ (k_I ⊙ exp(−λ))ᵀ,    M_II = k̃ (k_I ⊙ exp(−λ))ᵀ                 [16, 16], exp(−λ) ≤ e^75

    so ``exp(G_i − G_j) = exp(λ_i) · exp(G_a − G_j)`` splits into two factors that stay inside fp32 range
    (every exponent is taken as ``exp2`` of the stored ``G₂ = log₂(e)·G``; e^75 ≈ 2^108 < 2^128).

    Work of this program: the tile's q, k, G and, for each of the ``I`` earlier tiles, its k and G
    (``[16, K]`` each, read once), ``16·(2 + I)·K`` exps and ``2(1 + I)`` products ``[16, BK] × [BK, 16]``
    per key block; the earlier tiles are ``NC − 1 = 3`` static slots of which those with ``J < I`` run.
    (The ``[64, BK]`` key block of the whole chunk, rows ≥ a masked, would read and exponentiate 64 rows
    whatever ``I`` is: ``16·(2 + 4)·K`` exps per program instead of ``16·(2 + I)·K``.)

    Stores ``Aqk = scale·P`` (j ≤ i), ``Mkk = M`` (j < i), zeros after the tile, and
    ``(I + Diag(β) M_II)⁻¹`` (:func:`invert_unit_lower_16`, in registers) into the diagonal block of
    ``Akk_inv``, which :func:`ut_transform` (in :func:`kda_fwd_solve_kernel`, or in
    :func:`kda_fwd_wu_kernel` with ``SOLVE``) reads and then overwrites with the whole inverse.
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
    q, k, G2, beta = q + seq * K, k + seq * K, G2 + seq * K, beta + seq
    Aqk, Mkk, Akk_inv = Aqk + seq * BT, Mkk + seq * BT, Akk_inv + seq * BT
    NC: tl.constexpr = BT // BC
    o_c = tl.arange(0, BC)
    o_i = t0 + a + o_c  # [BC] token index of the tile's rows
    m_i = o_i < T
    b_P0 = tl.zeros([BC, BC], dtype=tl.float32)  # P_IJ, M_IJ for the earlier tiles J = 0, 1, 2
    b_M0 = tl.zeros([BC, BC], dtype=tl.float32)
    b_P1 = tl.zeros([BC, BC], dtype=tl.float32)
    b_M1 = tl.zeros([BC, BC], dtype=tl.float32)
    b_P2 = tl.zeros([BC, BC], dtype=tl.float32)
    b_M2 = tl.zeros([BC, BC], dtype=tl.float32)
    b_Pd = tl.zeros([BC, BC], dtype=tl.float32)  # diagonal block
    b_Md = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_ik = o_i[:, None] * (H * K) + o_k[None, :]
        m_ik = m_i[:, None] & m_k[None, :]
        b_Ga = tl.load(G2 + (t0 + a) * (H * K) + o_k, mask=m_k, other=0.0)  # [BK] log₂(e)·G at the anchor
        b_lam = tl.where(m_ik, tl.load(G2 + p_ik, mask=m_ik, other=0.0) - b_Ga[None, :], 0.0)  # [BC, BK] λ·log₂(e)
        b_qi = tl.load(q + p_ik, mask=m_ik, other=0.0).to(tl.float32)
        b_ki = tl.load(k + p_ik, mask=m_ik, other=0.0).to(tl.float32)
        b_f = tl.exp2(b_lam)
        b_qh = b_qi * b_f  # q̂
        b_kt = b_ki * b_f  # k̃
        b_kin = tl.trans(b_ki * tl.exp2(-b_lam))  # [BK, BC] k_j exp(G_a − G_j) inside the tile, ≤ e^75
        b_Pd += mm_fp32(b_qh, b_kin, PREC)
        b_Md += mm_fp32(b_kt, b_kin, PREC)
        for j in tl.static_range(NC - 1):
            if j < i_i:
                p_jk = (t0 + j * BC + o_c)[:, None] * (H * K) + o_k[None, :]  # rows < a: valid tokens
                b_e = b_Ga[None, :] - tl.load(G2 + p_jk, mask=m_k[None, :], other=0.0)  # [BC, BK] e_j·log₂(e) ≤ 0
                b_kh = tl.trans(tl.load(k + p_jk, mask=m_k[None, :], other=0.0).to(tl.float32) * tl.exp2(b_e))
                if j == 0:
                    b_P0 += mm_fp32(b_qh, b_kh, PREC)
                    b_M0 += mm_fp32(b_kt, b_kh, PREC)
                elif j == 1:
                    b_P1 += mm_fp32(b_qh, b_kh, PREC)
                    b_M1 += mm_fp32(b_kt, b_kh, PREC)
                else:
                    b_P2 += mm_fp32(b_qh, b_kh, PREC)
                    b_M2 += mm_fp32(b_kt, b_kh, PREC)
    # row block I of Aqk and Mkk, column block by column block: the earlier tiles, the diagonal, zeros after
    p_iA = o_i[:, None] * (H * BT) + o_c[None, :]  # [BC, BC] column block 0
    m_iA = m_i[:, None]
    for j in tl.static_range(NC - 1):
        if j < i_i:
            if j == 0:
                b_Pj, b_Mj = b_P0, b_M0
            elif j == 1:
                b_Pj, b_Mj = b_P1, b_M1
            else:
                b_Pj, b_Mj = b_P2, b_M2
            tl.store(Aqk + p_iA + j * BC, b_Pj * scale, mask=m_iA)
            tl.store(Mkk + p_iA + j * BC, b_Mj, mask=m_iA)
    for j in tl.static_range(1, NC):
        if j > i_i:
            tl.store(Aqk + p_iA + j * BC, tl.zeros([BC, BC], dtype=tl.float32), mask=m_iA)
            tl.store(Mkk + p_iA + j * BC, tl.zeros([BC, BC], dtype=tl.float32), mask=m_iA)
    tl.store(Aqk + p_iA + a, tl.where(o_c[:, None] >= o_c[None, :], b_Pd * scale, 0.0), mask=m_iA)
    b_Md = tl.where(o_c[:, None] > o_c[None, :], b_Md, 0.0)
    tl.store(Mkk + p_iA + a, b_Md, mask=m_iA)
    b_bi = tl.load(beta + o_i * H, mask=m_i, other=0.0).to(tl.float32)
    tl.store(Akk_inv + p_iA + a, invert_unit_lower_16(b_Md * b_bi[:, None], BC), mask=m_iA)


@triton.jit
def ut_transform(Akk_inv, Mkk, b_beta, o_t, m_t, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 PREC: tl.constexpr):
    """``A⁻¹ = (I + Diag(β) M)⁻¹ [BT, BT]`` of one chunk (rows ``o_t`` of ``Akk_inv``/``Mkk``, already
    offset to the head's first row; ``b_beta`` [BT]), stored over ``Akk_inv`` and returned.

    With ``L = Diag(β) M = L_d + L_o`` (its diagonal 16×16 blocks and the rest) and
    ``D⁻¹ = (I + L_d)⁻¹`` (block-diagonal, from :func:`kda_fwd_scores_kernel`),
    ``I + L = (I + L_d)(I + N)`` with ``N = D⁻¹ L_o`` strictly block-lower over 4 blocks, so ``N⁴ = 0`` and::

        A⁻¹ = (I − N + N² − N³) D⁻¹ = (I − N)(I + N²) D⁻¹          four 64×64 products, no serial chain

    — the same terms as block forward substitution ``X_I = D_I⁻¹ (E_I − L_{I,<I} X_{<I})``.
    """
    rows = tl.arange(0, BT)
    blk = rows // BC
    p_tA = o_t[:, None] * (H * BT) + rows[None, :]  # [BT, BT] offsets into Akk_inv, Mkk
    b_Dinv = tl.load(Akk_inv + p_tA, mask=m_t[:, None] & (blk[:, None] == blk[None, :]), other=0.0)
    b_Lo = tl.load(Mkk + p_tA, mask=m_t[:, None] & (blk[:, None] > blk[None, :]), other=0.0) * b_beta[:, None]
    b_N = mm_fp32(b_Dinv, b_Lo, PREC)  # [BT, BT]
    b_Y = b_Dinv + mm_fp32(mm_fp32(b_N, b_N, PREC), b_Dinv, PREC)  # (I + N²) D⁻¹
    b_Ai = b_Y - mm_fp32(b_N, b_Y, PREC)
    tl.store(Akk_inv + p_tA, b_Ai, mask=m_t[:, None])
    return b_Ai


@triton.jit(do_not_specialize=["T"])
def kda_fwd_solve_kernel(
    beta, Mkk,      # inputs; Akk_inv holds the diagonal blocks' inverses on entry
    Akk_inv,        # output [B, T, H, BT]: A⁻¹ (fp32, zeros above the diagonal)
    T,
    cu_seqlens, chunk_indices,  # packed sequences (IS_VARLEN)
    H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """The UT transform ``A⁻¹ = (I + Diag(β) M)⁻¹`` of one chunk of one head, grid (chunks, B·H), by
    :func:`ut_transform` (when :func:`kda_fwd_wu_kernel` runs with ``SOLVE``, it does this itself and this
    kernel is not launched)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    seq = bos * H + i_h
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_beta = tl.load(beta + seq + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    ut_transform(Akk_inv + seq * BT, Mkk + seq * BT, b_beta, o_t, m_t, H, BT, BC, PREC)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_wu_kernel(
    k, v, G2, beta, Mkk, Akk_inv,  # inputs (G2: in-chunk cumulative decay, log2 units; Mkk read if SOLVE)
    w, u,                         # outputs (and A⁻¹ over Akk_inv if SOLVE)
    T,
    cu_seqlens, chunk_indices,  # packed sequences (IS_VARLEN)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BLOCKS: tl.constexpr,
    SOLVE: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """``BLOCKS`` consecutive blocks of the ``NK`` key blocks then ``NV`` value blocks of one chunk of one
    head, grid (⌈(NK + NV) / BLOCKS⌉, chunks, B·H): ``W = A⁻¹ (β Γ ⊙ K)`` (stored in the dtype of k) for a
    key block, ``U = A⁻¹ (β V)`` (fp32) for a value block. A program reads ``A⁻¹ [BT, BT]`` (fp32) once for
    all its blocks: ``BLOCKS = NK + NV`` is one program per chunk (the block loop can then be pipelined
    with ``num_stages ≥ 2``), ``BLOCKS = 1`` one program per block. With ``SOLVE`` (one program per chunk
    only) the program first computes A⁻¹ itself from the diagonal inverses and ``Mkk``
    (:func:`ut_transform`, which also stores it for the backward), in place of
    :func:`kda_fwd_solve_kernel`: A⁻¹ then never makes a round trip through memory before use."""
    i_p, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NK = tl.cdiv(K, BK)
    NV = tl.cdiv(V, BV)
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    seq = bos * H + i_h
    rows = tl.arange(0, BT)
    o_t = i_t * BT + rows
    m_t = o_t < T
    b_beta = tl.load(beta + seq + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    if SOLVE:
        b_Ai = ut_transform(Akk_inv + seq * BT, Mkk + seq * BT, b_beta, o_t, m_t, H, BT, BC, PREC)
    else:
        b_Ai = tl.load(Akk_inv + seq * BT + o_t[:, None] * (H * BT) + rows[None, :], mask=m_t[:, None], other=0.0)
    lo = i_p * BLOCKS  # this program's blocks: lo .. lo + BLOCKS − 1 of the NK + NV
    for i_k in range(lo, tl.minimum(lo + BLOCKS, NK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_tk = seq * K + o_t[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
        b_gam = tl.exp2(tl.load(G2 + p_tk, mask=m_tk, other=0.0))  # Γ ≤ 1
        tl.store(w + p_tk, mm_fp32(b_Ai, b_k * b_beta[:, None] * b_gam, PREC).to(w.dtype.element_ty), mask=m_tk)
    for i_v in range(tl.maximum(lo - NK, 0), tl.minimum(lo + BLOCKS - NK, NV)):
        o_v = i_v * BV + tl.arange(0, BV)
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
