"""The routed experts of one MoE layer at decode batch sizes, fused: no sort of the token slots — each (token, slot)
reads its own expert's weights (:class:`k3lab.moe.latent.LatentMoE` takes it for N·k ≤ 128 slots on CUDA without
gradients: :func:`k3lab.moe.latent.use_decode_kernel`).

N tokens z [N, L], top-k expert ids T [N, k] (int64), routing weights p [N, k] (float32), experts stacked as
``w1, w3 [E, I, L]`` (gate, up) and ``w2 [E, L, I]`` (down)::

    u[n] = Σ_j p[n, j] · W2[e_nj] · act(W1[e_nj] z[n], W3[e_nj] z[n]),     e_nj = T[n, j]          u [N, L] float32

    act = SiTU-GLU   [β1·tanh(g/β1)·σ(g)] ⊙ [β2·tanh(u/β2)]     or     SwiGLU   [g·σ(g)] ⊙ u     (k3lab.moe.situ)

The sorted path it replaces — :meth:`LocalDispatcher.run <k3lab.moe.latent.LocalDispatcher.run>`: an argsort of
the N·k slots by expert, a gather, grouped GEMMs, the combine — is a chain of small kernels whose cost at N ≤ 16
is their number, not their bytes. Here three kernels, slot ``s = n·k + j``:

1. up:    ``h[s, i] = act(W1[e_s, i] · z[n], W3[e_s, i] · z[n])`` — grid (S = N·k slots, I blocks); a program reads
   BLOCK_I rows of its expert's W1 and W3 once, walking L;
2. down:  ``y[s, l] = W2[e_s, l] · h[s]`` — grid (S slots, L blocks); a program walks its slot's I;
3. combine: ``u[n, l] = Σ_j p[n, j] · y[n·k + j, l]`` — grid (N tokens, L blocks), the k slots in order
   j = 0..k-1. Every output element is written by one program: no atomics, the same bits every run.

Precision: the rounding points of the sorted path. The compute dtype c is z's (bf16 or float32; LatentMoE casts z
to the autocast dtype first, as :class:`~k3lab.moe.latent.RoutedExperts` does). Weights are read in their own
dtype and rounded to c in registers (``w.to(c)``, without the copy); every dot product accumulates in float32 and
is rounded to c where the GEMMs' outputs are — gate and up, the activation h (computed in float32 from the rounded
gate and up, as ``glu_activation``), the expert output y = W2 h — and the weighted sum ``Σ_j p_j·y_j`` runs in
float32 (bf16 expert output × float32 routing weight). bf16 rounds to nearest even in integer ops
(:mod:`k3lab.kernels.rounding`: the same bits under ``TRITON_INTERPRET=1``). tanh is computed from ``exp``
(:func:`_tanh`: Triton's interpreter has no ``libdevice.tanh``), within a few float32 ulps.

**CUDA graphs.** Launches depend on shapes only (no value read back, no data-dependent shape); the expert ids
are read by the kernels. Warm up (compile) before capture, as any Triton kernel. Under ``torch.compile`` the entry
calls the ``torch.library`` custom op ``k3lab::moe_routed_experts_decode`` (an opaque node with a fake
implementation); eager calls launch the kernels directly. Forward only (decoding): the entry refuses inputs that
need gradients.

Launch parameters: :data:`LAUNCH`. On CPU the kernels run under
``TRITON_INTERPRET=1`` (set before triton is imported): tests/test_moe_decode_kernel.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from k3lab.config import HIDDEN_ACTS
from k3lab.kernels.rounding import DTYPES, bf16_round_if, bf16_round_if_f32

Tensor = torch.Tensor

ENABLED = True  # LatentMoE.routed runs eligible calls here (on since the GPU suite and `kernels/bench_generate.py`
# ran with it on, issue 36); False: the sorted grouped path everywhere
MAX_SLOTS = 128  # N·k at most: decode batches (the kernels read every slot's expert weights; larger N sorts)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Launch parameters. up: a program's tile [up_block_i, ≤ up_block_l] of W1 and of W3; down: a program's tile
# [down_block_l, ≤ down_block_i] of W2 for one slot — rows of W2 are contiguous along I, so a wide I block reads
# long runs; one program per (slot, L block) gives 8 × 64 = 512 programs at small's N = 1 (one per (token, L block)
# gave 64, and the down kernel took 26 µs a layer on one H100, 2026-12-06: 10x its bytes); combine: columns a program
LAUNCH = dict(up_block_i=16, up_block_l=128, down_block_l=8, down_block_i=256, combine_block_l=128)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    """tanh in float32: ``sign(x)·(1 − e)/(1 + e)``, ``e = exp(−2|x|)``; for |x| < 1/4 the odd Taylor series to x⁹
    (truncation < 1e-8 relative), where ``1 − e`` would cancel."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    a2 = a * a
    near = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.25, near, far)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _glu(gate, up, beta, linear_beta, SITU: tl.constexpr):
    """act(gate, up) in float32: SiTU-GLU ``(β1·tanh(g/β1)·σ(g))·(β2·tanh(u/β2))`` or SwiGLU ``g·σ(g)·u``."""
    if SITU:
        return (beta * _tanh(gate / beta) * tl.sigmoid(gate)) * (linear_beta * _tanh(up / linear_beta))
    else:
        return gate * tl.sigmoid(gate) * up


