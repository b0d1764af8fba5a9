"""Model configuration: every Kimi K3 field under its Hugging Face `config.json` name.

Presets (`ModelConfig.preset(name)`):
  "k3"    the published K3 config (docs/k3_reference.md §1): 93 layers, d=7168, 2.78T total / 104.2B active.
          Build it only on the meta device.
  "small" one GPU, ~0.4B active parameters: the same architecture, narrower and shallower.
  "tiny"  CPU notebooks and tests: a few seconds per training step on 2 cores.

Besides the checkpoint fields there are experiment switches (not in K3's config.json):
kda_gate, residual, mlp_kind, balancer, qb_num_bins, aux_loss_coef, mtp_loss_weight, qk_clip_tau, backend.
`mla_use_nope=False` turns RoPE on in MLA for the NoPE-vs-RoPE experiment.

`from_hf_config` / `to_hf_config` read and write the released `config.json` exactly (docs/hf_checkpoint.md):
the multimodal wrapper (`KimiK3ForConditionalGeneration`, text fields under `text_config`), the release's
names for three fields (`num_experts`, `num_experts_per_token`, `num_shared_experts`; the DeepSeek-style
names of the dataclass are read too) and the layer schedule inside `linear_attn_config`
(`full_attn_layers`, `kda_layers`, 1-based).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from k3lab.mxfp4 import check_quantization_config

# every allowed-value list and shared constant of k3lab is defined here, once, and imported elsewhere
KDA_GATES = ("k3", "kimi_linear")
KDA_GATE_LOWER_BOUND = -5.0  # K3's gate g = −5·σ(·) ∈ (−5, 0) (docs/k3_reference.md §2.1); kernels assume ≥ this
RESIDUALS = ("attnres", "prenorm")
MLP_KINDS = ("latent_moe", "moe", "dense")
BALANCERS = ("quantile_hist", "quantile_exact", "loss_free", "aux_loss", "none")
HIDDEN_ACTS = ("situ", "swiglu")
BACKENDS = ("auto", "torch", "triton", "fla")  # k3lab.backend: where and how an op runs
DEVICES = ("auto", "cpu", "cuda")  # plus "cuda:N" where a device index is accepted
DTYPES = ("float32", "bfloat16")  # a float dtype by name: TrainConfig.dtype, param_dtype, moment_dtype; Muon ns_dtype
RUNNABLE_PRESETS = ("tiny", "small")  # the presets one machine builds and trains (the course, k3lab.parallel.run)
PRESETS = RUNNABLE_PRESETS + ("k3",)  # "k3": the meta device only

# --- the released config.json (docs/hf_checkpoint.md) --------------------------------------------
HF_ARCHITECTURE = "KimiK3ForConditionalGeneration"  # the wrapper's architectures[0]
HF_MODEL_TYPE = "kimi_k3"
HF_TEXT_ARCHITECTURE = "KimiLinearForCausalLM"  # text_config.architectures[0]
HF_TEXT_MODEL_TYPE = "kimi_linear"
HF_ARCHITECTURES = (HF_ARCHITECTURE, HF_TEXT_ARCHITECTURE)
HF_MODEL_TYPES = (HF_MODEL_TYPE, HF_TEXT_MODEL_TYPE)
# release name -> ModelConfig field (the dataclass keeps the DeepSeek-style names; both are read)
HF_ALIASES = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
              "num_shared_experts": "n_shared_experts"}
# keys of the release that k3lab does not store but checks: key -> (values k3lab builds, value written).
# A config asking for anything else is refused, never silently built as something different.
HF_CHECKED = {
    "topk_method": (("noaux_tc",), "noaux_tc"),  # top-k on sigmoid score + correction bias
    "use_grouped_topk": ((True, False), True),  # with one group, grouped top-k is plain top-k
    "num_expert_group": ((1,), 1),
    "topk_group": ((1,), 1),
    "moe_layer_freq": ((1,), 1),  # every layer from first_k_dense_replace on is MoE
    "moe_router_activation_func": (("sigmoid",), "sigmoid"),
}
# the wrapper's keys besides text_config (token ids and tie_word_embeddings must agree with it)
HF_WRAPPER_KEYS = ("architectures", "model_type", "text_config", "bos_token_id", "eos_token_id", "pad_token_id",
                   "tie_word_embeddings", "quantization_config")
# fields whose dataclass default is the tiny preset's: a config.json must give them (no silent tiny default)
HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "linear_attn_config", "num_attention_heads",
               "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim", "intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
               "moe_intermediate_size", "routed_expert_hidden_size", "attn_res_block_size",
               "bos_token_id", "eos_token_id", "pad_token_id")
HF_LINEAR_ATTN_REQUIRED = ("num_heads", "head_dim")
# k3lab's own switches: not in the release; to_hf_config writes those that differ from the default
# under text_config["k3lab"], so that every ModelConfig round-trips
EXPERIMENT_FIELDS = ("kda_gate", "residual", "mlp_kind", "balancer", "qb_num_bins", "aux_loss_coef",
                     "mtp_loss_weight", "qk_clip_tau", "backend")
HF_EXPERIMENT_KEY = "k3lab"


def _default_linear_attn_config() -> dict:
    return dict(num_heads=2, head_dim=32, short_conv_kernel_size=4, gate_lower_bound=KDA_GATE_LOWER_BOUND, use_full_rank_gate=True)


@dataclass
class ModelConfig:
    # --- shape -----------------------------------------------------------------------------
    vocab_size: int = 4096  # tokens (K3: 163840)
    hidden_size: int = 64  # D, the residual width (K3: 7168)
    num_hidden_layers: int = 4  # decoder layers (K3: 93)
    full_attn_layers: list = field(default_factory=lambda: [4])  # 1-based indices of Gated-MLA layers; the rest are KDA
    # --- KDA (docs/k3_reference.md §2) --------------------------------------------------------------------
    linear_attn_config: dict = field(default_factory=_default_linear_attn_config)
    # --- Gated MLA (docs/k3_reference.md §3) -----------------------------------------------------------------
    num_attention_heads: int = 2  # MLA heads H (K3: 96)
    num_key_value_heads: int = 2  # = num_attention_heads: MLA has no GQA
    q_lora_rank: int = 48  # query latent width (K3: 1536)
    kv_lora_rank: int = 32  # cached KV latent c_kv (K3: 512)
    qk_nope_head_dim: int = 16  # per-head q/k part from the latent (K3: 128)
    qk_rope_head_dim: int = 8  # per-head q part / shared k part, NOT rotated under NoPE (K3: 64)
    v_head_dim: int = 16  # per-head value width (K3: 128)
    mla_use_nope: bool = True  # True = no RoPE anywhere (K3); False = RoPE on the rope part (experiment)
    mla_use_output_gate: bool = True  # full-rank sigmoid gate before o_proj
    rope_theta: float = 10000.0  # only used when mla_use_nope is False
    # --- MLP / MoE (docs/k3_reference.md §5, §6) ---------------------------------------------------------------
    first_k_dense_replace: int = 1  # layers [0, k) use the dense SiTU MLP
    intermediate_size: int = 128  # dense MLP hidden width (K3: 33792)
    n_routed_experts: int = 8  # E (K3: 896)
    num_experts_per_tok: int = 2  # top-k (K3: 16)
    n_shared_experts: int = 1  # shared experts, fused as one MLP of width n_shared * moe_intermediate_size (K3: 2)
    moe_intermediate_size: int = 64  # expert hidden width I (K3: 3072)
    routed_expert_hidden_size: int = 32  # latent width L of routed experts (K3: 3584 = D/2)
    latent_moe_use_norm: bool = True  # RMSNorm before W_up ("normalized LatentMoE")
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    hidden_act: str = "situ"  # "situ" (K3) or "swiglu" (comparison)
    activation_situ_beta: float = 4.0  # beta_1 on the gate branch
    activation_situ_linear_beta: float = 25.0  # beta_2 on the up branch
    # --- residual stream (docs/k3_reference.md §1.1, §4) -------------------------------------------------------
    attn_res_block_size: int = 2  # decoder layers per AttnRes block (K3: 12)
    rms_norm_eps: float = 1e-5
    # --- heads, MTP, misc ----------------------------------------------------------------------------
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP depth (K3 report: 1; released config: 0)
    initializer_range: float = 0.02
    max_position_embeddings: int = 4096  # trained context (K3: 1048576); the model has no position table (NoPE)
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    # --- experiment switches (not in K3's config.json) ---------------------------------------------
    kda_gate: str = "k3"  # "k3": g = -5*sigmoid(e^A z); "kimi_linear": g = -e^A softplus(z)
    residual: str = "attnres"  # "attnres" (block AttnRes) or "prenorm" (plain residual)
    mlp_kind: str = "latent_moe"  # MLP of layers >= first_k_dense_replace
    balancer: str = "quantile_hist"  # MoE bias balancer
    qb_num_bins: int = 1000  # histogram bins of the QB estimator
    aux_loss_coef: float = 1e-2  # only used by balancer="aux_loss"
    mtp_loss_weight: float = 0.3  # lambda of the MTP loss
    qk_clip_tau: float | None = 100.0  # QK-Clip threshold on MLA max logits after each step (K2: 100); None = off
    backend: str = "auto"  # "auto" | "torch" | "triton" | "fla"

    def __post_init__(self):
        self.full_attn_layers = list(self.full_attn_layers)
        lac = _default_linear_attn_config()
        lac.update(self.linear_attn_config or {})
        self.linear_attn_config = lac
        self.validate()

    # ------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed values."""

        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size", "n_routed_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "routed_expert_hidden_size",
                     "attn_res_block_size", "qb_num_bins", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name}={v!r}: must be an integer >= 1")
        for name in ("qk_rope_head_dim", "first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"{name}={v!r}: must be an integer >= 0")
        L = self.num_hidden_layers
        need(all(isinstance(i, int) and 1 <= i <= L for i in self.full_attn_layers),
             f"full_attn_layers={self.full_attn_layers}: each entry must be a 1-based layer index in [1, {L}]")
        need(len(set(self.full_attn_layers)) == len(self.full_attn_layers),
             f"full_attn_layers={self.full_attn_layers}: duplicate layer indices")
        need(self.first_k_dense_replace <= L, f"first_k_dense_replace={self.first_k_dense_replace}: must be in [0, {L}]")
        need(self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok={self.num_experts_per_tok}: top-k must be <= n_routed_experts={self.n_routed_experts}")
        need(self.num_key_value_heads == self.num_attention_heads,
             f"num_key_value_heads={self.num_key_value_heads}: MLA has no GQA, must equal "
             f"num_attention_heads={self.num_attention_heads}")
        need(self.num_nextn_predict_layers in (0, 1), f"num_nextn_predict_layers={self.num_nextn_predict_layers}: allowed values are (0, 1)")
        need(self.mla_use_nope or (self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0),
             f"qk_rope_head_dim={self.qk_rope_head_dim}: RoPE (mla_use_nope=False) needs an even value > 0")
        lac = self.linear_attn_config
        allowed_lac = {"num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound", "use_full_rank_gate"}
        need(set(lac) <= allowed_lac, f"linear_attn_config keys {sorted(set(lac) - allowed_lac)}: allowed keys are {sorted(allowed_lac)}")
        for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
            need(isinstance(lac[key], int) and lac[key] >= 1, f"linear_attn_config.{key}={lac[key]!r}: must be an integer >= 1")
        need(lac["gate_lower_bound"] < 0, f"linear_attn_config.gate_lower_bound={lac['gate_lower_bound']}: must be < 0 (K3: {KDA_GATE_LOWER_BOUND})")
        need(lac["use_full_rank_gate"] is True, "linear_attn_config.use_full_rank_gate: only the K3 full-rank gate (True) is built")
        for name, allowed in (("kda_gate", KDA_GATES), ("residual", RESIDUALS), ("mlp_kind", MLP_KINDS),
                              ("balancer", BALANCERS), ("hidden_act", HIDDEN_ACTS), ("backend", BACKENDS)):
            need(getattr(self, name) in allowed, f"{name}={getattr(self, name)!r}: allowed values are {allowed}")
        need(self.activation_situ_beta > 0 and self.activation_situ_linear_beta > 0,
             "activation_situ_beta / activation_situ_linear_beta: must be > 0")
        need(self.qk_clip_tau is None or self.qk_clip_tau > 0, f"qk_clip_tau={self.qk_clip_tau!r}: must be > 0 or None (off)")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            need(0 <= v < self.vocab_size, f"{name}={v}: must be in [0, vocab_size={self.vocab_size})")

    # ------------------------------------------------------------------------------------------
    @property
    def kda_heads(self) -> int:
        return self.linear_attn_config["num_heads"]

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config["head_dim"]

    def is_mla_layer(self, i: int) -> bool:
        """0-based layer index -> True where the layer is Gated MLA (full_attn_layers is 1-based)."""
        return (i + 1) in self.full_attn_layers

    def mlp_kind_at(self, i: int) -> str:
        """"dense" for the first `first_k_dense_replace` layers, else `mlp_kind`."""
        return "dense" if i < self.first_k_dense_replace else self.mlp_kind

    def replace(self, **changes) -> "ModelConfig":
        """A validated copy with some fields changed (unknown field names raise ValueError)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; allowed fields are {sorted(names)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"preset={name!r}: allowed values are {PRESETS}")
        if name == "tiny":
            return cls()
        if name == "small":
            return cls(
                vocab_size=4096, hidden_size=1024, num_hidden_layers=16, full_attn_layers=[4, 8, 12, 16],
                linear_attn_config=dict(num_heads=8, head_dim=128),
                num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=256,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                first_k_dense_replace=1, intermediate_size=4096,
                n_routed_experts=64, num_experts_per_tok=8, n_shared_experts=1,
                moe_intermediate_size=1024, routed_expert_hidden_size=512, attn_res_block_size=4,
            )
        return cls(  # "k3": the published config (docs/k3_reference.md §1)
            vocab_size=163840, hidden_size=7168, num_hidden_layers=93,
            full_attn_layers=list(range(4, 93, 4)) + [93],
            linear_attn_config=dict(num_heads=96, head_dim=128, short_conv_kernel_size=4,
                                    gate_lower_bound=KDA_GATE_LOWER_BOUND, use_full_rank_gate=True),
            num_attention_heads=96, num_key_value_heads=96, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            first_k_dense_replace=1, intermediate_size=33792,
            n_routed_experts=896, num_experts_per_tok=16, n_shared_experts=2,
            moe_intermediate_size=3072, routed_expert_hidden_size=3584,
            attn_res_block_size=12, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
            max_position_embeddings=1048576,
        )

    @classmethod
    def from_hf_config(cls, cfg: dict | str | Path, *, source: str | None = None, **overrides) -> "ModelConfig":
        """Read a K3 ``config.json`` (a path, or its parsed dict) exactly; ``overrides`` then replace fields
        (experiment switches such as ``backend``).

        Accepted: the release's wrapper (``architectures`` [KimiK3ForConditionalGeneration], text fields under
        ``text_config``) or a bare text config (KimiLinearForCausalLM); the release's names ``num_experts`` /
        ``num_experts_per_token`` / ``num_shared_experts`` or the dataclass's (given both ways they must agree);
        the schedule as ``linear_attn_config.full_attn_layers`` and/or ``.kda_layers`` (1-based, together a
        partition of 1..num_hidden_layers) or as a top-level ``full_attn_layers``. The keys of
        :data:`HF_CHECKED` must hold what k3lab builds, and ``quantization_config`` must be MXFP4 weights
        (:func:`k3lab.mxfp4.check_quantization_config`). Keys k3lab does not use are listed in one UserWarning.
        The fields of :data:`HF_REQUIRED` must be present. Errors are ValueErrors naming the file
        (``source``, default the path) and the field.
        """
        if isinstance(cfg, dict):
            where = source or "config"
        else:
            where = source or str(cfg)
            try:
                cfg = json.loads(Path(cfg).read_text())
            except FileNotFoundError:
                raise ValueError(f"{where}: no such config file") from None
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err})") from None
        kwargs, unused = _parse_hf_config(cfg, where)
        if unused:
            warnings.warn(f"{where}: keys k3lab does not use, ignored: {unused}", UserWarning, stacklevel=2)
        try:
            out = cls(**kwargs)
            return out.replace(**overrides) if overrides else out
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    def to_hf_config(self) -> dict:
        """This config as the released ``config.json``: the wrapper with ``text_config``, the release's names,
        the schedule in ``linear_attn_config`` (``full_attn_layers`` and ``kda_layers``, 1-based), the
        :data:`HF_CHECKED` keys at the values k3lab builds; experiment switches that differ from their
        defaults under ``text_config["k3lab"]``. ``from_hf_config(to_hf_config()) == self`` for every config;
        ``preset("k3").to_hf_config()`` equals the release's text-model fields. JSON-serialisable."""
        L = self.num_hidden_layers
        full = list(self.full_attn_layers)
        lac = dict(self.linear_attn_config, full_attn_layers=full,
                   kda_layers=[i for i in range(1, L + 1) if i not in full])
        skip = set(EXPERIMENT_FIELDS) | set(HF_ALIASES.values()) | {"full_attn_layers", "linear_attn_config"}
        text = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        text.update({hf: getattr(self, name) for hf, name in HF_ALIASES.items()})
        text.update({key: written for key, (_, written) in HF_CHECKED.items()})
        text.update(architectures=[HF_TEXT_ARCHITECTURE], model_type=HF_TEXT_MODEL_TYPE, linear_attn_config=lac)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        switches = {k: getattr(self, k) for k in EXPERIMENT_FIELDS if getattr(self, k) != defaults[k]}
        if switches:
            text[HF_EXPERIMENT_KEY] = switches
        return {"architectures": [HF_ARCHITECTURE], "model_type": HF_MODEL_TYPE, "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
                "text_config": dict(sorted(text.items())), "tie_word_embeddings": self.tie_word_embeddings}

    # ------------------------------------------------------------------------------------------
    def param_counts(self) -> dict:
        """Parameters by component, total and active per token.

        Counted: every weight of the text backbone as the HF checkpoint names it (docs/k3_reference.md §1.2),
        including the router's `e_score_correction_bias` (stored, never trained), norm weights and
        AttnRes pseudo-queries; the MTP module when `num_nextn_predict_layers` = 1.
        Active per token: everything a token's forward pass multiplies with — all attention, the
        dense MLP, shared experts, the whole router, the latent projections and norm, top-k of the
        routed experts, norms/AttnRes, and the LM head; NOT the input embedding (a table lookup)
        and NOT the MTP module (a training-time head). This is the report's convention
        (2.78T total, 104.2B activated).
        Returns {"total": int, "active": int, "by_component": {name: {"total": n, "active": n}}}.
        """
        D, V = self.hidden_size, self.vocab_size
        H, K, W = self.kda_heads, self.kda_head_dim, self.linear_attn_config["short_conv_kernel_size"]
        Hm = self.num_attention_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        E, I, Lw, top = self.n_routed_experts, self.moe_intermediate_size, self.routed_expert_hidden_size, self.num_experts_per_tok
        latent = self.mlp_kind == "latent_moe"
        e_in = Lw if latent else D  # width the routed experts work in

        kda = (3 * D * H * K  # q_proj, k_proj, v_proj
               + 3 * H * K * W  # q/k/v short convs
               + D * K + K * H * K + H * K + H  # f_a_proj, f_b_proj, dt_bias, A_log
               + D * H  # b_proj
               + D * H * K + K + H * K * D)  # g_proj, o_norm, o_proj
        mla = (D * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * Hm * qk  # q_a_proj, q_a_layernorm, q_b_proj
               + D * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
               + self.kv_lora_rank * Hm * (self.qk_nope_head_dim + self.v_head_dim)  # kv_b_proj
               + (D * Hm * self.v_head_dim if self.mla_use_output_gate else 0)  # g_proj
               + Hm * self.v_head_dim * D)  # o_proj
        dense_mlp = 3 * D * self.intermediate_size
        expert = 3 * e_in * I
        shared = 3 * D * self.n_shared_experts * I
        router = E * D + E  # gate.weight + e_score_correction_bias
        latent_proj = (2 * D * Lw + (Lw if self.latent_moe_use_norm else 0)) if latent else 0
        norms_per_layer = 2 * D + (4 * D if self.residual == "attnres" else 0)  # 2 pre-norms (+ 2 AttnRes norm/proj pairs)
        out_norms = D + (2 * D if self.residual == "attnres" else 0)  # model.norm (+ output AttnRes)

        comp = {k: [0, 0] for k in ("embeddings", "lm_head", "kda", "mla", "dense_mlp", "routed_experts",
                                    "shared_experts", "router", "latent_projections", "norms_attnres", "mtp")}

        def add(name, total, active):
            comp[name][0] += total
            comp[name][1] += active

        add("embeddings", V * D, 0)
        if not self.tie_word_embeddings:
            add("lm_head", V * D, V * D)
        else:
            comp["lm_head"][1] += V * D  # tied: the head's multiply is active, its weights are the embedding's
        moe_layer_total = moe_layer_active = 0
        for i in range(self.num_hidden_layers):
            (add("mla", mla, mla) if self.is_mla_layer(i) else add("kda", kda, kda))
            add("norms_attnres", norms_per_layer, norms_per_layer)
            if self.mlp_kind_at(i) == "dense":
                add("dense_mlp", dense_mlp, dense_mlp)
            else:
                add("routed_experts", E * expert, top * expert)
                add("shared_experts", shared, shared)
                add("router", router, router)
                add("latent_projections", latent_proj, latent_proj)
        add("norms_attnres", out_norms, out_norms)
        if self.num_nextn_predict_layers:
            last = self.num_hidden_layers - 1
            mlp = dense_mlp if self.mlp_kind_at(last) == "dense" else E * expert + shared + router + latent_proj
            add("mtp", 2 * D + 2 * D * D + mla + 2 * D + mlp + D, 0)  # enorm, hnorm, eh_proj, block, final norm
        by = {k: {"total": t, "active": a} for k, (t, a) in comp.items()}
        return {"total": sum(t for t, _ in comp.values()), "active": sum(a for _, a in comp.values()), "by_component": by}


# ----------------------------------------------------------------------------------------------
# config.json parsing (ModelConfig.from_hf_config)
# ----------------------------------------------------------------------------------------------
def _check_identity(cfg: dict, prefix: str, where: str) -> None:
    """``architectures`` / ``model_type`` (where given) must name Kimi K3."""
    arch = cfg.get("architectures")
    if arch is not None and not (isinstance(arch, list) and any(a in HF_ARCHITECTURES for a in arch)):
        raise ValueError(f"{where}: {prefix}architectures={arch!r}: not a Kimi K3 config "
                         f"(k3lab reads {list(HF_ARCHITECTURES)})")
    model_type = cfg.get("model_type")
    if model_type is not None and model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{where}: {prefix}model_type={model_type!r}: not a Kimi K3 config "
                         f"(k3lab reads {list(HF_MODEL_TYPES)})")


