"""What a training step keeps for backward, and what it recomputes there (``TrainConfig(recompute=...)``).

    from k3lab.memory import apply_recompute
    apply_recompute(model, "selective")   # in place; fit() does this when TrainConfig.recompute says so
    apply_recompute(model, "sublayer", layers=12)  # 12 decoder layers checkpointed, the others "selective"

Modes (:data:`RECOMPUTE_MODES`), each exact — the same numbers as "none", bit for bit where the
recomputed code is deterministic:

* ``"none"``: autograd keeps what each op saves (fastest; most memory).
* ``"selective"``: the two large savers that need no projection re-run —
  the Triton KDA op keeps only its inputs ``q, k, v, g, β, S₀`` and re-runs its forward kernels in
  backward (``k3lab.kernels.triton_kda_chunk(recompute=True)``: ~2.8 KB less a token and head at K = V = 128 in
  bf16, one more kernel forward), and each Attention-Residuals depth mix
  (:func:`k3lab.residual.attn_res`) keeps only its sources — which the residual stream holds anyway —
  and recomputes the fp32 stack ``[S, B, T, D]``, its RMS-normalised keys and the softmax in backward
  (``torch.utils.checkpoint``, non-reentrant). On backend ``triton`` the mixes that the fused kernel takes
  (:func:`k3lab.residual.fused_mix_applies`) keep only their sources in every mode, without a checkpoint. Needs ``backend="triton"`` for the KDA part when the
  model has KDA layers (a ValueError names it otherwise: nothing falls back silently).
* ``"sublayer"``: the AttnRes mixes as in "selective", and every token mixer (``self_attn``) and MLP of every decoder layer
  checkpointed whole: only a sublayer's input is kept, its forward runs again in backward (about one
  more forward pass of compute; the least memory). A LatentMoE is checkpointed inside, at its routed
  experts and its shared experts, not around the router: the balancer observes each step's routing
  once (a recomputed router would count every token twice). A checkpointed KDA layer keeps only its
  input anyway, so the kernel's own recompute is not needed here, and any backend runs.
* ``"mixer"``: as "sublayer", but only the token mixers (KDA, Gated MLA) are checkpointed; the MLPs and
  experts keep what they save. The cheaper half of "sublayer" for KDA models: a KDA layer keeps a
  lot for backward, and under "selective" its kernel forward runs again anyway, so only its
  projections, convolutions and gates are extra (pure-KDA anchor on an H200: 0.6 GiB less a layer at
  8 × 4096 tokens for 0.7 ms more a step; ``kernels/TRAIN_RESULTS.md``).

``layers`` (``TrainConfig.recompute_layers``), with "mixer" or "sublayer": checkpoint only that many
decoder layers, spread evenly over the depth (:func:`recompute_layer_indices`; the MTP block counts as
the last layer), and run the others as "selective". Memory and time then move in steps of one layer
between "selective" and the mode — torchtitan's "every N-th layer" activation checkpointing, by count.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

RECOMPUTE_MODES = ("none", "selective", "mixer", "sublayer")
LAYERED_MODES = ("mixer", "sublayer")  # the modes that checkpoint whole sublayers (and take ``layers``)


def recompute_layer_indices(num_layers: int, layers: int | None) -> list[int]:
    """The decoder layers (``0 .. num_layers-1``) to checkpoint: all when ``layers`` is None, else
    ``layers`` of them spread evenly — layer ``i`` when ``⌊(i+1)·n/L⌋ > ⌊i·n/L⌋`` (``n = layers``,
    ``L = num_layers``: every second layer for ``n = L/2``, the last layer always for ``n ≥ 1``).
    ValueError unless ``0 <= layers <= num_layers``."""
    if layers is None:
        return list(range(num_layers))
    if not (isinstance(layers, int) and 0 <= layers <= num_layers):
        raise ValueError(f"TrainConfig.recompute_layers={layers!r}: must be None (all) or an int in "
                         f"[0, {num_layers}] (this model's decoder layers, the MTP block included)")
    return [i for i in range(num_layers) if (i + 1) * layers // num_layers > i * layers // num_layers]


def checkpoint_module(module: nn.Module) -> None:
    """Recompute this module's activations in backward (non-reentrant ``torch.utils.checkpoint``), in
    place; a second call on the same module changes nothing."""
    forward = module.forward
    if getattr(forward, "_k3lab_checkpointed", False):
        return

    @functools.wraps(forward)
    def run(*args, **kwargs):
        # preserve_rng_state=False: k3lab's layers draw no random numbers (no dropout), so the recompute needs no
        # saved RNG state, and reading it is host work a CUDA graph capture cannot hold (k3lab.cuda_graph)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    run._k3lab_checkpointed = True
    module.forward = run


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every K3DecoderLayer of ``model`` in module order (the main stack, then the MTP block)."""
    from k3lab.model import K3DecoderLayer

    return [m for m in model.modules() if isinstance(m, K3DecoderLayer)]


def checkpoint_targets(model: nn.Module, mode: str = "sublayer", layers: int | None = None) -> list[nn.Module]:
    """The modules ``mode`` ("sublayer" or "mixer") checkpoints in the decoder layers that ``layers``
    picks (:func:`recompute_layer_indices`): each layer's ``self_attn``, and for "sublayer" its dense MLP
    too, or for a LatentMoE its ``experts`` and ``shared_experts`` (the router and balancer stay outside)."""
    from k3lab.moe.latent import LatentMoE

    if mode not in LAYERED_MODES:
        raise ValueError(f"checkpoint_targets: mode={mode!r}: allowed values are {LAYERED_MODES}")
    found = decoder_layers(model)
    targets = []
    for i in recompute_layer_indices(len(found), layers):
        targets.append(found[i].self_attn)
        if mode == "mixer":
            continue
        mlp = getattr(found[i], found[i].mlp_name)
        if isinstance(mlp, LatentMoE):
            targets += [x for x in (mlp.experts, mlp.shared_experts) if x is not None]
        else:
            targets.append(mlp)
    return targets


def apply_recompute(model: nn.Module, mode: str, layers: int | None = None) -> None:
    """Set ``model`` (a K3ForCausalLM or K3Model, in place) to recompute per ``mode`` (see the module
    doc); ``layers``: with "mixer" / "sublayer", how many decoder layers (None: all)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r}: allowed values are {RECOMPUTE_MODES}")
    if layers is not None and mode not in LAYERED_MODES:
        raise ValueError(f"TrainConfig.recompute_layers={layers!r} needs recompute in {LAYERED_MODES}, "
                         f"got recompute={mode!r} (use recompute_layers=None)")
    if mode == "none":
        return
    from k3lab.mixers.kda import KDA
    from k3lab.model import K3Model

    targets = checkpoint_targets(model, mode, layers) if mode in LAYERED_MODES else []
    checkpointed = {id(t) for t in targets}
    for m in model.modules():
        if isinstance(m, KDA):  # a checkpointed KDA layer keeps only its input: no kernel recompute inside it
            m.kernel_recompute = id(m) not in checkpointed
        elif isinstance(m, K3Model):
            m.recompute_residual_mix = True
    for m in targets:
        checkpoint_module(m)
