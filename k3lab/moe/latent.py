"""Stable LatentMoE (docs/k3_reference.md §5) and the standard MoE it is compared with.

For each token x [D] (N = B·T tokens, E experts, top-k, latent width L, expert width I)::

    s, T, p = router(x)                         sigmoid on the full width, top-k on s + b, p from raw s
    z = W↓ x                                    routed_expert_down_proj [L, D], shared by all experts
    u = Σ_{j∈T} p_j · E_j(z)                     E_j: SiTU-GLU expert L → I → L (bf16 output × fp32 weight)
    y = shared_experts(x) + W↑ RMSNorm(u)       routed_expert_norm [L], routed_expert_up_proj [D, L]

``cfg.mlp_kind == "moe"`` is the standard MoE at the same code path: experts at the full width
(L = D) and no W↓, RMSNorm or W↑. Latent experts halve the bytes each dispatched token slot carries
(L = D/2), so at equal dispatch bytes a LatentMoE can route 2× the top-k over 2× the experts.

Three separable pieces, so that expert parallelism replaces only the middle one:

1. routing: :class:`~k3lab.moe.router.SigmoidRouter` → RouterOutput (scores, top-k, weights, cutoff);
2. dispatch/combine: :class:`LocalDispatcher` sorts the N·k token slots by expert into contiguous groups
   and puts them back; LatentMoE makes one call, ``u = dispatcher.run(z, topk_idx, topk_weight, experts)``,
   which the expert-parallel dispatchers of :mod:`k3lab.parallel.expert` (plain EP, MoonEP) replace:
   all-to-all to the ranks that compute, experts there, all-to-all back. Decoding (N·k ≤ 128 slots, CUDA,
   backend triton, no gradient: :func:`use_decode_kernel`) can skip the sort: the fused kernel of
   :mod:`k3lab.kernels.moe_decode` reads each slot's expert weights directly (its ``ENABLED``, on by
   default; False: the sorted path below);
3. expert compute: :class:`RoutedExperts` on the sorted slots: a reference loop over experts, a
   grouped-GEMM path (``torch.nn.functional.grouped_mm``, CUDA + bf16) and a padded batched-matmul path
   (few large ops instead of many small ones: the fast choice on CPU), all three equal.

Checkpoint names: experts are stacked ``experts.w1 [E, I, L]`` (gate), ``experts.w3 [E, I, L]`` (up),
``experts.w2 [E, L, I]`` (down); :func:`split_expert_weights` / :func:`merge_expert_weights` convert to
and from the HF per-expert names ``experts.{e}.w1.weight``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3lab.backend import resolve_backend
from k3lab.config import BACKENDS, HIDDEN_ACTS
from k3lab.linear import Linear
from k3lab.moe.router import SigmoidRouter, expert_load, make_balancer
from k3lab.moe.situ import SiTUMLP, glu_activation, glu_down

EXPERT_IMPLS = ("auto", "reference", "padded", "grouped")
ExpertWeights = tuple[Tensor, Tensor, Tensor]  # (w1 [G, I, L], w3 [G, I, L], w2 [G, L, I])


# ----------------------------------------------------------------------------------------------
# dispatch / combine
# ----------------------------------------------------------------------------------------------
@dataclass
class DispatchPlan:
    """Where each token slot went. N tokens, k slots each, E experts."""

    order: Tensor    # [N·k] int64 slot ids (slot = token·k + j) sorted by expert, stable
    counts: Tensor   # [E] int64 slots per expert (group sizes of the sorted slots)
    num_tokens: int  # N
    top_k: int       # k
    data: object = None  # dispatcher-specific (expert parallel: split sizes, the balancing plan)
    inverse: Tensor | None = None  # [N·k] int64 the inverse of ``order`` (made where a fused path reads it)


class DispatchRows(torch.autograd.Function):
    r"""``x_sorted = x[order // k]``: each of the N tokens copied to its k slots, in expert order.

    The backward sums each token's k slot gradients, ``x̄_n = Σ_j ȳ[inv(n·k + j)]`` (``inv`` the inverse
    permutation of ``order``, from :meth:`LocalDispatcher.dispatch`), in float32: a gather into slot order
    and a sum over k (torch), or the fused gather-sum of :func:`k3lab.kernels.moe_rows.gather_sum`
    (``fused``: backend triton) — what ``index_select``'s own backward computes with ``index_add`` (atomic
    adds, k to each row, rounded to the gradient's dtype one add at a time in bf16). Same sum, one rounding;
    no atomics.
    """

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor, k: int, fused: bool = False) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.k, ctx.fused = k, fused
        return x.index_select(0, order // k)  # [N·k, L]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        if ctx.k == 1:  # a permutation: its backward is the gather through the inverse (nothing to sum)
            return grad.index_select(0, inverse), None, None, None, None
        if ctx.fused:
            from k3lab.kernels.moe_rows import gather_sum

            return gather_sum(grad.contiguous(), inverse, ctx.k), None, None, None, None
        by_slot = grad.index_select(0, inverse).view(-1, ctx.k, grad.shape[-1])  # [N, k, L] slot order
        acc = torch.promote_types(grad.dtype, torch.float32)
        return by_slot.sum(1, dtype=acc).to(grad.dtype), None, None, None, None


def inverse_permutation(order: Tensor) -> Tensor:
    """``inv`` with ``inv[order[i]] = i`` ([S] int64; ``order`` a permutation of 0..S-1)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class LocalDispatcher:
    """Single-device dispatch/combine: a stable sort of the N·k slots by expert, and its inverse.

    Every dispatcher has :meth:`run`, LatentMoE's only call. Expert-parallel dispatchers
    (:mod:`k3lab.parallel.expert`) replace ``run`` as a whole and also record
    ``last_slots_per_rank`` ([R] int64: token slots each rank of the EP group computed in the last
    forward); this one records nothing.

    backend (``cfg.backend``): on "triton" (``auto`` on CUDA) the dispatch's backward and the combine run
    as the fused row kernels of :mod:`k3lab.kernels.moe_rows` (gather straight from the sorted rows, no
    slot-order copy); elsewhere as torch ops. Both equal within float32 rounding.
    """

    def __init__(self, backend: str = "torch"):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: allowed values are {BACKENDS}")
        self.backend = backend

    def fused(self, x: Tensor) -> bool:
        """Whether the fused row kernels run for tensors on ``x``'s device."""
        return resolve_backend(self.backend, x.device) == "triton"

    def run(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, experts: "RoutedExperts") -> Tensor:
        """z [N, L], topk_idx [N, k], topk_weight [N, k] -> u [N, L] fp32 = Σ_j p_j·E_{T_j}(z):
        dispatch, ``experts(z_sorted, counts)``, combine."""
        z_sorted, plan = self.dispatch(z, topk_idx, experts.num_experts)
        y_sorted = experts(z_sorted, plan.counts)                                   # [N·k, L]
        return self.combine(y_sorted, plan, topk_weight)                           # [N, L] fp32

    def dispatch(self, x: Tensor, topk_idx: Tensor, num_experts: int) -> tuple[Tensor, DispatchPlan]:
        """x [N, L], topk_idx [N, k] -> (x_sorted [N·k, L] grouped by expert, plan)."""
        N, k = topk_idx.shape
        flat = topk_idx.reshape(-1)                                   # [N·k]
        order = flat.argsort(stable=True)                             # [N·k]
        counts = expert_load(flat, num_experts)                       # [E], no host sync
        plan = DispatchPlan(order, counts, N, k)
        # CUDA: index_select's backward is index_add with atomics (bf16: k rounded adds a row, in no fixed
        # order); DispatchRows sums the k slots in float32 instead. CPU: index_add adds in order, no atomics
        fused = self.fused(x)  # backend triton: CUDA (a ValueError names the backend elsewhere)
        if x.is_cuda:
            plan.inverse = inverse_permutation(order)
            return DispatchRows.apply(x, order, plan.inverse, k, fused), plan
        return x.index_select(0, order // k), plan

    def combine(self, y_sorted: Tensor, plan: DispatchPlan, topk_weight: Tensor) -> Tensor:
        """y_sorted [N·k, L] (expert outputs), topk_weight [N, k] fp32 -> u [N, L] fp32 = Σ_j p_j·y_j."""
        if self.fused(y_sorted):
            from k3lab.kernels.moe_rows import combine_rows

            inverse = inverse_permutation(plan.order) if plan.inverse is None else plan.inverse
            return combine_rows(y_sorted.contiguous(), inverse, topk_weight.float())  # [N, L] fp32
        y = torch.zeros_like(y_sorted).index_copy(0, plan.order, y_sorted)         # [N·k, L] slot order
        y = y.view(plan.num_tokens, plan.top_k, -1)                                 # [N, k, L]
        return (y * topk_weight[..., None].float()).sum(1)                          # bf16 × fp32 -> fp32


# ----------------------------------------------------------------------------------------------
# expert compute
# ----------------------------------------------------------------------------------------------
def grouped_mm_available(x: Tensor) -> bool:
    """True where the grouped-GEMM path runs forward and backward: CUDA, bf16, torch with grouped_mm."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


class RoutedExperts(nn.Module):
    """E gated experts stacked along dim 0: ``w1, w3 [E, I, L]``, ``w2 [E, L, I]`` (no biases).

    forward(x_sorted [S, L], counts [G], weights=None) -> [S, L]: rows ``[offs_{g-1}, offs_g)`` go
    through expert g, ``E_g(z) = w2_g · act(w1_g z, w3_g z)``; G = E with the module's own weights, or
    the length of ``weights = (w1 [G, I, L], w3 [G, I, L], w2 [G, L, I])`` when given (expert parallel:
    the local slice with fetched replicas appended). ``impl``: "reference" (loop), "grouped"
    (``F.grouped_mm``; its backward needs CUDA), "padded" (``bmm`` on ``[G, max count, L]``), "auto" =
    grouped on CUDA with bf16 input, padded otherwise.

    ``num_experts`` is the global E; under expert parallelism the module holds experts
    ``[expert_offset, expert_offset + num_local_experts)`` only (``k3lab.parallel.expert``); by default
    all of them (offset 0, E local).

    ``static_capacity`` (default False): the padded path's capacity is always S, never read back from the counts.
    :class:`k3lab.cuda_graph.GraphedForwardBackward` sets it, so that the eager warmup steps trace, under
    ``torch.compile``, the same code the capture records (a capacity chosen by whether the stream is capturing made
    dynamo recompile in the middle of the capture, which CUDA refuses).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "situ", beta: float = 4.0,
                 linear_beta: float = 25.0, init_std: float = 0.02, impl: str = "auto"):
        super().__init__()
        if act not in HIDDEN_ACTS:
            raise ValueError(f"act={act!r}: allowed values are {HIDDEN_ACTS}")
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"impl={impl!r}: allowed values are {EXPERT_IMPLS}")
        self.act, self.beta, self.linear_beta, self.impl = act, beta, linear_beta, impl
        E, L, I = num_experts, hidden, intermediate
        self.w1 = nn.Parameter(torch.randn(E, I, L) * init_std)
        self.w3 = nn.Parameter(torch.randn(E, I, L) * init_std)
        self.w2 = nn.Parameter(torch.randn(E, L, I) * init_std)
        self.num_experts, self.expert_offset, self.num_local_experts = E, 0, E
        self.static_capacity = False

    def forward(self, x: Tensor, counts: Tensor, weights: ExpertWeights | None = None) -> Tensor:
        if x.is_cuda and torch.is_autocast_enabled("cuda"):
            x = x.to(torch.get_autocast_dtype("cuda"))  # fp32 residual input (standard MoE) -> the grouped path
        impl = self.impl
        if impl == "auto":
            impl = "grouped" if grouped_mm_available(x) else "padded"
        return getattr(self, f"forward_{impl}")(x, counts, weights)

    def matmul_dtype(self, x: Tensor) -> torch.dtype:
        """The dtype the expert matmuls read the weights in, for rows ``x``: autocast's where it is on for ``x``'s
        device (every path casts the weights to it), else ``x``'s own (the grouped path casts the weights to it, the
        others need them equal). A caller that moves the weights (the expert-parallel replicas) can cast them to it
        first and change no value the experts compute, nor any gradient (a cast's backward casts back)."""
        kind = x.device.type
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype

    def _weights(self, weights: ExpertWeights | None) -> ExpertWeights:
        """(w1, w3, w2): the given ones, or the module's own."""
        return (self.w1, self.w3, self.w2) if weights is None else weights

    def _act(self, gate: Tensor, up: Tensor) -> Tensor:
        return glu_activation(gate, up, self.act, self.beta, self.linear_beta)

    def forward_reference(self, x: Tensor, counts: Tensor, weights: ExpertWeights | None = None) -> Tensor:
        """Plain loop over experts (one host sync for the group sizes)."""
        w1, w3, w2 = self._weights(weights)
        outs = []
        for e, xe in enumerate(x.split(counts.tolist())):                           # xe [S_e, L]
            h = self._act(xe @ w1[e].T, xe @ w3[e].T)                               # [S_e, I]
            outs.append(h @ w2[e].T)                                                # [S_e, L]
        return torch.cat(outs)

    def forward_padded(self, x: Tensor, counts: Tensor, weights: ExpertWeights | None = None) -> Tensor:
        """Scatter the groups into ``[E, C, L]`` (C = largest group, zero padding), three ``bmm``, gather back.

        With ``static_capacity``, or while a CUDA graph is being captured, C is ``S`` (the bound no group
        exceeds), so that no value is read back to the host; the padding rows are zeros and every row's result is
        the same."""
        w1, w3, w2 = self._weights(weights)
        E, S = counts.numel(), x.shape[0]
        static = self.static_capacity or (x.is_cuda and torch.cuda.is_current_stream_capturing())
        capacity = S if static else int(counts.max())
        starts = counts.cumsum(0) - counts                                          # [E]
        expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=S)  # [S]
        slot = torch.arange(S, device=x.device) - starts[expert]                    # [S] position in its group
        x_pad = x.new_zeros(E, capacity, x.shape[1]).index_put((expert, slot), x)  # [E, C, L]
        h = self._act(torch.bmm(x_pad, w1.mT), torch.bmm(x_pad, w3.mT))            # [E, C, I]
        return torch.bmm(h, w2.mT)[expert, slot]                                    # [S, L]

    def forward_grouped(self, x: Tensor, counts: Tensor, weights: ExpertWeights | None = None) -> Tensor:
        """One ``F.grouped_mm`` per projection over the jagged groups (offsets = cumulative counts); the
        activation and the down projection as one :func:`~k3lab.moe.situ.glu_down` node (h not kept)."""
        offs = counts.cumsum(0).to(torch.int32)                                     # [E] group ends
        w1, w3, w2 = self._weights(weights)
        gate = F.grouped_mm(x, w1.to(x.dtype).transpose(-2, -1), offs=offs)        # [S, I]
        up = F.grouped_mm(x, w3.to(x.dtype).transpose(-2, -1), offs=offs)          # [S, I]
        return glu_down(gate, up, w2, offs, self.act, self.beta, self.linear_beta)  # [S, L]; h recomputed in backward


