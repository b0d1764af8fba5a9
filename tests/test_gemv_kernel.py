"""The small-batch GEMV (k3lab.kernels.gemv) against its torch reference, its split rule, and the model's one
entry to it (k3lab.linear: ``linear``, its dispatch rule ``small_linear_applies``, the ``Linear`` subclass).

On CPU the kernels run under Triton's interpreter, which must be on before triton is imported:
``test_interpreter_suite`` re-runs this file in a fresh process with ``TRITON_INTERPRET=1`` (the pattern of
tests/test_kernels.py), where the kernel tests run at tiny shapes (M, K not multiples of the blocks). On a CUDA
machine they run directly, and the ``gpu`` tests add the ``small`` preset's decode shapes, a CUDA-graph capture,
torch.compile and greedy generation with the kernel in every linear layer.

Tolerances (relative error ‖got − ref‖ / ‖ref‖ against :func:`small_linear_reference`):

* float32: the same float32 products, summed in another order: 1e-5;
* bf16 / fp16: both round the float32 sum once; where the two float32 sums straddle a rounding midpoint the
  results differ by one ulp of the dtype (2⁻⁸ / 2⁻¹¹ relative), elsewhere they agree: 1e-2 / 3e-3.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from k3lab.config import ModelConfig
from k3lab.kernels import gemv
from k3lab.kernels.gemv import (GEMV_DTYPES, GEMV_MAX_ROWS, LAUNCH, launch_config, num_k_splits, small_linear,
                                small_linear_reference)
from k3lab.linear import Linear, linear, small_linear_applies
from k3lab.testing import (KERNEL_DEVICE, KERNELS_RUN_HERE, assert_close, k3lab_imports, rel_err,
                           run_interpreter_suite)

DEVICE = KERNEL_DEVICE
ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}  # module docstring

needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="runs in test_interpreter_suite's subprocess")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def kernel_switched_on(monkeypatch):
    """The kernel is on by default (``k3lab.kernels.gemv.ENABLED``); these tests set it on regardless."""
    from k3lab.kernels import gemv as module

    monkeypatch.setattr(module, "ENABLED", True)

def inputs(N, M, K, dtype, bias=True, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=gen)
    w = torch.randn(M, K, generator=gen) * K ** -0.5
    b = torch.randn(M, generator=gen) if bias else None
    return x.to(device, dtype), w.to(device, dtype), None if b is None else b.to(device, dtype)


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run directly here")
def test_interpreter_suite():
    """This file's kernel tests on CPU under TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreter_suite(__file__, "-p", "no:nbval")


# ----------------------------------------------------------------------------------------------
# the reference
# ----------------------------------------------------------------------------------------------
def test_reference_is_f_linear_in_float32():
    x, w, b = inputs(5, 37, 300, torch.float32)
    assert_close("no bias", F.linear(x.cpu(), w.cpu()), small_linear_reference(x.cpu(), w.cpu()), 1e-6)
    assert_close("bias", F.linear(x.cpu(), w.cpu(), b.cpu()), small_linear_reference(x.cpu(), w.cpu(), b.cpu()), 1e-6)
    x3 = x.cpu().view(5, 1, 300)  # any leading dims
    assert small_linear_reference(x3, w.cpu(), b.cpu()).shape == (5, 1, 37)


def test_reference_rounds_once_to_bf16():
    """bf16: the reference is the exact value (float64) rounded once to bf16, within half an ulp plus the float32
    sum's error; F.linear in bf16 (float32 accumulation) differs from it by at most one ulp."""
    x, w, b = (t.cpu() for t in inputs(7, 53, 500, torch.bfloat16))
    ref = small_linear_reference(x, w, b)
    assert ref.dtype == torch.bfloat16
    exact = x.double() @ w.double().T + b.double()
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().to(torch.bfloat16).double().abs()  # ~ an ulp at |exact|
    fp32_err = 500 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert ((ref.double() - exact).abs() <= 0.5 * ulp + fp32_err).all()
    assert ((F.linear(x, w, b).double() - ref.double()).abs() <= ulp + 2 * fp32_err).all()