def _layer_list(value, field_name: str, where: str) -> list:
    if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise ValueError(f"{where}: {field_name}={value!r}: must be a list of 1-based layer indices")
    return list(value)


def _parse_hf_config(cfg: dict, where: str) -> tuple[dict, list[str]]:
    """(ModelConfig keyword arguments, keys k3lab does not use) from a parsed config.json."""
    def fail(msg: str):
        raise ValueError(f"{where}: {msg}")

    if not isinstance(cfg, dict):
        fail(f"a config must be a JSON object, got {type(cfg).__name__}")
    unused: list[str] = []
    quant = cfg.get("quantization_config")
    if "text_config" in cfg:  # the release's multimodal wrapper
        _check_identity(cfg, "", where)
        text, prefix = cfg["text_config"], "text_config."
        if not isinstance(text, dict):
            fail(f"text_config must be a JSON object, got {type(text).__name__}")
        text = dict(text)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if key in cfg:
                if key in text and text[key] != cfg[key]:
                    fail(f"{key}={cfg[key]!r} and text_config.{key}={text[key]!r} disagree")
                text[key] = cfg[key]
        if "quantization_config" in text and quant is not None:
            fail("quantization_config is given both at the top level and in text_config")
        unused += [k for k in cfg if k not in HF_WRAPPER_KEYS]  # vision_config, transformers_version, ...
    else:
        text, prefix = dict(cfg), ""
    _check_identity(text, prefix, where)
    quant = text.pop("quantization_config", quant)
    if quant is not None:
        check_quantization_config(quant, where)

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for hf, name in HF_ALIASES.items():  # the release's name and the dataclass's name of one field
        if hf in text:
            if name in text and text[name] != text[hf]:
                fail(f"{prefix}{hf}={text[hf]!r} and {prefix}{name}={text[name]!r} disagree "
                     "(one field under the release's and the DeepSeek-style name)")
            text[name] = text.pop(hf)
    for key, (allowed, _) in HF_CHECKED.items():
        value = text.pop(key, allowed[0])
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            fail(f"{prefix}{key}={value!r}: k3lab builds {allowed[0]!r} only (allowed values: {allowed})")
    switches = text.pop(HF_EXPERIMENT_KEY, {})
    if not isinstance(switches, dict) or set(switches) - set(EXPERIMENT_FIELDS):
        fail(f"{prefix}{HF_EXPERIMENT_KEY}={switches!r}: k3lab's switches are a dict with keys from {EXPERIMENT_FIELDS}")
    missing = [k for k in HF_REQUIRED if k not in text]
    if missing:
        fail(f"missing field(s) {[prefix + k for k in missing]} (a K3 config gives every one; Kimi Linear or "
             "DeepSeek configs without the latent MoE / AttnRes fields are not K3)")

    lac = text.pop("linear_attn_config")
    if not isinstance(lac, dict):
        fail(f"{prefix}linear_attn_config={lac!r}: must be a JSON object")
    lac = dict(lac)
    missing = [k for k in HF_LINEAR_ATTN_REQUIRED if k not in lac]
    if missing:
        fail(f"missing field(s) {[prefix + 'linear_attn_config.' + k for k in missing]}")
    L = text["num_hidden_layers"]
    if not isinstance(L, int) or L < 1:
        fail(f"{prefix}num_hidden_layers={L!r}: must be an integer >= 1")
    lac_full = f"{prefix}linear_attn_config.full_attn_layers"
    full = _layer_list(lac.pop("full_attn_layers"), lac_full, where) if "full_attn_layers" in lac else None
    if "full_attn_layers" in text:
        top = _layer_list(text.pop("full_attn_layers"), f"{prefix}full_attn_layers", where)
        if full is not None and full != top:
            fail(f"{prefix}full_attn_layers={top} and {lac_full}={full} disagree")
        full = top
    if "kda_layers" in lac:
        kda_field = f"{prefix}linear_attn_config.kda_layers"
        kda = _layer_list(lac.pop("kda_layers"), kda_field, where)
        if full is None:
            full = [i for i in range(1, L + 1) if i not in kda]
        both = sorted(set(kda) & set(full))
        neither = sorted(set(range(1, L + 1)) - set(kda) - set(full))
        outside = sorted(i for i in kda if not 1 <= i <= L)
        if both or neither or outside or len(set(kda)) != len(kda):
            fail(f"{kda_field} contradicts {lac_full}: together they must list each layer 1..{L} once "
                 f"(in both: {both}, in neither: {neither}, outside 1..{L}: {outside}, "
                 f"repeated: {sorted(i for i in set(kda) if kda.count(i) > 1)})")
    if full is None:
        fail(f"missing field {lac_full} (or .kda_layers): the layer schedule")
    known_lac = set(_default_linear_attn_config())
    unused += [f"{prefix}linear_attn_config.{k}" for k in lac if k not in known_lac]
    kwargs = {k: v for k, v in text.items() if k in names and k not in EXPERIMENT_FIELDS}
    unused += [prefix + k for k in text if k not in kwargs and k not in ("architectures", "model_type")]
    kwargs.update(switches, full_attn_layers=full, linear_attn_config={k: v for k, v in lac.items() if k in known_lac})
    return kwargs, unused
