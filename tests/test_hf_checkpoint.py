"""The HF checkpoint layout (k3lab.hf.checkpoint, k3lab.hf.mxfp4): the released K3's names and shapes on the meta
device; tiny checkpoints written by us and read back (bf16 bit-exact; MXFP4 equal to compressed-tensors' own
quantize -> dequantize and to the plain-PyTorch decode); subsets of layers on meta; bad input named."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3lab.config import ModelConfig
from k3lab.hf import mxfp4
from k3lab.hf.config import from_hf_config
from k3lab.hf.checkpoint import (FP32_SUFFIXES, INDEX_FILE, PREFIX, SINGLE_FILE, load_hf_checkpoint,
                                 save_hf_checkpoint, stored_dtype, tensor_specs)
from k3lab.model import K3ForCausalLM

FIXTURE = Path(__file__).parent / "fixtures" / "k3_config.json"
BF16, FP32 = torch.bfloat16, torch.float32


def tiny_model(seed: int = 0) -> K3ForCausalLM:
    """The tiny preset with every parameter random (norms, router bias, AttnRes queries and A_log included),
    so that a tensor loaded into the wrong place or left at its init shows."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(ModelConfig.preset("tiny"))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def source():
    return tiny_model()


@pytest.fixture(scope="module")
def bf16_dir(source, tmp_path_factory):
    return save_hf_checkpoint(source, tmp_path_factory.mktemp("ckpt") / "bf16", max_shard_bytes=300_000, progress=False)


@pytest.fixture(scope="module")
def mxfp4_dir(source, tmp_path_factory):
    return save_hf_checkpoint(source, tmp_path_factory.mktemp("ckpt") / "mxfp4", mxfp4_experts=True,
                              a_log_padded_to=128, progress=False)


