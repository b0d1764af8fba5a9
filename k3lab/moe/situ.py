"""SiTU-GLU, the bounded gated activation of K3 (docs/k3_reference.md §6), and SwiGLU for comparison.

    SiTU-GLU(g, u) = [β1·tanh(g/β1)·σ(g)] ⊙ [β2·tanh(u/β2)],      β1 = 4, β2 = 25
    SwiGLU(g, u)   = [g·σ(g)] ⊙ u

``β·tanh(z/β) = z + O(z³/β²)``, so SiTU matches SwiGLU to first order at 0 and recovers it as
β → ∞; every factor is bounded, ``|β1 tanh(g/β1) σ(g)| < β1`` and ``|β2 tanh(u/β2)| < β2``, so
``‖SiTU-GLU‖_∞ ≤ β1·β2 = 100``. The non-linearities run in fp32 (float64 for float64 inputs) and
the result is cast back to the input dtype (as the reference ``situ_and_mul``).

Memory: :func:`situ_glu` / :func:`swiglu` are custom autograd functions that save only ``gate`` and
``up`` in their input dtype (bf16 under autocast: 4 bytes per element of the pair) and recompute the
fp32 intermediates in backward; the plain formulas, :func:`situ_glu_reference` /
:func:`swiglu_reference`, let autograd keep ~6 (SiTU) / 3 (SwiGLU) fp32 tensors of gate's shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from k3lab.config import HIDDEN_ACTS
from k3lab.linear import Linear


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float64 for float64 inputs (gradcheck), float32 otherwise (bf16/fp16/fp32)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def situ_glu_reference(gate: Tensor, up: Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    """The plain formula, differentiated by autograd (which saves the fp32 intermediates: tanh, σ and
    the products, ~6 fp32 tensors of gate's shape). gate, up: [..., I] -> [..., I] in gate's dtype."""
    cd = _compute_dtype(gate)
    g, u = gate.to(cd), up.to(cd)
    out = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) ⊙ up in fp32, cast back, differentiated by autograd (saves 3 fp32 tensors)."""
    cd = _compute_dtype(gate)
    return (F.silu(gate.to(cd)) * up.to(cd)).to(gate.dtype)


CUDA_CHUNK_ELEMENTS = 2 ** 25  # elements per piece of the fp32 recompute on CUDA (128 MiB fp32 buffers)
PIECEWISE_DEVICES = ("cuda",)  # device types that run in pieces (tests add "cpu")


def _piecewise(fn, tensors: tuple[Tensor, ...], out_dtypes: tuple[torch.dtype | None, ...]) -> tuple:
    """``fn(*tensors)`` (elementwise, returns len(out_dtypes) tensors or None), on CUDA in flat pieces of
    ``CUDA_CHUNK_ELEMENTS`` written into preallocated outputs, so the fp32 temporaries of the
    recompute stay ~128 MiB each instead of the full [S, I]. On CUDA an elementwise kernel computes
    every element the same way wherever it lies, so the pieces are bit-equal to one call; on CPU
    (vectorised body vs scalar tail per thread range) one call is kept, for bit equality with the
    autograd reference. Broadcast shapes: one call. (Under ``torch.compile`` the activations do not come here:
    they are plain ops, :func:`_act_traced`.)"""
    first = tensors[0]
    n = first.numel()
    if first.device.type not in PIECEWISE_DEVICES or n <= CUDA_CHUNK_ELEMENTS or any(t.shape != first.shape for t in tensors):
        return fn(*tensors)
    flat = [t.reshape(-1) for t in tensors]
    outs = [None if dt is None else torch.empty(n, dtype=dt, device=first.device) for dt in out_dtypes]
    for s in range(0, n, CUDA_CHUNK_ELEMENTS):
        pieces = fn(*(t[s:s + CUDA_CHUNK_ELEMENTS] for t in flat))
        for o, piece in zip(outs, pieces):
            if o is not None:
                o[s:s + CUDA_CHUNK_ELEMENTS] = piece
    return tuple(None if o is None else o.view(first.shape) for o in outs)


def _situ_forward(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> tuple[Tensor]:
    cd = _compute_dtype(gate)
    g, u = gate.to(cd), up.to(cd)                                                   # [..., I] fp32
    out = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (linear_beta * torch.tanh(u / linear_beta))
    return (out.to(gate.dtype),)


def _situ_backward(gate: Tensor, up: Tensor, grad_out: Tensor, beta: float, linear_beta: float,
                   need_gate: bool, need_up: bool) -> tuple[Tensor | None, Tensor | None]:
    cd = _compute_dtype(gate)
    g, u, go = gate.to(cd), up.to(cd), grad_out.to(cd)                              # [..., I] fp32
    t1, s = torch.tanh(g / beta), torch.sigmoid(g)
    a1 = beta * t1                                                                  # β1·t1
    t2 = torch.tanh(u / linear_beta)
    dgate = dup = None
    if need_gate:
        ga = go * (linear_beta * t2)                                                # dout·b
        dg = torch.ops.aten.tanh_backward(ga * s * beta, t1) / beta                 # via β1·t1: ·s·(1 − t1²)
        dg = dg + torch.ops.aten.sigmoid_backward(ga * a1, s)                       # via σ: ·β1·t1·s(1 − s)
        dgate = dg.to(gate.dtype)
    if need_up:
        gb = go * (a1 * s)                                                          # dout·a
        dup = (torch.ops.aten.tanh_backward(gb * linear_beta, t2) / linear_beta).to(up.dtype)
    return dgate, dup


class SiTUGLUFunction(torch.autograd.Function):
    """SiTU-GLU saving only ``gate`` and ``up`` (in their own dtype, bf16 under autocast); the fp32
    intermediates are recomputed in backward. With t1 = tanh(g/β1), s = σ(g), t2 = tanh(u/β2)::

        a = β1·t1·s,   b = β2·t2,   out = a·b  (fp32, cast to gate's dtype)
        ∂a/∂g = (1 − t1²)·s + β1·t1·s·(1 − s),    ∂b/∂u = 1 − t2²
        dgate = dout·b·∂a/∂g,    dup = dout·a·∂b/∂u

    Backward evaluates these with the ops autograd uses on :func:`situ_glu_reference`
    (``tanh_backward``, ``sigmoid_backward``, in the same order), so fp32 gradients equal the
    reference's bit for bit. On CUDA both passes run in pieces (:func:`_piecewise`).
    """

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
        ctx.save_for_backward(gate, up)
        ctx.beta, ctx.linear_beta = beta, linear_beta
        return _piecewise(lambda g, u: _situ_forward(g, u, beta, linear_beta), (gate, up), (gate.dtype,))[0]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gate, up = ctx.saved_tensors
        need_g, need_u = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fn = lambda g, u, go: _situ_backward(g, u, go, ctx.beta, ctx.linear_beta, need_g, need_u)  # noqa: E731
        dgate, dup = _piecewise(fn, (gate, up, grad_out), (gate.dtype if need_g else None, up.dtype if need_u else None))
        return dgate, dup, None, None


def _swiglu_forward(gate: Tensor, up: Tensor) -> tuple[Tensor]:
    cd = _compute_dtype(gate)
    return ((F.silu(gate.to(cd)) * up.to(cd)).to(gate.dtype),)


def _swiglu_backward(gate: Tensor, up: Tensor, grad_out: Tensor, need_gate: bool, need_up: bool):
    cd = _compute_dtype(gate)
    g, u, go = gate.to(cd), up.to(cd), grad_out.to(cd)                              # [..., I] fp32
    dgate = torch.ops.aten.silu_backward(go * u, g).to(gate.dtype) if need_gate else None
    dup = (go * F.silu(g)).to(up.dtype) if need_up else None
    return dgate, dup


class SwiGLUFunction(torch.autograd.Function):
    """SwiGLU saving only ``gate`` and ``up`` (their own dtype); fp32 recomputed in backward::

        out = silu(g)·u,   dgate = dout·u·σ(g)·(1 + g·(1 − σ(g))),   dup = dout·silu(g)

    (``silu_backward``, as autograd on :func:`swiglu_reference`: fp32 gradients equal bit for bit).
    """

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return _piecewise(_swiglu_forward, (gate, up), (gate.dtype,))[0]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gate, up = ctx.saved_tensors
        need_g, need_u = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fn = lambda g, u, go: _swiglu_backward(g, u, go, need_g, need_u)  # noqa: E731
        return _piecewise(fn, (gate, up, grad_out), (gate.dtype if need_g else None, up.dtype if need_u else None))


_ACT_PASSES = {  # act -> (forward(gate, up, *betas) -> (h,), backward(gate, up, dh, *betas, need_g, need_u))
    "situ": (_situ_forward, _situ_backward),
    "swiglu": (lambda g, u: _swiglu_forward(g, u), lambda g, u, go, ng, nu: _swiglu_backward(g, u, go, ng, nu)),
}


def _down(h: Tensor, w: Tensor, offs: Tensor | None) -> Tensor:
    """``h @ wᵀ``: dense ``w [D, I]`` (``F.linear``), or per group ``w [G, L, I]`` with ``offs`` (``F.grouped_mm``)."""
    return F.linear(h, w) if offs is None else F.grouped_mm(h, w.transpose(-2, -1), offs=offs)


class GLUDownFunction(torch.autograd.Function):
    r"""``out = act(gate, up) @ Wᵀ`` — the gated activation and the down projection as one autograd node
    that saves ``gate``, ``up`` and ``W`` (the parameter itself, not a bf16 copy) but not ``h = act(gate, up)``:
    backward recomputes ``h`` (elementwise) for the weight gradient. Per token and unit of width that is
    2 bytes of bf16 less than :func:`situ_glu` followed by a Linear (whose autograd keeps its input ``h``)::

        h = act(gate, up)        out = h Wᵀ                       (dense W [D, I]; or per expert group g:
        h̄ = out̄ W                W̄ = out̄ᵀ h                        out_g = h_g W_gᵀ, W̄_g = out̄_gᵀ h_g, offs = group ends)
        gāte, ūp = act's backward at (gate, up) with h̄          (:class:`SiTUGLUFunction`'s formulas)

    The matmuls run in ``h``'s dtype (bf16 under autocast, with W cast to it, as autocast does for a
    Linear); W's gradient is returned in W's dtype. Equal to the unfused path within 1e-6 in float32 (tests).
    """

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, weight: Tensor, offs: Tensor | None, act: str,
                betas: tuple[float, ...]) -> Tensor:
        fwd, _ = _ACT_PASSES[act]
        h = _piecewise(lambda g, u: fwd(g, u, *betas), (gate, up), (gate.dtype,))[0]  # [..., I]
        ctx.save_for_backward(gate, up, weight, offs)
        ctx.act, ctx.betas = act, betas
        return _down(h, weight.to(h.dtype), offs)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gate, up, weight, offs = ctx.saved_tensors
        fwd, bwd = _ACT_PASSES[ctx.act]
        h = _piecewise(lambda g, u: fwd(g, u, *ctx.betas), (gate, up), (gate.dtype,))[0]  # recomputed [..., I]
        w, go = weight.to(h.dtype), grad_out.to(h.dtype)
        if offs is None:
            dh = go @ w                                                                 # [..., I]
            dw = go.reshape(-1, go.shape[-1]).T @ h.reshape(-1, h.shape[-1]) if ctx.needs_input_grad[2] else None
        else:
            dh = F.grouped_mm(go, w, offs=offs)                                         # [S, I]
            dw = F.grouped_mm(go.T, h, offs=offs) if ctx.needs_input_grad[2] else None   # [G, L, I]
        need_g, need_u = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fn = lambda g, u, d: bwd(g, u, d, *ctx.betas, need_g, need_u)  # noqa: E731
        dgate, dup = _piecewise(fn, (gate, up, dh), (gate.dtype if need_g else None, up.dtype if need_u else None))
        return dgate, dup, None if dw is None else dw.to(weight.dtype), None, None, None


def glu_down(gate: Tensor, up: Tensor, weight: Tensor, offs: Tensor | None = None, act: str = "situ",
             beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    """``act(gate, up) @ weightᵀ`` without keeping the activation for backward (:class:`GLUDownFunction`).

    Dense: gate, up ``[..., I]``, weight ``[D, I]`` -> ``[..., D]``. Grouped (routed experts): gate, up
    ``[S, I]`` sorted by expert, weight ``[G, L, I]``, offs ``[G]`` int32 group ends -> ``[S, L]``.
    Equal to ``glu_activation(gate, up, act, ...)`` followed by the matmul."""
    if act not in HIDDEN_ACTS:
        raise ValueError(f"act={act!r}: allowed values are {HIDDEN_ACTS}")
    _check_pair(gate, up)
    betas = (float(beta), float(linear_beta)) if act == "situ" else ()
    if torch.compiler.is_compiling():
        # traced, an autograd.Function's own choice of saved tensors is the partitioner's to remake, and it keeps
        # h; a checkpointed region keeps its inputs only, and the partitioner recomputes from them what backward
        # reads of it: h (the elementwise chain). The matmul stays outside the region: were it inside, a later op
        # that saves the output (the MoE combine's router-weight gradient reads the expert outputs) would make the
        # partitioner recompute the matmul in backward too. Same math, h fused into the kernels.
        h = checkpoint(_act_traced, gate, up, act, betas, use_reentrant=False, preserve_rng_state=False)
        return _down(h, weight.to(h.dtype), offs)
    return GLUDownFunction.apply(gate, up, weight, offs, act, betas)


def _act_traced(gate: Tensor, up: Tensor, act: str, betas: tuple[float, ...]) -> Tensor:
    """``act(gate, up)`` as plain ops, for torch.compile: inductor fuses the activation and derives its backward,
    and the partitioner chooses what to save (the autograd Functions' reason to exist, saving gate and up only, is
    its job there). The Functions themselves are not traced: torch 2.11's dynamo traced :class:`SiTUGLUFunction`
    into wrong gate and up gradients (the output right; the experts' w1 and w3 gradients 100% off, with the
    backends "eager", "aot_eager" and "inductor", CPU and CUDA; checked on 2026-12-07), torch 2.13 traces it
    right. The trigger, narrowed down under torch 2.11: a Function whose forward returns a no-op ``.to(dtype)`` of an
    intermediate (here the fp32 result cast to fp32), so the output is the intermediate itself; ``g * u`` alone
    traces right, ``(g * u).to(torch.float32)`` does not (pytorch/pytorch issue 180642 describes the mechanism
    for an in-place op: an output that is itself an intermediate gets its gradient routed to the wrong slot).
    ``tests/test_situ_fused.py`` compares the compiled activations' gradients with eager's."""
    return _ACT_PASSES[act][0](gate, up, *betas)[0]


def _check_pair(gate: Tensor, up: Tensor) -> None:
    """gate and up must broadcast (as the plain formula; autograd sums a broadcast input's gradient)."""
    try:
        torch.broadcast_shapes(gate.shape, up.shape)
    except RuntimeError:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)}: shapes do not broadcast") from None


