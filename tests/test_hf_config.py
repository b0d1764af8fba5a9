"""k3lab.hf.config.from_hf_config / to_hf_config against the released K3 config.json (tests/fixtures/k3_config.json:
the release's text-model fields, verbatim): exact reading, both name styles, the schedule in
linear_attn_config, refused architecture switches, one warning for unused keys, errors naming file and field."""

import copy
import json
import warnings
from pathlib import Path

import pytest

from k3lab.config import ModelConfig
from k3lab.hf.config import HF_CHECKED, from_hf_config, to_hf_config

FIXTURE = Path(__file__).parent / "fixtures" / "k3_config.json"
RELEASE = json.loads(FIXTURE.read_text())
# the release's quantization_config as its model card describes it (the fixture keeps only text-model fields):
# compressed-tensors, MXFP4 weights of Linear modules, group 32, uint8 scales, symmetric, activations unquantized
RELEASE_QUANT = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized", "input_activations": None,
                                  "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                                              "strategy": "group", "dynamic": False, "scale_dtype": "torch.uint8"}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj$",
               "re:vision.*"],
    "kv_cache_scheme": None,
}


def release(**text_changes) -> dict:
    """A deep copy of the released config with text_config fields changed (None deletes a field)."""
    cfg = copy.deepcopy(RELEASE)
    for key, value in text_changes.items():
        if value is None:
            cfg["text_config"].pop(key, None)
        else:
            cfg["text_config"][key] = value
    return cfg


def read_quietly(cfg, **kw) -> ModelConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return from_hf_config(cfg, **kw)


def write(tmp_path, cfg: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_release_config_is_the_k3_preset():
    cfg = read_quietly(FIXTURE)  # no warning: every key of the release is read or checked
    assert cfg == ModelConfig.preset("k3")
    text = RELEASE["text_config"]
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (
        text["num_experts"], text["num_experts_per_token"], text["num_shared_experts"])
    lac = text["linear_attn_config"]
    mla = [i for i in range(cfg.num_hidden_layers) if cfg.is_mla_layer(i)]
    assert mla == [i - 1 for i in lac["full_attn_layers"]]  # 1-based in the file, 0-based in is_mla_layer
    assert [i for i in range(cfg.num_hidden_layers) if not cfg.is_mla_layer(i)] == [i - 1 for i in lac["kda_layers"]]
    counts = cfg.param_counts()  # the report: 2.78T total, 104.2B activated
    assert abs(counts["total"] / 2.78e12 - 1) < 5e-4 and abs(counts["active"] / 104.2e9 - 1) < 5e-4


def test_to_hf_config_writes_the_release_back():
    out = to_hf_config(ModelConfig.preset("k3"), "k3")
    assert json.loads(json.dumps(out)) == RELEASE  # every key and value, release names, schedule in linear_attn_config


@pytest.mark.parametrize("cfg", [
    ModelConfig.preset("tiny"), ModelConfig.preset("small"),
    ModelConfig.preset("tiny").replace(residual="prenorm", mlp_kind="moe", qk_clip_tau=None, tie_word_embeddings=True,
                                       full_attn_layers=[1, 3], num_nextn_predict_layers=1, balancer="aux_loss"),
    ModelConfig.preset("tiny").replace(mlp_kind="dense", kda_gate="kimi_linear", full_attn_layers=[], backend="torch"),
], ids=["tiny", "small", "switches", "all-kda"])
def test_round_trip_is_exact(cfg, tmp_path):
    back = read_quietly(write(tmp_path, to_hf_config(cfg, "k3")))
    assert back == cfg
    assert to_hf_config(back, "k3") == to_hf_config(cfg, "k3")


def test_both_name_styles():
    text = RELEASE["text_config"]
    deepseek = release(num_experts=None, num_experts_per_token=None, num_shared_experts=None,
                       n_routed_experts=text["num_experts"], num_experts_per_tok=text["num_experts_per_token"],
                       n_shared_experts=text["num_shared_experts"])
    assert read_quietly(deepseek) == ModelConfig.preset("k3")
    assert read_quietly(release(n_routed_experts=text["num_experts"])) == ModelConfig.preset("k3")  # both, agreeing
    with pytest.raises(ValueError, match=r"num_experts=896 and text_config.n_routed_experts=8 disagree"):
        from_hf_config(release(n_routed_experts=8))


def lac_with(**changes) -> dict:
    lac = copy.deepcopy(RELEASE["text_config"]["linear_attn_config"])
    for key, value in changes.items():
        if value is None:
            lac.pop(key)
        else:
            lac[key] = value
    return lac


def test_schedule_from_either_list():
    full = RELEASE["text_config"]["linear_attn_config"]["full_attn_layers"]
    k3 = ModelConfig.preset("k3")
    assert read_quietly(release(linear_attn_config=lac_with(full_attn_layers=None))) == k3  # kda_layers alone
    assert read_quietly(release(linear_attn_config=lac_with(kda_layers=None))) == k3  # full_attn_layers alone
    top = release(linear_attn_config=lac_with(full_attn_layers=None, kda_layers=None), full_attn_layers=full)
    assert read_quietly(top) == k3  # k3lab's earlier top-level field


@pytest.mark.parametrize("lac, match", [
    (dict(kda_layers=[1, 2, 3, 4]), r"kda_layers contradicts text_config.linear_attn_config.full_attn_layers.*in both: \[4\]"),
    (dict(kda_layers=RELEASE["text_config"]["linear_attn_config"]["kda_layers"][1:]),
     r"kda_layers contradicts .*in neither: \[1\]"),
    (dict(full_attn_layers=None, kda_layers=None), r"missing field text_config.linear_attn_config.full_attn_layers"),
    (dict(full_attn_layers="4,8"), r"full_attn_layers='4,8': must be a list"),
])
def test_schedule_errors_name_the_fields(lac, match, tmp_path):
    path = write(tmp_path, release(linear_attn_config=lac_with(**lac)))
    with pytest.raises(ValueError, match=match) as err:
        from_hf_config(path)
    assert str(path) in str(err.value)


def test_schedule_given_twice_must_agree():
    with pytest.raises(ValueError, match=r"text_config.full_attn_layers=\[4\] and text_config.linear_attn_config."
                                         r"full_attn_layers=\[4, 8"):
        from_hf_config(release(full_attn_layers=[4]))


@pytest.mark.parametrize("key, value", [
    ("topk_method", "greedy"), ("use_grouped_topk", "yes"), ("num_expert_group", 8), ("topk_group", 4),
    ("moe_layer_freq", 2), ("moe_router_activation_func", "softmax"),
])
def test_architecture_keys_k3lab_does_not_build_are_refused(key, value, tmp_path):
    assert value not in HF_CHECKED[key][0]
    path = write(tmp_path, release(**{key: value}))
    with pytest.raises(ValueError, match=rf"text_config.{key}={value!r}: k3lab builds") as err:
        from_hf_config(path)
    assert str(path) in str(err.value)


def test_unused_keys_are_listed_in_one_warning():
    cfg = release(attention_dropout=0.0)
    cfg["transformers_version"] = "4.56.0"
    cfg["vision_config"] = {"hidden_size": 1152}
    cfg["text_config"]["linear_attn_config"]["num_value_heads"] = 96
    with pytest.warns(UserWarning) as record:
        out = from_hf_config(cfg)
    assert len(record) == 1
    message = str(record[0].message)
    for key in ("transformers_version", "vision_config", "text_config.attention_dropout",
                "text_config.linear_attn_config.num_value_heads"):
        assert key in message
    assert out == ModelConfig.preset("k3")


def test_other_architectures_are_refused(tmp_path):
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32}
    path = write(tmp_path, llama)
    with pytest.raises(ValueError, match=r"architectures=\['LlamaForCausalLM'\]: not a Kimi K3 or Kimi Linear config") as err:
        from_hf_config(path)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match=r"text_config.model_type='deepseek_v3': not a Kimi K3"):
        from_hf_config(release(model_type="deepseek_v3"))
    # a Kimi-Linear-style text config (no latent MoE, no AttnRes) is not K3: named missing fields
    with pytest.raises(ValueError, match=r"missing field\(s\) \['text_config.routed_expert_hidden_size', "
                                         r"'text_config.attn_res_block_size'\]"):
        from_hf_config(release(routed_expert_hidden_size=None, attn_res_block_size=None))
    with pytest.raises(ValueError, match=r"hidden_act='silu': allowed values are"):
        from_hf_config(release(hidden_act="silu"))


