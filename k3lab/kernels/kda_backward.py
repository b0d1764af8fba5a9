"""Triton backward kernels of chunkwise KDA (docs/k3_reference.md §2.3); notation as in :mod:`k3lab.kernels.kda_forward`.

The forward saves the state entering every chunk (``hs``), the pseudo-values ``Ṽ``, ``A⁻¹``, ``M``,
the scaled scores ``Aqk = scale·P``, the in-chunk cumulative decay ``G`` (as ``G₂ = log₂(e)·G``) and
``qg``, ``kg``, ``W``, ``G_C``: the backward recomputes nothing sequential and runs no scan but the final
one for ``dg``. With ``dS`` the gradient of the state *leaving* a chunk, and ``dO``:

1. :func:`kda_bwd_dv_local_kernel`, grid (chunks, B·H): the chunk-local part of the output's gradient,
   ``dP = scale·(dO Ṽᵀ)`` (lower, to a scratch buffer) and ``dṼ_local = Aqkᵀ dO``, in parallel over chunks.
2. :func:`kda_bwd_state_kernel`, grid (V blocks, N·H), N = B (packed: the sequences), chunks in
   reverse — the only sequential part::

        dṼ = dṼ_local + kg dS                        (Ṽ feeds the output and the next state)
        dS ← Diag(Γ_C) dS + qgᵀ dO − Wᵀ dṼ           (gradient of the state entering the chunk)

   It stores ``dS`` per chunk and ``dṼ`` (= ``dU``, since ``Ṽ = U − W S``); the last ``dS`` is ``dh0``.
3. :func:`kda_bwd_wy_key_kernel`, grid (K blocks, chunks, B·H): the chunk-level (inter-chunk and
   UT-transform) gradients of one block of key channels::

        dq   = scale Γ ⊙ (dO Sᵀ)                      dK̃ = Ṽ dS'ᵀ → dk += exp(G_C − G) ⊙ dK̃
        dW   = −dṼ Sᵀ            d(βΓK) = A⁻ᵀ dW       → dk, a partial dβ per key block

   plus ``dG`` from every place a decay appears (``q ⊙ dq`` where G enters with a plus sign,
   ``−k ⊙ dk`` where it enters with a minus sign, and the ``G_C`` terms on the last row).
   Partial ``dq, dk, dG`` (fp32) go to scratch buffers.
4. :func:`kda_bwd_wy_value_kernel`, grid (chunks, B·H): the value side and the UT transform. Since
   ``A Ṽ = βV − βΓK S =: Y``, with ``dY = A⁻ᵀ dṼ``::

        d(βV) = dY → dv, dβ;    dL = −dY Ṽᵀ (strictly lower);    dβ_i += Σ_j dL_ij M_ij;    dM = Diag(β) dL

   and the final ``dβ`` (adding the key blocks' partials); ``dM`` goes to a scratch buffer.
5. :func:`kda_bwd_intra_kernel`, grid (K blocks × 16-token tiles, chunks, B·H): the gradients through
   the scores ``P, M`` for one tile's rows and columns, anchored like the forward; adds its terms to
   ``dG`` in place.
6. :func:`kda_bwd_dg_kernel`, grid (K blocks, chunks, B·H): ``dg = reverse cumsum of dG`` in the chunk.

Packed sequences (``IS_VARLEN``) as in the forward: the chunk grids run over the chunks of all
sequences, :func:`kda_bwd_state_kernel` over the N sequences; ``dht`` and ``dh0`` are ``[N, H, K, V]``.
"""

import triton
import triton.language as tl

from k3lab.kernels.kda_forward import LOG2E, mm, mm_fp32, packed_chunk_span, packed_sequence_span


