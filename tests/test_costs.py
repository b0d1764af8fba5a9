"""The three costs of inference (k3lab.costs) against hand-computed values and against what real
models hold and compute: cache bytes read off the cache tensors of a model (the tiny preset, and
K3's per-layer shapes built without memory under FakeTensorMode), FLOPs counted by
``torch.utils.flop_counter.FlopCounterMode`` in forward passes."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from k3lab.config import ModelConfig
from k3lab.costs import ARCHS, InferenceCosts, cost_table
from k3lab.model import K3ForCausalLM
from k3lab.moe.latent import LatentMoE

K3 = ModelConfig.preset("k3")
TINY = ModelConfig.preset("tiny")


# ---------------------------------------------------------------------------------------------- helpers
def all_mla(cfg: ModelConfig) -> ModelConfig:
    return cfg.replace(full_attn_layers=list(range(1, cfg.num_hidden_layers + 1)))


def cache_tensor_bytes(cache) -> list[int]:
    """Bytes of every tensor each layer's cache entry holds, per layer (read off the tensors)."""
    return [sum(t.numel() * t.element_size() for t in vars(entry).values() if isinstance(t, torch.Tensor))
            for entry in cache.layers]


def counted_forward(model, input_ids, cache=None):
    """One no-grad forward under FlopCounterMode. Returns (output, linear, core):

    * ``linear``: FLOPs counted inside leaf modules (nn.Linear, the router, the routed experts):
      the weight multiplies;
    * ``core``: {decoder layer index: FLOPs counted in its mixer outside the mixer's leaf modules},
      the token mixing (KDA's state reads, attention's scores and value sums; in MLA's absorbed
      decode also the two per-head multiplies with ``kv_b_proj``'s weight).

    FlopCounterMode counts matmuls (2 FLOPs per multiply-accumulate), not element-wise ops."""
    root = type(model).__name__
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = model(input_ids, cache=cache)
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    leaves = [n for n, m in model.named_modules() if n and not list(m.children())]
    linear = sum(counts.get(f"{root}.{n}", 0) for n in leaves)
    core = {}
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}.self_attn"
        inside = sum(counts.get(f"{root}.{n}", 0) for n in leaves if n.startswith(prefix + "."))
        core[i] = counts.get(f"{root}.{prefix}", 0) - inside
    assert counts["Global"] == linear + sum(core.values())  # nothing counted outside these two parts
    return out, linear, core


def elementwise_params(model) -> int:
    """Weights a token uses element-wise (so FlopCounterMode does not see them): norm weights, KDA's
    ``A_log`` and ``dt_bias``, the router bias, the short-conv taps."""
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1 or n.endswith("conv1d.weight"))


