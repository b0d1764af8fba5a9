"""The fused master-weight AdamW step (k3lab.kernels.adamw, MasterWeightOptimizer(fused=True)) against the
unfused reference path: fp32 grads on the masters, ``nn.utils.clip_grad_norm_``, ``torch.optim.AdamW``,
``p = bf16(w)``; the split master format (``master_format="split"``: bf16 p + int16 lo) against float32 masters.

On CPU the kernel runs under Triton's interpreter, which must be on before triton is imported:
``test_interpreter_suite`` re-runs this file in a fresh process with ``TRITON_INTERPRET=1``.
"""
import copy

import pytest
import torch
from torch import nn

from k3lab.data import batch_iterator
from k3lab.optim import build_optimizer, set_lr
from k3lab.outputs import CausalLMOutput
from k3lab.precision import (MASTER_FORMATS, MASTER_KEY, MasterWeightOptimizer, cast_params_, join_master,
                             split_master)
from k3lab.testing import INTERPRETED, KERNELS_RUN_HERE, KERNEL_DEVICE, assert_close, run_interpreter_suite

DEVICE = KERNEL_DEVICE
FP32 = 1e-6  # relative: the same float32 formula, rounded in another order
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="runs in test_interpreter_suite's subprocess")


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run directly here")
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreter_suite(__file__)


def fused_step(*tensors, lr, beta1, beta2, eps, weight_decay, step):
    """The fused kernel's step (``k3lab.kernels.adamw.master_adamw_step_``) with its scalars from the reference's
    :func:`k3lab.precision.adamw_scalars` (imported here: the kernel module reads TRITON_INTERPRET when imported)."""
    from k3lab.kernels.adamw import master_adamw_step_
    from k3lab.precision import adamw_scalars

    master_adamw_step_(*tensors, scalars=adamw_scalars(lr, beta1, beta2, weight_decay, step), beta1=beta1,
                       beta2=beta2, eps=eps)


def bf16_model(seed=0):
    """Layers of several sizes (one over a kernel block, 1-D biases without weight decay) in bf16."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 3), nn.LayerNorm(3)).to(DEVICE)
    cast_params_(model, "bfloat16")
    return model


def backward(model, seed):
    x = torch.randn(6, 48, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16)
    (model(x).float() ** 2).mean().mul(50.0).backward()


def wrapped(model, fused, **kwargs):
    return MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=3e-2, weight_decay=0.1), fused=fused,
                                 **kwargs)


def bits(x):
    """float32 -> its bit patterns as int64 in [0, 2³²) (NaNs compare too)."""
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def assert_same_run(ref_model, ref_opt, got_model, got_opt, step):
    for w_ref, w in zip(ref_opt.masters, got_opt.masters):
        assert_close(f"master, step {step}", w_ref, w, FP32)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(f"{key}, step {step}", ref_opt.state[w_ref][key], got_opt.state[w][key], FP32)
        assert float(ref_opt.state[w_ref]["step"]) == float(got_opt.state[w]["step"])
    for p_ref, p, w in zip(ref_model.parameters(), got_model.parameters(), got_opt.masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p, w.to(torch.bfloat16)), step  # p = bf16(w)
        ulp = torch.finfo(torch.bfloat16).eps * p_ref.float().abs().clamp_min(1e-30)
        assert ((p.float() - p_ref.float()).abs() <= ulp).all(), step  # at most one bf16 rounding apart


@needs_kernels
def test_fused_step_equals_the_unfused_path():
    """Five steps with a changing lr, clipping active (max_norm 0.05) then not (inf): the norms, masters,
    AdamW moments and step counts equal the reference path's within float32 rounding."""
    ref_model = bf16_model()
    got_model = copy.deepcopy(ref_model)
    ref_opt, got_opt = wrapped(ref_model, fused=False), wrapped(got_model, fused=True)
    assert got_opt.fused and not ref_opt.fused
    for step in range(5):
        max_norm = 0.05 if step < 3 else float("inf")
        for opt, model in ((ref_opt, ref_model), (got_opt, got_model)):
            set_lr(opt, step, 10, 1, 0.1)
            backward(model, seed=step)
        norm_ref, norm = ref_opt.clip_grad_norm_(max_norm), got_opt.clip_grad_norm_(max_norm)
        assert_close(f"grad norm, step {step}", norm_ref, norm, FP32)
        assert step >= 3 or float(norm) > 0.05  # the clip is active in the first steps
        for opt in (ref_opt, got_opt):
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in got_model.parameters())
        assert_same_run(ref_model, ref_opt, got_model, got_opt, step)


