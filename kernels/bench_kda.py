"""Benchmark k3lab's Triton KDA (k3lab.kernels.triton_kda_chunk) against fla's chunk_kda, the torch reference
and SDPA (FlashAttention) on one GPU; all ratios come from one run.

    python kernels/bench_kda.py                 # the table recorded in kernels/RESULTS.md
    python kernels/bench_kda.py --tune          # time launch-parameter candidates per kernel first
    python kernels/bench_kda.py --json out.json # also write every number

Shapes (B, T, H, D) = (8, 4096, 16, 128), (2, 16384, 16, 128), (1, 65536, 16, 128); bf16 activations,
q, k L2-normalised, K3's gate g = −5·σ(z) in fp32, β = σ(·). fla runs with safe_gate=True,
lower_bound=−5 and its shipped autotune cache (kernels/fla060-triton36-h200-autotune.tgz, unpacked into
TRITON_CACHE_DIR before fla is imported). Times are medians of triton.testing.do_bench.
FLOPs: KDA forward (10·C·D + 6·D²) per token and head (C = 64, fla's chunk size),
forward+backward 3× that; causal attention 2·B·H·T²·D forward, 2.5× more for the backward.
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = [(8, 4096, 16, 128), (2, 16384, 16, 128), (1, 65536, 16, 128)]
PEAK_BF16_TFLOPS = 790.0  # measured bf16 dense matmul rate of the H200 (2026-11-29)


def use_fla_autotune_cache() -> str:
    """Unpack fla's tuned configs into a fresh TRITON_CACHE_DIR (must happen before triton compiles)."""
    cache = os.environ.get("TRITON_CACHE_DIR") or tempfile.mkdtemp(prefix="triton-cache-")
    with tarfile.open(os.path.join(HERE, "fla060-triton36-h200-autotune.tgz")) as tar:
        tar.extractall(cache)
    os.environ["TRITON_CACHE_DIR"] = cache
    return cache


def override_launch(launch: dict, text: str) -> None:
    """Merge ``{"kernel": {"key": value}}`` (JSON) into ``LAUNCH``; an unknown kernel or key raises before
    anything changes."""
    override = json.loads(text)
    for name, cfg in override.items():
        if name not in launch or not set(cfg) <= set(launch[name]):
            raise SystemExit(f"--launch: unknown kernel or key in {name}: {cfg}; kernels and keys: "
                             f"{ {k: sorted(v) for k, v in launch.items()} }")
    for name, cfg in override.items():
        launch[name].update({k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})


FIRST_CALL = """
import os, sys, time, torch, torch.nn.functional as F
t0 = time.time()
{imp}
if os.environ.get("K3LAB_BENCH_LAUNCH"):
    sys.path.insert(0, {here!r})
    from bench_kda import override_launch
    from k3lab.kernels import kda
    override_launch(kda.LAUNCH, os.environ["K3LAB_BENCH_LAUNCH"])
B, T, H, D = 8, 4096, 16, 128
q = F.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16().requires_grad_()
k = F.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16().requires_grad_()
v = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = (-5 * torch.sigmoid(torch.randn(B, T, H, D, device="cuda"))).requires_grad_()
beta = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
torch.cuda.synchronize(); t1 = time.time()
o, _ = {call}; o.sum().backward(); torch.cuda.synchronize()
print(f"{{t1 - t0:.2f}} {{time.time() - t1:.2f}}")
"""


