"""The K3 KDA layer (docs/k3_reference.md §2.1–2.5, names §1.2): gates vs fla's references, init, checkpoint
names/shapes, cache semantics (token by token == full == split), conv state, gradients, errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3lab.config import ModelConfig
from k3lab.mixers.kda import KDA, KDACache, causal_conv1d, kda_gate, kda_gate_reference, l2norm
from k3lab.experiments.numerics import factored_chunk_attention, factored_errors, log_range, pairwise_chunk_attention
from k3lab.testing import assert_close

FP64_TOL = 1e-10
FP32_TOL = 1e-5
GATE_TOL = 1e-6  # float32 gate vs fla's float32 reference


@pytest.fixture(scope="module")
def fla_ref():
    """fla's torch references (importing fla takes ~6 s on CPU; skipped when it cannot import)."""
    try:
        from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
        from fla.ops.kda.naive import naive_recurrent_kda
    except Exception as err:  # fla pulls in Triton; any import failure means "not testable here"
        pytest.skip(f"fla cannot be imported on this machine: {err!r}")
    return dict(gate=naive_kda_gate, lowerbound_gate=naive_kda_lowerbound_gate, recurrent=naive_recurrent_kda)


def tiny_cfg(**kw):
    return ModelConfig.preset("tiny").replace(**{"backend": "torch", **kw})


def make_layer(dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    layer = KDA(tiny_cfg(**kw), layer_idx=0).to(dtype)
    with torch.no_grad():  # move A_log off its init so e^A is exercised
        layer.A_log.uniform_(-1, 1)
    return layer


def rand_x(layer, B=2, T=70, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, layer.cfg.hidden_size, generator=gen, dtype=dtype)


# --- gate -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k3", "kimi_linear"])
def test_gate_matches_fla(fla_ref, kind):
    torch.manual_seed(0)
    H, K = 3, 8
    z, A_log, dt_bias = 3 * torch.randn(2, 5, H, K), torch.randn(H), torch.randn(H * K)
    got = kda_gate(z, A_log, dt_bias, kind, lower_bound=-5.0)
    if kind == "k3":
        ref = fla_ref["lowerbound_gate"](z, A_log, dt_bias, lower_bound=-5.0)
    else:
        ref = fla_ref["gate"](z, A_log, dt_bias)
    assert got.dtype == torch.float32
    assert_close(f"{kind} gate", ref, got, GATE_TOL)


def test_gate_bounds():
    torch.manual_seed(0)
    H, K = 4, 16
    A_log, dt_bias = 0.1 * torch.randn(H), 0.5 * torch.randn(H * K)
    z = torch.linspace(-8, 8, 2 * 7 * H * K).view(2, 7, H, K)  # |e^A (z + b)| < 16: σ not rounded to 0 or 1
    g = kda_gate(z, A_log, dt_bias, "k3", lower_bound=-5.0)
    assert bool((g > -5).all()) and bool((g < 0).all()), (g.min().item(), g.max().item())
    huge = kda_gate(1e4 * z, A_log, dt_bias, "k3", lower_bound=-5.0)  # saturated sigmoid: the bound itself
    assert huge.min().item() >= -5.0
    unbounded = kda_gate(1e2 * z, A_log, dt_bias, "kimi_linear")
    assert unbounded.max().item() <= 0 and unbounded.min().item() < -100  # the softplus gate has no floor
    z_mid = torch.zeros(1, 1, H, K)
    g_mid = kda_gate(z_mid, torch.zeros(H), torch.zeros(H * K), "k3", lower_bound=-5.0)
    assert torch.equal(g_mid, torch.full_like(g_mid, -2.5))  # σ(0) = 1/2


def _gate_inputs(dtype, seed=0, B=2, T=5, H=3, K=4):
    gen = torch.Generator().manual_seed(seed)
    z = (3 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    A_log = torch.randn(H, generator=gen, dtype=torch.float64).float().requires_grad_()
    dt_bias = torch.randn(H * K, generator=gen, dtype=torch.float64).float().requires_grad_()
    return z, A_log, dt_bias


def test_k3_gate_function_gradients_equal_autograd_on_the_formula():
    """K3GateFunction (saves z, recomputes σ) vs autograd on kda_gate_reference (keeps σ): float64
    gradcheck, and equal values and gradients in float32 and for bf16 z (as under autocast)."""
    z, A_log, dt_bias = _gate_inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda *t: kda_gate(*t, kind="k3", lower_bound=-5.0),
                                    (z, A_log.double().detach().requires_grad_(), dt_bias.double().detach().requires_grad_()))
    for dtype in (torch.float32, torch.bfloat16):
        z, A_log, dt_bias = _gate_inputs(dtype, seed=1)
        grad = torch.randn(z.shape, generator=torch.Generator().manual_seed(2))
        got = kda_gate(z, A_log, dt_bias, "k3", lower_bound=-5.0)
        assert got.grad_fn.name().startswith("K3GateFunction")
        ref = kda_gate_reference(z, A_log, dt_bias, "k3", lower_bound=-5.0)
        assert torch.equal(got, ref)
        g_got = torch.autograd.grad(got, (z, A_log, dt_bias), grad)
        g_ref = torch.autograd.grad(ref, (z, A_log, dt_bias), grad)
        for a, b, name in zip(g_got, g_ref, ("z", "A_log", "dt_bias")):
            assert a.dtype == b.dtype, name
            assert_close(f"d{name} {dtype}", b.float(), a.float(), 1e-6 if dtype == torch.float32 else 1e-2)


def test_kda_op_gets_contiguous_inputs(monkeypatch):
    """The recurrence's inputs leave the layer contiguous (the conv writes [B, T, D]): the Triton op's
    ``.contiguous()`` copies nothing, so it keeps no second copy of v for backward."""
    layer = make_layer(torch.float32)
    seen = {}

    def spy(q, k, v, g, beta, initial_state):
        seen.update(q=q, k=k, v=v, g=g, beta=beta)
        return KDA.mix(layer, q, k, v, g, beta, initial_state)

    monkeypatch.setattr(layer, "mix", spy)
    layer(rand_x(layer, dtype=torch.float32))
    assert {name: t.is_contiguous() for name, t in seen.items()} == dict.fromkeys(seen, True)


def test_gate_rejects_bad_arguments():
    z = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="kind"):
        kda_gate(z, torch.zeros(2), torch.zeros(8), "softmax")
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(z, torch.zeros(3), torch.zeros(8), "k3")
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(z, torch.zeros(2), torch.zeros(4), "k3")
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(z, torch.zeros(2), torch.zeros(8), "k3", lower_bound=0.0)