def test_quantization_config_checked():
    cfg = release()
    cfg["quantization_config"] = RELEASE_QUANT
    assert read_quietly(cfg) == ModelConfig.preset("k3")
    bad = [
        (("quant_method",), "fp8", r"quantization_config.quant_method='fp8'"),
        (("format",), "nvfp4-pack-quantized", r"quantization_config.format='nvfp4-pack-quantized'"),
        (("config_groups", "group_0", "format"), "pack-quantized", r"config_groups.group_0.format='pack-quantized'"),
        (("config_groups", "group_0", "weights", "group_size"), 16, r"weights.group_size=16"),
        (("config_groups", "group_0", "weights", "num_bits"), 8, r"weights.num_bits=8"),
        (("config_groups", "group_0", "weights", "symmetric"), False, r"weights.symmetric=False"),
        (("config_groups", "group_0", "input_activations"), {"num_bits": 4, "type": "float", "group_size": 32},
         r"config_groups.group_0.input_activations="),
        (("kv_cache_scheme",), {"num_bits": 8}, r"quantization_config.kv_cache_scheme="),
    ]
    for keys, value, match in bad:
        qc = copy.deepcopy(RELEASE_QUANT)
        node = qc
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        cfg["quantization_config"] = qc
        with pytest.raises(ValueError, match=match):
            from_hf_config(cfg, source="ckpt/config.json")


def test_missing_file_bad_json_and_missing_field(tmp_path):
    with pytest.raises(ValueError, match=r"nope.json: no such config file"):
        from_hf_config(tmp_path / "nope.json")
    (tmp_path / "broken.json").write_text("{\"text_config\": ")
    with pytest.raises(ValueError, match=r"broken.json: not valid JSON"):
        from_hf_config(tmp_path / "broken.json")
    with pytest.raises(ValueError, match=r"config.json: missing field\(s\) \['text_config.hidden_size'\]"):
        from_hf_config(write(tmp_path, release(hidden_size=None)))
    with pytest.raises(ValueError, match=r"pad_token_id=0 and text_config.pad_token_id=163839 disagree"):
        from_hf_config(dict(release(), pad_token_id=0))
    with pytest.raises(ValueError, match=r"config.json: num_experts_per_tok=897: top-k must be <= n_routed_experts"):
        from_hf_config(write(tmp_path, release(num_experts_per_token=897)))


def test_overrides_and_experiment_switches():
    cfg = from_hf_config(release(), backend="torch", balancer="loss_free")
    assert (cfg.backend, cfg.balancer) == ("torch", "loss_free")
    with pytest.raises(ValueError, match=r"text_config.k3lab=\{'depth': 3\}"):
        from_hf_config(release(k3lab={"depth": 3}))