def first_call_seconds(which: str) -> tuple[float, float]:
    """(import s, first forward+backward s) in a fresh process with an empty Triton cache
    (fla: with its shipped autotune cache only)."""
    env = dict(os.environ)
    if which == "ours":
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
        code = FIRST_CALL.format(imp="from k3lab.kernels import triton_kda_chunk", call="triton_kda_chunk(q, k, v, g, beta)",
                                 here=HERE)
    else:
        code = FIRST_CALL.format(imp="from fla.ops.kda import chunk_kda",
                                 call="chunk_kda(q, k, v, g, beta, safe_gate=True, lower_bound=-5.0)", here=HERE)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    imp, first = (float(x) for x in out.stdout.split()[-2:])
    return imp, first


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true", help="time launch-parameter candidates before the table")
    parser.add_argument("--json", default=None, help="write all numbers to this file")
    parser.add_argument("--first-call", default="both", choices=("both", "ours", "none"),
                        help="time cold first calls of both kernels, ours only, or none")
    parser.add_argument("--skip-reference", action="store_true", help="do not time the torch reference")
    parser.add_argument("--launch", default=None, metavar="JSON",
                        help="override LAUNCH entries for this run (also in the first-call process), e.g. "
                             "'{\"bwd_state\": {\"num_stages\": 3}}'")
    args = parser.parse_args()
    use_fla_autotune_cache()

    import torch
    import torch.nn.functional as F
    import triton
    from fla.ops.kda import chunk_kda

    import fla
    from k3lab.kernels import kda
    if args.launch:
        override_launch(kda.LAUNCH, args.launch)
        os.environ["K3LAB_BENCH_LAUNCH"] = args.launch  # read by the first-call process
    from k3lab.kernels import triton_kda_chunk
    from k3lab.mixers.chunk import kda_chunk as torch_kda_chunk

    dev = "cuda"
    print(f"GPU {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"fla {fla.__version__}", flush=True)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "fla": fla.__version__, "rows": [], "tune": [], "accuracy": {}, "profile": {}}

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def kda_inputs(B, T, H, D, grad):
        q = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).bfloat16()
        k = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).bfloat16()
        v = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
        g = -5.0 * torch.sigmoid(torch.randn(B, T, H, D, device=dev))
        beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).bfloat16()
        return [x.requires_grad_(grad) for x in (q, k, v, g, beta)]

    def ours(q, k, v, g, beta):
        return triton_kda_chunk(q, k, v, g, beta)[0]

    def theirs(q, k, v, g, beta):
        return chunk_kda(q, k, v, g, beta, safe_gate=True, lower_bound=-5.0)[0]

    def reference(q, k, v, g, beta):
        return torch_kda_chunk(q, k, v, g, beta, output_final_state=False)[0]

    def time_kda(fn, B, T, H, D):
        xs = kda_inputs(B, T, H, D, grad=False)
        with torch.no_grad():
            fwd = bench(lambda: fn(*xs))
        xs = kda_inputs(B, T, H, D, grad=True)
        do = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)

        def fb():
            for x in xs:
                x.grad = None
            fn(*xs).backward(do)

        return fwd, bench(fb)

    def time_once(fn, B, T, H, D):
        """(fwd ms, fwd+bwd ms) of a single call after one warm-up call; NaN when it runs out of memory."""
        xs = kda_inputs(B, T, H, D, grad=True)
        do = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
        out = []
        for step in (lambda: fn(*xs), lambda: fn(*xs).backward(do)):
            try:
                step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                out.append(1e3 * (time.perf_counter() - t0))
            except torch.OutOfMemoryError:
                out.append(float("nan"))
            torch.cuda.empty_cache()
        return out

    # accuracy against the float64 torch reference, ours and fla on the same inputs
    B, T, H, D = 1, 1000, 16, 128  # H = 16: fla's shipped autotune cache covers it (H4 autotunes for ~200 s)
    xs = kda_inputs(B, T, H, D, grad=True)
    do = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    grads = {}
    for name, fn in (("ours", ours), ("fla", theirs), ("ref", reference)):
        ins = [x.detach().double() if name == "ref" else x.detach() for x in xs]
        ins = [x.requires_grad_() for x in ins]
        o = fn(*ins)
        o.backward(do.to(o.dtype))
        grads[name] = [o] + [x.grad for x in ins]
    for name in ("ours", "fla"):
        errs = {n: ((a.double() - r).norm() / r.norm()).item()
                for n, a, r in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), grads[name], grads["ref"])}
        results["accuracy"][name] = errs
        print(f"accuracy {name:4s} vs fp64 ref (bf16, B1 T1000 H16 D128): "
              + " ".join(f"{n} {e:.1e}" for n, e in errs.items()), flush=True)
    del grads, xs

    if args.tune:
        candidates = {
            "fwd_gate": [dict(BK=32, num_warps=4), dict(BK=16, num_warps=2)],
            "fwd_scores": [dict(BK=32, num_warps=1), dict(BK=32, num_warps=2), dict(BK=64, num_warps=2)],
            "fwd_solve": [dict(num_warps=4), dict(num_warps=2)],
            "fwd_wu": [dict(BK=64, BV=64, per_chunk=True, solve=True, num_warps=4),
                       dict(BK=64, BV=64, per_chunk=True, solve=False, num_warps=4),
                       dict(BK=64, BV=64, per_chunk=False, solve=False, num_warps=4),
                       dict(BK=64, BV=64, per_chunk=True, solve=True, num_warps=8)],
            "fwd_state": [dict(BV=(64, 32, 16), min_programs=128, num_warps=4),
                          dict(BV=(32, 16), min_programs=256, num_warps=4)],
            "fwd_output": [dict(BK=64, BV=64, num_warps=4), dict(BK=64, BV=64, num_warps=8)],
            "bwd_state": [dict(BV=(64, 32, 16), min_programs=128, num_warps=4),
                          dict(BV=(32, 16), min_programs=256, num_warps=4)],
            "bwd_wy_key": [dict(BK=32, BV=64, num_warps=4), dict(BK=64, BV=64, num_warps=8),
                           dict(BK=16, BV=64, num_warps=4)],
            "bwd_intra": [dict(BK=32, num_warps=1), dict(BK=32, num_warps=2), dict(BK=32, num_warps=4),
                          dict(BK=16, num_warps=1), dict(BK=64, num_warps=4)],
            "bwd_dg": [dict(BK=32, num_warps=4), dict(BK=64, num_warps=4), dict(BK=32, num_warps=2)],
        }
        for name, cands in candidates.items():
            best, shipped = None, dict(kda.LAUNCH[name])  # a candidate replaces only the keys it names
            for cand in cands:
                kda.LAUNCH[name] = dict(shipped, **cand)
                times = []
                for shape in (SHAPES[0], SHAPES[2]):
                    fwd, fb = time_kda(ours, *shape)
                    times.append(fwd if name.startswith("fwd") else fb)
                score = sum(times)
                results["tune"].append(dict(kernel=name, config=str(cand), ms=times))
                print(f"tune {name:10s} {str(cand):60s} " + " ".join(f"{t:8.3f}" for t in times), flush=True)
                if best is None or score < best[0]:
                    best = (score, cand)
            kda.LAUNCH[name] = dict(shipped, **best[1])
            print(f"tune {name:10s} BEST {best[1]}", flush=True)

    results["launch"] = {k: str(v) for k, v in kda.LAUNCH.items()}

    # per-kernel time of one forward+backward (torch profiler), ours and fla, at each shape
    for shape in SHAPES:
        for name, fn in (("ours", ours), ("fla", theirs)):
            xs = kda_inputs(*shape, grad=True)
            do = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
            fn(*xs).backward(do)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn(*xs).backward(do)
                torch.cuda.synchronize()
            per = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    per[ev.name] = per.get(ev.name, 0.0) + ev.device_time / 1e3  # ms
            top = sorted(per.items(), key=lambda kv: -kv[1])[:10]
            results["profile"][f"{name} {shape}"] = top
            print(f"profile {name} {shape}: " + "; ".join(f"{k[:48]} {v:.3f}" for k, v in top), flush=True)

    for B, T, H, D in SHAPES:
        kda_flops = B * T * H * (10 * 64 * D + 6 * D * D)
        attn_flops = 2 * B * H * T * T * D
        entries = [("ours (k3lab triton)", ours, kda_flops), ("fla chunk_kda safe_gate", theirs, kda_flops)]
        row = {label: (*time_kda(fn, B, T, H, D), flops) for label, fn, flops in entries}
        if (B, T) == SHAPES[0][:2] and not args.skip_reference:  # builds [B, H, N, C, C, K]: one call, one shape
            row["torch chunk reference (1 call)"] = (*time_once(reference, B, T, H, D), kda_flops)
        qa = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        ka, va = torch.randn_like(qa, requires_grad=True), torch.randn_like(qa, requires_grad=True)
        doa = torch.randn_like(qa)
        with torch.no_grad():
            fwd = bench(lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True))
        fb = bench(lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True).backward(doa))
        row["SDPA causal (flash)"] = (fwd, fb, attn_flops)
        del qa, ka, va, doa
        torch.cuda.empty_cache()
        for label, (fwd, fb, flops) in row.items():
            results["rows"].append(dict(kernel=label, B=B, T=T, H=H, D=D, fwd_ms=fwd, fwdbwd_ms=fb,
                                        fwd_tflops=flops / fwd / 1e9, fwdbwd_tflops=(3 if "SDPA" not in label
                                                                                    else 3.5) * flops / fb / 1e9))
        print(f"done B{B} T{T}", flush=True)

    if args.first_call != "none":
        results["first_call"] = {w: first_call_seconds(w) for w in (("ours", "fla") if args.first_call == "both"
                                                                     else ("ours",))}

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print_table(results)


def print_table(results: dict) -> None:
    """The Markdown table of kernels/RESULTS.md, ratios against fla from the same run."""
    rows = results["rows"]
    fla = {(r["B"], r["T"]): r for r in rows if r["kernel"].startswith("fla")}
    print("\n| kernel | B | T | fwd ms | fwd+bwd ms | fla/this fwd | fla/this fwd+bwd | TFLOP/s fwd | "
          "TFLOP/s fwd+bwd | % of 790 (f+b) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = fla[(r["B"], r["T"])]
        print(f"| {r['kernel']} | {r['B']} | {r['T']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | "
              f"{ref['fwd_ms'] / r['fwd_ms']:.2f}x | {ref['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}x | "
              f"{r['fwd_tflops']:.0f} | {r['fwdbwd_tflops']:.0f} | {100 * r['fwdbwd_tflops'] / PEAK_BF16_TFLOPS:.1f} |")
    if "first_call" in results:
        for w, (imp, first) in results["first_call"].items():
            print(f"first call {w}: import {imp:.1f} s, first forward+backward (B8 T4096) {first:.1f} s")


if __name__ == "__main__":
    main()
