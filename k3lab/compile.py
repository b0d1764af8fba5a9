"""``torch.compile`` for k3lab models, one sublayer at a time (``TrainConfig(compile="sublayer")``).

    from k3lab.compile import compile_model
    compile_model(model, "sublayer")      # in place; fit() does this when TrainConfig.compile says so

What "sublayer" compiles: in every :class:`~k3lab.model.K3DecoderLayer` (the MTP head's block too) the
token mixer ``self_attn`` (KDA or Gated MLA) and the MLP (``mlp``: SiTU MLP, or ``block_sparse_moe``:
LatentMoE), each with ``nn.Module.compile`` — in place, so parameter names, ``state_dict`` keys and
checkpoints stay those of the eager model. Not the decoder layers themselves: a layer takes the residual
stream, a Python object holding lists of tensors (:mod:`k3lab.residual`), and names its AttnRes calls with
an f-string of its ``layer_idx``, so compiling whole layers traced one graph per layer and hit dynamo's
recompile limit. The sublayers take and return tensors (and a cache dataclass).

Between the sublayers, the Attention-Residuals depth mix and the next sublayer's pre-norm
(:func:`k3lab.residual.attn_res_normed`, a pure function over a list of ``S`` source tensors) are compiled
too (``K3Model.attn_res_fn``): eager it is about ten fp32 passes over ``[S, B, T, D]`` per call and an
RMSNorm, compiled one fused read of the sources — one graph per source count ``S`` (at most blocks + 1 of
them; the output mix, with no pre-norm after it, one more). Only forwards with autograd on use it (training):
evaluation and generation (no grad, often without autocast) run the mix eager, so that they add no
graphs per source count and autocast state (with ``small``'s five source counts they passed dynamo's
recompile limit of 8).

One graph per class and shape, not per layer: all compiled modules of one class run the same ``forward``
code; their parameters and buffers are graph inputs (dynamo's ``inline_inbuilt_nn_modules``, on by
default in torch 2.11 and 2.13), and none of the compiled forwards reads ``layer_idx`` or anything else
that differs between layers, so layer 2 passes the guards of layer 1's graph and reuses it. Measured
(``torch._dynamo.utils.counters``, one forward + backward): KDA + dense MLP, 2 or 4 layers: 2 graphs
(whole decoder layers compiled: 2 and 4); the ``small`` layout (KDA, MLA, dense, LatentMoE) on CUDA, 4 or
8 layers: 9 graphs either way. A new batch shape, eval mode or no-grad adds entries per class, not per layer.

Graph breaks (the pieces on both sides are still compiled):

* LatentMoE: the balancer's ``observe`` (:mod:`k3lab.moe.router`) runs eager — it is wrapped in
  ``torch.compiler.disable`` here: it is Python bookkeeping (a device check, running tensors and lists
  of margins on a plain object, the distributed ``all_reduce`` hook). The router before it and the
  dispatch and experts after it are compiled; an auxiliary loss it returns keeps its gradient.
* The padded expert path (CPU; CUDA + bf16 takes ``grouped_mm``) reads ``int(counts.max())``, a
  host value: one more break, and one recompile before that piece goes dynamic.
* LatentMoE's shared expert on a side stream (``shared_stream``, an expert-parallel run's ``shared_overlap``):
  the stream switches run eager, so the expert there is called through ``LatentMoE.shared_side``, a compiled
  :func:`call_module` of its own (one graph for every layer: the module is an argument). Eager, its SiTU-GLU
  activation ran as unfused float32 kernels, 47 ms a ``small`` step on one H100 (``docs/scaling.md``, section 4h).

The Triton KDA op (``k3lab.kernels.triton_kda_chunk``) is a ``torch.library`` custom op with a fake (shape)
implementation and a registered backward, so the KDA forward is one graph with the op inside it.

Backend: ``inductor`` unless the environment variable ``K3LAB_COMPILE_BACKEND`` names another
(``aot_eager``: AOTAutograd without code generation, what the fast CPU tests use; ``eager``: dynamo only).
"""
from __future__ import annotations

import os
import types

import torch
from torch import nn

COMPILE_MODES = ("none", "sublayer")
BACKEND_ENV = "K3LAB_COMPILE_BACKEND"


