"""The Hugging Face side of k3lab, in one place (docs/hf_checkpoint.md).

* :mod:`k3lab.hf.config`: ``config.json`` <-> :class:`~k3lab.config.ModelConfig` for K3's release and both
  Kimi Linear dialects (the hub's and transformers'); the family decided from the file, never guessed.
* :mod:`k3lab.hf.checkpoint`: read any slice of a safetensors checkpoint of either family onto a meta-device
  model; write a k3lab model in its family's layout (K3's release, or what transformers' Kimi Linear reads).
* :mod:`k3lab.hf.mxfp4`: the release's MXFP4 expert weights (compressed-tensors).
* :mod:`k3lab.hf.compare`: sublayer-by-sublayer comparison of a k3lab model with transformers' Kimi Linear.
"""
from k3lab.hf.checkpoint import LoadedCheckpoint, load_hf_checkpoint, read_hf_config, save_hf_checkpoint
from k3lab.hf.config import config_family, from_hf_config, hf_family, kimi_linear_mismatches, to_hf_config

__all__ = ["LoadedCheckpoint", "load_hf_checkpoint", "read_hf_config", "save_hf_checkpoint", "config_family",
           "from_hf_config", "hf_family", "kimi_linear_mismatches", "to_hf_config"]