@needs_kernels
@pytest.mark.parametrize("master_format", MASTER_FORMATS)
def test_kept_launches_equal_fresh_ones(master_format):
    """keep_grads=True (the gradients stay the same tensors, as under a CUDA graph): the fused step keeps its
    launches (addresses built once) and only rewrites their scalars, and gives the same bits as a run that
    builds its launches every step — with a new learning rate each step (the scalars are read on the device);
    in both master formats (split: the masters are the int16 low halves, the parameters are read too)."""
    fresh_model = bf16_model()
    kept_model = copy.deepcopy(fresh_model)
    fresh = wrapped(fresh_model, fused=True, master_format=master_format)
    kept = wrapped(kept_model, fused=True, master_format=master_format)
    kept.keep_grads = True
    launch_ids = None
    for step in range(4):
        for opt, model in ((fresh, fresh_model), (kept, kept_model)):
            set_lr(opt, step, 6, 1, 0.1)
            opt.zero_grad(set_to_none=False)  # kept: zero in place (backward accumulates into the kept tensors)
            backward(model, seed=step)
            opt.clip_grad_norm_(0.05 if step < 2 else float("inf"))
            opt.step()
        assert all(p.grad is None for p in fresh_model.parameters())
        assert all(p.grad is not None for p in kept_model.parameters())
        ids = [id(launch) for launch in kept._launches.values()]
        assert ids and (launch_ids is None or ids == launch_ids), step  # built at the first step, then reused
        launch_ids = ids
        for w_fresh, w_kept in zip(fresh.masters, kept.masters):
            assert w_kept.dtype == (torch.int16 if master_format == "split" else torch.float32)
            assert torch.equal(w_fresh, w_kept), step
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(fresh.state[w_fresh][key], kept.state[w_kept][key]), (key, step)
        for p_fresh, p_kept in zip(fresh_model.parameters(), kept_model.parameters()):
            assert torch.equal(p_fresh, p_kept), step
    kept.keep_grads = False  # dropping keep_grads drops the kept launches
    assert not kept._launches


@needs_kernels
def test_fused_state_dict_continues_on_either_path():
    """A fused run's state (torch's AdamW keys, plus the masters) resumes unfused, and the reverse."""
    model = bf16_model()
    opt = wrapped(model, fused=True)
    for step in range(2):
        backward(model, seed=step)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    state = copy.deepcopy(opt.state_dict())
    runs = {}
    for fused in (False, True):
        resumed = copy.deepcopy(model)
        resumed_opt = wrapped(resumed, fused=fused)
        resumed_opt.load_state_dict(copy.deepcopy(state))
        backward(resumed, seed=2)
        resumed_opt.clip_grad_norm_(1.0)
        resumed_opt.step()
        runs[fused] = (resumed, resumed_opt)
    assert_same_run(*runs[False], *runs[True], step=2)


def test_fused_refusals_name_the_reason():
    model = bf16_model()
    with pytest.raises(ValueError, match=r"fused=True\): the fused step is AdamW's, the wrapped optimizer is SGD"):
        MasterWeightOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), fused=True)
    with pytest.raises(ValueError, match="no amsgrad or maximize"):
        MasterWeightOptimizer(model, torch.optim.AdamW(model.parameters(), amsgrad=True), fused=True)
    if not KERNELS_RUN_HERE:  # CPU without the interpreter: the reference path, chosen and refused loudly
        assert not wrapped(model, fused=None).fused
        with pytest.raises(ValueError, match="contiguous bf16 CUDA tensor"):
            wrapped(model, fused=True)


