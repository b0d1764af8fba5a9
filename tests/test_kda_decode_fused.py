"""The fused KDA decode step (k3lab.kernels.kda_decode_fused): the kernel against its plain-torch reference, the
reference and the kernel against the KDA layer's own path (k3lab.mixers.kda), in-place tails and state over several
steps, bad inputs, the layer's routing predicate (:func:`k3lab.mixers.kda.use_fused_decode`), the import layering;
on the GPU ``small``'s KDA widths against the unfused path, a CUDA-graph capture and greedy generation.

On CPU the kernel runs under Triton's interpreter, which must be on before triton is imported:
``test_interpreter_suite`` re-runs this file in a fresh process with ``TRITON_INTERPRET=1`` (tests/test_moe_rows.py's
pattern), where the kernel tests run at tiny shapes (B = 1..3, H = 2, K = V = 8 or 16, W = 4).

Tolerances (relative error ‖got − ref‖ / ‖ref‖):

* float32: the same float32 formulas, sums over K in another order: 1e-5;
* bf16 activations: conv, SiLU, q, k, β and o rounded to bf16 at the same points; a float32 difference of an ulp can
  move a value across a bf16 rounding boundary (2⁻⁸ relative for that element), and the layer's torch path (CPU)
  does not round q, k and β: 1e-2.
"""

import pathlib

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.kernels import kda_decode_fused as fused
from k3lab.kernels.kda_decode_fused import kda_decode_fused, kda_decode_fused_reference
from k3lab.mixers import kda as kda_module
from k3lab.mixers.kda import KDA, FUSED_DECODE_DTYPES, KDACache, StaticKDACache, use_fused_decode
from k3lab.testing import (INTERPRETED, KERNEL_DEVICE, KERNELS_RUN_HERE, assert_close, k3lab_imports,
                           run_interpreter_suite)

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE = KERNEL_DEVICE
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # by activation dtype (module docstring)
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="runs in test_interpreter_suite's subprocess")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def kernel_switched_on(monkeypatch):
    """The kernel is on by default (``k3lab.kernels.kda_decode_fused.ENABLED``); on here whatever the default."""
    monkeypatch.setattr(fused, "ENABLED", True)


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run directly here")
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreter_suite(__file__)