# --- init and checkpoint layout -------------------------------------------------------------------


def test_init_A_log_and_dt_bias():
    torch.manual_seed(0)
    k3 = KDA(tiny_cfg(linear_attn_config=dict(num_heads=4, head_dim=64)), 0)
    assert torch.equal(k3.A_log, torch.zeros(4))  # K3-TR: A_h = 0
    dt = F.softplus(k3.dt_bias.detach())  # inverse-softplus init: softplus(dt_bias) = dt ∈ [1e-3, 1e-1]
    assert dt.min().item() >= 1e-3 * (1 - 1e-5) and dt.max().item() <= 1e-1 * (1 + 1e-5)
    lo, hi = (d + math.log(-math.expm1(-d)) for d in (1e-3, 1e-1))  # ≈ -6.907, -2.252
    assert k3.dt_bias.min().item() >= lo - 1e-5 and k3.dt_bias.max().item() <= hi + 1e-5
    assert k3.dt_bias.max().item() - k3.dt_bias.min().item() > 3  # log-uniform: spread over the range
    kl = KDA(tiny_cfg(kda_gate="kimi_linear"), 0)
    a = kl.A_log.detach().exp()
    assert a.min().item() >= 1 and a.max().item() <= 16  # Kimi Linear: A ~ log U(1, 16)
    for p in (k3.A_log, k3.dt_bias, k3.q_conv1d.weight, k3.k_conv1d.weight, k3.v_conv1d.weight):
        assert p.dtype == torch.float32


