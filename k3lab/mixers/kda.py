"""The K3 KDA layer: Kimi Delta Attention with K3's bounded gate and full-rank output gate (docs/k3_reference.md §2).

Per token ``x_t [D]`` and head ``h`` (``H`` heads, ``K = V = head_dim``)::

    q_t, k_t = L2Norm(SiLU(ShortConv(W_{q/k} x_t)))                  (eps 1e-6, float32)
    v_t      =        SiLU(ShortConv(W_v x_t))
    β_t      = σ(W_β x_t)                                            ∈ (0, 1)     (b_proj)
    z_t      = W_α↑ W_α↓ x_t + b_α                                   (f_b_proj ∘ f_a_proj, rank K; dt_bias)
    g_t      = g_min · σ(e^{A_h} z_t),  g_min = -5                   ∈ (-5, 0)^K  (kda_gate="k3")
             = -e^{A_h} · softplus(z_t)                              ∈ (-∞, 0)^K  (kda_gate="kimi_linear")
    S_t      = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t-1} + β_t k_t v_tᵀ,   õ_t = S_tᵀ (K^{-1/2} q_t)
    y_t      = W_o [ σ(W_g x_t) ⊙ RMSNorm_head(õ_t) ]                (g_proj full rank, no bias; o_norm [V])
    W_g      = W_g↑ W_g↓                                             (Kimi Linear: g_b_proj ∘ g_a_proj, rank K,
                                                                      linear_attn_config.use_full_rank_gate=False)

The recurrence runs chunkwise (``k3lab.mixers.chunk.kda_chunk``) for prompts and training, one
step at a time for decoding; the layer carries its state in a :class:`KDACache`, so feeding a
sequence piece by piece gives the same output as one forward over all of it.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3lab.backend import resolve_backend
from k3lab.config import KDA_GATE_LOWER_BOUND, KDA_GATES
from k3lab.linear import Linear
from k3lab.mixers.chunk import kda_chunk
from k3lab.mixers.lineage import kda_recurrent

Tensor = torch.Tensor

L2NORM_EPS = 1e-6  # fla l2norm_fwd and the fused recurrent kernel (docs/k3_reference.md §2.1)


@dataclass
class KDACache:
    """What a KDA layer carries between calls: the delta-rule state and the three conv tails.

    recurrent: ``[B, H, K, V]`` float32 (float64 in float64 runs); fla's K-first layout.
    conv_q, conv_k, conv_v: ``[B, H*K, W-1]`` (``[B, H*V, W-1]`` for v), the last ``W-1``
    projected inputs of each short convolution, oldest first.

    A forward returns a new cache and leaves this one untouched (a kept reference is a snapshot); for a
    :class:`StaticKDACache` it writes into the given tensors instead.
    """

    recurrent: Tensor
    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor
    in_place: ClassVar[bool] = False  # StaticKDACache: a step overwrites these tensors



def fla_available() -> bool:
    """Whether fla's KDA ops import (flash-linear-attention is installed)."""
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return False
    return True


def kda_backend(backend: str, device, bounded_gate: bool, fla_importable=fla_available) -> str:
    """The backend a KDA layer runs on: :func:`k3lab.backend.resolve_backend`, except that ``"auto"`` on CUDA with
    a gate our Triton kernels do not take (Kimi Linear's unbounded gate, or K3's with a lower bound below −5)
    picks fla where it is installed and the torch reference otherwise — "auto" means the fastest path that
    runs this layer. An explicit ``"triton"`` is not changed (it fails with a message naming the alternatives)."""
    resolved = resolve_backend(backend, device)
    if backend == "auto" and resolved == "triton" and not bounded_gate:
        return "fla" if fla_importable() else "torch"
    return resolved


FUSED_DECODE_DTYPES = (torch.bfloat16, torch.float32)  # activation dtypes the fused decode kernel takes


