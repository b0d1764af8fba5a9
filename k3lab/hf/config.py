"""Hugging Face ``config.json`` <-> :class:`~k3lab.config.ModelConfig`, for the two families k3lab reads and writes.

**K3** (the release, docs/hf_checkpoint.md, "`config.json`"): the multimodal wrapper ``KimiK3ForConditionalGeneration``
(``model_type`` "kimi_k3") with the text fields under ``text_config``, or that text config alone. It carries
K3's own fields (``routed_expert_hidden_size``, ``attn_res_block_size``, ``activation_situ_beta``, ...).

**Kimi Linear** (``model_type`` "kimi_linear", ``KimiLinearForCausalLM``, K3's ancestor), in either dialect
transformers reads (docs/hf_checkpoint.md, "Kimi Linear"):

* the hub's (Moonshot's own config.json): ``linear_attn_config`` {``num_heads``, ``head_dim``,
  ``short_conv_kernel_size``, ``full_attn_layers``, ``kda_layers`` (1-based)}, ``first_k_dense_replace``,
  ``num_experts``, ``num_experts_per_token``, ``num_shared_experts``, ``moe_renormalize``,
  ``num_expert_group``, ``model_max_length``, ``mla_use_nope``, ``moe_router_activation_func``,
  ``use_grouped_topk``, ``moe_layer_freq``;
* transformers' own (what ``save_pretrained`` writes): ``layer_types`` ("full_attention" /
  "linear_attention" per layer), ``mlp_layer_types`` ("dense" / "sparse"), ``linear_num_heads``,
  ``linear_head_dim``, ``linear_conv_kernel_dim``, ``num_local_experts``, ``n_group``, ``norm_topk_prob``,
  ``max_position_embeddings`` — transformers itself writes some fields under the hub's names.

A field missing from a Kimi Linear config takes transformers' default (:data:`KIMI_LINEAR_DEFAULTS`,
transformers 5.25.0), because that is the model transformers builds from it. Where a field is given under
both names, or the schedule both ways, the two must agree. Where transformers would silently do something
other than what the field says (``mla_use_nope=false``: transformers never rotates; ``moe_layer_freq=2``:
transformers ignores it), the config is refused.

The family is decided from ``model_type`` / ``architectures`` and the fields present, never guessed: the
wrapper makes a K3 config, and so do K3's own fields (:data:`K3_ONLY_KEYS`) in a bare text config, which must
then give every one of them (:data:`K3_TEXT_FIELDS`, as the release's ``text_config`` does); otherwise a
config naming ``kimi_linear`` is Kimi Linear. A K3 field beside a field only transformers' Kimi Linear has,
some of K3's fields without the others (a Kimi Linear config with K3 fields added), a Kimi Linear field
k3lab does not know, or a config naming neither family is a one-line ValueError naming the fields.
A Kimi Linear config always builds Kimi Linear's layers (:data:`KIMI_LINEAR_SHAPE`: its softplus KDA gate,
low-rank output gate, no MLA gate, PreNorm, standard MoE, SwiGLU); overrides may change only
:data:`OVERRIDABLE` (how the model runs, not what it computes).
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

from k3lab.config import ModelConfig
from k3lab.hf.mxfp4 import check_quantization_config

FAMILIES = ("k3", "kimi_linear")
# ModelConfig fields an override may set when reading a config.json: how the model runs and trains, never
# what it computes (a changed kda_gate, say, would load the weights into a different model without an error)
OVERRIDABLE = ("backend", "balancer", "qb_num_bins", "aux_loss_coef", "mtp_loss_weight", "qk_clip_tau")

# --- K3: the released config.json (docs/hf_checkpoint.md, "`config.json`") -----------------------------------
HF_ARCHITECTURE = "KimiK3ForConditionalGeneration"  # the wrapper's architectures[0]
HF_MODEL_TYPE = "kimi_k3"
HF_TEXT_ARCHITECTURE = "KimiLinearForCausalLM"  # text_config.architectures[0]; Kimi Linear's architecture too
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
# fields whose dataclass default is the tiny preset's: a K3 config.json must give them (no silent tiny default)
HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "linear_attn_config", "num_attention_heads",
               "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim", "intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
               "moe_intermediate_size", "routed_expert_hidden_size", "attn_res_block_size",
               "bos_token_id", "eos_token_id", "pad_token_id")
HF_LINEAR_ATTN_REQUIRED = ("num_heads", "head_dim")
# k3lab's own switches: not in the release; to_hf_config writes those that differ from the default
# under text_config["k3lab"], so that every ModelConfig round-trips through the K3 layout
EXPERIMENT_FIELDS = ("kda_gate", "residual", "mlp_kind", "balancer", "qb_num_bins", "aux_loss_coef",
                     "mtp_loss_weight", "qk_clip_tau", "backend")
HF_EXPERIMENT_KEY = "k3lab"
# keys only a K3 config has (a bare text config with one of them is K3, never Kimi Linear)
K3_ONLY_KEYS = ("routed_expert_hidden_size", "attn_res_block_size", "latent_moe_use_norm", "activation_situ_beta",
                "activation_situ_linear_beta", "mla_use_output_gate", HF_EXPERIMENT_KEY)
K3_ONLY_LINEAR_ATTN_KEYS = ("gate_lower_bound", "use_full_rank_gate")
# what a bare K3 text config (no wrapper: it names kimi_linear like Kimi Linear does) gives all of, as the
# release's text_config does: with some of them only, it is a Kimi Linear config with K3 fields added
K3_TEXT_FIELDS = tuple(k for k in K3_ONLY_KEYS if k != HF_EXPERIMENT_KEY) + tuple(
    f"linear_attn_config.{k}" for k in K3_ONLY_LINEAR_ATTN_KEYS)

# --- Kimi Linear (transformers' kimi_linear, 5.25.0) -----------------------------------------------
# transformers' field -> its default: what transformers builds when a config.json leaves the field out
KIMI_LINEAR_DEFAULTS = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": None, "n_shared_experts": 1,
    "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 1048576, "initializer_range": 0.02,
    "rms_norm_eps": 1e-5, "pad_token_id": 163839, "bos_token_id": 163584, "eos_token_id": 163586,
    "tie_word_embeddings": False, "attention_bias": False, "num_local_experts": 256,
    "linear_head_dim": 128, "linear_num_heads": 32, "linear_conv_kernel_dim": 4,
}
# the hub's name -> transformers' (transformers' attribute_map; its save_pretrained writes the hub's names)
KIMI_LINEAR_ALIASES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
                       "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
                       "num_expert_group": "n_group", "model_max_length": "max_position_embeddings"}
# the hub's linear_attn_config key -> transformers' top-level field
KIMI_LINEAR_ATTN_KEYS = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
                         "short_conv_kernel_size": "linear_conv_kernel_dim"}
# fields k3lab builds one value of (transformers' and the hub's): field -> allowed values. Anything else is
# a model transformers does not build as the field says, or k3lab does not build at all.
KIMI_LINEAR_CHECKED = {
    "hidden_act": ("silu",),  # the MLPs' SwiGLU and the KDA short conv's activation
    "attention_bias": (False,),
    "n_group": (1,), "topk_group": (1,),  # one expert group: grouped top-k is plain top-k
    "use_grouped_topk": (True, False), "topk_method": ("noaux_tc",), "moe_layer_freq": (1,),
    "moe_router_activation_func": ("sigmoid",), "mla_use_nope": (True,), "num_nextn_predict_layers": (0,),
}
# read and not used: bookkeeping, training-only or derived fields, and RoPE settings under NoPE (transformers'
# save_pretrained writes rope_parameters, null or {rope_theta, rope_type}, for a config read with rope_scaling)
KIMI_LINEAR_IGNORED = ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "auto_map",
                       "_name_or_path", "use_cache", "output_router_logits", "pretraining_tp", "attention_dropout",
                       "head_dim", "qk_head_dim", "rope_theta", "rope_scaling", "rope_parameters", "return_dict",
                       "output_hidden_states", "output_attentions", "tokenizer_class", "quantization_config")
# keys only transformers' Kimi Linear dialect has (refused inside a K3 config)
KIMI_LINEAR_ONLY_KEYS = ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim",
                         "linear_conv_kernel_dim", "num_local_experts", "n_group", "norm_topk_prob")
LAYER_TYPES = ("full_attention", "linear_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
# ModelConfig fields every Kimi Linear model has (linear_attn_config.use_full_rank_gate: False as well)
KIMI_LINEAR_SHAPE = {"kda_gate": "kimi_linear", "residual": "prenorm", "mlp_kind": "moe", "hidden_act": "swiglu",
                     "mla_use_nope": True, "mla_use_output_gate": False, "num_nextn_predict_layers": 0}
# what transformers' save_pretrained writes besides the model's fields (values k3lab writes too)
KIMI_LINEAR_WRITTEN = {"attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
                       "num_expert_group": 1, "topk_group": 1, "output_router_logits": False, "pretraining_tp": 1,
                       "use_cache": True}


# ----------------------------------------------------------------------------------------------
# public entry points
# ----------------------------------------------------------------------------------------------
def load_json(cfg: dict | str | Path, source: str | None = None) -> tuple[dict, str]:
    """``(parsed config, where)``: ``cfg`` as given when a dict, else the file read (errors name it)."""
    if isinstance(cfg, dict):
        return cfg, source or "config"
    where = source or str(cfg)
    try:
        return json.loads(Path(cfg).read_text()), where
    except FileNotFoundError:
        raise ValueError(f"{where}: no such config file") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err})") from None


def hf_family(cfg: dict, where: str = "config") -> str:
    """"k3" or "kimi_linear" for a parsed config.json, from ``model_type`` / ``architectures`` and the fields
    present (module docstring); a config of another model, or naming neither family, is a ValueError."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: a config must be a JSON object, got {type(cfg).__name__}")
    arch, model_type = cfg.get("architectures"), cfg.get("model_type")
    if "text_config" in cfg or model_type == HF_MODEL_TYPE or (isinstance(arch, list) and HF_ARCHITECTURE in arch):
        return "k3"
    _check_identity(cfg, "", where)
    lac = cfg.get("linear_attn_config")
    lac = lac if isinstance(lac, dict) else {}
    k3_keys = [k for k in K3_ONLY_KEYS if k in cfg] + [f"linear_attn_config.{k}" for k in K3_ONLY_LINEAR_ATTN_KEYS
                                                       if k in lac]
    kl_keys = [k for k in KIMI_LINEAR_ONLY_KEYS if k in cfg]
    if k3_keys and kl_keys:
        raise ValueError(f"{where}: {k3_keys[0]} is a K3 field and {kl_keys[0]} a field of transformers' Kimi Linear "
                         "config; one config.json describes one family (remove the other family's fields)")
    if k3_keys:
        missing = [k for k in K3_TEXT_FIELDS if k not in k3_keys]
        if missing:  # no wrapper: only K3's own fields tell a K3 text config from Kimi Linear, so all of them
            added = ", ".join(k3_keys)
            what = f"{added} is a K3 field" if len(k3_keys) == 1 else f"{added} are K3 fields"
            raise ValueError(f"{where}: {what}, but K3's {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                             "missing: a Kimi Linear config with K3 fields added (a mixed dialect); one config.json "
                             f"describes one family (remove {added} for Kimi Linear, or give every K3 field for K3)")
        return "k3"
    if model_type is None and arch is None:
        raise ValueError(f"{where}: neither model_type nor architectures names the model and no K3 field is present; "
                         f"k3lab does not guess (model_type {HF_TEXT_MODEL_TYPE!r} for Kimi Linear, or K3's fields)")
    return "kimi_linear"