def stored(path: Path) -> dict:
    """Every stored tensor of a checkpoint folder, read through its index."""
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(path / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(out) == set(weight_map)
    return out


def test_k3_names_and_shapes_are_the_release_layout():
    """The release's tensor list (its model-inspection report) for the dense layer 0, the MoE KDA layer 1, the
    MLA layer 3 and the globals, against what k3lab would write for preset("k3") (meta device)."""
    cfg = from_hf_config(FIXTURE)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    specs = tensor_specs(model, mxfp4_experts=True, a_log_padded_to=128, layers=[0, 1, 3])
    u8 = torch.uint8
    release = {  # name (after language_model.) -> (shape, dtype), as stored in the release
        "model.embed_tokens.weight": ([163840, 7168], BF16), "lm_head.weight": ([163840, 7168], BF16),
        "model.norm.weight": ([7168], BF16), "model.output_attn_res_norm.weight": ([7168], BF16),
        "model.output_attn_res_proj.weight": ([1, 7168], BF16),
        "model.layers.0.mlp.gate_proj.weight": ([33792, 7168], BF16),
        "model.layers.0.mlp.down_proj.weight": ([7168, 33792], BF16),
        "model.layers.1.input_layernorm.weight": ([7168], BF16), "model.layers.1.mlp_res_proj.weight": ([1, 7168], BF16),
        "model.layers.1.self_attention_res_norm.weight": ([7168], BF16),
        "model.layers.1.self_attn.q_proj.weight": ([12288, 7168], BF16),
        "model.layers.1.self_attn.v_conv1d.weight": ([12288, 1, 4], FP32),
        "model.layers.1.self_attn.f_a_proj.weight": ([128, 7168], BF16),
        "model.layers.1.self_attn.f_b_proj.weight": ([12288, 128], BF16),
        "model.layers.1.self_attn.b_proj.weight": ([96, 7168], BF16),
        "model.layers.1.self_attn.dt_bias": ([12288], FP32), "model.layers.1.self_attn.A_log": ([128], FP32),
        "model.layers.1.self_attn.o_norm.weight": ([128], FP32),
        "model.layers.1.self_attn.g_proj.weight": ([12288, 7168], BF16),
        "model.layers.1.self_attn.o_proj.weight": ([7168, 12288], BF16),
        "model.layers.3.self_attn.q_a_proj.weight": ([1536, 7168], BF16),
        "model.layers.3.self_attn.q_a_layernorm.weight": ([1536], BF16),
        "model.layers.3.self_attn.q_b_proj.weight": ([18432, 1536], BF16),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": ([576, 7168], BF16),
        "model.layers.3.self_attn.kv_a_layernorm.weight": ([512], BF16),
        "model.layers.3.self_attn.kv_b_proj.weight": ([24576, 512], BF16),
        "model.layers.3.self_attn.g_proj.weight": ([12288, 7168], BF16),
        "model.layers.1.block_sparse_moe.gate.weight": ([896, 7168], BF16),
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias": ([896], FP32),
        "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight": ([3584, 7168], BF16),
        "model.layers.1.block_sparse_moe.routed_expert_norm.weight": ([3584], BF16),
        "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight": ([7168, 3584], BF16),
        "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": ([6144, 7168], BF16),
        "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight": ([7168, 6144], BF16),
        "model.layers.1.block_sparse_moe.experts.0.w1.weight_packed": ([3072, 1792], u8),
        "model.layers.1.block_sparse_moe.experts.0.w1.weight_scale": ([3072, 112], u8),
        "model.layers.3.block_sparse_moe.experts.895.w3.weight_packed": ([3072, 1792], u8),
        "model.layers.1.block_sparse_moe.experts.895.w2.weight_packed": ([3584, 1536], u8),
        "model.layers.1.block_sparse_moe.experts.895.w2.weight_scale": ([3584, 96], u8),
    }
    for name, (shape, dtype) in release.items():
        assert specs[PREFIX + name] == (tuple(shape), dtype), name
    assert not any(".experts.896." in k for k in specs) and f"{PREFIX}model.layers.1.block_sparse_moe.experts.895.w3." \
        "weight_scale" in specs
    assert len([k for k in specs if ".layers.1.block_sparse_moe.experts." in k]) == 896 * 3 * 2


def test_bf16_round_trip_is_bit_exact(source, bf16_dir, tmp_path):
    index = json.loads((bf16_dir / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    on_disk = stored(bf16_dir)
    assert all(k.startswith(PREFIX) for k in on_disk)
    assert f"{PREFIX}model.layers.1.block_sparse_moe.experts.7.w2.weight" in on_disk  # per-expert names
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in on_disk.values())
    for name, t in on_disk.items():  # the release's dtypes: fp32 for conv/dt_bias/A_log/o_norm/router bias
        assert t.dtype == (FP32 if name.endswith(FP32_SUFFIXES) else BF16), name

    out = load_hf_checkpoint(bf16_dir, dtype=BF16, progress=False)
    assert out.layers == list(range(4)) and out.tensors_read == len(on_disk) and out.dequantized == 0
    got, ref = out.model.state_dict(), source.state_dict()
    assert set(got) == set(ref)
    for name, value in ref.items():
        want = value.to(stored_dtype(name, BF16))
        assert got[name].dtype == want.dtype and torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name

    # float32 end to end: the loaded model computes exactly what the source does
    fp32_dir = save_hf_checkpoint(source, tmp_path / "fp32", dtype=FP32, progress=False)
    loaded = load_hf_checkpoint(fp32_dir, dtype=FP32, progress=False).model
    ids = torch.randint(0, source.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded(ids).logits, source(ids).logits)


def test_mxfp4_round_trip_equals_compressed_tensors(source, mxfp4_dir):
    cfg_json = json.loads((mxfp4_dir / "config.json").read_text())
    mxfp4.check_quantization_config(cfg_json["quantization_config"])
    on_disk = stored(mxfp4_dir)
    assert on_disk[f"{PREFIX}model.layers.0.self_attn.A_log"].shape == (128,)
    out = load_hf_checkpoint(mxfp4_dir, dtype=FP32, progress=False)
    E = source.config.n_routed_experts
    moe_layers = [i for i in range(source.config.num_hidden_layers) if i >= source.config.first_k_dense_replace]
    assert out.dequantized == len(moe_layers) * E * 3
    got, ref = out.model.state_dict(), source.state_dict()
    errors = []
    for name, value in ref.items():
        if ".experts.w" not in name:
            assert torch.equal(got[name], value.to(stored_dtype(name, BF16)).float()), name
            continue
        layer, w = name.split(".")[2], name[-2:]
        for e in range(E):
            base = f"{PREFIX}model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
            packed, scale = on_disk[base + ".weight_packed"], on_disk[base + ".weight_scale"]
            assert packed.dtype == scale.dtype == torch.uint8 and 2 * packed.shape[1] == 32 * scale.shape[1] == value.shape[2]
            original = value[e].to(BF16)
            ct = mxfp4.round_trip(original).float()  # compressed-tensors' own quantize -> dequantize
            assert torch.equal(got[name][e], ct), (name, e)
            assert torch.equal(got[name][e], mxfp4.dequantize_reference(packed, scale)), (name, e)  # plain decode
            errors.append(((ct - original.float()).norm() / original.float().norm()).item())
    assert 0.0 < max(errors) < 0.2  # 4-bit values: a few percent to ~15 % relative error per matrix
    print(f"MXFP4 relative error per expert matrix: mean {sum(errors) / len(errors):.4f}, max {max(errors):.4f}")


def test_mxfp4_matches_compressed_tensors_on_hard_values():
    """Zeros, a group with one outlier, ties between E2M1 values, negative zero and tiny/huge scales."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 128, generator=g) * torch.logspace(-6, 3, 8)[:, None]
    w[0, :32] = 0.0
    w[1, 5] = 1e4
    w[2, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 4) * 2.0 ** -3
    w[3, :32] = -0.0
    w = w.to(BF16)
    packed, scale = mxfp4.quantize(w)
    assert packed.shape == (8, 64) and scale.shape == (8, 4)
    ct = mxfp4.round_trip(w)
    assert torch.equal(mxfp4.dequantize(packed, scale), ct)
    assert torch.equal(mxfp4.dequantize_reference(packed, scale), ct.float())
    assert torch.equal(ct[0, :32], torch.zeros(32, dtype=BF16))
    with pytest.raises(ValueError, match=r"a multiple of 32, got shape \(4, 48\)"):
        mxfp4.quantize(torch.zeros(4, 48))


def test_a_subset_of_layers_on_the_meta_device(source, mxfp4_dir):
    out = load_hf_checkpoint(mxfp4_dir, layers=[1], embeddings=True, head=False, routed_experts=False,
                             progress=False)
    model = out.model
    layer = model.model.layers[1]
    moe = layer.block_sparse_moe
    assert not moe.gate.weight.is_meta and moe.experts.w1.is_meta  # router loaded, experts left on meta
    assert model.model.layers[2].self_attn.q_proj.weight.is_meta and model.lm_head.weight.is_meta
    assert all(n.startswith(("model.layers.1.", "model.embed_tokens.")) for n in out.loaded)
    assert out.dequantized == 0 and out.bytes_read < sum(t.numel() * t.element_size() for t in stored(mxfp4_dir).values())
    ref = source.model.layers[1]
    assert torch.equal(layer.self_attn.A_log, ref.self_attn.A_log)  # read from the padded [128]
    assert torch.equal(moe.gate.e_score_correction_bias, ref.block_sparse_moe.gate.e_score_correction_bias)
    assert moe.balancer.bias is moe.gate.e_score_correction_bias  # a fresh balancer on the loaded bias
    # the loaded router routes real embeddings as the source's does
    h = layer.post_attention_layernorm(model.model.embed_tokens(torch.arange(16)[None]))[0].float()
    h_ref = ref.post_attention_layernorm(source.model.embed_tokens(torch.arange(16)[None]).to(BF16).float())[0]
    torch.testing.assert_close(moe.gate(h).scores, ref.block_sparse_moe.gate(h_ref).scores, rtol=1e-2, atol=1e-3)
    with pytest.raises(ValueError, match=r"layers=\[4\]: each entry must be a 0-based layer index in \[0, 4\)"):
        load_hf_checkpoint(mxfp4_dir, layers=[4], progress=False)


def copy_of(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / "copy"))


def edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_missing_index_shard_and_truncated_shard(bf16_dir, tmp_path):
    ckpt = copy_of(bf16_dir, tmp_path)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    data = (ckpt / shard).read_bytes()
    (ckpt / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{shard}: cannot be read as safetensors.*truncated"):
        load_hf_checkpoint(ckpt, progress=False)
    (ckpt / shard).unlink()
    with pytest.raises(ValueError, match=rf"{shard}: missing shard \({INDEX_FILE} names it for language_model\."):
        load_hf_checkpoint(ckpt, progress=False)
    (ckpt / INDEX_FILE).unlink()
    with pytest.raises(ValueError, match=rf"copy: no {INDEX_FILE} \(nor {SINGLE_FILE}\)"):
        load_hf_checkpoint(ckpt, progress=False)


def test_single_file_without_index(source, tmp_path):
    one = save_hf_checkpoint(source, tmp_path / "one", progress=False)
    (one / "model-00001-of-00001.safetensors").rename(one / SINGLE_FILE)
    (one / INDEX_FILE).unlink()
    got = load_hf_checkpoint(one, layers=[0], embeddings=False, head=False, progress=False).model
    assert torch.equal(got.model.layers[0].mlp.down_proj.weight, source.model.layers[0].mlp.down_proj.weight.to(BF16))


def test_missing_wrong_shaped_and_extra_tensors(bf16_dir, tmp_path):
    ckpt = copy_of(bf16_dir, tmp_path)
    gone = f"{PREFIX}model.layers.2.self_attn.b_proj.weight"
    edit_json(ckpt / INDEX_FILE, lambda d: d["weight_map"].pop(gone))
    with pytest.raises(ValueError, match=rf"{INDEX_FILE}: no tensor {gone} \(k3lab needs it, shape \[2, 64\]"):
        load_hf_checkpoint(ckpt, progress=False)
    assert load_hf_checkpoint(ckpt, layers=[0, 1, 3], progress=False).layers == [0, 1, 3]  # not needed there
    shutil.copy(bf16_dir / INDEX_FILE, ckpt / INDEX_FILE)

    cfg = ckpt / "config.json"
    edit_json(cfg, lambda d: d["text_config"].update(moe_intermediate_size=32))
    with pytest.raises(ValueError, match=r"safetensors: language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight "
                                         r"has shape \[64, 32\], expected \[32, 32\] \(from config.json\)"):
        load_hf_checkpoint(ckpt, layers=[1], progress=False)
    def three_kda_layers(d):  # the checkpoint's layers 0-2 are KDA; its MLA layer 3 is then one too many
        d["text_config"].update(moe_intermediate_size=64, num_hidden_layers=3)
        d["text_config"]["linear_attn_config"].update(full_attn_layers=[], kda_layers=[1, 2, 3])
    edit_json(cfg, three_kda_layers)
    with pytest.raises(ValueError, match=r"stored tensor\(s\) the model of config.json does not have, e.g. "
                                         r"\['language_model.model.layers.3."):
        load_hf_checkpoint(ckpt, progress=False)
    assert load_hf_checkpoint(ckpt, layers=[1], progress=False).layers == [1]


def test_bad_config_and_quantization(mxfp4_dir, tmp_path):
    ckpt = copy_of(mxfp4_dir, tmp_path)
    cfg = ckpt / "config.json"
    edit_json(cfg, lambda d: d["quantization_config"].update(format="nvfp4-pack-quantized"))
    with pytest.raises(ValueError, match=r"copy/config.json: quantization_config.format='nvfp4-pack-quantized'"):
        load_hf_checkpoint(ckpt, progress=False)
    edit_json(cfg, lambda d: d.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"config.json: no quantization_config, but language_model.model.layers.1."
                                         r"block_sparse_moe.experts.0.w1.weight_packed is MXFP4-packed"):
        load_hf_checkpoint(ckpt, layers=[1], progress=False)
    edit_json(cfg, lambda d: d.update(architectures=["Qwen3MoeForCausalLM"]))
    with pytest.raises(ValueError, match=r"copy/config.json: architectures=\['Qwen3MoeForCausalLM'\]: not a Kimi K3"):
        load_hf_checkpoint(ckpt, progress=False)


def test_padded_a_log_with_nonzero_padding_warns(source, tmp_path):
    ckpt = save_hf_checkpoint(source, tmp_path / "pad", a_log_padded_to=8, max_shard_bytes=10**9, progress=False)
    shard = ckpt / "model-00001-of-00001.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    name = f"{PREFIX}model.layers.0.self_attn.A_log"
    assert tensors[name].shape == (8,) and torch.count_nonzero(tensors[name][2:]) == 0
    tensors[name][5] = 1.0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"A_log is stored as \[8\] for 2 heads and its padding is not zero"):
        out = load_hf_checkpoint(ckpt, layers=[0], progress=False)
    assert torch.equal(out.model.model.layers[0].self_attn.A_log, source.model.layers[0].self_attn.A_log)
    with pytest.raises(ValueError, match=r"exists and is not an empty folder"):
        save_hf_checkpoint(source, ckpt, progress=False)
