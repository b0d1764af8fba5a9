"""Pinned autotuning (k3lab.kernels.autotune, used by -m gpu runs): the order it tries configurations, and on
CPU under TRITON_INTERPRET=1 that a pinned autotuner runs one configuration per key — the preferred one — and
that undoing the pin restores Triton's own tuning."""
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from k3lab.kernels.autotune import pinned_order


def cfg(block, warps=4, stages=2):
    return SimpleNamespace(kwargs={"BLOCK": block}, num_warps=warps, num_stages=stages)


def test_pinned_order_puts_the_preferred_first_then_fewest_stages():
    a, b, c, d = cfg(16, stages=3), cfg(32, stages=1), cfg(64, stages=2), cfg(64, warps=8, stages=1)
    order = pinned_order("k", [a, b, c, d], {"k": [{"kwargs": {"BLOCK": 64}, "num_warps": 8}]})
    assert order == [d, b, c, a]  # the preferred; then stages 1, 2, 3 (stable among equals)
    assert pinned_order("other", [a, b, c], {"k": [{"kwargs": {"BLOCK": 16}}]}) == [b, c, a]
    assert pinned_order("k", [a, c], {"k": [{"kwargs": {"BLOCK": 64}}, {"kwargs": {"BLOCK": 16}}]}) == [c, a]


SCRIPT = textwrap.dedent("""
    import functools, torch, triton, triton.language as tl
    print = functools.partial(print, flush=True)
    from k3lab.kernels.autotune import pin_autotuning, autotuning_pinned

    ran = []
    def hook(block):
        return lambda nargs: ran.append(block)

    @triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=1, num_stages=s, pre_hook=hook(b))
                              for b, s in ((16, 2), (32, 1), (64, 3))], key=["n"])
    @triton.jit
    def scale_kernel(x, y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offs, 2 * tl.load(x + offs, mask=offs < n), mask=offs < n)

    def call(n):
        x = torch.arange(n, dtype=torch.float32)
        y = torch.empty_like(x)
        scale_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
        assert torch.equal(y, 2 * x)

    undo = pin_autotuning({"scale_kernel": [{"kwargs": {"BLOCK": 64}}]})
    assert autotuning_pinned()
    call(100)
    print("pinned", sorted(set(ran)), scale_kernel.best_config.kwargs["BLOCK"])
    ran.clear()
    call(100)  # the same key: the kept choice, no tuning
    print("again", sorted(set(ran)))
    ran.clear()
    call(300)  # a new key: tuned (pinned) again
    print("newkey", sorted(set(ran)))
    undo()
    assert not autotuning_pinned()
    ran.clear()
    # unpinned: Triton benchmarks every configuration (on CPU its benchmarker needs a GPU driver: a stand-in that
    # launches once and reports equal times)
    scale_kernel.__dict__["do_bench"] = lambda fn, quantiles=None, **_: (fn(), [1.0] * len(quantiles or (0,)))[1]
    call(500)
    print("unpinned", sorted(set(ran)))
""")


def test_a_pinned_autotuner_runs_the_preferred_configuration_only(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["pinned"] == "[64] 64"  # only the preferred configuration ran, and it is the one kept
    assert lines["again"] == "[64]"
    assert lines["newkey"] == "[64]"
    assert lines["unpinned"] == "[16, 32, 64]"  # the undo restores Triton's tuning over every configuration
