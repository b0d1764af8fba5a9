"""Split-K flash-decoding for MLA's absorbed attention over the bf16/fp16 latent cache (docs/inference.md, section 6b,
"Latent attention for decoding: a split-K kernel").

The math is :func:`k3lab.mixers.mla.latent_attention_lowp`'s. For batch row b, new token t (of T), head h (of H)
and cache slot j (of S), with the latent ``c_j`` [R] (kv_lora_rank) and the shared rope key ``k^R_j`` [ρ]::

    s_bhtj = (q^lat_bth · c_bj + q^R_bth · k^R_bj) · scale
    visible_btj = key_mask[b, j] ∧ j ≤ limit[b, t]          (key_mask None: all; limit None: every j ≤ S − 1)
    p_bhtj = softmax_j(s_bhtj over the visible j)
    o_bhtj = Σ_j p_bhtj c_bj                                 -> o_latent [B, H, T, R] float32

The values are the latents themselves (MQA with one KV head), so each tile of ``c_kv`` is loaded once and used
twice: ``q · cᵀ`` for the scores and ``p · c`` for the output. Precision as the bmm path's: q, p and k^R are
rounded to the cache's dtype for the tensor-core dots, which accumulate in float32; the softmax runs in
float32 (base 2: scores are multiplied by ``scale · log2 e``).

**Split-K ("flash-decoding").** A decode step has few query rows (T·H: 8 for ``small`` at T = 1) but a long
cache, so the grid runs over (splits of S, groups of query rows, B). One program takes the ``BLOCK_M`` (≥ 16,
masked) query rows of one row group of batch row b — all H heads of one or more tokens t, row ``t·H + h`` — and
walks its range of S in tiles of ``BLOCK_S`` slots, keeping the online-softmax state in float32: the running max
``m`` [rows], sum ``l`` [rows] and accumulator ``acc`` [rows, R]. It writes its partial output ``acc / l`` and
log-sum-exp ``m + log2 l`` (base 2); a second small kernel merges the splits of each row::

    M = max_s lse_s,   w_s = 2^(lse_s − M),   o = Σ_s w_s o_s / Σ_s w_s

With one split the first kernel writes ``o`` itself and the merge is skipped. With ``limit`` a program stops at
the largest limit of its rows, so slots past every row's limit are not read.

**Rows that see no slot** (every slot masked): ``l = 0``, the row's partial is 0 with lse = −inf, and the merged
output is 0 — not the NaN a softmax over only −inf gives (the bmm path's). The callers never produce such rows:
every query of :class:`k3lab.mixers.mla.GatedMLA` sees at least its own token (the dynamic cache appends the new
tokens with key mask True; the static cache sets the written slot's key mask before attending), so the choice
only matters for direct calls; 0 keeps a graphed step free of NaNs.

**CUDA graphs.** The call is capturable: the number of splits is a function of shapes only (B, S, T·H, R) and
of the device's SM count, read once per device on the host (:func:`num_splits`); the partial buffers'
sizes follow from it; nothing is read back from the device and no value decides a launch — masks and limits
are read by the kernels. Warm the call up (compile) before capture, as any Triton kernel.

Under ``torch.compile`` the entry point, :func:`mla_decode_attention`, calls a ``torch.library`` custom op
(``k3lab::mla_decode_attention``, with a fake implementation), one opaque node in the graph; eager calls launch
the kernels directly (no custom-op dispatch on the decode path). Forward only (decoding): the
dispatcher in ``latent_attention_lowp`` sends calls that need gradients to the bmm path.
:data:`ENABLED` switches the dispatch off (the bmm path is then used everywhere).

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set before triton is imported): tests and
``kernels/bench_mla_decode.py --smoke``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from k3lab.kernels.rounding import bf16_round_nearest_even

Tensor = torch.Tensor

ENABLED = True  # latent_attention_lowp dispatches decode-like CUDA calls here; False: the bmm path everywhere
MAX_QUERY_ROWS = 64  # T·H up to this: decode-like (latent_attention_lowp's dispatch rule)
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: exact (IEEE) dots, for tests
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET = tl.constexpr(INTERPRET)  # read inside the kernels
LOG2E = 1.4426950408889634

# Launch parameters (chosen without GPU timings yet: kernels/bench_mla_decode.py --sweep re-times candidates).
#   block_s:        cache slots a tile, by the padded kv_lora_rank BLOCK_R (≤ 256: 64; wider: 32) — a tile of
#                   [c | k^R] is BLOCK_S·(BLOCK_R + BLOCK_P)·2 bytes a pipeline stage
#   acc_elems:      BLOCK_M·BLOCK_R float32 accumulator elements a program at 4 warps (8 warps above that)
#   programs_per_sm: split-K targets this many programs per SM over the grid
#   min_tiles:      a split covers at least this many tiles (fewer, larger splits at short contexts)
LAUNCH = dict(block_s={256: 64, 512: 32}, acc_elems=8192, max_acc_elems=16384, num_stages=3,
              programs_per_sm=2, min_tiles=2, max_splits=1024, merge_block_r=64, merge_block_s=16)
INTERPRETER_SMS = 4  # the "SM count" under TRITON_INTERPRET=1: small shapes still split


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _to_lp(x, LP: tl.constexpr, BF16: tl.constexpr):
    """``x`` rounded to the cache's dtype ``LP`` (nearest even), as the bmm path rounds q and p. Under the
    interpreter the result is held in float32 — Triton 3.9's interpreter multiplies the raw bits of bf16 operands
    in tl.dot, and its float32 -> bf16 conversion truncates — so bf16 is rounded in integer ops instead."""
    if _INTERPRET:
        if BF16:
            return bf16_round_nearest_even(x.to(tl.float32)).to(tl.float32)
        else:
            return x.to(LP).to(tl.float32)
    else:
        return x.to(LP)


@triton.jit
def mla_decode_split_kernel(
    QL, QR, C, KR, MASK, LIM, O, LSE,
    S, TH, split_len, scale_log2,
    sql_b, sql_t, sql_h, sqr_b, sqr_t, sqr_h,
    sc_b, sc_s, skr_b, skr_s, sm_b, sm_s, sl_b, sl_t,
    so_b, so_split, so_t, so_h, slse_b, slse_split,
    H: tl.constexpr, R: tl.constexpr, RHO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_ROPE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_LIMIT: tl.constexpr, WRITE_LSE: tl.constexpr,
    BF16: tl.constexpr, IEEE: tl.constexpr,
):
    """One (split, row group, batch row): online softmax over slots [split·split_len, (split+1)·split_len)."""
    i_split, i_group, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b64 = i_b.to(tl.int64)
    rows = i_group * BLOCK_M + tl.arange(0, BLOCK_M)  # query row t·H + h
    row_ok = rows < TH
    t, h = rows // H, rows % H
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    lp = C.dtype.element_ty
    q = tl.load(QL + b64 * sql_b + t[:, None] * sql_t + h[:, None] * sql_h + offs_r[None, :],
                mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    q = _to_lp(q, lp, BF16)  # [BM, BR], rounded as the bmm path rounds it
    if HAS_ROPE:
        offs_p = tl.arange(0, BLOCK_P)
        p_ok = offs_p < RHO
        qr = tl.load(QR + b64 * sqr_b + t[:, None] * sqr_t + h[:, None] * sqr_h + offs_p[None, :],
                     mask=row_ok[:, None] & p_ok[None, :], other=0.0)
        qr = _to_lp(qr, lp, BF16)  # [BM, BP]

    lo = i_split * split_len
    hi = tl.minimum(lo + split_len, S)
    if HAS_LIMIT:
        lim = tl.load(LIM + b64 * sl_b + t * sl_t, mask=row_ok, other=-1)  # [BM] last visible slot of each row
        hi = tl.minimum(hi, (tl.max(lim, 0) + 1).to(tl.int32))  # no row sees a slot past its largest limit

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        s_ok = offs_s < hi
        s64 = offs_s.to(tl.int64)
        c = tl.load(C + b64 * sc_b + s64[:, None] * sc_s + offs_r[None, :],
                    mask=s_ok[:, None] & r_ok[None, :], other=0.0)  # [BS, BR]: read once, used twice
        if IEEE:  # float32 operands (an fp32 cache; every cache under the interpreter): exact products
            c = c.to(tl.float32)
            qk = tl.dot(q, tl.trans(c), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(c))  # [BM, BS] float32 (tensor cores)
        if HAS_ROPE:
            kr = tl.load(KR + b64 * skr_b + s64[:, None] * skr_s + offs_p[None, :],
                         mask=s_ok[:, None] & p_ok[None, :], other=0.0)  # in c's dtype (the host casts)
            if IEEE:
                qk += tl.dot(qr, tl.trans(kr.to(tl.float32)), input_precision="ieee")
            else:
                qk += tl.dot(qr, tl.trans(kr))
        visible = s_ok[None, :] & row_ok[:, None]
        if HAS_MASK:
            km = tl.load(MASK + b64 * sm_b + s64 * sm_s, mask=s_ok, other=0)
            visible = visible & (km != 0)[None, :]
        if HAS_LIMIT:
            visible = visible & (offs_s[None, :] <= lim[:, None])
        qk = tl.where(visible, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])  # [BM, BS], 0 where hidden
        l_i = l_i * alpha + tl.sum(p, 1)
        p_lp = _to_lp(p, lp, BF16)  # rounded to the cache's dtype as the bmm path rounds p
        if IEEE:
            pv = tl.dot(p_lp, c, input_precision="ieee")
        else:
            pv = tl.dot(p_lp, c)  # [BM, BR] float32
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # a row that saw nothing: acc = 0, o = 0
    tl.store(O + b64 * so_b + i_split * so_split + t[:, None] * so_t + h[:, None] * so_h + offs_r[None, :], o,
             mask=row_ok[:, None] & r_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b64 * slse_b + i_split * slse_split + rows, lse, mask=row_ok)


@triton.jit
def mla_decode_merge_kernel(
    OP, LSE, O, NSPLIT, TH,
    sp_b, sp_split, slse_b, slse_split, so_b, so_t, so_h,
    H: tl.constexpr, R: tl.constexpr, BLOCK_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One (batch row, query row), ``BLOCK_R`` columns: o = Σ_s 2^(lse_s − M) o_s / Σ_s 2^(lse_s − M)."""
    i_row, i_r = tl.program_id(0), tl.program_id(1)
    b64 = (i_row // TH).to(tl.int64)
    row = i_row % TH
    t, h = row // H, row % H
    offs_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    offs_sp = tl.arange(0, BLOCK_SPLIT)
    m = tl.full([BLOCK_SPLIT], float("-inf"), dtype=tl.float32)
    for s0 in range(0, NSPLIT, BLOCK_SPLIT):
        lse = tl.load(LSE + b64 * slse_b + (s0 + offs_sp) * slse_split + row, mask=s0 + offs_sp < NSPLIT,
                      other=float("-inf"))
        m = tl.maximum(m, lse)
    m_all = tl.max(m, 0)
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)  # every split empty: all weights 0, o = 0
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    den = tl.zeros([BLOCK_SPLIT], dtype=tl.float32)
    for s0 in range(0, NSPLIT, BLOCK_SPLIT):
        sp = s0 + offs_sp
        sp_ok = sp < NSPLIT
        lse = tl.load(LSE + b64 * slse_b + sp * slse_split + row, mask=sp_ok, other=float("-inf"))
        w = tl.exp2(lse - m_use)  # [BLOCK_SPLIT]
        den += w
        part = tl.load(OP + b64 * sp_b + sp[:, None] * sp_split + row * R + offs_r[None, :],
                       mask=sp_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_SPLIT, BLOCK_R]
        acc += tl.sum(w[:, None] * part, 0)
    total = tl.sum(den, 0)
    o = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(O + b64 * so_b + t * so_t + h * so_h + offs_r, o, mask=r_ok)


