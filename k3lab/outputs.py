"""Output containers shared by every causal LM in k3lab (the trainer reads `.loss`)."""

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CausalLMOutput:
    """What a causal LM returns.

    loss:     mean cross-entropy over labels != -100 (plus weighted aux/MTP losses), or None.
    logits:   [B, T, vocab].
    cache:    the per-layer generation cache (model-specific), or None.
    aux_loss: the auxiliary part of `loss` (MoE balance, MTP), or None.
    metrics:  scalars worth logging (e.g. "lm_loss", "mtp_loss"), as detached 0-d tensors so the
              forward never waits for the GPU; ``float()`` them when logging.
    """

    loss: torch.Tensor | None
    logits: torch.Tensor
    cache: Any = None
    aux_loss: torch.Tensor | None = None
    metrics: dict = field(default_factory=dict)