def situ_glu(gate: Tensor, up: Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    """[β1·tanh(gate/β1)·σ(gate)] ⊙ [β2·tanh(up/β2)] in fp32, cast back. gate, up: [..., I] -> [..., I].
    Saves only gate and up for backward (:class:`SiTUGLUFunction`); equal to :func:`situ_glu_reference`.
    Under ``torch.compile``: the plain ops (:func:`_act_traced`)."""
    _check_pair(gate, up)
    if torch.compiler.is_compiling():
        return _act_traced(gate, up, "situ", (float(beta), float(linear_beta)))
    return SiTUGLUFunction.apply(gate, up, float(beta), float(linear_beta))


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) ⊙ up in fp32, cast back. gate, up: [..., I] -> [..., I].
    Saves only gate and up for backward (:class:`SwiGLUFunction`); equal to :func:`swiglu_reference`.
    Under ``torch.compile``: the plain ops (:func:`_act_traced`)."""
    _check_pair(gate, up)
    if torch.compiler.is_compiling():
        return _act_traced(gate, up, "swiglu", ())
    return SwiGLUFunction.apply(gate, up)


def glu_activation(gate: Tensor, up: Tensor, act: str = "situ", beta: float = 4.0, linear_beta: float = 25.0,
                   fused: bool = True) -> Tensor:
    """The gated activation named by ``act`` ("situ" | "swiglu"); β's are used by SiTU only.
    ``fused=False``: the autograd reference (:func:`situ_glu_reference` / :func:`swiglu_reference`)."""
    if act == "situ":
        return (situ_glu if fused else situ_glu_reference)(gate, up, beta, linear_beta)
    if act == "swiglu":
        return (swiglu if fused else swiglu_reference)(gate, up)
    raise ValueError(f"act={act!r}: allowed values are {HIDDEN_ACTS}")


class SiTUMLP(nn.Module):
    """Dense gated MLP ``down_proj(act(gate_proj x, up_proj x))`` with no biases (docs/k3_reference.md §6).

    Used for the dense first layer (width ``intermediate_size``) and the shared experts
    (width ``n_shared_experts·moe_intermediate_size``). x: [..., D] -> [..., D]. ``backend``: the projections'
    (:class:`k3lab.linear.Linear`: on ``triton``, decode-sized calls by the Triton GEMV); the model passes
    ``cfg.backend``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, beta: float = 4.0, linear_beta: float = 25.0,
                 act: str = "situ", backend: str = "torch"):
        super().__init__()
        if act not in HIDDEN_ACTS:
            raise ValueError(f"act={act!r}: allowed values are {HIDDEN_ACTS}")
        self.act, self.beta, self.linear_beta = act, beta, linear_beta
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False, backend=backend)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False, backend=backend)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, backend=backend)
        self.fuse_down = True  # with grad: act + down_proj as one node (glu_down: h recomputed in backward); False: down_proj(h)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)                                  # [..., I]
        if self.fuse_down and torch.is_grad_enabled():  # the fused node only saves memory for backward
            return glu_down(gate, up, self.down_proj.weight, None, self.act, self.beta, self.linear_beta)
        return self.down_proj(glu_activation(gate, up, self.act, self.beta, self.linear_beta))


