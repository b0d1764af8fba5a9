"""Where a decode step's time goes: torch.profiler over static decode steps (``k3lab.infer.static``, the
step a CUDA graph replays, run eagerly so each kernel is seen), for each batch/context given.

    python kernels/profile_decode.py --preset small --batches 1 64 --contexts 4096 --steps 8

Prints per configuration: kernels per step, GPU time per step, and the top kernels by GPU time
(name, calls per step, µs per step). CUDA only.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3lab.config import RUNNABLE_PRESETS, ModelConfig  # noqa: E402
from k3lab.infer.static import allocate, load  # noqa: E402
from k3lab.model import K3ForCausalLM  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=RUNNABLE_PRESETS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--compile", action="store_true", help="the step compiled (StaticDecoder(compile=True))")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_infer import tiled_prefill  # the benchmark's synthetic cache

    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.preset(args.preset)).to("cuda", torch.bfloat16).eval()
    from k3lab.infer.static import StaticDecoder

    dec = StaticDecoder(model, compile=args.compile)
    for context in args.contexts:
        for B in args.batches:
            with torch.no_grad():
                pre = tiled_prefill(model, B, context)
                buf = allocate(pre, B, context + 256)
                load(buf, pre, torch.arange(B))
                dec.step(buf, False, 0)  # warm-up (and compilation); greedy
                dec.step(buf, False, 0)
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.steps):
                        dec.step(buf, False, 0)
                    torch.cuda.synchronize()
            per = defaultdict(lambda: [0, 0.0])
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name][0] += 1
                    per[e.name][1] += e.device_time
            calls = sum(c for c, _ in per.values()) / args.steps
            gpu_us = sum(t for _, t in per.values()) / args.steps
            print(f"\n## {args.preset}{' compiled' if args.compile else ''} B={B} context={context}: {calls:.0f} kernels/step, {gpu_us / 1e3:.3f} ms GPU/step")
            for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:args.top]:
                print(f"{t / args.steps:9.1f} us  {c / args.steps:6.1f}x  {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