def from_hf_config(cfg: dict | str | Path, *, source: str | None = None, **overrides) -> ModelConfig:
    """Read a K3 or Kimi Linear ``config.json`` (a path, or its parsed dict) exactly; ``overrides`` then set
    fields of :data:`OVERRIDABLE` (e.g. ``backend``).

    K3: the release's wrapper or bare text config; the release's names ``num_experts`` /
    ``num_experts_per_token`` / ``num_shared_experts`` or the dataclass's (given both ways they must agree);
    the schedule as ``linear_attn_config.full_attn_layers`` and/or ``.kda_layers`` (1-based) or a top-level
    ``full_attn_layers``; :data:`HF_CHECKED` keys at the values k3lab builds; :data:`HF_REQUIRED` present;
    keys k3lab does not use listed in one UserWarning. Kimi Linear: either dialect (module docstring), every
    key known. ``quantization_config`` (either family) must be MXFP4 weights
    (:func:`k3lab.hf.mxfp4.check_quantization_config`). Errors are ValueErrors naming the file (``source``,
    default the path) and the field.
    """
    raw, where = load_json(cfg, source)
    family = hf_family(raw, where)
    bad = sorted(set(overrides) - set(OVERRIDABLE))
    if bad:
        raise ValueError(f"{where}: override {bad[0]}: changes the model config.json describes; the fields an "
                         f"override may set are {OVERRIDABLE}")
    if family == "k3":
        kwargs, unused = parse_k3_config(raw, where)
        if unused:
            warnings.warn(f"{where}: keys k3lab does not use, ignored: {unused}", UserWarning, stacklevel=2)
    else:
        kwargs = parse_kimi_linear_config(raw, where)
    try:
        out = ModelConfig(**kwargs)
        return out.replace(**overrides) if overrides else out
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def kimi_linear_mismatches(cfg: ModelConfig) -> list[str]:
    """The fields that keep ``cfg`` from being a Kimi Linear model (empty: it is one), as ``field=value``."""
    out = [f"{k}={getattr(cfg, k)!r} (Kimi Linear: {v!r})" for k, v in KIMI_LINEAR_SHAPE.items() if getattr(cfg, k) != v]
    if cfg.linear_attn_config["use_full_rank_gate"]:
        out.append("linear_attn_config.use_full_rank_gate=True (Kimi Linear: False)")
    return out


