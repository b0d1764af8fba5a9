"""Predict multi-GPU training scaling of k3lab's parallel plan from ONE device, with torch's fake process group.

    python kernels/predict_scaling.py --device cpu --configs cpu-smoke              # CPU, seconds
    python kernels/predict_scaling.py --configs gpu --json scaling.json             # one H200, ~2 min
    python kernels/predict_scaling.py --preset small --world 8 --ep 8 --batch-size 16 --seq-len 1024
    torchrun --standalone --nproc_per_node 8 kernels/predict_scaling.py --configs gpu \\
        --predicted scaling.json                                                    # measured beside predicted

Method (docs/scaling.md has the whole of it, with the bandwidth figures and their sources): one process
plays rank R of an N-rank run. ``torch.distributed.init_process_group("fake", ...)`` makes every collective
return at once without moving data; the real model (``K3ForCausalLM``) gets the real plan
(:func:`k3lab.parallel.parallelize.parallelize`: EP -> CP -> FSDP2 on the groups of
:func:`k3lab.parallel.dims.init_groups`), this rank's share of a global batch
(:func:`~k3lab.parallel.parallelize.local_batch`) and the trainer's step (forward, backward, expert-gradient
sum, global grad-norm clip, optimizer step, balancer update). Measured per config:

* **compute**: the median wall time of the timed steps (``torch.cuda.synchronize`` around each on a GPU),
  i.e. the rank's step with every collective free;
* **peak memory**: ``torch.cuda.max_memory_allocated`` over the steps (GPU only);
* **bytes per collective kind**, in the nccl-tests size convention (all-gather: the gathered output;
  reduce-scatter: the input; all-reduce: the tensor; all-to-all: the larger of the send and receive
  buffers), per group and per source (FSDP, EP, CP, other), counted in one extra untimed step by wrapping
  ``torch.distributed``'s collective functions, and cross-checked in that step against a
  ``TorchDispatchMode`` that sees every ``c10d`` / ``_c10d_functional`` op (whatever Python path called it).

The fake group cannot make data-dependent exchanges real, so what the collectives return is chosen (it
must be plausible, not correct): an all-gather returns this rank's input in every slot (torch's fake group
does so itself), a reduce-scatter this rank's own chunk, an all-to-all the input rows (torch 2.13's fake
group does both; older ones leave the output untouched, and then this script fills it: a one-time probe
decides). For EP this means the all-gathered expert counts ``tpe [R, E]`` say "every rank routed like me";
MoonEP then plans on them (each rank computes exactly S·K slots, a rank receives its replicas) and the
split sizes of every all-to-all are consistent. For CP, the gathered KDA states and MLA latents are this
rank's own, repeated.

The counted bytes and the measured compute then go through an alpha-beta model of NCCL over 8 H200s
(:data:`LINKS`): ``t = calls·alpha + bytes·f(N)/busbw`` with the nccl-tests factors f = (N-1)/N for
all-gather, reduce-scatter and all-to-all, 2(N-1)/N for all-reduce. Three predicted step times:
no overlap (compute + Σ comm), full overlap (max(compute, Σ comm)), and FSDP's realistic case (EP and CP
collectives and the small all-reduces block the compute stream; FSDP2 prefetches its all-gathers and runs
its reduce-scatters on a side stream, so only the all-gathers that open the step and the reduce-scatters that
close it are exposed: the root's, and the embedding's where it is a unit of its own
(:func:`k3lab.parallel.fsdp.exposed_calls`); the rest hides under compute up to the compute time).

Every config also measures its **one-GPU baseline** in the same run: world size 1 (no process group, no
FSDP, the trainer's one-process path) at the same per-rank batch ``[B, T/cp]`` (for ``k3slice`` with
``E/ep`` experts, the rank's own share, since the whole model fits no GPU). "compute vs 1 GPU" = this
config's tokens per compute second / the baseline's (= baseline ms / compute ms at equal tokens); "update
ms" = the optimizer step and after-step work (the rest of "compute ms" is forward + backward + grad norm);
"scaling eff" = predicted tokens/s per GPU / baseline tokens/s.

**The fake group's writes** ("fake writes ms"): the fake group (or this script's fill) writes each collective's
output on the compute stream, so the measured compute holds copies that a real run's NCCL kernels make on their own
stream, inside the collective times the model adds. The counting step records the bytes each call writes; they are
copied again on their own after the timed steps (:func:`emulation_seconds`, device time), and the predictions take
compute − that time as the rank's compute. "compute ms" and "compute vs 1 GPU" stay as measured.

A config name is ``PRESET-wN[-epE][-cpC]-BxT[@key=value,...]``: preset ``tiny`` / ``small`` / ``k3slice``
(the K3 widths, ``layers`` layers: K3's dense KDA layer 1, MoE layers after it, Gated MLA last), N ranks, B
rows per data-parallel rank, T tokens per sequence (global; a CP rank holds T/C). Options:
``optimizer=adamw|sgd``, ``layers=N`` (k3slice), ``recompute=...``, ``rank=R`` (the simulated rank;
default 0, or the last rank of the first CP group, which does the most causal work), ``ep_kind=moonep|ep|static``
(``static``: MoonEP with fixed shapes, planned on the device, :mod:`k3lab.parallel.expert_static`, its exchange
timed by :func:`fixed_size_exchange`; ``kernels/bench_train.py``'s ``exchange=emulated`` times ``fit``'s rank with
:func:`emulated_exchange` instead, which holds the stream for each all-to-all's modelled time so that overlap shows
in the measured step),
``reshard=true|false`` (FSDP2 ``reshard_after_forward``, :class:`~k3lab.parallel.parallelize.ParallelOptions`),
``edges=root|units|vocab`` (``ParallelOptions.edges``: the embedding and head in the root unit, units of their own,
or the head a unit and the table sharded by rows with the tokens sent to them, :mod:`k3lab.parallel.vocab`, whose
exchanges block the compute stream),
``init=device|meta`` (meta: build on the meta device, lay out, ``to_empty``, fill for timing; k3slice's
default), ``baseline=world1|local-experts``, ``vocab=V``, ``graph=true|false`` (forward, backward and gradient
norm replayed as one CUDA graph, :class:`k3lab.cuda_graph.GraphedForwardBackward`, captured after the counting
step; the update stays eager and updates the captured gradients in place; with EP only ``ep_kind=static``, since
the other dispatchers read their all-to-all sizes on the host; the one-GPU baseline is graphed too), ``lent=N``
(``ep_kind=static``: the replica-weight exchanges move N experts' weights each way, :func:`fixed_size_weights`;
default E/ep, MoonEP's bound, every rank borrowing its most in every layer; what a balanced router lends:
:func:`k3lab.experiments.moe_simulate.moonep_lending`), ``send=read|bound`` (with ``lent=``: the dispatcher hands that
exchange the N rows it reads, as a device-initiated exchange reads them in place, or the whole send buffer of MoonEP's
bound, El + R − 2 rows, as before; default read).

Debugging: ``--raise-errors`` stops at the first failing config (else its row says OOM or the error);
``K3LAB_PREDICT_ANOMALY=1`` runs the steps under autograd anomaly mode (a failing backward op names its
forward line); ``K3LAB_PREDICT_DEBUG=1`` prints each MoE dispatcher's last plan when a step fails.

``--measured``: under ``torchrun`` with WORLD_SIZE > 1 the fake group is skipped; the same configs (those
whose N equals WORLD_SIZE) run on the real NCCL group, the step time is the slowest rank's, and with
``--predicted JSON`` (a fake-group run's ``--json``) the predicted columns are printed beside it.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import inspect
import json
import math
import os
import statistics
import sys
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere: the repo's k3lab first
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

# k3lab's collectives still call the pre-2.13 names (all_gather_into_tensor, reduce_scatter_tensor)
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is (deprecated|a private function)")
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
GIB = 1024 ** 3


# ==============================================================================================
# the bandwidth model (pure functions)
# ==============================================================================================
# docs/peer_figures.md §5: NCCL between two H200s (NV18 NVLink, torch 2.11, CUDA events), per-rank message
# size (MiB) -> bus bandwidth (GB/s) in the nccl-tests convention.
PEER_FIGURES_S5 = {
    "all_to_all": {4: 35.0, 64: 236.0, 256: 281.0, 1024: 332.0},
    "all_gather": {4: 96.0, 64: 231.0, 256: 257.0, 1024: 279.0},
    "all_reduce": {4: 85.0, 64: 271.0, 256: 302.0, 1024: 329.0},
}
# 8 H200s over NVLink 4 / NVSwitch with NVLink SHARP off (as on the lent machines: NCCL_NVLS_ENABLE=0): NCCL's
# effective per-GPU NVLink bandwidth ("BusBw" of every collective but the NVLS all-reduce), NVIDIA's NCCL
# maintainer in NVIDIA/nccl-tests#212 (450 GB/s line rate per direction, ~20% protocol overhead -> 370 GB/s);
# nccl-tests#309 read 368.8 GB/s all-reduce with NVLS off. H100 and H200 share NVLink 4 (18 links, 900 GB/s
# bidirectional per GPU, NVIDIA's datasheet). Assumed equal for all-to-all (each GPU's ports are the limit
# on a full NVSwitch crossbar) and for reduce-scatter.
NVLINK8_BUSBW = 370e9


def _bus_bytes_s5(kind: str, per_rank_bytes: float, world: int = 2) -> float:
    """§5's busbw numerators: all-gather bytes·(W−1), all-to-all bytes·(W−1)/W, all-reduce 2·bytes·(W−1)/W."""
    if kind == "all_gather":
        return per_rank_bytes * (world - 1)
    factor = (world - 1) / world
    return per_rank_bytes * factor * (2 if kind == "all_reduce" else 1)


