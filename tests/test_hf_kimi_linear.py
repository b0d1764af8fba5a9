"""Kimi Linear in and out, against transformers itself (its ``kimi_linear``, plain-PyTorch KDA on CPU).

Tiny random-init ``KimiLinearForCausalLM`` models are built here (never downloaded) and saved with
``save_pretrained``; k3lab reads them (config in either dialect, weights sharded or not, fp32 or bf16) and
must give transformers' logits to 1e-5 relative in fp32; k3lab writes Kimi-Linear-shaped models that
``AutoModelForCausalLM.from_pretrained`` loads with no missing or unexpected key, to the same logits. A
mismatch names the first sublayer where the two models part (:mod:`k3lab.hf.compare`). The edges transformers
runs are read to the same logits: a config transformers has loaded and saved again (``rope_parameters``),
``tie_word_embeddings`` both ways, every expert on every token (top-k = experts). Planted faults
(wrong gate, a missing, extra or wrongly shaped tensor, mixed or unknown config fields) are loud. Both of
transformers' save formats are read and written: the original (``save_pretrained``'s default) and the internal
one (``save_original_format=False``: fused ``conv1d`` and ``experts.gate_up_proj``, split exactly on load).
"""
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from transformers import AutoModelForCausalLM, KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402  (pinned: never skipped)

from k3lab.config import ModelConfig  # noqa: E402
from k3lab.hf.checkpoint import INDEX_FILE, SINGLE_FILE, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from k3lab.hf.compare import compare_with_transformers  # noqa: E402
from k3lab.hf.config import from_hf_config, kimi_linear_mismatches, to_hf_config  # noqa: E402
from k3lab.model import K3ForCausalLM  # noqa: E402

TOL = 1e-5  # relative, fp32 on CPU
VOCAB = 96
# 5 layers: KDA, KDA, MLA, KDA, MLA; layer 0 dense, the rest MoE (4 experts, top-2, one shared)
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=5,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8,
            qk_nope_head_dim=8, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, linear_head_dim=8,
            linear_num_heads=2, linear_conv_kernel_dim=4, routed_scaling_factor=2.446, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                         "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])
IDS = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(0))  # 70 tokens: two KDA chunks


def hub_dialect(cfg: dict) -> dict:
    """A transformers-written config.json rewritten in the hub's dialect (Moonshot's own config.json)."""
    out = {k: v for k, v in cfg.items() if k not in ("layer_types", "mlp_layer_types", "linear_num_heads",
                                                       "linear_head_dim", "linear_conv_kernel_dim")}
    L = cfg["num_hidden_layers"]
    out["linear_attn_config"] = {
        "num_heads": cfg["linear_num_heads"], "head_dim": cfg["linear_head_dim"],
        "short_conv_kernel_size": cfg["linear_conv_kernel_dim"],
        "full_attn_layers": [i + 1 for i in range(L) if cfg["layer_types"][i] == "full_attention"],
        "kda_layers": [i + 1 for i in range(L) if cfg["layer_types"][i] == "linear_attention"]}
    out.update(first_k_dense_replace=cfg["mlp_layer_types"].count("dense"), mla_use_nope=True, moe_layer_freq=1,
               moe_router_activation_func="sigmoid", use_grouped_topk=True, num_nextn_predict_layers=0)
    return out


def transformers_model(q_lora_rank, seed: int = 0, **changes) -> KimiLinearForCausalLM:
    """A random-init transformers model; norms, the router bias and dt_bias perturbed so a tensor left at its
    init or loaded into the wrong place shows."""
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**dict(TINY, q_lora_rank=q_lora_rank, **changes))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.05)
    return model


def save(model: KimiLinearForCausalLM, path: Path, **kw) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path, **kw)
    return path


def load_transformers(path: Path) -> KimiLinearForCausalLM:
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True,
                                                        local_files_only=True)  # a local folder: never the hub
    assert info["missing_keys"] == set() or not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    return model.eval()


def assert_same_logits(ours: K3ForCausalLM, theirs: KimiLinearForCausalLM) -> float:
    """Logits within TOL; on failure the message names the first sublayer that parts and lists them all."""
    cmp = compare_with_transformers(ours.eval(), theirs.eval(), IDS)
    assert cmp.max_rel <= TOL, f"first sublayer over {TOL}: {cmp.first_over(TOL)}\n{cmp.table()}"
    return cmp.max_rel


