"""MLA prefill chunk attention split in two and merged by log-sum-exp (k3lab.mixers.mla.prefill_chunk_attention):
the merge against one-shot attention on a CPU, the CUDA backends against the SDPA path of before on a GPU, and a CPU
smoke of kernels/profile_prefill.py."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from k3lab.config import ModelConfig
from k3lab.mixers import mla as mla_mod
from k3lab.mixers.mla import (GatedMLA, attention_lse_math, attention_math, chunk_attention_lse, merge_attention_lse,
                              prefill_chunk_attention)
from k3lab.testing import assert_close, load_script

FP32_TOL = 1e-5
BF16_TOL = 1e-2
PROFILE = Path(__file__).resolve().parents[1] / "kernels" / "profile_prefill.py"


def qkv(T, S, B=2, H=3, K=24, V=16, dtype=torch.float32, device="cpu", seed=0, gain=1.0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, T, K, generator=g, device=device) * gain
    k = torch.randn(B, H, S, K, generator=g, device=device)
    v = torch.randn(B, H, S, V, generator=g, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def full_lse(q, k, scale, offset):
    """log Σ_j e^{s_ij} over the keys query i sees (j <= offset + i), from the whole score matrix in float64."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale  # [B, H, T, S]
    s = s.masked_fill(~mla_mod.causal_mask(q.shape[2], k.shape[2], offset, q.device), float("-inf"))
    return torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("T, S", [(5, 20), (7, 7 + 13), (1, 9), (8, 32)])
@pytest.mark.parametrize("gain", [1.0, 40.0], ids=["plain", "large-logits"])
def test_merge_equals_one_shot_attention(T, S, gain):
    """Prefix (no mask) and chunk (square causal) apart, each with its reference log-sum-exp, merged: the one-shot
    causal attention of T queries at positions S − T .. S − 1, and its log-sum-exp. Large logits (lse ~ hundreds,
    e^{lse} overflowing float32) check that the merge never exponentiates an lse itself."""
    q, k, v = qkv(T, S, gain=gain)
    scale, P = 0.3, S - T
    o_a, lse_a = attention_lse_math(q, k[:, :, :P], v[:, :, :P], scale, causal=False)
    o_b, lse_b = attention_lse_math(q, k[:, :, P:], v[:, :, P:], scale, causal=True)
    o, lse = merge_attention_lse(o_a, lse_a, o_b, lse_b)
    want, _ = attention_math(q, k, v, scale, P)
    assert o.dtype == lse.dtype == torch.float32
    assert_close("merged o vs one-shot attention", want, o, FP32_TOL)
    assert_close("merged lse vs the whole score matrix", full_lse(q, k, scale, P), lse, FP32_TOL)
    if gain > 1:
        assert lse.abs().max() > 100  # e^lse is not representable in float32 here


def test_merge_is_associative_and_skips_empty_sets():
    """Three key sets merged two at a time equal one-shot attention; a set with lse = −inf weighs nothing."""
    T, S = 4, 30
    q, k, v = qkv(T, S, seed=1)
    scale, P = 0.25, S - T
    parts = [attention_lse_math(q, k[:, :, a:b], v[:, :, a:b], scale, causal=False) for a, b in ((0, 10), (10, P))]
    parts.append(attention_lse_math(q, k[:, :, P:], v[:, :, P:], scale, causal=True))
    o, lse = merge_attention_lse(*merge_attention_lse(*parts[0], *parts[1]), *parts[2])
    assert_close("three-way merge", attention_math(q, k, v, scale, P)[0], o, FP32_TOL)
    empty = torch.full_like(lse, float("-inf"))
    o2, lse2 = merge_attention_lse(torch.zeros_like(o), empty, o, lse)
    assert torch.equal(o2, o) and torch.equal(lse2, lse)