def fit_alpha_beta(points: dict, kind: str) -> tuple[float, float]:
    """(alpha s, beta B/s) of ``t = alpha + bus_bytes/beta`` through §5's smallest and largest message
    (``points``: MiB -> busbw GB/s): alpha is what the 4 MiB call took beyond its bytes, beta the bandwidth
    between the two sizes."""
    small, large = min(points), max(points)
    b0, b1 = (_bus_bytes_s5(kind, m * 2 ** 20) for m in (small, large))
    t0, t1 = b0 / (points[small] * 1e9), b1 / (points[large] * 1e9)
    beta = (b1 - b0) / (t1 - t0)
    return max(t0 - b0 / beta, 0.0), beta


@dataclass(frozen=True)
class Link:
    """Per collective kind: alpha (s per call) and bus bandwidth beta (B/s, nccl-tests convention)."""

    name: str
    alpha: dict
    busbw: dict
    note: str = ""


def _links() -> dict[str, Link]:
    fits = {k: fit_alpha_beta(v, k) for k, v in PEER_FIGURES_S5.items()}
    fits["reduce_scatter"] = fits["broadcast"] = fits["all_gather"]  # not in §5: the all-gather's (same ring)
    alpha = {k: a for k, (a, _) in fits.items()}
    return {
        "nvlink8": Link("nvlink8", alpha, {k: NVLINK8_BUSBW for k in KINDS},
                        "8×H200 NVLink 4, NVLS off: busbw 370 GB/s for every kind (nccl-tests#212); alpha per call "
                        "from the 2×H200 fit of docs/peer_figures.md §5"),
        "h200x2": Link("h200x2", alpha, {k: b for k, (_, b) in fits.items()},
                       "alpha and beta fitted to the 2×H200 NCCL figures of docs/peer_figures.md §5 (torch-level, "
                       "CUDA events): a conservative 8-GPU stand-in"),
    }


LINKS = _links()