def default_backend() -> str:
    """``$K3LAB_COMPILE_BACKEND`` or "inductor"."""
    return os.environ.get(BACKEND_ENV) or "inductor"


def sublayer_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every sublayer "sublayer" mode compiles: ``self_attn`` and the MLP of each
    K3DecoderLayer in ``model`` (main stack, then the MTP block), in module order."""
    from k3lab.model import K3DecoderLayer

    found = []
    for name, module in model.named_modules():
        if isinstance(module, K3DecoderLayer):
            prefix = f"{name}." if name else ""
            found.append((prefix + "self_attn", module.self_attn))
            found.append((prefix + module.mlp_name, getattr(module, module.mlp_name)))
    return found


def call_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``: compiled, the call :attr:`k3lab.moe.latent.LatentMoE.shared_side` holds. A plain function of
    the module, not a closure over it: a deep copy of the model keeps calling its own expert."""
    return module(x)


def _balancer_runs_eager(moe: nn.Module) -> None:
    """Wrap ``moe.balancer.observe`` (once) so that dynamo leaves it out of the graph. A bound method on
    the instance: ``copy.deepcopy`` rebinds it to the copied balancer."""
    balancer = getattr(moe, "balancer", None)
    if balancer is None or getattr(balancer.observe, "_k3lab_eager", False):
        return
    observe = torch.compiler.disable(type(balancer).observe)
    observe._k3lab_eager = True
    balancer.observe = types.MethodType(observe, balancer)


def compile_sublayers(model: nn.Module, backend: str | None = None, **compile_kwargs) -> list[str]:
    """Compile every sublayer of ``model`` in place (see the module docstring); returns their names.

    ``backend``: None = :func:`default_backend`; ``compile_kwargs`` go to ``torch.compile`` (``mode``,
    ``dynamic``, ``fullgraph`` ...). A module that is already compiled is left as it is. Raises
    ValueError when ``model`` has no K3 decoder layer.
    """
    from k3lab.moe.latent import LatentMoE

    targets = sublayer_modules(model)
    if not targets:
        raise ValueError(f"compile='sublayer' needs a k3lab model with K3DecoderLayer modules; "
                         f"{type(model).__name__} has none (use compile='none')")
    backend = backend or default_backend()
    from k3lab.model import K3Model
    from k3lab.residual import attn_res_normed

    for module in model.modules():  # the AttnRes depth mixes between the sublayers: one graph per source count
        if isinstance(module, K3Model) and module.use_attn_res and module.attn_res_fn is None:
            module.attn_res_fn = torch.compile(attn_res_normed, backend=backend, **compile_kwargs)
    side = None  # one compiled call_module for every shared expert a side stream runs
    for _, module in targets:
        if isinstance(module, LatentMoE):
            _balancer_runs_eager(module)
            if module.shared_experts is not None and module.shared_side is None:
                side = side or torch.compile(call_module, backend=backend, **compile_kwargs)
                module.shared_side = side
        if getattr(module, "_compiled_call_impl", None) is None:
            module.compile(backend=backend, **compile_kwargs)
    return [name for name, _ in targets]


def uncompile(model: nn.Module) -> None:
    """Undo :func:`compile_sublayers`: every module of ``model`` runs eager again (the balancers'
    ``observe`` goes back to the class method)."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
        if getattr(module, "attn_res_fn", None) is not None:
            module.attn_res_fn = None
        if getattr(module, "shared_side", None) is not None:
            module.shared_side = None
        balancer = getattr(module, "balancer", None)
        if balancer is not None and getattr(balancer.observe, "_k3lab_eager", False):
            del balancer.observe


def compile_model(model: nn.Module, mode: str = "sublayer", backend: str | None = None, **compile_kwargs) -> nn.Module:
    """Apply compile ``mode`` (:data:`COMPILE_MODES`) to ``model`` in place and return it: "none" leaves
    it eager, "sublayer" calls :func:`compile_sublayers`."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile={mode!r}: allowed values are {COMPILE_MODES}")
    if mode == "sublayer":
        compile_sublayers(model, backend, **compile_kwargs)
    return model