# ----------------------------------------------------------------------------------------------
# host side: shapes -> launch (no data read)
# ----------------------------------------------------------------------------------------------
def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (read once per device); :data:`INTERPRETER_SMS` off CUDA."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_config(TH: int, R: int, rho: int) -> dict:
    """Blocks and warps for T·H query rows, kv_lora_rank R, rope dim ρ (shapes only)."""
    block_r = _pow2(R)
    block_s = LAUNCH["block_s"].get(block_r, 64 if block_r <= 256 else 32)
    block_m = min(_pow2(TH), max(16, LAUNCH["max_acc_elems"] // block_r))  # all rows of a token at once if they fit
    warps = 4 if block_m * block_r <= LAUNCH["acc_elems"] else 8
    return dict(BLOCK_M=block_m, BLOCK_S=block_s, BLOCK_R=block_r, BLOCK_P=_pow2(rho), num_warps=warps,
                num_stages=LAUNCH["num_stages"])


def num_splits(B: int, groups: int, S: int, block_s: int, sms: int) -> tuple[int, int]:
    """(splits, split_len): how a cache of S slots is cut for B·groups programs per split on ``sms`` SMs.

    A deterministic function of its arguments (shapes and the device's SM count, no data): enough splits to
    give about ``programs_per_sm`` programs per SM, each split at least ``min_tiles`` tiles, ``split_len`` a
    multiple of ``block_s``, and no empty split."""
    tiles = max(1, triton.cdiv(S, block_s))
    want = triton.cdiv(LAUNCH["programs_per_sm"] * sms, max(1, B * groups))
    splits = max(1, min(want, triton.cdiv(tiles, LAUNCH["min_tiles"]), LAUNCH["max_splits"]))
    split_len = triton.cdiv(tiles, splits) * block_s
    return max(1, triton.cdiv(S, split_len)), split_len


def _check(q_latent: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, key_mask: Tensor | None,
           limit: Tensor | None) -> None:
    if q_latent.dim() != 4 or c_kv.dim() != 3:
        raise ValueError(f"q_latent must be [B, T, H, R] and c_kv [B, S, R]; got {tuple(q_latent.shape)}, "
                         f"{tuple(c_kv.shape)}")
    B, T, H, R = q_latent.shape
    S = c_kv.shape[1]
    rho = q_rope.shape[-1]
    if c_kv.shape != (B, S, R):
        raise ValueError(f"c_kv must be [B, S, R] = [{B}, S, {R}], got {tuple(c_kv.shape)}")
    if q_rope.shape != (B, T, H, rho) or k_rope.shape != (B, S, rho):
        raise ValueError(f"q_rope must be [B, T, H, ρ] = {(B, T, H, rho)} and k_rope [B, S, ρ] = {(B, S, rho)}; "
                         f"got {tuple(q_rope.shape)}, {tuple(k_rope.shape)}")
    if c_kv.dtype not in CACHE_DTYPES:
        raise ValueError(f"c_kv dtype {c_kv.dtype}: allowed values are {CACHE_DTYPES}")
    if key_mask is not None and (key_mask.shape != (B, S) or key_mask.dtype != torch.bool):
        raise ValueError(f"key_mask must be bool [B, S] = {(B, S)}, got {key_mask.dtype} {tuple(key_mask.shape)}")
    if limit is not None and (limit.shape != (B, T) or limit.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"limit must be int64 [B, T] = {(B, T)}, got {limit.dtype} {tuple(limit.shape)}")


def _last_contiguous(x: Tensor) -> Tensor:
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _run(q_latent: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, scale: float, key_mask: Tensor | None,
         limit: Tensor | None, splits_override: int) -> Tensor:
    B, T, H, R = q_latent.shape
    S, rho, TH = c_kv.shape[1], q_rope.shape[-1], T * H
    out = torch.empty(B, H, T, R, dtype=torch.float32, device=c_kv.device)
    if out.numel() == 0:
        return out
    q_latent, q_rope, c_kv, k_rope = (_last_contiguous(x) for x in (q_latent, q_rope, c_kv, k_rope))
    if rho and k_rope.dtype != c_kv.dtype:
        k_rope = k_rope.to(c_kv.dtype)  # as the bmm path rounds it (the caches store both in one dtype)
    cfg = launch_config(TH, R, rho)
    BM, BS = cfg["BLOCK_M"], cfg["BLOCK_S"]
    groups = triton.cdiv(TH, BM)
    if splits_override > 0:
        split_len = triton.cdiv(triton.cdiv(max(S, 1), splits_override), BS) * BS
        splits = max(1, triton.cdiv(S, split_len))
    else:
        splits, split_len = num_splits(B, groups, S, BS, sm_count(c_kv.device))
    has_rope, has_mask, has_limit = rho > 0, key_mask is not None, limit is not None
    mask = key_mask.view(torch.uint8) if has_mask else c_kv
    lim = limit if has_limit else c_kv
    if splits == 1:  # write o directly in [B, H, T, R]
        o_part, lse = out, out
        o_strides = (out.stride(0), 0, out.stride(2), out.stride(1))
        lse_strides = (0, 0)
    else:
        o_part = torch.empty(B, splits, TH, R, dtype=torch.float32, device=c_kv.device)  # row t·H + h
        lse = torch.empty(B, splits, TH, dtype=torch.float32, device=c_kv.device)
        o_strides = (o_part.stride(0), o_part.stride(1), H * R, R)
        lse_strides = (lse.stride(0), lse.stride(1))
    launch = {} if INTERPRET else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    mla_decode_split_kernel[(splits, groups, B)](
        q_latent, q_rope if has_rope else q_latent, c_kv, k_rope if has_rope else c_kv, mask, lim, o_part, lse,
        S, TH, split_len, float(scale) * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_latent.stride(2),
        *((q_rope.stride(0), q_rope.stride(1), q_rope.stride(2)) if has_rope else (0, 0, 0)),
        c_kv.stride(0), c_kv.stride(1), *((k_rope.stride(0), k_rope.stride(1)) if has_rope else (0, 0)),
        *((mask.stride(0), mask.stride(1)) if has_mask else (0, 0)),
        *((lim.stride(0), lim.stride(1)) if has_limit else (0, 0)),
        *o_strides, *lse_strides,
        H=H, R=R, RHO=rho, BLOCK_M=BM, BLOCK_S=BS, BLOCK_R=cfg["BLOCK_R"], BLOCK_P=cfg["BLOCK_P"],
        HAS_ROPE=has_rope, HAS_MASK=has_mask, HAS_LIMIT=has_limit, WRITE_LSE=splits > 1,
        BF16=c_kv.dtype == torch.bfloat16, IEEE=c_kv.dtype == torch.float32 or INTERPRET, **launch)
    if splits > 1:
        block_r = min(LAUNCH["merge_block_r"], _pow2(R))
        mla_decode_merge_kernel[(B * TH, triton.cdiv(R, block_r))](
            o_part, lse, out, splits, TH, o_part.stride(0), o_part.stride(1), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(2), out.stride(1),
            H=H, R=R, BLOCK_SPLIT=min(LAUNCH["merge_block_s"], _pow2(splits, 1)), BLOCK_R=block_r,
            **({} if INTERPRET else dict(num_warps=2)))
    return out


@torch.library.custom_op("k3lab::mla_decode_attention", mutates_args=())
def _mla_decode_op(q_latent: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, scale: float,
                   key_mask: Tensor | None, limit: Tensor | None, splits: int) -> Tensor:
    return _run(q_latent, q_rope, c_kv, k_rope, scale, key_mask, limit, splits)


@_mla_decode_op.register_fake
def _(q_latent, q_rope, c_kv, k_rope, scale, key_mask, limit, splits):
    B, T, H, R = q_latent.shape
    return q_latent.new_empty(B, H, T, R, dtype=torch.float32)


def mla_decode_attention(q_latent: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, scale: float,
                         key_mask: Tensor | None = None, limit: Tensor | None = None, *,
                         splits: int | None = None) -> Tensor:
    """Absorbed MLA attention over the latent cache, split-K (the module docstring has the math).

    q_latent [B, T, H, R] float32/bf16; q_rope [B, T, H, ρ] (ρ may be 0); c_kv [B, S, R] bf16/fp16 (float32:
    exact dots, for tests); k_rope [B, S, ρ]; key_mask [B, S] bool or None; limit [B, T] int64 or None: query t
    of row b sees slots ``j ≤ limit[b, t]`` (None: every slot; strides may be 0, e.g. an expanded ``[T]``).
    splits: None picks the split count from the shapes and the SM count (:func:`num_splits`); an int forces
    it (tests). Returns o_latent [B, H, T, R] float32; a row that sees no slot gives 0.
    """
    _check(q_latent, q_rope, c_kv, k_rope, key_mask, limit)
    if torch.compiler.is_compiling():  # an opaque node in the compiled graph
        return _mla_decode_op(q_latent, q_rope, c_kv, k_rope, float(scale), key_mask, limit, int(splits or 0))
    # eager: the kernels directly (no custom-op dispatch on the decode path)
    return _run(q_latent, q_rope, c_kv, k_rope, float(scale), key_mask, limit, int(splits or 0))


def mla_decode_reference(q_latent: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, scale: float,
                         key_mask: Tensor | None = None, limit: Tensor | None = None) -> Tensor:
    """The same math in float64 with plain torch ops (any device): o_latent [B, H, T, R] float64; a row that sees
    no slot gives 0 (as the kernel)."""
    B, T, H, R = q_latent.shape
    S = c_kv.shape[1]
    d = torch.float64
    scores = torch.einsum("bthr,bsr->bhts", q_latent.to(d), c_kv.to(d))
    if q_rope.shape[-1]:
        scores = scores + torch.einsum("bthp,bsp->bhts", q_rope.to(d), k_rope.to(d))
    visible = torch.ones(B, 1, T, S, dtype=torch.bool, device=c_kv.device)
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
    if limit is not None:
        visible = visible & (torch.arange(S, device=c_kv.device) <= limit[:, :, None])[:, None]
    scores = (scores * scale).masked_fill(~visible, float("-inf"))
    p = torch.nan_to_num(scores.softmax(-1), nan=0.0)  # a row that sees nothing: 0
    return torch.einsum("bhts,bsr->bhtr", p, c_kv.to(d))


__all__ = ["ENABLED", "mla_decode_attention", "mla_decode_reference", "num_splits", "launch_config", "LAUNCH",
           "MAX_QUERY_ROWS"]