def bus_factor(kind: str, n: int) -> float:
    """The nccl-tests bus factor: bytes on each GPU's link = size · factor."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind == "broadcast":
        return 1.0
    return (n - 1) / n


def collective_seconds(kind: str, size_bytes: float, n: int, calls: int, link: Link) -> float:
    """alpha-beta time of ``calls`` collectives of ``kind`` over ``n`` ranks moving ``size_bytes`` in all
    (nccl-tests size: all-gather output, reduce-scatter input, all-reduce tensor, all-to-all buffer)."""
    if n <= 1 or calls == 0:
        return 0.0
    return calls * link.alpha[kind] + size_bytes * bus_factor(kind, n) / link.busbw[kind]


def predict_step(compute_s: float, comm: list[dict], link: Link, fsdp_edges: list[dict] = ()) -> dict:
    """Predicted step seconds from the measured compute and the counted collectives.

    ``comm``: records ``{source, kind, n, bytes, calls}`` (source "fsdp" is overlappable; every other source
    blocks the compute stream: EP all-to-alls, CP gathers, the small all-reduces); ``fsdp_edges``: the FSDP
    calls nothing can hide (the step's first all-gather, the root's, and its last reduce-scatter), records
    ``{kind, n, bytes}``. Returns seconds: ``comm`` (Σ), ``fsdp``, ``blocking``, ``fsdp_exposed`` and the
    three predictions ``no_overlap`` = compute + Σ, ``overlap`` = max(compute, Σ) and
    ``realistic`` = compute + blocking + edges + max(0, fsdp − edges − compute).
    """
    times = [collective_seconds(r["kind"], r["bytes"], r["n"], r["calls"], link) for r in comm]
    total = sum(times)
    fsdp = sum(t for t, r in zip(times, comm) if r["source"] == "fsdp")
    blocking = total - fsdp
    edges = min(sum(collective_seconds(e["kind"], e["bytes"], e["n"], 1, link) for e in fsdp_edges), fsdp)
    hidden_part = max(0.0, fsdp - edges - compute_s)
    return dict(comm=total, fsdp=fsdp, blocking=blocking, fsdp_exposed=edges + hidden_part,
                no_overlap=compute_s + total, overlap=max(compute_s, total),
                realistic=compute_s + blocking + edges + hidden_part)


# ==============================================================================================
# counting collectives
# ==============================================================================================
def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


# torch.distributed function -> (kind, how to read its tensors from the bound arguments)
_PY_FUNCS = {
    "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather", "_all_gather_base": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce", "all_to_all_single": "all_to_all", "all_to_all": "all_to_all",
    "broadcast": "broadcast", "scatter": "scatter",
}
# imported by name into modules of torch.distributed (DTensor's distribute_tensor scatters through its own binding):
# wrapped there too
_BOUND_BY_NAME = ("scatter",)
_tls = threading.local()
_ACTIVE: "CommCounter | None" = None


def _args_of(a: dict) -> tuple:
    """(output, input) of a bound collective call, whatever the spelling of its parameters."""
    out = a.get("output_tensor", a.get("output", a.get("tensor_list", a.get("output_tensor_list"))))
    inp = a.get("input_tensor", a.get("input", a.get("tensor", a.get("input_tensor_list", a.get("input_list")))))
    return out, inp


def _size_of(kind: str, out, inp) -> int:
    """nccl-tests size: all-gather output, reduce-scatter input, all-reduce / broadcast tensor, all-to-all
    the larger of the two buffers."""
    if kind == "all_gather":
        return _nbytes(out)
    if kind == "reduce_scatter":
        return _nbytes(inp)
    if kind == "all_to_all":
        return max(_nbytes(out), _nbytes(inp))
    return _nbytes(inp if inp is not None else out)


def _written(kind: str, out, inp, filled: bool) -> int:
    """Bytes a fake-group call writes on this device: its output, written by the fake group itself (all-gather,
    reduce-scatter and all-to-all where it does so) or by :func:`_fill`; nothing for an all-reduce or broadcast
    (in place), or for a scatter with nothing to copy. A real group's NCCL kernels write these bytes on their own
    stream, inside the collective time the model adds (:func:`emulation_seconds`)."""
    if kind in ("all_reduce", "broadcast") or (kind == "scatter" and (inp is None or not filled)):
        return 0
    return _nbytes(out)


def emulation_seconds(sizes: list[int], device: torch.device, repeats: int = 3, chunk: int = 1 << 28) -> float:
    """Device seconds of one contiguous copy of each of ``sizes`` bytes in turn, the median of ``repeats``: what the
    fake group's outputs cost the measured step (:func:`_written`), which a real group's collectives write on their
    own stream instead. Buffers of at most ``chunk`` bytes (a larger size is copied chunk by chunk, as bandwidth-bound
    copies add up). On CUDA the device first sleeps while the host queues the copies, so the events time the copies
    alone, not the host's launches."""
    sizes = [int(s) for s in sizes if s > 0]
    if not sizes:
        return 0.0
    room = min(max(sizes), chunk)
    src = torch.ones(room, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copies() -> None:
        for size in sizes:
            for start in range(0, size, room):
                k = min(room, size - start)
                dst[:k].copy_(src[:k])

    copies()  # warm
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(200_000_000)  # ~0.1 s of device time: the queue stays ahead of the GPU
            begin.record()
            copies()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            copies()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def _fill(kind: str, out, inp, n: int, r: int) -> None:
    """Plausible outputs where the fake group leaves them untouched (see the module docstring)."""
    if kind == "reduce_scatter":
        if isinstance(inp, (list, tuple)):
            out.copy_(inp[r])
        elif inp.is_contiguous() and out.is_contiguous():
            out.view(-1).copy_(inp.reshape(n, -1)[r])
    elif kind == "all_to_all":
        if isinstance(out, (list, tuple)):
            for o, i in zip(out, inp):
                if o.shape == i.shape:
                    o.copy_(i)
        elif out.is_contiguous() and inp.is_contiguous():
            k = min(out.numel(), inp.numel())
            out.view(-1)[:k].copy_(inp.reshape(-1)[:k])
            out.view(-1)[k:].zero_()
    elif kind == "scatter":  # the source rank's own chunk (another rank has none to copy)
        if inp is not None:
            out.copy_(inp[r])
    elif kind == "all_gather":
        if isinstance(out, (list, tuple)):
            for o in out:
                o.copy_(inp)
        elif out.is_contiguous():
            out.view(n, -1).copy_(inp.reshape(1, -1).expand(n, -1))


def _wrap(name: str, orig):
    kind = _PY_FUNCS[name]
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if getattr(_tls, "depth", 0):  # an alias calling the new name (all_gather_into_tensor -> _single)
            return orig(*args, **kwargs)
        counter = _ACTIVE
        _tls.depth = 1
        try:
            if counter is not None and counter.fake and name == "all_to_all_single":
                work = counter.fake_all_to_all_single(orig, sig.bind(*args, **kwargs).arguments)
            else:
                work = orig(*args, **kwargs)
        finally:
            _tls.depth = 0
        if counter is not None and (counter.counting or counter.fill.get(kind)):
            counter.on_call(kind, sig.bind(*args, **kwargs).arguments)
        return work

    wrapper.__k3lab_wrapped__ = orig
    return wrapper


class CommCounter:
    """Wraps ``torch.distributed``'s collective functions (both the public names and those of
    ``distributed_c10d``) while installed: counts bytes and calls by (source, kind, group size) when
    ``counting``, and fills outputs for the kinds in ``fill`` (fake group only).

    Install it before :func:`parallelize` (the balancers bind ``dist.all_reduce`` there)."""

    def __init__(self, groups=None, fill: dict | None = None, fake: bool = False):
        self.groups = groups
        self.fill = dict(fill or {})
        self.fake = fake
        self.substituted: dict = defaultdict(int)  # bytes of calls the fake group could not take as they were
        self.counting = False
        self.records: dict = defaultdict(lambda: [0, 0])  # (source, kind, n) -> [bytes, calls]
        self.fsdp_calls: list[tuple[str, int, int]] = []   # FSDP (kind, n, bytes) in call order
        self.writes: list[tuple[str, int]] = []   # (kind, bytes) the fake group or a fill writes, in call order
        self._saved: list = []

    def install(self) -> "CommCounter":
        global _ACTIVE
        import torch.distributed.distributed_c10d as c10d

        for module in (dist, c10d):
            for name in _PY_FUNCS:
                orig = getattr(module, name, None)
                if orig is None or hasattr(orig, "__k3lab_wrapped__"):
                    continue
                self._saved.append((module, name, orig))
                setattr(module, name, _wrap(name, orig))
        for name in _BOUND_BY_NAME:
            wrapped = getattr(c10d, name)
            orig = wrapped.__k3lab_wrapped__
            for module in [m for k, m in list(sys.modules.items()) if k.startswith("torch.distributed.") and m]:
                if module is not c10d and getattr(module, name, None) is orig:
                    self._saved.append((module, name, orig))
                    setattr(module, name, wrapped)
        _ACTIVE = self
        return self

    def uninstall(self) -> None:
        global _ACTIVE
        for module, name, orig in reversed(self._saved):
            setattr(module, name, orig)
        self._saved.clear()
        _ACTIVE = None

    def reset(self) -> None:
        self.records.clear()
        self.fsdp_calls.clear()
        self.substituted.clear()
        self.writes.clear()

    def timed_writes(self, device: torch.device) -> dict:
        """The counted step's fake-group writes per kind: ``{kind: {"bytes": Σ, "ms": their copies' device time}}``
        (:func:`emulation_seconds`)."""
        sizes = defaultdict(list)
        for kind, b in self.writes:
            sizes[kind].append(b)
        return {k: dict(bytes=sum(v), ms=1e3 * emulation_seconds(v, device)) for k, v in sorted(sizes.items())}

    def fake_all_to_all_single(self, orig, a: dict):
        """torch >= 2.13's fake group copies an all-to-all's input rows into its output and refuses an empty
        input with a non-empty output (a MoonEP rank that receives expert replicas but lends none): such a
        call goes to the fake group with an empty output, and the output is zero-filled here."""
        out, inp = a.get("output"), a.get("input")
        if inp is None or out is None or inp.numel() > 0 or out.numel() == 0:
            return orig(**a)
        group = a.get("group")
        n = dist.get_world_size(group)
        if self.counting:
            self.substituted["all_to_all"] += _nbytes(out)
        work = orig(**{**a, "output": out.new_empty((0, *out.shape[1:])), "output_split_sizes": [0] * n})
        out.zero_()
        return work

    def _source(self, group) -> str:
        frame = sys._getframe(3)
        while frame is not None:
            if "/fsdp/" in frame.f_code.co_filename.replace("\\", "/"):
                return "fsdp"
            frame = frame.f_back
        g = self.groups
        if g is not None and group is not None:
            for name in ("ep", "cp", "edp"):
                if getattr(g, name) is group:
                    return name
        return "other"

    def on_call(self, kind: str, a: dict) -> None:
        group = a.get("group")
        n = dist.get_world_size(group)
        out, inp = (a.get("tensor"), a.get("scatter_list")) if kind == "scatter" else _args_of(a)
        if self.fill.get(kind):
            _fill(kind, out, inp, n, dist.get_rank(group))
        if not self.counting:
            return
        size = _size_of(kind, out, inp)
        if self.fake and (written := _written(kind, out, inp, filled=bool(self.fill.get(kind)))):
            self.writes.append((kind, written))
        source = self._source(group)
        rec = self.records[(source, kind, n)]
        rec[0] += size
        rec[1] += 1
        if source == "fsdp":
            self.fsdp_calls.append((kind, n, size))

    def summary(self, steps: int = 1, edge_calls: int = 1) -> dict:
        """Bytes and calls per (source, kind, n) a step, and the FSDP edges: the first ``edge_calls`` all-gathers and
        the last ``edge_calls`` reduce-scatters (the root's, and the embedding's where it is a unit of its own:
        nothing runs before the one's forward or after the other's backward to hide them)."""
        comm = [dict(source=s, kind=k, n=n, bytes=b / steps, calls=c / steps)
                for (s, k, n), (b, c) in sorted(self.records.items())]
        ag = [c for c in self.fsdp_calls if c[0] == "all_gather"][:edge_calls]
        rs = [c for c in self.fsdp_calls if c[0] == "reduce_scatter"][-edge_calls:]
        edges = [dict(kind=k, n=n, bytes=b) for k, n, b in ag + rs]
        return dict(comm=comm, fsdp_edges=edges)


def _op_size(func, args) -> tuple[str | None, int]:
    """(kind, nccl-tests size) of a ``c10d`` / ``_c10d_functional`` op from its positional arguments."""
    name = func._schema.name.split("::")[-1]
    base = name.rstrip("_")
    if func.namespace == "c10d":
        table = {"_allgather_base": ("all_gather", 0), "allgather": ("all_gather", 0),
                 "allgather_into_tensor_coalesced": ("all_gather", 0),
                 "_reduce_scatter_base": ("reduce_scatter", 1), "reduce_scatter": ("reduce_scatter", 1),
                 "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
                 "allreduce": ("all_reduce", 0), "allreduce_coalesced": ("all_reduce", 0),
                 "alltoall_base": ("all_to_all", None), "alltoall": ("all_to_all", 1), "broadcast": ("broadcast", 0)}
        if base not in table:
            return None, 0
        kind, i = table[base]
        if i is None:
            return kind, max(_nbytes(args[0]), _nbytes(args[1]))
        return kind, _nbytes(args[i])
    table = {"all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
             "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_to_all_single": "all_to_all",
             "broadcast": "broadcast"}
    if base not in table:
        return None, 0
    kind = table[base]
    size = _nbytes(args[0])
    if kind == "all_gather":
        size *= int(args[1])  # group_size
    return kind, size


def dispatch_counter():
    """A ``TorchDispatchMode`` counting every c10d / functional collective op's bytes by kind (the cross-check)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class DispatchCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes: dict = defaultdict(int)
            self.calls: dict = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                kind, size = _op_size(func, args)
                if kind is not None:
                    self.bytes[kind] += size
                    self.calls[kind] += 1
            return func(*args, **(kwargs or {}))

    return DispatchCounter()


# ==============================================================================================
# the fake process group
# ==============================================================================================
def _probe_fills(device: torch.device) -> dict:
    """Which kinds the installed fake group leaves untouched (then :class:`CommCounter` fills them)."""
    n = dist.get_world_size()
    x = torch.arange(1.0, 3.0, device=device)
    nan = float("nan")
    ag = torch.full((2 * n,), nan, device=device)
    dist.all_gather_into_tensor(ag, x)
    rs = torch.full((2,), nan, device=device)
    dist.reduce_scatter_tensor(rs, torch.ones(2 * n, device=device))
    a2a = torch.full((n,), nan, device=device)
    dist.all_to_all_single(a2a, torch.ones(n, device=device))
    sc = torch.full((1,), nan, device=device)
    rank = dist.get_rank()
    dist.scatter(sc, [torch.ones(1, device=device)] * n if rank == 0 else None, src=0)
    return {"all_gather": bool(ag.isnan().any()), "reduce_scatter": bool(rs.isnan().any()),
            "all_to_all": bool(a2a.isnan().any()), "scatter": rank == 0 and bool(sc.isnan().any())}


class _FixedSizeExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows_out, group, take, place, most):
        ctx.rows_in, ctx.group, ctx.take, ctx.place, ctx.most = x.shape[0], group, take, place, most
        return _fixed_size_all_to_all(x, rows_out, group, take, place, most)

    @staticmethod
    def backward(ctx, grad):
        orders = _reverse(ctx.take, ctx.place)
        return (_fixed_size_all_to_all(grad, ctx.rows_in, ctx.group, *orders, ctx.most),) + (None,) * 5


def _reverse(take, place):
    """The (take, place) orders of an exchange's backward: the gradient leaves through the inverse of ``place`` and
    lands through the inverse of ``take`` (each ``(order, inverse)`` or None)."""
    flip = lambda o: None if o is None else (o[1], o[0])  # noqa: E731
    return flip(place), flip(take)


def _fixed_size_all_to_all(x, rows, group, take=None, place=None, most=None):
    """``x [C_in, …]`` -> ``[rows, …]``: one equal-split all-to-all of min(C_in, rows) rows (the most either buffer
    lets a device-initiated exchange move; at most ``most`` where given), padded with zero rows to ``rows``;
    ``take``/``place`` (``(order, inverse)`` or None) gather the rows before and after it, as a two-dimensional
    all-to-all writes them (:data:`k3lab.parallel.expert_static.Exchange`)."""
    if take is not None:
        x = x.index_select(0, take[0])
    n = dist.get_world_size(group)
    k = min(rows, x.shape[0]) if most is None else min(rows, x.shape[0], most)
    flat = x[:k].reshape(-1)
    pad = (-flat.numel()) % n  # equal splits: a multiple of the group size
    flat = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.contiguous()
    out = torch.empty_like(flat)
    dist.all_to_all_single(out, flat, group=group)
    moved = out[:k * x[0].numel()].view(k, *x.shape[1:])
    moved = torch.cat([moved, moved.new_zeros(rows - k, *x.shape[1:])]) if rows > k else moved
    return moved if place is None else moved.index_select(0, place[0])


def fixed_size_exchange(x, send, recv, rows_out, group, take=None, place=None):
    """A stand-in for the capturable exchange of :mod:`k3lab.parallel.expert_static` on the fake group (timing
    only): one equal-split ``all_to_all_single`` of the fixed buffers' rows each way (the smaller buffer's: the
    most the device-initiated exchange moves), the split sizes ``send``/``recv`` ignored, so no host read; the rows
    taken and placed in the dispatcher's orders (``take``/``place``) as a two-dimensional all-to-all writes them. On
    the fake group it returns this rank's own rows, so every rank computes rows as the simulated one does; it routes
    nothing."""
    return _FixedSizeExchange.apply(x, rows_out, group, take, place, None)


fixed_size_exchange.capturable = True  # no host read: a CUDA graph records it (k3lab.parallel.expert_static.capturable)
fixed_size_exchange.places_rows = True  # takes and places rows itself (k3lab.parallel.expert_static.Exchange)


def fixed_size_weights(lent: int, send: str = "read"):
    """:func:`fixed_size_exchange` for MoonEP's replica weights (the dispatcher's ``weight_exchange``) that moves
    ``lent`` weight rows each way instead of the El its buffer holds: the bytes a device-initiated exchange moves when
    a rank borrows ``lent`` experts a MoE layer (it moves what the plan lends, where the stand-in cannot read that
    without a host read). ``lent`` = El is the bound (every rank borrowing E/R experts in every layer). ``send``:
    "read" (it declares ``reads_rows = lent``, so the dispatcher hands it those rows only) or "bound" (it declares
    nothing and is handed the whole send buffer of El + R − 2 rows, as before 2026-12-07's eighth session)."""

    def exchange(x, send, recv, rows_out, group, take=None, place=None):
        return _FixedSizeExchange.apply(x, rows_out, group, take, place, lent)

    exchange.capturable, exchange.places_rows = True, True
    if send == "read":  # it reads the first `lent` rows only, so the dispatcher hands it no more (Exchange's
        exchange.reads_rows = lent  # reads_rows): the rows a device-initiated exchange reads in place
    return exchange


def unplaced(exchange):
    """``exchange`` (:func:`fixed_size_exchange`, :func:`emulated_exchange`) without its row orders: the dispatcher
    then permutes the received rows bank-major itself (``k3lab.parallel.expert_static.Exchange``), as it must for an
    exchange without a two-dimensional all-to-all. Same capturability, same emulated time."""

    def without_orders(x, send, recv, rows_out, group):
        return exchange(x, send, recv, rows_out, group)

    without_orders.capturable = getattr(exchange, "capturable", False)
    without_orders.emulated = getattr(exchange, "emulated", False)
    return without_orders


# the SMs an emulated all-to-all keeps busy while it waits: NCCL runs a collective as a number of channels, one
# thread block (SM) each; 16 is this script's assumption, stated beside every figure that uses it
EMULATED_SMS = 16


def emulated_exchange(link: Link, sms: int = EMULATED_SMS):
    """:func:`fixed_size_exchange` that also *takes the time* the step model gives it (CUDA only): each call, forward
    and backward, holds the caller's stream for ``collective_seconds("all_to_all", bytes, N, 1, link)`` from its
    start, on ``sms`` SMs (:data:`EMULATED_SMS`), as an NCCL all-to-all blocks its stream; work on other streams
    (:attr:`k3lab.moe.latent.LatentMoE.shared_stream`) runs beside it. The rank's measured step then holds its exposed
    all-to-all time, what overlap hides included: a fake rank timed with it adds every collective but the all-to-alls
    (:func:`predict_step` with ``in_compute``). The time a call waits is measured from a device timestamp taken before
    the fake group's copy of the rows, so the copy (what NCCL's kernels write) counts inside it."""

    def exchange(x, send, recv, rows_out, group, take=None, place=None):
        return _EmulatedExchange.apply(x, rows_out, group, link, sms, take, place)

    exchange.capturable = True
    exchange.places_rows = True
    exchange.emulated = True
    return exchange


class _EmulatedExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows_out, group, link, sms, take, place):
        ctx.rows_in, ctx.group, ctx.link, ctx.sms, ctx.take, ctx.place = x.shape[0], group, link, sms, take, place
        return _timed_all_to_all(x, rows_out, group, link, sms, take, place)

    @staticmethod
    def backward(ctx, grad):
        orders = _reverse(ctx.take, ctx.place)
        return (_timed_all_to_all(grad, ctx.rows_in, ctx.group, ctx.link, ctx.sms, *orders),) + (None,) * 6


