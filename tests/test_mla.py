"""Gated MLA (docs/k3_reference.md §3): naive == absorbed, NoPE is permutation-blind, cache decode == full, names."""

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.mixers.mla import GatedMLA, MLACache, attention_math
from k3lab.testing import assert_close

FP32_TOL = 1e-5
FP64_TOL = 1e-10
BF16_TOL = 1e-2


def tiny_mla(seed=0, **kw) -> GatedMLA:
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny").replace(hidden_size=32, num_attention_heads=3, num_key_value_heads=3, **kw)
    mla = GatedMLA(cfg, layer_idx=3)
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return mla


@pytest.mark.parametrize("nope", [True, False], ids=["nope", "rope"])
@pytest.mark.parametrize("past", [0, 7], ids=["no-cache", "cache7"])
def test_absorbed_equals_naive(nope, past):
    mla = tiny_mla(mla_use_nope=nope)
    x = torch.randn(2, 9, 32)
    cache = None if past == 0 else mla(torch.randn(2, past, 32))[1]
    outs = {}
    for form in ("naive", "absorbed"):
        mla.attn_form = form
        outs[form], new_cache = mla(x, cache)
        assert new_cache.offset == past + 9
    assert_close("y absorbed vs naive", outs["naive"], outs["absorbed"], FP32_TOL)


def test_absorbed_equals_naive_float64():
    mla = tiny_mla().double()
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    mla.attn_form = "naive"
    ref, _ = mla(x)
    mla.attn_form = "absorbed"
    assert_close("y absorbed vs naive (fp64)", ref, mla(x)[0], FP64_TOL)


@pytest.mark.parametrize("nope", [True, False], ids=["nope", "rope"])
def test_permuting_the_past(nope):
    """NoPE: the output at t sees the past as a set, so permuting tokens before t changes nothing."""
    mla = tiny_mla(mla_use_nope=nope)
    x = torch.randn(1, 12, 32)
    t = 10
    perm = torch.cat([torch.randperm(t), torch.arange(t, 12)])
    y, _ = mla(x)
    y_perm, _ = mla(x[:, perm])
    if nope:
        assert_close("y[t] after permuting x[:t]", y[:, t], y_perm[:, t], FP32_TOL)
    else:
        assert (y[:, t] - y_perm[:, t]).norm() > 1e-3 * y[:, t].norm()


@pytest.mark.parametrize("nope", [True, False], ids=["nope", "rope"])
def test_cache_decode_equals_full(nope):
    mla = tiny_mla(mla_use_nope=nope)
    x = torch.randn(2, 13, 32)
    full, _ = mla(x)
    y, cache = mla(x[:, :5])  # prefill (naive form), then one token at a time (absorbed form)
    steps = [y]
    for t in range(5, 13):
        y, cache = mla(x[:, t:t + 1], cache)
        steps.append(y)
    assert_close("token-by-token vs full", full, torch.cat(steps, 1), FP32_TOL)
    assert isinstance(cache, MLACache) and cache.offset == 13
    assert cache.c_kv.shape == (2, 13, mla.kv_lora_rank) and cache.k_rope.shape == (2, 13, mla.qk_rope_head_dim)
    assert cache.nbytes() == 2 * 13 * mla.cache_numbers_per_token() * 4


def test_cache_holds_the_post_norm_latent():
    mla = tiny_mla()
    x = torch.randn(1, 4, 32)
    _, cache = mla(x)
    c_kv, k_rope = mla.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    assert_close("c_kv", mla.kv_a_layernorm(c_kv), cache.c_kv, FP32_TOL)
    assert_close("k_rope", k_rope, cache.k_rope, FP32_TOL)


def test_output_gate():
    """y = o_proj(sigmoid(g_proj x) * o): with the gate off, y = o_proj(o) and g_proj does not exist."""
    gated = tiny_mla()
    plain = tiny_mla(mla_use_output_gate=False)
    assert not hasattr(plain, "g_proj")
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("g_proj")})
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        gated.g_proj.weight.zero_()  # sigmoid(0) = 1/2 on every channel
    assert_close("gate(0) = half the ungated output", 0.5 * plain(x)[0], gated(x)[0], FP32_TOL)


def test_max_logit_tracked_in_training_only():
    mla = tiny_mla()
    x = torch.randn(2, 8, 32)
    mla.eval()
    mla(x)
    assert torch.equal(mla.max_logit, torch.zeros(3))
    mla.train()
    mla(x)
    q_nope, q_rope, c_kv, k_rope = mla.project(x, 0)
    k_nope, _ = mla.kv_b_proj(c_kv).view(2, 8, 3, -1).split([mla.qk_nope_head_dim, mla.v_head_dim], -1)
    q = torch.cat([q_nope, q_rope], -1)
    k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, 3, -1)], -1)
    s = torch.einsum("bthk,bshk->bhts", q, k) * mla.scale
    s = s.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    assert_close("max_logit", s.amax(dim=(0, 2, 3)), mla.max_logit, FP32_TOL)
    assert not mla.max_logit.requires_grad
    mla.track_max_logit = False
    mla(3 * x)
    assert_close("max_logit frozen when not tracked", s.amax(dim=(0, 2, 3)), mla.max_logit, FP32_TOL)