def config_family(cfg: ModelConfig) -> str:
    """"kimi_linear" where ``cfg`` is Kimi-Linear-shaped (:func:`kimi_linear_mismatches` empty), else "k3"."""
    return "k3" if kimi_linear_mismatches(cfg) else "kimi_linear"


def to_hf_config(cfg: ModelConfig, family: str | None = None) -> dict:
    """``cfg`` as a ``config.json`` of ``family`` (None: :func:`config_family`). JSON-serialisable.

    "k3": the released wrapper with ``text_config``, the release's names, the schedule in
    ``linear_attn_config``, :data:`HF_CHECKED` at the values k3lab builds, experiment switches that differ
    from their defaults under ``text_config["k3lab"]``; ``from_hf_config(to_hf_config(c, "k3")) == c`` for
    every config, and ``preset("k3")`` gives the release's text-model fields.
    "kimi_linear": the keys transformers' ``KimiLinearConfig.save_pretrained`` writes for the same model
    (transformers' dialect, some fields under the hub's names; no ``dtype``: the checkpoint writer adds it).
    The fields Kimi Linear has no place for (k3lab's runtime switches, K3-only widths) are not written.
    """
    family = config_family(cfg) if family is None else family
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: allowed values are {FAMILIES}")
    if family == "kimi_linear":
        return _to_kimi_linear(cfg)
    L = cfg.num_hidden_layers
    full = list(cfg.full_attn_layers)
    lac = dict(cfg.linear_attn_config, full_attn_layers=full,
               kda_layers=[i for i in range(1, L + 1) if i not in full])
    skip = set(EXPERIMENT_FIELDS) | set(HF_ALIASES.values()) | {"full_attn_layers", "linear_attn_config"}
    text = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    text.update({hf: getattr(cfg, name) for hf, name in HF_ALIASES.items()})
    text.update({key: written for key, (_, written) in HF_CHECKED.items()})
    text.update(architectures=[HF_TEXT_ARCHITECTURE], model_type=HF_TEXT_MODEL_TYPE, linear_attn_config=lac)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    switches = {k: getattr(cfg, k) for k in EXPERIMENT_FIELDS if getattr(cfg, k) != defaults[k]}
    if switches:
        text[HF_EXPERIMENT_KEY] = switches
    return {"architectures": [HF_ARCHITECTURE], "model_type": HF_MODEL_TYPE, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
            "text_config": dict(sorted(text.items())), "tie_word_embeddings": cfg.tie_word_embeddings}