def _timed_all_to_all(x, rows: int, group, link: Link, sms: int, take=None, place=None):
    """:func:`_fixed_size_all_to_all` (its row orders included), with the caller's stream held until the modelled
    time of that all-to-all (nccl-tests size: its buffer) has passed since a device timestamp taken before it."""
    if x.device.type != "cuda":
        raise ValueError(f"emulated_exchange: its timer runs on a CUDA GPU; the rows are on {x.device} (use "
                         "fixed_size_exchange, the stand-in without the time)")
    stamp, wait_until = _timer_kernels()
    n = dist.get_world_size(group)
    numel = min(rows, x.shape[0]) * x[0].numel()
    size = (numel + (-numel) % n) * x.element_size()                               # the equal-split buffer's bytes
    t0 = torch.empty(1, dtype=torch.int64, device=x.device)
    stamp[(1,)](t0)
    out = _fixed_size_all_to_all(x, rows, group, take, place)
    wait_until[(sms,)](t0, int(1e9 * collective_seconds("all_to_all", size, n, 1, link)))
    return out


def _timer_kernels():
    """(stamp, wait_until): the two Triton kernels on the GPU's global nanosecond timer; RuntimeError without Triton."""
    if triton is None:
        raise RuntimeError("emulated_exchange: needs Triton and a CUDA GPU (its timer kernels)")
    return _stamp_kernel, _wait_until_kernel


try:  # the emulated exchange's kernels (GPU runs only; the CPU tests never launch them)
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer
except ImportError:  # pragma: no cover - a CPU install without Triton
    triton = None
else:
    @triton.jit
    def _stamp_kernel(t_ptr):
        tl.store(t_ptr, globaltimer())

    @triton.jit
    def _wait_until_kernel(t_ptr, ns):
        start = tl.load(t_ptr)
        now = globaltimer()
        while now - start < ns:
            now = globaltimer()