def test_k3_parameter_names_and_shapes_on_meta():
    with torch.device("meta"):
        layer = KDA(ModelConfig.preset("k3"), layer_idx=0)
    expected = {  # docs/k3_reference.md §1.2, "self_attn." dropped
        "q_proj.weight": (12288, 7168), "k_proj.weight": (12288, 7168), "v_proj.weight": (12288, 7168),
        "q_conv1d.weight": (12288, 1, 4), "k_conv1d.weight": (12288, 1, 4), "v_conv1d.weight": (12288, 1, 4),
        "f_a_proj.weight": (128, 7168), "f_b_proj.weight": (12288, 128), "dt_bias": (12288,), "A_log": (96,),
        "b_proj.weight": (96, 7168), "g_proj.weight": (12288, 7168),
        "o_norm.weight": (128,), "o_proj.weight": (7168, 12288),
    }
    got = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert got == expected
    for name in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "dt_bias", "A_log"):
        assert layer.get_parameter(name).dtype == torch.float32, name
    assert layer.muon_head_splits == {"q_proj": 96, "k_proj": 96, "v_proj": 96}
    assert sum(p.numel() for p in layer.parameters()) == _kda_params_from_config(ModelConfig.preset("k3"))


def _kda_params_from_config(cfg):
    """The KDA entry of the lead's param_counts() (per KDA layer)."""
    counts = cfg.param_counts()["by_component"]["kda"]["total"]
    n_kda = sum(not cfg.is_mla_layer(i) for i in range(cfg.num_hidden_layers))
    return counts // n_kda


# --- cache: token by token == full == split ------------------------------------------------------------


@pytest.mark.parametrize("kind,dtype,tol", [("k3", torch.float64, FP64_TOL), ("k3", torch.float32, FP32_TOL),
                                            ("kimi_linear", torch.float32, FP32_TOL)], ids=["k3-fp64", "k3-fp32", "kl-fp32"])
def test_token_by_token_equals_full(kind, dtype, tol):
    layer = make_layer(dtype, kda_gate=kind)
    x = rand_x(layer, T=70, dtype=dtype)  # 70 > the reference's 64-token chunk
    y, cache = layer(x)
    ys, c = [], None
    with torch.no_grad():
        for t in range(x.shape[1]):
            y_t, c = layer(x[:, t : t + 1], c)
            ys.append(y_t)
    assert_close(f"{kind} y", y, torch.cat(ys, dim=1), tol)
    assert_close(f"{kind} recurrent state", cache.recurrent, c.recurrent, tol)
    for name in ("conv_q", "conv_k", "conv_v"):  # projections of one token vs all: rounding may differ
        assert_close(name, getattr(cache, name), getattr(c, name), tol)


@pytest.mark.parametrize("split", [2, 33, 64])
def test_split_with_state_equals_full(split):
    layer = make_layer(torch.float64)
    x = rand_x(layer, T=70)
    y, cache = layer(x)
    y1, c1 = layer(x[:, :split])
    y2, c2 = layer(x[:, split:], c1)
    assert_close("y", y, torch.cat([y1, y2], dim=1), FP64_TOL)
    assert_close("recurrent state", cache.recurrent, c2.recurrent, FP64_TOL)


def test_split_fp32():
    layer = make_layer(torch.float32)
    x = rand_x(layer, T=70, dtype=torch.float32)
    y, cache = layer(x)
    y1, c1 = layer(x[:, :37])
    y2, c2 = layer(x[:, 37:], c1)
    assert_close("y", y, torch.cat([y1, y2], dim=1), FP32_TOL)
    assert_close("recurrent state", cache.recurrent, c2.recurrent, FP32_TOL)


def test_cache_layout():
    layer = make_layer(torch.float32)
    _, cache = layer(rand_x(layer, B=3, T=5, dtype=torch.float32))
    H, K, W = layer.num_heads, layer.head_k_dim, layer.conv_size
    assert isinstance(cache, KDACache)
    assert cache.recurrent.shape == (3, H, K, K) and cache.recurrent.dtype == torch.float32
    for name in ("conv_q", "conv_k", "conv_v"):
        assert getattr(cache, name).shape == (3, H * K, W - 1), name