def rewrite_config(path: Path, change) -> None:
    file = path / "config.json"
    file.write_text(json.dumps(change(json.loads(file.read_text()))))


def tensors(path: Path) -> dict:
    return load_file(str(path / SINGLE_FILE))


# ----------------------------------------------------------------------------------------------
# transformers -> k3lab
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("dialect", ["transformers", "hub"])
def test_transformers_checkpoint_reads_to_the_same_logits(q_lora_rank, dialect, tmp_path):
    theirs = transformers_model(q_lora_rank)
    path = save(theirs, tmp_path / "kl")
    if dialect == "hub":
        rewrite_config(path, hub_dialect)
        # the hub's config builds the same model in transformers itself
        again = load_transformers(path)
        assert torch.equal(again(input_ids=IDS).logits, theirs(input_ids=IDS).logits)
    cfg = from_hf_config(path / "config.json")
    assert kimi_linear_mismatches(cfg) == [] and cfg.kda_gate == "kimi_linear"
    assert cfg.q_lora_rank == q_lora_rank and cfg.full_attn_layers == [3, 5] and cfg.first_k_dense_replace == 1
    ours = load_hf_checkpoint(path, dtype=torch.float32, progress=False).model
    assert not [n for n, p in ours.named_parameters() if p.is_meta]
    assert_same_logits(ours, theirs)


def test_sharded_bf16_checkpoint(tmp_path):
    theirs = transformers_model(None, seed=1).to(torch.bfloat16)
    path = save(theirs, tmp_path / "kl", max_shard_size="20KB")
    assert (path / INDEX_FILE).is_file() and len(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())) > 2
    loaded = load_hf_checkpoint(path, dtype=torch.float32, progress=False)
    ours = loaded.model
    # bf16 values arrive bit-exact: the same tensors as transformers' own fp32 load of the folder
    fp32 = load_transformers(path)
    assert torch.equal(ours.model.layers[0].self_attn.A_log, fp32.model.layers[0].self_attn.forget_gate.A_log.view(-1))
    assert torch.equal(ours.model.layers[1].block_sparse_moe.experts.w2[3], fp32.model.layers[1].mlp.experts.down_proj[3])
    assert_same_logits(ours, fp32)


def test_dense_layer_under_either_name(tmp_path):
    theirs = transformers_model(None)
    path = save(theirs, tmp_path / "kl")
    stored = tensors(path)
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in stored  # transformers' own save
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in stored.items()}
    save_file(renamed, str(path / SINGLE_FILE), metadata={"format": "pt"})
    assert_same_logits(load_hf_checkpoint(path, dtype=torch.float32, progress=False).model, theirs)
    save_file(dict(renamed, **{"model.layers.0.block_sparse_moe.gate_proj.weight":
                               renamed["model.layers.0.mlp.gate_proj.weight"].clone()}), str(path / SINGLE_FILE))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight is stored twice"):
        load_hf_checkpoint(path, progress=False)


# ----------------------------------------------------------------------------------------------
# k3lab -> transformers
# ----------------------------------------------------------------------------------------------
def k3lab_model(q_lora_rank, seed: int = 2, **changes) -> K3ForCausalLM:
    """A k3lab model built from a Kimi Linear config (``changes``: its fields), every parameter random."""
    raw = dict(TINY, model_type="kimi_linear", q_lora_rank=q_lora_rank, **changes)
    torch.manual_seed(seed)
    model = K3ForCausalLM(from_hf_config(raw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name or "bias" in name else 0.1) + ("norm" in name))
    return model


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q_proj", "q_lora"])
def test_k3lab_writes_what_transformers_reads(q_lora_rank, tmp_path):
    ours = k3lab_model(q_lora_rank)
    path = save_hf_checkpoint(ours, tmp_path / "ours", dtype=torch.float32, progress=False)
    theirs = load_transformers(path)  # no missing, unexpected or mismatched key
    assert_same_logits(ours, theirs)
    # exactly what transformers writes for the same model: config.json keys and values, tensor names and shapes
    again = save(theirs, tmp_path / "theirs")
    ours_cfg, their_cfg = (json.loads((p / "config.json").read_text()) for p in (path, again))
    assert ours_cfg == {k: v for k, v in their_cfg.items() if k != "transformers_version"}
    ours_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    their_tensors = tensors(again)
    assert set(ours_map) == set(their_tensors)
    ours_loaded = load_hf_checkpoint(path, dtype=torch.float32, progress=False).model
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), ours_loaded.state_dict().values()))