def step_inputs(B, H, K, V, dtype=torch.float32, w_dtype=torch.float32, W=4, seed=0, device=DEVICE):
    """The entry's positional arguments: projections, taps, tails, f, A_log, dt_bias, b, state (float32)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    acts = [r(B, H * K), r(B, H * K), r(B, H * V)]
    taps = [r(d, 1, W) / W ** 0.5 for d in (H * K, H * K, H * V)]
    tails = [r(B, d, W - 1) for d in (H * K, H * K, H * V)]
    f, A_log, dt_bias, b, state = r(B, H * K), r(H) / 2, r(H * K), r(B, H), r(B, H, K, V) / 4
    return ([t.to(device, dtype) for t in acts] + [t.to(device, w_dtype) for t in taps]
            + [t.to(device, dtype) for t in tails] + [f.to(device, dtype), A_log.to(device), dt_bias.to(device),
                                                       b.to(device, dtype), state.to(device)])


def clone(args):
    return [a.clone() for a in args]


# ----------------------------------------------------------------------------------------------
# the reference against the layer's own pieces (no kernels: plain torch, any process)
# ----------------------------------------------------------------------------------------------
def tiny_layer(dtype=torch.float32, H=2, K=16, seed=0, backend="torch"):
    cfg = ModelConfig.preset("tiny").replace(backend=backend, linear_attn_config=dict(num_heads=H, head_dim=K))
    torch.manual_seed(seed)
    layer = KDA(cfg, layer_idx=0).to(DEVICE)
    with torch.no_grad():  # off the init: e^A and the taps exercised
        layer.A_log.uniform_(-1, 1)
    return layer.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True], ids=["KDACache", "StaticKDACache"])
def test_reference_equals_layer_decode_path(dtype, in_place):
    """The layer's decode_fused with the reference in place of the kernel against its own one-token forward (torch
    on CPU: causal_conv1d, SiLU, l2norm, kda_gate, kda_recurrent) over 5 steps after a 3-token prompt: outputs,
    states and tails; a plain KDACache is left as it was."""
    layer = tiny_layer(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, layer.cfg.hidden_size, generator=gen).to(DEVICE, dtype)
    with torch.no_grad():
        _, c0 = layer(x[:, :3])
        want, c = [], c0
        for t in range(3, 8):
            y, c = layer(x[:, t:t + 1], c)
            want.append(y)
        got, g = [], (StaticKDACache(*(t.clone() for t in (c0.recurrent, c0.conv_q, c0.conv_k, c0.conv_v)))
                      if in_place else c0)
        before = [t.clone() for t in (c0.recurrent, c0.conv_q)]
        for t in range(3, 8):
            y, g2 = layer.decode_fused(x[:, t:t + 1], g, kda_decode_fused_reference)
            assert (g2 is g) == in_place
            g = g2
            got.append(y)
    assert torch.equal(before[0], c0.recurrent) and torch.equal(before[1], c0.conv_q)
    assert_close("y", torch.cat(want, 1).float(), torch.cat(got, 1).float(), TOL[dtype])
    assert_close("state", c.recurrent, g.recurrent, TOL[dtype])
    for name in ("conv_q", "conv_k", "conv_v"):  # the inputs themselves: the same bits
        assert torch.equal(getattr(c, name), getattr(g, name)), name


# ----------------------------------------------------------------------------------------------
# the kernel against the reference and the layer (interpreter on CPU, directly on CUDA)
# ----------------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("B", [3])  # several rows (independent programs; B = 1 at real widths: the GPU tests)
@pytest.mark.parametrize("K, V", [(16, 16), (16, 8)])  # square, and K != V (value blocks over V)
@pytest.mark.parametrize("dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.bfloat16, torch.bfloat16)], ids=["fp32", "bf16", "bf16-bf16taps"])
def test_kernel_matches_reference(B, K, V, dtype, w_dtype):
    """o, the state and the tails against the reference, in place (the default) and into separate outputs."""
    args = step_inputs(B, 2, K, V, dtype, w_dtype, seed=B + K + V)
    with torch.no_grad():
        ref = clone(args)
        o_ref = kda_decode_fused_reference(*ref, scale=0.3)
        got = clone(args)
        o = kda_decode_fused(*got, scale=0.3)
        outs = [torch.empty_like(t) for t in args[6:9]]
        state_out = torch.empty_like(args[-1])
        sep = clone(args)
        o2 = kda_decode_fused(*sep, scale=0.3, out_state=state_out, out_conv=outs)
    assert o.dtype == dtype and o.shape == (B, 2, V)
    assert_close("o", o_ref.float(), o.float(), TOL[dtype])
    assert_close("state", ref[-1], got[-1], TOL[dtype])
    for i in range(6, 9):
        assert torch.equal(ref[i], got[i]), f"tail {i - 6}"
        assert torch.equal(ref[i], outs[i - 6]), f"out tail {i - 6}"
    assert torch.equal(o, o2) and torch.equal(state_out, got[-1])
    for a, s in zip(args, sep):  # inputs untouched when the outputs are elsewhere
        assert torch.equal(a, s)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True], ids=["KDACache", "StaticKDACache"])
def test_layer_takes_kernel_and_matches_chunked_forward(dtype, in_place, monkeypatch):
    """The wiring: a tiny KDA layer (B = 3, H = 2, K = V = 16, W = 4) with the predicate forced true runs the kernel
    (counted) for 5 tokens one by one after a 3-token prompt; outputs, state and tails against the layer's chunked
    forward over all 8 tokens (torch path), and against its current one-token path with the Triton decode step
    (kda_backend forced to "triton": kda_decode_step under the interpreter on CPU)."""
    layer = tiny_layer(dtype)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, layer.cfg.hidden_size, generator=gen).to(DEVICE, dtype)
    calls = []
    kernel = fused.kda_decode_fused
    monkeypatch.setattr(fused, "kda_decode_fused", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    with torch.no_grad():
        y_full, c_full = layer(x)
        _, c0 = layer(x[:, :3])

        def decode(cache):
            ys = []
            for t in range(3, 8):
                y, cache = layer(x[:, t:t + 1], cache)
                ys.append(y)
            return torch.cat(ys, 1), cache

        static = lambda c: StaticKDACache(*(t.clone() for t in (c.recurrent, c.conv_q, c.conv_k, c.conv_v)))  # noqa
        if DEVICE == "cpu":
            monkeypatch.setattr(kda_module, "kda_backend", lambda *a: "triton")
            y_step, c_step = decode(static(c0) if in_place else c0)  # today's path: kda_decode_step
            monkeypatch.undo()
            monkeypatch.setattr(fused, "ENABLED", True)
            monkeypatch.setattr(fused, "kda_decode_fused", lambda *a, **k: calls.append(1) or kernel(*a, **k))
        else:
            monkeypatch.setattr(fused, "ENABLED", False)
            y_step, c_step = decode(static(c0) if in_place else c0)
            monkeypatch.setattr(fused, "ENABLED", True)
        assert calls == []
        monkeypatch.setattr(kda_module, "use_fused_decode", lambda *a, **k: True)
        start = static(c0) if in_place else c0
        y, c = decode(start)
    assert calls == [1] * 5 and (c is start) == in_place
    for name, want, want_c in (("chunked", y_full[:, 3:], c_full), ("decode step", y_step, c_step)):
        assert_close(f"y vs {name}", want.float(), y.float(), TOL[dtype])
        assert_close(f"state vs {name}", want_c.recurrent, c.recurrent, TOL[dtype])
    for name in ("conv_q", "conv_k", "conv_v"):
        assert torch.equal(getattr(c_step, name), getattr(c, name)), name
        assert_close(name, getattr(c_full, name).float(), getattr(c, name).float(), TOL[dtype])


# ----------------------------------------------------------------------------------------------
# inputs, the predicate, the layering (no kernels run)
# ----------------------------------------------------------------------------------------------
def test_bad_inputs_are_refused_by_name():
    args = step_inputs(2, 2, 8, 16)
    names = ["q_proj", "k_proj", "v_proj", "q_weight", "k_weight", "v_weight", "conv_q", "conv_k", "conv_v", "f",
             "A_log", "dt_bias", "b", "state"]

    def bad(i, value):
        return [value if j == i else a for j, a in enumerate(args)]

    cases = [(0, args[0][None], "q_proj must be"), (0, args[0].double(), "q_proj must be"),
             (0, args[0][:, :15], "q_proj must be"), (1, args[1].bfloat16(), "k_proj must be"),
             (2, args[2][:1], "v_proj must be"), (3, args[3][:, :, :1], "q_weight must be"),
             (4, args[4][:8], "k_weight must be"), (5, args[5].half(), "v_weight must be"),
             (6, args[6][..., :2], "conv_q must be"), (7, args[7].bfloat16(), "conv_k must be"),
             (8, args[8].mT.contiguous().mT, "conv_v must be"), (9, args[9][:, :8], "f must be"),
             (10, args[10][None], "A_log must be"), (11, args[11][:3], "dt_bias must be"),
             (12, args[12].double(), "b must be"), (13, args[13].bfloat16(), "state must be"),
             (13, args[13].transpose(2, 3).contiguous().transpose(2, 3), "state must be")]
    for i, value, message in cases:
        with pytest.raises(ValueError, match=message):
            kda_decode_fused(*bad(i, value))
        assert message.startswith(names[i])
    with pytest.raises(ValueError, match="out_state must be"):
        kda_decode_fused(*args, out_state=args[13][:1])
    with pytest.raises(ValueError, match=r"out_conv\[2\] must be"):
        kda_decode_fused(*args, out_conv=(args[6], args[7], args[6]))
    with pytest.raises(ValueError, match="lower_bound=0.5"):
        kda_decode_fused(*args, lower_bound=0.5)
    with pytest.raises(ValueError, match="forward only"):
        kda_decode_fused(*bad(0, args[0].clone().requires_grad_()))
    if not INTERPRETED and DEVICE == "cpu":
        with pytest.raises(ValueError, match="kernel runs on CUDA"):
            kda_decode_fused(*args)


def test_use_fused_decode_conditions():
    """The fused path only with: CUDA, a backend resolving to triton there, one token, no gradient, a cache, no
    autocast, no context parallelism, K3's bounded gate, bf16/float32 activations with float32 state and tails in
    the activation dtype. (Pure: no GPU needed to decide.)"""
    bf, f32 = torch.bfloat16, torch.float32
    ok = dict(backend="auto", device="cuda", tokens=1, needs_grad=False, gate_kind="k3", lower_bound=-5.0,
              dtypes=(bf, f32, bf, bf, bf))
    assert use_fused_decode(**ok)
    allowed = [dict(backend="triton"), dict(device=torch.device("cuda", 1)), dict(dtypes=(f32,) * 5),
               dict(lower_bound=-1.0), dict(has_cache=True)]
    refused = [dict(backend="torch"), dict(backend="fla"), dict(device="cpu"), dict(device="cpu", backend="triton"),
               dict(tokens=2), dict(tokens=0), dict(needs_grad=True), dict(gate_kind="kimi_linear"),
               dict(lower_bound=-6.0), dict(dtypes=(torch.float16, f32) + (torch.float16,) * 3),
               dict(dtypes=(torch.float64,) * 5), dict(dtypes=(bf, bf, bf, bf, bf)), dict(dtypes=(bf, f32, f32, bf, bf)),
               dict(has_cache=False), dict(autocast=True), dict(context_parallel=True)]
    for change in allowed:
        assert use_fused_decode(**{**ok, **change}), change
    for change in refused:
        assert not use_fused_decode(**{**ok, **change}), change
    assert FUSED_DECODE_DTYPES == (bf, f32)


def test_cpu_forward_keeps_todays_path(monkeypatch):
    """On CPU the layer never calls the kernel (the predicate says no first; that the kernel module is not even
    imported is tests/test_gemv_kernel.py::test_model_import_loads_no_kernel_module)."""
    layer = tiny_layer(torch.float32)
    monkeypatch.setattr(fused, "kda_decode_fused", lambda *a, **k: pytest.fail("the kernel was called"))
    x = torch.randn(1, 4, layer.cfg.hidden_size, device=DEVICE)
    with torch.no_grad():
        _, c = layer(x[:, :3])
        layer(x[:, 3:], c)
    if DEVICE == "cpu":
        layer(x[:, 3:], c)  # with gradients too


def test_modules_import_no_upper_layer():
    """k3lab/kernels/kda_decode_fused.py imports only k3lab.config and k3lab.kernels (no mixers, model or infer);
    k3lab/mixers/kda.py imports the kernel module lazily, never at module level."""
    imports = k3lab_imports

    assert imports(ROOT / "k3lab" / "kernels" / "kda_decode_fused.py") == {"k3lab.config", "k3lab.kernels.rounding"}
    top = imports(ROOT / "k3lab" / "mixers" / "kda.py", top_level_only=True)
    assert not any(n.startswith("k3lab.kernels") for n in top), top
    assert "k3lab.kernels.kda_decode_fused" in imports(ROOT / "k3lab" / "mixers" / "kda.py")


# ----------------------------------------------------------------------------------------------
# GPU: small's KDA widths against today's path, graph capture, generation
# ----------------------------------------------------------------------------------------------
def small_layer(dtype):
    cfg = ModelConfig.preset("small")  # H = 8, K = V = 128, W = 4, hidden 1024
    torch.manual_seed(0)
    layer = KDA(cfg, layer_idx=0).cuda()
    with torch.no_grad():
        layer.A_log.uniform_(-1, 1)
    return layer.to(dtype).eval()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True], ids=["KDACache", "StaticKDACache"])
def test_small_widths_match_unfused_path_gpu(B, dtype, in_place, monkeypatch):
    """A KDA layer of ``small``'s widths: 6 tokens decoded with the kernel (counted) against the same steps unfused
    (ENABLED off: the projections, convs, gate and kda_decode_step as today) and the kernel against its reference
    on the same inputs; fp32 with full-precision matmuls (no TF32)."""
    layer = small_layer(dtype)
    x = torch.randn(B, 16, layer.cfg.hidden_size, device="cuda", dtype=dtype)
    calls = []
    kernel = fused.kda_decode_fused
    monkeypatch.setattr(fused, "kda_decode_fused", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad():
            _, c0 = layer(x[:, :10])
            runs = {}
            for on in (False, True):
                monkeypatch.setattr(fused, "ENABLED", on)
                c = StaticKDACache(c0.recurrent.clone(), c0.conv_q.clone(), c0.conv_k.clone(),
                                   c0.conv_v.clone()) if in_place else c0
                ys = []
                for t in range(10, 16):
                    y, c = layer(x[:, t:t + 1], c)
                    ys.append(y)
                runs[on] = torch.cat(ys, 1), c
            args = step_inputs(B, 8, 128, 128, dtype, torch.float32, seed=5, device="cuda")
            ref = clone(args)
            o, o_ref = kernel(*args), kda_decode_fused_reference(*ref)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert calls == [1] * 6
    (y0, c_off), (y1, c_on) = runs[False], runs[True]
    assert_close("y", y0.float(), y1.float(), TOL[dtype])
    assert_close("state", c_off.recurrent, c_on.recurrent, TOL[dtype])
    for name in ("conv_q", "conv_k", "conv_v"):
        assert torch.equal(getattr(c_off, name), getattr(c_on, name)), name
    assert_close("o", o_ref.float(), o.float(), TOL[dtype])
    assert_close("kernel state", ref[-1], args[-1], TOL[dtype])


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture_gpu():
    """The layer's decode step on a StaticKDACache (bf16, B = 2) captured in a CUDA graph with the kernel inside:
    three replays on new tokens give the eager steps' outputs and leave the same state and tails."""
    layer = small_layer(torch.bfloat16)
    x = torch.randn(2, 12, layer.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, c0 = layer(x[:, :8])
        make = lambda: StaticKDACache(*(t.clone() for t in (c0.recurrent, c0.conv_q, c0.conv_k, c0.conv_v)))  # noqa
        eager, want = make(), []
        for t in range(8, 11):
            want.append(layer(x[:, t:t + 1], eager)[0])
        graphed, inp = make(), x[:, 8:9].clone()
        warm = make()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(inp, warm)  # compile before capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        snapshot = [t.clone() for t in (graphed.recurrent, graphed.conv_q, graphed.conv_k, graphed.conv_v)]
        with torch.cuda.graph(graph):
            y, _ = layer(inp, graphed)
        for t, s in zip((graphed.recurrent, graphed.conv_q, graphed.conv_k, graphed.conv_v), snapshot):
            t.copy_(s)  # capture does not run the step
        got = []
        for t in range(8, 11):
            inp.copy_(x[:, t:t + 1])
            graph.replay()
            got.append(y.clone())
        torch.cuda.synchronize()
    assert_close("y", torch.cat(want, 1).float(), torch.cat(got, 1).float(), TOL[torch.bfloat16])
    assert_close("state", eager.recurrent, graphed.recurrent, TOL[torch.bfloat16])
    for name in ("conv_q", "conv_k", "conv_v"):
        assert torch.equal(getattr(eager, name), getattr(graphed, name)), name


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("decoder", ["eager", "graph"])
def test_greedy_generation_matches_torch_backend_gpu(decoder, monkeypatch):
    """Greedy generation of a tiny two-layer model (KDA + MLA) in fp32 with the kernel on (counted) gives the tokens
    of backend torch."""
    from k3lab.infer import generate
    from k3lab.model import K3ForCausalLM

    def model(backend):
        cfg = ModelConfig.preset("tiny").replace(vocab_size=256, num_hidden_layers=2, full_attn_layers=[2],
                                                 attn_res_block_size=1, initializer_range=0.1, backend=backend)
        torch.manual_seed(0)
        return K3ForCausalLM(cfg).eval().cuda()

    calls = []
    kernel = fused.kda_decode_fused
    monkeypatch.setattr(fused, "kda_decode_fused", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 30)]
    got = generate(model("triton"), prompts, 12, eos_token_id=None, decoder=decoder)
    want = generate(model("torch"), prompts, 12, eos_token_id=None, decoder=decoder)
    assert got == want and calls