@contextlib.contextmanager
def fake_process_group(world: int, rank: int, device: torch.device):
    """An initialised fake default group of ``world`` ranks in which this process is ``rank``; destroyed on
    exit. Yields the kinds whose outputs must be filled (:func:`_probe_fills`)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 — registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_process_group: torch.distributed is already initialised")
    # an in-memory store that implements every call (fit's heartbeat uses it; the FakeStore does not)
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    try:
        yield _probe_fills(device)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_rank(world: int, rank: int, device: torch.device):
    """This process as ``rank`` of a ``world``-rank fake group whose collectives return plausible data: the fake group
    (:func:`fake_process_group`) and a :class:`CommCounter` that fills what this torch's fake group leaves untouched
    (torch 2.11 leaves a scatter's output empty, so ``distribute_tensor`` from rank 0 gave ``fit``'s shards no
    weights). Yields the counter (installed; ``counting`` off)."""
    with fake_process_group(world, rank, device) as fills:
        counter = CommCounter(fill={k: v for k, v in fills.items() if v}, fake=True).install()
        try:
            yield counter
        finally:
            counter.uninstall()


# ==============================================================================================
# configs
# ==============================================================================================
PRESETS = ("tiny", "small", "k3slice")
OPTIONS = {"optimizer": ("adamw", "sgd"), "recompute": None, "layers": int, "rank": int,
           "ep_kind": ("moonep", "ep", "static"), "baseline": ("world1", "local-experts"), "init": ("device", "meta"),
           "vocab": int, "reshard": ("true", "false"), "graph": ("true", "false"), "lent": int,
           "edges": ("root", "units", "vocab"), "send": ("read", "bound")}


@dataclass(frozen=True)
class Spec:
    """One configuration: ``preset`` on ``world`` ranks (``ep``, ``cp``), B rows of T tokens per data-parallel rank."""

    name: str
    preset: str
    world: int
    B: int
    T: int
    ep: int = 1
    cp: int = 1
    options: tuple = ()

    def option(self, key: str, default=None):
        return dict(self.options).get(key, default)

    @property
    def tokens_per_rank(self) -> int:
        return self.B * self.T // self.cp


def parse_config(name: str) -> Spec:
    """``PRESET-wN[-epE][-cpC]-BxT[@key=value,...]`` -> Spec (ValueError naming the rule)."""
    rule = f"config {name!r}: must be PRESET-wN[-epE][-cpC]-BxT[@key=value,...] with PRESET in {PRESETS}"
    main, _, opts = name.partition("@")
    parts = main.split("-")
    if len(parts) < 3 or parts[0] not in PRESETS:
        raise ValueError(rule)
    degrees = {"w": None, "ep": 1, "cp": 1}
    for p in parts[1:-1]:
        key = next((k for k in ("ep", "cp", "w") if p.startswith(k) and p[len(k):].isdigit()), None)
        if key is None:
            raise ValueError(rule)
        degrees[key] = int(p[len(key):])
    bt = parts[-1].split("x")
    if degrees["w"] is None or len(bt) != 2 or not all(s.isdigit() and int(s) > 0 for s in bt):
        raise ValueError(rule)
    options = []
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in OPTIONS:
            raise ValueError(f"config {name!r}: option {item!r}: allowed keys are {sorted(OPTIONS)}")
        allowed = OPTIONS[key]
        if allowed is int:
            if not value.isdigit():
                raise ValueError(f"config {name!r}: option {item!r}: {key} must be an int >= 0")
            value = int(value)
        elif allowed is not None and value not in allowed:
            raise ValueError(f"config {name!r}: option {item!r}: allowed values are {allowed}")
        options.append((key, value))
    spec = Spec(name, parts[0], degrees["w"], int(bt[0]), int(bt[1]), degrees["ep"], degrees["cp"], tuple(options))
    from k3lab.parallel.dims import ParallelDims

    ParallelDims(spec.world, cp=spec.cp, ep=spec.ep)  # ValueError naming the axis
    if spec.T % spec.cp:
        raise ValueError(f"config {name!r}: cp={spec.cp} must divide T={spec.T}")
    return spec


CONFIG_LISTS = {
    # CPU, seconds: tiny preset, FSDP at 2 and 4, EP 2, CP 2
    "cpu-smoke": ["tiny-w2-2x64", "tiny-w4-2x64", "tiny-w2-ep2-2x64", "tiny-w2-cp2-1x128"],
    # one H200, ~2 min: `small` at 16×1024 per rank under FSDP and FSDP+EP (MoonEP) at N = 2/4/8, CP 2/4 on a 32K
    # sequence (sublayer recompute: CP 2 runs out of memory with less), and the K3 slice (2 layers of K3 widths,
    # 896/8 = 112 experts a rank; SGD so that the one-rank baseline fits; plain EP, eager, as first measured, and
    # the graphed fixed-shape MoonEP rank lending 8 experts a layer, the most any simulated routing lent at K3's
    # shape: docs/scaling.md, section 4j; it needs an H200's memory)
    "gpu": ["small-w2-16x1024", "small-w4-16x1024", "small-w8-16x1024",
            "small-w2-ep2-16x1024", "small-w4-ep4-16x1024", "small-w8-ep8-16x1024",
            "small-w2-cp2-1x32768@recompute=sublayer", "small-w4-cp4-1x32768@recompute=sublayer",
            "k3slice-w8-ep8-2x4096@optimizer=sgd,ep_kind=ep",
            "k3slice-w8-ep8-2x4096@optimizer=sgd,ep_kind=static,graph=true,lent=8",
            "k3slice-w8-ep8-2x4096@optimizer=sgd,ep_kind=static,graph=true,lent=8,edges=units",
            "k3slice-w8-ep8-2x4096@optimizer=sgd,ep_kind=static,graph=true,lent=8,edges=vocab"],
    "gpu-quick": ["small-w8-16x1024", "small-w8-ep8-16x1024", "k3slice-w8-ep8-2x4096@optimizer=sgd,ep_kind=ep"],
}


def model_config(spec: Spec, local_experts: bool = False):
    """The ModelConfig of ``spec`` (``local_experts``: E/ep routed experts, the baseline of a rank's share)."""
    from k3lab.config import ModelConfig

    if spec.preset == "k3slice":
        layers = spec.option("layers", 2)
        if layers < 2:
            raise ValueError(f"config {spec.name!r}: layers={layers}: a K3 slice needs >= 2 (one dense, one MoE)")
        cfg = ModelConfig.preset("k3").replace(num_hidden_layers=layers, full_attn_layers=[layers])
    else:
        cfg = ModelConfig.preset(spec.preset)
    if spec.option("vocab"):
        cfg = cfg.replace(vocab_size=spec.option("vocab"), bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if local_experts and spec.ep > 1:
        E = cfg.n_routed_experts // spec.ep
        cfg = cfg.replace(n_routed_experts=E, num_experts_per_tok=min(cfg.num_experts_per_tok, E))
    return cfg


def baseline_of(spec: Spec) -> Spec:
    """The one-GPU run at this config's per-rank shape [B, T/cp] (k3slice: E/ep experts, no EP)."""
    kind = spec.option("baseline", "local-experts" if spec.preset == "k3slice" else "world1")
    keep = tuple((k, v) for k, v in spec.options if k in ("optimizer", "layers", "recompute", "vocab", "init", "graph"))
    if kind == "local-experts" and spec.ep > 1:
        keep += (("experts_of_ep", spec.ep),)
    name = f"{spec.preset}-w1-{spec.B}x{spec.T // spec.cp}"
    opts = ",".join(f"{k}={v}" for k, v in keep if k != "experts_of_ep")
    name += (f"@{opts}" if opts else "") + (f" (E/{spec.ep} experts)" if kind == "local-experts" and spec.ep > 1 else "")
    return Spec(name, spec.preset, 1, spec.B, spec.T // spec.cp, 1, 1, keep)


# ==============================================================================================
# one run
# ==============================================================================================
@torch.no_grad()
def init_for_timing(model: nn.Module, std: float) -> None:
    """Fill a model allocated by ``to_empty`` (built on meta): the model's own init in kind (norms 1, AttnRes
    queries and router biases 0, K3's A_log 0, dt_bias in its inverse-softplus range, short convs uniform
    ±1/sqrt(k), every other matrix N(0, std)), on each rank's local shard; then the balancers as
    :func:`k3lab.parallel.materialize.materialize_from_rank0` leaves them. For timing, not for training."""
    from k3lab.moe.latent import LatentMoE

    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        leaf = name.rsplit(".", 1)[-1]
        owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if not local.is_floating_point():
            local.zero_()
        elif name.endswith("res_proj.weight") or leaf in ("A_log", "e_score_correction_bias", "max_logit"):
            local.zero_()
        elif leaf == "dt_bias":
            local.uniform_(-6.9, -2.3)
        elif leaf == "weight" and local.dim() == 1 and "norm" in owner:
            local.fill_(1.0)
        elif "conv" in owner and local.dim() == 3:
            bound = 1.0 / math.sqrt(local.shape[-1] * local.shape[1])
            local.uniform_(-bound, bound)
        elif local.dim() >= 2:
            local.normal_(0.0, std)
        else:
            local.zero_()
    for m in model.modules():
        if isinstance(m, LatentMoE):
            b = m.balancer
            b.bias = m.gate.e_score_correction_bias
            for attr, value in list(vars(b).items()):
                if isinstance(value, torch.Tensor) and value is not b.bias and value.is_meta:
                    setattr(b, attr, torch.zeros(value.shape, dtype=value.dtype, device=b.bias.device))


def fsdp_expected_bytes(model: nn.Module, reshard_after_forward: bool = True) -> dict:
    """What FSDP2 should move per step on this model (after :func:`parallelize`): every FSDP-managed parameter
    (a DTensor) at its dim-0 size padded to a multiple of the mesh size, in its dtype (or FSDP's mixed
    precision param dtype); all-gathered once in forward and, for the sublayers with ``reshard_after_forward``, once
    more in backward; reduce-scattered once (fp32 under mixed precision). FSDP2 reduce-scatters only the
    parameters that got a gradient: the count is below this by those that did not (layer 0's AttnRes
    query and norm, whose softmax has one source: 0.02% at ``tiny``)."""
    from k3lab.parallel.fsdp import sublayers
    from k3lab.parallel.vocab import ShardedEmbedding

    def padded(p) -> int:
        n = p.device_mesh.size()
        rows = -(-p.shape[0] // n) * n if p.dim() else n
        return rows * (p.numel() // max(p.shape[0], 1) if p.dim() else 1)

    def mp_dtype(module, p, which: str):
        state = getattr(module, "_get_fsdp_state", None)
        try:
            policy = state()._mp_policy if state else None
        except Exception:
            policy = None
        dt = getattr(policy, which, None) if policy is not None else None
        return dt or p.dtype

    subs = sublayers(model)
    in_sub = {id(p) for m in subs for p in m.parameters()}
    ag = rs = 0
    for m in subs:
        for p in m.parameters():
            if hasattr(p, "device_mesh"):
                ag += (2 if reshard_after_forward else 1) * padded(p) * mp_dtype(m, p, "param_dtype").itemsize
                rs += padded(p) * mp_dtype(m, p, "reduce_dtype").itemsize
    apart = {id(p) for m in model.modules() if isinstance(m, ShardedEmbedding) for p in m.parameters()}  # not FSDP's
    for p in model.parameters():
        if hasattr(p, "device_mesh") and id(p) not in in_sub and id(p) not in apart:
            ag += padded(p) * mp_dtype(model, p, "param_dtype").itemsize
            rs += padded(p) * mp_dtype(model, p, "reduce_dtype").itemsize
    return {"all_gather": ag, "reduce_scatter": rs}


def profile_step(step, device: torch.device, top: int) -> dict:
    """One ``step()`` under ``torch.profiler``: its wall time, the summed kernel time, the kernel count and the
    ``top`` ops by self device time and by self host time (name, calls, ms)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    return summarize_profile(prof, time.perf_counter() - t0, top)


def summarize_profile(prof, wall: float, top: int) -> dict:
    """A finished ``torch.profiler`` run of one step, ``wall`` seconds long: the dict :func:`print_profile` prints
    (wall ms, the summed kernel time, the kernel count, the ``top`` ops by self device and by self host time)."""
    events = prof.key_averages()
    dev_time = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_dev = sorted(events, key=dev_time, reverse=True)[:top]
    by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return dict(wall_ms=1e3 * wall, kernel_ms=sum(k.device_time_total for k in kernels) / 1e3 if kernels else None,
                kernels=len(kernels),
                top_device=[(e.key[:90], e.count, dev_time(e) / 1e3) for e in by_dev],
                top_host=[(e.key[:90], e.count, e.self_cpu_time_total / 1e3) for e in by_host])


# where a file's Python runs, for the host attribution (first match wins; the rest is "other Python")
HOST_BUCKETS = (("torch/distributed/fsdp", "FSDP2 hooks and copies"), ("torch/distributed/tensor", "DTensor dispatch"),
                ("torch/distributed", "torch.distributed"), ("torch/_dynamo", "dynamo (guards, frames)"),
                ("torch/_inductor", "inductor runtime"), ("torch/_functorch", "AOT autograd runtime"),
                ("torch/optim", "optimizer (Python)"), ("torch/autograd", "autograd (Python)"),
                ("k3lab/", "k3lab"), ("torch/", "torch (other Python)"))


def host_bucket(filename: str) -> str:
    """The :data:`HOST_BUCKETS` name of a cProfile entry's file; C functions (``~``) are "C++ (ops, launches)"."""
    if filename == "~" or filename.startswith("<"):
        return "C++ (ops, launches, backward engine)"
    path = filename.replace("\\", "/")
    return next((name for key, name in HOST_BUCKETS if key in path), "other Python")


def host_profile_step(step, device: torch.device, top: int) -> dict:
    """One ``step()`` under ``cProfile``: the host's self time by :data:`HOST_BUCKETS` and the ``top`` Python
    functions by self time (``file:function``, calls, ms). C++ work (ops, kernel launches, the autograd engine)
    shows as the self time of the built-in that entered it."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    _sync(device)
    t0 = time.perf_counter()
    prof.enable()
    step()
    _sync(device)
    prof.disable()
    wall = time.perf_counter() - t0
    entries = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, self s, cumulative s, ...)
    buckets: dict[str, float] = {}
    for (file, _, _), (_, _, self_s, _, _) in entries.items():
        buckets[host_bucket(file)] = buckets.get(host_bucket(file), 0.0) + 1e3 * self_s
    functions = sorted(entries.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return dict(wall_ms=1e3 * wall, buckets=dict(sorted(buckets.items(), key=lambda kv: -kv[1])),
                top=[(f"{file.split('site-packages/')[-1]}:{fn}"[-90:], calls, 1e3 * self_s)
                     for (file, _, fn), (_, calls, self_s, _, _) in functions])


def print_profile(row: dict) -> None:
    prof = row.get("profile")
    if not prof:
        return
    print(f"\n### profile of one step: {row['config']}: wall {prof['wall_ms']:.1f} ms, {prof['kernels']} kernels, "
          f"kernel time {_fmt(prof['kernel_ms'])} ms")
    for title, key in (("self device ms", "top_device"), ("self host ms", "top_host")):
        print(f"{title:>15s} | calls | op")
        for name, calls, ms in prof[key]:
            print(f"{ms:15.2f} | {calls:5d} | {name}")


def print_host_profile(row: dict) -> None:
    prof = row.get("host_profile")
    if not prof:
        return
    print(f"\n### host time of one step (cProfile): {row['config']}: wall {prof['wall_ms']:.1f} ms (profiled, slower)")
    print(f"{'self host ms':>15s} | where")
    for name, ms in prof["buckets"].items():
        print(f"{ms:15.2f} | {name}")
    print(f"{'self host ms':>15s} | calls | Python function")
    for name, calls, ms in prof["top"]:
        print(f"{ms:15.2f} | {calls:5d} | {name}")


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counts(device: torch.device) -> dict:
    """The CUDA caching allocator's running counters (:data:`ALLOCATOR_COUNTS`: retries after freeing the cache, and
    cudaMalloc / cudaFree calls, each of which may synchronize the device); {} off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def run_config(spec: Spec, args, *, process_group: str = "fake") -> dict:
    """Build, lay out and step ``spec`` on this device; returns the measurements (module docstring).

    ``process_group``: "fake" (one process plays rank R of spec.world), "real" (torchrun: the initialised
    default group, world size spec.world), or "none" (spec.world must be 1)."""
    from k3lab.model import K3ForCausalLM
    from k3lab.parallel.dims import ParallelDims, init_groups
    from k3lab.parallel.fsdp import clip_grad_norm_, exposed_calls, sum_expert_grads_
    from k3lab.parallel.parallelize import expert_parameters, parallelize, reduce_max_logits_

    from k3lab.parallel.parallelize import global_label_counts, local_batch
    from k3lab.train import TrainConfig, make_optimizer

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    share = spec.option("experts_of_ep")  # a baseline holding one EP rank's experts (baseline_of)
    cfg = model_config(dataclasses.replace(spec, ep=share), local_experts=True) if share else model_config(spec)
    dims = ParallelDims(spec.world, cp=spec.cp, ep=spec.ep)
    global_B = spec.B * dims.dp_shard
    dims.check_model(cfg, global_B, spec.T)
    rank = spec.option("rank", (spec.cp - 1) if spec.cp > 1 else 0) if process_group == "fake" else None
    distributed = spec.world > 1
    param_dtype = torch.bfloat16 if args.param_dtype == "bfloat16" else None
    meta = spec.option("init", "meta" if spec.preset == "k3slice" or args.meta else "device") == "meta"
    row = dict(config=spec.name, preset=spec.preset, world=spec.world, ep=spec.ep, cp=spec.cp, B=spec.B, T=spec.T,
               tokens_per_rank=spec.tokens_per_rank, optimizer=spec.option("optimizer", args.optimizer),
               device=str(device), dtype=args.dtype, param_dtype=args.param_dtype, torch=torch.__version__,
               process_group=process_group if distributed else "none", rank=rank,
               params=cfg.param_counts()["total"], active_params=cfg.param_counts()["active"])

    with contextlib.ExitStack() as stack:
        fills = {}
        if distributed and process_group == "fake":
            fills = stack.enter_context(fake_process_group(spec.world, rank, device))
        counter = CommCounter(fill={k: v for k, v in fills.items() if v}, fake=process_group == "fake")
        if distributed:
            counter.install()
            stack.callback(counter.uninstall)
            groups = init_groups(dims, device.type)
            counter.groups = groups
            rank = groups.rank
        else:
            from k3lab.parallel.dims import ParallelGroups

            groups = ParallelGroups(dims, 0, None, None, None, None)
        row.update(rank=rank, fake_pg_fills=sorted(k for k, v in fills.items() if v))

        torch.manual_seed(args.seed)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with torch.device("meta" if meta else device):
            model = K3ForCausalLM(cfg)
        model.fused_loss = args.fused_loss
        reshard = spec.option("reshard", "true") == "true"  # FSDP2 reshard_after_forward
        ep_kind = spec.option("ep_kind", "moonep")
        if spec.option("lent") is not None and (ep_kind != "static" or spec.ep == 1):
            raise ValueError(f"config {spec.name!r}: lent= sizes MoonEP's replica-weight exchange: it needs "
                             f"ep_kind=static and ep > 1")
        if spec.option("send") is not None and spec.option("lent") is None:
            raise ValueError(f"config {spec.name!r}: send= says what the lent=N exchange is handed: it needs lent=")
        model, experts = parallelize(model, groups, device, ep_kind="moonep" if ep_kind == "static" else ep_kind,
                                     cp_layout="contiguous", recompute=spec.option("recompute", args.recompute),
                                     compile=args.compile, param_dtype=param_dtype if distributed else None,
                                     reshard_after_forward=reshard, edges=spec.option("edges", "root"))
        if ep_kind == "static" and spec.ep > 1:
            from k3lab.parallel.expert_static import apply_static_moonep

            lent = spec.option("lent")  # None: the bound, El weight rows each way
            if lent is not None and not 0 <= lent <= cfg.n_routed_experts // spec.ep:
                raise ValueError(f"config {spec.name!r}: lent={lent}: a rank borrows 0 to E/ep = "
                                 f"{cfg.n_routed_experts // spec.ep} experts")
            weights = None if lent is None else fixed_size_weights(lent, spec.option("send", "read"))
            apply_static_moonep(model, groups.ep, fixed_size_exchange, weight_exchange=weights)
        if meta:
            model.to_empty(device=device)
            init_for_timing(model, cfg.initializer_range)
            experts = set(expert_parameters(model)) if experts else set()
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer_name = row["optimizer"]
        if optimizer_name == "sgd":
            optimizer = torch.optim.SGD(params, lr=1e-4, foreach=False if distributed else None)
        else:
            optimizer = make_optimizer(model, TrainConfig(optimizer="adamw", lr=1e-4))  # as fit builds it
        if distributed:
            row["fsdp_expected"] = fsdp_expected_bytes(model, reshard)
        row["setup_peak_gib"] = _peak_gib(device)

        gen = torch.Generator().manual_seed(args.seed)
        x = torch.randint(0, cfg.vocab_size, (global_B, spec.T), generator=gen)
        y = torch.roll(x, -1, dims=1)
        shard = None
        if distributed:
            x, y, shard = local_batch(x, y, dims, rank, *global_label_counts(y), "contiguous")
            if shard.mtp_input_ids is not None:
                shard.mtp_input_ids, shard.mtp_labels = shard.mtp_input_ids.to(device), shard.mtp_labels.to(device)
        x, y = x.to(device), y.to(device)
        expert_list = [p for p in params if p in experts]
        autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

        def step() -> tuple[float, float, float]:
            try:
                with torch.autograd.set_detect_anomaly(bool(os.environ.get("K3LAB_PREDICT_ANOMALY"))):
                    return _step()
            except Exception:
                if os.environ.get("K3LAB_PREDICT_DEBUG"):
                    for i, m in enumerate(x for x in model.modules() if hasattr(x, "dispatcher")):
                        d = m.dispatcher
                        plan = getattr(d, "last_plan", None)
                        print(f"[debug] moe {i}: {type(d).__name__}", None if plan is None else dict(
                            slots=plan.slots.tolist(), replicas=plan.num_replicas.tolist(),
                            moved=int(plan.moved), home_load=plan.home_load.tolist()), file=sys.stderr)
                raise

        def forward(x, y):
            return model(x, labels=y) if shard is None else model(x, labels=y, shard=shard)

        def grad_norm():
            if distributed:
                sum_expert_grads_(expert_list, groups.edp)
                return clip_grad_norm_(params, 1.0, experts, dims.world_size // dims.ep, groups.world)
            return nn.utils.clip_grad_norm_(params, 1.0)

        graphed = None
        if spec.option("graph", "false") == "true":
            if device.type != "cuda" or (spec.ep > 1 and ep_kind != "static") or spec.cp > 1:
                raise ValueError(f"config {spec.name}: graph=true needs a CUDA device, no CP, and with EP "
                                 "ep_kind=static (the other dispatchers read their all-to-all sizes on the host, "
                                 "which a captured step cannot)")
            from k3lab.cuda_graph import GraphedForwardBackward

            # eager: the warmup steps and the counting step; the next step captures (untimed), the timed ones replay
            graphed = GraphedForwardBackward(model, torch.bfloat16 if args.dtype == "bfloat16" else None,
                                             warmup=args.warmup + int(distributed), after_backward=grad_norm,
                                             forward=forward)

        def _step() -> tuple[float, float, float]:
            t0 = time.perf_counter()
            if graphed is not None:
                out, norm = graphed(x, y)
            else:
                with autocast:
                    out = forward(x, y)
                out.loss.backward()
                norm = grad_norm()
            values = torch.stack([out.loss.detach().double(), norm.double()])
            if distributed:
                dist.all_reduce(values, group=groups.world)
            loss, gnorm = values.tolist()  # the step's one host read-back, as the trainer's
            t_fwd_bwd = time.perf_counter() - t0
            optimizer.step()
            if graphed is None or not graphed.captured:  # a replayed backward writes the captured gradients
                optimizer.zero_grad(set_to_none=True)
            if distributed:
                reduce_max_logits_(model, groups.world)
            model.after_optimizer_step()
            return loss, gnorm, t_fwd_bwd

        t_start = time.perf_counter()
        losses = []
        for _ in range(args.warmup):
            losses.append(step()[0])
        first_steps_s = time.perf_counter() - t_start
        # one untimed step with the counters on: bytes per collective kind (and the dispatch-level cross-check)
        counted = {}
        if distributed:
            counter.reset()
            counter.counting = True
            mode = dispatch_counter() if args.verify_counts else None
            # the dispatch-mode cross-check runs eager: compiled regions entered under a TorchDispatchMode left the
            # timed steps that followed 2x slower (small N = 8 compiled: 613 ms with the check, 308 ms without)
            eager = torch.compiler.set_stance("force_eager") if mode is not None else contextlib.nullcontext()
            with eager, mode if mode is not None else contextlib.nullcontext():
                losses.append(step()[0])
            counter.counting = False
            counted = counter.summary(edge_calls=exposed_calls(spec.option("edges", "root")))
            if mode is not None:
                python_side = defaultdict(float)
                for r in counted["comm"]:
                    python_side[r["kind"]] += r["bytes"]
                row["dispatch_bytes"] = dict(mode.bytes)
                seen = {k: mode.bytes.get(k, 0) + counter.substituted.get(k, 0) for k in set(mode.bytes) | set(python_side)}
                row["uncounted_bytes"] = {k: v - python_side.get(k, 0) for k, v in seen.items()
                                          if abs(v - python_side.get(k, 0)) > 0.01 * max(v, 1)}
        if device.type == "cuda":  # (before the capture: the graph's private pool is allocated there, and held)
            torch.cuda.reset_peak_memory_stats(device)
        if graphed is not None:  # the capture (untimed): it records the step and replays it once
            losses.append(step()[0])
            row["graphed"] = graphed.captured
        before = allocator_counts(device)
        times, fwd_bwd = [], []
        for _ in range(args.steps):
            _sync(device)
            t0 = time.perf_counter()
            loss, _, t_fb = step()
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            fwd_bwd.append(t_fb)
        after = allocator_counts(device)
        if after:  # per timed step: a step that makes the allocator free its cache and retry stalls the host
            row["allocator_per_step"] = {k: (after[k] - before[k]) / args.steps for k in after}
        if args.profile:  # one more step under the profiler: where this rank's step spends its GPU and host time
            row["profile"] = profile_step(step, device, args.profile)
        if args.host_profile:  # and one under cProfile: which Python (FSDP2, DTensor, dynamo, k3lab) holds the host
            row["host_profile"] = host_profile_step(step, device, args.host_profile)
        if process_group == "real":  # the slowest rank sets the step
            t = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times = t.tolist()
        # forward + backward + grad norm end at the step's host read-back (a sync); the rest is the update
        row.update(step_ms=[1e3 * t for t in times], compute_ms=1e3 * statistics.median(times),
                   fwd_bwd_ms=1e3 * statistics.median(fwd_bwd),
                   update_ms=1e3 * statistics.median(t - f for t, f in zip(times, fwd_bwd)),
                   peak_gib=_peak_gib(device), first_steps_s=first_steps_s, losses=losses,
                   finite=all(math.isfinite(v) for v in losses), **counted)
        if counter.writes:  # the fake group's outputs, written on the compute stream: timed on their own
            writes = counter.timed_writes(device)
            row["emulation_writes"] = {k: w["bytes"] for k, w in writes.items()}
            row["emulation_ms"] = sum(w["ms"] for w in writes.values())
        if process_group == "real" and device.type == "cuda":
            p = torch.tensor([row["peak_gib"]], device=device)
            dist.all_reduce(p, op=dist.ReduceOp.MAX)
            row["peak_gib"] = float(p)
    return row  # the caller frees the device memory once this frame is gone (_guarded)


# ==============================================================================================
# predictions and the table
# ==============================================================================================
def add_predictions(row: dict, baseline: dict | None, link: Link) -> dict:
    """Predicted step ms under ``link`` (and every link in :data:`LINKS` in ``row["predicted"]``), tokens/s per
    GPU, the baseline's compute, scaling efficiency and compute vs one GPU."""
    if "compute_ms" not in row:
        return row
    # the rank's step with every collective free: less the fake group's own writes (run_config, emulation_seconds)
    compute_s = (row["compute_ms"] - row.get("emulation_ms", 0.0)) / 1e3
    comm, edges = row.get("comm", []), row.get("fsdp_edges", [])
    row["predicted"] = {name: {k: 1e3 * v for k, v in predict_step(compute_s, comm, lk, edges).items()}
                        for name, lk in LINKS.items()}
    pred = row["predicted"][link.name] if row.get("process_group") != "real" else None
    step_ms = pred["realistic"] if pred else row["compute_ms"]
    row["link"] = link.name
    row["tokens_per_s_per_gpu"] = row["tokens_per_rank"] / (step_ms / 1e3)
    if baseline is not None and "compute_ms" in baseline:
        row["baseline"] = baseline["config"]
        row["baseline_ms"] = baseline["compute_ms"]
        base_tps = baseline["tokens_per_rank"] / (baseline["compute_ms"] / 1e3)
        row["scaling_efficiency"] = row["tokens_per_s_per_gpu"] / base_tps
        # per-token compute rate against the baseline's (= baseline ms / compute ms at equal tokens)
        row["compute_vs_one_gpu"] = (row["tokens_per_rank"] / row["compute_ms"]) / (
            baseline["tokens_per_rank"] / baseline["compute_ms"])
    return row


def _fmt_bytes(b: float | None) -> str:
    if not b:
        return "0"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def _fmt(v, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def markdown_table(rows: list[dict], link: Link) -> str:
    """The results table (one line per config; comm bytes are per step, nccl-tests sizes)."""
    head = ("| config | N | tokens/rank | compute ms | fake writes ms | update ms | 1-GPU ms | compute vs 1 GPU "
            "| peak GiB | AG | RS | A2A | AR "
            "| comm ms | no-overlap ms | overlap ms | FSDP-realistic ms | tok/s/GPU | scaling eff |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r.get('world', '')} | {r.get('tokens_per_rank', '')} | {r['error']} |")
            continue
        by_kind = defaultdict(float)
        for c in r.get("comm", []):
            by_kind[c["kind"]] += c["bytes"]
        p = r.get("predicted", {}).get(link.name) if r.get("process_group") != "real" else None
        measured = r.get("process_group") == "real"
        lines.append(
            f"| {r['config']}{' (measured)' if measured else ''} | {r['world']} | {r['tokens_per_rank']} "
            f"| {r['compute_ms']:.1f} | {_fmt(r.get('emulation_ms'))} | {_fmt(r.get('update_ms'))} "
            f"| {_fmt(r.get('baseline_ms'))} "
            f"| {_fmt(r.get('compute_vs_one_gpu'), '.0%')} | {_fmt(r.get('peak_gib'))} "
            f"| {_fmt_bytes(by_kind['all_gather'])} | {_fmt_bytes(by_kind['reduce_scatter'])} "
            f"| {_fmt_bytes(by_kind['all_to_all'])} | {_fmt_bytes(by_kind['all_reduce'] + by_kind['broadcast'])} "
            f"| {_fmt(p and p['comm'])} | {_fmt(p and p['no_overlap'])} | {_fmt(p and p['overlap'])} "
            f"| {_fmt(p and p['realistic'])} | {r['tokens_per_s_per_gpu']:,.0f} "
            f"| {_fmt(r.get('scaling_efficiency'), '.0%')} |")
    return "\n".join(lines)


def measured_beside_predicted(rows: list[dict], predicted: list[dict], link: Link) -> str:
    """torchrun rows: the measured step next to the fake-group prediction of the same config."""
    by_name = {p["config"]: p for p in predicted}
    lines = ["| config | N | measured step ms | predicted no-overlap | overlap | FSDP-realistic | measured peak GiB "
             "| predicted peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = by_name.get(r["config"], {})
        pr = p.get("predicted", {}).get(link.name, {})
        lines.append(f"| {r['config']} | {r['world']} | {_fmt(r.get('compute_ms'))} | {_fmt(pr.get('no_overlap'))} "
                     f"| {_fmt(pr.get('overlap'))} | {_fmt(pr.get('realistic'))} | {_fmt(r.get('peak_gib'))} "
                     f"| {_fmt(p.get('peak_gib'))} |")
    return "\n".join(lines)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _guarded(spec: Spec, args, process_group: str) -> dict:
    try:
        row = run_config(spec, args, process_group=process_group)
    except Exception as err:  # one config's failure is its row, the others still run
        if args.raise_errors:
            raise
        import traceback

        traceback.print_exc()
        msg = "OOM" if _is_oom(err) else f"error: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
        row = dict(config=spec.name, world=spec.world, tokens_per_rank=spec.tokens_per_rank, error=msg)
    _free_device_memory()  # out here the failed run's frames (and tensors) are gone with its traceback
    return row


def _progress(row: dict, t0: float) -> None:
    what = row.get("error") or (f"compute {row['compute_ms']:.1f} ms, peak {_fmt(row.get('peak_gib'))} GiB, "
                                f"first steps {row['first_steps_s']:.1f} s")
    print(f"[predict_scaling] {time.perf_counter() - t0:6.1f} s  {row['config']}: {what}", file=sys.stderr, flush=True)


def _save(rows: list[dict], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1, default=str)


def run_all(specs: list[Spec], args) -> list[dict]:
    """Fake group: every config and its one-GPU baseline (each baseline once), in this process. With
    ``args.json`` the rows are saved after each config (a run cut short keeps what it measured)."""
    link = LINKS[args.link]
    baselines: dict[str, dict] = {}
    rows = []
    t0 = time.perf_counter()
    for spec in specs:
        base = baseline_of(spec) if spec.world > 1 and args.baseline else None
        if base is not None and base.name not in baselines:
            baselines[base.name] = add_predictions(_guarded(base, args, "none"), None, link)
            baselines[base.name] = add_predictions(baselines[base.name], baselines[base.name], link)
            _progress(baselines[base.name], t0)
        row = _guarded(spec, args, "fake" if spec.world > 1 else "none")
        rows.append(add_predictions(row, baselines.get(base.name) if base else (row if spec.world == 1 else None), link))
        _progress(row, t0)
        _save(list(baselines.values()) + rows, args.json)
    return list(baselines.values()) + rows


def run_measured(specs: list[Spec], args) -> list[dict]:
    """torchrun: the configs whose N is WORLD_SIZE, on the real group."""
    from k3lab.parallel.dims import init_process_group_from_env

    device = torch.device(args.device)
    init_process_group_from_env(device.type)
    world = dist.get_world_size()
    if device.type == "cuda":
        args.device = f"cuda:{torch.cuda.current_device()}"
    rows = []
    try:
        for spec in specs:
            if spec.world != world:
                continue
            row = _guarded(spec, args, "real")
            rows.append(add_predictions(row, None, LINKS[args.link]))
    finally:
        dist.destroy_process_group()
    return rows


def expand_configs(names: list[str]) -> list[str]:
    out = []
    for name in names:
        out += CONFIG_LISTS.get(name, [name])
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=None,
                        help=f"config names or lists {sorted(CONFIG_LISTS)} (default: one config from the flags below)")
    parser.add_argument("--preset", default="small", choices=PRESETS)
    parser.add_argument("--world", type=int, default=8, help="N ranks")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (a CP rank holds seq-len/cp)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (then one counting step)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="bfloat16: autocast with fp32 weights (the trainer's dtype='bfloat16')")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="FSDP2's compute dtype (bfloat16: bf16 all-gathers, fp32 reduce-scatters)")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--compile", default="none")
    parser.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--meta", action="store_true", help="build every model on meta and fill it (k3slice always)")
    parser.add_argument("--link", default="nvlink8", choices=sorted(LINKS), help="the bandwidth model of the table")
    parser.add_argument("--verify-counts", action=argparse.BooleanOptionalAction, default=True,
                        help="cross-check the counted bytes against a TorchDispatchMode in the counting step")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="measure each config's one-GPU baseline in the same run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--measured", action="store_true",
                        help="under torchrun (WORLD_SIZE > 1): real groups, measured steps (implied by WORLD_SIZE > 1)")
    parser.add_argument("--predicted", default=None, help="a fake-group run's --json, printed beside --measured rows")
    parser.add_argument("--raise-errors", action="store_true", help="stop at the first failing config")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="profile one more step per config and print its TOP ops by device and host time")
    parser.add_argument("--host-profile", type=int, default=0, metavar="TOP",
                        help="one more step per config under cProfile: the host's time by package (FSDP2, DTensor, "
                             "dynamo, inductor, k3lab, C++) and its TOP Python functions")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    names = expand_configs(args.configs) if args.configs else [
        f"{args.preset}-w{args.world}" + (f"-ep{args.ep}" if args.ep > 1 else "")
        + (f"-cp{args.cp}" if args.cp > 1 else "")
        + f"-{args.batch_size}x{args.seq_len}"]
    specs = [parse_config(n) for n in names]
    link = LINKS[args.link]
    measured = args.measured or int(os.environ.get("WORLD_SIZE", "1")) > 1
    if measured:
        rows = run_measured(specs, args)
        if dist.is_initialized() or int(os.environ.get("RANK", "0")) != 0:
            return 0
    else:
        rows = run_all(specs, args)
    _save(rows, args.json)
    for row in rows:
        print_profile(row)
        print_host_profile(row)
        if row.get("allocator_per_step"):
            print(f"{row['config']}: CUDA allocator per timed step: " +
                  ", ".join(f"{k} {v:g}" for k, v in row["allocator_per_step"].items()))
    print(f"\nlink model {link.name}: {link.note}")
    if measured and args.predicted:
        with open(args.predicted) as f:
            print(measured_beside_predicted(rows, json.load(f), link))
        print()
    print(markdown_table(rows, link))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
