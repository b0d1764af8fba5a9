"""The fused master-weight AdamW step (k3lab.kernels.adamw, MasterWeightOptimizer(fused=True)) against the
unfused reference path: fp32 grads on the masters, ``nn.utils.clip_grad_norm_``, ``torch.optim.AdamW``,
``p = bf16(w)``.

On CPU the kernel runs under Triton's interpreter, which must be on before triton is imported:
``test_interpreter_suite`` re-runs this file in a fresh process with ``TRITON_INTERPRET=1``.
"""
import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from k3lab.optim import build_optimizer, set_lr
from k3lab.precision import MasterWeightOptimizer, cast_params_
from k3lab.testing import assert_close

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNELS_RUN_HERE = INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
FP32 = 1e-6  # relative: the same float32 formula, rounded in another order
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="runs in test_interpreter_suite's subprocess")


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run directly here")
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under TRITON_INTERPRET=1 in a fresh interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-o", "addopts=", "-p", "no:cacheprovider",
           "-m", "not gpu", "-k", "not interpreter_suite"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]


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