def test_writer_refuses_a_model_kimi_linear_cannot_describe(tmp_path):
    cfg = k3lab_model(None).config.replace(balancer="none")
    with pytest.raises(ValueError, match=r"not a Kimi Linear model: residual='attnres'"):
        save_hf_checkpoint(K3ForCausalLM(cfg.replace(residual="attnres")), tmp_path / "x", family="kimi_linear",
                           progress=False)
    with pytest.raises(ValueError, match=r"mxfp4_experts=True: the Kimi Linear layout"):
        save_hf_checkpoint(K3ForCausalLM(cfg), tmp_path / "y", mxfp4_experts=True, progress=False)
    tiny = ModelConfig.preset("tiny")  # K3-shaped: the release's layout, as before
    assert json.loads(json.dumps(to_hf_config(tiny)))["model_type"] == "kimi_k3"


# ----------------------------------------------------------------------------------------------
# planted faults
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    theirs = transformers_model(None, seed=3)
    return theirs, save(theirs, tmp_path_factory.mktemp("kl") / "kl")


def test_wrong_gate_is_refused_and_would_show_at_the_first_kda_layer(saved):
    theirs, path = saved
    with pytest.raises(ValueError, match=r"override kda_gate: changes the model config.json describes"):
        load_hf_checkpoint(path, kda_gate="k3", progress=False)
    ours = load_hf_checkpoint(path, dtype=torch.float32, progress=False).model
    ours.model.layers[1].self_attn.gate_kind = "k3"  # planted: K3's bounded gate in place of Kimi Linear's
    cmp = compare_with_transformers(ours, theirs, IDS)
    assert cmp.first_over(TOL) == "layers.1.self_attn" and cmp.max_rel > 1e-2, cmp.table()


