"""One KDA decode step (T = 1) as one Triton kernel: the short convolutions with their tails, SiLU, the l2 norms,
K3's gate, β and the delta-rule recurrence (:class:`k3lab.mixers.kda.KDA` takes it on CUDA, backend "triton",
without gradients, for the K3 gate: :func:`k3lab.mixers.kda.use_fused_decode`; switched on by :data:`ENABLED`).

Per batch row b and head h (``D_q = H·K``, ``D_v = H·V``; the inputs are the projections of the layer's token x)::

    x^q, x^k = W_q x, W_k x                                  # [B, H*K]  pre-conv projections (activation dtype c)
    x^v      = W_v x                                         # [B, H*V]
    c^q_d    = Σ_{w<W} taps^q[d, 0, w] · [tail^q_d ; x^q_d]_w  # [B, H*K]  window of W inputs, oldest first
    tail^q_d ← [tail^q_d[1:] ; x^q_d]                         # [B, H*K, W-1]  (k, v likewise)
    q̂, k̂, v  = SiLU(c^q), SiLU(c^k), SiLU(c^v)                # [B, H, K], [B, H, K], [B, H, V]
    q, k     = q̂ / sqrt(Σ_K q̂² + 1e-6),  k̂ / sqrt(Σ_K k̂² + 1e-6)  # [B, H, K]  (l2norm)
    g        = lb · σ(e^{A_log[h]} · (f + dt_bias))           # [B, H, K]  K3's bounded gate, lb = lower_bound
    β        = σ(b)                                          # [B, H]
    S        ← Diag(e^g) S                                   # [B, H, K, V]  fp32, in place
    S        ← S + k ⊗ β (v − Sᵀ k)
    o        = scale · Sᵀ q                                  # [B, H, V]  in c

what :meth:`KDA.forward <k3lab.mixers.kda.KDA.forward>` computes for one token on backend "triton" today:
``ShortConvolution`` (:func:`~k3lab.mixers.kda.causal_conv1d` + SiLU) three times, ``l2norm`` twice,
``kda_gate_reference`` (kind "k3"), ``sigmoid`` and :func:`k3lab.kernels.kda_decode_step`. The output norm, the
output gate and ``o_proj`` (and the projections before) stay outside: the RMSNorm needs a head's whole ``V``.
Kimi Linear's unbounded gate (``kda_gate="kimi_linear"``) is not taken (the triton backend refuses it anyway).

**Precision** — everything in float32 inside, rounded where the current path rounds to the activation dtype c
(bf16 or float32; in float32 there is no rounding but the float32 one): the conv output (``causal_conv1d``
returns c), the SiLU (an op on c), the l2-normed q and k and β (``KDA.mix_backend`` casts them to c for the decode
kernel) and o. The gate and the state stay float32. The conv runs in the promoted dtype of c and the taps, as
``causal_conv1d``: float32 taps (K3's) give float32 products summed tap by tap in order w = 0..W-1; bf16 taps with
bf16 activations (a model cast with ``.to(torch.bfloat16)``) round every product and every partial sum to bf16, as
torch's bf16 ops do. bf16 rounds to nearest even in integer ops (:mod:`k3lab.kernels.rounding`: the bits of
``Tensor.to(torch.bfloat16)``, on the GPU and under ``TRITON_INTERPRET=1``). Sums over K (the l2 norm, ``Sᵀ k``,
``Sᵀ q``) run in another order than torch's, and the GPU may contract a multiply-add: ulp-level float32 differences.

**Grid** — one program per (batch row, head), walking the head's value blocks of ``BV`` columns in a loop. Not a
program per value block as :func:`~k3lab.kernels.kda_decode_step`: every value block needs the head's whole q and k,
and with the tails updated in place a program that writes the q/k tails would race with its siblings still reading
them. So each program owns its head's q, k and v tail channels and state; inside it all tail loads come before a
barrier and the tail stores after it (threads holding replicated copies of a vector must not see a new tail), and
each state tile is read and written by the same thread. In-place is therefore safe: ``out_state`` may be ``state``
and the new tails may be the old ones (the default).

**CUDA graphs and torch.compile** — the launch depends on shapes only (no value read back, no host sync), so it is
capturable (warm up — Triton compiles — before capture). Under ``torch.compile`` the entry calls the
``torch.library`` custom op ``k3lab::kda_decode_fused`` (it declares the state and tails it writes as mutated);
eager calls launch the kernel directly. Forward only: the entry refuses inputs that need gradients.

:func:`kda_decode_fused_reference` is the same step in plain torch (the formulas above with the same rounding
points; no import of :mod:`k3lab.mixers` — kernels sit below the layers); tests/test_kda_decode_fused.py checks the
kernel against it and against the layer's own path. Launch parameters (:data:`LAUNCH`) are chosen without GPU
timings yet. On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from k3lab.config import KDA_GATE_LOWER_BOUND
from k3lab.kernels.rounding import DTYPES, bf16_round_if, bf16_round_if_f32

Tensor = torch.Tensor

ENABLED = True  # KDA.forward sends eligible decode steps here (on since the GPU suite and
# `kernels/bench_generate.py` ran with it on, issue 36); False: the projections, convolutions, gate and
# kda_decode_step as separate launches
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
L2NORM_EPS = 1e-6  # as k3lab.mixers.kda.L2NORM_EPS (fla's l2norm)
MAX_HEAD_DIM = 256  # K and V at most (a program holds a head's q, k, g and a [K, BV] state tile)

# Launch parameters (no GPU timings yet): BV value columns per state tile (a program loops over V / BV tiles).
LAUNCH = dict(BV=32, num_warps=4, num_stages=1)


# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _short_conv_silu(X, TAIL, NEW_TAIL, TAPS, row, ch, m, D, W: tl.constexpr, WP: tl.constexpr,
                     BF16: tl.constexpr, CONV_BF16: tl.constexpr):
    """SiLU(Σ_w taps[d, w] · [tail_d ; x_d]_w) for channels ``ch`` of batch row ``row`` (float32, rounded to the
    activation dtype as the torch path rounds), and the new tail ``[tail_d[1:] ; x_d]`` written to NEW_TAIL (which may
    be TAIL: every load comes before the barrier, every store after it)."""
    cols = tl.arange(0, WP)                                                          # [WP] tail positions
    p_tail = row * D * (W - 1) + ch[:, None] * (W - 1) + cols[None, :]                # [BC, WP]
    tail = tl.load(TAIL + p_tail, mask=m[:, None] & (cols[None, :] < W - 1), other=0.0).to(tl.float32)
    older = tl.load(TAIL + p_tail + 1, mask=m[:, None] & (cols[None, :] < W - 2), other=0.0).to(tl.float32)
    x = tl.load(X + row * D + ch, mask=m, other=0.0).to(tl.float32)                  # [BC] the new input
    acc = tl.zeros(x.shape, dtype=tl.float32)
    for w in tl.static_range(W):                                                     # taps in order, oldest first
        if w < W - 1:
            xw = tl.sum(tl.where(cols[None, :] == w, tail, 0.0), 1)                  # column w (exact)
        else:
            xw = x
        tap = tl.load(TAPS + ch * W + w, mask=m, other=0.0).to(tl.float32)
        if CONV_BF16:  # bf16 taps and activations: torch rounds each product and each partial sum
            prod = bf16_round_if_f32(tap * xw, True)
            acc = prod if w == 0 else bf16_round_if_f32(acc + prod, True)
        else:
            acc = acc + tap * xw
    y = bf16_round_if_f32(acc, BF16)                                                         # causal_conv1d returns c
    new_tail = tl.where(cols[None, :] == W - 2, x[:, None], older)                   # [BC, WP]
    tl.debug_barrier()
    tl.store(NEW_TAIL + p_tail, new_tail.to(NEW_TAIL.dtype.element_ty), mask=m[:, None] & (cols[None, :] < W - 1))
    return bf16_round_if_f32(y / (1.0 + tl.exp(-y)), BF16)                                   # SiLU on c


@triton.jit
def kda_decode_fused_kernel(
    XQ, XK, XV,                 # [B, H*K], [B, H*K], [B, H*V] pre-conv projections (activation dtype)
    TAPS_Q, TAPS_K, TAPS_V,     # [H*K, 1, W], [H*K, 1, W], [H*V, 1, W] conv taps
    TQ, TK, TV,                 # [B, H*K, W-1], [B, H*K, W-1], [B, H*V, W-1] conv tails (read)
    NTQ, NTK, NTV,              # the new tails (written; may be TQ, TK, TV)
    F, A_LOG, DT_BIAS, BLOGIT,  # F [B, H*K] gate logits; A_log [H]; dt_bias [H*K]; b [B, H] (pre-sigmoid)
    S, NS,                      # state [B, H, K, V] fp32 (read) and the new state (written; may be S)
    O,                          # [B, H, V] output (activation dtype)
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, WP: tl.constexpr, BF16: tl.constexpr, CONV_BF16: tl.constexpr,
):
    """One token of one (batch row, head): the module docstring's equations, value blocks in a loop."""
    i_bh = tl.program_id(0)
    row, h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    ch_k = h * K + o_k                                                               # [BK] q/k/gate channels
    q = _short_conv_silu(XQ, TQ, NTQ, TAPS_Q, row, ch_k, m_k, H * K, W, WP, BF16, CONV_BF16)  # [BK]
    k = _short_conv_silu(XK, TK, NTK, TAPS_K, row, ch_k, m_k, H * K, W, WP, BF16, CONV_BF16)
    q = bf16_round_if_f32(q * tl.math.rsqrt(tl.sum(q * q, 0) + 1e-6), BF16)                 # l2norm, cast to c
    k = bf16_round_if_f32(k * tl.math.rsqrt(tl.sum(k * k, 0) + 1e-6), BF16)
    z = tl.load(F + row * H * K + ch_k, mask=m_k, other=0.0).to(tl.float32)
    z = z + tl.load(DT_BIAS + ch_k, mask=m_k, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(A_LOG + h).to(tl.float32))
    g = lower_bound * tl.sigmoid(a * z)                                             # [BK] K3 gate, float32
    beta = bf16_round_if_f32(tl.sigmoid(tl.load(BLOGIT + i_bh).to(tl.float32)), BF16)     # β cast to c
    decay = tl.exp(g)
    for v0 in tl.static_range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        v = _short_conv_silu(XV, TV, NTV, TAPS_V, row, h * V + o_v, m_v, H * V, W, WP, BF16, CONV_BF16)  # [BV]
        m_kv = m_k[:, None] & m_v[None, :]
        p_kv = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        s = tl.load(S + p_kv, mask=m_kv, other=0.0)                                 # [BK, BV] fp32
        s = s * decay[:, None]
        read = tl.sum(k[:, None] * s, 0)                                             # [BV] what k reads
        s = s + k[:, None] * (beta * (v - read))[None, :]
        o = tl.sum(q[:, None] * s, 0) * scale
        tl.store(O + i_bh * V + o_v, bf16_round_if(o, BF16), mask=m_v)
        tl.store(NS + p_kv, s, mask=m_kv)


