"""A tiny causal LM whose token mixer is any member of the linear-attention lineage, or softmax
attention as the ceiling: the test bench of notebook 01 (MQAR, state capacity).

Every model is the same stack; only the mixer op between the projections changes::

    x → Embedding → n_layers × [ x + MixerLayer(RMSNorm(x));  x + MLP(RMSNorm(x)) ] → RMSNorm → head

MixerLayer: ``q, k, v = SiLU(ShortConv(W x))`` (depthwise causal conv, kernel 4, as in KDA §2.1),
then the mixer, a head-wise RMSNorm and ``o_proj``. Per mixer:

=================  =========================================================================
``linear``         raw q, k (scale ``K^-1/2``), no decay
``retnet``         raw q, k, fixed decay ``γ_h = 1 − 2^{−5−h}`` (RetNet's schedule)
``mamba2``         raw q, k, ``g = −exp(A_log)·softplus(a_proj(x) + dt_bias)`` per head
``deltanet``       L2-normalised q, k; ``β = σ(b_proj(x))``
``gated_deltanet`` deltanet + mamba2's gate
``kda``            deltanet + per-channel K3 gate ``g = −5·σ(exp(A_log)·(f_b(f_a(x)) + dt_bias))``; on CUDA
                   (``backend="auto"``) k3lab's Triton KDA kernels, elsewhere the torch chunk form
``softmax``        SDPA, causal (no positional encoding, like K3's NoPE MLA)
=================  =========================================================================

Labels are pre-aligned (``loss = CE(logits[:, t], labels[:, t])``, ignore_index -100).

The MQAR harness that trains these models (:func:`k3lab.experiments.mqar.train_mqar`) lives above
the trainer, in :mod:`k3lab.experiments.mqar`: this module imports neither ``k3lab.train`` nor
``k3lab.data`` (lower layers never import upper ones).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3lab.backend import resolve_backend
from k3lab.config import KDA_GATE_LOWER_BOUND
from k3lab.mixers import chunk
from k3lab.mixers.kda import ShortConvolution, inverse_softplus_dt_bias, kda_gate, l2norm
from k3lab.outputs import CausalLMOutput

MIXER_NAMES = ("linear", "retnet", "mamba2", "deltanet", "gated_deltanet", "kda", "softmax")
DELTA_MIXERS = ("deltanet", "gated_deltanet", "kda")
# Gate init range: long memory at the start (per-token log-decay ≈ −A·dt ≥ −0.16 for Mamba2/GDN, ≈ −5·dt
# for KDA). fla's [1e-3, 1e-1] leaves some of only 2 heads forgetting within a few tokens, and then the
# gated mixers do not leave the MQAR plateau in a few hundred steps.
GATE_DT_RANGE = (1e-3, 1e-2)


class ToyMixer(nn.Module):
    """One token-mixing layer: projections + short convs, the chosen mixer, head-wise RMSNorm, ``o_proj``."""

    def __init__(self, d_model: int, num_heads: int, mixer: str, head_dim: int | None = None,
                 conv_size: int = 4, chunk_size: int = 16, backend: str = "auto"):
        super().__init__()
        resolve_backend(backend, "cpu" if backend in ("auto", "torch") else "cuda")  # validates the name
        if backend == "fla":
            raise ValueError("ToyMixer: backend='fla' is not wired here; use 'auto', 'torch' or 'triton'")
        self.backend = backend
        if mixer not in MIXER_NAMES:
            raise ValueError(f"mixer must be one of {MIXER_NAMES}, got {mixer!r}")
        head_dim = head_dim or d_model // num_heads
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1 (d_model={d_model}, num_heads={num_heads})")
        self.mixer, self.num_heads, self.head_dim, self.chunk_size = mixer, num_heads, head_dim, chunk_size
        H, K = num_heads, head_dim
        self.qkv_proj = nn.Linear(d_model, 3 * H * K, bias=False)
        self.qkv_conv = ShortConvolution(3 * H * K, conv_size)  # SiLU inside
        if mixer in DELTA_MIXERS:
            self.b_proj = nn.Linear(d_model, H, bias=False)
        if mixer == "retnet":
            self.register_buffer("gamma", 1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32)))
        if mixer in ("mamba2", "gated_deltanet"):
            self.a_proj = nn.Linear(d_model, H, bias=False)
            self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)))
            self.dt_bias = nn.Parameter(inverse_softplus_dt_bias(H, *GATE_DT_RANGE))
        if mixer == "kda":
            self.f_a_proj = nn.Linear(d_model, K, bias=False)
            self.f_b_proj = nn.Linear(K, H * K, bias=False)
            self.A_log = nn.Parameter(torch.zeros(H))
            self.dt_bias = nn.Parameter(inverse_softplus_dt_bias(H * K, *GATE_DT_RANGE))
        self.o_norm = nn.RMSNorm(K)
        self.o_proj = nn.Linear(H * K, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        qkv, _ = self.qkv_conv(self.qkv_proj(x))
        q, k, v = qkv.reshape(B, T, 3, H, K).unbind(2)  # [B, T, H, K] each
        if self.mixer in DELTA_MIXERS:
            q, k = l2norm(q), l2norm(k)
            beta = torch.sigmoid(self.b_proj(x))  # [B, T, H]
        if self.mixer in ("mamba2", "gated_deltanet"):
            # Mamba2's gate −e^A·softplus(a + dt_bias) is Kimi Linear's KDA gate with one channel
            g = kda_gate(self.a_proj(x)[..., None], self.A_log, self.dt_bias, kind="kimi_linear")[..., 0]  # [B, T, H]
        C = self.chunk_size
        match self.mixer:
            case "softmax":
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True).transpose(1, 2)
            case "linear":
                o, _ = chunk.linear_attention_chunk(q, k, v, output_final_state=False, chunk_size=C)
            case "retnet":
                o, _ = chunk.retnet_chunk(q, k, v, self.gamma, output_final_state=False, chunk_size=C)
            case "mamba2":
                o, _ = chunk.mamba2_chunk(q, k, v, g, output_final_state=False, chunk_size=C)
            case "deltanet":
                o, _ = chunk.deltanet_chunk(q, k, v, beta, output_final_state=False, chunk_size=C)
            case "gated_deltanet":
                o, _ = chunk.gated_deltanet_chunk(q, k, v, g, beta, output_final_state=False, chunk_size=C)
            case "kda":
                z = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, K)
                g = kda_gate(z, self.A_log, self.dt_bias, kind="k3", lower_bound=KDA_GATE_LOWER_BOUND)  # [B, T, H, K]
                if resolve_backend(self.backend, x.device) == "triton":  # the kernels K3's KDA layer runs on CUDA
                    from k3lab.kernels import triton_kda_chunk

                    o, _ = triton_kda_chunk(q, k, v, g, beta, output_final_state=False)
                else:
                    o, _ = chunk.kda_chunk(q, k, v, g, beta, output_final_state=False, chunk_size=C)
        return self.o_proj(self.o_norm(o).reshape(B, T, H * K))


class ToyBlock(nn.Module):
    """Pre-norm block: ``x + mixer(norm(x))``, then ``x + MLP(norm(x))`` (GELU MLP)."""

    def __init__(self, d_model: int, num_heads: int, mixer: str, mlp_ratio: int, **mixer_kw):
        super().__init__()
        self.mixer_norm, self.mlp_norm = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.mixer = ToyMixer(d_model, num_heads, mixer, **mixer_kw)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MixerLM(nn.Module):
    """Tiny causal LM with a lineage mixer (see module docstring); ``model(input_ids, labels=None)``.

    Args: vocab_size, d_model (D), n_layers, mixer (one of ``MIXER_NAMES``), num_heads,
    head_dim (default ``D // num_heads``), mlp_ratio (MLP width / D), conv_size (short conv kernel),
    chunk_size (of the chunkwise mixer forms; 16 keeps KDA's [C, C, K] decay tensor small on CPU),
    backend (KDA's: "auto" = k3lab's Triton kernels on CUDA, the torch chunk form elsewhere; "torch"; "triton").
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, mixer: str, num_heads: int,
                 head_dim: int | None = None, mlp_ratio: int = 2, conv_size: int = 4, chunk_size: int = 16,
                 backend: str = "auto"):
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self.mixer_name = mixer
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            ToyBlock(d_model, num_heads, mixer, mlp_ratio, head_dim=head_dim, conv_size=conv_size,
                     chunk_size=chunk_size, backend=backend)
            for _ in range(n_layers)
        )
        self.norm = nn.RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            if isinstance(module, ShortConvolution):  # taps ~ N(0, 1/W): the conv keeps the input's scale
                nn.init.normal_(module.weight, std=module.kernel_size[0] ** -0.5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, cache=None) -> CausalLMOutput:
        if cache is not None:
            raise ValueError("MixerLM runs full sequences only: cache must be None")
        x = self.embed(input_ids)  # [B, T, D]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))  # [B, T, vocab]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
