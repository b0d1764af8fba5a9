"""Attention Residuals (docs/k3_reference.md §1.1, §4) and the plain PreNorm residual they replace.

PreNorm:  x_{s+1} = x_s + f_s(Norm(x_s))   — every sublayer adds into one running sum.

AttnRes:  each sublayer s reads a softmax mixture over depth instead of the running sum::

    h_s = sum_i alpha_{i->s} v_i,    alpha_{i->s} = softmax_i( w_s . RMSNorm(v_i) )

with a learned pseudo-query ``w_s`` (``*_res_proj = Linear(D, 1, bias=False)``, zero-initialised
so depth mixing starts uniform), RMSNorm'd keys (``*_res_norm``, its own weight), un-normalised
values, no 1/sqrt(D), fp32 math. Sources ``v_i``:

* full form: the embedding and every earlier sublayer output;
* block form (K3): the embedding ``b_0``, the completed block sums ``b_1 .. b_{n-1}`` and the
  partial sum of the current block. K3 uses blocks of 12 decoder layers (24 sublayers).

The bookkeeping of :class:`AttnResStream` is the reference code's (docs/k3_reference.md §1.1): at a block
boundary the attention sublayer first reads ``[*blocks, prefix_sum]``, then ``prefix_sum``
(the just-completed block; the embedding at layer 0) joins ``blocks``. One more AttnRes mixes
everything at the output. Each decoder layer owns ``self_attention_res_{norm,proj}`` and
``mlp_res_{norm,proj}``; the model owns ``output_attn_res_{norm,proj}``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Tensor = torch.Tensor


def attn_res(sources: Sequence[Tensor], proj: nn.Linear, norm: nn.RMSNorm) -> tuple[Tensor, Tensor]:
    """One depth attention: h = sum_i softmax_i( (w * gamma) . v_i / rms(v_i) ) v_i.

    sources: S tensors [..., D] (same shape/dtype); proj.weight [1, D] = w; norm.weight [D] = gamma.
    Returns (h [..., D] in the sources' dtype, p [S, ...] the depth-softmax weights, float32/64).
    Math in float32 (float64 if the sources are float64), as the HF ``_apply_attn_res``.
    """
    if len(sources) == 0:
        raise ValueError("sources: need at least one residual source")
    dtype = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    V = torch.stack(tuple(sources), dim=0).to(dtype)  # [S, ..., D]
    eps = torch.finfo(dtype).eps if norm.eps is None else norm.eps  # nn.RMSNorm's default when eps is None
    K = V * torch.rsqrt(V.pow(2).mean(dim=-1, keepdim=True) + eps)  # RMSNorm without its weight
    query = (norm.weight * proj.weight[0]).to(dtype)  # [D]: the norm's gain folded into w
    p = (K * query).sum(dim=-1).softmax(dim=0)  # [S, ...]
    h = (p[..., None] * V).sum(dim=0)  # [..., D]
    return h.to(sources[0].dtype), p


def attn_res_normed(sources: Sequence[Tensor], proj: nn.Linear, norm: nn.RMSNorm,
                    post_norm: nn.Module | None = None) -> tuple[Tensor, Tensor]:
    """:func:`attn_res`, then ``post_norm`` (the next sublayer's pre-norm, None: none) on ``h``: one function,
    so that ``torch.compile`` fuses the norm into the depth mix (and, recomputed, into its backward).
    Returns ``(post_norm(h), p)``."""
    h, p = attn_res(sources, proj, norm)
    return (h if post_norm is None else post_norm(h)), p


def attn_res_normed_triton(sources: Sequence[Tensor], proj: nn.Linear, norm: nn.RMSNorm,
                           post_norm: nn.RMSNorm | None = None) -> tuple[Tensor, None]:
    """:func:`attn_res_normed` by the fused Triton kernels of :mod:`k3lab.kernels.attn_res` (CUDA, or the Triton
    interpreter): the same ``post_norm(h)`` within float32 rounding (bf16 sources: within bf16 rounding), the
    depth weights not returned (None). It keeps only the sources for backward and recomputes the rest there, so
    it needs no checkpoint. Use where :func:`fused_mix_applies`."""
    from k3lab.kernels.attn_res import attn_res_mix

    post_weight, post_eps = (None, None) if post_norm is None else (post_norm.weight, post_norm.eps)
    return attn_res_mix(list(sources), proj.weight, norm.weight, norm.eps, post_weight, post_eps), None


def fused_mix_applies(sources: Sequence[Tensor], post_norm: nn.Module | None) -> bool:
    """Whether :func:`attn_res_normed_triton` takes this call: at most ``MAX_SOURCES`` contiguous sources of one
    dtype (bf16 or float32: fp32 weights under bf16 autocast mix an fp32 embedding with bf16 outputs, which it
    does not), of width at most ``MAX_FAST_WIDTH`` (K3's D = 7168 keeps the torch mix), and a post-norm that is
    an ``nn.RMSNorm`` with a weight, or none."""
    from k3lab.kernels.attn_res import MAX_FAST_WIDTH, MAX_SOURCES
    from k3lab.kernels.rounding import DTYPES

    first = sources[0]
    return (len(sources) <= MAX_SOURCES and first.shape[-1] <= MAX_FAST_WIDTH and first.dtype in DTYPES
            and all(s.dtype == first.dtype and s.is_contiguous() for s in sources)
            and (post_norm is None or (isinstance(post_norm, nn.RMSNorm) and post_norm.weight is not None)))


class PreNormStream:
    """The plain residual: every sublayer reads the running sum and adds its output to it."""

    def __init__(self, embeddings: Tensor):
        self.x = embeddings  # [B, T, D]

    def sublayer_input(self, proj: nn.Linear | None = None, norm: nn.RMSNorm | None = None, name: str = "",
                       post_norm: nn.Module | None = None) -> Tensor:
        return self.x if post_norm is None else post_norm(self.x)

    def add(self, out: Tensor) -> None:
        self.x = self.x + out

    def output(self, proj: nn.Linear | None = None, norm: nn.RMSNorm | None = None) -> Tensor:
        return self.x


class AttnResStream:
    """Block Attention Residuals over one forward pass (docs/k3_reference.md §1.1), counted in sublayers.

    sublayers_per_block: 2 * attn_res_block_size for K3's decoder-layer blocks (an attention
    sublayer and an MLP sublayer per layer); 1 gives the full form (every sublayer output is its
    own source). A block size >= the depth is well defined: sources are then [embedding, partial].
    recorder: a list that receives ``(name, p)`` per AttnRes call, p [S] the weights averaged
    over tokens (detached) — for depth-attention heatmaps; None records nothing.
    """

    def __init__(self, embeddings: Tensor, sublayers_per_block: int, recorder: list | None = None,
                 recompute: bool = False, mix_fn=None, fused_mix=None):
        if sublayers_per_block < 1:
            raise ValueError(f"sublayers_per_block={sublayers_per_block}: must be >= 1")
        self.sublayers_per_block = sublayers_per_block
        self.recorder = recorder
        self.recompute = recompute  # keep only the sources for backward; rebuild the fp32 stack there
        self.mix_fn = attn_res_normed if mix_fn is None else mix_fn  # or a compiled attn_res_normed (k3lab.compile)
        self.fused_mix = fused_mix  # attn_res_normed_triton (backend "triton"), where fused_mix_applies; else mix_fn
        self.blocks: list[Tensor] = []  # completed block representations (the embedding first)
        self.prefix_sum: Tensor | None = embeddings  # partial sum of the current block
        self.sublayer = 0  # index of the next sublayer

    def _mix(self, proj: nn.Linear, norm: nn.RMSNorm, name: str, post_norm: nn.Module | None = None) -> Tensor:
        sources = [*self.blocks, self.prefix_sum]
        if self.fused_mix is not None and self.recorder is None and fused_mix_applies(sources, post_norm):
            return self.fused_mix(sources, proj, norm, post_norm)[0]  # keeps only the sources: no checkpoint needed
        if self.recompute and torch.is_grad_enabled():  # exact: the same ops again in backward
            h, p = checkpoint(self.mix_fn, sources, proj, norm, post_norm, use_reentrant=False,
                              preserve_rng_state=False)  # no randomness in the mix (and a CUDA graph captures it)
        else:
            h, p = self.mix_fn(sources, proj, norm, post_norm)
        if self.recorder is not None:
            self.recorder.append((name, p.detach().flatten(1).mean(dim=1).float().cpu()))
        return h

    def sublayer_input(self, proj: nn.Linear, norm: nn.RMSNorm, name: str = "",
                       post_norm: nn.Module | None = None) -> Tensor:
        """The input of the next sublayer, ``post_norm`` (its pre-norm; None: none) applied; starts a new block
        at a boundary."""
        if self.prefix_sum is None:
            raise ValueError("AttnResStream: sublayer_input called twice without add()")
        if not self.blocks:
            h = self.prefix_sum if post_norm is None else post_norm(self.prefix_sum)
        else:
            h = self._mix(proj, norm, name, post_norm)
        if self.sublayer % self.sublayers_per_block == 0:
            self.blocks.append(self.prefix_sum)
            self.prefix_sum = None
        return h

    def add(self, out: Tensor) -> None:
        """Accumulate a sublayer output into the current block."""
        self.prefix_sum = out if self.prefix_sum is None else self.prefix_sum + out
        self.sublayer += 1

    def output(self, proj: nn.Linear, norm: nn.RMSNorm) -> Tensor:
        """The final AttnRes over [*blocks, prefix_sum] (before the model's final norm)."""
        return self._mix(proj, norm, "output")


def residual_stream(kind: str, embeddings: Tensor, sublayers_per_block: int, recorder: list | None = None,
                    recompute: bool = False, mix_fn=None, fused_mix=None):
    """"attnres" -> AttnResStream, "prenorm" -> PreNormStream (cfg.residual); ``recompute``: AttnRes mixes
    recomputed in backward (k3lab.memory); ``mix_fn``: the depth-mix function (None: :func:`attn_res_normed`);
    ``fused_mix``: :func:`attn_res_normed_triton` where it applies (None: never)."""
    if kind == "attnres":
        return AttnResStream(embeddings, sublayers_per_block, recorder, recompute, mix_fn, fused_mix)
    if kind == "prenorm":
        return PreNormStream(embeddings)
    raise ValueError(f"residual={kind!r}: allowed values are ('attnres', 'prenorm')")


def depth_weights_matrix(records: Sequence[tuple[str, Tensor]]) -> tuple[list[str], np.ndarray]:
    """Recorder entries -> (row names, [rows, max sources] array, NaN where a row has fewer sources)."""
    width = max(len(p) for _, p in records)
    mat = np.full((len(records), width), np.nan)
    for r, (_, p) in enumerate(records):
        mat[r, : len(p)] = p.numpy()
    return [name for name, _ in records], mat
