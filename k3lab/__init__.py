"""k3lab — Kimi K3 rebuilt at small scale: KDA + Gated MLA hybrid, AttnRes, LatentMoE, QB, Muon."""

__version__ = "0.1.0"
