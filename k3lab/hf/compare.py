"""A k3lab model beside transformers' ``KimiLinearForCausalLM``, sublayer by sublayer.

Both models run the same tokens; forward hooks record every sublayer's output (``layers.{i}.self_attn``,
``layers.{i}.mlp``, the final ``norm``) and the logits. Each entry's difference is

    rel(a, b) = max |a − b| / max |b|          (b: transformers' tensor)

The sublayers run in order on the residual stream, so the first entry over the tolerance is where the two
models part: a wrong gate shows at the first KDA layer's ``self_attn``, a wrong router at the first MoE
layer's ``mlp``. No transformers import here: the transformers model is passed in, and only its module
names (``model.layers[i].self_attn`` / ``.mlp``, ``model.norm``) are used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3lab.model import K3ForCausalLM


@dataclass
class Comparison:
    """``rows``: (name, rel) in forward order, logits last; ``max_rel``: the logits' rel."""

    rows: list[tuple[str, float]]

    @property
    def max_rel(self) -> float:
        return dict(self.rows)["logits"]

    def first_over(self, tol: float) -> str | None:
        """The first entry whose difference exceeds ``tol`` (None: all within)."""
        return next((name for name, rel in self.rows if not rel <= tol), None)

    def table(self) -> str:
        return "\n".join(f"{name:<24s} {rel:.2e}" for name, rel in self.rows)


def relative_difference(a: Tensor, b: Tensor) -> float:
    """``max |a − b| / max |b|`` in float64 (inf where the shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def k3lab_sublayers(model: K3ForCausalLM) -> dict[str, nn.Module]:
    """``{name: module}`` of a k3lab model's sublayers, named as :func:`transformers_sublayers` names them."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        out[f"layers.{i}.self_attn"] = layer.self_attn
        out[f"layers.{i}.mlp"] = getattr(layer, layer.mlp_name)
    out["norm"] = model.model.norm
    return out


def transformers_sublayers(hf_model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of a transformers ``KimiLinearForCausalLM``'s sublayers."""
    out = {}
    for i, layer in enumerate(hf_model.model.layers):
        out[f"layers.{i}.self_attn"] = layer.self_attn
        out[f"layers.{i}.mlp"] = layer.mlp
    out["norm"] = hf_model.model.norm
    return out


@torch.no_grad()
def sublayer_outputs(modules: dict[str, nn.Module], run) -> dict[str, Tensor]:
    """Call ``run()`` (returns logits) with a forward hook on each module; ``{name: output}`` plus "logits".
    A tuple output (k3lab's mixers return ``(y, cache)``) records its first element."""
    seen: dict[str, Tensor] = {}
    hooks = []
    for name, module in modules.items():
        def hook(_module, _args, output, name=name):
            seen[name] = (output[0] if isinstance(output, tuple) else output).detach().clone()
        hooks.append(module.register_forward_hook(hook))
    try:
        seen["logits"] = run().detach().clone()
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def compare_with_transformers(model: K3ForCausalLM, hf_model: nn.Module, input_ids: Tensor) -> Comparison:
    """Run ``input_ids [B, T]`` through both models and compare every sublayer output and the logits."""
    ours = sublayer_outputs(k3lab_sublayers(model), lambda: model(input_ids).logits)
    theirs = sublayer_outputs(transformers_sublayers(hf_model), lambda: hf_model(input_ids=input_ids).logits)
    names = [n for n in theirs if n in ours]
    return Comparison([(n, relative_difference(ours[n], theirs[n])) for n in names])
