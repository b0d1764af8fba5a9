"""The split-K MLA decode kernel (k3lab.kernels.mla_decode) against a float64 torch reference of the same math.

On CPU the kernels run under Triton's interpreter, which must be on before triton is imported:
``test_interpreter_suite`` re-runs this file in a fresh process with ``TRITON_INTERPRET=1`` (the pattern of
tests/test_kernels.py), where the kernel tests run at tiny shapes (R = 32, H ≤ 8, S ≤ 300). On a CUDA machine
they run directly, and the ``gpu`` tests add ``small``'s dimensions against ``latent_attention_lowp``'s bmm path
and a CUDA-graph capture.

Tolerances (relative error, ‖got − ref‖ / ‖ref‖, against float64 math on the same cache values):

* fp32 cache: the dots are exact (IEEE), only float32 accumulation and the float32 log-sum-exp merge differ from
  float64: 1e-5;
* bf16 cache: as the bmm path, the kernel rounds q (when fp32) and p to bf16 — 2⁻⁹ relative each, so a logit
  of size |s| moves by about 2⁻⁹·|s| and each weight by 2⁻⁹; measured 3e-4 to 3e-3 here (the fp32-q case
  the largest: q's rounding moves every logit), bound 1e-2 (bf16 tolerance);
* fp16 cache: the same with 2⁻¹¹ (measured 2e-4): 3e-3.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3lab.kernels import mla_decode
from k3lab.kernels.mla_decode import LAUNCH, mla_decode_attention, mla_decode_reference, num_splits
from k3lab.testing import (INTERPRETED, KERNEL_DEVICE, KERNELS_RUN_HERE, assert_close, load_script, rel_err,
                           run_interpreter_suite)

DEVICE = KERNEL_DEVICE
ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}  # by cache dtype (module docstring)

needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="runs in test_interpreter_suite's subprocess")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def inputs(B, T, H, R, rho, S, q_dtype, c_dtype, seed, device=DEVICE, pad=None, holes=0.0):
    """Random q / cache; key_mask with ``pad[b]`` leading padded slots per row and a fraction ``holes`` of
    other slots masked (the last slot stays visible)."""
    gen = torch.Generator().manual_seed(seed)
    q_latent = torch.randn(B, T, H, R, generator=gen)
    q_rope = torch.randn(B, T, H, rho, generator=gen)
    c_kv = torch.randn(B, S, R, generator=gen)
    k_rope = torch.randn(B, S, rho, generator=gen)
    key_mask = torch.rand(B, S, generator=gen) >= holes
    for b, n in enumerate(pad or []):
        key_mask[b, :n] = False
    key_mask[:, -1] = True
    return (q_latent.to(q_dtype).to(device), q_rope.to(q_dtype).to(device), c_kv.to(c_dtype).to(device),
            k_rope.to(c_dtype).to(device), key_mask.to(device))


def check(B, T, H, R, rho, S, q_dtype, c_dtype, seed, limit=None, splits=None, masked=True, **kw):
    ql, qr, c, kr, km = inputs(B, T, H, R, rho, S, q_dtype, c_dtype, seed, **kw)
    km = km if masked else None
    scale = (R + rho) ** -0.5 * 2.0  # logits of a few units: a peaked softmax, as trained heads give
    got = mla_decode_attention(ql, qr, c, kr, scale, km, limit, splits=splits)
    want = mla_decode_reference(ql, qr, c, kr, scale, km, limit)
    assert got.dtype == torch.float32 and got.shape == (B, H, T, R)
    assert_close("o_latent", want, got, TOL[c_dtype])
    return got, want


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run directly here")
def test_interpreter_suite():
    """This file's kernel tests on CPU under TRITON_INTERPRET=1 in a fresh interpreter; numpy's overflow
    warnings are errors there, so no masked lane computes an overflowing exponent."""
    run_interpreter_suite(__file__, "-W", "error:overflow encountered:RuntimeWarning", "-p", "no:nbval")


@needs_kernels
@pytest.mark.parametrize("B, T, H, rho, S, q_dtype, c_dtype, splits", [
    (2, 1, 4, 8, 100, torch.float32, torch.float32, None),    # S not a multiple of the 64-slot tile
    (1, 1, 2, 0, 20, torch.float32, torch.float32, None),     # ρ = 0 (NoPE without a rope part), S < one tile
    (1, 1, 8, 16, 300, torch.float32, torch.float32, None),   # the automatic split count gives 3 splits here
    (2, 2, 4, 8, 150, torch.float32, torch.float32, 3),       # forced splits: the log-sum-exp merge
    (2, 1, 8, 8, 200, torch.float32, torch.bfloat16, None),   # fp32 q, bf16 cache (the decode case)
    (2, 2, 4, 8, 130, torch.bfloat16, torch.bfloat16, 2),     # bf16 q
    (1, 1, 4, 0, 90, torch.bfloat16, torch.bfloat16, None),   # bf16, ρ = 0
    (2, 1, 4, 8, 70, torch.float32, torch.float16, 2),        # fp16 cache
], ids=["fp32-S100", "fp32-rho0-S20", "fp32-auto-splits", "fp32-T2-splits3", "bf16cache-fp32q", "bf16-T2-splits2",
        "bf16-rho0", "fp16"])
def test_against_float64_reference(B, T, H, rho, S, q_dtype, c_dtype, splits):
    check(B, T, H, 32, rho, S, q_dtype, c_dtype, seed=S + T, splits=splits, pad=[0, S // 3][:B], holes=0.2)


@needs_kernels
def test_limit_per_row_and_token():
    """limit [B, T]: query t of row b sees slots ≤ limit[b, t] (the static cache's ``length_b + t``); a limit past
    S is no limit; -1 hides every slot: that row gives 0, not NaN. Split so that some splits lie past every
    limit (their programs read nothing). fp32 cache: a slot too many or too few is far outside 1e-5."""
    B, T, H, S = 3, 3, 2, 160
    limit = torch.tensor([[40, 41, 42], [5, 150, 400], [-1, 0, 63]], device=DEVICE)
    got, want = check(B, T, H, 32, 8, S, torch.float32, torch.float32, seed=5, limit=limit, splits=3, pad=[0, 3, 0])
    assert torch.equal(got[2, :, 0], torch.zeros_like(got[2, :, 0]))  # limit -1: sees nothing
    assert torch.isfinite(got).all()


@needs_kernels
def test_limit_with_zero_strides():
    """An expanded limit (stride 0 over B, as latent_attention_lowp passes the causal ``offset + t``)."""
    B, T = 2, 2
    limit = (torch.arange(T, device=DEVICE) + 97).expand(B, T)
    check(B, T, 4, 32, 8, 100, torch.float32, torch.float32, seed=3, limit=limit, splits=2, masked=False)


@needs_kernels
def test_all_masked_rows_give_zero():
    """A row whose every slot is masked gives 0 (the softmax reference's NaN is not what a graphed step wants);
    the other rows are unaffected."""
    ql, qr, c, kr, km = inputs(2, 1, 4, 32, 8, 80, torch.float32, torch.float32, seed=9)
    km[1] = False
    got = mla_decode_attention(ql, qr, c, kr, 0.2, km, splits=2)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert_close("row 0", mla_decode_reference(ql, qr, c, kr, 0.2, km)[0], got[0], TOL[torch.float32])


@needs_kernels
def test_several_row_groups(monkeypatch):
    """T·H = 24 rows in blocks of 16 (the accumulator limit forced down): two row groups, the second masked, each
    with its own limits; one split, so the programs write o in [B, H, T, R] themselves."""
    monkeypatch.setitem(LAUNCH, "max_acc_elems", 16 * 32)
    assert mla_decode.launch_config(24, 32, 8)["BLOCK_M"] == 16
    check(1, 3, 8, 32, 8, 90, torch.float32, torch.float32, seed=4, splits=1,
          limit=torch.tensor([[10, 70, 89]], device=DEVICE))


@needs_kernels
def test_split_count_does_not_change_the_result():
    """1 and 4 splits and the automatic count (3 here) agree to float32 rounding; a non-contiguous q view is read in
    place."""
    ql, qr, c, kr, km = inputs(1, 2, 2, 32, 8, 250, torch.float32, torch.float32, seed=11, holes=0.3)
    ql = ql.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, R] view with H-major strides
    outs = [mla_decode_attention(ql, qr, c, kr, 0.3, km, splits=n) for n in (1, 4, None)]
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < 1e-6


def test_split_count_is_a_function_of_shapes():
    """num_splits: deterministic from (B, row groups, S, tile, SMs); splits cover S with no empty split, a split is
    whole tiles, more rows or fewer SMs never give more splits, long caches give about programs_per_sm per SM."""
    for B in (1, 2, 16, 64, 256):
        for S in (1, 63, 64, 65, 4096, 65536, 1 << 20):
            splits, split_len = num_splits(B, 1, S, 64, 132)
            assert (splits, split_len) == num_splits(B, 1, S, 64, 132)
            assert split_len % 64 == 0 and (splits - 1) * split_len < S <= splits * split_len or S <= split_len
            assert splits <= LAUNCH["max_splits"]
            assert num_splits(2 * B, 1, S, 64, 132)[0] <= splits >= num_splits(B, 1, S, 64, 66)[0]
    assert 132 < num_splits(1, 1, 1 << 20, 64, 132)[0] <= 2 * 132  # one long row: about two programs per SM
    assert num_splits(64, 1, 65536, 64, 132)[0] == 5  # 64 rows: 5 splits of 13,120 slots, 320 programs
    assert num_splits(512, 1, 4096, 64, 132)[0] == 1  # enough programs already


def test_bad_inputs_raise():
    q, qr = torch.zeros(1, 1, 2, 32), torch.zeros(1, 1, 2, 8)
    c, kr = torch.zeros(1, 10, 32, dtype=torch.bfloat16), torch.zeros(1, 10, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="c_kv must be"):
        mla_decode_attention(q, qr, c[:, :, :16], kr, 1.0)
    with pytest.raises(ValueError, match="q_rope must be"):
        mla_decode_attention(q, qr, c, kr[..., :4], 1.0)
    with pytest.raises(ValueError, match="key_mask must be"):
        mla_decode_attention(q, qr, c, kr, 1.0, key_mask=torch.ones(1, 10))
    with pytest.raises(ValueError, match="limit must be"):
        mla_decode_attention(q, qr, c, kr, 1.0, limit=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="c_kv dtype"):
        mla_decode_attention(q, qr, c.to(torch.float64), kr, 1.0)


@needs_kernels
def test_bench_smoke():
    """kernels/bench_mla_decode.py --smoke: a tiny case under TRITON_INTERPRET=1 on CPU through the table's code.
    On CPU it runs inside the interpreter suite's process (no third interpreter start); on a CUDA machine, where
    this process's kernels are compiled for the GPU, in a process of its own."""
    if INTERPRETED:
        bench = load_script(ROOT / "kernels" / "bench_mla_decode.py", "bench_mla_decode")
        assert bench.main(["--smoke"]) == 0
        return
    run = subprocess.run([sys.executable, str(ROOT / "kernels" / "bench_mla_decode.py"), "--smoke"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "GB/s" in run.stdout and "smoke: ok" in run.stdout


# ----------------------------------------------------------------------------------------------
# GPU: small's dimensions against latent_attention_lowp's bmm path, and graph capture
# ----------------------------------------------------------------------------------------------
def small_dims():
    from k3lab.config import ModelConfig

    cfg = ModelConfig.preset("small")
    return cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, (cfg.qk_nope_head_dim +
                                                                             cfg.qk_rope_head_dim) ** -0.5


def cuda_inputs(B, T, S, seed):
    H, R, rho, scale = small_dims()
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_latent = torch.randn(B, T, H, R, device="cuda", generator=g) * 4.0  # W^UKᵀ q^C: logits of a few units
    q_rope = torch.randn(B, T, H, rho, device="cuda", generator=g)
    c_kv = torch.randn(B, S, R, device="cuda", generator=g).bfloat16()
    k_rope = torch.randn(B, S, rho, device="cuda", generator=g).bfloat16()
    key_mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    key_mask[B // 2:, : S // 5] = False  # left padding on half the rows
    return q_latent, q_rope, c_kv, k_rope, key_mask, scale


def row_rel_err(got, want):
    """Largest ‖got − want‖ / ‖want‖ over the rows (b, h, t)."""
    return ((got - want).double().norm(dim=-1) / want.double().norm(dim=-1)).max().item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("B, S, T", [(1, 4096, 1), (1, 4096, 4), (1, 65536, 1), (1, 65536, 4), (64, 4096, 1),
                                     (64, 4096, 4), (64, 65536, 1), (64, 65536, 4)])
def test_matches_bmm_path_gpu(B, S, T, monkeypatch):
    """latent_attention_lowp through the kernel vs its bmm path (ENABLED False), small's H, R, ρ: the new T tokens
    sit at the end of the cache (offset S − T: causal among themselves, a limit for all but the last)."""
    from k3lab.mixers.mla import latent_attention_lowp

    q_latent, q_rope, c_kv, k_rope, key_mask, scale = cuda_inputs(B, T, S, seed=B + S + T)
    calls = []
    kernel = mla_decode.mla_decode_attention
    monkeypatch.setattr(mla_decode, "mla_decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    with torch.no_grad():
        got = latent_attention_lowp(q_latent, q_rope, c_kv, k_rope, scale, S - T, key_mask)
        assert calls == [1]  # dispatched to the kernel
        monkeypatch.setattr(mla_decode, "ENABLED", False)
        want = latent_attention_lowp(q_latent, q_rope, c_kv, k_rope, scale, S - T, key_mask)
    assert calls == [1]
    assert rel_err(got, want) < 1e-2 and row_rel_err(got, want) < 2e-2  # both round q and p to bf16


@pytest.mark.gpu
@needs_cuda
def test_limit_matches_bmm_path_gpu(monkeypatch):
    """latent_attention_lowp's ``limit`` (the static cache's per-row ``length_b + t``) on both paths."""
    from k3lab.mixers.mla import latent_attention_lowp

    B, T, S = 8, 4, 4096
    q_latent, q_rope, c_kv, k_rope, key_mask, scale = cuda_inputs(B, T, S, seed=1)
    # rows 4-7 are left-padded over their first S // 5 = 819 slots: their lengths reach past the padding (a row
    # that sees no slot is NaN on the bmm path, 0 from the kernel; the layer never makes one)
    length = torch.tensor([10, 100, 1000, 4000, 4092, 900, 901, 3000], device="cuda")
    limit = length[:, None] + torch.arange(T, device="cuda")
    key_mask &= torch.arange(S, device="cuda") <= limit[:, -1:]
    got = latent_attention_lowp(q_latent, q_rope, c_kv, k_rope, scale, S - 1, key_mask, limit)
    monkeypatch.setattr(mla_decode, "ENABLED", False)
    want = latent_attention_lowp(q_latent, q_rope, c_kv, k_rope, scale, S - 1, key_mask, limit)
    assert rel_err(got, want) < 1e-2 and row_rel_err(got, want) < 2e-2


@pytest.mark.gpu
@needs_cuda
def test_against_float64_reference_gpu():
    """small's dimensions, fp32 q and bf16 cache, split automatically (B = 1: many splits), against float64."""
    q_latent, q_rope, c_kv, k_rope, key_mask, scale = cuda_inputs(1, 1, 65536, seed=7)
    got = mla_decode_attention(q_latent, q_rope, c_kv, k_rope, scale, key_mask)
    want = mla_decode_reference(q_latent, q_rope, c_kv, k_rope, scale, key_mask)
    assert rel_err(got, want) < TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture_gpu():
    """The call inside torch.cuda.graph: replayed on new data (copied into the captured inputs) it gives the
    eager call's result bit for bit (the split count and the order of sums depend on shapes only)."""
    B, T, S = 4, 1, 8192
    static = cuda_inputs(B, T, S, seed=2)
    fresh = cuda_inputs(B, T, S, seed=3)
    q_latent, q_rope, c_kv, k_rope, key_mask, scale = static
    limit = torch.full((B, T), S - 1, dtype=torch.long, device="cuda")

    def call():
        return mla_decode_attention(q_latent, q_rope, c_kv, k_rope, scale, key_mask, limit)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compile before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for dst, src in zip(static[:5], fresh[:5]):
        dst.copy_(src)
    key_mask[0, S // 2:] = False  # masks and limits are read on the device
    limit[1] = 100
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, call())
    assert rel_err(out, mla_decode_reference(q_latent, q_rope, c_kv, k_rope, scale, key_mask, limit)) < 1e-2