@pytest.mark.parametrize("fault, match", [
    ("missing", r"no tensor model.layers.3.self_attn.g_b_proj.weight"),
    ("extra", r"1 stored tensor\(s\) the model of config.json does not have, e.g. \['model.layers.3.self_attn.g_proj.weight'\]"),
    ("a_log_shape", r"model.layers.3.self_attn.A_log has shape \[2\], expected \[1, 1, 2, 1\]"),
    ("transposed", r"model.layers.3.self_attn.f_a_proj.weight has shape \[32, 8\], expected \[8, 32\]"),
])
def test_planted_tensor_faults_are_named(saved, fault, match, tmp_path):
    _, path = saved
    stored = tensors(path)
    layer = "model.layers.3.self_attn."
    if fault == "missing":
        del stored[layer + "g_b_proj.weight"]
    elif fault == "extra":
        stored[layer + "g_proj.weight"] = torch.zeros(16, 32)
    elif fault == "a_log_shape":
        stored[layer + "A_log"] = stored[layer + "A_log"].reshape(-1)
    else:
        stored[layer + "f_a_proj.weight"] = stored[layer + "f_a_proj.weight"].T.contiguous()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    save_file(stored, str(bad / SINGLE_FILE), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(bad, progress=False)


# ----------------------------------------------------------------------------------------------
# transformers' internal format: save_pretrained(save_original_format=False)
# ----------------------------------------------------------------------------------------------
INTERNAL = dict(save_original_format=False)
FUSED = {  # layer 1 (KDA + MoE) in the internal format: fused name -> shape for TINY (H·K = 16, W = 4, E = 4, I = 16)
    "model.layers.1.self_attn.conv1d.weight": [48, 1, 4],                       # q, k, v convs on axis 0
    "model.layers.1.mlp.experts.gate_up_proj": [4, 32, 32],                     # gate w1, up w3 on axis 1
    "model.layers.1.mlp.experts.down_proj": [4, 32, 16],
    "model.layers.1.self_attn.forget_gate.A_log": [1, 1, 2, 1],
}


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q_proj", "q_lora"])
def test_internal_format_reads_to_the_same_logits(q_lora_rank, tmp_path):
    theirs = transformers_model(q_lora_rank, seed=4)
    internal, original = save(theirs, tmp_path / "internal", **INTERNAL), save(theirs, tmp_path / "original")
    stored = tensors(internal)
    assert {k: list(stored[k].shape) for k in FUSED} == FUSED
    assert not [k for k in stored if "block_sparse_moe" in k or "_conv1d" in k]
    loaded = load_hf_checkpoint(internal, dtype=torch.float32, progress=False)
    assert loaded.kimi_linear_format == "internal"
    assert load_hf_checkpoint(original, dtype=torch.float32, progress=False).kimi_linear_format == "original"
    ours = loaded.model
    assert not [n for n, p in ours.named_parameters() if p.is_meta]
    # split exactly: the same parameters as from the original format, bit for bit
    again = load_hf_checkpoint(original, dtype=torch.float32, progress=False).model.state_dict()
    assert all(torch.equal(v, again[k]) for k, v in ours.state_dict().items())
    assert_same_logits(ours, theirs)


def test_internal_format_sharded_bf16_and_a_slice(tmp_path):
    theirs = transformers_model(None, seed=5).to(torch.bfloat16)
    path = save(theirs, tmp_path / "kl", max_shard_size="20KB", **INTERNAL)
    whole = load_hf_checkpoint(path, dtype=torch.float32, progress=False)
    experts = theirs.model.layers[3].mlp.experts
    w = whole.model.model.layers[3].block_sparse_moe.experts
    assert torch.equal(torch.cat([w.w1, w.w3], dim=1), experts.gate_up_proj.float())
    part = load_hf_checkpoint(path, layers=[3], embeddings=False, head=False, dtype=torch.float32, progress=False)
    assert part.loaded == sorted(n for n in whole.loaded if n.startswith("model.layers.3."))
    assert all(torch.equal(p, whole.model.get_parameter(n)) for n, p in part.model.named_parameters() if not p.is_meta)
    assert_same_logits(whole.model, load_transformers(path))


@pytest.mark.parametrize("fault, match", [
    ("conv_shape", r"model.layers.1.self_attn.conv1d.weight has shape \[40, 1, 4\], expected \[48, 1, 4\] "
                   r"\(the q, k, v short convs \[16, 1, 4\] concatenated on axis 0"),
    ("gate_up_shape", r"model.layers.1.mlp.experts.gate_up_proj has shape \[4, 30, 32\], expected \[4, 32, 32\] "
                      r"\(the experts' gate w1 and up w3 \[4, 16, 32\] concatenated on axis 1"),
    ("missing", r"no tensor model.layers.3.mlp.experts.gate_up_proj \(k3lab needs it for "
                r"model.layers.3.block_sparse_moe.experts.w1"),
    ("mixed", r"model.layers.0.self_attn.conv1d.weight is transformers' internal Kimi Linear format "
              r"\(save_original_format=False\) and model.layers.3.self_attn.k_conv1d.weight its original format"),
])
def test_internal_format_faults_are_named(fault, match, tmp_path):
    path = save(transformers_model(None, seed=3), tmp_path / "kl", **INTERNAL)
    stored = tensors(path)
    conv, gate_up = "model.layers.1.self_attn.conv1d.weight", "model.layers.1.mlp.experts.gate_up_proj"
    if fault == "conv_shape":
        stored[conv] = stored[conv][:40].clone()                                 # [40, 1, 4]: 8 channels short
    elif fault == "gate_up_shape":
        stored[gate_up] = stored[gate_up][:, :30].clone()                        # [4, 30, 32]: 2 up rows short
    elif fault == "missing":
        del stored["model.layers.3.mlp.experts.gate_up_proj"]
    else:  # layer 3's fused conv split back into the original format's three
        q, k, v = stored.pop("model.layers.3.self_attn.conv1d.weight").chunk(3)
        stored.update({f"model.layers.3.self_attn.{n}_conv1d.weight": t.clone() for n, t in zip("qkv", (q, k, v))})
    save_file(stored, str(path / SINGLE_FILE), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match) as err:
        load_hf_checkpoint(path, progress=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fmt", ["original", "internal"])
def test_k3lab_writes_either_format(fmt, tmp_path):
    ours = k3lab_model(24, seed=6)
    path = save_hf_checkpoint(ours, tmp_path / "ours", dtype=torch.float32, progress=False, kimi_linear_format=fmt)
    theirs = load_transformers(path)  # no missing, unexpected or mismatched key
    assert_same_logits(ours, theirs)
    # the names and shapes transformers writes in that format for the same model
    again = tensors(save(theirs, tmp_path / "theirs", save_original_format=fmt == "original"))
    written = {k: list(v.shape) for k, v in tensors_of(path).items()}
    assert written == {k: list(v.shape) for k, v in again.items()}
    back = load_hf_checkpoint(path, dtype=torch.float32, progress=False)
    assert back.kimi_linear_format == fmt
    assert all(torch.equal(v, back.model.state_dict()[k]) for k, v in ours.state_dict().items())


def test_writer_format_is_checked(tmp_path):
    ours = k3lab_model(None)
    with pytest.raises(ValueError, match=r"kimi_linear_format='fused': allowed values are \('original', 'internal'\)"):
        save_hf_checkpoint(ours, tmp_path / "x", kimi_linear_format="fused", progress=False)
    with pytest.raises(ValueError, match=r"kimi_linear_format='internal': only the Kimi Linear layout"):
        save_hf_checkpoint(K3ForCausalLM(ModelConfig.preset("tiny")), tmp_path / "y", kimi_linear_format="internal",
                           progress=False)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def tensors_of(path: Path) -> dict:
    """Every tensor of a sharded checkpoint folder (the writer's index)."""
    shards = set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())
    return {k: v for s in shards for k, v in load_file(str(path / s)).items()}


# ----------------------------------------------------------------------------------------------
# config.json: both dialects, as transformers reads them
# ----------------------------------------------------------------------------------------------
def transformers_reading(raw: dict) -> dict:
    """What transformers' KimiLinearConfig makes of ``raw``, in k3lab's terms."""
    c = KimiLinearConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    L = c.num_hidden_layers
    return dict(full_attn_layers=[i + 1 for i in range(L) if c.layer_types[i] == "full_attention"],
                first_k_dense_replace=c.mlp_layer_types.count("dense"), q_lora_rank=c.q_lora_rank,
                kda=(c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim),
                moe=(c.num_local_experts, c.num_experts_per_tok, c.n_shared_experts, c.norm_topk_prob,
                     c.routed_scaling_factor, c.moe_intermediate_size),
                sizes=(c.vocab_size, c.hidden_size, L, c.intermediate_size, c.kv_lora_rank, c.v_head_dim),
                max_position_embeddings=c.max_position_embeddings)


def k3lab_reading(raw: dict) -> dict:
    c = from_hf_config(raw)
    lac = c.linear_attn_config
    return dict(full_attn_layers=c.full_attn_layers, first_k_dense_replace=c.first_k_dense_replace,
                q_lora_rank=c.q_lora_rank, kda=(lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]),
                moe=(c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_renormalize,
                     c.routed_scaling_factor, c.moe_intermediate_size),
                sizes=(c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.kv_lora_rank,
                       c.v_head_dim),
                max_position_embeddings=c.max_position_embeddings)


