"""Measure the seconds a step of notebook 15's GPU family takes, per variant and width, so a device call's grid is
planned from measurements (docs/scaling_laws.md §4). Random tokens (no corpus to build), the GPU scale's shape, bf16,
CUDA graphs: a run of ``--short`` steps and one of ``--long`` steps per point; the seconds a step is their difference
over the extra steps (the first run also pays compilation and capture, which the difference removes).

    python notebooks/gpu_runs/scaling_dry_run.py --variants mla hybrid --out "$OUT"

Prints one line a point as it goes (a cut call keeps what finished) and, last, each experiment's predicted training
seconds at the GPU scale's plan (SCALES["15"]["gpu"]).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from k3lab.data import window_batches
from k3lab.experiments.scales import SCALES
from k3lab.experiments.scaling import EXPERIMENTS, experiment_variants, family_config, plan_runs, sweep_runs
from k3lab.model import K3ForCausalLM
from k3lab.train import TrainConfig, fit

V = 259


def seconds_per_step(variant: str, width: int, g: dict, short: int, long: int) -> tuple[float, float]:
    cfg = family_config(variant, width, g["depth"], V, g["seq_len"])
    ids = torch.randint(0, V, (g["batch_size"] * (g["seq_len"] + 1) * (long + 2),), generator=torch.Generator().manual_seed(0))
    took = []
    for steps in (short, long):
        torch.manual_seed(0)
        model = K3ForCausalLM(cfg)
        tc = TrainConfig(steps=steps, lr=1e-3, device="cuda", dtype=g["dtype"], cuda_graph=g["cuda_graph"],
                         eval_batches=1, progress=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fit(model, window_batches(ids, g["batch_size"], g["seq_len"]), tc)
        torch.cuda.synchronize()
        took.append(time.perf_counter() - t0)
    return (took[1] - took[0]) / (long - short), took[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=["mla", "hybrid"])
    p.add_argument("--short", type=int, default=10)
    p.add_argument("--long", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    g = SCALES["15"]["gpu"]
    rows = {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; depth {g['depth']}, {g['batch_size']} x "
          f"{g['seq_len']} tokens a step, {g['dtype']}, CUDA graphs {g['cuda_graph']}", flush=True)
    for v in a.variants:
        for w in g["widths"]:
            per_step, first = seconds_per_step(v, w, g, a.short, a.long)
            rows[(v, w)] = per_step
            print(f"{v:16s} D={w:4d}: {per_step * 1e3:7.2f} ms a step ({g['batch_size'] * g['seq_len'] / per_step:,.0f} "
                  f"tokens/s); first {a.short} steps {first:.1f} s", flush=True)
            if a.out:
                a.out.mkdir(parents=True, exist_ok=True)
                (a.out / "scaling_dry_run.json").write_text(json.dumps([dict(variant=k[0], width=k[1], s_per_step=s)
                                                                      for k, s in rows.items()], indent=1))
    shape = dict(depth=g["depth"], seq_len=g["seq_len"], batch_size=g["batch_size"],
                 tokens_per_param=g["tokens_per_param"], lr0=g["lr0"], vocab_size=V, min_steps=g["min_steps"])
    print("\n| experiment | runs (1 seed) | predicted training s, 1 seed | 3 seeds |\n|---|---|---|---|")
    for name in EXPERIMENTS:
        variants, base = experiment_variants(name)
        runs = plan_runs(variants, g["widths"], [0], **shape) + sweep_runs(base, g["widths"], g["lr_sweep"], **shape)
        known = [r for r in runs if (r.variant, r.width) in rows]
        if len(known) < len(runs):
            print(f"| {name} | {len(runs)} | ({len(runs) - len(known)} points not measured) | |")
            continue
        s = sum(rows[(r.variant, r.width)] * r.steps for r in runs)
        grid = sum(rows[(r.variant, r.width)] * r.steps for r in runs if r.kind == "grid")
        print(f"| {name} | {len(runs)} | {s:.0f} | {s + 2 * grid:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
