"""The Attention-Residuals depth mix and the next sublayer's RMSNorm, fused, forward and backward
(:func:`k3lab.residual.attn_res_normed` in two Triton kernels).

Per row, over the ``S`` sources ``v_i`` [D] (one dtype: bf16 or fp32), in float32::

    q   = γ · w                                  γ: the key norm's weight, w: the pseudo-query (the
                                                 reference's product, in the weights' dtype, then fp32)
    r_i = rsqrt(mean(v_i²) + ε₁)                 z_i = r_i (q · v_i)        p = softmax_i(z)
    h   = Σ_i p_i v_i,  rounded to the sources' dtype
    out = h · ρ · g,   ρ = rsqrt(mean(h²) + ε₂)  (no post-norm: out = h)

Backward, given ``d`` = ∂L/∂out::

    ∂h   = ρ (g·d − h ρ² mean(h · g·d))          ∂g = Σ_rows d · h · ρ
    ∂p_i = ∂h · v_i                              ∂z_i = p_i (∂p_i − Σ_j p_j ∂p_j)
    ∂v_i = p_i ∂h + ∂z_i (r_i q − r_i³ (q · v_i) / D · v_i)
    ∂q   = Σ_rows Σ_i ∂z_i r_i v_i               (∂γ = ∂q · w, ∂w = ∂q · γ: autograd, through the product q)

Traffic: the forward reads the sources once and writes ``out``; the backward reads the sources and ``d``
once and writes the ``S`` gradients — ``(3S + 2)·N·D`` elements. Nothing but the inputs is saved for
backward: every row statistic (r, q·v, p, h, ρ) is recomputed from the sources, held in registers as one
``[S, D]`` tile per row. The sources are separate pointer arguments (``S`` a compile-time constant): no
stacked copy, no address table, no host read — a CUDA graph captures both launches. ``∂q`` and ``∂g`` are
per-program partial sums ``[programs, D]`` in float32, added up by torch (deterministic, no atomics).
H200, N=16384, D=1024, bf16, forward + backward in a CUDA graph: 0.165 / 0.195 / 0.274 ms for S = 2 / 3 / 5
(1.6 to 2.1 TB/s), 2.0 to 2.4x faster than the compiled reference; called eagerly both are bound by host
time (autograd and launches, about 0.8 to 1.3 ms) — ``python -m k3lab.kernels.attn_res`` prints both.

Rounding, with bf16 sources: ``h`` is rounded to bf16 before the post-norm, and ``out = bf16(h·ρ·g)``
rounded once from float32 — what ``nn.RMSNorm`` gives for a bf16 input, with or without bf16 autocast
(which leaves it in bf16): bit for bit on the CPU (torch 2.13, float32 or bf16 g) and on an H200 in eager
float32-g (torch 2.11); there its fused kernel (bf16 g) and compiled code differ in 2e-6 to 3e-6 of the
elements, by an ulp (another order of the multiplies, fused multiply-adds). The gradients stay
float32 until their store (the reference rounds ``∂h`` to bf16 first): within bf16 rounding of it. Each bf16
store rounds to nearest even with integer ops, so that ``TRITON_INTERPRET=1`` rounds as torch does.
Unset eps (None) is ``torch.finfo(torch.float32).eps`` for both norms, as ``nn.RMSNorm`` on float32 math.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from k3lab.kernels.rounding import DTYPES, bf16_round_if

Tensor = torch.Tensor
MAX_SOURCES = 8  # pointer arguments of the kernels
MAX_FAST_WIDTH = 2048  # widest D whose [S, D] row tile (S <= 8) stays in registers; timed on the H200 at D = 1024.
                       # Wider rows are computed correctly but spill: the residual stream then keeps the torch mix


@triton.jit
def _bases(s, p0, p1, p2, p3, p4, p5, p6, p7):
    """[BLOCK_S] pointers: ``p_s`` at index s (s >= S gets an alias, masked off by the caller)."""
    base = tl.where(s == 1, p1, p0)
    base = tl.where(s == 2, p2, base)
    base = tl.where(s == 3, p3, base)
    base = tl.where(s == 4, p4, base)
    base = tl.where(s == 5, p5, base)
    base = tl.where(s == 6, p6, base)
    return tl.where(s == 7, p7, base)


@triton.jit
def _mix(V, s, q, e1, e2, S: tl.constexpr, D: tl.constexpr, BF16: tl.constexpr, HAS_POST: tl.constexpr):
    """One row: the sources V [BLOCK_S, BLOCK_D] (float32, 0 outside S x D) -> (r, qv, p [BLOCK_S],
    h [BLOCK_D] rounded to the sources' dtype, ρ (1.0 without a post-norm))."""
    r = tl.rsqrt(tl.sum(V * V, 1) / D + e1)                 # [BLOCK_S]
    qv = tl.sum(V * q[None, :], 1)                          # [BLOCK_S]
    z = tl.where(s < S, r * qv, float("-inf"))
    e = tl.exp(z - tl.max(z, 0))
    p = e / tl.sum(e, 0)                                    # [BLOCK_S], 0 past S
    h = bf16_round_if(tl.sum(p[:, None] * V, 0), BF16).to(tl.float32)  # [BLOCK_D]
    rho = 1.0
    if HAS_POST:
        rho = tl.rsqrt(tl.sum(h * h, 0) / D + e2)
    return r, qv, p, h, rho


@triton.jit
def attn_res_fwd_kernel(v0, v1, v2, v3, v4, v5, v6, v7, q_ptr, g2_ptr, out_ptr, e1, e2,
                    S: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                    BF16: tl.constexpr, HAS_POST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                     # one row per program
    s, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    d_ok = d < D
    offs = row * D + d                                      # [BLOCK_D] into [N, D]
    src = _bases(s, v0, v1, v2, v3, v4, v5, v6, v7)[:, None] + offs[None, :]  # [BLOCK_S, BLOCK_D]
    V = tl.load(src, mask=(s < S)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q = tl.load(q_ptr + d, mask=d_ok, other=0.0)            # [BLOCK_D] float32
    g2 = 1.0
    if HAS_POST:
        g2 = tl.load(g2_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    r, qv, p, h, rho = _mix(V, s, q, e1, e2, S, D, BF16, HAS_POST)
    tl.store(out_ptr + offs, bf16_round_if(h * rho * g2, BF16), mask=d_ok)


@triton.jit
def attn_res_bwd_kernel(v0, v1, v2, v3, v4, v5, v6, v7, g0, g1, g2_, g3, g4, g5, g6, g7,
                     dout_ptr, q_ptr, post_ptr, dq_part, dpost_part, N, e1, e2,
                     S: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                     BF16: tl.constexpr, HAS_POST: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)  # rows pid, pid + programs, ...
    s, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    d_ok = d < D
    mask = (s < S)[:, None] & d_ok[None, :]
    src = _bases(s, v0, v1, v2, v3, v4, v5, v6, v7)[:, None] + d[None, :]      # [BLOCK_S, BLOCK_D]
    dst = _bases(s, g0, g1, g2_, g3, g4, g5, g6, g7)[:, None] + d[None, :]
    q = tl.load(q_ptr + d, mask=d_ok, other=0.0)
    g2 = 1.0
    if HAS_POST:
        g2 = tl.load(post_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_D], dtype=tl.float32)             # this program's partial sums
    dg2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    for row in range(pid, N, programs):
        start = tl.cast(row, tl.int64) * D                 # row offset into [N, D]
        V = tl.load(src + start, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + start + d, mask=d_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
        r, qv, p, h, rho = _mix(V, s, q, e1, e2, S, D, BF16, HAS_POST)
        dh = dout
        if HAS_POST:
            gd = g2 * dout
            dh = rho * (gd - h * (rho * rho * tl.sum(h * gd, 0) / D))
            dg2 += dout * h * rho
        dp = tl.sum(V * dh[None, :], 1)                     # [BLOCK_S]
        dz = p * (dp - tl.sum(p * dp, 0))
        dV = p[:, None] * dh[None, :] + dz[:, None] * (r[:, None] * q[None, :] - (r * r * r * qv / D)[:, None] * V)
        tl.store(dst + start, bf16_round_if(dV, BF16), mask=mask)
        dq += tl.sum((dz * r)[:, None] * V, 0)
    tl.store(dq_part + pid * D + d, dq, mask=d_ok)
    if HAS_POST:
        tl.store(dpost_part + pid * D + d, dg2, mask=d_ok)


def _config(S: int, D: int) -> dict:
    block_s, block_d = triton.next_power_of_2(S), triton.next_power_of_2(D)
    warps = max(1, min(8, block_d // 256))  # S stays in each thread (no cross-warp sum over it); H200: 4 for D=1024
    return dict(S=S, D=D, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=warps)


@functools.lru_cache(maxsize=None)
def _programs_per_launch(device: torch.device) -> int:
    """Backward programs (each loops over rows): a few per multiprocessor; 4 under the interpreter."""
    if device.type != "cuda":
        return 4
    return 16 * torch.cuda.get_device_properties(device).multi_processor_count


def _padded(tensors: list[Tensor]) -> list[Tensor]:
    return [*tensors, *[tensors[0]] * (MAX_SOURCES - len(tensors))]


class _AttnResMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, post_weight: Tensor | None, e1: float, e2: float, *sources: Tensor) -> Tensor:
        v = sources[0]
        D = v.shape[-1]
        out = torch.empty_like(v)                           # [..., D]
        N = v.numel() // D
        if N > 0:
            attn_res_fwd_kernel[(N,)](*_padded(list(sources)), q, v if post_weight is None else post_weight, out, e1, e2,
                                  BF16=v.dtype == torch.bfloat16, HAS_POST=post_weight is not None,
                                  **_config(len(sources), D))
        ctx.save_for_backward(q, post_weight, *sources)     # the inputs only
        ctx.eps = (e1, e2)
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        q, post_weight, *sources = ctx.saved_tensors
        v = sources[0]
        D, N = v.shape[-1], v.numel() // v.shape[-1]
        grads = [torch.empty_like(x) for x in sources]      # S x [..., D]
        programs = max(1, min(N, _programs_per_launch(v.device)))
        dq_part = torch.zeros(programs, D, dtype=torch.float32, device=v.device)  # [programs, D]
        dpost_part = torch.zeros_like(dq_part) if post_weight is not None else dq_part
        if N > 0:
            attn_res_bwd_kernel[(programs,)](*_padded(list(sources)), *_padded(grads), d_out.contiguous(), q,
                                          v if post_weight is None else post_weight, dq_part, dpost_part, N,
                                          *ctx.eps, BF16=v.dtype == torch.bfloat16,
                                          HAS_POST=post_weight is not None, **_config(len(sources), D))
        dpost = None if post_weight is None else dpost_part.sum(0).to(post_weight.dtype)
        return dq_part.sum(0), dpost, None, None, *grads


def _check(name: str, t: Tensor, shape: tuple, device: torch.device, dtypes=DTYPES) -> None:
    if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.dtype not in dtypes or t.device != device:
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape {shape}, dtype in {dtypes}, on {device}; got {got}")


def attn_res_mix(sources: list[Tensor], proj_weight: Tensor, norm_weight: Tensor, norm_eps: float | None,
                 post_weight: Tensor | None, post_eps: float | None) -> Tensor:
    """``attn_res_normed(sources, proj, norm, post_norm)[0]`` fused (module docstring): ``proj_weight``
    [1, D] (``proj.weight``), ``norm_weight`` [D] and ``norm_eps`` (``norm``'s), ``post_weight`` [D] and
    ``post_eps`` (``post_norm``'s; ``post_weight=None``: no post-norm, then ``post_eps`` must be None too).

    sources: 1 to MAX_SOURCES contiguous tensors [..., D] of one shape, dtype (bf16 or float32) and device.
    Returns out [..., D] in the sources' dtype, differentiable w.r.t. the sources and the three weights.
    """
    if not isinstance(sources, (list, tuple)) or not 1 <= len(sources) <= MAX_SOURCES:
        got = f"{len(sources)} sources" if isinstance(sources, (list, tuple)) else type(sources).__name__
        raise ValueError(f"sources: need a list of 1 to MAX_SOURCES={MAX_SOURCES} tensors, got {got}")
    v = sources[0]
    if not isinstance(v, Tensor) or v.dim() == 0:
        raise ValueError(f"sources[0] must be a tensor [..., D], got {getattr(v, 'shape', type(v).__name__)}")
    for i, x in enumerate(sources):
        _check(f"sources[{i}]", x, tuple(v.shape), v.device, (v.dtype,) if i else DTYPES)
        if not x.is_contiguous():
            raise ValueError(f"sources[{i}] must be contiguous (shape {tuple(x.shape)}, strides {x.stride()})")
    D = v.shape[-1]
    _check("proj_weight", proj_weight, (1, D), v.device)
    _check("norm_weight", norm_weight, (D,), v.device)
    if post_weight is not None:
        _check("post_weight", post_weight, (D,), v.device)
    elif post_eps is not None:
        raise ValueError(f"post_eps={post_eps}: allowed values without a post_weight are (None,)")
    eps = torch.finfo(torch.float32).eps
    q = (norm_weight * proj_weight[0]).float()              # [D]: as the reference, differentiable by autograd
    return _AttnResMix.apply(q, post_weight, eps if norm_eps is None else float(norm_eps),
                             eps if post_eps is None else float(post_eps), *sources)