# ----------------------------------------------------------------------------------------------
# the kernel (interpreter on CPU, directly on CUDA)
# ----------------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("N", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("splits", [None, 3])
def test_against_reference(N, dtype, bias, splits):
    """M = 37 and K = 300: neither a multiple of the blocks; splits None splits K under the interpreter's 4 "SMs" (2
    splits at N = 1), 3 forces three (the [S, N, M] partials and the reduce kernel)."""
    x, w, b = inputs(N, 37, 300, dtype, bias, seed=N)
    if gemv.INTERPRET and splits is None:
        cfg = launch_config(N, 37, 300, 4)
        assert num_k_splits(37, 300, cfg["BLOCK_M"], cfg["BLOCK_K"], 4)[0] > 1
    got = small_linear(x, w, b, splits=splits)
    assert got.dtype == dtype and got.shape == (N, 37)
    assert_close(f"N={N}", small_linear_reference(x, w, b), got, TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("N, M, K", [(2, 5, 20), (1, 100, 17), (16, 9, 130)])
def test_shapes_smaller_and_larger_than_a_block(N, M, K):
    """M and K below one block (masked tiles), K just past one, M past one block of rows."""
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = inputs(N, M, K, dtype, seed=M + K)
        assert_close(f"{dtype}", small_linear_reference(x, w, b), small_linear(x, w, b), TOL[dtype])


@needs_kernels
def test_split_count_changes_only_the_order_of_sums():
    """1, 2, 5 splits and the automatic count agree to float32 rounding; each call is deterministic (the same bits
    twice: no atomics); x may be a view with a row stride (read in place)."""
    x, w, b = inputs(4, 40, 600, torch.float32, seed=7)
    x = torch.cat([x, x], 1)[:, :600]  # [4, 600] with row stride 1200
    outs = [small_linear(x, w, b, splits=s) for s in (1, 2, 5, None)]
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < 1e-6
    assert all(torch.equal(small_linear(x, w, b, splits=s), o) for s, o in zip((1, 2, 5, None), outs))


@needs_kernels
def test_rows_do_not_depend_on_padding_rows():
    """The launch depends on N only through N_PAD: a row's bits are the same in a call of 3 rows and of 4 (the static
    decoder pads a batch of 3 to its bucket of 4, a power of two as N_PAD: its tokens stay the eager decoder's)."""
    x, w, b = inputs(4, 300, 200, torch.bfloat16, seed=5)
    assert torch.equal(small_linear(x[:3], w, b), small_linear(x, w, b)[:3])
    assert torch.equal(small_linear(x[:3], w, b, splits=2), small_linear(x, w, b, splits=2)[:3])


@needs_kernels
def test_bf16_rounds_to_nearest_even_as_torch():
    """One split in float32 data that bf16 represents exactly (small integers): the sum is exact, so the kernel's
    bf16 result is ``exact.to(bfloat16)`` bit for bit — nearest even, not the interpreter's truncation."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-8, 9, (3, 64), generator=gen).float()
    w = torch.randint(-8, 9, (33, 64), generator=gen).float()
    b = torch.randint(-8, 9, (33,), generator=gen).float() + 0.5  # sums of a few hundred + 0.5: bf16 rounds them
    want = (x.double() @ w.double().T + b.double()).to(torch.bfloat16)
    got = small_linear(*(t.to(DEVICE, torch.bfloat16) for t in (x, w, b)), splits=1)
    assert torch.equal(got.cpu(), want)
    got_split = small_linear(*(t.to(DEVICE, torch.bfloat16) for t in (x, w, b)), splits=2)
    assert torch.equal(got_split.cpu(), want)  # the reduce kernel rounds the same way


@needs_kernels
def test_custom_op_and_torch_compile():
    """opcheck of ``k3lab::small_linear`` (schema, fake tensors); a fullgraph compile of ``small_linear`` gives the
    eager call's bits in one graph."""
    from torch._dynamo.utils import counters

    x, w, b = inputs(3, 37, 300, torch.float32)
    torch.library.opcheck(torch.ops.k3lab.small_linear.default, (x, w, b, 2),
                          test_utils=("test_schema", "test_faketensor"))
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda x, w, b: small_linear(x, w, b, splits=2) * 2.0, backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(x, w, b), small_linear(x, w, b, splits=2) * 2.0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


# ----------------------------------------------------------------------------------------------
# host-side rules (pure functions)
# ----------------------------------------------------------------------------------------------
def test_launch_config():
    """N padded to a power of two; the tile's products within budget; BLOCK_M narrowed while the output blocks times
    the K tiles are fewer than the target programs; tiny shapes get small blocks."""
    for N, n_pad in [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (16, 16)]:
        cfg = launch_config(N, 32768, 1024, 132)
        assert cfg["N_PAD"] == n_pad
        assert cfg["N_PAD"] * cfg["BLOCK_M"] * cfg["BLOCK_K"] <= LAUNCH["product_elems"]
    assert launch_config(1, 4096, 1024, 132) == dict(N_PAD=1, BLOCK_M=64, BLOCK_K=128)  # 64 blocks x 8 tiles: enough
    assert launch_config(1, 1024, 1024, 132) == dict(N_PAD=1, BLOCK_M=16, BLOCK_K=128)  # 16 x 8 < 396: narrowed twice
    assert launch_config(16, 4096, 1024, 132) == dict(N_PAD=16, BLOCK_M=8, BLOCK_K=64)
    assert launch_config(1, 5, 20, 132) == dict(N_PAD=1, BLOCK_M=8, BLOCK_K=32)
    assert launch_config(1, 37, 300, 4) == dict(N_PAD=1, BLOCK_M=8, BLOCK_K=128)  # the interpreter's 4 "SMs"


def test_split_rule():
    """num_k_splits: deterministic; whole tiles a split, none empty, at most max_splits; S the achievable split count
    whose S·blocks is nearest programs_per_sm·SMs (ties: fewer), so layers with ≥ 2/3 of the target blocks run
    unsplit; with launch_config, every small-preset decode shape big enough to fill 2×SMs programs gets 2-4 programs
    per SM."""
    sms = 132
    target = LAUNCH["programs_per_sm"] * sms
    assert num_k_splits(4096, 1024, 64, 128, sms) == (8, 128)  # 64 blocks: 8 splits of one tile, 512 programs
    assert num_k_splits(4096, 1024, 64, 64, sms) == (6, 192)  # 16 tiles: 6 splits of 3 tiles (the last of 1)
    assert num_k_splits(1024, 4096, 64, 128, sms) == (32, 128)
    assert num_k_splits(32768, 1024, 64, 128, sms) == (1, 1024)  # 512 blocks: enough
    assert num_k_splits(1000, 10, 64, 128, sms) == (1, 128)  # one tile: no split
    for M in (8, 64, 320, 384, 512, 1024, 1536, 2048, 4096, 163840):
        for K in (100, 128, 256, 384, 1024, 4096, 7168):
            for bm, bk in ((64, 128), (8, 64)):
                S, split_k = num_k_splits(M, K, bm, bk, sms)
                assert (S, split_k) == num_k_splits(M, K, bm, bk, sms)
                tiles, blocks = -(-K // bk), -(-M // bm)
                assert 1 <= S <= min(tiles, LAUNCH["max_splits"]) and split_k % bk == 0
                assert (S - 1) * split_k < K <= S * split_k  # covers K, no empty split
                achievable = {a for a in (-(-tiles // t) for t in range(1, tiles + 1)) if a <= LAUNCH["max_splits"]}
                assert all(abs(S * blocks - target) <= abs(a * blocks - target) for a in achievable)
                assert (S == 1) == (tiles == 1 or 3 * blocks >= 2 * target)
    for M, K in small_shapes():
        for N in (1, 8, 16):
            cfg = launch_config(N, M, K, sms)
            S, _ = num_k_splits(M, K, cfg["BLOCK_M"], cfg["BLOCK_K"], sms)
            programs = S * -(-M // cfg["BLOCK_M"])
            if -(-M // LAUNCH["min_block_m"]) * -(-K // cfg["BLOCK_K"]) >= 2 * sms:
                assert 2 * sms <= programs <= 4 * sms, (N, M, K, cfg, S)


def test_dispatch_rule():
    """small_linear_applies: backend triton (auto on CUDA), CUDA, 1-16 rows, bf16/fp16/fp32, matching and contiguous
    operands, no gradient needed, no autocast; torch and fla never; triton off CUDA is an error, not a fallback."""
    cuda = torch.device("cuda", 0)
    assert small_linear_applies("triton", cuda, 1, torch.bfloat16)
    assert small_linear_applies("auto", cuda, GEMV_MAX_ROWS, torch.float32)
    assert small_linear_applies("auto", "cuda", 3, torch.float16)
    assert not small_linear_applies("torch", cuda, 1, torch.bfloat16)
    assert not small_linear_applies("fla", cuda, 1, torch.bfloat16)
    assert not small_linear_applies("auto", "cpu", 1, torch.bfloat16)
    assert not small_linear_applies("torch", "cpu", 1, torch.bfloat16)
    assert not small_linear_applies("auto", cuda, GEMV_MAX_ROWS + 1, torch.bfloat16)
    assert not small_linear_applies("auto", cuda, 0, torch.bfloat16)
    assert not small_linear_applies("auto", cuda, 1, torch.float64)
    for fact in ("matching", "contiguous"):
        assert not small_linear_applies("auto", cuda, 1, torch.bfloat16, **{fact: False})
    for fact in ("needs_grad", "autocast"):
        assert not small_linear_applies("auto", cuda, 1, torch.bfloat16, **{fact: True})
    with pytest.raises(ValueError, match=r"^backend='triton' needs a CUDA device"):
        small_linear_applies("triton", "cpu", 1, torch.bfloat16)
    with pytest.raises(ValueError, match=r"^backend='cuBLAS': allowed values"):
        small_linear_applies("cuBLAS", cuda, 1, torch.bfloat16)
    assert set(GEMV_DTYPES) == {torch.bfloat16, torch.float16, torch.float32}


def test_bad_inputs_raise():
    x, w, b = inputs(2, 6, 8, torch.float32, device="cpu")
    cases = [
        ((torch.zeros(8), w, b), {}, r"^x must be a \[N, K\] tensor"),
        ((torch.zeros(GEMV_MAX_ROWS + 1, 8), w, b), {}, r"^x must be a \[N, K\] tensor with 1 <= N <= GEMV_MAX_ROWS=16"
                                                          r", K >= 1; got torch.float32 \(17, 8\) on cpu$"),
        ((x.double(), w, b), {}, r"^x dtype torch.float64: allowed values"),
        ((x.t().contiguous().t(), torch.zeros(6, 2), None), {}, r"^x must have a contiguous last dim"),
        ((x, w[:, :4], b), {}, r"^weight must be a contiguous \[M, K=8\] torch.float32 tensor"),
        ((x, w.bfloat16(), b), {}, r"^weight must be"),
        ((x, w.t().contiguous().t(), b), {}, r"^weight must be"),
        ((x, w, b[:3]), {}, r"^bias must be None or a contiguous \[M=6\]"),
        ((x, w, b), {"splits": 0}, r"^splits=0: must be None \(automatic\) or an int >= 1"),
        ((x, w.clone().requires_grad_(), b), {}, r"^weight requires grad with grad mode on: small_linear is "
                                                 r"inference-only \(no backward\)"),
        ((x.clone().requires_grad_(), w, b), {}, r"^x requires grad with grad mode on"),
    ]
    for args, kw, msg in cases:
        with pytest.raises(ValueError, match=msg) as err:
            small_linear(*args, **kw)
        assert "\n" not in str(err.value)  # one line


def test_off_cuda_without_the_interpreter_is_refused():
    if gemv.INTERPRET:
        return  # the interpreter runs the kernels on CPU: the kernel tests above (no skip: the suite allows none)
    x, w, b = inputs(2, 6, 8, torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"^x on cpu: small_linear runs on CUDA \(or on CPU under TRITON_INTERPRET"):
        small_linear(x, w, b)


# ----------------------------------------------------------------------------------------------
# the model's entry: linear and Linear
# ----------------------------------------------------------------------------------------------
def test_linear_is_f_linear_off_the_triton_backend():
    """On CPU (auto -> torch) and on backend torch, linear is F.linear bit for bit, any leading dims, with grad."""
    x, w, b = inputs(2, 6, 8, torch.float32, device="cpu")
    x3 = x.view(2, 1, 8).requires_grad_()
    for backend in ("torch", "auto"):
        assert torch.equal(linear(x3, w, b, backend), F.linear(x3, w, b))
        assert torch.equal(linear(x, w, None, backend), F.linear(x, w))
    with pytest.raises(ValueError, match=r"^backend='triton' needs a CUDA device"):
        linear(x, w, b, "triton")  # never a silent fallback


def test_linear_subclass_keeps_nn_linear():
    """Linear is an nn.Linear: the same parameters, names, state dict and random init; forward is F.linear on CPU."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 6)
    torch.manual_seed(0)
    lin = Linear(8, 6, backend="auto")
    assert isinstance(lin, nn.Linear) and type(lin).__name__ == "Linear" and lin.backend == "auto"
    assert list(lin.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert all(torch.equal(a, b) for a, b in zip(lin.state_dict().values(), ref.state_dict().values()))
    x = torch.randn(3, 8)
    assert torch.equal(lin(x), ref(x))
    assert Linear(8, 6, bias=False).bias is None and Linear(8, 6).backend == "torch"
    with pytest.raises(ValueError, match=r"^backend='cublas': allowed values are"):
        Linear(8, 6, backend="cublas")


def test_model_layers_carry_the_config_backend():
    """Every projection a decode step runs is a k3lab Linear (or the router) on cfg.backend; the only plain
    nn.Linear left are the AttnRes pseudo-queries, read as weights by the depth mix (never called)."""
    from k3lab.model import K3ForCausalLM
    from k3lab.moe.router import SigmoidRouter

    cfg = ModelConfig.preset("tiny").replace(backend="fla", num_nextn_predict_layers=1)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    ours = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert all(m.backend == "fla" for m in ours.values())
    assert all(m.backend == "fla" for m in model.modules() if isinstance(m, SigmoidRouter))
    assert plain and all(n.endswith("res_proj") for n in plain)
    leaves = {n.rsplit(".", 1)[-1] for n in ours}
    assert {"lm_head", "eh_proj", "q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "q_a_proj", "q_b_proj",
            "kv_a_proj_with_mqa", "kv_b_proj", "f_a_proj", "f_b_proj", "b_proj", "gate_proj", "up_proj", "down_proj",
            "routed_expert_down_proj", "routed_expert_up_proj"} <= leaves


def test_gemv_modules_import_no_upper_layer():
    """k3lab/kernels/gemv.py imports only torch, triton and k3lab.kernels; k3lab/linear.py only k3lab.backend and
    k3lab.config at module level (the kernel module lazily, on the CUDA path): no moe, mixers, model or infer."""
    imports = k3lab_imports

    assert imports(ROOT / "k3lab" / "kernels" / "gemv.py") == {"k3lab.kernels.mla_decode", "k3lab.kernels.rounding"}
    assert imports(ROOT / "k3lab" / "linear.py", top_level_only=True) == {"k3lab.backend", "k3lab.config"}
    assert imports(ROOT / "k3lab" / "linear.py") == {"k3lab.backend", "k3lab.config", "k3lab.kernels.gemv"}


def test_model_import_loads_no_kernel_module():
    """Building and running a model on CPU never imports k3lab.kernels (Triton kernels are decorated at import:
    a process that sets TRITON_INTERPRET=1 later must not find them compiled for the GPU already)."""
    code = ("import sys, torch\nfrom k3lab.config import ModelConfig\nfrom k3lab.model import K3ForCausalLM\n"
            "m = K3ForCausalLM(ModelConfig.preset('tiny')).eval()\n"
            "with torch.no_grad(): m(torch.zeros(1, 3, dtype=torch.long))\n"
            "print(sorted(k for k in sys.modules if k.startswith('k3lab.kernels')))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# GPU: the small preset's decode shapes, CUDA graphs, torch.compile, generation
# ----------------------------------------------------------------------------------------------
def small_shapes() -> list[tuple[int, int]]:
    """The distinct weight shapes [M, K] of the small preset's decode-path projections (and its router)."""
    from k3lab.model import K3ForCausalLM
    from k3lab.moe.router import SigmoidRouter

    with torch.device("meta"):
        model = K3ForCausalLM(ModelConfig.preset("small"))
    return sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, (Linear, SigmoidRouter))})


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_preset_shapes_gpu(dtype):
    """Every small-preset shape at N = 1, 8, 16 against the reference, and against F.linear (cuBLAS)."""
    for M, K in small_shapes():
        for N in (1, 8, 16):
            x, w, b = inputs(N, M, K, dtype, bias=N == 8, seed=M + K + N, device="cuda")
            got = small_linear(x, w, b)
            assert_close(f"[{N}, {K}] x [{M}, {K}]", small_linear_reference(x, w, b), got, TOL[dtype])
            assert_close(f"[{N}, {K}] x [{M}, {K}] vs F.linear", F.linear(x, w, b), got, TOL[dtype])


@pytest.mark.gpu
@needs_cuda
def test_linear_routes_decode_calls_gpu(monkeypatch):
    """linear on CUDA, backend triton: [B, T, K] with B·T ≤ 16 and no grad goes to small_linear; 17 rows, grad mode
    with a weight that requires grad, or autocast go to F.linear."""
    calls = []
    real = gemv.small_linear
    monkeypatch.setattr(gemv, "small_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    w = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(2, 8, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = linear(x, w, None, "triton")
        assert calls == [(16, 256)] and y.shape == (2, 8, 300)
        assert_close("routed", small_linear_reference(x, w), y, TOL[torch.bfloat16])
        linear(torch.randn(17, 256, device="cuda", dtype=torch.bfloat16), w, None, "auto")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            linear(x.float(), w.float(), None, "auto")
    linear(x, w, None, "triton")  # grad mode, w requires grad
    assert calls == [(16, 256)]


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture_gpu():
    """small_linear inside torch.cuda.graph (split-K and unsplit shapes of the small preset): replayed on new inputs
    copied into the captured ones it gives the eager call's bits."""
    shapes = [(1, 4096, 1024), (16, 4096, 1024), (4, 512, 1024)]  # split-K 8, unsplit, split-K 8 (on an H100)
    static = [inputs(N, M, K, torch.bfloat16, seed=N, device="cuda") for N, M, K in shapes]
    fresh = [inputs(N, M, K, torch.bfloat16, seed=N + 100, device="cuda") for N, M, K in shapes]

    def call():
        return [small_linear(*args) for args in static]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        call()  # compile before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        outs = call()
    for dst, src in zip(static, fresh):
        for d, s in zip(dst, src):
            d.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        for out, want in zip(outs, call()):
            assert torch.equal(out, want)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plans = [launch_config(N, M, K, sms) for N, M, K in shapes]
    splits = {num_k_splits(M, K, p["BLOCK_M"], p["BLOCK_K"], sms)[0] for (N, M, K), p in zip(shapes, plans)}
    assert 1 in splits and max(splits) > 1  # both kinds of launch captured


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_compile_gpu(dtype):
    """Two Linear layers on backend triton compiled (inductor, fullgraph: the GEMV one opaque node each) give the
    eager layers' bits (between them only an exact ``* 2``), and match F.linear within the dtype's tolerance."""
    torch.manual_seed(0)
    first = Linear(1024, 512, bias=False, backend="triton").to("cuda", dtype)
    second = Linear(512, 4096, backend="triton").to("cuda", dtype)
    x = torch.randn(8, 1024, device="cuda", dtype=dtype)

    def f(x):
        return second(first(x) * 2.0)

    with torch.no_grad():
        eager = f(x)
        compiled = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(compiled, eager)
    want = F.linear(F.linear(x, first.weight) * 2.0, second.weight, second.bias)
    assert_close("vs F.linear", want, eager, TOL[dtype])


def tiny_generation_model(backend: str):
    """test_infer's two-layer model (KDA + dense MLP, Gated MLA + LatentMoE), with an MTP head, in fp32 on CUDA."""
    cfg = ModelConfig.preset("tiny").replace(vocab_size=256, num_hidden_layers=2, full_attn_layers=[2],
                                             attn_res_block_size=1, initializer_range=0.1, backend=backend,
                                             num_nextn_predict_layers=1)
    torch.manual_seed(0)
    from k3lab.model import K3ForCausalLM

    return K3ForCausalLM(cfg).eval().cuda()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("decoder", ["eager", "graph"])
def test_greedy_generation_matches_torch_backend_gpu(decoder, monkeypatch):
    """Greedy generation in fp32 gives the same tokens with backend triton (every decode-step projection by the GEMV)
    as with backend torch; the eager decoder calls the GEMV in every linear layer of every step."""
    from k3lab.infer import generate

    calls = []
    real = gemv.small_linear
    monkeypatch.setattr(gemv, "small_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 30)]
    got = generate(tiny_generation_model("triton"), prompts, 12, eos_token_id=None, decoder=decoder)
    want = generate(tiny_generation_model("torch"), prompts, 12, eos_token_id=None, decoder=decoder)
    assert got == want and calls
    if decoder == "eager":
        spec = generate(tiny_generation_model("triton"), prompts, 12, eos_token_id=None, decoder="eager", draft=2)
        assert spec == want  # MTP drafting: eh_proj and the head's block through the GEMV too