def use_fused_decode(backend: str, device, tokens: int, needs_grad: bool, gate_kind: str, lower_bound: float,
                     dtypes: tuple, *, has_cache: bool = True, autocast: bool = False,
                     context_parallel: bool = False) -> bool:
    """Whether a KDA forward runs as the fused one-token decode kernel (:mod:`k3lab.kernels.kda_decode_fused`:
    convs + SiLU, l2 norms, gate, β and the recurrence in one launch; taken only while its ``ENABLED`` is on).
    All must hold: ``device`` is CUDA and :func:`kda_backend` resolves to "triton" there, ``tokens == 1``, no
    gradient is needed, a cache is given, no autocast, no context parallelism, K3's bounded gate (``gate_kind="k3"``,
    ``lower_bound >= -5``: Kimi Linear's gate keeps today's path), and ``dtypes`` = (activation, state, conv_q,
    conv_k, conv_v) is (c, float32, c, c, c) with c in :data:`FUSED_DECODE_DTYPES`. Pure: no GPU needed to decide."""
    device = torch.device(device)
    act, state, *tails = dtypes
    return (device.type == "cuda" and tokens == 1 and not needs_grad and has_cache and not autocast
            and not context_parallel and gate_kind == "k3" and lower_bound >= KDA_GATE_LOWER_BOUND
            and act in FUSED_DECODE_DTYPES and state == torch.float32 and all(t == act for t in tails)
            and kda_backend(backend, device, True) == "triton")


class StaticKDACache(KDACache):
    """A :class:`KDACache` that a forward updates in place (graphed decoding, :mod:`k3lab.infer.static`): the new
    state and tails are written into these tensors and the same cache is returned — the fixed addresses a
    CUDA graph replays."""

    in_place = True


@dataclass
class StaticKDAStepCache(StaticKDACache):
    """A :class:`StaticKDACache` whose multi-token forward keeps the state after every token (the speculative
    verify on the static decoder: "keep per-step states", :mod:`k3lab.infer.speculative`). :meth:`KDA.forward_steps`
    runs tokens ``x_0 … x_{T-1}`` one recurrent step each from ``recurrent`` (left unchanged)::

        S_i = (I − β_i k_i k_iᵀ) Diag(e^{g_i}) S_{i−1} + β_i k_i v_iᵀ,   S_{−1} = recurrent  ->  states[i]

    and writes each conv window ``[tail ; projected inputs]``; :meth:`keep` then makes the cache the one after
    token ``j_b`` in each row b (a rollback on the device, no replay).

    states:   ``[T_max, B, H, K, V]`` float32, ``states[i]`` the state after token i (each one contiguous: our
              Triton decode step writes it in place)
    window_q, window_k, window_v: ``[B, W-1+T_max, H*K]`` (``H*V`` for v): the old tail then the T new projected
              inputs, oldest first; the tail after token i is rows ``i+1 … i+W-1``.
    """

    states: Tensor
    window_q: Tensor
    window_k: Tensor
    window_v: Tensor

    def keep(self, j: Tensor, rows: Tensor | None = None) -> None:
        """Row b keeps the state and conv tails after token ``j_b`` of the last :meth:`KDA.forward_steps`
        (j: int64 [B] on the device, 0 <= j_b < T; no host read)::

            recurrent[b] = states[j_b, b],   conv_*[b] = window_*[b, j_b+1 … j_b+W-1]ᵀ

        ``rows``: bool [B] or None (all); a row where it is False keeps the cache it had before the step."""
        B, W1 = self.conv_q.shape[0], self.conv_q.shape[-1]
        state = self.states[j, torch.arange(B, device=j.device)]  # [B, H, K, V]
        if rows is not None:
            state = torch.where(rows[:, None, None, None], state, self.recurrent)
        self.recurrent.copy_(state)
        at = j[:, None] + 1 + torch.arange(W1, device=j.device)  # [B, W-1] window rows after token j
        for tail, window in ((self.conv_q, self.window_q), (self.conv_k, self.window_k), (self.conv_v, self.window_v)):
            new = window.gather(1, at[:, :, None].expand(B, W1, window.shape[2])).transpose(1, 2)  # [B, D, W-1]
            tail.copy_(new if rows is None else torch.where(rows[:, None, None], new, tail))