def test_kernel_inputs_checked():
    ok = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
    f32, bf16 = (lambda *s: torch.zeros(*s)), (lambda *s: torch.zeros(*s, dtype=torch.bfloat16))
    lists = [[f32(4, 3), f32(2)], [bf16(4, 3), bf16(2)], [f32(4, 3), f32(2)], [f32(4, 3), f32(2)], [bf16(4, 3), bf16(2)]]
    clip = torch.ones(())
    with pytest.raises(ValueError, match=r"grads\[1\] must be a contiguous torch.bfloat16 tensor of shape \(2,\)"):
        fused_step(lists[0], [bf16(4, 3), f32(2)], *lists[2:], clip, **ok)
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\] must be .* \(not contiguous\)"):
        fused_step(*lists[:3], [f32(3, 4).t(), f32(2)], lists[4], clip, **ok)
    with pytest.raises(ValueError, match=r"the five lists must have one length, got \[2, 2, 2, 2, 1\]"):
        fused_step(*lists[:4], lists[4][:1], clip, **ok)
    with pytest.raises(ValueError, match="step=0: AdamW steps count from 1"):
        fused_step(*lists, clip, **{**ok, "step": 0})
    i16 = lambda *s: torch.zeros(*s, dtype=torch.int16)  # noqa: E731 — the split format's masters
    with pytest.raises(ValueError, match=r"masters\[1\] must be a contiguous torch.int16 tensor of shape \(2,\)"):
        fused_step([i16(4, 3), f32(2)], *lists[1:], clip, **ok)
    with pytest.raises(ValueError, match=r"masters\[0\] must be a contiguous torch.float32 tensor .* got torch.int32"):
        fused_step([torch.zeros(4, 3, dtype=torch.int32), f32(2)], *lists[1:], clip, **ok)


def reference_bf16_moment_step(w, m, v, g, clip, *, lr, beta1, beta2, eps, weight_decay, step):
    """The module docstring's update in plain float32 PyTorch, with m and v rounded to bf16 after their
    update (what the next step reads) -> (w, m, v, p) — an independent reference for the kernel."""
    g = clip * g.float()
    w = w * (1 - lr * weight_decay)
    m = (beta1 * m.float() + (1 - beta1) * g).to(torch.bfloat16)
    v = (beta2 * v.float() + (1 - beta2) * g * g).to(torch.bfloat16)
    denom = v.float().sqrt() / (1 - beta2 ** step) ** 0.5 + eps
    w = w - (lr / (1 - beta1 ** step)) * m.float() / denom
    return w, m, v, w.to(torch.bfloat16)