# ----------------------------------------------------------------------------------------------
# LatentMoE
# ----------------------------------------------------------------------------------------------
DECODE_MAX_SLOTS = 128  # N·k at most for the fused decode kernel (k3lab.kernels.moe_decode.MAX_SLOTS refuses more)
DECODE_DTYPES = (torch.bfloat16, torch.float32)  # compute and weight dtypes the decode kernel reads


def use_decode_kernel(dispatcher, device: torch.device | str, num_slots: int, needs_grad: bool,
                      dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether LatentMoE's routed experts run as the fused small-batch kernel
    (:func:`k3lab.kernels.moe_decode.routed_experts_decode`: each slot reads its expert's weights, no sort) instead
    of ``dispatcher.run``. All must hold: ``dispatcher`` is the plain :class:`LocalDispatcher` (the expert-parallel
    ones keep their own run), ``device`` is CUDA and the dispatcher's backend resolves to "triton" there, no
    gradient is needed, ``num_slots`` (N·k) ≤ :data:`DECODE_MAX_SLOTS`, and every one of ``dtypes`` (the compute
    dtype and the experts' weights') is in :data:`DECODE_DTYPES`."""
    device = torch.device(device)
    return (type(dispatcher) is LocalDispatcher and device.type == "cuda" and not needs_grad
            and resolve_backend(dispatcher.backend, device) == "triton" and num_slots <= DECODE_MAX_SLOTS
            and all(dt in DECODE_DTYPES for dt in dtypes))


class LatentMoE(nn.Module):
    """K3's Stable LatentMoE (``cfg.mlp_kind == "latent_moe"``) or a standard MoE (``"moe"``).

    forward(x [B, T, D]) -> y [B, T, D]. Sets ``self.aux_loss`` (scalar or None) every forward;
    the balancer (``cfg.balancer``) observes routing in training mode and moves the router bias in
    ``after_optimizer_step()``.
    """

    def __init__(self, cfg, expert_impl: str = "auto"):
        super().__init__()
        if cfg.mlp_kind not in ("latent_moe", "moe"):
            raise ValueError(f"mlp_kind={cfg.mlp_kind!r}: LatentMoE builds 'latent_moe' or 'moe'")
        D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.latent = cfg.mlp_kind == "latent_moe"
        L = cfg.routed_expert_hidden_size if self.latent else D
        self.num_experts, self.top_k, self.eps = E, cfg.num_experts_per_tok, cfg.rms_norm_eps
        act = dict(beta=cfg.activation_situ_beta, linear_beta=cfg.activation_situ_linear_beta, act=cfg.hidden_act)

        self.gate = SigmoidRouter(D, E, self.top_k, cfg.routed_scaling_factor, cfg.moe_renormalize,
                                  init_std=cfg.initializer_range, backend=cfg.backend)
        if self.latent:
            self.routed_expert_down_proj = Linear(D, L, bias=False, backend=cfg.backend)  # W↓ [L, D]
            self.routed_expert_norm = nn.RMSNorm(L, eps=cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
            self.routed_expert_up_proj = Linear(L, D, bias=False, backend=cfg.backend)    # W↑ [D, L]
        self.experts = RoutedExperts(E, L, I, init_std=cfg.initializer_range, impl=expert_impl, **act)
        self.shared_experts = (SiTUMLP(D, cfg.n_shared_experts * I, **act, backend=cfg.backend)
                               if cfg.n_shared_experts > 0 else None)
        self.dispatcher = LocalDispatcher(cfg.backend)
        # CUDA: the shared expert runs on this stream, beside the routed path (an expert-parallel run sets it with
        # ParallelOptions.shared_overlap=True: k3lab.parallel.parallelize); None: in line, on the caller's stream
        self.shared_stream: torch.cuda.Stream | None = None
        # how the side stream calls the shared expert: ``side(shared_experts, h)``; None: the module as it is.
        # k3lab.compile.compile_sublayers sets a compiled call, since the fork runs outside the MoE's own graph
        self.shared_side: Callable[[nn.Module, Tensor], Tensor] | None = None
        self.balancer = make_balancer(cfg.balancer, self.gate, num_bins=cfg.qb_num_bins,
                                      aux_loss_coef=cfg.aux_loss_coef)
        self.aux_loss: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        h = x.reshape(B * T, D)                                                     # [N, D]
        beside = self.shared_experts is not None and self.shared_stream is not None and h.is_cuda
        shared = self._shared_fork(h) if beside else None                           # [N, D], on shared_stream
        route = self.gate(h)
        self.aux_loss = self.balancer.observe(route) if self.training else None
        z = self.routed_expert_down_proj(h) if self.latent else h                   # [N, L]
        u = self.routed(z, route.topk_idx, route.topk_weight)                       # [N, L] fp32
        if self.latent:
            if self.routed_expert_norm is not None:
                u = F.rms_norm(u, (u.shape[-1],), self.routed_expert_norm.weight.float(), self.eps)
            u = self.routed_expert_up_proj(u.to(x.dtype))                          # [N, D]
        y = u.to(x.dtype)
        if self.shared_experts is not None:
            y = y + (self._shared_join(shared) if beside else self.shared_experts(h))
        return y.view(B, T, D)

    @torch.compiler.disable  # stream switches run eager (dynamo would trace the expert onto one stream)
    def _shared_fork(self, h: Tensor) -> Tensor:
        """The shared expert of ``h [N, D]`` on :attr:`shared_stream`, launched before the routed path, so that its
        kernels run beside the dispatcher's (an expert-parallel dispatcher's all-to-alls block the caller's stream).
        Autograd runs a node's backward on its forward's stream, so the backward overlaps too. The same math as in
        line (eager, the same kernels). The fork is outside ``torch.compile`` (it switches streams), so a compiled
        model runs the expert through :attr:`shared_side`, its own compiled call; without it the expert ran eager,
        its activation unfused (measured slower than in line on one H100: ``docs/scaling.md``, sections 4g and 4h),
        so the side stream is off unless asked for."""
        side, caller = self.shared_stream, torch.cuda.current_stream(h.device)
        side.wait_stream(caller)                   # h (and the gathered weights) are ready
        with torch.cuda.stream(side):
            s = (self.shared_experts(h) if self.shared_side is None
                 else self.shared_side(self.shared_experts, h))                     # [N, D]
        h.record_stream(side)                      # h's memory is not reused before the side stream has read it
        return s

    @torch.compiler.disable
    def _shared_join(self, s: Tensor) -> Tensor:
        """``s`` from :meth:`_shared_fork`, once the caller's stream has waited for it."""
        caller = torch.cuda.current_stream(s.device)
        caller.wait_stream(self.shared_stream)
        s.record_stream(caller)
        return s

    def routed(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor) -> Tensor:
        """z [N, L], topk_idx [N, k], topk_weight [N, k] -> u [N, L] fp32 = Σ_j p_j·E_{T_j}(z): the fused decode
        kernel where :func:`use_decode_kernel` allows it and ``k3lab.kernels.moe_decode.ENABLED`` is on (z cast to the
        autocast dtype first, as :meth:`RoutedExperts.forward` casts), else ``self.dispatcher.run``."""
        e = self.experts
        dtype = torch.get_autocast_dtype("cuda") if z.is_cuda and torch.is_autocast_enabled("cuda") else z.dtype
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (z, topk_weight, e.w1, e.w3, e.w2))
        dtypes = (dtype, e.w1.dtype, e.w3.dtype, e.w2.dtype)
        if use_decode_kernel(self.dispatcher, z.device, topk_idx.numel(), needs_grad, dtypes):
            from k3lab.kernels import moe_decode  # triton: imported on the CUDA path only

            if moe_decode.ENABLED:  # the switch (on by default; False: the sorted path)
                return moe_decode.routed_experts_decode(z.to(dtype), topk_idx, topk_weight.float(), e.w1, e.w3, e.w2,
                                                        e.act, e.beta, e.linear_beta)
        return self.dispatcher.run(z, topk_idx, topk_weight, e)

    def after_optimizer_step(self) -> None:
        """Move the router bias from this step's statistics (used from the next step on)."""
        self.balancer.update()

    def hf_expert_state_dict(self) -> dict[str, Tensor]:
        """This module's state dict with the experts under HF per-expert names ``experts.{e}.w1.weight``."""
        return split_expert_weights(self.state_dict())

    def load_hf_expert_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True):
        """Load a state dict with HF per-expert names (inverse of :meth:`hf_expert_state_dict`)."""
        return self.load_state_dict(merge_expert_weights(state_dict), strict=strict)