class GLUOutputRecorder:
    """Records the GLU output ``h = act(gate_proj x, up_proj x)`` entering every SiTUMLP's ``down_proj``
    (dense layers and shared experts) on training-mode forwards: per forward and module, ``max_abs``
    (max |h|), ``kurtosis`` (E[(h−μ)⁴]/σ⁴, 3 for a Gaussian; heavy tails → large) and ``frac_over``
    (fraction of |h| above ``threshold``, default 448 = the FP8-E4M3 max). ``remove()`` drops the hooks."""

    def __init__(self, model: nn.Module, threshold: float = 448.0):
        self.threshold = threshold
        self.history: dict[str, list[dict]] = {}
        self.handles = []
        self.modules: list[SiTUMLP] = []
        for name, module in model.named_modules():
            if isinstance(module, SiTUMLP):
                self.history[name] = []
                module.fuse_down = False  # so that down_proj runs as a module and its hook sees h
                self.modules.append(module)
                self.handles.append(module.down_proj.register_forward_pre_hook(self._hook(name, module)))

    def _hook(self, name: str, mlp: nn.Module):
        def hook(down_proj, args):
            if mlp.training:
                self.history[name].append(glu_output_stats(args[0], self.threshold))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for module in self.modules:
            module.fuse_down = True


@torch.no_grad()
def glu_output_stats(h: Tensor, threshold: float = 448.0) -> dict:
    """``{"max_abs", "kurtosis", "frac_over"}`` of a GLU output tensor (computed in fp32)."""
    h = h.detach().float().flatten()
    c = h - h.mean()
    var = c.pow(2).mean()
    return {"max_abs": h.abs().max().item(),
            "kurtosis": (c.pow(4).mean() / var.pow(2)).item() if var > 0 else 0.0,
            "frac_over": (h.abs() > threshold).float().mean().item()}