def test_layer_matches_fla_naive_pieces(fla_ref):
    """The layer == an independent composition: causal conv by left padding, fla's naive gate and recurrence."""
    layer = make_layer(torch.float64)
    x = rand_x(layer, T=20)
    B, T, _ = x.shape
    H, K, W = layer.num_heads, layer.head_k_dim, layer.conv_size

    def conv_silu(proj, conv):
        h = F.pad(proj(x).transpose(1, 2), (W - 1, 0))
        return F.silu(F.conv1d(h, conv.weight, groups=h.shape[1])).transpose(1, 2).reshape(B, T, H, K)

    q, k, v = (conv_silu(p, c) for p, c in ((layer.q_proj, layer.q_conv1d), (layer.k_proj, layer.k_conv1d),
                                             (layer.v_proj, layer.v_conv1d)))
    q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    z = layer.f_b_proj(layer.f_a_proj(x)).view(B, T, H, K)
    g = fla_ref["lowerbound_gate"](z, layer.A_log, layer.dt_bias, lower_bound=-5.0, output_dtype=torch.float64)
    o, _ = fla_ref["recurrent"](q, k, v, g, torch.sigmoid(layer.b_proj(x)))
    o = layer.o_norm(o) * torch.sigmoid(layer.g_proj(x)).view(B, T, H, K)
    ref = layer.o_proj(o.reshape(B, T, H * K))
    assert_close("y vs fla naive pieces", ref, layer(x)[0], FP32_TOL)  # fla's naive gate computes in float32


# --- short convolution ---------------------------------------------------------------------------------


def test_causal_conv1d_state_semantics():
    torch.manual_seed(0)
    B, T, D, W = 2, 9, 5, 4
    x, w = torch.randn(B, T, D, dtype=torch.float64), torch.randn(D, 1, W, dtype=torch.float64)
    y, state = causal_conv1d(x, w)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), w, groups=D).transpose(1, 2)
    assert_close("conv", ref, y, FP64_TOL)
    assert torch.equal(state, x[:, -(W - 1):].transpose(1, 2))  # the last W-1 inputs, oldest first
    assert y[:, 0].allclose(x[:, 0] * w[:, 0, -1])  # causal: token 0 sees only itself (zero history)
    s = None
    for t in range(T):  # pieces shorter than W-1 shift the tail
        y_t, s = causal_conv1d(x[:, t : t + 1], w, s)
        assert_close(f"conv token {t}", y[:, t : t + 1], y_t, FP64_TOL)
    assert torch.equal(s, state)
    _, s2 = causal_conv1d(x[:, :2], w, state)  # T = 2 < W-1: one old input survives
    assert torch.equal(s2, torch.cat([state[..., 2:], x[:, :2].transpose(1, 2)], dim=-1))


def test_causal_conv1d_rejects_bad_shapes():
    x = torch.zeros(1, 3, 4)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.zeros(5, 1, 4))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(x, torch.zeros(4, 1, 4), torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="x must be"):
        causal_conv1d(torch.zeros(3, 4), torch.zeros(4, 1, 4))


# --- gradients and errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k3", "kimi_linear"])
def test_gradients_reach_every_parameter(kind):
    layer = make_layer(torch.float32, kda_gate=kind)
    x = rand_x(layer, T=20, dtype=torch.float32).requires_grad_()
    y, cache = layer(x)
    (y.square().mean() + cache.recurrent.square().mean()).backward()
    for name, p in [("x", x), *layer.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max().item() > 0, f"{name}: zero gradient"


def test_bad_config_and_inputs_raise():
    with pytest.raises(ValueError, match="kda_gate"):
        tiny_cfg(kda_gate="softplus")
    with pytest.raises(ValueError, match="gate_lower_bound"):
        tiny_cfg(linear_attn_config=dict(gate_lower_bound=1.0))
    layer = make_layer(torch.float32)
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.zeros(1, 3, layer.cfg.hidden_size + 1))
    fla_layer = KDA(tiny_cfg(backend="fla"), 0)
    with pytest.raises(ValueError, match="backend"):  # fla / triton need CUDA: no silent fallback
        fla_layer(torch.zeros(1, 3, layer.cfg.hidden_size))


# --- numerics of the factored chunk form (notebook 03) --------------------------------------------------


def test_log_range():
    assert log_range(torch.bfloat16)[1] == pytest.approx(88.72, abs=0.01)
    assert log_range(torch.float16)[1] == pytest.approx(11.09, abs=0.01)
    assert log_range(torch.float32)[0] == pytest.approx(-87.34, abs=0.01)


