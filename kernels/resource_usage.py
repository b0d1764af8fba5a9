"""Registers, spills and shared memory of every k3lab KDA kernel, compiled for Hopper (sm_90a) on any
machine — no GPU needed: Triton compiles ahead of time with its bundled ptxas.

    python kernels/resource_usage.py                    # B8 T4096 H16 D128, bf16 (the benchmark's first shape)
    python kernels/resource_usage.py --dtype float32 --sass

How: the host-side launch code (``k3lab.kernels.kda.kda_forward`` / ``kda_backward``) runs on tensors
on the ``meta`` device with ``JITFunction.run`` replaced by a recorder, so every launch is captured with
its real argument dtypes, constexprs and ``num_warps``/``num_stages``; each one is then compiled for
``GPUTarget("cuda", 90, 64)`` and its cubin read with ``cuobjdump --dump-resource-usage``.

Why it matters: a kernel at 255 registers with a STACK (spill) area runs one CTA per SM and waits on
local-memory traffic; this is the first thing to check before spending GPU time on a benchmark.
Numbers come from the local Triton (CI: 3.9), the GPU machine runs 3.6: close, not identical.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from k3lab.config import DTYPES  # noqa: E402

TORCH_TO_TRITON = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                   torch.int64: "i64"}


def record_launches(dtype: torch.dtype, B: int, T: int, H: int, D: int) -> list:
    """Run the forward and backward launch code on meta tensors; return ``[(kernel, bound args, options)]``."""
    from k3lab.kernels import kda

    launches = []

    def recorder(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        launches.append((self, bound, options))

    meta = dict(device="meta")
    q, k, v = (torch.empty(B, T, H, D, dtype=dtype, **meta) for _ in range(3))
    g = torch.empty(B, T, H, D, dtype=torch.float32, **meta)
    beta = torch.empty(B, T, H, dtype=dtype, **meta)
    original = JITFunction.run
    JITFunction.run = recorder
    try:
        o, _, saved = kda.kda_forward(q, k, v, g, beta, D ** -0.5, None, False)
        kda.kda_backward(q, k, v, g, beta, D ** -0.5, None, saved, torch.empty_like(v), None)
    finally:
        JITFunction.run = original
    return launches


def compile_hopper(fn: JITFunction, bound: dict, options: dict):
    """Compile one recorded launch for sm_90a; returns the CompiledKernel."""
    signature, constexprs, attrs = {}, {}, {}
    aligned = [["tt.divisibility", 16]]  # what a real launch specializes: 16-byte aligned pointers, ints % 16
    for i, p in enumerate(fn.params):
        name, value = p.name, bound[p.name]
        if p.is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name], attrs[(i,)] = "*" + TORCH_TO_TRITON[value.dtype], aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int):
            signature[name] = "i32"
            if value % 16 == 0 and name not in fn.do_not_specialize and i not in fn.do_not_specialize:
                attrs[(i,)] = aligned
        else:
            raise TypeError(f"argument {name} of {fn.__name__}: cannot type {type(value)}")
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=options)


def resource_usage(cubin: bytes) -> dict:
    """REG, STACK, SHARED from ``cuobjdump --dump-resource-usage``."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {key: int(val) for key, val in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def sass_counts(cubin: bytes) -> dict:
    """Instruction counts of interest in the SASS: tensor-core MMAs, exps (MUFU), shuffles, barriers,
    local-memory loads/stores (spills)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)
    groups = {"total": len(ops), "mma": 0, "mufu": 0, "shfl": 0, "bar": 0, "ldl/stl": 0, "lds/sts": 0}
    for op in ops:
        head = op.split(".")[0]
        groups["mma"] += head in ("HMMA", "HGMMA", "IMMA")
        groups["mufu"] += head == "MUFU"
        groups["shfl"] += head == "SHFL"
        groups["bar"] += head in ("BAR", "SYNCS")
        groups["ldl/stl"] += head in ("LDL", "STL")
        groups["lds/sts"] += head in ("LDS", "STS", "LDSM", "STSM")
    return groups


HOPPER_MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--shape", default="8,4096,16,128", help="B,T,H,D")
    parser.add_argument("--sass", action="store_true", help="also count SASS instructions (static, not executed)")
    args = parser.parse_args()
    B, T, H, D = (int(x) for x in args.shape.split(","))
    launches = record_launches(getattr(torch, args.dtype), B, T, H, D)
    head = f"{'kernel':<26}{'warps':>6}{'stages':>7}{'REG':>5}{'STACK':>7}{'SHARED':>8}"
    extra = ["total", "mma", "mufu", "shfl", "bar", "ldl/stl", "lds/sts"]
    print(head + ("".join(f"{e:>9}" for e in extra) if args.sass else ""))
    for fn, bound, options in launches:
        kernel = compile_hopper(fn, bound, options)
        use = resource_usage(kernel.asm["cubin"])
        line = (f"{fn.__name__:<26}{options.get('num_warps', 4):>6}{options.get('num_stages', 3):>7}"
                f"{use.get('REG', 0):>5}{use.get('STACK', 0):>7}{kernel.metadata.shared:>8}")
        if args.sass:
            counts = sass_counts(kernel.asm["cubin"])
            line += "".join(f"{counts[e]:>9}" for e in extra)
        if kernel.metadata.shared > HOPPER_MAX_SHARED:
            line += f"   SHARED > {HOPPER_MAX_SHARED} B: will not launch on an H100/H200"
        print(line, flush=True)


if __name__ == "__main__":
    main()
