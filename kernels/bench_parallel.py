"""One GPU: the distributed trainer's CLI at world size 1 (torchrun, NCCL) against the plain trainer.

    python kernels/bench_parallel.py --preset small --steps 20 --batch-size 16 --seq-len 1024

Both train the same model from the same seed on the same batches (KJV corpus, bf16 autocast,
AdamW). tokens/s is counted over steps 2..N (step 1 compiles kernels). Prints a table and the
ratio CLI / plain; the losses of both runs are compared too (they should agree to bf16 noise).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def plain(args) -> dict:
    from k3lab.config import ModelConfig
    from k3lab.model import K3ForCausalLM
    from k3lab.parallel.run import batches_for
    from k3lab.train import TrainConfig, fit

    cfg = ModelConfig.preset(args.preset)
    torch.manual_seed(args.seed)
    model = K3ForCausalLM(cfg)
    tc = TrainConfig(steps=args.steps, lr=args.lr, seed=args.seed, device="cuda", dtype=args.dtype, progress=False)
    hist = fit(model, batches_for("corpus", cfg, args.batch_size, args.seq_len, args.seed), tc).history
    timed = hist[-1]["elapsed"] - hist[0]["elapsed"]
    out = dict(losses=[r["loss"] for r in hist], tokens_per_s=(len(hist) - 1) * args.batch_size * args.seq_len / timed,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    del model, hist
    gc.collect()
    torch.cuda.empty_cache()  # the CLI run is another process on the same GPU
    return out


def cli(args) -> dict:
    out = Path(tempfile.mkdtemp()) / "m.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
           "k3lab.parallel.run", "--preset", args.preset, "--steps", str(args.steps), "--seed", str(args.seed),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
           "--dtype", args.dtype, "--device", "cuda", "--metrics", str(out)]
    run = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"CLI run failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}")
    return json.loads(out.read_text())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    a, b = plain(args), cli(args)
    print(f"| run | tokens/s (steps 2..{args.steps}) | loss @1 | loss @{args.steps} |")
    print("|---|---|---|---|")
    print(f"| plain fit | {a['tokens_per_s']:,.0f} | {a['losses'][0]:.4f} | {a['losses'][-1]:.4f} |")
    print(f"| k3lab.parallel.run, torchrun ×1 (NCCL) | {b['tokens_per_s']:,.0f} | {b['losses'][0]:.4f} | {b['losses'][-1]:.4f} |")
    print(f"ratio CLI/plain = {b['tokens_per_s'] / a['tokens_per_s']:.3f}; plain peak memory {a['peak_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
