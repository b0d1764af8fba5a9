"""Attention Residuals (docs/k3_reference.md §1.1, §4): the formula against fla, the block bookkeeping against
a literal transcription of the reference pseudocode, the full form, zero-init uniformity."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from k3lab.residual import AttnResStream, PreNormStream, attn_res, depth_weights_matrix, residual_stream
from k3lab.testing import assert_close

FP32_TOL = 1e-5
FP64_TOL = 1e-12
D = 16


def res_params(seed: int, scale: float = 0.5, eps: float = 1e-5) -> tuple[nn.Linear, nn.RMSNorm]:
    torch.manual_seed(seed)
    proj, norm = nn.Linear(D, 1, bias=False), nn.RMSNorm(D, eps=eps)
    with torch.no_grad():
        proj.weight.normal_(0, scale)
        norm.weight.uniform_(0.5, 1.5)
    return proj.double(), norm.double()


def reference_attn_res(sources, proj, norm):
    """docs/k3_reference.md §4 per source: logit_i = w · RMSNorm(v_i), softmax over sources, sum of raw v_i."""
    w = proj.weight[0]
    logits = []
    for v in sources:
        rms = torch.sqrt((v * v).mean(-1, keepdim=True) + norm.eps)
        logits.append(((v / rms) * norm.weight * w).sum(-1))
    m = torch.stack(logits).amax(0)
    e = [torch.exp(l - m) for l in logits]
    z = sum(e)
    return sum((ei / z)[..., None] * v for ei, v in zip(e, sources))


def load_fla_naive_attnres():
    """fla's ``naive_attnres``, loaded from its file alone: importing the fla package takes ~7 s on CPU
    (it sets up Triton); ``fla/ops/attnres/naive.py`` itself needs only torch and einops."""
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        pytest.skip("fla (flash-linear-attention) is not installed")
    path = Path(spec.origin).parent / "ops" / "attnres" / "naive.py"
    if not path.exists():
        pytest.skip(f"fla has no {path}")
    module_spec = importlib.util.spec_from_file_location("fla_attnres_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.naive_attnres


def test_attn_res_matches_fla_naive_attnres():
    naive_attnres = load_fla_naive_attnres()
    proj, norm = res_params(0, eps=1e-6)
    proj, norm = proj.float(), norm.float()
    sources = [torch.randn(2, 5, D) * (i + 1) for i in range(4)]
    h, p = attn_res(sources, proj, norm)
    h_ref, p_ref = naive_attnres(proj.weight, sources, norm.weight, rms_eps=1e-6, return_weights=True)
    assert_close("h vs fla naive_attnres", h_ref, h, FP32_TOL)
    assert_close("p vs fla naive_attnres", p_ref, p, FP32_TOL)


def test_attn_res_matches_reference_formula_fp64():
    proj, norm = res_params(1)
    sources = [torch.randn(3, 4, D, dtype=torch.float64) for _ in range(5)]
    assert_close("h vs HF formula", reference_attn_res(sources, proj, norm), attn_res(sources, proj, norm)[0], FP64_TOL)


def test_zero_query_is_uniform_mixing():
    proj, norm = res_params(2)
    nn.init.zeros_(proj.weight)
    sources = [torch.randn(2, 3, D, dtype=torch.float64) for _ in range(3)]
    h, p = attn_res(sources, proj, norm)
    assert_close("p uniform", torch.full_like(p, 1 / 3), p, FP64_TOL)
    assert_close("h = mean of sources", torch.stack(sources).mean(0), h, FP64_TOL)


def test_single_source_is_identity():
    proj, norm = res_params(3)
    x = torch.randn(2, 3, D, dtype=torch.float64)
    assert torch.equal(attn_res([x], proj, norm)[0], x)


def make_sublayers(L, seed=4):
    torch.manual_seed(seed)
    Ws = [torch.randn(D, D, dtype=torch.float64) / D ** 0.5 for _ in range(2 * L)]
    return [lambda h, W=W: torch.tanh(h @ W) for W in Ws]


def spec_reference(emb, fns, params, out_params, block_size):
    """docs/k3_reference.md §1.1 transcribed literally (block_size in decoder layers)."""
    L = len(fns) // 2
    prefix_sum, blocks = emb, []
    for l in range(L):
        h = prefix_sum if blocks == [] else reference_attn_res([*blocks, prefix_sum], *params[2 * l])
        if l % block_size == 0:
            blocks.append(prefix_sum)
            prefix_sum = None
        a = fns[2 * l](h)
        prefix_sum = a if prefix_sum is None else prefix_sum + a
        h = reference_attn_res([*blocks, prefix_sum], *params[2 * l + 1])
        prefix_sum = prefix_sum + fns[2 * l + 1](h)
    return reference_attn_res([*blocks, prefix_sum], *out_params), len(blocks) + 1


def run_stream(stream, fns, params, out_params):
    for s, fn in enumerate(fns):
        stream.add(fn(stream.sublayer_input(*params[s])))
    return stream.output(*out_params)


@pytest.mark.parametrize("block_size", [1, 2, 3, 5, 12], ids=lambda b: f"block{b}")
def test_block_bookkeeping_matches_spec(block_size):
    L = 5  # block_size >= L: one block, sources [embedding, partial sum] — still well defined
    fns = make_sublayers(L)
    params = [res_params(10 + s) for s in range(2 * L)]
    out_params = res_params(99)
    emb = torch.randn(2, 3, D, dtype=torch.float64)
    ref, n_sources = spec_reference(emb, fns, params, out_params, block_size)
    records = []
    got = run_stream(AttnResStream(emb, 2 * block_size, records), fns, params, out_params)
    assert_close("stream vs docs/k3_reference.md §1.1", ref, got, FP64_TOL)
    assert len(records[-1][1]) == n_sources == 1 + -(-L // block_size)  # embedding + ceil(L / block_size) blocks


def test_full_form_has_every_sublayer_as_a_source():
    L = 3
    fns = make_sublayers(L, seed=5)
    params = [res_params(20 + s) for s in range(2 * L)]
    out_params = res_params(98)
    emb = torch.randn(2, 3, D, dtype=torch.float64)
    outs = [emb]  # full AttnRes (paper §3): sublayer s mixes [emb, f_0, ..., f_{s-1}]
    for s, fn in enumerate(fns):
        h = emb if s == 0 else reference_attn_res(outs, *params[s])
        outs.append(fn(h))
    ref = reference_attn_res(outs, *out_params)
    records = []
    got = run_stream(AttnResStream(emb, 1, records), fns, params, out_params)
    assert_close("full form", ref, got, FP64_TOL)
    assert [len(p) for _, p in records] == list(range(2, 2 * L + 2))


def test_k3_has_nine_sources_at_the_output():
    """93 layers in blocks of 12: 7 full blocks, one partial block of 9 layers, plus the embedding."""
    records = []
    stream = AttnResStream(torch.ones(1, 1, 4), 2 * 12, records)
    proj, norm = nn.Linear(4, 1, bias=False), nn.RMSNorm(4)
    for _ in range(2 * 93):
        stream.add(stream.sublayer_input(proj, norm) * 0.5)
    stream.output(proj, norm)
    assert len(records[-1][1]) == 9
    names, mat = depth_weights_matrix(records)
    assert mat.shape == (2 * 93, 9) and names[-1] == "output"


def test_prenorm_stream_is_the_running_sum():
    x = torch.randn(2, 3, D)
    stream = residual_stream("prenorm", x, sublayers_per_block=2)
    assert isinstance(stream, PreNormStream)
    total = x
    for s in range(4):
        out = torch.tanh(stream.sublayer_input()) * (s + 1)
        stream.add(out)
        total = total + out
    assert torch.equal(stream.output(), total)


def test_bad_arguments():
    with pytest.raises(ValueError, match="residual"):
        residual_stream("hyper", torch.zeros(1, 1, D), 2)
    with pytest.raises(ValueError, match="sublayers_per_block"):
        AttnResStream(torch.zeros(1, 1, D), 0)
    with pytest.raises(ValueError, match="sources"):
        attn_res([], *res_params(0))