@triton.jit
def _decode_up_kernel(Z, IDX, W1, W3, H, I, L, beta, linear_beta,
                      s1_e, s1_i, s1_l, s3_e, s3_i, s3_l,
                      TOP_K: tl.constexpr, SITU: tl.constexpr, BF16: tl.constexpr, ROUND_W1: tl.constexpr,
                      ROUND_W3: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr):
    """H[s, i] = act(W1[e_s, i]·z[s // k], W3[e_s, i]·z[s // k]) for one slot s and BLOCK_I rows i."""
    s = tl.program_id(0)
    n = s // TOP_K                                                                  # the slot's token
    e = tl.load(IDX + s).to(tl.int64)                                               # the slot's expert
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)                       # [BLOCK_I] i
    row_ok = rows < I
    acc_g = tl.zeros((BLOCK_I, BLOCK_L), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I, BLOCK_L), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)                                           # [BLOCK_L] l
        col_ok = cols < L
        mask = row_ok[:, None] & col_ok[None, :]
        z = tl.load(Z + n * L + cols, mask=col_ok, other=0.0).to(tl.float32)        # [BLOCK_L]
        w1 = tl.load(W1 + e * s1_e + rows[:, None] * s1_i + cols[None, :] * s1_l, mask=mask, other=0.0)
        w3 = tl.load(W3 + e * s3_e + rows[:, None] * s3_i + cols[None, :] * s3_l, mask=mask, other=0.0)
        acc_g += bf16_round_if_f32(w1.to(tl.float32), ROUND_W1) * z[None, :]               # [BLOCK_I, BLOCK_L]
        acc_u += bf16_round_if_f32(w3.to(tl.float32), ROUND_W3) * z[None, :]
    gate = bf16_round_if_f32(tl.sum(acc_g, 1), BF16)                                     # [BLOCK_I], as the GEMM rounds
    up = bf16_round_if_f32(tl.sum(acc_u, 1), BF16)
    h = _glu(gate, up, beta, linear_beta, SITU)                                     # float32
    tl.store(H + s * I + rows, bf16_round_if(h, BF16), mask=row_ok)                 # rounded to the compute dtype