HUB_48B_SHAPE = {  # the hub dialect with the released 48B's structure, at a small width; defaults left out
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
    "num_hidden_layers": 27, "first_k_dense_replace": 1, "q_lora_rank": None, "num_experts": 16,
    "num_experts_per_token": 4, "num_shared_experts": 1, "moe_renormalize": True, "mla_use_nope": True,
    "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "model_max_length": 4096, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]}}


@pytest.mark.parametrize("raw", [
    HUB_48B_SHAPE,
    {k: v for k, v in HUB_48B_SHAPE.items() if k != "linear_attn_config"},  # transformers' default schedule
    dict(TINY, model_type="kimi_linear", q_lora_rank=24),
    {"model_type": "kimi_linear", "vocab_size": 200000, "num_hidden_layers": 3, "first_k_dense_replace": 5},
], ids=["hub-48b-shape", "hub-default-schedule", "transformers", "mostly-defaults"])
def test_config_reads_as_transformers_reads_it(raw):
    assert k3lab_reading(raw) == transformers_reading(raw)
    cfg = from_hf_config(raw)
    assert kimi_linear_mismatches(cfg) == []
    assert from_hf_config(to_hf_config(cfg)) == cfg  # and back


@pytest.mark.parametrize("change, match", [
    (dict(attn_res_block_size=12), r"attn_res_block_size is a K3 field and layer_types a field of transformers' "
                                   r"Kimi Linear config"),
    (dict(sliding_window=128), r"sliding_window: not a field of a Kimi Linear config"),
    (dict(mla_use_nope=False), r"mla_use_nope=False: transformers' kimi_linear builds True"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu': transformers' kimi_linear builds 'silu'"),
    (dict(n_group=2), r"n_group=2"),
    (dict(num_experts=8), r"num_experts=8 and num_local_experts=4 disagree"),
    (dict(first_k_dense_replace=2), r"mlp_layer_types \(1 dense first\) and first_k_dense_replace=2 disagree"),
    (dict(linear_attn_config={"full_attn_layers": [3, 5]}), r"missing field linear_attn_config.kda_layers"),
    (dict(linear_attn_config={"full_attn_layers": [2, 5], "kda_layers": [1, 3, 4]}),
     r"layer_types \(full attention at \[3, 5\]\) and linear_attn_config.full_attn_layers=\[2, 5\] disagree"),
    (dict(model_type="deepseek_v3"), r"model_type='deepseek_v3': not a Kimi K3 or Kimi Linear config"),
])
def test_config_faults_are_named(change, match):
    with pytest.raises(ValueError, match=match) as err:
        from_hf_config(dict(dict(TINY, model_type="kimi_linear"), **change), source="kl/config.json")
    assert str(err.value).startswith("kl/config.json: ") and "\n" not in str(err.value)


def test_a_kimi_linear_config_always_gets_its_gate():
    raw = dict(TINY, model_type="kimi_linear")
    assert from_hf_config(raw).kda_gate == "kimi_linear"
    assert from_hf_config(raw, backend="torch").backend == "torch"  # how it runs may change
    for field, value in (("kda_gate", "k3"), ("residual", "attnres"), ("mlp_kind", "latent_moe")):
        with pytest.raises(ValueError, match=rf"override {field}: changes the model config.json describes"):
            from_hf_config(raw, **{field: value})
    with pytest.raises(ValueError, match=r"neither model_type nor architectures names the model"):
        from_hf_config({k: v for k, v in raw.items() if k != "model_type"})


# ----------------------------------------------------------------------------------------------
# edges transformers runs (issue 38)
# ----------------------------------------------------------------------------------------------
def test_a_hub_checkpoint_transformers_loaded_and_saved_again(tmp_path):
    """transformers reads the hub's ``rope_scaling: null`` and writes ``rope_parameters: null`` back (RoPE
    settings: unused under NoPE); the re-saved folder reads to the same config and logits."""
    theirs = transformers_model(None, seed=7)
    path = save(theirs, tmp_path / "hub")
    rewrite_config(path, lambda cfg: dict(hub_dialect(cfg), rope_theta=10000.0, rope_scaling=None,
                                          torch_dtype="float32"))
    again = save(load_transformers(path), tmp_path / "again")
    written = json.loads((again / "config.json").read_text())
    assert "rope_parameters" in written and written["rope_parameters"] is None  # what transformers adds
    assert from_hf_config(again / "config.json") == from_hf_config(path / "config.json")
    assert_same_logits(load_hf_checkpoint(again, dtype=torch.float32, progress=False).model, theirs)
    # the config alone, through KimiLinearConfig's own save (as a hub config.json is usually re-saved)
    hub = dict(HUB_48B_SHAPE, rope_theta=10000.0, rope_scaling=None)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(hub))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        KimiLinearConfig.from_pretrained(tmp_path / "cfg", local_files_only=True).save_pretrained(tmp_path / "cfg2")
    assert from_hf_config(tmp_path / "cfg2" / "config.json") == from_hf_config(hub)


def test_tied_embeddings_both_ways(tmp_path):
    """``tie_word_embeddings: true``. transformers' KimiLinearForCausalLM never ties (its ``_tied_weights_keys``
    is empty): its lm_head is a tensor of its own, saved and loaded as such. A tied model's head holds the
    embedding: k3lab reads that folder tied, and writes lm_head.weight (the embedding) for transformers."""
    theirs = transformers_model(None, seed=8, tie_word_embeddings=True)
    with torch.no_grad():
        theirs.lm_head.weight.copy_(theirs.model.embed_tokens.weight)
    path = save(theirs, tmp_path / "theirs")
    assert torch.equal(tensors(path)["lm_head.weight"], tensors(path)["model.embed_tokens.weight"])
    ours = load_hf_checkpoint(path, dtype=torch.float32, progress=False).model
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    assert_same_logits(ours, theirs)

    mine = k3lab_model(None, seed=9, tie_word_embeddings=True)
    assert mine.lm_head.weight is mine.model.embed_tokens.weight
    out = save_hf_checkpoint(mine, tmp_path / "ours", dtype=torch.float32, progress=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert_same_logits(mine, load_transformers(out))  # no missing lm_head.weight
    back = load_hf_checkpoint(out, dtype=torch.float32, progress=False).model
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in mine.state_dict().items())


def test_a_tied_config_with_a_head_of_its_own_is_refused(tmp_path):
    """transformers runs the stored head whatever tie_word_embeddings says; k3lab ties as the config says, so a
    head that is not the embedding would give other logits: refused, naming the field and the fix."""
    theirs = transformers_model(None, seed=10, tie_word_embeddings=True)  # its own random head
    path = save(theirs, tmp_path / "kl")
    with pytest.raises(ValueError, match=r"lm_head.weight differs from model.embed_tokens.weight, but config.json "
                                         r"says tie_word_embeddings=true .* set tie_word_embeddings to false") as err:
        load_hf_checkpoint(path, progress=False)
    assert "\n" not in str(err.value)
    rewrite_config(path, lambda cfg: dict(cfg, tie_word_embeddings=False))  # the fix the message names
    assert_same_logits(load_hf_checkpoint(path, dtype=torch.float32, progress=False).model, theirs)


DROP = object()  # a field left out


@pytest.mark.parametrize("change, match", [
    (dict(attn_res_block_size=12), r"^kl/config.json: attn_res_block_size is a K3 field, but K3's "
                                   r"routed_expert_hidden_size, .* are missing: a Kimi Linear config with K3 fields "
                                   r"added \(a mixed dialect\)"),
    (dict(attn_res_block_size=12, routed_expert_hidden_size=32, hidden_act=DROP),
     r"^kl/config.json: routed_expert_hidden_size, attn_res_block_size are K3 fields, but K3's latent_moe_use_norm, "
     r".* are missing: a Kimi Linear config with K3 fields added"),
    (dict(linear_attn_config=dict(HUB_48B_SHAPE["linear_attn_config"], use_full_rank_gate=True)),
     r"^kl/config.json: linear_attn_config.use_full_rank_gate is a K3 field, but"),
], ids=["one-k3-field", "two-k3-fields", "k3-gate-field"])
def test_a_hub_config_with_k3_fields_added_is_refused(change, match):
    """The hub's dialect shares K3's names; only K3's own fields tell a bare K3 text config apart, so some of
    them without the others is a mixed config, refused naming the fields added (never built as K3)."""
    raw = dict(HUB_48B_SHAPE, hidden_act="silu", num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=64, moe_intermediate_size=16)
    raw.update(change)  # a complete hub config.json (every field given, as Moonshot's) with K3 fields added
    raw = {k: v for k, v in raw.items() if v is not DROP}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not built with a warning
        with pytest.raises(ValueError, match=match) as err:
            from_hf_config(raw, source="kl/config.json")
    assert "\n" not in str(err.value)
    # the release's text config alone (every K3 field) is still K3
    release = json.loads((Path(__file__).parent / "fixtures" / "k3_config.json").read_text())["text_config"]
    assert from_hf_config(release) == ModelConfig.preset("k3")


@pytest.mark.parametrize("balancer", ["quantile_hist", "quantile_exact"])
def test_every_expert_on_every_token(balancer, tmp_path):
    """num_experts_per_tok == n_routed_experts (transformers runs it): every load is the target whatever the
    bias, so Quantile Balancing has nothing to move; the logits are transformers', a training step runs."""
    theirs = transformers_model(None, seed=11, num_experts_per_tok=TINY["num_local_experts"])
    path = save(theirs, tmp_path / "kl")
    ours = load_hf_checkpoint(path, dtype=torch.float32, progress=False, balancer=balancer).model
    assert ours.config.num_experts_per_tok == ours.config.n_routed_experts == 4
    assert_same_logits(ours, theirs)
    moe = ours.model.layers[1].block_sparse_moe
    before = moe.gate.e_score_correction_bias.detach().clone()
    ours.train()
    ours(input_ids=IDS, labels=IDS).loss.backward()
    moe.balancer.update()
    assert torch.equal(moe.gate.e_score_correction_bias, before)
    assert moe.balancer.metrics()["max_violation"] == 0.0 and moe.balancer.metrics()["load"].tolist() == [140] * 4
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5: top-k must be <= n_routed_experts=4"):
        from_hf_config(dict(TINY, model_type="kimi_linear", num_experts_per_tok=5))
