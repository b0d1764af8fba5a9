"""Model configuration: every Kimi K3 field under its Hugging Face `config.json` name.

Presets (`ModelConfig.preset(name)`):
  "k3"    the published K3 config (docs/k3_reference.md §1): 93 layers, d=7168, 2.78T total / 104.2B active.
          Build it only on the meta device.
  "small" one GPU, ~0.4B active parameters: the same architecture, narrower and shallower.
  "tiny"  CPU notebooks and tests: a few seconds per training step on 2 cores.

Besides the checkpoint fields there are experiment switches (not in K3's config.json):
kda_gate, residual, mlp_kind, balancer, qb_num_bins, aux_loss_coef, mtp_loss_weight, qk_clip_tau, backend.
`mla_use_nope=False` turns RoPE on in MLA for the NoPE-vs-RoPE experiment.

Kimi Linear (K3's ancestor) is the same dataclass with its variants switched on: ``q_lora_rank=None``
(plain ``q_proj``), ``linear_attn_config["use_full_rank_gate"]=False`` (low-rank KDA output gate),
``kda_gate="kimi_linear"``, ``mla_use_output_gate=False``, ``residual="prenorm"``, ``mlp_kind="moe"``,
``hidden_act="swiglu"``.

Plain data: this module imports nothing else from k3lab. Reading and writing Hugging Face ``config.json``
files (K3's release and both Kimi Linear dialects) lives in :mod:`k3lab.hf.config` (docs/hf_checkpoint.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
    q_lora_rank: int | None = 48  # query latent width (K3: 1536); None = plain q_proj (Kimi-Linear-48B)
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

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size", "n_routed_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "routed_expert_hidden_size",
                     "attn_res_block_size", "qb_num_bins", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name}={v!r}: must be an integer >= 1")
        q = self.q_lora_rank
        need(q is None or (isinstance(q, int) and not isinstance(q, bool) and q >= 1),
             f"q_lora_rank={q!r}: must be an integer >= 1 or None (plain q_proj)")
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
        need(isinstance(lac["use_full_rank_gate"], bool), f"linear_attn_config.use_full_rank_gate="
             f"{lac['use_full_rank_gate']!r}: allowed values are (True, False) (K3's full-rank g_proj / Kimi Linear's "
             "low-rank g_a_proj, g_b_proj)")
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
               + (D * H * K if self.linear_attn_config["use_full_rank_gate"] else D * K + K * H * K)  # g_proj | g_a, g_b
               + K + H * K * D)  # o_norm, o_proj
        ql = self.q_lora_rank
        mla = ((D * Hm * qk if ql is None else D * ql + ql + ql * Hm * qk)  # q_proj | q_a_proj, q_a_layernorm, q_b_proj
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
