"""The anchored (one-matmul) decayed scores of k3lab.mixers.chunk against the pairwise form."""
import math

import pytest
import torch
import torch.nn.functional as F

from k3lab.mixers import chunk, lineage
from k3lab.testing import rel_err

FP64_TOL, FP32_TOL = 1e-12, 1e-5


def inputs(C, K, g_min, dtype, seed=0, lead=(2, 2, 3)):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*lead, C, K, generator=gen, dtype=dtype)
    b = F.normalize(torch.randn(*lead, C, K, generator=gen, dtype=dtype), dim=-1)
    g = g_min * torch.sigmoid(torch.randn(*lead, C, K, generator=gen, dtype=dtype))  # K3's gate: g in (g_min, 0)
    return a, b, g.cumsum(-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, FP64_TOL), (torch.float32, FP32_TOL)])
@pytest.mark.parametrize("C, g_min", [(16, -5.0), (64, -0.5), (8, -5.0)])
def test_anchored_equals_pairwise_values_and_gradients(dtype, tol, C, g_min):
    a, b, G = (x.requires_grad_() for x in inputs(C, 8, g_min, dtype))
    anchored = chunk.decayed_scores_anchored(a, b, G)
    assert anchored is not None
    pairwise = chunk.decayed_scores(a, b, G)
    assert rel_err(anchored, pairwise) < tol
    assert (anchored.triu(1) == 0).all()
    w = torch.randn_like(pairwise)
    grads_anchored = torch.autograd.grad((anchored * w).sum(), (a, b, G))
    grads_pairwise = torch.autograd.grad((pairwise * w).sum(), (a, b, G))
    for name, x, y in zip("abG", grads_anchored, grads_pairwise):
        assert rel_err(x, y) < 10 * tol, name


def test_anchored_refuses_ranges_past_the_limit_and_chunk_scores_falls_back():
    """fp32: at g = −9 every anchor tile (16, or 8 tokens: 7 · 9 = 63) spans more than (2/3)·88.7;
    the pairwise form is used, exactly."""
    a, b, _ = inputs(16, 8, -5.0, torch.float32)
    G = torch.full_like(a, -9.0).cumsum(-2)
    limit = chunk.ANCHORED_RANGE_FRACTION * math.log(torch.finfo(torch.float32).max)
    assert 7 * 9.0 > limit
    assert chunk.decayed_scores_anchored(a, b, G) is None
    assert torch.equal(chunk.chunk_scores(a, b, G), chunk.decayed_scores(a, b, G))
    a64, b64, G64 = (x.double() for x in (a, b, G))  # the same range is fine in fp64
    assert rel_err(chunk.decayed_scores_anchored(a64, b64, G64), chunk.decayed_scores(a64, b64, G64)) < FP64_TOL


@pytest.mark.parametrize("C, g_min", [(64, -5.0), (64, -2.0), (32, -5.0)])
def test_tiled_anchors_at_k3_bound_fp32(C, g_min):
    """A 64-token chunk at K3's bound spans up to 315: too deep for one anchor, fine for 8-token tiles."""
    a, b, G = (x.requires_grad_() for x in inputs(C, 8, g_min, torch.float32))
    anchored = chunk.decayed_scores_anchored(a, b, G)
    assert anchored is not None
    assert rel_err(anchored, chunk.decayed_scores(a, b, G)) < FP32_TOL
    w = torch.randn_like(anchored)
    for x, y in zip(torch.autograd.grad((anchored * w).sum(), (a, b, G)),
                    torch.autograd.grad((chunk.decayed_scores(a, b, G) * w).sum(), (a, b, G))):
        assert rel_err(x, y) < 10 * FP32_TOL


def test_growing_decay_and_odd_chunk_lengths():
    """g > 0 (G grows) and a chunk of 37 rows (no tile divides it): still equal to the pairwise form."""
    a, b, G = inputs(37, 8, -0.3, torch.float64)
    assert rel_err(chunk.chunk_scores(a, b, G), chunk.decayed_scores(a, b, G)) < FP64_TOL
    a, b, G = inputs(16, 8, 0.4, torch.float64)  # g in (0, 0.4): a growing G
    assert rel_err(chunk.chunk_scores(a, b, G), chunk.decayed_scores(a, b, G)) < FP64_TOL


def test_scalar_decay_keeps_its_matmul_form():
    a, b, G = inputs(16, 8, -5.0, torch.float64)
    G1 = G[..., :1]
    assert torch.equal(chunk.chunk_scores(a, b, G1), chunk.decayed_scores(a, b, G1))


@pytest.mark.parametrize("g_min, chunk_size", [(-0.5, 64), (-5.0, 16), (-40.0, 64)])
def test_kda_chunk_equals_recurrence_on_both_paths(g_min, chunk_size):
    """Weak decays (anchored path) and decays deep enough to need the pairwise fallback in fp64."""
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, V = 1, 70, 2, 8, 4
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    g, beta = g_min * torch.sigmoid(r(B, T, H, K)), torch.sigmoid(r(B, T, H))
    o_rec, s_rec = lineage.kda_recurrent(q, k, v, g, beta)
    o_chk, s_chk = chunk.kda_chunk(q, k, v, g, beta, chunk_size=chunk_size)
    assert rel_err(o_chk, o_rec) < 1e-10 and rel_err(s_chk, s_rec) < 1e-10