# ----------------------------------------------------------------------------------------------
# host side: shapes -> launch (no data read)
# ----------------------------------------------------------------------------------------------
def _run(q_proj, k_proj, v_proj, q_weight, k_weight, v_weight, conv_q, conv_k, conv_v, out_q, out_k, out_v,
         f, A_log, dt_bias, b, state, out_state, scale, lower_bound) -> Tensor:
    B, HK = q_proj.shape
    H = A_log.shape[0]
    K, V, W = HK // H, v_proj.shape[1] // H, q_weight.shape[-1]
    o = torch.empty(B, H, V, dtype=v_proj.dtype, device=v_proj.device)             # [B, H, V]
    if B == 0:
        return o
    bf16 = v_proj.dtype == torch.bfloat16
    BV = min(LAUNCH["BV"], triton.next_power_of_2(V))
    launch = {} if INTERPRET else dict(num_warps=LAUNCH["num_warps"], num_stages=LAUNCH["num_stages"])
    kda_decode_fused_kernel[(B * H,)](
        q_proj, k_proj, v_proj, q_weight, k_weight, v_weight, conv_q, conv_k, conv_v, out_q, out_k, out_v,
        f, A_log, dt_bias, b, state, out_state, o, float(scale), float(lower_bound),
        H=H, K=K, V=V, W=W, BK=triton.next_power_of_2(K), BV=BV, WP=triton.next_power_of_2(W - 1),
        BF16=bf16, CONV_BF16=bf16 and q_weight.dtype == torch.bfloat16, **launch)
    return o


