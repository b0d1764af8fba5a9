"""Run a function on W local gloo processes from a test or a notebook (the CPU stand-in for torchrun).

Each process: one torch thread, ``init_process_group("gloo")`` on a file store with a timeout (a
rank that dies or waits in a mismatched collective ends the run with an error, never a hang),
``fn(rank, world, *args)``, ``destroy_process_group()``. Results come back through files in a
temporary folder (pickled by these processes themselves, read back by the caller).
``fn`` must be importable (a module-level function), since ``spawn`` starts fresh interpreters:
notebooks call functions from :mod:`k3lab.experiments.parallel_demos`.
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60  # seconds a collective may wait before the process group raises


def _entry(rank: int, world: int, init: str, out_dir: str, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn, world: int, *args) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes; return their results by rank.
    ``fn`` must be a module-level function; results are pickled (test-local files only)."""
    out_dir = tempfile.mkdtemp(prefix="k3lab-dist-")
    init = f"file://{os.path.join(out_dir, 'store')}"
    mp.start_processes(_entry, args=(world, init, out_dir, fn, args), nprocs=world, start_method="spawn")
    results = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results