def kda_gate(z: Tensor, A_log: Tensor, dt_bias: Tensor, kind: str = "k3",
             lower_bound: float = KDA_GATE_LOWER_BOUND) -> Tensor:
    r"""Per-channel log-decay ``g`` from the forget logits (docs/k3_reference.md §2.1; §13 for the two kinds).

    ``kind="k3"``:          ``g = lower_bound · σ(e^{A_log} (z + dt_bias))``  ∈ (lower_bound, 0)
    ``kind="kimi_linear"``: ``g = −e^{A_log} · softplus(z + dt_bias)``         ∈ (−∞, 0)

    z: ``[..., H, K]`` raw logits (``f_b_proj(f_a_proj(x))``); A_log: ``[H]``; dt_bias: ``[H*K]``.
    Computed and returned in float32 (float64 when ``z`` is float64), like fla's ``naive_kda_gate``
    and ``naive_kda_lowerbound_gate``.
    """
    if kind not in KDA_GATES:
        raise ValueError(f"kind={kind!r}: allowed values are {KDA_GATES}")
    H, K = z.shape[-2:]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must be [H] = ({H},), got {tuple(A_log.shape)}")
    if dt_bias.shape != (H * K,):
        raise ValueError(f"dt_bias must be [H*K] = ({H * K},), got {tuple(dt_bias.shape)}")
    if kind == "k3" and not lower_bound < 0:
        raise ValueError(f"lower_bound={lower_bound}: must be < 0 (K3: {KDA_GATE_LOWER_BOUND})")
    if kind == "k3" and torch.is_grad_enabled() and any(t.requires_grad for t in (z, A_log, dt_bias)):
        return K3GateFunction.apply(z, A_log, dt_bias, float(lower_bound))
    return kda_gate_reference(z, A_log, dt_bias, kind, lower_bound)


def kda_gate_reference(z: Tensor, A_log: Tensor, dt_bias: Tensor, kind: str = "k3",
                       lower_bound: float = KDA_GATE_LOWER_BOUND) -> Tensor:
    """:func:`kda_gate`'s formula in plain ops, differentiated by autograd (which keeps the float32
    ``σ(e^{A} z)`` of the K3 gate, 4 bytes per channel and token, for backward). No argument checks."""
    H, K = z.shape[-2:]
    dtype = torch.promote_types(z.dtype, torch.float32)
    z = z.to(dtype) + dt_bias.to(dtype).view(H, K)  # [..., H, K]
    a = A_log.to(dtype).exp()[:, None]  # e^{A_h} [H, 1]
    if kind == "k3":
        return lower_bound * torch.sigmoid(a * z)  # g ∈ (-5, 0): 16 steps ≥ e^-80, inside bf16
    return -a * F.softplus(z)