@triton.jit
def _decode_down_kernel(H, IDX, W2, Y, I, L, s2_e, s2_l, s2_i,
                        BF16: tl.constexpr, ROUND_W2: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_I: tl.constexpr):
    """Y[s, l] = round(W2[e_s, l]·H[s]) for one slot s and BLOCK_L columns l: the expert's output, rounded to c."""
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)                       # [BLOCK_L] l
    col_ok = cols < L
    e = tl.load(IDX + s).to(tl.int64)
    acc = tl.zeros((BLOCK_L, BLOCK_I), dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        ks = i0 + tl.arange(0, BLOCK_I)                                             # [BLOCK_I] i
        k_ok = ks < I
        h = tl.load(H + s * I + ks, mask=k_ok, other=0.0).to(tl.float32)           # [BLOCK_I]
        w2 = tl.load(W2 + e * s2_e + cols[:, None] * s2_l + ks[None, :] * s2_i,
                     mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += bf16_round_if_f32(w2.to(tl.float32), ROUND_W2) * h[None, :]                 # [BLOCK_L, BLOCK_I]
    y = bf16_round_if_f32(tl.sum(acc, 1), BF16)                                          # [BLOCK_L] the expert's output
    tl.store(Y + s * L + cols, y, mask=col_ok)


@triton.jit
def _decode_combine_kernel(Y, P, U, L, TOP_K: tl.constexpr, BLOCK_L: tl.constexpr):
    """U[n, l] = Σ_j P[n, j]·Y[n·k + j, l] for one token n and BLOCK_L columns, j in order (float32)."""
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    col_ok = cols < L
    u = tl.zeros((BLOCK_L,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        s = n * TOP_K + j
        u += tl.load(P + s) * tl.load(Y + s * L + cols, mask=col_ok, other=0.0)     # bf16-valued × fp32 -> fp32
    tl.store(U + n * L + cols, u, mask=col_ok)


# ----------------------------------------------------------------------------------------------
# host side: shapes -> launch (no data read)
# ----------------------------------------------------------------------------------------------
def _run(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, act: str,
         beta: float, linear_beta: float) -> Tensor:
    N, L = z.shape
    k = topk_idx.shape[1]
    I = w1.shape[1]
    u = torch.empty(N, L, dtype=torch.float32, device=z.device)                    # [N, L]
    if N == 0 or L == 0:
        return u
    if I == 0 or k == 0:
        return u.zero_()
    z, idx, p = z.contiguous(), topk_idx.contiguous(), topk_weight.contiguous()    # [N, L], [N, k], [N, k]
    h = torch.empty(N * k, I, dtype=z.dtype, device=z.device)                      # [N·k, I] in the compute dtype
    bf16 = z.dtype == torch.bfloat16
    rounds = [bf16 and w.dtype != torch.bfloat16 for w in (w1, w3, w2)]          # float32 weights, bf16 compute
    bi, bl = LAUNCH["up_block_i"], min(LAUNCH["up_block_l"], triton.next_power_of_2(L))
    _decode_up_kernel[(N * k, triton.cdiv(I, bi))](
        z, idx, w1, w3, h, I, L, float(beta), float(linear_beta), *w1.stride(), *w3.stride(),
        TOP_K=k, SITU=act == "situ", BF16=bf16, ROUND_W1=rounds[0], ROUND_W3=rounds[1], BLOCK_I=bi, BLOCK_L=bl)
    y = torch.empty(N * k, L, dtype=torch.float32, device=z.device)                # [N·k, L] experts' outputs
    bl, bi = LAUNCH["down_block_l"], min(LAUNCH["down_block_i"], triton.next_power_of_2(I))
    _decode_down_kernel[(N * k, triton.cdiv(L, bl))](
        h, idx, w2, y, I, L, *w2.stride(), BF16=bf16, ROUND_W2=rounds[2], BLOCK_L=bl, BLOCK_I=bi)
    bc = min(LAUNCH["combine_block_l"], triton.next_power_of_2(L))
    _decode_combine_kernel[(N, triton.cdiv(L, bc))](y, p, u, L, TOP_K=k, BLOCK_L=bc)
    return u


@torch.library.custom_op("k3lab::moe_routed_experts_decode", mutates_args=())
def _decode_op(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, act: str,
               beta: float, linear_beta: float) -> Tensor:
    return _run(z, topk_idx, topk_weight, w1, w3, w2, act, beta, linear_beta)


@_decode_op.register_fake
def _(z, topk_idx, topk_weight, w1, w3, w2, act, beta, linear_beta):
    return z.new_empty(z.shape, dtype=torch.float32)


def _describe(x) -> str:
    return f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, Tensor) else type(x).__name__


def _check(z, topk_idx, topk_weight, w1, w3, w2, act) -> None:
    """One ValueError naming the first bad argument (shapes, dtypes, devices, the slot limit, gradients)."""
    if not isinstance(z, Tensor) or z.dim() != 2 or z.dtype not in DTYPES:
        raise ValueError(f"z must be a [N, L] tensor of dtype in {DTYPES}; got {_describe(z)}")
    N, L = z.shape
    dev = z.device
    if (not isinstance(topk_idx, Tensor) or topk_idx.dim() != 2 or topk_idx.shape[0] != N
            or topk_idx.dtype != torch.int64 or topk_idx.device != dev):
        raise ValueError(f"topk_idx must be int64 [N, k] with N = {N} on {dev}; got {_describe(topk_idx)}")
    k = topk_idx.shape[1]
    if N * k > MAX_SLOTS:
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)}: N·k = {N * k} slots exceeds MAX_SLOTS = {MAX_SLOTS} "
                         f"(larger batches take the sorted path)")
    if (not isinstance(topk_weight, Tensor) or topk_weight.shape != (N, k) or topk_weight.dtype != torch.float32
            or topk_weight.device != dev):
        raise ValueError(f"topk_weight must be float32 [N, k] = [{N}, {k}] on {dev}; got {_describe(topk_weight)}")
    if not isinstance(w1, Tensor) or w1.dim() != 3 or w1.shape[2] != L or w1.dtype not in DTYPES or w1.device != dev:
        raise ValueError(f"w1 must be [E, I, L] with L = {L}, dtype in {DTYPES}, on {dev}; got {_describe(w1)}")
    E, I, _ = w1.shape
    if not isinstance(w3, Tensor) or w3.shape != w1.shape or w3.dtype not in DTYPES or w3.device != dev:
        raise ValueError(f"w3 must be [E, I, L] = {tuple(w1.shape)} (as w1), dtype in {DTYPES}, on {dev}; "
                         f"got {_describe(w3)}")
    if not isinstance(w2, Tensor) or w2.shape != (E, L, I) or w2.dtype not in DTYPES or w2.device != dev:
        raise ValueError(f"w2 must be [E, L, I] = {(E, L, I)}, dtype in {DTYPES}, on {dev}; got {_describe(w2)}")
    if act not in HIDDEN_ACTS:
        raise ValueError(f"act={act!r}: allowed values are {HIDDEN_ACTS}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (z, topk_weight, w1, w3, w2)):
        raise ValueError("routed_experts_decode is forward only and an input requires grad: call it under "
                         "torch.no_grad() (LatentMoE takes the sorted path when gradients are needed)")
    if dev.type != "cuda" and not INTERPRET:
        raise ValueError(f"z is on {dev}: the kernels run on CUDA (or on CPU with TRITON_INTERPRET=1 set before "
                         f"triton is imported)")


def routed_experts_decode(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                          act: str = "situ", beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    """``u[n] = Σ_j p[n, j]·W2[e_nj]·act(W1[e_nj] z[n], W3[e_nj] z[n])`` (the module docstring has the precision).

    z [N, L] bf16/float32 (the compute dtype); topk_idx [N, k] int64 expert ids in [0, E) (not checked: that would
    read the device), with N·k ≤ :data:`MAX_SLOTS`; topk_weight [N, k] float32; w1, w3 [E, I, L] and w2 [E, L, I],
    bf16/float32 (any strides), each rounded to z's dtype as read; act "situ" | "swiglu" (β's: SiTU only).
    Returns u [N, L] float32. Forward only; CUDA-graph capturable."""
    _check(z, topk_idx, topk_weight, w1, w3, w2, act)
    args = (z, topk_idx, topk_weight, w1, w3, w2, act, float(beta), float(linear_beta))
    if torch.compiler.is_compiling():  # an opaque node in the compiled graph
        return _decode_op(*args)
    return _run(*args)  # eager: the kernels directly (no custom-op dispatch on the decode path)


# ----------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------
def _glu_reference(gate: Tensor, up: Tensor, act: str, beta: float, linear_beta: float) -> Tensor:
    """act(gate, up) in float32 (the formulas of k3lab.moe.situ), rounded to gate's dtype."""
    g, u = gate.float(), up.float()
    if act == "situ":
        out = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (linear_beta * torch.tanh(u / linear_beta))
    else:
        out = g * torch.sigmoid(g) * u
    return out.to(gate.dtype)


def routed_experts_decode_reference(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, w1: Tensor, w3: Tensor,
                                    w2: Tensor, act: str = "situ", beta: float = 4.0,
                                    linear_beta: float = 25.0) -> Tensor:
    """The same sum in plain torch, a loop over tokens and slots (any device; one host read per slot): each dot
    product in float32 from the operands rounded to z's dtype c, its result rounded to c, as the kernels.
    Returns u [N, L] float32."""
    c = z.dtype
    N, k = topk_idx.shape
    u = torch.zeros(N, z.shape[1], dtype=torch.float32, device=z.device)           # [N, L]
    for n in range(N):
        x = z[n].float()                                                            # [L]
        for j in range(k):
            e = int(topk_idx[n, j])
            gate = (w1[e].to(c).float() @ x).to(c)                                  # [I]
            up = (w3[e].to(c).float() @ x).to(c)                                    # [I]
            h = _glu_reference(gate, up, act, beta, linear_beta)                    # [I] in c
            y = (w2[e].to(c).float() @ h.float()).to(c)                             # [L] expert output in c
            u[n] += topk_weight[n, j].float() * y.float()                           # c × fp32 -> fp32
    return u


__all__ = ["MAX_SLOTS", "LAUNCH", "routed_experts_decode", "routed_experts_decode_reference"]
