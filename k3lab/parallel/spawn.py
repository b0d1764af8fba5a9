"""Run a function on W local gloo processes from a test or a notebook (the CPU stand-in for torchrun).

Each process: one torch thread, ``init_process_group("gloo")`` on a file store with a timeout (a
rank that dies or waits in a mismatched collective ends the run with an error, never a hang),
``fn(rank, world, *args)``, ``destroy_process_group()``. Results come back through files in a
temporary folder (pickled by these processes themselves, read back by the caller).
``fn`` must be importable (a module-level function), since the processes are not forks of the caller:
notebooks call functions from :mod:`k3lab.experiments.parallel_demos`.

The processes start from multiprocessing's *forkserver*, which imports torch, dynamo and k3lab's training stack
once (:data:`PRELOAD`) and forks each rank from there: a fresh interpreter per rank (``spawn``) spent about 5 s of
CPU a rank on those imports, a minute of the test suite's 2 cores at 8 ranks. The server has run nothing, so the
forks hold no threads or locks; each rank gets the caller's environment as it is at the call (a forkserver
child would otherwise see the server's, from its start; modules the server preloaded read theirs then). Where the
platform has no forkserver (Windows), the ranks are spawned.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60  # seconds a collective may wait before the process group raises
# imported once by the forkserver, so a rank starts without importing them (the optimizer imports dynamo)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "k3lab.train", "k3lab.parallel.parallelize")


def _entry(rank: int, world: int, init: str, out_dir: str, fn, args, environ: dict):
    os.environ.clear()
    os.environ.update(environ)  # the caller's, as spawn would give it
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    # every rank's side of gloo's full mesh connected before any rank can finish: a rank whose fn ran no collective
    # could otherwise exit while a slower one was still connecting to it ("Connection closed by peer", seen in CI)
    dist.barrier()
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def rank_context():
    """multiprocessing's forkserver context, its server to import :data:`PRELOAD` when it starts (the module
    docstring), or spawn's where there is no forkserver; for callers that start rank processes themselves
    (``start_method=rank_context().get_start_method()``). Their ranks see the server's environment."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs
    return ctx


def run_ranks(fn, world: int, *args) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes; return their results by rank.
    ``fn`` must be a module-level function; results are pickled (test-local files only)."""
    out_dir = tempfile.mkdtemp(prefix="k3lab-dist-")
    init = f"file://{os.path.join(out_dir, 'store')}"
    mp.start_processes(_entry, args=(world, init, out_dir, fn, args, dict(os.environ)), nprocs=world,
                       start_method=rank_context().get_start_method())
    results = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results