def test_factored_tile_matches_pairwise_and_overflows_past_the_floor():
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 64, 2, 16
    q, k = (l2norm(torch.randn(B, T, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5 * torch.rand(B, T, H, K, generator=gen)  # inside K3's bound
    ref = pairwise_chunk_attention(q, k, v, g, 16)
    assert_close("fp32 factored", ref, factored_chunk_attention(q, k, v, g, 16, torch.float32), FP32_TOL)
    assert_close("bf16 factored", ref, factored_chunk_attention(q, k, v, g, 16, torch.bfloat16), 2e-2)
    at_floor = factored_errors(q, k, v, torch.full_like(g, -5.0), 16, (torch.bfloat16, torch.float16))
    assert at_floor[torch.bfloat16]["nonfinite_rows"] == 0  # G_16 = -80 fits bf16
    assert at_floor[torch.float16]["nonfinite_rows"] > 0  # but not fp16
    past = factored_errors(q, k, v, torch.full_like(g, -5.6), 16, (torch.bfloat16,))[torch.bfloat16]
    assert past["nonfinite_rows"] == pytest.approx(1 / 16)  # only the 16th token: G_16 = -89.6 < -88.7


# --- GPU: the fla and Triton backends against the torch reference -----------------------------------------

GPU_FP32_TOL = 5e-3  # fused kernels with tf32/bf16x3 dots vs the fp32 reference
GPU_BF16_TOL = 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend,kind,dtype", [("fla", "k3", torch.float32), ("fla", "kimi_linear", torch.float32),
                                                ("fla", "k3", torch.bfloat16), ("triton", "k3", torch.float32),
                                                ("triton", "k3", torch.bfloat16)],
                         ids=["fla-k3-fp32", "fla-kl-fp32", "fla-k3-bf16", "triton-k3-fp32", "triton-k3-bf16"])
def test_gpu_backend_matches_torch(backend, kind, dtype):
    if backend == "fla":
        pytest.importorskip("fla")
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(kda_gate=kind, hidden_size=256,
                                             linear_attn_config=dict(num_heads=16, head_dim=128))
    ref = KDA(cfg.replace(backend="torch"), 0).cuda()
    fast = KDA(cfg.replace(backend=backend), 0).cuda()
    fast.load_state_dict(ref.state_dict())
    fast.to(dtype)
    tol = GPU_FP32_TOL if dtype == torch.float32 else GPU_BF16_TOL
    x = torch.randn(2, 200, cfg.hidden_size, device="cuda")  # 200: a partial last chunk
    y_ref, c_ref = ref(x)
    y, c = fast(x.to(dtype))
    assert_close(f"{backend} y", y_ref, y.float(), tol)
    assert_close(f"{backend} state", c_ref.recurrent, c.recurrent, tol)
    dy = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad((y_ref * dy).sum(), list(ref.parameters()))
    grads = torch.autograd.grad((y.float() * dy).sum(), list(fast.parameters()))
    for (name, _), g_ref, g in zip(ref.named_parameters(), grads_ref, grads):
        assert_close(f"{backend} grad {name}", g_ref, g.float(), 2 * tol)
    with torch.no_grad():  # a prompt, then one-token decoding (fused_recurrent_kda / kda_decode_step)
        _, c1 = fast(x[:, :198].to(dtype))
        y2, c2 = fast(x[:, 198:199].to(dtype), c1)
        y3, c3 = fast(x[:, 199:].to(dtype), c2)
    assert_close(f"{backend} decode", y_ref[:, 198:], torch.cat([y2, y3], dim=1).float(), tol)
    assert_close(f"{backend} decode state", c_ref.recurrent, c3.recurrent, tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_backend_refuses_unbounded_gate():
    layer = KDA(tiny_cfg(backend="triton", kda_gate="kimi_linear"), 0).cuda()
    with pytest.raises(ValueError, match="bounded gate"):
        layer(torch.zeros(1, 4, layer.cfg.hidden_size, device="cuda"))


def test_auto_backend_picks_a_path_that_takes_the_gate():
    from k3lab.mixers.kda import kda_backend

    # CUDA + K3's bounded gate: our Triton kernels; an unbounded (Kimi Linear) gate: fla where installed, else torch
    assert kda_backend("auto", "cuda", True, lambda: True) == "triton"
    assert kda_backend("auto", "cuda", False, lambda: True) == "fla"
    assert kda_backend("auto", "cuda", False, lambda: False) == "torch"
    assert kda_backend("auto", "cpu", False, lambda: True) == "torch"
    assert kda_backend("triton", "cuda", False, lambda: True) == "triton"  # explicit: kept, and refused by the layer
    with pytest.raises(ValueError, match=r"backend='fast': allowed values are"):
        kda_backend("fast", "cpu", True)