def _to_kimi_linear(cfg: ModelConfig) -> dict:
    wrong = kimi_linear_mismatches(cfg)
    if wrong:
        raise ValueError(f"family='kimi_linear': this config is not a Kimi Linear model: {wrong[0]}"
                         + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    L, lac = cfg.num_hidden_layers, cfg.linear_attn_config
    out = dict(KIMI_LINEAR_WRITTEN)
    out.update(
        architectures=[HF_TEXT_ARCHITECTURE], model_type=HF_TEXT_MODEL_TYPE,
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=L,
        layer_types=[LAYER_TYPES[0] if cfg.is_mla_layer(i) else LAYER_TYPES[1] for i in range(L)],
        mlp_layer_types=[MLP_LAYER_TYPES[0] if i < cfg.first_k_dense_replace else MLP_LAYER_TYPES[1] for i in range(L)],
        linear_num_heads=lac["num_heads"], linear_head_dim=lac["head_dim"],
        linear_conv_kernel_dim=lac["short_conv_kernel_size"],
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        head_dim=cfg.qk_rope_head_dim, qk_head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,  # derived
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.n_routed_experts, num_experts_per_token=cfg.num_experts_per_tok,
        num_shared_experts=cfg.n_shared_experts, moe_renormalize=cfg.moe_renormalize,
        routed_scaling_factor=cfg.routed_scaling_factor, rms_norm_eps=cfg.rms_norm_eps,
        initializer_range=cfg.initializer_range, model_max_length=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------------
# K3
# ----------------------------------------------------------------------------------------------
def _check_identity(cfg: dict, prefix: str, where: str) -> None:
    """``architectures`` / ``model_type`` (where given) must name Kimi K3 or Kimi Linear."""
    arch = cfg.get("architectures")
    if arch is not None and not (isinstance(arch, list) and any(a in HF_ARCHITECTURES for a in arch)):
        raise ValueError(f"{where}: {prefix}architectures={arch!r}: not a Kimi K3 or Kimi Linear config "
                         f"(k3lab reads {list(HF_ARCHITECTURES)})")
    model_type = cfg.get("model_type")
    if model_type is not None and model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{where}: {prefix}model_type={model_type!r}: not a Kimi K3 or Kimi Linear config "
                         f"(k3lab reads {list(HF_MODEL_TYPES)})")


def _layer_list(value, field_name: str, where: str) -> list:
    if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise ValueError(f"{where}: {field_name}={value!r}: must be a list of 1-based layer indices")
    return list(value)


def _check_partition(full: list, kda: list, L: int, full_field: str, kda_field: str, where: str) -> None:
    """``full`` and ``kda`` (1-based) must together list each layer 1..L once."""
    both = sorted(set(kda) & set(full))
    neither = sorted(set(range(1, L + 1)) - set(kda) - set(full))
    outside = sorted(i for i in kda + full if not 1 <= i <= L)
    repeated = sorted(i for i in set(kda + full) if (kda + full).count(i) > 1 and i not in both)
    if both or neither or outside or repeated:
        raise ValueError(f"{where}: {kda_field} contradicts {full_field}: together they must list each layer 1..{L} "
                         f"once (in both: {both}, in neither: {neither}, outside 1..{L}: {outside}, "
                         f"repeated: {repeated})")


def parse_k3_config(cfg: dict, where: str) -> tuple[dict, list[str]]:
    """(ModelConfig keyword arguments, keys k3lab does not use) from a parsed K3 config.json."""
    def fail(msg: str):
        raise ValueError(f"{where}: {msg}")

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
    mixed = [k for k in KIMI_LINEAR_ONLY_KEYS if k in text]
    if mixed:
        fail(f"{prefix}{mixed[0]}: a field of transformers' Kimi Linear config, not of K3 (a K3 config gives the "
             "schedule in linear_attn_config and the MoE under the release's names)")
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
        fail(f"missing field(s) {[prefix + k for k in missing]} (a K3 config gives every one; a Kimi Linear "
             "config has none of K3's latent MoE / AttnRes fields)")

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
        _check_partition(full, kda, L, lac_full, kda_field, where)
    if full is None:
        fail(f"missing field {lac_full} (or .kda_layers): the layer schedule")
    known_lac = {"num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound", "use_full_rank_gate"}
    unused += [f"{prefix}linear_attn_config.{k}" for k in lac if k not in known_lac]
    kwargs = {k: v for k, v in text.items() if k in names and k not in EXPERIMENT_FIELDS}
    unused += [prefix + k for k in text if k not in kwargs and k not in ("architectures", "model_type")]
    kwargs.update(switches, full_attn_layers=full, linear_attn_config={k: v for k, v in lac.items() if k in known_lac})
    return kwargs, unused


# ----------------------------------------------------------------------------------------------
# Kimi Linear
# ----------------------------------------------------------------------------------------------
def parse_kimi_linear_config(cfg: dict, where: str) -> dict:
    """ModelConfig keyword arguments from a parsed Kimi Linear config.json, either dialect (module docstring)."""
    def fail(msg: str):
        raise ValueError(f"{where}: {msg}")

    known = (set(KIMI_LINEAR_DEFAULTS) | set(KIMI_LINEAR_ALIASES) | set(KIMI_LINEAR_CHECKED) | set(KIMI_LINEAR_IGNORED)
             | {"linear_attn_config", "first_k_dense_replace", "layer_types", "mlp_layer_types"})
    unknown = [k for k in cfg if k not in known]
    if unknown:
        fail(f"{unknown[0]}: not a field of a Kimi Linear config (transformers' kimi_linear or the hub's); "
             "k3lab reads every field it builds and refuses the rest")
    text = dict(cfg)
    for hub, name in KIMI_LINEAR_ALIASES.items():
        if hub in text:
            if name in text and text[name] != text[hub]:
                fail(f"{hub}={text[hub]!r} and {name}={text[name]!r} disagree (one field under the hub's and "
                     "transformers' name)")
            text[name] = text.pop(hub)
    lac = text.pop("linear_attn_config", {})
    if not isinstance(lac, dict):
        fail(f"linear_attn_config={lac!r}: must be a JSON object")
    allowed_lac = set(KIMI_LINEAR_ATTN_KEYS) | {"full_attn_layers", "kda_layers"}
    extra = [k for k in lac if k not in allowed_lac]
    if extra:
        fail(f"linear_attn_config.{extra[0]}: not a Kimi Linear field (allowed keys: {sorted(allowed_lac)})")
    for key, name in KIMI_LINEAR_ATTN_KEYS.items():  # transformers: linear_attn_config wins over the top level
        if key in lac:
            text[name] = lac[key]
    for key, allowed in KIMI_LINEAR_CHECKED.items():
        if key in text and (text[key] not in allowed or isinstance(text[key], bool) != isinstance(allowed[0], bool)):
            fail(f"{key}={text[key]!r}: transformers' kimi_linear builds {allowed[0]!r} here and k3lab with it "
                 f"(allowed values: {allowed})")
    quant = text.get("quantization_config")
    if quant is not None:
        check_quantization_config(quant, where)
    v = {k: text.get(k, d) for k, d in KIMI_LINEAR_DEFAULTS.items()}
    L = v["num_hidden_layers"]
    if not (isinstance(L, int) and not isinstance(L, bool) and L >= 1):
        fail(f"num_hidden_layers={L!r}: must be an integer >= 1")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "v_head_dim"):
        if not (isinstance(v[name], int) and not isinstance(v[name], bool)):
            fail(f"{name}={v[name]!r}: k3lab needs one integer here")

    # attention schedule: layer_types > linear_attn_config (both lists) > transformers' default
    from_lac = None
    if "full_attn_layers" in lac or "kda_layers" in lac:
        have = "full_attn_layers" if "full_attn_layers" in lac else "kda_layers"
        other = "kda_layers" if have == "full_attn_layers" else "full_attn_layers"
        if other not in lac:
            fail(f"missing field linear_attn_config.{other}: transformers reads the schedule from linear_attn_config "
                 f"only when both lists are given (with {have} alone it builds its default schedule)")
        full = _layer_list(lac["full_attn_layers"], "linear_attn_config.full_attn_layers", where)
        kda = _layer_list(lac["kda_layers"], "linear_attn_config.kda_layers", where)
        _check_partition(full, kda, L, "linear_attn_config.full_attn_layers", "linear_attn_config.kda_layers", where)
        from_lac = sorted(full)
    if text.get("layer_types") is not None:
        types = text["layer_types"]
        if not (isinstance(types, list) and len(types) == L and all(t in LAYER_TYPES for t in types)):
            fail(f"layer_types={types!r}: must list one of {LAYER_TYPES} for each of the {L} layers")
        full = [i + 1 for i, t in enumerate(types) if t == LAYER_TYPES[0]]
        if from_lac is not None and from_lac != full:
            fail(f"layer_types (full attention at {full}) and linear_attn_config.full_attn_layers={from_lac} disagree")
    elif from_lac is not None:
        full = from_lac
    else:
        full = [i + 1 for i in range(L) if i and i % 4 == 0]  # transformers' default: 0-based layers 4, 8, ...

    # MLP schedule: mlp_layer_types > first_k_dense_replace (default 1)
    first_dense = text.get("first_k_dense_replace")
    if first_dense is not None and not (isinstance(first_dense, int) and not isinstance(first_dense, bool)
                                        and first_dense >= 0):
        fail(f"first_k_dense_replace={first_dense!r}: must be an integer >= 0")
    if text.get("mlp_layer_types") is not None:
        types = text["mlp_layer_types"]
        if not (isinstance(types, list) and len(types) == L and all(t in MLP_LAYER_TYPES for t in types)):
            fail(f"mlp_layer_types={types!r}: must list one of {MLP_LAYER_TYPES} for each of the {L} layers")
        k = types.index("sparse") if "sparse" in types else L
        if "dense" in types[k:]:
            fail(f"mlp_layer_types={types!r}: k3lab builds the dense layers first, then the sparse ones")
        if first_dense is not None and min(first_dense, L) != k:
            fail(f"mlp_layer_types ({k} dense first) and first_k_dense_replace={first_dense} disagree")
    else:
        k = min(1 if first_dense is None else first_dense, L)

    heads = v["num_attention_heads"]
    return dict(
        vocab_size=v["vocab_size"], hidden_size=v["hidden_size"], num_hidden_layers=L, full_attn_layers=full,
        linear_attn_config=dict(num_heads=v["linear_num_heads"], head_dim=v["linear_head_dim"],
                                short_conv_kernel_size=v["linear_conv_kernel_dim"], use_full_rank_gate=False),
        num_attention_heads=heads,
        num_key_value_heads=heads if v["num_key_value_heads"] is None else v["num_key_value_heads"],
        q_lora_rank=v["q_lora_rank"], kv_lora_rank=v["kv_lora_rank"], qk_nope_head_dim=v["qk_nope_head_dim"],
        qk_rope_head_dim=v["qk_rope_head_dim"], v_head_dim=v["v_head_dim"],
        first_k_dense_replace=k, intermediate_size=v["intermediate_size"],
        n_routed_experts=v["num_local_experts"], num_experts_per_tok=v["num_experts_per_tok"],
        n_shared_experts=v["n_shared_experts"], moe_intermediate_size=v["moe_intermediate_size"],
        routed_scaling_factor=v["routed_scaling_factor"], moe_renormalize=v["norm_topk_prob"],
        rms_norm_eps=v["rms_norm_eps"], tie_word_embeddings=v["tie_word_embeddings"],
        initializer_range=v["initializer_range"], max_position_embeddings=v["max_position_embeddings"],
        bos_token_id=v["bos_token_id"], eos_token_id=v["eos_token_id"], pad_token_id=v["pad_token_id"],
        **KIMI_LINEAR_SHAPE,
    )
