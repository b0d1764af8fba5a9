"""ModelConfig: presets, the K3 parameter count against the report, HF config reading, loud errors."""

import json

import pytest

from k3lab.backend import resolve_backend, resolve_device
from k3lab.config import ModelConfig
from k3lab.hf.config import from_hf_config
from k3lab.experiments.nb import check_param, check_params

# the K3 text backbone's config.json fields (docs/k3_reference.md §1) in k3lab's earlier style: DeepSeek-style
# expert names and a top-level full_attn_layers (tests/test_hf_config.py reads the release's own file)
K3_HF_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_k3", "vocab_size": 163840,
    "hidden_size": 7168, "num_hidden_layers": 93, "full_attn_layers": list(range(4, 93, 4)) + [93],
    "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                           "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "mla_use_output_gate": True, "n_routed_experts": 896, "num_experts_per_tok": 16, "n_shared_experts": 2,
    "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
    "first_k_dense_replace": 1, "intermediate_size": 33792, "attn_res_block_size": 12,
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "topk_method": "noaux_tc",
}


def test_k3_param_counts_match_report():
    counts = ModelConfig.preset("k3").param_counts()
    assert abs(counts["total"] / 2.78e12 - 1) < 0.005, counts["total"]
    assert abs(counts["active"] / 104.2e9 - 1) < 0.005, counts["active"]
    by = counts["by_component"]
    assert sum(v["total"] for v in by.values()) == counts["total"]
    assert by["embeddings"]["active"] == 0 and by["lm_head"]["active"] == 163840 * 7168
    # 92 MoE layers x 16 of 896 experts x 3 matrices of 3072 x 3584
    assert by["routed_experts"]["active"] == 92 * 16 * 3 * 3072 * 3584
    assert by["routed_experts"]["total"] == 92 * 896 * 3 * 3072 * 3584


def test_k3_schedule():
    cfg = ModelConfig.preset("k3")
    mla = [i for i in range(cfg.num_hidden_layers) if cfg.is_mla_layer(i)]
    assert len(mla) == 24 and mla[-1] == 92 and mla[:2] == [3, 7]
    assert cfg.num_hidden_layers - len(mla) == 69
    assert cfg.mlp_kind_at(0) == "dense" and cfg.mlp_kind_at(1) == "latent_moe"


def test_small_preset_active_range():
    active = ModelConfig.preset("small").param_counts()["active"]
    assert 0.3e9 <= active <= 0.5e9


def test_from_hf_config_dict_and_path(tmp_path):
    cfg = from_hf_config(K3_HF_CONFIG)
    assert cfg.param_counts() == ModelConfig.preset("k3").param_counts()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": K3_HF_CONFIG}))
    assert from_hf_config(path).full_attn_layers[-1] == 93


@pytest.mark.parametrize("changes, field", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(full_attn_layers=[0]), "full_attn_layers"),
    (dict(full_attn_layers=[5]), "full_attn_layers"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(kda_gate="softplus"), "kda_gate"),
    (dict(mlp_kind="mixture"), "mlp_kind"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(linear_attn_config=dict(num_heads=0)), "linear_attn_config.num_heads"),
    (dict(linear_attn_config=dict(gate_lower_bound=1.0)), "gate_lower_bound"),
    (dict(mla_use_nope=False, qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(nonexistent=1), "nonexistent"),
])
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.preset("tiny").replace(**changes)


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset='huge'.*tiny"):
        ModelConfig.preset("huge")


def test_mtp_counted_only_in_total():
    base = ModelConfig.preset("tiny")
    mtp = base.replace(num_nextn_predict_layers=1).param_counts()
    assert mtp["by_component"]["mtp"]["total"] > 0 and mtp["active"] == base.param_counts()["active"]


def test_backend_switch():
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", "cuda") == "triton"
    with pytest.raises(ValueError, match="backend='triton' needs a CUDA"):
        resolve_backend("triton", "cpu")
    with pytest.raises(ValueError, match="allowed values"):
        resolve_backend("cudnn", "cpu")
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="device='tpu'"):
        resolve_device("tpu")


def test_check_param():
    assert check_param("steps", 5, type_=int, min_=1) == 5
    with pytest.raises(ValueError, match="steps"):
        check_param("steps", 0, type_=int, min_=1)
    with pytest.raises(ValueError, match="preset='big'"):
        check_param("preset", "big", choices=("tiny", "small"))
    with pytest.raises(ValueError, match="type int"):
        check_param("steps", True, type_=int)


def test_check_params_names_the_failing_parameter():
    ns = {"steps": 5, "lr": -1.0, "preset": "tiny"}
    check_params(ns, {"steps": dict(type_=int, min_=1), "preset": dict(choices=("tiny", "small"))})
    with pytest.raises(ValueError, match=r"lr=-1.0: must be >= 0"):
        check_params(ns, {"steps": dict(type_=int, min_=1), "lr": dict(type_=float, min_=0.0)})
    with pytest.raises(ValueError, match="'seed' has a rule but is not defined"):
        check_params(ns, {"seed": dict(type_=int)})
