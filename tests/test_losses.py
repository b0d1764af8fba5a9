"""Chunked lm_head + cross-entropy (k3lab.losses.linear_cross_entropy): values and gradients equal to
``F.cross_entropy(F.linear(h, W).float())`` (fp32, bf16, CPU autocast), ignored rows, all-ignored (0, not
NaN), the model's fused_loss switch (main + MTP loss, tied embeddings) and the bytes saved for backward
(no [N, V] tensor)."""
import pytest
import torch
import torch.nn.functional as F

from k3lab.config import ModelConfig
from k3lab.losses import IGNORE_INDEX, linear_cross_entropy
from k3lab.model import K3ForCausalLM, LossShard, masked_cross_entropy
from k3lab.testing import assert_close
from k3lab.testing import saved_bytes as count_saved

FP32 = 1e-6
BF16 = 1e-2


def reference(h, w, y, num_valid=None):
    return masked_cross_entropy(F.linear(h, w)[None], y[None], num_valid)  # [1, N, V] as the model's call


def problem(N=300, D=32, V=1000, dtype=torch.float32, ignore=0.2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen).to(dtype)
    w = (torch.randn(V, D, generator=gen) * 0.3).to(dtype)
    y = torch.randint(0, V, (N,), generator=gen)
    y[torch.rand(N, generator=gen) < ignore] = IGNORE_INDEX
    return h, w, y


def loss_and_grads(fn, h, w, *args, **kw):
    h, w = h.detach().requires_grad_(), torch.nn.Parameter(w.detach().clone())
    loss = fn(h, w, *args, **kw)
    loss.backward()
    return loss, h.grad, w.grad


def saved_bytes(fn, exclude=()):
    """(output, [(bytes, dtype, shape)]) of the tensors ``fn()`` saves for backward (k3lab.testing)."""
    out, seen = count_saved(fn, exclude)
    return out, list(seen.values())


# ---------------------------------------------------------------------------------------------- function
@pytest.mark.parametrize("chunk_size", [7, 64, None])
@pytest.mark.parametrize("num_valid", [None, 500])
def test_fp32_equals_reference(chunk_size, num_valid):
    h, w, y = problem()
    got = loss_and_grads(linear_cross_entropy, h, w, y, num_valid, chunk_size=chunk_size)
    want = loss_and_grads(reference, h, w, y, num_valid)
    for name, a, b in zip(("loss", "dhidden", "dweight"), got, want):
        assert a.dtype == torch.float32
        assert_close(f"fp32 {name} (chunk {chunk_size}, num_valid {num_valid})", b, a, FP32)


def test_bf16_and_autocast_equal_reference():
    h, w, y = problem(N=200, V=700)
    hb, wb = h.bfloat16(), w.bfloat16()
    exact = loss_and_grads(reference, hb.float(), wb.float(), y)  # fp32 math on the bf16 values
    got = loss_and_grads(linear_cross_entropy, hb, wb, y, chunk_size=64)
    want = loss_and_grads(reference, hb, wb, y)
    for name, a, b, c in zip(("loss", "dhidden", "dweight"), got, want, exact):
        assert a.dtype == (torch.float32 if name == "loss" else torch.bfloat16), name
        assert_close(f"bf16 {name} vs bf16 reference", b.float(), a.float(), BF16)
        assert_close(f"bf16 {name} vs fp32 math", c, a.float(), BF16)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 params and hidden, bf16 matmuls (the GPU setting)
        got = loss_and_grads(linear_cross_entropy, h, w, y, chunk_size=64)
        want = loss_and_grads(reference, h, w, y)
    for name, a, b in zip(("loss", "dhidden", "dweight"), got, want):
        assert a.dtype == torch.float32, name
        assert_close(f"autocast {name}", b, a, BF16)


def test_ignored_rows_and_all_ignored():
    h, w, y = problem(N=50, V=64, ignore=0.5)
    _, dh, _ = loss_and_grads(linear_cross_entropy, h, w, y, chunk_size=16)
    assert (dh[y == IGNORE_INDEX] == 0).all() and (dh[y != IGNORE_INDEX] != 0).any()
    y_none = torch.full_like(y, IGNORE_INDEX)
    for num_valid in (None, 0):
        loss, dh, dw = loss_and_grads(linear_cross_entropy, h, w, y_none, num_valid, chunk_size=16)
        assert loss.item() == 0.0 and torch.isfinite(loss)
        assert (dh == 0).all() and (dw == 0).all()
    loss = linear_cross_entropy(h.view(5, 10, -1), w, y.view(5, 10))  # [B, T, D] with [B, T] labels
    assert_close("[B, T] input", reference(h, w, y), loss, FP32)


def test_errors_name_the_argument():
    h, w, y = problem(N=10, V=20)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, y[:5])
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, w[:, :5], y)
    with pytest.raises(ValueError, match="dtype"):
        linear_cross_entropy(h, w.double(), y)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, y, chunk_size=0)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_saved_bytes_no_NxV_tensor(autocast):
    N, D, V = 512, 64, 2048
    h, w, y = problem(N=N, D=D, V=V, ignore=0.1)
    h = h.requires_grad_()
    w = torch.nn.Parameter(w)
    runs = {}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for name, fn in (("fused", linear_cross_entropy), ("reference", reference)):
            _, runs[name] = saved_bytes(lambda: fn(h, w, y), exclude=[w])
    fused, ref = (sum(n for n, _, _ in runs[k]) for k in ("fused", "reference"))
    print(f"\nloss N={N} D={D} V={V} autocast={autocast}: saved {fused} B fused vs {ref} B reference ({ref / fused:.0f}x)")
    assert not any(V in shape for _, _, shape in runs["fused"]), runs["fused"]
    assert any(n >= N * V * 4 and dt == torch.float32 for n, dt, _ in runs["reference"])  # the fp32 log-softmax
    elt = 2 if autocast else 4
    assert fused <= N * D * elt + N * 8 + 64  # hidden (compute dtype) + labels int64 + the divisor


# ---------------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("kw", [dict(), dict(num_nextn_predict_layers=1, tie_word_embeddings=True)],
                         ids=["k3-tiny", "mtp-tied"])
@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "shard"])
def test_model_fused_loss_equals_unfused(kw, sharded):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(**kw)
    model = K3ForCausalLM(cfg).train()
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    labels = torch.randint(0, cfg.vocab_size, (2, 16))
    labels[0, :3] = IGNORE_INDEX
    shard = LossShard(lm_tokens=40, mtp_tokens=37) if sharded else None
    runs = []
    for fused in (False, True):
        model.fused_loss = fused
        model.zero_grad(set_to_none=True)
        out = model(x, labels, shard=shard)
        out.loss.backward()
        assert (out.logits is None) == fused
        runs.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ref, ref_grads), (got, got_grads) = runs
    assert_close("loss", ref.loss, got.loss, FP32)
    for key in ref.metrics:
        assert_close(key, ref.metrics[key], got.metrics[key], FP32)
    assert ("mtp_loss" in got.metrics) == (cfg.num_nextn_predict_layers == 1)
    assert ref_grads.keys() == got_grads.keys()
    for name in ref_grads:
        assert_close(f"grad {name}", ref_grads[name], got_grads[name], FP32)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight and "lm_head.weight" not in got_grads
    model.fused_loss = True
    assert model(x).logits.shape == (2, 16, cfg.vocab_size)  # no labels: logits as before