def test_attention_math_is_causal_with_offset():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 6)
    o, _ = attention_math(q, k, v, 0.5, offset=2)  # queries at positions 2, 3, 4
    for i in range(3):
        ref = torch.softmax(q[:, :, i:i + 1] @ k[:, :, : i + 3].transpose(-1, -2) * 0.5, -1) @ v[:, :, : i + 3]
        assert_close(f"row {i}", ref, o[:, :, i:i + 1], FP32_TOL)


def test_k3_names_shapes_and_head_splits():
    with torch.device("meta"):
        mla = GatedMLA(ModelConfig.preset("k3"), layer_idx=3)
    shapes = {k: tuple(v.shape) for k, v in mla.state_dict().items()}
    assert shapes == {
        "q_a_proj.weight": (1536, 7168), "q_a_layernorm.weight": (1536,), "q_b_proj.weight": (96 * 192, 1536),
        "kv_a_proj_with_mqa.weight": (576, 7168), "kv_a_layernorm.weight": (512,),
        "kv_b_proj.weight": (96 * 256, 512), "g_proj.weight": (12288, 7168), "o_proj.weight": (7168, 12288),
    }
    assert mla.muon_head_splits == {"q_b_proj": 96, "kv_b_proj": 96}
    assert mla.cache_numbers_per_token() == 576
    assert mla.scale == 192 ** -0.5
    assert mla.q_a_layernorm.eps == 1e-6 and mla.kv_a_layernorm.eps == 1e-6


def test_bad_attn_form():
    mla = tiny_mla()
    mla.attn_form = "flash"
    with pytest.raises(ValueError, match="attn_form"):
        mla(torch.randn(1, 2, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cudnn_sdpa_matches_math_bf16():
    """The cuDNN SDPA path (bf16, K3 head dims 192/128) against the fp32 math path, with max_logit."""
    cfg = ModelConfig.preset("tiny").replace(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                             q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=128,
                                             qk_rope_head_dim=64, v_head_dim=128)
    torch.manual_seed(0)
    mla = GatedMLA(cfg, 3).cuda().train()
    x = torch.randn(2, 256, 256, device="cuda")
    ref, _ = mla(x)
    ref_max = mla.max_logit.clone()
    got, _ = mla.to(torch.bfloat16)(x.bfloat16())
    assert_close("cuDNN bf16 vs fp32 math", ref, got.float(), 2e-2)
    assert_close("max_logit (cuDNN path)", ref_max, mla.max_logit, 2e-2)
    got.float().sum().backward()
    assert torch.isfinite(mla.q_b_proj.weight.grad).all()


def test_attention_stays_fp32_under_bf16_autocast():
    """K3 keeps the attention output in fp32: the softmax attention ignores a bf16 autocast region (only
    the naive form's kv_b_proj, a projection, runs in bf16 there)."""
    mla = tiny_mla()
    x = torch.randn(2, 6, 32)
    inputs = mla.project(x, 0)
    for form, tol in (("absorbed", FP32_TOL), ("naive", BF16_TOL)):
        attend = getattr(mla, f"attend_{form}")
        ref = attend(*inputs, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = attend(*inputs, 0)
        assert got.dtype == torch.float32
        assert_close(f"{form} under autocast", ref, got, tol)


def _max_logit_reference(q, k, scale):
    """max over b, i, j <= i of q_i·k_j·scale per head, from the full float64 score matrix."""
    s = torch.einsum("bhik,bhjk->bhij", q.double(), k.double()) * scale
    T = q.shape[2]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return s.amax(dim=(0, 2, 3))


def test_causal_max_logit_equals_the_full_score_matrix(monkeypatch):
    """Query chunks (3 of them, the last partial) give the max of the whole causal score matrix."""
    from k3lab.mixers import mla

    monkeypatch.setattr(mla, "MAX_LOGIT_QUERY_CHUNK", 16)
    q, k = torch.randn(2, 3, 40, 24), torch.randn(2, 3, 40, 24)
    assert_close("max logit", _max_logit_reference(q, k, 0.2), mla.causal_max_logit(q, k, 0.2).double(), 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_causal_max_logit_bf16_tensor_cores_equal_float32():
    """bf16 q, k on CUDA (the bf16 GEMM with float32 output) against the same values in float32."""
    from k3lab.mixers.mla import causal_max_logit

    q = torch.randn(2, 4, 1500, 192, device="cuda").to(torch.bfloat16)
    k = torch.randn(2, 4, 1500, 192, device="cuda").to(torch.bfloat16)
    fast = causal_max_logit(q, k, 0.07)
    assert_close("max logit", _max_logit_reference(q.float(), k.float(), 0.07), fast.double(), 1e-6)
