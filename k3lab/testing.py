"""Helpers shared by tests and notebooks: one definition of "relative error", a saved-for-backward counter, a module
run eager and compiled, and the run of a kernel test file under Triton's CPU interpreter."""

import os
import subprocess
import sys

import torch

# Where Triton kernel tests run: on the CPU under Triton's interpreter (TRITON_INTERPRET=1, which must be set
# before triton is imported: run_interpreter_suite starts such a process), else on CUDA when there is a GPU
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNELS_RUN_HERE = INTERPRETED or torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (0 when both are zero)."""
    got, ref = got.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    diff = (got - ref).norm().item()
    return diff if denom == 0.0 else diff / denom


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    """Fail with a readable message when rel_err(got, ref) > tol."""
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    if not torch.isfinite(got).all():
        raise AssertionError(f"{name}: non-finite values")
    err = rel_err(got, ref)
    if err > tol:
        raise AssertionError(f"{name}: relative error {err:.3e} > tolerance {tol:.1e}")


def eager_and_compiled(build, make_input, compile_backend) -> list[dict]:
    """Forward and backward (loss ``y.square().sum()``) of a module built twice by ``build()`` after
    ``torch.manual_seed(0)``, eager and then compiled with ``compile_backend`` (a name or a callable; dynamo reset
    first), on the input ``make_input()`` (requires grad). Returns ``[eager, compiled]``, each
    ``{"y": output, "x": input grad, parameter name: grad or None}``, for comparing one with the other."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        module = build()
        x = make_input().requires_grad_()
        if compiled:
            torch._dynamo.reset()
            module.compile(backend=compile_backend)
        y = module(x)
        y.square().sum().backward()
        runs.append({"y": y.detach(), "x": x.grad, **{n: p.grad for n, p in module.named_parameters()}})
    return runs


def saved_bytes(fn, exclude=()) -> tuple[object, dict]:
    """Run ``fn()`` recording every tensor autograd saves for backward; returns
    ``(output, {storage pointer: (bytes, dtype, shape)})``. Counted once per storage (a tensor saved by
    two ops is one allocation); ``exclude``'s storages (the parameters) are skipped."""
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = (st.nbytes(), t.dtype, tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def run_interpreter_suite(path: str, *extra_args: str, timeout: float = 600.0) -> str:
    """Run the test file ``path`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (which must be set before
    triton is imported, hence the new process): its kernel tests then run on the CPU at their tiny shapes.
    Deselects GPU-marked tests and the calling ``test_interpreter_suite`` itself; ``extra_args`` go to pytest
    (e.g. ``"-W", "error:overflow encountered:RuntimeWarning"``). Fails with the run's output tail unless it
    passes with nothing skipped; returns its stdout."""
    cmd = [sys.executable, "-m", "pytest", path, "-q", "-o", "addopts=", "-p", "no:cacheprovider",
           "-m", "not gpu", "-k", "not interpreter_suite", *extra_args]
    run = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                         timeout=timeout)
    if run.returncode != 0:
        raise AssertionError(f"{path} under TRITON_INTERPRET=1 failed:\n{run.stdout[-6000:]}{run.stderr[-3000:]}")
    if " passed" not in run.stdout or " skipped" in run.stdout:
        raise AssertionError(f"{path} under TRITON_INTERPRET=1: expected every test to run\n{run.stdout[-2000:]}")
    return run.stdout


def load_script(path, name: str):
    """Import the script at ``path`` (a ``kernels/`` benchmark, a ``tools/`` check) as module ``name``, so tests (or
    another script) can call its functions; registered in ``sys.modules`` (dataclasses look their module up there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def k3lab_imports(path, top_level_only: bool = False) -> set[str]:
    """The k3lab modules a source file imports (``from k3lab.kernels import x`` counts as ``k3lab.kernels.x``), at any
    depth or, with ``top_level_only``, at module level only: the layering tests' reading of a file."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module] if node.module != "k3lab.kernels" else
                         [f"k3lab.kernels.{a.name}" for a in node.names])
    return {n for n in names if n.startswith("k3lab")}
