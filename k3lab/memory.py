"""What a training step keeps for backward, and what it recomputes there (``TrainConfig(recompute=...)``).

    from k3lab.memory import apply_recompute
    apply_recompute(model, "selective")   # in place; fit() does this when TrainConfig.recompute says so

Modes (:data:`RECOMPUTE_MODES`), each exact — the same numbers as "none", bit for bit where the
recomputed code is deterministic:

* ``"none"``: autograd keeps what each op saves (fastest; most memory).
* ``"selective"``: the two large savers that need no projection re-run —
  the Triton KDA op keeps only its inputs ``q, k, v, g, β, S₀`` and re-runs its forward kernels in
  backward (``k3lab.kernels.triton_kda_chunk(recompute=True)``: ~2.8 KB less a token and head at K = V = 128 in
  bf16, one more kernel forward), and each Attention-Residuals depth mix
  (:func:`k3lab.residual.attn_res`) keeps only its sources — which the residual stream holds anyway —
  and recomputes the fp32 stack ``[S, B, T, D]``, its RMS-normalised keys and the softmax in backward
  (``torch.utils.checkpoint``, non-reentrant). Needs ``backend="triton"`` for the KDA part when the
  model has KDA layers (a ValueError names it otherwise: nothing falls back silently).
* ``"sublayer"``: the AttnRes mixes as in "selective", and every token mixer (``self_attn``) and MLP of every decoder layer
  checkpointed whole: only a sublayer's input is kept, its forward runs again in backward (about one
  more forward pass of compute; the least memory). A LatentMoE is checkpointed inside, at its routed
  experts and its shared experts, not around the router: the balancer observes each step's routing
  once (a recomputed router would count every token twice). A checkpointed KDA layer keeps only its
  input anyway, so the kernel's own recompute is not needed here, and any backend runs.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

RECOMPUTE_MODES = ("none", "selective", "sublayer")


def checkpoint_module(module: nn.Module) -> None:
    """Recompute this module's activations in backward (non-reentrant ``torch.utils.checkpoint``), in
    place; a second call on the same module changes nothing."""
    forward = module.forward
    if getattr(forward, "_k3lab_checkpointed", False):
        return

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run._k3lab_checkpointed = True
    module.forward = run


def checkpoint_targets(model: nn.Module) -> list[nn.Module]:
    """The modules "sublayer" checkpoints: each decoder layer's ``self_attn`` and dense MLP; for a
    LatentMoE its ``experts`` and ``shared_experts`` (the router and balancer stay outside)."""
    from k3lab.compile import sublayer_modules
    from k3lab.moe.latent import LatentMoE

    targets = []
    for _, m in sublayer_modules(model):
        if isinstance(m, LatentMoE):
            targets += [x for x in (m.experts, m.shared_experts) if x is not None]
        else:
            targets.append(m)
    return targets


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Set ``model`` (a K3ForCausalLM or K3Model, in place) to recompute per ``mode`` (see the module doc)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r}: allowed values are {RECOMPUTE_MODES}")
    if mode == "none":
        return
    from k3lab.mixers.kda import KDA
    from k3lab.model import K3Model

    for m in model.modules():
        if isinstance(m, KDA):
            m.kernel_recompute = mode == "selective"
        elif isinstance(m, K3Model):
            m.recompute_residual_mix = True
    if mode == "sublayer":
        for m in checkpoint_targets(model):
            checkpoint_module(m)
