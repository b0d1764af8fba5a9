"""Command line of the distributed trainer, under torchrun or alone, and the notebook launcher.

    torchrun --standalone --nproc_per_node 4 -m k3lab.parallel.run --preset tiny --steps 3 --seed 0 \\
        --ep 2 --cp 2 --dp-shard 2 --metrics out.json
    python -m k3lab.parallel.run --preset tiny --steps 3        # world size 1: the plain trainer's losses

Several nodes: the same command on every node with ``--nnodes N --node_rank i --rdzv_backend c10d
--rdzv_endpoint HOST:PORT`` (HOST = the first node) in place of ``--standalone``; ``--nproc_per_node``
= GPUs per node. On CUDA each rank uses the GPU of its ``LOCAL_RANK`` and NCCL, on CPU gloo.

``--metrics`` (rank 0) writes JSON: ``world_size``, ``dims``, ``losses`` (per-step global training
loss), ``grad_norms``, ``step_times``, ``tokens_per_s`` (steps 2..), ``expert_loads`` (per MoE layer,
per expert, global), ``slots_per_rank`` (per MoE layer, token slots each EP rank computed).

:func:`launch` starts torchrun as a subprocess from Python (notebooks, papermill), shows rank 0's
progress as a tqdm bar and returns the metrics. Every process group has a timeout; a rank that
dies makes torchrun stop the others, and :func:`launch` raises with the failing rank's message.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k3lab.backend import DEVICES
from k3lab.config import PRESETS, ModelConfig
from k3lab.parallel.context import CP_LAYOUTS
from k3lab.parallel.dims import DEFAULT_TIMEOUT_S
from k3lab.parallel.expert import EP_KINDS
from k3lab.train import DTYPES, OPTIMIZERS, TrainConfig

PROGRESS_PREFIX = "K3LAB_PROGRESS "  # rank 0 prints "K3LAB_PROGRESS step/steps loss" for launch()'s bar


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m k3lab.parallel.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=PRESETS[:2])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (rows)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--ns-dtype", default="bfloat16", choices=("bfloat16", "float32"), help="Muon Newton–Schulz dtype")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "fla"))
    p.add_argument("--dp-shard", type=int, default=-1, help="-1: world_size / cp")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--ep-kind", default="moonep", choices=EP_KINDS)
    p.add_argument("--cp-layout", default="contiguous", choices=CP_LAYOUTS)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--balancer", default=None, help="override the preset's balancer")
    p.add_argument("--out-dir", default=None, help="DCP checkpoints go here")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", default=None, help="a checkpoint folder, or a run folder with 'latest'")
    p.add_argument("--stop-at", type=int, default=None, help="end after this many steps (schedule still spans --steps)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="process-group timeout, seconds")
    p.add_argument("--metrics", default=None, help="write the metrics JSON here (rank 0)")
    p.add_argument("--data", default="corpus", choices=("corpus", "random"), help="KJV corpus (BPE) or random tokens")
    p.add_argument("--progress", action="store_true", help="print K3LAB_PROGRESS lines on rank 0")
    return p


def batches_for(data: str, cfg: ModelConfig, batch_size: int, seq_len: int, seed: int):
    """The global batch stream: ``step -> (x, y)`` (same on every rank)."""
    import torch

    from k3lab.data import batch_iterator, corpus_splits, get_tokenizer

    if data == "corpus":
        tok = get_tokenizer("bpe")
        if tok.vocab_size != cfg.vocab_size:
            raise ValueError(f"--data corpus: the BPE tokenizer has {tok.vocab_size} tokens, the model "
                             f"vocab_size={cfg.vocab_size}; use --data random")
        ids = corpus_splits(tok)[0]
    else:
        ids = torch.randint(0, cfg.vocab_size, (200_000,), generator=torch.Generator().manual_seed(seed))
    return batch_iterator(ids, batch_size, seq_len, seed=seed)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from k3lab.parallel.trainer import ParallelOptions, train_parallel

    if args.steps < 1:
        raise SystemExit(f"--steps={args.steps}: must be >= 1")
    cfg = ModelConfig.preset(args.preset).replace(backend=args.backend)
    if args.balancer is not None:
        cfg = cfg.replace(balancer=args.balancer)
    okw = {"ns_dtype": args.ns_dtype} if args.optimizer == "muon" else {}
    tc = TrainConfig(steps=args.steps, lr=args.lr, optimizer=args.optimizer, optimizer_kwargs=okw, seed=args.seed,
                     device=args.device, dtype=args.dtype, out_dir=args.out_dir,
                     checkpoint_every=args.checkpoint_every, progress=False, name="parallel")
    opts = ParallelOptions(dp_shard=args.dp_shard, cp=args.cp, ep=args.ep, ep_kind=args.ep_kind,
                           cp_layout=args.cp_layout, activation_checkpointing=args.activation_checkpointing,
                           timeout_s=args.timeout)
    rank = int(os.environ.get("RANK", "0"))
    hook = None
    if args.progress and rank == 0:
        def hook(step, loss):
            print(f"{PROGRESS_PREFIX}{step}/{args.steps} {loss:.6g}", flush=True)
    metrics = train_parallel(cfg, tc, opts, batches_for(args.data, cfg, args.batch_size, args.seq_len, args.seed),
                             resume_from=args.resume, stop_at=args.stop_at, on_step=hook)
    if rank == 0 and args.metrics:
        Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
        Path(args.metrics).write_text(json.dumps(metrics, indent=1))
    return metrics


def launch(nproc: int, *args: str, timeout: float = 600.0, progress: bool = True, env: dict | None = None) -> dict:
    """Run ``torchrun --standalone --nproc_per_node nproc -m k3lab.parallel.run *args`` and return
    rank 0's metrics. A tqdm bar follows rank 0's steps. Raises RuntimeError with the tail of the
    output when the run fails (a dead rank, a bad flag) or takes longer than ``timeout`` seconds."""
    from tqdm import tqdm  # the text bar: its final state is what a saved notebook shows (a widget's is not)

    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"launch: nproc={nproc!r} must be an int >= 1")
    out = Path(tempfile.mkdtemp(prefix="k3lab-run-")) / "metrics.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "k3lab.parallel.run", *args, "--metrics", str(out), "--progress"]
    steps = int(args[list(args).index("--steps") + 1]) if "--steps" in args else 3
    full_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
    lines: list[str] = []
    bar = tqdm(total=steps, desc=f"torchrun ×{nproc}", disable=not progress, file=sys.stdout)
    t0 = time.monotonic()
    try:
        for line in proc.stdout:
            lines.append(line)
            m = re.match(rf"{PROGRESS_PREFIX}(\d+)/\d+ (\S+)", line)
            if m:
                bar.n = int(m.group(1))
                bar.set_postfix(loss=m.group(2))
                bar.refresh()
            if time.monotonic() - t0 > timeout:
                proc.kill()
                raise RuntimeError(f"launch: torchrun ran past {timeout} s; last output:\n{''.join(lines[-20:])}")
        rc = proc.wait()
    finally:
        bar.close()
        if proc.poll() is None:
            proc.kill()
    if rc != 0 or not out.exists():
        failed = re.findall(r"Root Cause[\s\S]*?rank\s*:\s*(\d+)", "".join(lines))
        who = f" (failed rank: {failed[0]})" if failed else ""
        raise RuntimeError(f"launch: torchrun exited with {rc}{who}; last output:\n{''.join(lines[-30:])}")
    return json.loads(out.read_text())


if __name__ == "__main__":
    main()