@torch.library.custom_op("k3lab::kda_decode_fused", mutates_args=("out_q", "out_k", "out_v", "out_state"))
def _fused_op(q_proj: Tensor, k_proj: Tensor, v_proj: Tensor, q_weight: Tensor, k_weight: Tensor, v_weight: Tensor,
              conv_q: Tensor | None, conv_k: Tensor | None, conv_v: Tensor | None, out_q: Tensor, out_k: Tensor,
              out_v: Tensor, f: Tensor, A_log: Tensor, dt_bias: Tensor, b: Tensor, state: Tensor | None,
              out_state: Tensor, scale: float, lower_bound: float) -> Tensor:
    """The kernel as one opaque node; an input given as None is read from its output (the in-place step: no
    argument aliases another, as functionalization needs)."""
    return _run(q_proj, k_proj, v_proj, q_weight, k_weight, v_weight, *(out if t is None else t for t, out in
                ((conv_q, out_q), (conv_k, out_k), (conv_v, out_v))), out_q, out_k, out_v, f, A_log, dt_bias, b,
                out_state if state is None else state, out_state, scale, lower_bound)


@_fused_op.register_fake
def _(q_proj, k_proj, v_proj, q_weight, k_weight, v_weight, conv_q, conv_k, conv_v, out_q, out_k, out_v, f, A_log,
      dt_bias, b, state, out_state, scale, lower_bound):
    return v_proj.new_empty(v_proj.shape[0], A_log.shape[0], v_proj.shape[1] // A_log.shape[0])


def _describe(x) -> str:
    return f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, Tensor) else type(x).__name__