class K3GateFunction(torch.autograd.Function):
    r"""The K3 gate ``g = lb · σ(a ⊙ z')``, ``z' = z + dt_bias``, ``a = e^{A_log}`` (per head), saving only
    ``z`` (in its own dtype: bf16 under autocast, the ``f_b_proj`` output) and the two parameters; ``σ``
    is recomputed in backward instead of kept in float32. With ``s = σ(a z')`` and upstream ``ḡ``::

        ū = sigmoid_backward(lb·ḡ, s) = lb·ḡ·s(1 − s)        (u = a z')
        z̄ = ū·a      dt̄_bias = Σ_{batch} ū·a      Ā_log = a · Σ_{batch, K} ū·z'

    the same ops, in the same order, as autograd applies to :func:`kda_gate_reference`.
    """

    @staticmethod
    def forward(ctx, z: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
        ctx.save_for_backward(z, A_log, dt_bias)
        ctx.lower_bound = lower_bound
        return kda_gate_reference(z, A_log, dt_bias, "k3", lower_bound)

    @staticmethod
    def backward(ctx, grad_g: Tensor):
        z, A_log, dt_bias = ctx.saved_tensors
        H, K = z.shape[-2:]
        dtype = torch.promote_types(z.dtype, torch.float32)
        zb = z.to(dtype) + dt_bias.to(dtype).view(H, K)  # z' [..., H, K]
        a = A_log.to(dtype).exp()[:, None]  # [H, 1]
        s = torch.sigmoid(a * zb)
        du = torch.ops.aten.sigmoid_backward(grad_g * ctx.lower_bound, s)  # [..., H, K]
        dzb = du * a
        dz = dzb.to(z.dtype) if ctx.needs_input_grad[0] else None
        dA = (du * zb).sum_to_size(a.shape) * a if ctx.needs_input_grad[1] else None  # d/dA_log e^{A_log} = a
        dA = None if dA is None else dA.view(H).to(A_log.dtype)
        ddt = dzb.sum_to_size(H, K).reshape(H * K).to(dt_bias.dtype) if ctx.needs_input_grad[2] else None
        return dz, dA, ddt, None


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    r"""Depthwise causal convolution with a carried tail (the ShortConv of docs/k3_reference.md §2.1, without its SiLU).

    ``y_t[d] = Σ_{w<W} weight[d, 0, w] · x_{t−W+1+w}[d]``, where inputs before ``x_0`` come from
    ``conv_state`` (zeros when None).

    x: ``[B, T, D]``; weight: ``[D, 1, W]``; conv_state: ``[B, D, W-1]`` (oldest first) or None.
    Returns ``(y [B, T, D] in x's dtype, new_state [B, D, W-1])``, where new_state holds the last
    ``W-1`` inputs seen (from conv_state when ``T < W-1``). The product runs in the promoted dtype of
    x and weight (float32 for bf16 activations with K3's float32 conv weights).
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    if weight.dim() != 3 or weight.shape[:2] != (D, 1):
        raise ValueError(f"weight must be [D, 1, W] with D={D}, got {tuple(weight.shape)}")
    W = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(B, D, W - 1)
    elif conv_state.shape != (B, D, W - 1):
        raise ValueError(f"conv_state must be [B, D, W-1] = {(B, D, W - 1)}, got {tuple(conv_state.shape)}")
    xs = torch.cat([conv_state.to(x.dtype).transpose(1, 2), x], dim=1)  # [B, W-1+T, D]
    dtype = torch.promote_types(x.dtype, weight.dtype)
    taps = weight.to(dtype)[:, 0, :].T  # [W, D]
    window = xs.to(dtype)
    # W taps beat a depthwise conv1d kernel; in x's [B, T, D] layout the output is contiguous, so the
    # kernels that take it (the KDA op: v) need no copy
    y = sum(taps[w] * window[:, w : w + T] for w in range(W))  # [B, T, D]
    return y.to(x.dtype), xs[:, T:].transpose(1, 2).contiguous()


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim, in float32 (float64 stays float64), as fla's l2norm."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def inverse_softplus_dt_bias(n: int, dt_min: float = 1e-3, dt_max: float = 1e-1, dt_floor: float = 1e-4,
                             generator: torch.Generator | None = None) -> Tensor:
    """fla's (Mamba2 / GDN / Kimi Linear) ``dt_bias`` init: ``dt ~ exp(U[log dt_min, log dt_max])``
    clamped at ``dt_floor``, then ``softplus⁻¹(dt) = dt + log(−expm1(−dt))`` (docs/k3_reference.md §2.1).
    Returns ``[n]`` float32."""
    u = torch.rand(n, dtype=torch.float32, generator=generator)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_floor)
    return dt + torch.log(-torch.expm1(-dt))


class ShortConvolution(nn.Conv1d):
    """Causal depthwise conv (kernel W, no bias, weight ``[D, 1, W]`` kept in float32) fused with SiLU.

    ``forward(x [B, T, D], conv_state [B, D, W-1] | None) -> (SiLU(conv(x)) [B, T, D], new_state)``.
    """

    def __init__(self, dim: int, kernel_size: int):
        super().__init__(dim, dim, kernel_size, groups=dim, bias=False, dtype=torch.float32)

    def forward(self, x: Tensor, conv_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        y, new_state = causal_conv1d(x, self.weight, conv_state)
        return F.silu(y), new_state


class KDA(nn.Module):
    """The K3 KDA token mixer (equations in the module docstring); checkpoint names (docs/k3_reference.md §1.2).

    ``forward(x [B, T, D], cache: KDACache | None) -> (y [B, T, D], KDACache)``. The backend
    (``cfg.backend`` resolved on x's device): "torch" runs ``kda_chunk`` (``kda_recurrent`` for one
    token), "fla" runs fla's ``chunk_kda`` (``safe_gate`` for the K3 gate) and ``fused_recurrent_kda``
    for one-token decoding without autograd, "triton" runs ``k3lab.kernels``.
    """

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        lac = cfg.linear_attn_config  # validated by ModelConfig: kda_gate in KDA_GATES, gate_lower_bound < 0
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.gate_kind = cfg.kda_gate
        self.lower_bound = float(lac["gate_lower_bound"])
        self.num_heads = H = lac["num_heads"]
        self.head_k_dim = K = lac["head_dim"]
        self.head_v_dim = V = lac["head_dim"]  # K3: d_k = d_v = 128
        self.conv_size = W = lac["short_conv_kernel_size"]
        self.scale = K ** -0.5
        self.kernel_recompute = False  # k3lab.memory "selective": the Triton op keeps only its inputs
        D = cfg.hidden_size

        be = cfg.backend  # the projections' GEMV backend (k3lab.linear: Triton for decode-sized calls on CUDA)
        self.q_proj = Linear(D, H * K, bias=False, backend=be)
        self.k_proj = Linear(D, H * K, bias=False, backend=be)
        self.v_proj = Linear(D, H * V, bias=False, backend=be)
        self.q_conv1d = ShortConvolution(H * K, W)
        self.k_conv1d = ShortConvolution(H * K, W)
        self.v_conv1d = ShortConvolution(H * V, W)
        self.f_a_proj = Linear(D, K, bias=False, backend=be)  # W_α↓, rank = head_dim
        self.f_b_proj = Linear(K, H * K, bias=False, backend=be)  # W_α↑
        self.b_proj = Linear(D, H, bias=False, backend=be)  # β logits
        if self.gate_kind == "k3":
            A_log = torch.zeros(H, dtype=torch.float32)  # K3-TR: A_h = 0 at init
        else:
            A_log = torch.empty(H, dtype=torch.float32).uniform_(1, 16).log()  # Kimi Linear: A ~ log U(1, 16)
        self.A_log = nn.Parameter(A_log)
        self.dt_bias = nn.Parameter(inverse_softplus_dt_bias(H * K))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        if lac["use_full_rank_gate"]:
            self.g_proj = Linear(D, H * V, bias=False, backend=be)  # full-rank output gate (K3), not fla's low-rank one
        else:  # Kimi Linear: low-rank output gate of rank K, no biases (transformers' kimi_linear)
            self.g_a_proj = Linear(D, K, bias=False, backend=be)  # W_g↓
            self.g_b_proj = Linear(K, H * V, bias=False, backend=be)  # W_g↑
        self.o_norm = nn.RMSNorm(V, eps=cfg.rms_norm_eps)  # one [V] weight shared by all heads
        self.o_proj = Linear(H * V, D, bias=False, backend=be)
        self.muon_head_splits = {"q_proj": H, "k_proj": H, "v_proj": H}
        self.cp = None  # a k3lab.parallel.context.CPContext: context-parallel forward (halo convs, KCP mix)

    def forward(self, x: Tensor, cache: KDACache | None = None) -> tuple[Tensor, KDACache]:
        if x.dim() != 3 or x.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"x must be [B, T, D] with D={self.cfg.hidden_size}, got {tuple(x.shape)}")
        if isinstance(cache, StaticKDAStepCache):
            return self.forward_steps(x, cache)
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        if cache is not None and use_fused_decode(
                self.cfg.backend, x.device, T, torch.is_grad_enabled(), self.gate_kind, self.lower_bound,
                (x.dtype, cache.recurrent.dtype, cache.conv_q.dtype, cache.conv_k.dtype, cache.conv_v.dtype),
                autocast=torch.is_autocast_enabled(x.device.type), context_parallel=self.cp is not None):
            from k3lab.kernels import kda_decode_fused  # triton: imported on the CUDA path only

            if kda_decode_fused.ENABLED:  # the switch (on by default; False: the separate launches below)
                return self.decode_fused(x, cache, kda_decode_fused.kda_decode_fused)
        past = (None,) * 4 if cache is None else (cache.recurrent, cache.conv_q, cache.conv_k, cache.conv_v)
        if self.cp is None:
            q, conv_q = self.q_conv1d(self.q_proj(x), past[1])  # [B, T, H*K]
            k, conv_k = self.k_conv1d(self.k_proj(x), past[2])
            v, conv_v = self.v_conv1d(self.v_proj(x), past[3])  # [B, T, H*V]
        else:  # context parallel: conv halos from the previous rank (cache must be None)
            (q, conv_q), (k, conv_k), (v, conv_v) = self.cp.short_convs(
                (self.q_conv1d, self.k_conv1d, self.v_conv1d), (self.q_proj(x), self.k_proj(x), self.v_proj(x)), cache)
        q = l2norm(q.view(B, T, H, K))  # [B, T, H, K] float32
        k = l2norm(k.view(B, T, H, K))
        v = v.view(B, T, H, V)
        cdt = q.dtype  # float32 (float64 in float64 runs): gates, β, norm
        beta = torch.sigmoid(self.b_proj(x).to(cdt))  # [B, T, H]
        z = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        g = kda_gate(z, self.A_log, self.dt_bias, self.gate_kind, self.lower_bound)  # [B, T, H, K]
        mix = self.mix if self.cp is None else lambda *a: self.cp.kda_mix(self, *a)  # KCP: affine chain
        in_place = cache is not None and cache.in_place
        extra = {"out_state": past[0]} if in_place else {}  # a static cache: the new state into its own buffer
        o, state = mix(q, k, v, g, beta, past[0], **extra)  # [B, T, H, V], [B, H, K, V]
        y = self.output(x, o)  # [B, T, D]
        if in_place:  # the state was written in place by mix; the tails are [B, D, W-1] copies
            for tail, new_tail in zip(past[1:], (conv_q, conv_k, conv_v)):
                tail.copy_(new_tail)
            return y, cache
        return y, KDACache(state, conv_q, conv_k, conv_v)

    def forward_steps(self, x: Tensor, cache: StaticKDAStepCache) -> tuple[Tensor, StaticKDAStepCache]:
        """``T`` tokens (``T <= T_max``) on a :class:`StaticKDAStepCache`, one recurrent step per token, keeping every
        intermediate state in ``cache.states[i]`` and the conv windows in ``cache.window_*``; ``cache.recurrent`` and
        the tails are left as they were (:meth:`StaticKDAStepCache.keep` picks a token's). The output is
        :meth:`forward`'s (each token is the one-token decode step: the Triton decode kernel on CUDA, the torch
        recurrence on CPU), so it is capturable: fixed shapes, no host reads. x [B, T, D] -> (y [B, T, D], cache)."""
        if self.cp is not None:
            raise ValueError("StaticKDAStepCache: decoding does not run under context parallelism (layer.cp is set)")
        B, T, _ = x.shape
        H, K, V, W1 = self.num_heads, self.head_k_dim, self.head_v_dim, self.conv_size - 1
        if T > cache.states.shape[0]:
            raise ValueError(f"x: {T} tokens, the step cache keeps states for at most {cache.states.shape[0]}")
        qkv = []
        for proj, conv, tail, window in ((self.q_proj, self.q_conv1d, cache.conv_q, cache.window_q),
                                         (self.k_proj, self.k_conv1d, cache.conv_k, cache.window_k),
                                         (self.v_proj, self.v_conv1d, cache.conv_v, cache.window_v)):
            p = proj(x)  # [B, T, H*K]
            y, _ = conv(p, tail)
            window[:, :W1].copy_(tail.transpose(1, 2))  # [B, W-1, H*K] the tail before the step
            window[:, W1:W1 + T].copy_(p)
            qkv.append(y)
        q = l2norm(qkv[0].view(B, T, H, K))  # [B, T, H, K] float32
        k = l2norm(qkv[1].view(B, T, H, K))
        v = qkv[2].view(B, T, H, V)
        cdt = q.dtype
        beta = torch.sigmoid(self.b_proj(x).to(cdt))  # [B, T, H]
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K), self.A_log, self.dt_bias, self.gate_kind,
                     self.lower_bound)  # [B, T, H, K]
        state, outs = cache.recurrent, []
        for i in range(T):  # S_i from S_{i-1}, written into states[i]
            o_i, state = self.mix(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1], beta[:, i:i + 1], state,
                                  out_state=cache.states[i])  # [B, 1, H, V]
            outs.append(o_i)
        return self.output(x, torch.cat(outs, dim=1)), cache  # o [B, T, H, V]

    def output(self, x: Tensor, o: Tensor) -> Tensor:
        """``y = W_o [σ(W_g x) ⊙ RMSNorm_head(õ)]`` [B, T, D] from the recurrence's output õ [B, T, H, V] (float32
        inside: float64 in float64 runs)."""
        B, T, H, V = o.shape
        cdt = torch.promote_types(x.dtype, torch.float32)
        o = F.rms_norm(o.to(cdt), (V,), self.o_norm.weight.to(cdt), self.o_norm.eps)
        o = torch.sigmoid(self.output_gate(x).to(cdt)).view(B, T, H, V) * o
        return self.o_proj(o.reshape(B, T, H * V).to(x.dtype))

    def decode_fused(self, x: Tensor, cache: KDACache, kernel) -> tuple[Tensor, KDACache]:
        """One token ``x [B, 1, D]`` through ``kernel`` (:func:`k3lab.kernels.kda_decode_fused.kda_decode_fused`):
        the projections here, the convs + SiLU, l2 norms, gate, β and the recurrence in the kernel, then
        :meth:`output`. A :class:`StaticKDACache` is updated in place (state and tails) and returned; a plain
        :class:`KDACache` is left as it was and a new one returned."""
        B = x.shape[0]
        tails = (cache.conv_q, cache.conv_k, cache.conv_v)
        if cache.in_place:
            out_state, out_conv, new = None, None, cache
        else:
            out_state = torch.empty(cache.recurrent.shape, dtype=torch.float32, device=x.device)  # [B, H, K, V]
            out_conv = tuple(torch.empty(t.shape, dtype=t.dtype, device=x.device) for t in tails)  # [B, D, W-1]
            new = KDACache(out_state, *out_conv)
            tails = tuple(t.contiguous() for t in tails)
        o = kernel(self.q_proj(x).view(B, -1), self.k_proj(x).view(B, -1), self.v_proj(x).view(B, -1),
                   self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight, *tails,
                   self.f_b_proj(self.f_a_proj(x)).view(B, -1), self.A_log, self.dt_bias, self.b_proj(x).view(B, -1),
                   cache.recurrent if cache.in_place else cache.recurrent.contiguous(), scale=self.scale,
                   lower_bound=self.lower_bound, out_state=out_state, out_conv=out_conv)  # [B, H, V]
        return self.output(x, o.view(B, 1, self.num_heads, self.head_v_dim)), new

    def output_gate(self, x: Tensor) -> Tensor:
        """The output gate's logits ``W_g x`` [B, T, H*V]: K3's full-rank ``g_proj`` or Kimi Linear's
        ``g_b_proj(g_a_proj x)``."""
        return self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))

    @property
    def bounded_gate(self) -> bool:
        """True when every ``g ≥ -5``: the K3 gate with a bound fla's ``safe_gate`` and our kernels accept."""
        return self.gate_kind == "k3" and self.lower_bound >= KDA_GATE_LOWER_BOUND

    def mix(self, q, k, v, g, beta, initial_state, out_state=None):
        """Run the delta-rule recurrence on the chosen backend; returns ``(o [B, T, H, V], state [B, H, K, V])``.

        ``out_state``: a tensor to hold the new state (it may be ``initial_state``: the step runs in place);
        the returned state is then ``out_state``."""
        o, state = self.mix_backend(q, k, v, g, beta, initial_state, out_state)
        if out_state is not None and state is not out_state:
            out_state.copy_(state)
            state = out_state
        return o, state

    def mix_backend(self, q, k, v, g, beta, initial_state, out_state=None):
        """:meth:`mix` on the backend :func:`kda_backend` picks (``out_state`` is written only by our decode kernel)."""
        backend = kda_backend(self.cfg.backend, q.device, self.bounded_gate)
        decode = q.shape[1] == 1
        if self.kernel_recompute and backend != "triton" and torch.is_grad_enabled():
            raise ValueError(f"recompute='selective' recomputes the KDA op in our Triton kernels: it needs "
                             f"backend='triton' (this layer resolves to {backend!r}); use recompute='none' "
                             "or 'sublayer' (k3lab.memory)")
        if backend == "torch":
            mix = kda_recurrent if decode else kda_chunk
            return mix(q, k, v, g, beta, scale=self.scale, initial_state=initial_state, output_final_state=True)
        dtype = v.dtype  # the kernels take q, k, v, β in the activation dtype; g and the state in float32
        q, k, beta, g = q.to(dtype), k.to(dtype), beta.to(dtype), g.float()
        if initial_state is not None:
            initial_state = initial_state.float()
        decode = decode and not torch.is_grad_enabled()  # the one-step kernels have no backward
        if backend == "fla":
            from fla.ops.kda import chunk_kda, fused_recurrent_kda

            if decode:
                return fused_recurrent_kda(q, k, v, g, beta, scale=self.scale, initial_state=initial_state,
                                           output_final_state=True)
            safe = self.bounded_gate
            return chunk_kda(q, k, v, g, beta, scale=self.scale, initial_state=initial_state, output_final_state=True,
                             safe_gate=safe, lower_bound=self.lower_bound if safe else None,
                             use_gate_in_kernel=False)
        if not self.bounded_gate:
            raise ValueError(f"backend='triton' needs K3's bounded gate (kda_gate='k3', gate_lower_bound >= -5), got "
                             f"kda_gate={self.gate_kind!r}, gate_lower_bound={self.lower_bound}; use backend='fla' or 'torch'")
        try:
            from k3lab.kernels import triton_kda_chunk
            from k3lab.kernels import kda_decode_step
        except ImportError as err:
            raise RuntimeError("backend='triton': k3lab.kernels (triton_kda_chunk, kda_decode_step) cannot be imported "
                               f"({err}); use backend='torch' or 'fla'") from err
        if decode:
            in_place = out_state is not None and out_state.dtype == torch.float32 and out_state.is_contiguous()
            return kda_decode_step(q, k, v, g, beta, initial_state, scale=self.scale,
                                   out_state=out_state if in_place else None)
        return triton_kda_chunk(q, k, v, g, beta, scale=self.scale, initial_state=initial_state, output_final_state=True,
                                recompute=self.kernel_recompute)