@pytest.mark.parametrize("T, S", [(6, 6), (6, 24), (1, 1), (3, 50)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
def test_prefill_chunk_attention_math_equals_attention_math(T, S, dtype, tol):
    q, k, v = qkv(T, S, dtype=dtype, seed=2)
    got = prefill_chunk_attention(q, k, v, 0.2, "math")
    want, _ = attention_math(q, k, v, 0.2, S - T)
    assert got.dtype == want.dtype
    assert_close(f"prefill_chunk_attention (math) T={T} S={S}", want, got, tol)


def test_argument_errors_name_the_parameter():
    q, k, v = qkv(4, 10)
    with pytest.raises(ValueError, match=r"^backend='triton': allowed values are \('cudnn', 'flash', 'efficient', 'math'\)$"):
        chunk_attention_lse(q, k, v, 0.1, False, "triton")
    with pytest.raises(ValueError, match=r"^causal=True: needs as many keys as queries"):
        chunk_attention_lse(q, k, v, 0.1, True, "math")
    with pytest.raises(ValueError, match=r"^k: a chunk on a cache needs S >= T keys, got S=3, T=4$"):
        prefill_chunk_attention(q, k[:, :, :3], v[:, :, :3], 0.1, "math")


def tiny_mla(seed=0, **kw) -> GatedMLA:
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny").replace(hidden_size=32, num_attention_heads=3, num_key_value_heads=3, **kw)
    return GatedMLA(cfg, layer_idx=3).eval()


def test_cpu_chunk_on_cache_keeps_the_math_path(monkeypatch):
    """Off CUDA (and in fp32) a chunk on a cache never takes the split path: today's float32 math path runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("prefill_chunk_attention called on a CPU")

    monkeypatch.setattr(mla_mod, "prefill_chunk_attention", refuse)
    mla = tiny_mla()
    x = torch.randn(1, 12, 32)
    with torch.no_grad():
        full, _ = mla(x)
        _, cache = mla(x[:, :5])
        y, _ = mla(x[:, 5:], cache)
    assert_close("chunk on cache vs one forward (CPU)", full[:, 5:], y, FP32_TOL)


def test_profile_prefill_smoke(tmp_path, capsys):
    """kernels/profile_prefill.py --smoke on a CPU: the three sections run and the JSON holds their numbers; the
    FLOP floor of a 1M-token `small` prefill is its attention term plus the weights' (checked independently)."""
    script = load_script(PROFILE, "profile_prefill")
    out_json = tmp_path / "p.json"
    assert script.main(["--smoke", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for needle in ("one 64-token chunk at offset 192", "MLA chunk attention alone", "FLOP floor", "MLA causal attention"):
        assert needle in text
    got = json.loads(out_json.read_text())
    assert set(got["profile"]["paths"]["sdpa"]["categories_ms"]) <= {c for c, _ in script.CATEGORIES} | {script.OTHER}
    assert all(r["rel_err"]["math"] < FP32_TOL for r in got["attention"]["rows"])
    cfg, N = ModelConfig.preset("small"), 1 << 20
    fl = got["floor"]
    attn = 4 * 2 * 8 * (192 + 128) * N * (N + 1) // 2  # small: 4 MLA layers, H = 8, d_qk = 192, d_v = 128
    assert fl["rows"]["MLA causal attention"] == attn
    active = cfg.param_counts()["active"] - cfg.param_counts()["by_component"]["lm_head"]["active"]
    weights = sum(v for name, v in fl["rows"].items() if name not in ("MLA causal attention", "KDA chunk work",
                                                                       "LM head (last position)"))
    assert weights == 2 * active * N
    assert fl["seconds"] == pytest.approx(fl["total"] / 989e12)


def test_classify_kernel_names():
    script = load_script(PROFILE, "profile_prefill")
    cases = {
        "kda_fwd_state_kernel": "KDA chunk kernels",
        "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0": "MLA attention",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)": "MLA attention",
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<192, 128, 64, 8, false>>": "MLA attention",
        "void cutlass::device_kernel<GemmUniversal<cutlass::gemm::GroupProblemShape<...>>>": "MoE grouped GEMMs",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "dense GEMMs",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "dense GEMMs",
        "void at::native::vectorized_elementwise_kernel<4, ...>": "elementwise/copy/reduce",
        "_gather_sum_kernel": "elementwise/copy/reduce",
        "aten::mm": "dense GEMMs",
        "aten::exp": "elementwise/copy/reduce",
        "some_unknown_kernel": "other",
    }
    for name, category in cases.items():
        assert script.classify(name) == category, name


# ----------------------------------------------------------------------------------------------
# GPU: the fused backends against the SDPA call of before (lower-right causal mask) and fp32 math
SMALL_MLA = dict(H=8, nope=128, rope=64, V=128)  # `small`'s MLA heads: d_qk = 192, d_v = 128


def cuda_qkv(T, S, dtype=torch.bfloat16, seed=0):
    """q [1, H, T, 192], k [1, H, S, 192], v [1, H, S, 128] strided as attend_naive builds them ([B, S, H, d]
    transposed; v a slice of kv_b_proj's [B, S, H, nope + v] output)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, nope, dqk, V = SMALL_MLA["H"], SMALL_MLA["nope"], SMALL_MLA["nope"] + SMALL_MLA["rope"], SMALL_MLA["V"]
    q = torch.randn(1, T, H, dqk, device="cuda", generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, S, H, dqk, device="cuda", generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(1, S, H, nope + V, device="cuda", generator=g).to(dtype)[..., nope:].transpose(1, 2)
    return q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("T, S", [(256, 256), (256, 1024), (1000, 1000), (1000, 4000), (200, 3000), (64, 4096)])
def test_prefill_chunk_attention_equals_sdpa_gpu(backend, T, S):
    """The split + merge on each fused backend equals the single lower-right-masked SDPA call (the old path) and the
    float32 math to bf16 tolerance, for S = T (no prefix), S = 4T and ragged lengths; its lse is the natural-log
    log-sum-exp of the float32 scores."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v = cuda_qkv(T, S)
    scale = 192 ** -0.5
    with torch.no_grad():
        got = prefill_chunk_attention(q, k, v, scale, backend)
        old = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S), scale=scale).float()
        ref, _ = attention_math(q, k, v, scale, S - T)
        assert got.dtype == torch.float32 and got.shape == (1, 8, T, 128)
        assert_close(f"{backend} vs old SDPA path", old, got, BF16_TOL)
        assert_close(f"{backend} vs fp32 math", ref, got, BF16_TOL)
        n = max(S - T, 128)  # an unmasked key set of its own (the prefix part, or 128 keys where there is none)
        o, lse = chunk_attention_lse(q, k[:, :, :n], v[:, :, :n], scale, False, backend)
        o_ref, lse_ref = attention_lse_math(q, k[:, :, :n], v[:, :, :n], scale, False)
        assert lse.shape == (1, 8, T) and o.shape == (1, 8, T, 128)
        assert (lse - lse_ref).abs().max().item() < 2e-2  # bf16 inputs, float32 scores: same lse to rounding
        assert_close(f"{backend} unmasked o", o_ref, o.float(), BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("prefix, T", [(0, 256), (768, 256), (100, 200), (4000, 96)])
def test_gated_mla_chunk_on_cache_new_path_equals_old_gpu(monkeypatch, prefix, T):
    """A GatedMLA layer with `small`'s head dims in bf16 on CUDA: a chunk on a cache without grad takes the split path
    (checked by counting calls), equal to the old lower-right SDPA path within bf16 tolerance; with grad enabled, and
    with PREFILL_ATTENTION = "sdpa", the old path runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = ModelConfig.preset("small")
    torch.manual_seed(0)
    mla = GatedMLA(cfg, layer_idx=3).to("cuda", torch.bfloat16).eval()
    x = torch.randn(1, prefix + T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = mla_mod.prefill_chunk_attention

    def counted(*args, **kwargs):
        calls.append(args[3:])
        return real(*args, **kwargs)

    monkeypatch.setattr(mla_mod, "prefill_chunk_attention", counted)
    with torch.no_grad():
        cache = mla(x[:, :prefix])[1] if prefix else None
        new, _ = mla(x[:, prefix:], cache)
        assert len(calls) == (1 if prefix else 0)  # offset 0: the fused cuDNN is_causal branch, as before
        monkeypatch.setattr(mla_mod, "PREFILL_ATTENTION", "sdpa")
        old, _ = mla(x[:, prefix:], cache)
        assert len(calls) == (1 if prefix else 0)
    assert_close("GatedMLA chunk on cache, split vs old SDPA", old.float(), new.float(), BF16_TOL)
    monkeypatch.setattr(mla_mod, "PREFILL_ATTENTION", "cudnn")
    with torch.enable_grad():
        mla(x[:, prefix:], cache)  # grad enabled: the old SDPA path
    assert len(calls) == (1 if prefix else 0)