@pytest.fixture(scope="module")
def k3_shaped_decode():
    """Three one-token forwards of a model with K3's layer shapes (hidden 7168; KDA 96 heads x 128,
    conv 4; MLA 96 heads, latent 512 + 64): 4 layers (3 KDA + 1 MLA, as in each K3 group of four),
    dense MLPs of width 64, a 256-token vocabulary (what the per-layer cache and mixing costs depend
    on, and nothing else), built and run under FakeTensorMode (shapes and dtypes only, no memory)
    with bf16 autocast, as K3 decodes. The first token has no cache (the recurrent KDA form, naive
    MLA), the next two decode with it (absorbed MLA). Returns [(cache bytes per layer, core FLOPs
    per layer)] after 1, 2 and 3 tokens."""
    cfg = K3.replace(num_hidden_layers=4, full_attn_layers=[4], mlp_kind="dense", intermediate_size=64,
                     vocab_size=256, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    steps, cache = [], None
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = K3ForCausalLM(cfg).eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(3):
                out, _, core = counted_forward(model, torch.zeros(1, 1, dtype=torch.long), cache)
                cache = out.cache
                steps.append((cache_tensor_bytes(cache), core))
    return steps


# ---------------------------------------------------------------------------------------------- cache bytes
def test_k3_cache_bytes_by_hand():
    k3 = InferenceCosts(K3, "k3")
    assert k3.layer_kinds().count("mla") == 24 and k3.layer_kinds().count("kda") == 69
    assert k3.cache_bytes_per_token() == 24 * 576 * 2 == 27_648  # MLA latent + shared k part, bf16
    state = 96 * 128 * 128 * 4  # 6 MiB fp32 per KDA layer
    conv_tails = 3 * 96 * 128 * 3 * 2  # q, k, v: W-1 = 3 inputs of 12288 channels, bf16
    assert k3.cache_fixed_bytes() == 69 * (state + conv_tails) == 449_372_160
    assert k3.cache_bytes(1 << 20) == 449_372_160 + (1 << 20) * 27_648


def test_k3_cache_bytes_are_the_cache_tensors_of_k3_shaped_layers(k3_shaped_decode):
    """Per layer, the cost model's bytes are what K3-shaped KDA and MLA layers carry after N tokens
    under bf16 autocast (as K3 decodes): the fp32 KDA state, bf16 conv tails, bf16 MLA latents."""
    k3 = InferenceCosts(K3, "k3")
    for N, (per_layer, _) in enumerate(k3_shaped_decode, start=1):
        kda_0, kda_1, kda_2, mla = per_layer
        assert kda_0 == kda_1 == kda_2
        assert k3.cache_fixed_bytes() == 69 * kda_0
        assert N * k3.cache_bytes_per_token() == 24 * mla
        assert k3.cache_bytes(N) == 69 * kda_0 + 24 * mla


def test_cost_table_cache_columns_are_real_caches():
    """cost_table's cache columns (tiny preset, fp32 caches: kv_bytes = 4) equal the bytes of the cache
    tensors a model holds after N tokens, for its own schedule and for every layer MLA."""
    contexts = (3, 12)
    rows = cost_table(TINY, contexts, archs=("k3", "all_mla"), kv_bytes=4)
    assert [(r["arch"], r["context"]) for r in rows] == [(a, n) for a in ("k3", "all_mla") for n in contexts]
    for arch, cfg in (("k3", TINY), ("all_mla", all_mla(TINY))):
        torch.manual_seed(0)
        model = K3ForCausalLM(cfg).eval()
        for row in (r for r in rows if r["arch"] == arch):
            with torch.no_grad():
                cache = model(torch.randint(0, cfg.vocab_size, (1, row["context"]))).cache
            measured = sum(cache_tensor_bytes(cache))
            assert row["cache_bytes"] == measured, (arch, row["context"])
            assert row["cache_bytes_per_token"] == measured / row["context"]


def test_counterfactual_cache_bytes_by_hand():
    assert InferenceCosts(K3, "all_mla").cache_bytes_per_token() == 93 * 576 * 2 == 107_136
    assert InferenceCosts(K3, "all_mla").cache_fixed_bytes() == 0
    assert InferenceCosts(K3, "all_gqa").cache_bytes_per_token() == 93 * 2 * 8 * 128 * 2 == 380_928
    assert InferenceCosts(K3, "all_gqa", gqa_kv_heads=4, gqa_head_dim=64).cache_bytes_per_token() == 93 * 2 * 4 * 64 * 2


def test_cache_bytes_match_the_tiny_model():
    """The cost model's cache equals what K3ForCausalLM actually carries (fp32: kv_bytes = 4)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(TINY).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, TINY.vocab_size, (1, 12))).cache
    assert cache.nbytes() == InferenceCosts(TINY, kv_bytes=4).cache_bytes(12) == 3 * (2 * 32 * 32 * 4 + 3 * 64 * 3 * 4) + 12 * 40 * 4


# ---------------------------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("arch, mlp_kind", [("k3", "latent_moe"), ("k3", "moe"), ("k3", "dense"), ("all_mla", "latent_moe")])
def test_active_params_are_the_weights_a_token_multiplies(arch, mlp_kind):
    """P (ModelConfig.param_counts' "active", and its all-MLA counterfactual) against a real model:
    the matmul FLOPs FlopCounterMode counts in its leaf modules over N tokens are 2·N per weight
    used in a matmul (top-k experts only: the reference expert loop multiplies each token's own
    rows); P adds the element-wise weights. PreNorm, because an AttnRes pseudo-query multiplies
    every source, not once per token."""
    cfg = TINY.replace(residual="prenorm", mlp_kind=mlp_kind)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg if arch == "k3" else all_mla(cfg)).eval()
    for module in model.modules():
        if isinstance(module, LatentMoE):
            module.experts.impl = "reference"  # the padded path also multiplies its zero padding
    N = 12
    _, linear, _ = counted_forward(model, torch.randint(0, cfg.vocab_size, (1, N)))
    assert linear % (2 * N) == 0
    assert InferenceCosts(cfg, arch).active_params() == linear // (2 * N) + elementwise_params(model)


def test_active_params_of_counterfactuals():
    counts = K3.param_counts()
    by = counts["by_component"]
    gqa = InferenceCosts(K3, "all_gqa")
    assert gqa.gqa_layer_params() == 2 * 7168 * 96 * 128 + 2 * 7168 * 8 * 128 == 190_840_832
    non_mixer = counts["active"] - by["kda"]["active"] - by["mla"]["active"]
    assert gqa.active_params() == non_mixer + 93 * 190_840_832
    kda_layer, mla_layer = by["kda"]["active"] // 69, by["mla"]["active"] // 24
    assert InferenceCosts(K3, "all_mla").active_params() == counts["active"] + 69 * (mla_layer - kda_layer)


# ---------------------------------------------------------------------------------------------- FLOPs
def test_k3_decode_flops_by_hand_and_counted_on_k3_shaped_layers(k3_shaped_decode):
    """By hand, then the two mixing terms against FlopCounterMode on K3-shaped layers (FakeTensorMode).

    KDA, one token (the recurrent form): kᵀS and qᵀS are matmuls, 2·H·K·V each (counted); the decay
    Diag(α)S (H·K·V multiplies) and the rank-1 write S + k vᵀ (2·H·K·V) are element-wise: 7·H·K·V.
    MLA (absorbed decode): one more cached key adds only score and value work, so the counted
    difference between decoding at context N + 1 and N is the per-key term."""
    k3 = InferenceCosts(K3, "k3")
    P = k3.active_params()
    kda_mix = 69 * 7 * 96 * 128 * 128  # fixed per token
    mla_per_key = 24 * 2 * 96 * (2 * 512 + 64)  # absorbed MQA: 576-d scores + 512-d values, 96 heads
    assert k3.decode_flops(1) == 2 * P + kda_mix + mla_per_key
    assert k3.decode_flops(4096) - k3.decode_flops(4095) == mla_per_key
    gqa = InferenceCosts(K3, "all_gqa")
    assert gqa.decode_flops(101) - gqa.decode_flops(100) == 93 * 2 * 96 * 2 * 128

    (_, core_at_1), (_, core_at_2), (_, core_at_3) = k3_shaped_decode
    kda_matmuls = core_at_1[0]
    assert core_at_1[0] == core_at_1[1] == core_at_1[2] == core_at_2[0] == core_at_3[0]  # KDA: fixed per token
    assert kda_mix == 69 * (kda_matmuls + kda_matmuls * 3 // 4) and kda_matmuls % 4 == 0
    assert mla_per_key == 24 * (core_at_3[3] - core_at_2[3])


def test_tiny_prefill_flops_by_hand():
    # tiny: 4 layers (layer 4 MLA), KDA 2 heads x 32, MLA 2 heads, d_qk = 16 + 8, d_v = 16
    costs = InferenceCosts(TINY, "k3")
    N = 10
    kda = 3 * 7 * 2 * 32 * 32 * N  # 43_008 N
    mla = 2 * 2 * (24 + 16) * N * (N + 1) // 2  # 80 N (N + 1)
    assert costs.prefill_flops(N) == 2 * costs.active_params() * N + kda + mla


def test_tiny_mixing_flops_are_the_counted_matmuls():
    """prefill_flops − 2·P·N against FlopCounterMode on the tiny model (PreNorm; 3 KDA + 1 MLA layer).

    MLA: the reference prefill computes the full N×N score matrix and masks it, so it counts
    2·H·(d_qk + d_v)·N² where the cost model counts the N(N+1)/2 causal pairs. KDA: the cost model
    counts the recurrent form, run here token by token with the cache; 4 of its 7·H·K·V per token
    are matmuls (see the K3 decode test). Decode: each extra cached key adds the per-key MLA term."""
    cfg = TINY.replace(residual="prenorm")
    costs = InferenceCosts(cfg, "k3")
    N = 10
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, N))
    _, _, prefill_core = counted_forward(model, ids)
    mla_full = prefill_core[3]
    assert mla_full * (N + 1) % (2 * N) == 0

    cache, kda_matmuls, mla_decode = None, 0, []
    for t in range(N):
        out, _, core = counted_forward(model, ids[:, t:t + 1], cache)
        cache = out.cache
        kda_matmuls += core[0] + core[1] + core[2]
        mla_decode.append(core[3])
    assert kda_matmuls % 4 == 0
    mixing = costs.prefill_flops(N) - 2 * costs.active_params() * N
    assert mixing == kda_matmuls * 7 // 4 + mla_full * (N + 1) // (2 * N)
    for t in range(2, N):  # absorbed decode from the second token on: per key, not per pair
        assert costs.decode_flops(t + 1) - costs.decode_flops(t) == mla_decode[t] - mla_decode[t - 1]


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