# ----------------------------------------------------------------------------------------------
# checkpoint names
# ----------------------------------------------------------------------------------------------
_STACKED_KEY = re.compile(r"^(.*?)(experts)\.(w[123])$")
_PER_EXPERT_KEY = re.compile(r"^(.*?)(experts)\.(\d+)\.(w[123])\.weight$")


def split_expert_weights(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """``...experts.w1 [E, I, L]`` -> ``...experts.{e}.w1.weight [I, L]`` for e < E; other keys unchanged."""
    out = {}
    for key, value in state_dict.items():
        m = _STACKED_KEY.match(key)
        if m is None:
            out[key] = value
            continue
        prefix, experts, w = m.groups()
        for e in range(value.shape[0]):
            out[f"{prefix}{experts}.{e}.{w}.weight"] = value[e]
    return out


def merge_expert_weights(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of :func:`split_expert_weights`: stack ``...experts.{e}.wN.weight`` into ``...experts.wN``."""
    out, groups = {}, {}
    for key, value in state_dict.items():
        m = _PER_EXPERT_KEY.match(key)
        if m is None:
            out[key] = value
            continue
        prefix, experts, e, w = m.groups()
        groups.setdefault(f"{prefix}{experts}.{w}", {})[int(e)] = value
    for key, by_expert in groups.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"merge_expert_weights: {key} has experts {sorted(by_expert)}, expected 0..{len(by_expert) - 1}")
        out[key] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out
