"""The linear-attention lineage: recurrence == chunkwise form (float64, forward and gradients),
state chaining, and KDA == fla's naive_recurrent_kda (docs/k3_reference.md §2.2-2.3)."""

import pytest
import torch
import torch.nn.functional as F

from k3lab.mixers import chunk, lineage
from k3lab.testing import assert_close

FP64_TOL = 1e-10
FP32_TOL = 1e-5

MIXERS = ("linear_attention", "retnet", "mamba2", "deltanet", "gated_deltanet", "kda")


def make_inputs(mixer, B=2, T=37, H=3, K=8, V=6, dtype=torch.float64, seed=0):
    """Random inputs for one mixer: (q, k, v, mixer-specific args, initial_state), all leaves with grad."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k, v = rand(B, T, H, K), F.normalize(rand(B, T, H, K), dim=-1), rand(B, T, H, V)
    gate_scalar = -F.softplus(rand(B, T, H))  # log-decay ≤ 0
    gate_channel = -F.softplus(rand(B, T, H, K))
    beta = torch.sigmoid(rand(B, T, H))
    gamma = 1 - torch.sigmoid(rand(H)) / 4  # fixed decay in (0.75, 1)
    extra = {
        "linear_attention": (),
        "retnet": (gamma,),
        "mamba2": (gate_scalar,),
        "deltanet": (beta,),
        "gated_deltanet": (gate_scalar, beta),
        "kda": (gate_channel, beta),
    }[mixer]
    tensors = [x.detach().requires_grad_() for x in (q, k, v, *extra, rand(B, H, K, V))]
    return tensors[:3], tensors[3:-1], tensors[-1]


def run(form, mixer, qkv, extra, h0, **kw):
    fn = getattr(lineage if form == "recurrent" else chunk, f"{mixer}_{form}")
    return fn(*qkv, *extra, initial_state=h0, **kw)


@pytest.mark.parametrize("T,chunk_size", [(37, 8), (100, 16), (100, 64), (5, 64)], ids=lambda x: str(x))
@pytest.mark.parametrize("mixer", MIXERS)
def test_chunk_equals_recurrence_fp64(mixer, T, chunk_size):
    qkv, extra, h0 = make_inputs(mixer, T=T)
    leaves = [*qkv, *extra, h0]
    o_ref, s_ref = run("recurrent", mixer, qkv, extra, h0)
    o, s = run("chunk", mixer, qkv, extra, h0, chunk_size=chunk_size)
    assert_close(f"{mixer} o", o_ref, o, FP64_TOL)
    assert_close(f"{mixer} final_state", s_ref, s, FP64_TOL)

    do, ds = torch.randn_like(o_ref), torch.randn_like(s_ref)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), leaves)
    grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves)
    names = ["q", "k", "v", *[f"extra{i}" for i in range(len(extra))], "initial_state"]
    for name, ref, got in zip(names, grads_ref, grads):
        assert_close(f"{mixer} d{name}", ref, got, FP64_TOL)


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
@pytest.mark.parametrize("mixer", MIXERS)
def test_split_sequence_with_state_equals_full(mixer, form):
    """Running [0, 23) then [23, 50) with the state carried == one run over [0, 50)."""
    qkv, extra, h0 = make_inputs(mixer, T=50)
    kw = {"chunk_size": 16} if form == "chunk" else {}
    o_full, s_full = run(form, mixer, qkv, extra, h0, **kw)

    def piece(x, sl):
        return x if x.dim() == 1 else x[:, sl]  # retnet's gamma [H] is not per token

    first, second = slice(0, 23), slice(23, 50)
    o1, s1 = run(form, mixer, [x[:, first] for x in qkv], [piece(x, first) for x in extra], h0, **kw)
    o2, s2 = run(form, mixer, [x[:, second] for x in qkv], [piece(x, second) for x in extra], s1, **kw)
    assert_close(f"{mixer} o (split)", o_full, torch.cat([o1, o2], dim=1), FP64_TOL)
    assert_close(f"{mixer} state (split)", s_full, s2, FP64_TOL)


def test_kda_chunk_float32_and_no_final_state():
    """bf16/fp32 inputs compute in fp32: o in the input dtype, state fp32; output_final_state=False gives None."""
    qkv, extra, h0 = make_inputs("kda", T=40, dtype=torch.float32)
    o_ref, s_ref = run("recurrent", "kda", qkv, extra, h0)
    o, s = run("chunk", "kda", qkv, extra, h0, chunk_size=16)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert_close("kda o fp32", o_ref, o, FP32_TOL)
    assert_close("kda state fp32", s_ref, s, FP32_TOL)
    for fn in (lineage.kda_recurrent, chunk.kda_chunk):
        o_bf16, none = fn(*(x.bfloat16() for x in qkv), *extra, output_final_state=False)
        assert o_bf16.dtype == torch.bfloat16 and none is None


def test_kda_recurrent_matches_fla_naive():
    naive = pytest.importorskip("fla.ops.kda.naive", reason="fla (flash-linear-attention) not importable")
    qkv, extra, h0 = make_inputs("kda", T=33, dtype=torch.float32, seed=1)
    scale = 0.3
    o_ref, s_ref = naive.naive_recurrent_kda(*qkv, *extra, scale=scale, initial_state=h0, output_final_state=True)
    o, s = lineage.kda_recurrent(*qkv, *extra, scale=scale, initial_state=h0)
    assert_close("kda o vs fla", o_ref, o, FP32_TOL)
    assert_close("kda state vs fla", s_ref, s, FP32_TOL)


def test_delta_rule_replaces_value_of_repeated_key():
    """DeltaNet with beta = 1 and a unit key stores the *last* value written under that key;
    linear attention returns the sum of both writes."""
    k = F.normalize(torch.randn(1, 1, 1, 4, dtype=torch.float64), dim=-1).expand(1, 2, 1, 4)
    v = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 1.0]]]], dtype=torch.float64).reshape(1, 2, 1, 2)
    beta = torch.ones(1, 2, 1, dtype=torch.float64)
    o_delta, _ = lineage.deltanet_recurrent(k, k, v, beta, scale=1.0)
    o_linear, _ = lineage.linear_attention_recurrent(k, k, v, scale=1.0)
    assert_close("delta recall", v[:, 1], o_delta[:, 1], FP64_TOL)
    assert_close("linear recall", v[:, 0] + v[:, 1], o_linear[:, 1], FP64_TOL)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda q, v: lineage.kda_recurrent(q, q, v, q[..., 0], q[..., 0, 0]), "kda g"),
        (lambda q, v: chunk.mamba2_chunk(q, q, v, q), "mamba2 g"),
        (lambda q, v: chunk.retnet_chunk(q, q, v, torch.full((2,), 1.5)), "gamma"),
        (lambda q, v: chunk.deltanet_chunk(q, q, v, q[..., 0, 0]), "beta"),
        (lambda q, v: chunk.linear_attention_chunk(q, q, v[:, :3]), "v must"),
        (lambda q, v: chunk.linear_attention_chunk(q, q, v, chunk_size=0), "chunk_size"),
    ],
)
def test_bad_inputs_raise(call, match):
    q, v = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 3)
    with pytest.raises(ValueError, match=match):
        call(q, v)


@pytest.mark.parametrize("mixer", ["linear", "retnet", "mamba2", "deltanet", "gated_deltanet", "kda", "softmax"])
def test_mixer_lm_is_causal_and_trains(mixer):
    """MixerLM: logits [B, T, vocab], finite loss on pre-aligned labels, gradients reach every
    parameter, and changing a future token leaves earlier logits unchanged (causality, odd T, 2 chunks)."""
    from k3lab.experiments.toy import MixerLM

    torch.manual_seed(0)
    model = MixerLM(vocab_size=16, d_model=16, n_layers=2, mixer=mixer, num_heads=2, chunk_size=8)
    x = torch.randint(0, 16, (2, 13))
    labels = torch.full_like(x, -100)
    labels[:, 5] = x[:, 6]
    out = model(x, labels=labels)
    assert out.logits.shape == (2, 13, 16) and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    x2 = x.clone()
    x2[:, 9] = (x[:, 9] + 1) % 16
    with torch.no_grad():
        assert_close(f"{mixer} causal prefix", model(x).logits[:, :9], model(x2).logits[:, :9], FP32_TOL)
        assert not torch.allclose(model(x).logits[:, 9:], model(x2).logits[:, 9:])


def test_mixer_lm_rejects_unknown_mixer():
    from k3lab.experiments.toy import MixerLM

    with pytest.raises(ValueError, match="mixer must be one of"):
        MixerLM(vocab_size=16, d_model=16, n_layers=1, mixer="mamba3", num_heads=2)