def _check(q_proj, k_proj, v_proj, weights, tails, f, A_log, dt_bias, b, state, out_state, out_conv) -> None:
    """One ValueError naming the first bad argument (shapes, dtypes, devices, contiguity, gradients)."""
    if not isinstance(A_log, Tensor) or A_log.dim() != 1 or A_log.numel() == 0 or A_log.dtype not in DTYPES:
        raise ValueError(f"A_log must be a [H] tensor (H >= 1) of dtype in {DTYPES}; got {_describe(A_log)}")
    H, dev = A_log.shape[0], A_log.device
    if (not isinstance(q_proj, Tensor) or q_proj.dim() != 2 or q_proj.dtype not in DTYPES or q_proj.shape[1] % H
            or not 1 <= q_proj.shape[1] // H <= MAX_HEAD_DIM or q_proj.device != dev):
        raise ValueError(f"q_proj must be [B, H*K] with H = {H}, K <= {MAX_HEAD_DIM}, dtype in {DTYPES}, on {dev}; "
                         f"got {_describe(q_proj)}")
    (B, HK), c = q_proj.shape, q_proj.dtype
    if not isinstance(k_proj, Tensor) or k_proj.shape != (B, HK) or k_proj.dtype != c or k_proj.device != dev:
        raise ValueError(f"k_proj must be {c} [B, H*K] = [{B}, {HK}] on {dev} (as q_proj); got {_describe(k_proj)}")
    if (not isinstance(v_proj, Tensor) or v_proj.dim() != 2 or v_proj.shape[0] != B or v_proj.shape[1] % H
            or not 1 <= v_proj.shape[1] // H <= MAX_HEAD_DIM or v_proj.dtype != c or v_proj.device != dev):
        raise ValueError(f"v_proj must be {c} [B, H*V] with B = {B}, H = {H}, V <= {MAX_HEAD_DIM}, on {dev}; "
                         f"got {_describe(v_proj)}")
    K, HV = HK // H, v_proj.shape[1]
    W = weights[0].shape[-1] if isinstance(weights[0], Tensor) and weights[0].dim() == 3 else 0
    for name, w, d in zip(("q_weight", "k_weight", "v_weight"), weights, (HK, HK, HV)):
        if (not isinstance(w, Tensor) or w.dim() != 3 or w.shape != (d, 1, W) or W < 2 or w.dtype != weights[0].dtype
                or w.dtype not in DTYPES or not w.is_contiguous() or w.device != dev):
            raise ValueError(f"{name} must be a contiguous [D, 1, W] = [{d}, 1, W >= 2] tensor (the W of q_weight), "
                             f"dtype in {DTYPES} as q_weight, on {dev}; got {_describe(w)}")
    for name, t, d in zip(("conv_q", "conv_k", "conv_v"), tails, (HK, HK, HV)):
        if not isinstance(t, Tensor) or t.shape != (B, d, W - 1) or t.dtype != c or not t.is_contiguous() \
                or t.device != dev:
            raise ValueError(f"{name} must be a contiguous {c} [B, D, W-1] = {[B, d, W - 1]} tensor on {dev}; "
                             f"got {_describe(t)}")
    if out_conv is not None:
        if not isinstance(out_conv, (tuple, list)) or len(out_conv) != 3:
            raise ValueError(f"out_conv must be None or three tensors (q, k, v tails); got {type(out_conv).__name__}")
        for name, t, like in zip(("out_conv[0]", "out_conv[1]", "out_conv[2]"), out_conv, tails):
            if not isinstance(t, Tensor) or t.shape != like.shape or t.dtype != c or not t.is_contiguous() \
                    or t.device != dev:
                raise ValueError(f"{name} must be a contiguous {c} {list(like.shape)} tensor on {dev}; "
                                 f"got {_describe(t)}")
    if not isinstance(f, Tensor) or f.shape != (B, HK) or f.dtype not in DTYPES or f.device != dev:
        raise ValueError(f"f must be [B, H*K] = [{B}, {HK}] of dtype in {DTYPES} on {dev}; got {_describe(f)}")
    if not isinstance(dt_bias, Tensor) or dt_bias.shape != (HK,) or dt_bias.dtype not in DTYPES \
            or dt_bias.device != dev:
        raise ValueError(f"dt_bias must be [H*K] = [{HK}] of dtype in {DTYPES} on {dev}; got {_describe(dt_bias)}")
    if not isinstance(b, Tensor) or b.shape != (B, H) or b.dtype not in DTYPES or b.device != dev:
        raise ValueError(f"b must be [B, H] = [{B}, {H}] of dtype in {DTYPES} on {dev}; got {_describe(b)}")
    shape = (B, H, K, HV // H)
    for name, s in (("state", state), ("out_state", state if out_state is None else out_state)):
        if not isinstance(s, Tensor) or s.shape != shape or s.dtype != torch.float32 or not s.is_contiguous() \
                or s.device != dev:
            raise ValueError(f"{name} must be a contiguous float32 [B, H, K, V] = {list(shape)} tensor on {dev}; "
                             f"got {_describe(s)}")
    grads = (q_proj, k_proj, v_proj, *weights, f, A_log, dt_bias, b, state)
    if torch.is_grad_enabled() and any(t.requires_grad for t in grads):
        raise ValueError("kda_decode_fused is forward only and an input requires grad: call it under torch.no_grad() "
                         "(KDA takes its unfused path when gradients are needed)")
    if dev.type != "cuda" and not INTERPRET:
        raise ValueError(f"q_proj is on {dev}: the kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1 set before "
                         "triton is imported)")


def kda_decode_fused(q_proj: Tensor, k_proj: Tensor, v_proj: Tensor, q_weight: Tensor, k_weight: Tensor,
                     v_weight: Tensor, conv_q: Tensor, conv_k: Tensor, conv_v: Tensor, f: Tensor, A_log: Tensor,
                     dt_bias: Tensor, b: Tensor, state: Tensor, *, scale: float | None = None,
                     lower_bound: float = KDA_GATE_LOWER_BOUND, out_state: Tensor | None = None,
                     out_conv: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """One KDA decode step (the module docstring's equations) -> ``o [B, H, V]`` in the activation dtype c.

    q_proj, k_proj [B, H*K], v_proj [B, H*V]: the pre-conv projections, bf16 or float32 (c); q/k/v_weight
    [D, 1, W] (W >= 2) the conv taps, float32 (K3) or bf16; conv_q, conv_k [B, H*K, W-1], conv_v [B, H*V, W-1] the
    tails in c, oldest first; f [B, H*K] the gate logits (``f_b_proj(f_a_proj(x))``); A_log [H]; dt_bias [H*K];
    b [B, H] the β logits (pre-sigmoid); state [B, H, K, V] contiguous float32; scale (default ``K^-1/2``);
    lower_bound: K3's gate bound (< 0). H is A_log's length.

    Writes the new state into ``out_state`` and the new tails into ``out_conv`` (q, k, v) — by default (None) into
    ``state`` and the tails themselves, in place. Forward only; CUDA-graph capturable."""
    weights, tails = (q_weight, k_weight, v_weight), (conv_q, conv_k, conv_v)
    if not lower_bound < 0:
        raise ValueError(f"lower_bound={lower_bound}: must be < 0 (K3: {KDA_GATE_LOWER_BOUND})")
    _check(q_proj, k_proj, v_proj, weights, tails, f, A_log, dt_bias, b, state, out_state, out_conv)
    scale = (q_proj.shape[1] // A_log.shape[0]) ** -0.5 if scale is None else float(scale)
    q_proj, k_proj, v_proj, f, b = (t.contiguous() for t in (q_proj, k_proj, v_proj, f, b))
    outs = tails if out_conv is None else tuple(out_conv)
    new_state = state if out_state is None else out_state
    if torch.compiler.is_compiling():  # an opaque node in the compiled graph; in-place inputs passed as None
        ins = tuple(None if t is out else t for t, out in zip(tails, outs))
        return _fused_op(q_proj, k_proj, v_proj, *weights, *ins, *outs, f, A_log, dt_bias, b,
                         None if state is new_state else state, new_state, scale, float(lower_bound))
    return _run(q_proj, k_proj, v_proj, *weights, *tails, *outs, f, A_log, dt_bias, b, state, new_state, scale,
                float(lower_bound))  # eager: the kernel directly (no custom-op dispatch on the decode path)


# ----------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------
def kda_decode_fused_reference(q_proj: Tensor, k_proj: Tensor, v_proj: Tensor, q_weight: Tensor, k_weight: Tensor,
                               v_weight: Tensor, conv_q: Tensor, conv_k: Tensor, conv_v: Tensor, f: Tensor,
                               A_log: Tensor, dt_bias: Tensor, b: Tensor, state: Tensor, *,
                               scale: float | None = None, lower_bound: float = KDA_GATE_LOWER_BOUND,
                               out_state: Tensor | None = None,
                               out_conv: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """:func:`kda_decode_fused` in plain torch, the module docstring's equations line by line with the same
    rounding points (any device; no argument checks). Writes the new state and tails as the kernel does (in place
    by default) and returns ``o [B, H, V]`` in c."""
    c, B, H = v_proj.dtype, v_proj.shape[0], A_log.shape[0]
    K = q_proj.shape[1] // H
    scale = K ** -0.5 if scale is None else float(scale)

    def short_conv_silu(x, taps, tail, out):  # x [B, D], taps [D, 1, W], tail [B, D, W-1] -> SiLU(conv) [B, D] in c
        dt = torch.promote_types(c, taps.dtype)
        window = torch.cat([tail.to(c), x[:, :, None]], dim=2).to(dt)             # [B, D, W] oldest first
        y = sum(taps[:, 0, w].to(dt) * window[:, :, w] for w in range(taps.shape[-1]))  # tap by tap, in dt
        out.copy_(window[:, :, 1:].to(c))                                          # the new tail
        return F.silu(y.to(c))                                                     # [B, D] in c (float32 inside)

    def l2norm(x):  # [B, H, K] float32
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)

    outs = (conv_q, conv_k, conv_v) if out_conv is None else out_conv
    q = short_conv_silu(q_proj, q_weight, conv_q, outs[0]).view(B, H, K).float()   # [B, H, K]
    k = short_conv_silu(k_proj, k_weight, conv_k, outs[1]).view(B, H, K).float()
    v = short_conv_silu(v_proj, v_weight, conv_v, outs[2]).view(B, H, -1).float()  # [B, H, V]
    q, k = l2norm(q).to(c).float(), l2norm(k).to(c).float()                        # cast to c for the step
    z = f.float().view(B, H, K) + dt_bias.float().view(H, K)                       # [B, H, K]
    g = lower_bound * torch.sigmoid(A_log.float().exp()[:, None] * z)              # [B, H, K] float32
    beta = torch.sigmoid(b.float()).to(c).float()                                  # [B, H]
    s = state.float() * g.exp()[..., None]                                         # [B, H, K, V] decay
    read = (k[..., None] * s).sum(-2)                                              # [B, H, V] Sᵀ k
    s = s + k[..., None] * (beta[..., None] * (v - read))[:, :, None, :]           # delta rule
    o = (q[..., None] * s).sum(-2) * scale                                         # [B, H, V]
    (state if out_state is None else out_state).copy_(s)
    return o.to(c)


__all__ = ["ENABLED", "LAUNCH", "MAX_HEAD_DIM", "kda_decode_fused", "kda_decode_fused_reference"]
