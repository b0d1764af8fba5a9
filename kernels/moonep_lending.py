"""How many experts MoonEP lends at K3's shape (896 experts, top-16, 8 ranks of 8192 tokens) on synthetic routings:
what ``kernels/predict_scaling.py``'s ``lent=`` should be for the K3 slice (``docs/scaling.md``, section 4j).

Runs :func:`k3lab.experiments.moe_simulate.moonep_lending` under Quantile Balancing (K3's balancer, the histogram
form) and with no balancer at several skews, a few seeds each, and prints, per routing, the most experts one rank
borrowed and the most (expert, receiver) pairs one home rank lent over the steps after the warm-up, against
MoonEP's bound E/R = 112. CPU, about 3 minutes on 2 cores::

    python kernels/moonep_lending.py --json kernels/results/2026-12-07-moonep-lending-k3-cpu.json
"""
from __future__ import annotations

import argparse
import json

import torch

from k3lab.experiments.moe_simulate import moonep_lending

ROUTINGS = [  # (balancer, skew, drift, seeds)
    ("quantile_hist", 2.0, 0.0, (0, 1, 2)),
    ("quantile_hist", 2.0, 0.05, (0,)),
    ("none", 2.0, 0.0, (0, 1, 2)),
    ("none", 1.0, 0.0, (0,)),
    ("none", 0.5, 0.0, (0,)),
    ("none", 0.2, 0.0, (0,)),
]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--json", default=None, help="write the runs here")
    args = parser.parse_args(argv)
    n, k, ranks, S = 896, 16, 8, 8192
    out = dict(n=n, k=k, ranks=ranks, tokens_per_rank=S, steps=args.steps, warmup=args.warmup, torch=torch.__version__,
               runs=[])
    print("| balancer | skew | drift | seed | max violation (median) | most borrowed by a rank | most lent by a home |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for balancer, skew, drift, seeds in ROUTINGS:
        for seed in seeds:
            r = moonep_lending(balancer, n, k, ranks, S, args.steps, args.warmup, skew=skew, drift=drift, seed=seed)
            out["runs"].append(dict(balancer=balancer, skew=skew, drift=drift, seed=seed, **r))
            vio = sorted(r["max_violation"])[len(r["max_violation"]) // 2]
            print(f"| {balancer} | {skew} | {drift} | {seed} | {vio:.2f} | {max(r['borrowed'])} | {max(r['lent'])} |",
                  flush=True)
    print(f"bound E/R = {n // ranks}; over every routing: borrowed <= {max(max(r['borrowed']) for r in out['runs'])}, "
          f"lent <= {max(max(r['lent']) for r in out['runs'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