@triton.jit(do_not_specialize=["T"])
def kda_bwd_dv_local_kernel(
    Aqk, do, v_new,   # inputs
    dP, dv_new,       # outputs: dP [B, T, H, BT] fp32, the local part of dṼ [B, T, H, V] fp32
    scale, T,
    cu_seqlens, chunk_indices,  # packed sequences (IS_VARLEN): [N + 1] int64, [NT, 2] int32
    H: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """The parallel, chunk-local part of the output's gradient, for one chunk::

        dP = scale · dO Ṽᵀ   (lower)         dṼ_local = Aqkᵀ dO

    ``dṼ_local`` seeds ``dv_new``; :func:`kda_bwd_state_kernel` adds ``kg dS`` in place.
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    seq = bos * H + i_h
    Aqk, dP, do, v_new, dv_new = Aqk + seq * BT, dP + seq * BT, do + seq * V, v_new + seq * V, dv_new + seq * V
    rows = tl.arange(0, BT)
    o_t = i_t * BT + rows
    m_t = o_t < T
    p_tA = o_t[:, None] * (H * BT) + rows[None, :]
    b_A = tl.load(Aqk + p_tA, mask=m_t[:, None], other=0.0)  # [BT, BT] scale·P
    b_dP = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = o_t[:, None] * (H * V) + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        b_vn = tl.load(v_new + p_tv, mask=m_tv, other=0.0)
        b_dP += mm(b_do, tl.trans(b_vn), DT, PREC)
        tl.store(dv_new + p_tv, mm_fp32(tl.trans(b_A), b_do, PREC), mask=m_tv)
    tl.store(dP + p_tA, tl.where(rows[:, None] >= rows[None, :], b_dP * scale, 0.0), mask=m_t[:, None])


@triton.jit(do_not_specialize=["T"])
def kda_bwd_state_kernel(
    qg, kg, w, gl, do, dht,   # inputs (dht [B, H, K, V] fp32, read if HAS_DHT)
    dhs, dv_new, dh0,         # outputs: dS per chunk [B, NT, H, K, V], dṼ [B, T, H, V] (in: Aqkᵀ dO), dh0 fp32
    T,
    cu_seqlens, chunk_offsets,  # packed sequences (IS_VARLEN): [N + 1] int64, first chunk of each [N + 1] int32
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Reverse recurrence for a ``[K, BV]`` slice of the state gradient (fp32 in registers)::

        for each chunk t, last to first:
            dhs[t] = dS;   dṼ = dṼ_local + kg dS;   dS ← Diag(Γ_C) dS + qgᵀ dO − Wᵀ dṼ

    ``dṼ_local = Aqkᵀ dO`` comes from :func:`kda_bwd_dv_local_kernel`; ``dṼ`` overwrites it.
    Grid (V blocks, N·H) over the N sequences, as :func:`kda_fwd_state_kernel`.
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    NT = tl.cdiv(T, BT)
    bos = i_n.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T, NT, boc = packed_sequence_span(i_n, cu_seqlens, chunk_offsets, BT)
    seq = bos * H + i_h
    qg, kg, w = qg + seq * K, kg + seq * K, w + seq * K
    do, dv_new = do + seq * V, dv_new + seq * V
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    if HAS_DHT:
        b_dh = tl.load(dht + (i_n.to(tl.int64) * H + i_h) * K * V + p_kv, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    for i_r in range(NT):
        i_t = NT - 1 - i_r
        i_c = i_n.to(tl.int64) * NT + i_t  # row of the chunk in the per-chunk buffers
        if IS_VARLEN:
            i_c = boc + i_t
        p_dh = dhs + (i_c * H + i_h) * K * V
        tl.store(p_dh + p_kv, b_dh.to(dhs.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        p_tk = o_t[:, None] * (H * K) + o_k[None, :]
        p_tv = o_t[:, None] * (H * V) + o_v[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        b_kg = tl.load(kg + p_tk, mask=m_tk, other=0.0)
        b_dvn = tl.load(dv_new + p_tv, mask=m_tv, other=0.0) + mm(b_kg, b_dh, DT, PREC)  # [BT, BV]
        tl.store(dv_new + p_tv, b_dvn, mask=m_tv)
        b_qg = tl.load(qg + p_tk, mask=m_tk, other=0.0)
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
        b_gl = tl.load(gl + (i_c * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_dh = b_dh * tl.exp(b_gl)[:, None] + mm(tl.trans(b_qg), b_do, DT, PREC) - mm(tl.trans(b_w), b_dvn, DT, PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n.to(tl.int64) * H + i_h) * K * V + p_kv, b_dh, mask=m_kv)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_wy_key_kernel(
    q, k, G2, gl, beta, Akk_inv, hs, dhs, do, v_new, dv_new,   # inputs (G2 = log₂(e)·G, fp32)
    dq_p, dk_p, dG_p, dbeta_p,                           # outputs (dbeta_p [B, T, H, NK] fp32)
    scale, T,
    cu_seqlens, chunk_indices,                           # packed sequences (IS_VARLEN)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Key side of the chunk-level gradients for one chunk and one block of ``BK`` key channels.
    ``S`` is ``hs[t]``, the state entering the chunk, and ``dS'`` is ``dhs[t]``, the gradient of the
    state leaving it::

        dq = scale Γ ⊙ (dO Sᵀ)       dk = exp(G_C − G) ⊙ (Ṽ dS'ᵀ) + βΓ ⊙ d(βΓK)
        d(βΓK) = −A⁻ᵀ (dṼ Sᵀ)        dβ_partial = Σ_{d in block} d(βΓK) ⊙ Γ ⊙ K

    Decay gradients (``dG`` before the in-chunk reverse cumsum), for the terms handled here::

        dG += q ⊙ dq                 (Γ ⊙ Q in the output)
        dG −= kg ⊙ dK̃                (exp(−G) in kg = exp(G_C − G) ⊙ K, dK̃ = Ṽ dS'ᵀ)
        dG += βΓk ⊙ d(βΓK)          (Γ in W)
        dG_C += Γ_C ⊙ Σ_v S ⊙ dS' + Σ_r kg ⊙ dK̃     (on the last valid row)

    Per program: three ``[BT, V] × [V, BK]`` products in DT, one ``[BT, BT] × [BT, BK]`` in tf32; the
    decays are ``exp2`` of the forward's in-chunk cumsum in log2 units, ``G₂ = log₂(e)·G``, and of ``G_C``
    (no scans).
    """
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NK = tl.num_programs(0)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)  # chunks per batch row (packed: i_b = 0)
    t0 = i_t * BT
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    seq = bos * H + i_h
    q, k, G2, dq_p, dk_p, dG_p = q + seq * K, k + seq * K, G2 + seq * K, dq_p + seq * K, dk_p + seq * K, dG_p + seq * K
    do, v_new, dv_new = do + seq * V, v_new + seq * V, dv_new + seq * V
    beta, dbeta_p, Akk_inv = beta + seq, dbeta_p + seq * NK, Akk_inv + seq * BT
    rows = tl.arange(0, BT)
    o_t = t0 + rows
    m_t = o_t < T
    last = tl.minimum(T - t0, BT) - 1  # last valid row of the chunk
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    p_chunk = (i_b.to(tl.int64) * NT + i_t) * H + i_h  # row of the per-chunk buffers gl, hs, dhs
    p_state = p_chunk * K * V
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)  # dO Sᵀ
    b_dkt = tl.zeros([BT, BK], dtype=tl.float32)  # Ṽ dS'ᵀ  (gradient of kg)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)   # dṼ Sᵀ  (= −dW)
    b_hdh = tl.zeros([BK], dtype=tl.float32)      # Σ_v S ⊙ dS'
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        m_kv = m_k[:, None] & (o_v < V)[None, :]
        p_tv = o_t[:, None] * (H * V) + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        b_vn = tl.load(v_new + p_tv, mask=m_tv, other=0.0)
        b_dvn = tl.load(dv_new + p_tv, mask=m_tv, other=0.0)
        b_h = tl.load(hs + p_state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        b_dh = tl.load(dhs + p_state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        b_dqg += mm(b_do, tl.trans(b_h), DT, PREC)
        b_dkt += mm(b_vn, tl.trans(b_dh), DT, PREC)
        b_dw += mm(b_dvn, tl.trans(b_h), DT, PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    p_tk = o_t[:, None] * (H * K) + o_k[None, :]
    b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_q = tl.load(q + p_tk, mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
    b_G2 = tl.load(G2 + p_tk, mask=m_tk, other=0.0)  # [BT, BK] log₂(e)·G
    b_GC2 = tl.load(gl + p_chunk * K + o_k, mask=m_k, other=0.0) * LOG2E  # [BK] log₂(e)·G_C (G at the last row)
    b_gam = tl.exp2(b_G2)  # Γ
    b_dec = tl.exp2(b_GC2[None, :] - b_G2)  # exp(G_C − G) ≤ 1
    b_kg = b_k * b_dec
    b_Ai = tl.load(Akk_inv + o_t[:, None] * (H * BT) + rows[None, :], mask=m_t[:, None], other=0.0)
    b_dkbg = -mm_fp32(tl.trans(b_Ai), b_dw, PREC)  # d(βΓK) = A⁻ᵀ dW
    b_dq = scale * b_gam * b_dqg
    b_dk = b_dec * b_dkt + b_beta[:, None] * b_gam * b_dkbg
    b_dG = b_q * b_dq - b_kg * b_dkt + b_beta[:, None] * b_gam * b_k * b_dkbg
    b_dGC = tl.exp2(b_GC2) * b_hdh + tl.sum(b_kg * b_dkt, 0)
    b_dG += tl.where(rows[:, None] == last, b_dGC[None, :], 0.0)
    tl.store(dq_p + p_tk, b_dq, mask=m_tk)
    tl.store(dk_p + p_tk, b_dk, mask=m_tk)
    tl.store(dG_p + p_tk, b_dG, mask=m_tk)
    tl.store(dbeta_p + o_t * (H * NK) + i_k, tl.sum(b_dkbg * b_gam * b_k, 1), mask=m_t)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_wy_value_kernel(
    v, beta, Akk_inv, Mkk, v_new, dv_new, dbeta_p,   # inputs (dbeta_p [B, T, H, NK] fp32)
    dv, dbeta, dM,                                   # outputs
    T,
    cu_seqlens, chunk_indices,                       # packed sequences (IS_VARLEN)
    H: tl.constexpr, V: tl.constexpr, NK: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Value side of the chunk-level gradients and the gradient through the UT transform, one chunk.

    ``Ṽ = A⁻¹ Y`` with ``Y = βV − βΓK S``, i.e. ``A Ṽ = Y``; so with ``dY = A⁻ᵀ dṼ``::

        d(βV) = dY  → dv = β ⊙ dY,  dβ += Σ_v dY ⊙ V
        dA = −dY Ṽᵀ  → dL = its strictly lower part (A = I + Diag(β) M),
        dβ_i += Σ_j dL_ij M_ij,   dM = Diag(β) dL

    (the same as ``dL = −A⁻ᵀ dA⁻¹ A⁻ᵀ`` with ``dA⁻¹ = dṼ (βV)ᵀ + dW (βΓK)ᵀ``, since ``A⁻¹ Y = Ṽ``,
    without forming ``dA⁻¹``), plus the key side's partial ``dβ`` of every key block.
    Per program: two ``[BT, BT] × [BT, V]``-sized products in tf32, no scans.
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    seq = bos * H + i_h
    v, v_new, dv_new, dv = v + seq * V, v_new + seq * V, dv_new + seq * V, dv + seq * V
    beta, dbeta, dbeta_p = beta + seq, dbeta + seq, dbeta_p + seq * NK
    Akk_inv, Mkk, dM = Akk_inv + seq * BT, Mkk + seq * BT, dM + seq * BT
    rows = tl.arange(0, BT)
    o_t = i_t * BT + rows
    m_t = o_t < T
    p_tA = o_t[:, None] * (H * BT) + rows[None, :]
    b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_Ai = tl.load(Akk_inv + p_tA, mask=m_t[:, None], other=0.0)  # [BT, BT]
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = o_t[:, None] * (H * V) + o_v[None, :]
        b_dvn = tl.load(dv_new + p_tv, mask=m_tv, other=0.0)
        b_vn = tl.load(v_new + p_tv, mask=m_tv, other=0.0)
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_dy = mm_fp32(tl.trans(b_Ai), b_dvn, PREC)  # dY = d(βV) [BT, BV]
        tl.store(dv + p_tv, (b_dy * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        b_dbeta += tl.sum(b_dy * b_v, 1)
        b_dA -= mm_fp32(b_dy, tl.trans(b_vn), PREC)
    b_dL = tl.where(rows[:, None] > rows[None, :], b_dA, 0.0)
    b_M = tl.load(Mkk + p_tA, mask=m_t[:, None], other=0.0)
    b_dbeta += tl.sum(b_dL * b_M, 1)
    tl.store(dM + p_tA, b_dL * b_beta[:, None], mask=m_t[:, None])
    for i_k in tl.static_range(NK):
        b_dbeta += tl.load(dbeta_p + o_t * (H * NK) + i_k, mask=m_t, other=0.0)
    tl.store(dbeta + o_t * H, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_intra_kernel(
    q, k, G2, dP, dM, dq_p, dk_p,  # inputs (G2: the forward's in-chunk cumulative decay, log₂(e)·G, fp32)
    dG_p,                          # in: the chunk-level dG; out: dG with the score terms added (fp32)
    dq, dk,                        # outputs
    T,
    cu_seqlens, chunk_indices,     # packed sequences (IS_VARLEN)
    H: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    PREC: tl.constexpr, PREC_DIAG: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Gradients through ``P_ij = Σ_d q_id k_jd e^{G_id − G_jd}`` (j ≤ i) and ``M`` (same form with k
    for q, j < i) for one 16-token tile ``X`` (rows ``a .. e = a + 15``) of a chunk and one block of ``BK``
    key channels; grid (K blocks × tiles, chunks, B·H). From the score gradients ``dP, dM``::

        row side  (i in X):  dq_i += Σ_{j ≤ i} dP_ij k_j e^{G_i−G_j},   dk_i += Σ_{j < i} dM_ij k_j e^{G_i−G_j}
        column side (j in X): dk_j += Σ_{i ≥ j} (dP_ij q_i + dM_ij k_i) e^{G_i−G_j}
        dG = q ⊙ dq_row + k ⊙ (dk_row − dk_col)      (added to dG_p in place; dg, its in-chunk reverse
                                                        cumsum, is :func:`kda_bwd_dg_kernel`)

    Every pair of tiles is one ``[16, 16] × [16, BK]`` tensor-core product, the decay split at an anchor
    row, as differences of the forward's fp32 in-chunk cumsum (in log2 units, ``G₂ = log₂(e)·G``, so each
    factor is one ``exp2``; no scans here):

    - keys of an earlier tile ``J``, anchor ``a``: ``e^{G_i−G_a} ≤ 1`` (rows, applied once at the end)
      times ``e^{G_a−G_j} ≤ 1`` (keys);
    - rows of a later tile ``I``, anchor ``e``: ``e^{G_i−G_e} ≤ 1`` (rows) times ``e^{G_e−G_j} ≤ 1``
      (this tile's columns, applied once at the end);
    - the diagonal tile, anchored at ``a`` like the forward: ``e^{G_i−G_a} ≤ 1`` and
      ``e^{G_a−G_j} ≤ e^{15·5} = e^75`` (K3's gate ``g ≥ −5``); its four products run at ``PREC_DIAG``
      (bf16 inputs: ``LAUNCH["bwd_intra"]["diag_precision"]``, fp32: exact).

    Per program (tile X of NC = 4): ``4 + 2·(NC − 1)`` products and ``3 + (NC − 1)`` exps of ``[16, BK]``,
    no scans; the loops over the other tiles only add independent products into accumulators.
    """
    NC: tl.constexpr = BT // BC
    i_kx, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k, X = i_kx // NC, i_kx % NC
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    t0 = i_t * BT
    a = t0 + X * BC  # anchor row (token index) of the tile
    if a >= T:
        return
    seq = bos * H + i_h
    q, k, G2, dq_p, dk_p, dG_p = q + seq * K, k + seq * K, G2 + seq * K, dq_p + seq * K, dk_p + seq * K, dG_p + seq * K
    dq, dk, dP, dM = dq + seq * K, dk + seq * K, dP + seq * BT, dM + seq * BT
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_c = tl.arange(0, BC)
    x_c = X * BC + o_c  # the tile's rows as rows of the chunk
    o_i = a + o_c
    m_i = o_i < T
    m_ik = m_i[:, None] & m_k[None, :]
    p_ik = o_i[:, None] * (H * K) + o_k[None, :]
    b_Gi = tl.load(G2 + p_ik, mask=m_ik, other=0.0)  # [BC, BK] log₂(e)·G_i
    b_qi = tl.load(q + p_ik, mask=m_ik, other=0.0).to(tl.float32)
    b_ki = tl.load(k + p_ik, mask=m_ik, other=0.0).to(tl.float32)
    b_Ga = tl.load(G2 + a * (H * K) + o_k, mask=m_k, other=0.0)  # [BK] at the anchor a
    b_li = tl.where(m_ik, b_Gi - b_Ga[None, :], 0.0)  # log₂(e)·(G_i − G_a), G_i − G_a ∈ (−75, 0]
    b_rf = tl.exp2(b_li)  # e^{G_i − G_a} ≤ 1
    b_kf = tl.exp2(-b_li)  # e^{G_a − G_j} ≤ e^75

    # diagonal tile: dP lower, dM strictly lower, and their transposes
    p_XX = o_i[:, None] * (H * BT) + x_c[None, :]
    p_XXT = o_i[None, :] * (H * BT) + x_c[:, None]
    b_dP = tl.load(dP + p_XX, mask=m_i[:, None] & (o_c[:, None] >= o_c[None, :]), other=0.0)
    b_dM = tl.load(dM + p_XX, mask=m_i[:, None] & (o_c[:, None] > o_c[None, :]), other=0.0)
    b_dPT = tl.load(dP + p_XXT, mask=m_i[None, :] & (o_c[:, None] <= o_c[None, :]), other=0.0)
    b_dMT = tl.load(dM + p_XXT, mask=m_i[None, :] & (o_c[:, None] < o_c[None, :]), other=0.0)
    b_kd = b_ki * b_kf
    b_dq_row = mm_fp32(b_dP, b_kd, PREC_DIAG)  # [BC, BK], every row term shares the row factor e^{G_i − G_a}
    b_dk_row = mm_fp32(b_dM, b_kd, PREC_DIAG)
    b_dk_col = (mm_fp32(b_dPT, b_qi * b_rf, PREC_DIAG) + mm_fp32(b_dMT, b_ki * b_rf, PREC_DIAG)) * b_kf

    # row side, keys of the earlier tiles J < X: k_j e^{G_a − G_j}
    for J in range(X):
        p_jk = (t0 + J * BC + o_c)[:, None] * (H * K) + o_k[None, :]  # rows < a < T
        b_kt = tl.load(k + p_jk, mask=m_k[None, :], other=0.0).to(tl.float32)
        b_kt *= tl.exp2(b_Ga[None, :] - tl.load(G2 + p_jk, mask=m_k[None, :], other=0.0))  # ≤ 1
        p_XJ = o_i[:, None] * (H * BT) + (J * BC + o_c)[None, :]
        b_dq_row += mm_fp32(tl.load(dP + p_XJ, mask=m_i[:, None], other=0.0), b_kt, PREC)
        b_dk_row += mm_fp32(tl.load(dM + p_XJ, mask=m_i[:, None], other=0.0), b_kt, PREC)
    b_dq_row *= b_rf
    b_dk_row *= b_rf

    # column side, rows of the later tiles I > X (they exist only if all of tile X's rows are valid):
    # (q_i, k_i) e^{G_i − G_e}, then this tile's columns e^{G_e − G_j}
    if a + BC < T:
        b_Ge = tl.load(G2 + (a + BC - 1) * (H * K) + o_k, mask=m_k, other=0.0)  # [BK] at the anchor e
        b_dk_late = tl.zeros([BC, BK], dtype=tl.float32)
        for I in range(X + 1, NC):
            o_r = t0 + I * BC + o_c
            m_r = o_r < T
            m_rk = m_r[:, None] & m_k[None, :]
            p_rk = o_r[:, None] * (H * K) + o_k[None, :]
            b_e = tl.exp2(tl.where(m_rk, tl.load(G2 + p_rk, mask=m_rk, other=0.0) - b_Ge[None, :], -float("inf")))
            b_qe = tl.load(q + p_rk, mask=m_rk, other=0.0).to(tl.float32) * b_e
            b_ke = tl.load(k + p_rk, mask=m_rk, other=0.0).to(tl.float32) * b_e
            p_IXT = o_r[None, :] * (H * BT) + x_c[:, None]  # [BC, BC] transposed tile
            b_dk_late += mm_fp32(tl.load(dP + p_IXT, mask=m_r[None, :], other=0.0), b_qe, PREC)
            b_dk_late += mm_fp32(tl.load(dM + p_IXT, mask=m_r[None, :], other=0.0), b_ke, PREC)
        b_dk_col += b_dk_late * tl.exp2(b_Ge[None, :] - b_Gi)

    tl.store(dq + p_ik, (tl.load(dq_p + p_ik, mask=m_ik, other=0.0) + b_dq_row).to(dq.dtype.element_ty), mask=m_ik)
    b_dki = tl.load(dk_p + p_ik, mask=m_ik, other=0.0) + b_dk_row + b_dk_col
    tl.store(dk + p_ik, b_dki.to(dk.dtype.element_ty), mask=m_ik)
    b_dGi = tl.load(dG_p + p_ik, mask=m_ik, other=0.0) + b_qi * b_dq_row + b_ki * (b_dk_row - b_dk_col)
    tl.store(dG_p + p_ik, b_dGi, mask=m_ik)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_dg_kernel(
    dG,   # input [B, T, H, K] fp32: the gradient of the in-chunk cumulative decay G
    dg,   # output [B, T, H, K]
    T,
    cu_seqlens, chunk_indices,  # packed sequences (IS_VARLEN)
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """``dg_i = Σ_{r ≥ i in the chunk} dG_r`` (``G = cumsum g`` inside each chunk), one ``[BT, BK]``
    reverse scan per program; grid (K blocks, chunks, B·H)."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T  # first token of the batch row
    if IS_VARLEN:
        bos, T = packed_chunk_span(i_t, cu_seqlens, chunk_indices, BT)
    seq = bos * H + i_h
    o_t = i_t * BT + tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_tk = (o_t < T)[:, None] & (o_k < K)[None, :]
    p_tk = seq * K + o_t[:, None] * (H * K) + o_k[None, :]
    b_dG = tl.load(dG + p_tk, mask=m_tk, other=0.0)
    tl.store(dg + p_tk, tl.cumsum(b_dG, 0, reverse=True).to(dg.dtype.element_ty), mask=m_tk)
