"""SiTU-GLU, the bounded gated activation of K3 (K3 spec §6), and SwiGLU for comparison.

    SiTU-GLU(g, u) = [β1·tanh(g/β1)·σ(g)] ⊙ [β2·tanh(u/β2)],      β1 = 4, β2 = 25
    SwiGLU(g, u)   = [g·σ(g)] ⊙ u

``β·tanh(z/β) = z + O(z³/β²)``, so SiTU matches SwiGLU to first order at 0 and recovers it as
β → ∞; every factor is bounded, ``|β1 tanh(g/β1) σ(g)| < β1`` and ``|β2 tanh(u/β2)| < β2``, so
``‖SiTU-GLU‖_∞ ≤ β1·β2 = 100``. The non-linearities run in fp32 and the result is cast back to the
input dtype (as the reference ``situ_and_mul``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = ("situ", "swiglu")


def situ_glu(gate: Tensor, up: Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    """[β1·tanh(gate/β1)·σ(gate)] ⊙ [β2·tanh(up/β2)] in fp32, cast back. gate, up: [..., I] -> [..., I]."""
    g, u = gate.float(), up.float()
    out = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) ⊙ up in fp32, cast back. gate, up: [..., I] -> [..., I]."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def glu_activation(gate: Tensor, up: Tensor, act: str = "situ", beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    """The gated activation named by ``act`` ("situ" | "swiglu"); β's are used by SiTU only."""
    if act == "situ":
        return situ_glu(gate, up, beta, linear_beta)
    if act == "swiglu":
        return swiglu(gate, up)
    raise ValueError(f"act={act!r}: allowed values are {ACTIVATIONS}")


class SiTUMLP(nn.Module):
    """Dense gated MLP ``down_proj(act(gate_proj x, up_proj x))`` with no biases (K3 spec §6).

    Used for the dense first layer (width ``intermediate_size``) and the shared experts
    (width ``n_shared_experts·moe_intermediate_size``). x: [..., D] -> [..., D].
    """

    def __init__(self, hidden_size: int, intermediate_size: int, beta: float = 4.0, linear_beta: float = 25.0,
                 act: str = "situ"):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"act={act!r}: allowed values are {ACTIVATIONS}")
        self.act, self.beta, self.linear_beta = act, beta, linear_beta
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = glu_activation(self.gate_proj(x), self.up_proj(x), self.act, self.beta, self.linear_beta)  # [..., I]
        return self.down_proj(h)


class GLUOutputRecorder:
    """Records the GLU output ``h = act(gate_proj x, up_proj x)`` entering every SiTUMLP's ``down_proj``
    (dense layers and shared experts) on training-mode forwards: per forward and module, ``max_abs``
    (max |h|), ``kurtosis`` (E[(h−μ)⁴]/σ⁴, 3 for a Gaussian; heavy tails → large) and ``frac_over``
    (fraction of |h| above ``threshold``, default 448 = the FP8-E4M3 max). ``remove()`` drops the hooks."""

    def __init__(self, model: nn.Module, threshold: float = 448.0):
        self.threshold = threshold
        self.history: dict[str, list[dict]] = {}
        self.handles = []
        for name, module in model.named_modules():
            if isinstance(module, SiTUMLP):
                self.history[name] = []
                self.handles.append(module.down_proj.register_forward_pre_hook(self._hook(name, module)))

    def _hook(self, name: str, mlp: nn.Module):
        def hook(down_proj, args):
            if mlp.training:
                self.history[name].append(glu_output_stats(args[0], self.threshold))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def glu_output_stats(h: Tensor, threshold: float = 448.0) -> dict:
    """``{"max_abs", "kurtosis", "frac_over"}`` of a GLU output tensor (computed in fp32)."""
    h = h.detach().float().flatten()
    c = h - h.mean()
    var = c.pow(2).mean()
    return {"max_abs": h.abs().max().item(),
            "kurtosis": (c.pow(4).mean() / var.pow(2)).item() if var > 0 else 0.0,
            "frac_over": (h.abs() > threshold).float().mean().item()}