@needs_kernels
def test_bf16_moments_kernel_equals_the_plain_formula():
    """Three steps of the kernel with bf16 m and v, each against :func:`reference_bf16_moment_step` applied to
    the kernel's state before it: moments within one bf16 ulp (or float32 rounding where the two terms
    cancel), masters within float32 rounding, p = bf16(w)."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(70, 33), (5,), (2100,)]  # one tensor over a kernel block
    w = [torch.randn(*s, generator=gen).to(DEVICE) for s in shapes]
    m = [torch.zeros(*s, dtype=torch.bfloat16, device=DEVICE) for s in shapes]
    v = [torch.zeros(*s, dtype=torch.bfloat16, device=DEVICE) for s in shapes]
    p = [x.to(torch.bfloat16) for x in w]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in range(1, 4):  # each step against the reference applied to the kernel's state before it
        g = [torch.randn(*s, generator=gen).to(DEVICE, torch.bfloat16) for s in shapes]
        clip = torch.tensor(0.5 if step == 1 else 1.0, device=DEVICE)
        ref = [reference_bf16_moment_step(x.clone(), a.clone(), b.clone(), gi, clip, step=step, **hyper)[:3]
               for x, a, b, gi in zip(w, m, v, g)]
        prev = {"exp_avg": [a.clone() for a in m], "exp_avg_sq": [b.clone() for b in v]}
        fused_step(w, g, m, v, p, clip, step=step, **hyper)
        for i, (rw, rm, rv) in enumerate(ref):
            assert m[i].dtype == v[i].dtype == torch.bfloat16
            for name, got, want, beta, new in (("exp_avg", m[i], rm, 0.9, g[i].float()),
                                               ("exp_avg_sq", v[i], rv, 0.95, g[i].float() ** 2)):
                # one bf16 ulp of the result, or float32 rounding of the two terms where they cancel (the GPU
                # fuses a multiply-add the reference rounds twice: an fp32 ulp of the terms, then bf16)
                terms = beta * prev[name][i].float().abs() + (1 - beta) * new.abs() * float(clip) ** (1 + (name == "exp_avg_sq"))
                bound = torch.finfo(torch.bfloat16).eps * want.float().abs() + 1e-6 * terms
                assert ((got.float() - want.float()).abs() <= bound).all(), (name, step, i)
                if INTERPRETED:  # op for op the same float32 arithmetic: almost all bits equal. On a GPU the
                    # kernel's fused multiply-adds move more values across a bf16 rounding boundary (H200: the
                    # bound above holds, the share of equal bits fell under 99% at step 2)
                    assert (got == want).float().mean() > 0.99, (name, step, i)
            assert_close(f"master {i}, step {step}", rw, w[i], 1e-5)
            assert torch.equal(p[i], w[i].to(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("master_format", MASTER_FORMATS)
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_reference_step_is_the_kernel(moments, master_format):
    """master_adamw_reference_ (the fused step where no kernel runs: the CPU, FSDP2's local shards under gloo)
    against the kernel, three steps from one state, a clip active then not: masters and float32 moments within
    float32 rounding, bf16 moments and parameters within one bf16 rounding (Triton's interpreter evaluates the
    scalar terms such as 1 − β1 in double, a GPU fuses multiply-adds: the same formula, not the same bits)."""
    from k3lab.precision import adamw_scalars, master_adamw_reference_

    gen = torch.Generator().manual_seed(5)
    shapes = [(70, 33), (5,), (2100,)]  # one tensor over a kernel block
    start = [torch.randn(*s, generator=gen).to(DEVICE) for s in shapes]

    def state():  # [masters, exp_avgs, exp_avg_sqs, params]
        split = [split_master(w) for w in start]
        masters = [lo for _, lo in split] if master_format == "split" else [w.clone() for w in start]
        params = [p for p, _ in split] if master_format == "split" else [w.to(torch.bfloat16) for w in start]
        return [masters, [torch.zeros_like(w, dtype=moments) for w in start],
                [torch.zeros_like(w, dtype=moments) for w in start], params]

    kernel = state()
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in range(1, 4):  # each step from the kernel's state before it
        reference = [[t.clone() for t in ts] for ts in kernel]
        grads = [torch.randn(*s, generator=gen).to(DEVICE, torch.bfloat16) for s in shapes]
        clip = torch.tensor(0.5 if step == 1 else 1.0, device=DEVICE)
        w, m, v, p = kernel
        fused_step(w, grads, m, v, p, clip, step=step, **hyper)
        scalars = torch.tensor(adamw_scalars(hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["weight_decay"], step),
                               dtype=torch.float32, device=DEVICE)
        before = [[t.float() for t in ts] for ts in reference[1:3]]
        for w, m, v, g, p in zip(*reference[:3], grads, reference[3]):
            master_adamw_reference_(w, g, m, v, p, clip, scalars, beta1=0.9, beta2=0.95, eps=1e-8)
        for i in range(len(shapes)):
            a, b = reference[0][i], kernel[0][i]
            if master_format == "split":  # the joined float32 masters
                a, b = join_master(reference[3][i], a), join_master(kernel[3][i], b)
            # float32 rounding through m / √v; bf16 moments a rounding apart move the update by up to 2⁻⁸ of itself
            assert_close(f"master {i}, step {step}", b, a, 1e-5 if moments == torch.float32 else 1e-3)
            for k, new in ((1, grads[i].float().abs()), (2, grads[i].float() ** 2)):
                a, b = reference[k][i].float(), kernel[k][i].float()
                if moments == torch.float32:
                    assert_close(f"moment {k} {i}, step {step}", b, a, FP32)
                else:  # one bf16 rounding apart, or float32 rounding of the two terms where they cancel
                    terms = before[k - 1][i].abs() + new
                    bound = torch.finfo(torch.bfloat16).eps * torch.maximum(a.abs(), b.abs()) + 1e-6 * terms
                    assert ((a - b).abs() <= bound).all(), (k, i, step)
        for w, p in zip(reference[0], reference[3]):  # p is its master's rounding (split: its high half)
            want = split_master(join_master(p, w))[0] if master_format == "split" else w.to(torch.bfloat16)
            assert torch.equal(p, want)


@needs_kernels
def test_bf16_moments_optimizer_state_and_resume():
    """MasterWeightOptimizer(moment_dtype="bfloat16"): bf16 moments in torch's AdamW state, within bf16 rounding
    of the float32-moment run after the first step (later steps see other gradients: this toy loss amplifies
    sub-ulp weight differences); after three steps a saved state resumes bit for bit (moments stay bf16)."""
    ref_model, got_model = bf16_model(), bf16_model()
    ref_opt = wrapped(ref_model, fused=True)
    got_opt = MasterWeightOptimizer(got_model, build_optimizer(got_model, "adamw", lr=3e-2, weight_decay=0.1),
                                    moment_dtype="bfloat16")
    for step in range(3):
        for model, opt in ((ref_model, ref_opt), (got_model, got_opt)):
            backward(model, seed=step)
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        for w_ref, w in zip(ref_opt.masters, got_opt.masters) if step == 0 else ():
            for key in ("exp_avg", "exp_avg_sq"):
                got, want = got_opt.state[w][key], ref_opt.state[w_ref][key]
                assert got.dtype == torch.bfloat16 and want.dtype == torch.float32
                assert_close(key, want, got.float(), 1e-2)  # bf16 keeps 8 significant bits
            assert_close("master", w_ref, w, 1e-2)
    state = copy.deepcopy(got_opt.state_dict())
    runs = []
    for _ in range(2):
        model = copy.deepcopy(got_model)
        opt = MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=3e-2, weight_decay=0.1),
                                    moment_dtype="bfloat16")
        opt.load_state_dict(copy.deepcopy(state))
        assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())
        backward(model, seed=3)
        opt.clip_grad_norm_(1.0)
        opt.step()
        runs.append(opt)
    backward(got_model, seed=3)
    got_opt.clip_grad_norm_(1.0)
    got_opt.step()
    for opt in runs:
        for w_ref, w in zip(got_opt.masters, opt.masters):
            assert torch.equal(w_ref, w)
            assert torch.equal(got_opt.state[w_ref]["exp_avg_sq"], opt.state[w]["exp_avg_sq"])


def test_bf16_moments_refused_where_the_fused_step_does_not_run():
    from k3lab.train import TrainConfig

    model = bf16_model()
    with pytest.raises(ValueError, match=r"moment_dtype='float16': allowed values are \('float32', 'bfloat16'\)"):
        MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=1e-2), moment_dtype="float16")
    with pytest.raises(ValueError, match="moment_dtype='bfloat16' needs the fused AdamW step"):
        MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=1e-2), fused=False, moment_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"TrainConfig.moment_dtype='bfloat16': 'bfloat16' needs TrainConfig.param_dtype"):
        TrainConfig(dtype="bfloat16", moment_dtype="bfloat16")
    with pytest.raises(ValueError, match="optimizer='muon'"):
        TrainConfig(dtype="bfloat16", param_dtype="bfloat16", optimizer="muon", moment_dtype="bfloat16")


# ----------------------------------------------------------------------------------------------
# the split master format (master_format="split": bf16 p + int16 lo, bits(w) = (bits(p) << 16) + lo)
# ----------------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy, on NaNs
def test_split_kernel_is_the_reference_split(moments):
    """The kernel with int16 masters. (1) lr = 0 (w passes through): any (p, lo) — every bit pattern, ±0 under a
    negative lo, NaN-making pairs — comes back as split_master(join_master(p, lo)): the kernel's join and split
    are the plain-torch ones, bit for bit. (2) Three steps from one w against the kernel on float32 masters:
    the joined master, m and v bit for bit; (p, lo) = split_master(w); p = the float32 run's bf16(w) off ties."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(70, 33), (12,), (2100,)]  # one tensor over a kernel block, partial blocks; (12,): the edges
    rand16 = lambda s: torch.randint(-2**15, 2**15, s, generator=gen, dtype=torch.int16)  # noqa: E731
    p = [rand16(s).view(torch.bfloat16).to(DEVICE) for s in shapes]
    lo = [rand16(s).to(DEVICE) for s in shapes]
    edges = [(0x7F80, 0), (0x7F80, -1), (0x7F7F, 32767), (0x7F7F, -32768),  # inf; max finite; 0x7F7F7FFF; a tie
             (0x0000, -1), (-0x8000, -1), (0x7FFF, -1), (-1, 32767),  # NaNs: 0xFFFFFFFF, 0x7FFFFFFF, ...
             (0x3F80, -32768), (0x0000, 1), (-0x8000, 5), (0x7FC0, 0)]  # a tie below 1; ±denormals; the quiet NaN
    p[1] = torch.tensor([a for a, _ in edges], dtype=torch.int16).view(torch.bfloat16).to(DEVICE)
    lo[1] = torch.tensor([b for _, b in edges], dtype=torch.int16).to(DEVICE)
    want = [split_master(join_master(a, b)) for a, b in zip(p, lo)]
    zeros = lambda dtype: [torch.zeros(s, dtype=dtype, device=DEVICE) for s in shapes]  # noqa: E731
    fused_step(lo, zeros(torch.bfloat16), zeros(moments), zeros(moments), p, torch.ones((), device=DEVICE),
                       lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    for (want_p, want_lo), got_p, got_lo in zip(want, p, lo):
        assert torch.equal(got_p.view(torch.int16), want_p.view(torch.int16)) and torch.equal(got_lo, want_lo)
    assert torch.isnan(p[1][4:8].float()).all() and (p[1][4:8].view(torch.int16) == 0x7FC0).all()
    assert not lo[1][4:8].any()
    assert p[1][1].float() == float("inf") and lo[1][1] == -1  # the largest finite float: (inf, -1)

    w = [torch.randn(s, generator=gen).to(DEVICE) for s in shapes]
    w[2][:300] = ((w[2][:300].view(torch.int32) & ~0xFFFF) | 0x8000).view(torch.float32)  # ties to start from
    split = [split_master(x) for x in w]
    p_split, lo = [a for a, _ in split], [b for _, b in split]
    p_f32 = [x.to(torch.bfloat16) for x in w]
    m32, v32, m16, v16 = zeros(moments), zeros(moments), zeros(moments), zeros(moments)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in range(1, 4):
        g = [torch.randn(s, generator=gen).to(DEVICE, torch.bfloat16) for s in shapes]
        clip = torch.tensor(0.5 if step == 1 else 1.0, device=DEVICE)
        fused_step(w, g, m32, v32, p_f32, clip, step=step, **hyper)
        fused_step(lo, g, m16, v16, p_split, clip, step=step, **hyper)
        for i in range(len(shapes)):
            assert torch.equal(bits(join_master(p_split[i], lo[i])), bits(w[i])), (step, i)
            assert torch.equal(m16[i], m32[i]) and torch.equal(v16[i], v32[i]), (step, i)
            want_p, want_lo = split_master(w[i])
            assert torch.equal(p_split[i], want_p) and torch.equal(lo[i], want_lo), (step, i)
            tie = (bits(w[i]) & 0xFFFF) == 0x8000
            assert torch.equal(p_split[i][~tie], p_f32[i][~tie]), (step, i)


def split_and_float32_runs(moment_dtype="float32"):
    """Two copies of one bf16 model, wrapped with float32 and with split masters (the fused step), started from
    masters with planted ties: the first 8 entries of the first bias (no weight decay; :func:`same_grads` gives
    them zero gradients, so m = v = 0 and w stays a tie: nearest-even rounds those down, the split away)."""
    ref_model = bf16_model()
    got_model = copy.deepcopy(ref_model)
    ref = wrapped(ref_model, True, moment_dtype=moment_dtype)
    got = wrapped(got_model, True, moment_dtype=moment_dtype, master_format="split")
    assert got.fused and all(lo.dtype == torch.int16 and not lo.any() for lo in got.masters)
    assert all(torch.equal(w, p.float()) for w, p in zip(got.float32_masters(), got_model.parameters()))
    with torch.no_grad():  # low half 0x8000 under an even high half
        w = ref.masters[1][:8]
        w.copy_(((w.view(torch.int32) & ~0x1FFFF) | 0x8000).view(torch.float32))
    state = ref.state_dict()
    for opt in (ref, got):  # a float32 master state loads into either format
        opt.load_state_dict(copy.deepcopy(state))
    return ref_model, ref, got_model, got


def same_grads(models, seed):
    """The same random bf16 gradients on every model's parameters (zero on the planted ties)."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=gen).to(DEVICE, torch.bfloat16) for p in models[0].parameters()]
    grads[1][:8] = 0
    for model in models:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()


def assert_split_equals_float32(ref_model, ref, got_model, got, step):
    """The joined masters equal the float32 masters bit for bit, moments and steps too; p equals the float32 run's
    bf16(w) except at ties, where it is w's high half rounded away from zero. Returns the number of ties."""
    ties = 0
    for w_ref, lo, p_ref, p in zip(ref.masters, got.masters, ref_model.parameters(), got_model.parameters()):
        assert torch.equal(bits(join_master(p, lo)), bits(w_ref)), step
        assert ref.state[w_ref].keys() == got.state[lo].keys()  # none before the first step
        for key in ref.state[w_ref]:
            assert torch.equal(ref.state[w_ref][key], got.state[lo][key]), (key, step)
        tie = (bits(w_ref) & 0xFFFF) == 0x8000
        assert torch.equal(p_ref, w_ref.to(torch.bfloat16)) and torch.equal(p[~tie], p_ref[~tie]), step
        assert torch.equal(p.view(torch.int16)[tie].to(torch.int64) & 0xFFFF, (bits(w_ref)[tie] >> 16) + 1), step
        ties += int(tie.sum())
    return ties


@needs_kernels
@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_split_masters_equal_float32_masters(moment_dtype):
    """Five fused steps on the same gradients (a changing lr; clipping active, then not): split masters, joined,
    are the float32 masters bit for bit after every step, and so are the moments; p differs only at ties."""
    ref_model, ref, got_model, got = split_and_float32_runs(moment_dtype)
    assert assert_split_equals_float32(ref_model, ref, got_model, got, step=-1) >= 8
    for step in range(5):
        same_grads([ref_model, got_model], seed=step)
        norms = []
        for opt in (ref, got):
            set_lr(opt, step, 10, 1, 0.1)
            norms.append(opt.clip_grad_norm_(0.05 if step < 3 else float("inf")))
            opt.step()
            opt.zero_grad()
        assert torch.equal(*norms) and all(p.grad is None for p in got_model.parameters())
        assert got.state[got.masters[0]]["exp_avg"].dtype == getattr(torch, moment_dtype)
        assert assert_split_equals_float32(ref_model, ref, got_model, got, step) >= 8  # the planted ties stay


@needs_kernels
def test_split_state_dict_loads_either_way():
    """Checkpoints are format-independent: the split run's state_dict holds fp32 masters (its joined ones); a
    split state loads into float32 masters and a float32 state into split ones, each restoring the masters,
    parameters and moments of the run it came from, and the resumed runs continue bit for bit."""
    ref_model, ref, got_model, got = split_and_float32_runs()
    for step in range(2):
        same_grads([ref_model, got_model], seed=step)
        for opt in (ref, got):
            opt.clip_grad_norm_(0.05)
            opt.step()
    split_state, f32_state = copy.deepcopy(got.state_dict()), copy.deepcopy(ref.state_dict())
    for i, s in split_state["state"].items():
        want = f32_state["state"][i][MASTER_KEY].cpu()
        assert s[MASTER_KEY].dtype == torch.float32 and torch.equal(bits(s[MASTER_KEY]), bits(want))
    as_f32_model, as_split_model = bf16_model(seed=1), bf16_model(seed=1)
    as_f32 = wrapped(as_f32_model, True)
    as_split = wrapped(as_split_model, True, master_format="split")
    as_f32.load_state_dict(copy.deepcopy(split_state))   # split -> float32
    as_split.load_state_dict(copy.deepcopy(f32_state))   # float32 -> split
    pairs = ((ref_model, ref, as_f32_model, as_f32), (got_model, got, as_split_model, as_split))

    def assert_resumed_equal(step):  # each resumed run equals, bit for bit, the run whose state it loaded
        for model_a, opt_a, model_b, opt_b in pairs:
            for w_a, w_b in zip(opt_a.masters, opt_b.masters):
                assert w_a.dtype == w_b.dtype and torch.equal(w_a, w_b), step
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(opt_a.state[w_a][key], opt_b.state[w_b][key]), (key, step)
            for p_a, p_b in zip(model_a.parameters(), model_b.parameters()):
                assert torch.equal(p_a, p_b), step

    for step in range(2, 4):
        assert_resumed_equal(step)
        same_grads([ref_model, got_model, as_f32_model, as_split_model], seed=step)
        for opt in (ref, got, as_f32, as_split):
            opt.clip_grad_norm_(1.0)
            opt.step()
    assert_resumed_equal(4)
    assert_split_equals_float32(ref_model, ref, got_model, got, step=4)


@needs_kernels
def test_split_refuses_the_unfused_calls():
    """split masters are int16: grads_to_masters (fp32 grads on them) is refused, naming the field; a step without
    gradients changes nothing; sync_from_params has nothing to do (QK-Clip's rescale moves w with p, keeping
    w's low bits: within half a bf16 ulp of the new p, which is still its rounding)."""
    model = bf16_model()
    opt = wrapped(model, None, master_format="split")
    same_grads([model], seed=0)
    with pytest.raises(ValueError, match=r"grads_to_masters: TrainConfig\.master_format='split' keeps"):
        opt.grads_to_masters()
    opt.clip_grad_norm_(1.0)
    opt.step()
    before = [p.clone() for p in model.parameters()], [lo.clone() for lo in opt.masters]
    opt.step()  # no gradients: nothing to step
    assert all(map(torch.equal, before[0], model.parameters())) and all(map(torch.equal, before[1], opt.masters))
    with torch.no_grad():
        model[0].weight[0].mul_(0.5)  # as QK-Clip's scale_rows_
    assert opt.sync_from_params() == 0
    w = join_master(model[0].weight, opt.masters[0])
    p, lo = split_master(w)
    assert torch.equal(p, model[0].weight) and torch.equal(lo, opt.masters[0])  # p is still w's rounding
    ulp = torch.finfo(torch.bfloat16).eps * model[0].weight.float().abs()
    assert ((w - model[0].weight.float()).abs() <= ulp / 2).all()


class TinyLM(nn.Module):
    """Embedding -> Linear -> LayerNorm -> head, for fit (pre-aligned labels)."""

    def __init__(self, vocab=61, dim=16):
        super().__init__()
        self.embed, self.mix, self.norm, self.head = (nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.LayerNorm(dim),
                                                      nn.Linear(dim, vocab))

    def forward(self, input_ids, labels=None):
        logits = self.head(self.norm(self.mix(self.embed(input_ids))))
        loss = None if labels is None else nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return CausalLMOutput(loss=loss, logits=logits)


def lm_run(master_format, out_dir, stop_at=None, resume_from=None):
    from k3lab.train import TrainConfig, fit

    torch.manual_seed(0)
    model = TinyLM()
    cfg = TrainConfig(steps=4, lr=1e-2, warmup_steps=1, device=DEVICE, progress=False, dtype="bfloat16",
                      param_dtype="bfloat16", master_format=master_format, out_dir=str(out_dir))
    stream = torch.arange(2000) % 61
    return model, fit(model, batch_iterator(stream, 2, 8, seed=1), cfg, stop_at=stop_at, resume_from=resume_from)


@needs_kernels
def test_fit_with_split_masters_resumes_in_either_format(tmp_path):
    """fit(master_format="split"): an interrupted run resumes bit for bit; its checkpoint holds fp32 masters
    (optimizer.safetensors) and loads into float32 masters, and a float32-master checkpoint into split ones;
    fit resumes across formats, warning that master_format changed."""
    from safetensors.torch import load_file

    from k3lab.train import load_checkpoint

    full_model, full = lm_run("split", tmp_path / "full")
    _, half = lm_run("split", tmp_path / "half", stop_at=2)
    resumed_model, resumed = lm_run("split", tmp_path / "half", resume_from=tmp_path / "half")
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history]
    assert all(map(torch.equal, full_model.parameters(), resumed_model.parameters()))
    _, f32_half = lm_run("float32", tmp_path / "f32", stop_at=2)
    for checkpoint, load_as in ((half.checkpoint, "float32"), (f32_half.checkpoint, "split")):
        saved = load_file(str(checkpoint / "optimizer.safetensors"))
        model = TinyLM().to(DEVICE)
        cast_params_(model)
        opt = wrapped(model, None, master_format=load_as)
        load_checkpoint(checkpoint, model, opt)
        index = {id(w): i for i, w in enumerate(w for g in opt.param_groups for w in g["params"])}
        for p, lo_or_w, w in zip(model.parameters(), opt.masters, opt.float32_masters()):
            master = saved[f"{index[id(lo_or_w)]}.master"].to(DEVICE)
            assert master.dtype == torch.float32 and torch.equal(bits(w), bits(master))
            assert torch.equal(p, split_master(master)[0] if load_as == "split" else master.to(torch.bfloat16))
    with pytest.warns(UserWarning, match=r"honoured \(this run's values\): master_format 'float32' -> 'split'"):
        _, crossed = lm_run("split", tmp_path / "f32", resume_from=tmp_path / "f32")
    assert crossed.step == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in crossed.history)
