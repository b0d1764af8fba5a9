"""The K3 hybrid model: KDA and Gated MLA 3:1, (Latent)MoE, Attention Residuals, MTP (docs/k3_reference.md §1, §10).

Layer schedule from the config (docs/k3_reference.md §1)::

    layer i:  self_attn = GatedMLA   if cfg.is_mla_layer(i) (1-based full_attn_layers; K3: every 4th + the last)
                          KDA        otherwise
              mlp               = dense SiTU MLP            for i < first_k_dense_replace
              block_sparse_moe  = LatentMoE(cfg)            for the others when mlp_kind is "latent_moe"/"moe"
              mlp               = dense SiTU MLP            for the others when mlp_kind is "dense"

Each sublayer reads its input from the residual stream (:mod:`k3lab.residual`): Block AttnRes
(K3) or PreNorm. The pre-norm (``input_layernorm`` / ``post_attention_layernorm``) is applied
after the depth mixing; one more AttnRes mixes the output before ``model.norm`` and ``lm_head``.

MTP (docs/k3_reference.md §10, DeepSeek-V3 style, depth 1; K3's exact design is not published)::

    h'_t = eh_proj[ enorm(Emb(x_{t+1})) ; hnorm(h_t) ]        h_t: the main model's final residual
    logits_mtp = lm_head(norm(Block(h')))                      Block: MLA + the last layer's MLP kind, PreNorm
    loss += mtp_loss_weight * CE(logits_mtp[:, t], labels[:, t+1])    predicts x_{t+2}

Labels are pre-aligned (loss = CE(logits[:, t], labels[:, t]), ignore_index -100, no shift).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3lab.backend import resolve_backend
from k3lab.config import ModelConfig
from k3lab.linear import Linear
from k3lab.losses import linear_cross_entropy, loss_divisor
from k3lab.mixers.kda import KDA
from k3lab.mixers.mla import GatedMLA, qk_clip_
from k3lab.moe.latent import LatentMoE
from k3lab.moe.situ import SiTUMLP
from k3lab.outputs import CausalLMOutput
from k3lab.residual import PreNormStream, attn_res_normed_triton, residual_stream

Tensor = torch.Tensor
IGNORE_INDEX = -100


@dataclass
class K3Cache:
    """Generation cache: one entry per decoder layer (KDA: recurrent + conv states; MLA: MLACache)
    and the absolute position of the next token."""

    layers: list
    offset: int

    def nbytes(self) -> int:
        """Bytes held by every tensor in the cache (a KDA state and an MLA latent alike)."""
        total = 0
        for layer_cache in self.layers:
            for value in vars(layer_cache).values():
                tensors = value if isinstance(value, (list, tuple)) else [value]
                total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))
        return total


@dataclass
class K3ModelOutput:
    last_hidden_state: Tensor  # [B, T, D] after model.norm
    residual: Tensor  # [B, T, D] the output AttnRes mix (or PreNorm sum) before model.norm; MTP reads it
    cache: K3Cache


def build_mlp(cfg: ModelConfig, kind: str) -> tuple[str, nn.Module]:
    """(checkpoint attribute name, module) for an MLP of `kind` ("dense", "latent_moe", "moe")."""
    if kind == "dense":
        return "mlp", SiTUMLP(cfg.hidden_size, cfg.intermediate_size, beta=cfg.activation_situ_beta,
                              linear_beta=cfg.activation_situ_linear_beta, act=cfg.hidden_act, backend=cfg.backend)
    if kind in ("latent_moe", "moe"):
        return "block_sparse_moe", LatentMoE(cfg)
    raise ValueError(f"mlp kind={kind!r}: allowed values are ('dense', 'latent_moe', 'moe')")


class K3DecoderLayer(nn.Module):
    """One decoder layer: [AttnRes] -> input_layernorm -> self_attn -> [AttnRes] ->
    post_attention_layernorm -> mlp | block_sparse_moe (docs/k3_reference.md §1.1, names §1.2)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, is_mla: bool, mlp_kind: str, use_attn_res: bool):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_mla = is_mla
        self.use_attn_res = use_attn_res
        self.input_layernorm = nn.RMSNorm(D, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(D, eps=eps)
        if use_attn_res:
            self.self_attention_res_norm = nn.RMSNorm(D, eps=eps)
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = nn.RMSNorm(D, eps=eps)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        self.self_attn = GatedMLA(cfg, layer_idx) if is_mla else KDA(cfg, layer_idx)
        self.mlp_name, mlp = build_mlp(cfg, mlp_kind)
        self.add_module(self.mlp_name, mlp)

    def forward(self, stream, cache=None):
        """Run both sublayers on `stream` (an AttnResStream or PreNormStream); return the mixer's new cache."""
        i = self.layer_idx
        res = (self.self_attention_res_proj, self.self_attention_res_norm) if self.use_attn_res else (None, None)
        # the pre-norm goes to the stream: with a compiled depth mix it runs fused into it (k3lab.compile)
        x = stream.sublayer_input(*res, name=f"{i}.attn", post_norm=self.input_layernorm)
        a, new_cache = self.self_attn(x, cache)
        stream.add(a)
        res = (self.mlp_res_proj, self.mlp_res_norm) if self.use_attn_res else (None, None)
        x = stream.sublayer_input(*res, name=f"{i}.mlp", post_norm=self.post_attention_layernorm)
        stream.add(getattr(self, self.mlp_name)(x))
        return new_cache


class K3Model(nn.Module):
    """Embedding -> decoder layers on the residual stream -> output AttnRes -> model.norm.

    forward(input_ids [B, T], cache: K3Cache | None) -> K3ModelOutput (with the updated cache).

    Experiment knobs (attributes, not config fields):
    ``attn_res_sublayers_per_block`` (default 2 * cfg.attn_res_block_size; 1 = full AttnRes) and
    ``attn_res_recorder`` (a list to receive ``(name, depth weights [S])`` per AttnRes call).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        D = cfg.hidden_size
        self.use_attn_res = cfg.residual == "attnres"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(
            K3DecoderLayer(cfg, i, cfg.is_mla_layer(i), cfg.mlp_kind_at(i), self.use_attn_res)
            for i in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        if self.use_attn_res:
            self.output_attn_res_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(D, 1, bias=False)
        self.attn_res_sublayers_per_block = 2 * cfg.attn_res_block_size
        self.attn_res_recorder: list | None = None
        self.recompute_residual_mix = False  # k3lab.memory "selective": AttnRes mixes recomputed in backward
        self.attn_res_fn = None  # None: k3lab.residual.attn_res_normed; k3lab.compile sets a compiled one

    def forward(self, input_ids: Tensor, cache: K3Cache | None = None) -> K3ModelOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if cache is not None and len(cache.layers) != len(self.layers):
            raise ValueError(f"cache has {len(cache.layers)} layer entries, the model has {len(self.layers)} layers")
        mix_fn = self.attn_res_fn if torch.is_grad_enabled() else None  # compiled for training; eager for no-grad calls
        # backend "triton" (and "auto" on CUDA): the depth mixes by k3lab's fused kernels, where they apply
        # (not inside torch.compile: inductor fuses the torch mix with its neighbours instead, e.g. a compiled decode step)
        fused = resolve_backend(self.config.backend, input_ids.device) == "triton" and not torch.compiler.is_compiling()
        fused_mix = attn_res_normed_triton if fused else None
        stream = residual_stream(self.config.residual, self.embed_tokens(input_ids),
                                 self.attn_res_sublayers_per_block, self.attn_res_recorder,
                                 self.recompute_residual_mix, mix_fn, fused_mix)
        new_caches = [layer(stream, None if cache is None else cache.layers[i]) for i, layer in enumerate(self.layers)]
        res = (self.output_attn_res_proj, self.output_attn_res_norm) if self.use_attn_res else (None, None)
        residual = stream.output(*res)
        offset = input_ids.shape[1] + (0 if cache is None else cache.offset)
        return K3ModelOutput(self.norm(residual), residual, K3Cache(new_caches, offset))


class MTPHead(nn.Module):
    """DeepSeek-V3-style multi-token prediction module, depth 1 (docs/k3_reference.md §10; names as DeepSeek-V3's)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, eps, L = cfg.hidden_size, cfg.rms_norm_eps, cfg.num_hidden_layers
        self.enorm = nn.RMSNorm(D, eps=eps)
        self.hnorm = nn.RMSNorm(D, eps=eps)
        self.eh_proj = Linear(2 * D, D, bias=False, backend=cfg.backend)
        self.block = K3DecoderLayer(cfg, L, is_mla=True, mlp_kind=cfg.mlp_kind_at(L - 1), use_attn_res=False)
        self.norm = nn.RMSNorm(D, eps=eps)

    def forward(self, next_embeddings: Tensor, residual: Tensor) -> Tensor:
        """next_embeddings = Emb(x_{t+1}) [B, T', D], residual = h_t [B, T', D] -> normed hidden [B, T', D]."""
        stream = PreNormStream(self.eh_proj(torch.cat([self.enorm(next_embeddings), self.hnorm(residual)], dim=-1)))
        self.block(stream)
        return self.norm(stream.output())


def masked_cross_entropy(logits: Tensor, labels: Tensor, num_valid: int | Tensor | None = None) -> Tensor:
    """CE summed over labels != -100 in float32, divided by ``num_valid`` (default: this call's
    valid labels, i.e. the mean; 0, not NaN, when none is valid). A data/context-parallel rank passes
    the *global* count, so the ranks' losses add up to the one-process loss (a 0-d tensor in a captured
    step, :func:`k3lab.losses.loss_divisor`)."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / loss_divisor(labels, num_valid)


@dataclass
class LossShard:
    """How one rank's slice of a global batch enters the loss (data and context parallelism).

    lm_tokens / mtp_tokens: valid labels of the *global* batch for the main and the MTP loss (the
    divisors, so that Σ over ranks of each rank's loss = the one-process loss); num_shards: ranks
    the batch is split over (MoE auxiliary losses are averaged over them).
    mtp_input_ids / mtp_labels ``[B, T_local]``: under context parallelism, the token one ahead of
    each local position and its label (MTP at global position t reads ``x_{t+1}`` and predicts
    ``labels[t+1]``, which may live on another rank); the sequence's last position gets a pad with
    label -100 (causal attention keeps it from touching the others). None: shift inside the slice.
    """

    lm_tokens: int | Tensor  # a 0-d device tensor in a captured step (refilled before each replay)
    mtp_tokens: int | Tensor
    num_shards: int = 1
    mtp_input_ids: Tensor | None = None
    mtp_labels: Tensor | None = None


class LMHead(Linear):
    """The output projection ``logits = h Wᵀ`` ([B, T, D] → [B, T, V]); :meth:`cross_entropy` is the same projection
    fused with the loss (:func:`k3lab.losses.linear_cross_entropy`), a method of this module so that a wrapper that
    hooks the module's calls (FSDP2's ``register_fsdp_forward_method``) sees the weight's use."""

    def cross_entropy(self, hidden: Tensor, labels: Tensor, tokens: int | Tensor | None) -> Tensor:
        """Σ CE(hidden Wᵀ, labels) / tokens over the unmasked labels, no [B, T, V] logits kept for backward."""
        return linear_cross_entropy(hidden, self.weight, labels, tokens)


class K3ForCausalLM(nn.Module):
    """K3Model + lm_head (+ the MTP head when cfg.num_nextn_predict_layers == 1).

    forward(input_ids [B, T], labels [B, T] | None, cache | None) -> CausalLMOutput, with
    loss = CE + mtp_loss_weight * MTP CE + MoE aux losses (labels pre-aligned, no shift).
    Init: N(0, initializer_range) for every Linear/Embedding weight, zeros for AttnRes queries.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = K3Model(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False, backend=cfg.backend)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = MTPHead(cfg) if cfg.num_nextn_predict_layers == 1 else None
        # True: with labels, the main and MTP losses go through k3lab.losses.linear_cross_entropy (lm_head + CE
        # in row chunks, no [B, T, V] fp32 logits kept for backward) and forward returns logits=None
        self.fused_loss = False
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if name.endswith("res_proj"):
                    nn.init.zeros_(module.weight)  # AttnRes pseudo-query: uniform depth mixing at init
                else:
                    nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, cache: K3Cache | None = None,
                shard: LossShard | None = None) -> CausalLMOutput:
        """``shard``: this rank's part of a data/context-parallel batch (:class:`LossShard`); None = the whole batch."""
        out = self.model(input_ids, cache)
        fused = labels is not None and self.fused_loss
        logits = None if fused else self.lm_head(out.last_hidden_state)  # [B, T, vocab]
        if labels is None:
            return CausalLMOutput(loss=None, logits=logits, cache=out.cache)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
        lm_tokens = None if shard is None else shard.lm_tokens
        lm_loss = (self.lm_head.cross_entropy(out.last_hidden_state, labels, lm_tokens) if fused
                   else masked_cross_entropy(logits, labels, lm_tokens))
        metrics = {"lm_loss": lm_loss.detach()}  # 0-d tensors: no host sync in the forward
        ran = [self.model]
        mtp_loss = None
        ahead = shard is not None and shard.mtp_input_ids is not None
        if self.mtp is not None and (input_ids.shape[1] > 1 or ahead):
            ids, lab, res = input_ids[:, 1:], labels[:, 1:], out.residual[:, :-1]
            if ahead:  # context parallel: the tokens one ahead of every local position come with the shard
                ids, lab, res = shard.mtp_input_ids, shard.mtp_labels, out.residual
            hidden = self.mtp(self.model.embed_tokens(ids), res)
            mtp_tokens = None if shard is None else shard.mtp_tokens
            mtp_loss = (self.lm_head.cross_entropy(hidden, lab, mtp_tokens) if fused
                        else masked_cross_entropy(self.lm_head(hidden), lab, mtp_tokens))
            metrics["mtp_loss"] = mtp_loss.detach()
            ran.append(self.mtp)
        aux = [m.aux_loss for part in ran for m in part.modules() if isinstance(m, LatentMoE) and m.aux_loss is not None]
        if shard is not None and shard.num_shards > 1:
            aux = [a / shard.num_shards for a in aux]
        terms = ([torch.stack(aux).sum()] if aux else []) + ([self.config.mtp_loss_weight * mtp_loss] if mtp_loss is not None else [])
        if aux:
            metrics["moe_aux_loss"] = terms[0].detach()
        aux_loss = sum(terms[1:], terms[0]) if terms else None
        loss = lm_loss if aux_loss is None else lm_loss + aux_loss
        return CausalLMOutput(loss=loss, logits=logits, cache=out.cache, aux_loss=aux_loss, metrics=metrics)

    def after_optimizer_step(self) -> None:
        """After each optimizer step (the trainer calls this): every MoE updates its balancer, and
        QK-Clip (K2's MuonClip, docs/k3_reference.md §11) caps each MLA head's max logit at ``cfg.qk_clip_tau``."""
        for module in self.modules():
            if isinstance(module, LatentMoE):
                module.after_optimizer_step()
            elif isinstance(module, GatedMLA) and self.config.qk_clip_tau is not None and module.max_logit is not None:
                qk_clip_(module, self.config.qk_clip_tau)
