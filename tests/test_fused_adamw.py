"""The fused master-weight AdamW step (k3lab.kernels.adamw, MasterWeightOptimizer(fused=True)) against the
unfused reference path: fp32 grads on the masters, ``nn.utils.clip_grad_norm_``, ``torch.optim.AdamW``,
``p = bf16(w)``.

On CPU the kernel runs under Triton's interpreter, which must be on before triton is imported:
``test_interpreter_suite`` re-runs this file in a fresh process with ``TRITON_INTERPRET=1``.
"""
import copy

import pytest
import torch
from torch import nn

from k3lab.optim import build_optimizer, set_lr
from k3lab.precision import MasterWeightOptimizer, cast_params_
from k3lab.testing import INTERPRETED, KERNELS_RUN_HERE, KERNEL_DEVICE, assert_close, run_interpreter_suite

DEVICE = KERNEL_DEVICE
FP32 = 1e-6  # relative: the same float32 formula, rounded in another order
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="runs in test_interpreter_suite's subprocess")


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run directly here")
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreter_suite(__file__)


def bf16_model(seed=0):
    """Layers of several sizes (one over a kernel block, 1-D biases without weight decay) in bf16."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 3), nn.LayerNorm(3)).to(DEVICE)
    cast_params_(model, "bfloat16")
    return model


def backward(model, seed):
    x = torch.randn(6, 48, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16)
    (model(x).float() ** 2).mean().mul(50.0).backward()


def wrapped(model, fused):
    return MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=3e-2, weight_decay=0.1), fused=fused)


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
def test_kept_launches_equal_fresh_ones():
    """keep_grads=True (the gradients stay the same tensors, as under a CUDA graph): the fused step keeps its
    launches (addresses built once) and only rewrites their scalars, and gives the same bits as a run that
    builds its launches every step — with a new learning rate each step (the scalars are read on the device)."""
    fresh_model = bf16_model()
    kept_model = copy.deepcopy(fresh_model)
    fresh, kept = wrapped(fresh_model, fused=True), wrapped(kept_model, fused=True)
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
            assert torch.equal(w_fresh, w_kept), step
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(fresh.state[w_fresh][key], kept.state[w_kept][key]), (key, step)
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
    from k3lab.kernels.adamw import master_adamw_step_

    ok = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
    f32, bf16 = (lambda *s: torch.zeros(*s)), (lambda *s: torch.zeros(*s, dtype=torch.bfloat16))
    lists = [[f32(4, 3), f32(2)], [bf16(4, 3), bf16(2)], [f32(4, 3), f32(2)], [f32(4, 3), f32(2)], [bf16(4, 3), bf16(2)]]
    clip = torch.ones(())
    with pytest.raises(ValueError, match=r"grads\[1\] must be a contiguous torch.bfloat16 tensor of shape \(2,\)"):
        master_adamw_step_(lists[0], [bf16(4, 3), f32(2)], *lists[2:], clip, **ok)
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\] must be .* \(not contiguous\)"):
        master_adamw_step_(*lists[:3], [f32(3, 4).t(), f32(2)], lists[4], clip, **ok)
    with pytest.raises(ValueError, match=r"the five lists must have one length, got \[2, 2, 2, 2, 1\]"):
        master_adamw_step_(*lists[:4], lists[4][:1], clip, **ok)
    with pytest.raises(ValueError, match="step=0: AdamW steps count from 1"):
        master_adamw_step_(*lists, clip, **{**ok, "step": 0})


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
    from k3lab.kernels.adamw import master_adamw_step_

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
        master_adamw_step_(w, g, m, v, p, clip, step=step, **hyper)
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
