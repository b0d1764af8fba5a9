"""The three costs of inference (k3lab.costs) against hand-computed values."""

import pytest

from k3lab.config import ModelConfig
from k3lab.costs import ARCHS, InferenceCosts, cost_table

K3 = ModelConfig.preset("k3")
TINY = ModelConfig.preset("tiny")


def test_k3_cache_bytes_by_hand():
    k3 = InferenceCosts(K3, "k3")
    assert k3.layer_kinds().count("mla") == 24 and k3.layer_kinds().count("kda") == 69
    assert k3.cache_bytes_per_token() == 24 * 576 * 2 == 27_648  # MLA latent + shared k part, bf16
    state = 96 * 128 * 128 * 4  # 6 MiB fp32 per KDA layer
    conv_tails = 3 * 96 * 128 * 3 * 2  # q, k, v: W-1 = 3 inputs of 12288 channels, bf16
    assert state == 6_291_456 and conv_tails == 221_184
    assert k3.cache_fixed_bytes() == 69 * (state + conv_tails) == 449_372_160
    assert k3.cache_bytes(1 << 20) == 449_372_160 + (1 << 20) * 27_648


def test_counterfactual_cache_bytes_by_hand():
    assert InferenceCosts(K3, "all_mla").cache_bytes_per_token() == 93 * 576 * 2 == 107_136
    assert InferenceCosts(K3, "all_mla").cache_fixed_bytes() == 0
    assert InferenceCosts(K3, "all_gqa").cache_bytes_per_token() == 93 * 2 * 8 * 128 * 2 == 380_928
    assert InferenceCosts(K3, "all_gqa", gqa_kv_heads=4, gqa_head_dim=64).cache_bytes_per_token() == 93 * 2 * 4 * 64 * 2


def test_active_params_of_counterfactuals():
    counts = K3.param_counts()
    by = counts["by_component"]
    assert InferenceCosts(K3, "k3").active_params() == counts["active"]
    gqa = InferenceCosts(K3, "all_gqa")
    assert gqa.gqa_layer_params() == 2 * 7168 * 96 * 128 + 2 * 7168 * 8 * 128 == 190_840_832
    non_mixer = counts["active"] - by["kda"]["active"] - by["mla"]["active"]
    assert gqa.active_params() == non_mixer + 93 * 190_840_832
    kda_layer, mla_layer = by["kda"]["active"] // 69, by["mla"]["active"] // 24
    assert InferenceCosts(K3, "all_mla").active_params() == counts["active"] + 69 * (mla_layer - kda_layer)


def test_k3_decode_flops_by_hand():
    k3 = InferenceCosts(K3, "k3")
    P = k3.active_params()
    kda_mix = 69 * 7 * 96 * 128 * 128  # fixed per token
    mla_per_key = 24 * 2 * 96 * (2 * 512 + 64)  # absorbed MQA: 576-d scores + 512-d values, 96 heads
    assert kda_mix == 759_693_312 and mla_per_key == 5_013_504
    assert k3.decode_flops(1) == 2 * P + kda_mix + mla_per_key
    assert k3.decode_flops(4096) - k3.decode_flops(4095) == mla_per_key
    gqa = InferenceCosts(K3, "all_gqa")
    assert gqa.decode_flops(101) - gqa.decode_flops(100) == 93 * 2 * 96 * 2 * 128


def test_tiny_prefill_flops_by_hand():
    # tiny: 4 layers (layer 4 MLA), KDA 2 heads x 32, MLA 2 heads, d_qk = 16 + 8, d_v = 16
    costs = InferenceCosts(TINY, "k3")
    N = 10
    kda = 3 * 7 * 2 * 32 * 32 * N  # 43_008 N
    mla = 2 * 2 * (24 + 16) * N * (N + 1) // 2  # 80 N (N + 1)
    assert kda + mla == 438_880
    assert costs.prefill_flops(N) == 2 * costs.active_params() * N + 438_880


@pytest.mark.parametrize("arch", ["k3", "all_gqa"])
def test_prefill_is_the_sum_of_decode_steps(arch):
    """Without the MLA absorption switch, prefill(N) = Σ_t decode(t) exactly."""
    cfg = TINY.replace(full_attn_layers=[]) if arch == "k3" else TINY
    costs = InferenceCosts(cfg, arch, gqa_kv_heads=1, gqa_head_dim=16)
    assert costs.prefill_flops(50) == sum(costs.decode_flops(t) for t in range(1, 51))


def test_cost_table_rows_and_growth():
    rows = cost_table(K3, [4096, 1 << 20])
    assert [(r["arch"], r["context"]) for r in rows] == [(a, n) for a in ARCHS for n in (4096, 1 << 20)]
    at_1m = {r["arch"]: r for r in rows if r["context"] == 1 << 20}
    assert at_1m["k3"]["cache_bytes"] < at_1m["all_mla"]["cache_bytes"] < at_1m["all_gqa"]["cache_bytes"]
    assert at_1m["k3"]["prefill_flops"] < at_1m["all_gqa"]["prefill_flops"] < at_1m["all_mla"]["prefill_flops"]
    assert at_1m["k3"]["cache_bytes_per_token"] == at_1m["k3"]["cache_bytes"] / (1 << 20)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="arch='mamba': allowed values are"):
        InferenceCosts(K3, "mamba")
    with pytest.raises(ValueError, match="gqa_kv_heads=7: must divide num_attention_heads=96"):
        InferenceCosts(K3, "all_gqa", gqa_kv_heads=7)
    with pytest.raises(ValueError, match="gqa_head_dim=0"):
        InferenceCosts(K3, "all_gqa", gqa_head_dim=0)
    with pytest.raises(ValueError, match="context=0: must be an integer >= 1"):
        InferenceCosts(K3).decode_flops(0)
    with pytest.raises(ValueError, match="n_tokens=1.5"):
        InferenceCosts(K3).prefill_flops(1.5)


def test_cache_bytes_match_the_tiny_model():
    """The cost model's cache equals what K3ForCausalLM actually carries (fp32: kv_bytes = 4)."""
    import torch

    from k3lab.model import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(TINY).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, TINY.vocab_size, (1, 12))).cache
    assert cache.nbytes() == InferenceCosts(TINY, kv_bytes=4).cache_bytes(12) == 3 * (2 * 32 * 32 * 4 + 3 * 64 * 3 * 4) + 12 * 40 * 4
