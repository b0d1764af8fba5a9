"""The k3lab training loop — the only one: one process or one rank of many, any causal LM, exact resume,
never unpickles.

    result = fit(model, batch_iterator(train_ids, 16, 128), TrainConfig(steps=200), val_batches=...)
    result = fit(lambda: K3ForCausalLM(cfg), batches, TrainConfig(...), parallel=ParallelOptions(ep=2))  # torchrun

With ``parallel`` (:class:`k3lab.parallel.parallelize.ParallelOptions`) the model is built and laid out by the
parallel plan (EP -> CP -> recompute -> compile -> FSDP2, :func:`k3lab.parallel.parallelize.parallelize`) over the
initialised process group, and the same step runs on every rank: this rank's part of the global batch, its share
of the global loss, the expert gradients summed over their replicas, the global clip, one all-reduce of the
logged values, QK-Clip from the MAX-reduced logits. World size 1 (no group, or ``torchrun --nproc_per_node 1``)
is the one-process step itself. ``python -m k3lab.parallel.run`` is this function's command line
(docs/training.md, section "One loop for every world size").

Per step ``s`` (0-based): ``lr = cosine_lr(s, steps, warmup, lr, min_lr_ratio)`` for every group
(K3: cosine, 1% linear warmup, weight decay 0.1), ``loss = model(x, labels=y).loss`` (under bf16
autocast if asked), backward, global grad-norm clip, optimizer step, ``model.after_optimizer_step()``
when the model defines it (MoE balancer updates, QK-Clip). One host sync a step: after backward, the
loss, the gradient norm and the logged metrics are read back together (a non-finite loss or norm stops
the run there, before the update). ``compile="sublayer"`` compiles each
decoder layer's mixer and MLP first (:mod:`k3lab.compile`). ``cuda_graph=True`` replays the same step as two
CUDA graphs, split at that sync (:mod:`k3lab.cuda_graph`). The model's ``loss`` is the objective:
a model adds its own auxiliary/MTP terms into it (``aux_loss`` and ``metrics`` are only logged).

Precision: ``dtype="bfloat16"`` runs forward and backward under bf16 autocast. ``param_dtype="bfloat16"``
(with bf16 autocast only: :data:`PRECISIONS`) also keeps the model's trainable parameters in bf16 and
steps fp32 master copies of them (:mod:`k3lab.precision`): the bf16 grads become the masters' fp32
grads, the clip (and the logged ``grad_norm``) is on those, the optimizer steps the masters, then
``p ← bf16(master)``. Above world size 1 the same switches hold on each rank's shards (:func:`shard_masters`):
FSDP2 mixed precision with the fp32 shards as the masters, or, with ``moment_dtype="bfloat16"`` /
``master_format="split"``, bf16 shards and the one-GPU fused master step on the local shards (docs/training.md,
section "One loop for every world size"). ``fused_loss=True`` sets the model's ``fused_loss`` (K3: the chunked linear
cross-entropy of :mod:`k3lab.losses`; it changes only float rounding).

Checkpoints (``out_dir/ckpt-00000100/`` plus the ``out_dir/latest`` pointer; safetensors + JSON,
written atomically, never unpickled) are :mod:`k3lab.checkpoint`'s format, documented there; its
functions stay importable from here (``from k3lab.train import save_checkpoint, load_checkpoint``).
Batches are fetched by step (``train_batches(step)`` when callable, e.g.
:func:`k3lab.data.batch_iterator`), so a resumed run sees the same data.
"""
from __future__ import annotations

import json
import math
import dataclasses
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm  # text bar on stdout: a saved notebook keeps its finished state (no widget)

from k3lab.backend import resolve_device
from k3lab.checkpoint import (CHECKPOINT_FORMAT, plain_config, set_rng_state,  # noqa: F401 (re-exported)
                              load_checkpoint, resolve_checkpoint, save_checkpoint)
from k3lab.compile import COMPILE_MODES
from k3lab.config import DTYPES
from k3lab.cuda_graph import GraphedForwardBackward, GraphedOptimizerStep
from k3lab.memory import LAYERED_MODES, RECOMPUTE_MODES
from k3lab.optim import build_optimizer, set_lr
from k3lab.precision import MASTER_FORMATS, MOMENT_DTYPES, PARAM_DTYPES, MasterWeightOptimizer, cast_params_

OPTIMIZERS = ("adamw", "muon")
PROFILES = ("reference", "fast")  # TrainConfig.profile
# The measured-best settings of a one-GPU step (docs/training.md, "What to pick": the `small` preset at 16 x 1024 on
# one H200, 113.5K tokens/s with all of them; the reference path, fp32 and eager, ran the same shape at 0.25x). On a CPU the
# reference path is the fastest measured, so there the fast profile changes nothing. resolve_profile applies them.
FAST_CUDA = dict(dtype="bfloat16", param_dtype="bfloat16", compile="sublayer", fused_loss=True,
                 moment_dtype="bfloat16", master_format="split", cuda_graph=True)
MAX_LR = 10.0  # the largest peak lr TrainConfig takes: above it an update overflows fp32 (1e300) or diverges at once
# (dtype, param_dtype) pairs fit runs: bf16 parameters need bf16 autocast (fp32 inputs would meet bf16 weights)
PRECISIONS = (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"))
@dataclass
class TrainConfig:
    """How to train; every field is validated on construction (ValueError names the field)."""

    steps: int = 200                          # optimizer steps in the whole run (the schedule's length)
    lr: float = 3e-3                          # peak learning rate (every optimizer group)
    min_lr_ratio: float = 0.1                 # cosine floor, as a fraction of lr
    warmup_steps: int | None = None           # linear warmup steps; None -> round(warmup_frac·steps)
    warmup_frac: float = 0.01                 # K3: 1% warmup
    weight_decay: float = 0.1                 # decoupled; norms, biases and other 1-D params get none
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas (also Muon's AdamW groups)
    grad_clip: float = 1.0                    # max global grad norm; 0 = no clipping (norm still logged)
    optimizer: str = "adamw"                  # "adamw" | "muon" (k3lab.optim.build_optimizer)
    optimizer_kwargs: dict = field(default_factory=dict)  # extra build_optimizer args (muon_lr, per_head, ...)
    eval_every: int = 0                       # evaluate every N steps and at the end; 0 = at the end only
    eval_batches: int = 8                     # validation batches per evaluation
    log_every: int = 1                        # keep a history record (and a metrics.jsonl line) every N steps
    checkpoint_every: int = 0                 # save every N steps and at the end of fit; 0 = at the end only
    keep_checkpoints: int = 2                 # newest checkpoints kept in out_dir
    out_dir: str | None = None                # None = write no files
    seed: int = 0                             # torch seed for randomness during training
    device: str = "auto"                      # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "float32"                    # "float32" | "bfloat16" (autocast; weights as param_dtype)
    param_dtype: str = "float32"              # PARAM_DTYPES: "float32" = params as the model has them, stepped directly |
                                              # "bfloat16" = cast to bf16, fp32 master weights (k3lab.precision)
    moment_dtype: str = "float32"             # MOMENT_DTYPES: AdamW's m and v; "bfloat16" needs param_dtype="bfloat16",
                                              # AdamW and the fused step (CUDA; the CPU: its reference): 4 bytes a
                                              # parameter less; above world size 1 on the local shards (shard_masters)
    master_format: str = "float32"            # MASTER_FORMATS: how the fp32 masters are kept; "split" = the bf16
                                              # param is the master's high half, an int16 tensor the rest (exact;
                                              # k3lab.precision): needs param_dtype="bfloat16", AdamW and the fused
                                              # step (CUDA; the CPU: its reference): 2 bytes a parameter less; above
                                              # world size 1 bf16 shards + lo shards (shard_masters)
    fused_loss: bool = False                  # True: set model.fused_loss (K3: chunked linear CE); False: leave it
    compile: str = "none"                     # COMPILE_MODES: "none" (eager) | "sublayer" (k3lab.compile)
    recompute: str = "none"                   # RECOMPUTE_MODES: "none" | "selective" | "mixer" | "sublayer" (k3lab.memory)
    recompute_layers: int | None = None       # with "mixer" / "sublayer": checkpoint this many decoder layers
                                              # (spread over depth; the others "selective"); None = all
    cuda_graph: bool = False                  # True (CUDA): after two eager steps, forward + backward + norm and (bf16
                                              # params, AdamW) the update replayed as CUDA graphs (k3lab.cuda_graph);
                                              # every batch one shape
    progress: bool = True                     # tqdm progress bar
    name: str = "train"                       # run name: the progress bar's label
    profile: str = "reference"                # PROFILES: "reference" = the fields as given; "fast" = on CUDA, the
                                              # measured-best settings (FAST_CUDA) for every field left at its default

    # allowed values of the fields that take one of a list (the CLI's choices come from here: k3lab.cli)
    CHOICES = {"optimizer": OPTIMIZERS, "dtype": DTYPES, "param_dtype": PARAM_DTYPES, "moment_dtype": MOMENT_DTYPES,
               "master_format": MASTER_FORMATS, "compile": COMPILE_MODES, "recompute": RECOMPUTE_MODES,
               "profile": PROFILES}

    def __post_init__(self):
        def need(ok: bool, name: str, rule: str):
            if not ok:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: {rule}")

        def number(v) -> bool:  # a finite real number (bool is not one here)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for name in ("steps", "eval_batches", "log_every", "keep_checkpoints"):
            need(type(getattr(self, name)) is int and getattr(self, name) >= 1, name, "must be an int >= 1")
        for name in ("eval_every", "checkpoint_every", "seed"):
            need(type(getattr(self, name)) is int and getattr(self, name) >= 0, name, "must be an int >= 0")
        need(number(self.lr) and 0 < self.lr <= MAX_LR, "lr", f"must be a finite number > 0 and <= {MAX_LR:g}")
        need(number(self.min_lr_ratio) and 0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        need(self.warmup_steps is None or (type(self.warmup_steps) is int and 0 <= self.warmup_steps <= self.steps),
             "warmup_steps", f"must be None or an int in [0, steps={self.steps}]")
        need(number(self.warmup_frac) and 0.0 <= self.warmup_frac <= 1.0, "warmup_frac", "must be in [0, 1]")
        need(number(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be a finite number >= 0")
        need(isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
             and all(number(b) and 0.0 <= b < 1.0 for b in self.betas), "betas", "must be two numbers in [0, 1)")
        need(number(self.grad_clip) and self.grad_clip >= 0, "grad_clip",
             "must be a finite number >= 0 (0 = no clipping)")
        for name in ("fused_loss", "cuda_graph", "progress"):
            need(isinstance(getattr(self, name), bool), name, "must be a bool")
        for name, allowed in self.CHOICES.items():
            need(getattr(self, name) in allowed, name, f"allowed values are {allowed}")
        need(isinstance(self.optimizer_kwargs, dict), "optimizer_kwargs", "must be a dict")
        need((self.dtype, self.param_dtype) in PRECISIONS, "param_dtype",
             f"needs TrainConfig.dtype='bfloat16' (bf16 autocast), got TrainConfig.dtype={self.dtype!r}; "
             f"allowed (dtype, param_dtype) combinations are {PRECISIONS}")
        need(self.moment_dtype == "float32" or (self.param_dtype == "bfloat16" and self.optimizer == "adamw"),
             "moment_dtype", "'bfloat16' needs TrainConfig.param_dtype='bfloat16' and optimizer='adamw' (the fused "
             f"master-weight AdamW step keeps them), got param_dtype={self.param_dtype!r}, optimizer={self.optimizer!r}")
        need(self.master_format == "float32" or (self.param_dtype == "bfloat16" and self.optimizer == "adamw"),
             "master_format", "'split' needs TrainConfig.param_dtype='bfloat16' and optimizer='adamw' (the fused "
             f"master-weight AdamW step splits the masters), got param_dtype={self.param_dtype!r}, "
             f"optimizer={self.optimizer!r}")
        need(not self.cuda_graph or self.param_dtype == "float32" or self.optimizer == "adamw", "cuda_graph",
             "with param_dtype='bfloat16' needs optimizer='adamw' (the fused master step keeps the captured "
             f"gradients; the unfused master path frees them), got optimizer={self.optimizer!r}")
        need(self.recompute_layers is None or (isinstance(self.recompute_layers, int)
                                               and not isinstance(self.recompute_layers, bool)
                                               and self.recompute_layers >= 0),
             "recompute_layers", "must be None (all layers) or an int >= 0")
        need(self.recompute_layers is None or self.recompute in LAYERED_MODES, "recompute_layers",
             f"needs TrainConfig.recompute in {LAYERED_MODES}, got recompute={self.recompute!r}")
        need(isinstance(self.device, str) and (self.device in ("auto", "cpu", "cuda")
                                               or self.device.startswith("cuda:")),
             "device", "allowed values are 'auto', 'cpu', 'cuda', 'cuda:N'")
        self.betas = tuple(self.betas)

    @property
    def warmup(self) -> int:
        """Warmup length in steps."""
        return self.warmup_steps if self.warmup_steps is not None else round(self.warmup_frac * self.steps)


@dataclass
class TrainResult:
    """What :func:`fit` returns at every world size: the metric history (one dict per logged step; under a
    parallel plan the global batch's values, the same on every rank), the number of optimizer steps done,
    the newest checkpoint folder (None without ``out_dir``), wall seconds, and ``info``: the layout
    (world size, parallel dims, device) and what the experts saw (per-MoE-layer loads, EP slots per rank)."""

    history: list[dict]
    step: int
    checkpoint: Path | None
    elapsed: float
    info: dict = field(default_factory=dict)

    def column(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the records that have it, e.g. ``column("val_loss")``."""
        rows = [r for r in self.history if key in r]
        return [r["step"] for r in rows], [r[key] for r in rows]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.history]

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens a second over the logged steps after the first (which compiles and warms up); None if < 2."""
        rows = [r for r in self.history if "step_time" in r][1:]
        timed = sum(r["step_time"] for r in rows)
        if len(rows) < 1 or timed <= 0:
            return None
        per_step = rows[-1]["tokens"] / rows[-1]["step"]  # tokens of one global batch
        return len(rows) * per_step / timed

    def summary(self) -> dict:
        """Plain data for a metrics JSON file: ``info``, ``step``, ``elapsed``, ``tokens_per_s``, the per-step
        ``losses``, ``grad_norms`` and ``step_times``, and the whole ``history``."""
        return dict(self.info, step=self.step, elapsed=self.elapsed, tokens_per_s=self.tokens_per_s,
                    losses=self.losses, grad_norms=[r["grad_norm"] for r in self.history],
                    step_times=[r.get("step_time") for r in self.history], history=self.history,
                    checkpoint=None if self.checkpoint is None else str(self.checkpoint))


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm stopped the run; ``.result`` holds the history so far."""

    def __init__(self, message: str, result: TrainResult):
        super().__init__(message)
        self.result = result


# ----------------------------------------------------------------------------------------------
# batches and evaluation
# ----------------------------------------------------------------------------------------------
def _next_batch(batches, step: int, iterator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step``: ``batches(step)`` when callable, else the iterator's next item."""
    if callable(batches):
        x, y = batches(step)
    else:
        try:
            x, y = next(iterator)
        except StopIteration:
            raise ValueError(f"train_batches ran out at step {step}; pass an infinite iterator or a "
                             "callable step -> (input_ids, labels)") from None
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def autocast(device: torch.device, dtype: str):
    """The forward's autocast context: bf16 when ``dtype == "bfloat16"`` (:data:`DTYPES`), else off."""
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


@torch.no_grad()
def evaluate(model: nn.Module, batches, num_batches: int = 8, device: str | torch.device = "cpu",
             dtype: str = "float32", plan=None) -> float:
    """Mean language-modelling loss over the first ``num_batches`` batches, in eval mode: the
    model's ``metrics["lm_loss"]`` when it reports one (K3: CE without the MTP/MoE terms), else ``loss``.

    ``batches``: a callable ``i -> (x, y)`` (batches 0..num_batches-1, the same every time) or an
    iterable (a fresh ``iter()`` each call: a list gives the same batches each time, a generator
    continues where it stopped; fewer batches than ``num_batches`` is fine).
    ``plan``: :func:`fit`'s run under a parallel plan: each rank evaluates its part of every global batch and
    the shares are summed over the ranks (every rank returns the same value).
    """
    device = torch.device(device)
    was_training = model.training
    model.eval()
    if callable(batches):
        source = (batches(i) for i in range(num_batches))
    else:
        source = (b for _, b in zip(range(num_batches), batches))
    losses = []
    for x, y in source:
        shard = None
        if plan is not None and plan.distributed:
            from k3lab.parallel.parallelize import global_label_counts, local_batch

            x, y, shard = local_batch(x, y, plan.dims, plan.rank, *global_label_counts(y), plan.parallel.cp_layout)
            if shard.mtp_input_ids is not None:
                shard.mtp_input_ids, shard.mtp_labels = shard.mtp_input_ids.to(device), shard.mtp_labels.to(device)
        with autocast(device, dtype):
            out = (model(x.to(device), labels=y.to(device)) if shard is None
                   else model(x.to(device), labels=y.to(device), shard=shard))
        loss = out.metrics.get("lm_loss", out.loss).detach().float()
        if shard is not None:
            loss = _all_reduce_sum({"loss": loss}, plan.groups.world, device)["loss"]
        losses.append(float(loss))
    model.train(was_training)
    if not losses:
        raise ValueError("evaluate: val_batches gave no batch")
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------------
def _metric_values(out) -> dict:
    """aux_loss and the scalar entries of out.metrics (0-d tensors or numbers), for the history."""
    found = {"aux_loss": out.aux_loss} if getattr(out, "aux_loss", None) is not None else {}
    found.update(getattr(out, "metrics", None) or {})
    return {k: v for k, v in found.items()
            if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1)}


def _host_floats(values: dict) -> dict:
    """``{name: one-element tensor | number}`` -> ``{name: float}``, reading all the tensors of a device
    back in one copy: one host sync a step instead of one per value."""
    floats = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    by_device: dict = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append((k, v.detach().reshape(()).double()))
    for items in by_device.values():
        floats.update(zip((k for k, _ in items), torch.stack([v for _, v in items]).tolist()))
    return {k: floats[k] for k in values}


# ----------------------------------------------------------------------------------------------
# the run's layout: one process, or this rank's part of a parallel plan
# ----------------------------------------------------------------------------------------------
@dataclass
class _Run:
    """What the loop needs to know about the layout (built once by :func:`_setup`)."""

    model: nn.Module
    device: torch.device
    groups: object                    # k3lab.parallel.dims.ParallelGroups (all None: one process)
    parallel: object | None           # the ParallelOptions asked for (None: plain fit)
    experts: set                      # EP expert slices (their gradients are summed over replicas)
    local_shards: dict | None         # how DCP must see the EP slices

    @property
    def dims(self):
        return self.groups.dims

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def distributed(self) -> bool:
        return self.groups.world is not None


def _run_device(cfg: TrainConfig, distributed: bool) -> torch.device:
    device = resolve_device(cfg.device)
    if distributed and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU (LOCAL_RANK, set at init)
    return device


def _setup(model, cfg: TrainConfig, parallel, first_batch_shape) -> _Run:
    """Build (``model`` may be a zero-argument builder) and lay out the model: EP -> CP -> recompute ->
    compile -> FSDP2 (:func:`k3lab.parallel.parallelize.parallelize`), the same plan at every world size."""
    import torch.distributed as dist

    from k3lab.parallel.dims import ParallelDims, ParallelGroups, init_groups
    from k3lab.parallel.parallelize import expert_layout, expert_parameters, parallelize

    world = dist.get_world_size() if parallel is not None and dist.is_initialized() else 1
    refusal = ep_cp_refusal(cfg, parallel, world) if parallel is not None else None
    if refusal:  # before any group is made: every rank refuses alike
        raise ValueError(refusal)
    if parallel is None:
        groups = ParallelGroups(ParallelDims(1), 0, None, None, None, None)
    else:
        dims = ParallelDims(world, dp_shard=parallel.dp_shard, cp=parallel.cp, ep=parallel.ep)
        groups = init_groups(dims, resolve_device(cfg.device).type, parallel.timeout)
    distributed = groups.world is not None
    device = _run_device(cfg, distributed)
    builder = None if isinstance(model, nn.Module) else model
    if builder is not None and not callable(builder):
        raise ValueError(f"fit: model must be an nn.Module or a zero-argument builder, got {type(model).__name__}")
    torch.manual_seed(cfg.seed)  # a builder draws the one-process initial weights from cfg.seed
    source = None
    if builder is None:
        net = model
    elif not distributed:
        net = builder()
    else:  # meta on every rank; rank 0's seeded one-process model fills the shards (k3lab.parallel.materialize)
        source = builder() if groups.rank == 0 else None
        with torch.device("meta"):
            net = builder()
    if not isinstance(net, nn.Module):
        raise ValueError(f"fit: the model builder returned {type(net).__name__}, not an nn.Module")
    if parallel is not None and hasattr(net, "config") and first_batch_shape is not None:
        groups.dims.check_model(net.config, *first_batch_shape)
    if cfg.fused_loss:
        if not hasattr(net, "fused_loss"):
            raise ValueError(f"TrainConfig.fused_loss=True: {type(net).__name__} has no fused_loss attribute "
                             "(K3ForCausalLM has); use fused_loss=False for this model")
        net.fused_loss = True
    meta = next(net.parameters()).is_meta
    if not meta:
        net.to(device)
    on_shards = distributed and shard_masters(cfg)
    if cfg.param_dtype != "float32" and (not distributed or on_shards):
        cast_params_(net, cfg.param_dtype)  # trainable floating params only; buffers stay as the model made them
    # FSDP2 mixed precision: bf16 compute from fp32 shards (the masters), or bf16 shards (masters on them: fit)
    bf16_compute = torch.bfloat16 if distributed and cfg.param_dtype == "bfloat16" and not on_shards else None
    net, experts = parallelize(net, groups, device, ep_kind=getattr(parallel, "ep_kind", "moonep"),
                               ep_plan=getattr(parallel, "ep_plan", "host"),
                               cp_layout=getattr(parallel, "cp_layout", "contiguous"), recompute=cfg.recompute,
                               recompute_layers=cfg.recompute_layers, compile=cfg.compile, param_dtype=bf16_compute,
                               reduce_dtype=torch.float32 if on_shards else None,
                               reshard_after_forward=getattr(parallel, "reshard_after_forward", True),
                               shared_overlap=getattr(parallel, "shared_overlap", False),
                               ep_chunks=getattr(parallel, "ep_chunks", 1),
                               edges=getattr(parallel, "edges", "root"))
    if meta:
        from k3lab.parallel.materialize import materialize_from_rank0

        net.to_empty(device=device)
        materialize_from_rank0(net, source, device, groups.world)
        if experts:  # to_empty made new Parameter objects for the (unsharded) expert slices
            experts = set(expert_parameters(net))
    del source
    net.train()
    return _Run(net, device, groups, parallel, experts, expert_layout(net, experts, groups))


def shard_masters(cfg: TrainConfig) -> bool:
    """Whether a sharded run (world size > 1) keeps its masters on the local shards: the parameters stay bf16
    FSDP2 shards and :class:`~k3lab.precision.MasterWeightOptimizer` steps each rank's shards with the one-GPU fused
    step (the Triton kernel on CUDA, its plain-PyTorch reference on the CPU) — what ``moment_dtype="bfloat16"``
    and ``master_format="split"`` need, since only that step keeps bf16 moments or splits a master. Otherwise
    ``param_dtype="bfloat16"`` above world size 1 is FSDP2's MixedPrecisionPolicy: the fp32 sharded parameters
    are the masters and torch's AdamW steps them (fp32 moments)."""
    return cfg.param_dtype == "bfloat16" and (cfg.moment_dtype != "float32" or cfg.master_format != "float32")


# TrainConfig values that a run with expert or context parallelism cannot take: (field, the value it takes, why)
_NOT_EP_CP = (
    ("cuda_graph", False, "the step is not captured: MoonEP reads its all-to-all sizes on the host at every MoE "
                          "layer and CP's shard carries each batch's shifted tokens (FSDP alone is captured; so is "
                          "ep_plan='device' with a capturable exchange, which k3lab does not have yet)"),
)


def ep_cp_refusal(cfg: TrainConfig, parallel, world: int) -> str | None:
    """Why this run cannot take ``cfg`` with its expert or context parallelism (:data:`_NOT_EP_CP`), or None. A run
    with EP alone, planned on the device (``ParallelOptions.ep_plan="device"``) over a capturable exchange
    (:func:`k3lab.parallel.expert_static.current_exchange`), takes CUDA graphs: nothing in its step reads the host.
    Today that exchange is only the timing harness's stand-in (``kernels/bench_train.py``'s fake rank)."""
    if world <= 1 or (parallel.ep <= 1 and parallel.cp <= 1):
        return None
    if parallel.cp == 1 and getattr(parallel, "ep_plan", "host") == "device":
        from k3lab.parallel.expert_static import capturable, current_exchange

        if capturable(current_exchange()):
            return None
    for name, runs, why in _NOT_EP_CP:
        if getattr(cfg, name) != runs:
            return (f"TrainConfig.{name}={getattr(cfg, name)!r}: with ep={parallel.ep}, cp={parallel.cp} {why}; use "
                    f"{name}={runs!r}, or ep=1 and cp=1")
    return None


# ----------------------------------------------------------------------------------------------
# resume: what the checkpoint was written with, and what this run changes
# ----------------------------------------------------------------------------------------------
def _saved_state(resume_from) -> tuple[Path, bool, dict]:
    """(checkpoint folder, written by DCP?, the TrainConfig it was written with: fields it predates at their
    defaults, plus the recorded ``batch_shape`` / ``data`` under those keys)."""
    path = resolve_checkpoint(resume_from)
    state = json.loads((path / "state.json").read_text())
    dcp = (path / ".metadata").exists()
    meta = state.get("extra", {}) if dcp else state
    saved = {**plain_config(TrainConfig()), **(meta.get("train_config") or {})}
    return path, dcp, {**saved, "batch_shape": meta.get("batch_shape"), "data": meta.get("data"),
                       "step": state.get("step")}


def check_resume_steps(saved_step, steps: int, stop_at: int | None = None, path=None) -> None:
    """Refuse a resume that would train no step: a checkpoint at step ``saved_step`` and a run of ``steps`` steps
    (``stop_at``: ending there) that ends at or before it (ValueError naming the field). A malformed step is left
    to the load's own check."""
    if type(saved_step) is not int:
        return
    where = f"the checkpoint is at step {saved_step}{f' ({path})' if path is not None else ''}"
    if saved_step >= steps:
        raise ValueError(f"TrainConfig.steps={steps}: {where}, so this run would train no step (a longer run "
                         "trains further)")
    if stop_at is not None and saved_step >= stop_at:
        raise ValueError(f"fit: stop_at={stop_at}: {where}, so this run would stop before training a step (stop "
                         "later, or not at all)")


# changed on resume: honoured (the schedule and the optimizer's hyperparameters come from this run's config)
HONOURED_ON_RESUME = ("steps", "lr", "min_lr_ratio", "warmup_steps", "warmup_frac", "weight_decay", "betas",
                      "grad_clip", "optimizer_kwargs", "dtype", "moment_dtype", "master_format", "fused_loss",
                      "compile", "recompute", "recompute_layers", "cuda_graph")
# changed on resume: the checkpoint's RNG state and data position continue, so the run differs from an
# uninterrupted one with either setting (a warning names them)
DIFFERS_ON_RESUME = ("seed", "batch_shape", "data")


def _resume_report(saved: dict, cfg: TrainConfig, batch_shape, data) -> None:
    """Warn once, naming every changed field with both values: which are honoured, which only differ."""
    mine = {**plain_config(cfg), "batch_shape": list(batch_shape), "data": data}
    if saved["optimizer"] != cfg.optimizer:
        raise ValueError(f"TrainConfig.optimizer={cfg.optimizer!r}: the checkpoint was trained with "
                         f"optimizer={saved['optimizer']!r}, whose state does not fit; resume with that value")

    def changed(names):
        return [f"{k} {saved[k]!r} -> {mine[k]!r}" for k in names
                if saved.get(k) is not None and json.dumps(saved[k]) != json.dumps(mine[k])]

    honoured, differs = changed(HONOURED_ON_RESUME), changed(DIFFERS_ON_RESUME)
    if honoured or differs:
        warnings.warn("resuming with changed settings: "
                      + (f"honoured (this run's values): {', '.join(honoured)}" if honoured else "")
                      + ("; " if honoured and differs else "")
                      + (f"differ from the checkpoint (its RNG state and data position continue, so the run "
                         f"will not match an uninterrupted one): {', '.join(differs)}" if differs else ""),
                      stacklevel=3)


def _group_settings(optimizer) -> list[dict]:
    """Every param group's hyperparameters (all but the parameters) as this run's config built them."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _resume(run: _Run, resume_from, cfg: TrainConfig, optimizer, masters, batch_shape, data, stop_at=None) -> dict:
    """Load weights, optimizer state, RNG, step and history; this run's optimizer hyperparameters stay."""
    path, dcp, saved = _saved_state(resume_from)
    if dcp and masters is not None and not run.distributed:
        raise ValueError(f"TrainConfig.param_dtype={cfg.param_dtype!r}: {path} is a sharded (DCP) checkpoint, whose "
                         "fp32 parameters the one-process master-weight optimizer does not read; resume it with "
                         "param_dtype='float32' at world size 1, or at the world size it was saved with")
    if not dcp and run.distributed:
        raise ValueError(f"fit: resume_from={str(path)!r} is a one-process checkpoint (k3lab.checkpoint), which "
                         f"cannot be sharded over {run.dims.world_size} ranks; resume it at world size 1")
    if not dcp and saved["param_dtype"] != cfg.param_dtype:
        raise ValueError(f"TrainConfig.param_dtype={cfg.param_dtype!r}: the checkpoint at {path} was "
                         f"trained with param_dtype={saved['param_dtype']!r}; resume with that value "
                         "(the fp32 master weights exist only in a param_dtype='bfloat16' run)")
    if dcp and run.distributed and shard_masters(cfg) != shard_masters(TrainConfig(
            **{k: saved[k] for k in ("dtype", "param_dtype", "moment_dtype", "master_format", "optimizer")})):
        raise ValueError(f"TrainConfig.moment_dtype={cfg.moment_dtype!r}, master_format={cfg.master_format!r}: the "
                         f"checkpoint at {path} was trained with param_dtype={saved['param_dtype']!r}, moment_dtype="
                         f"{saved['moment_dtype']!r}, master_format={saved['master_format']!r}, whose sharded state "
                         "has another layout (fp32 shards as masters, or bf16 shards with the optimizer's masters); "
                         "resume with those values")
    check_resume_steps(saved["step"], cfg.steps, stop_at, path)  # before the load: a run of no step is refused
    _resume_report(saved, cfg, batch_shape, data)
    settings = _group_settings(optimizer)
    if dcp:
        from k3lab.parallel.checkpoint import load_distributed

        state = load_distributed(path, run.model, optimizer, group=run.groups.world, local_shards=run.local_shards)
        for note in state.get("warnings", []):
            warnings.warn(note, stacklevel=3)
    else:
        state = load_checkpoint(path, run.model, optimizer)
        set_rng_state(load_file(str(path / "rng.safetensors")), state["rng"])
    for group, mine in zip(optimizer.param_groups, settings):  # honour this run's lr, betas, weight decay, ...
        group.update(mine)
    state["path"] = str(path)
    return state


# ----------------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------------
def resolve_profile(cfg: TrainConfig, device_type: str, world_size: int = 1, ep: int = 1,
                    cp: int = 1) -> tuple[TrainConfig, list[str]]:
    """``cfg`` with its profile applied, and the ``field=value`` settings the profile made.

    ``"fast"`` on CUDA fills every field of :data:`FAST_CUDA` that ``cfg`` leaves at its default (a field set to
    another value keeps it; to pin one at its default, use ``"reference"`` and set the others), except what this
    run cannot take: bf16 moments, split masters and (with bf16 weights) CUDA graphs need AdamW's fused step;
    ``cuda_graph`` is chosen at any world size with FSDP alone, not with expert or context parallelism above 1
    (``ep``, ``cp``: their degrees; :data:`_NOT_EP_CP`). On a CPU, or with ``"reference"``, ``cfg`` is returned
    unchanged."""
    if cfg.profile == "reference" or device_type != "cuda":
        return cfg, []
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    want = dict(FAST_CUDA)
    if cfg.optimizer != "adamw":  # these need AdamW's fused master step (CUDA graphs with bf16 weights too)
        for name in ("moment_dtype", "master_format", "cuda_graph"):
            want.pop(name)
    if world_size > 1 and (ep > 1 or cp > 1):
        for name, runs, _ in _NOT_EP_CP:
            want[name] = runs
    chosen = {k: v for k, v in want.items() if getattr(cfg, k) == defaults[k] and v != defaults[k]}
    return dataclasses.replace(cfg, **chosen), [f"{k}={v!r}" for k, v in chosen.items()]


def resolve_ep_plan(cfg: TrainConfig, parallel, device_type: str, world_size: int):
    """``parallel`` with the fast profile's MoonEP settings, and the ``field=value`` settings it made (or none).

    ``"fast"`` on CUDA, with expert parallelism above 1, MoonEP and compiled sublayers, plans on the device
    (``ep_plan="device"``, :mod:`k3lab.parallel.expert_static`) where ``parallel`` leaves the plan at its default
    ("host"): one H100, 2026-12-07, ``fit`` as a compiled fake rank of 8 with EP = 8 ran 311.2 ms a step planned on
    the device against 574.0 ms planned on the host, in one invocation (``kernels/TRAIN_RESULTS.md``). Equal to one
    process at 4 and 8 gloo ranks (``tests/test_moonep_property.py``). With the plan on the device it also runs the
    shared expert on a side stream (``shared_overlap=True``) where ``parallel`` leaves it off: one H200, 2026-12-07,
    the graphed rank with its all-to-alls emulated took 172.8 and 172.2 ms a step against 194.1 and 186.6 in line,
    two invocations (``docs/scaling.md``, section 4i). Not with context parallelism (EP with CP is tested planned on
    the host only). Otherwise ``parallel`` is returned as given."""
    if (cfg.profile != "fast" or device_type != "cuda" or world_size <= 1 or parallel is None or parallel.ep <= 1
            or parallel.cp > 1 or parallel.ep_kind != "moonep" or cfg.compile == "none"):
        return parallel, []
    defaults = {f.name: f.default for f in dataclasses.fields(type(parallel))}
    if parallel.ep_plan != defaults["ep_plan"]:
        return parallel, []  # a plan the run set keeps, and so does the rest
    want = dict(ep_plan="device", shared_overlap=True)
    chosen = {k: v for k, v in want.items() if getattr(parallel, k) == defaults[k]}
    return dataclasses.replace(parallel, **chosen), [f"{k}={v!r}" for k, v in chosen.items()]


def fit(model, train_batches, cfg: TrainConfig, val_batches=None, resume_from: str | os.PathLike | None = None,
        stop_at: int | None = None, *, parallel=None, on_step=None, data: str | None = None) -> TrainResult:
    """Train for ``cfg.steps`` optimizer steps, in one process or as one rank of a parallel run; see the
    module docstring.

    model:         an ``nn.Module``, or a zero-argument builder (called after ``torch.manual_seed(cfg.seed)``;
        under a process group rank 0 builds the one-process model and every rank a meta copy that is
        sharded, then filled from it: :mod:`k3lab.parallel.materialize`).
    train_batches: callable ``step -> (input_ids [B, T], labels [B, T])`` (preferred: exact resume)
        or an iterable of such pairs (on resume it must start at the resumed step). Under ``parallel``
        it gives the *global* batch, the same on every rank; each rank keeps its part.
    val_batches:   callable or iterable for :func:`evaluate`, run every ``cfg.eval_every`` steps and
        at step ``cfg.steps``; the record of that step gets ``val_loss``.
    resume_from:   a checkpoint folder or a run folder (``out_dir`` with ``latest``): weights,
        optimizer, RNG states, step and history are restored; build the same model first. This run's
        schedule and optimizer hyperparameters (lr, betas, weight decay, ...) are used, and a warning
        names every changed setting (:data:`HONOURED_ON_RESUME`, :data:`DIFFERS_ON_RESUME`). A resume
        that would train no step (the checkpoint at or past ``cfg.steps`` or ``stop_at``) is refused
        (:func:`check_resume_steps`).
    stop_at:       end this call after that many steps (the schedule still spans ``cfg.steps``);
        a later ``fit(..., resume_from=out_dir)`` continues, as after an interruption.
    parallel:      a :class:`k3lab.parallel.parallelize.ParallelOptions`: run the parallel plan over the
        initialised default process group (torchrun; none = world size 1, where the plan is the
        one-process model). Checkpoints are then DCP (sharded) when the world size is above 1.
    on_step:       ``on_step(step, row)`` after each step (row: the step's metrics).
    data:          a name for the data source, recorded in checkpoints (a resume warns when it differs).

    ``cfg.param_dtype="bfloat16"`` casts the model's trainable floating parameters to bf16 in place at
    world size 1 (above it, FSDP2 computes in bf16 from fp32 sharded masters, or, with bf16 moments or split
    masters, keeps bf16 shards whose masters the optimizer holds: :func:`shard_masters`) and ``cfg.fused_loss=True``
    sets ``model.fused_loss``; both stay so after fit returns. A one-process resume must use the
    ``param_dtype`` the checkpoint was written with (ValueError otherwise).
    Raises :class:`TrainingDiverged` on a non-finite loss or gradient norm, before that step
    changes the weights (on every rank); the checkpoints already written are kept.
    """
    if stop_at is not None and (type(stop_at) is not int or stop_at < 1):
        raise ValueError(f"fit: stop_at={stop_at!r}: must be None or an int >= 1 (steps to run before stopping)")
    iterator = None if callable(train_batches) else iter(train_batches)
    first = _next_batch(train_batches, 0, iterator, "cpu") if callable(train_batches) else None
    if cfg.profile != "reference":
        world = torch.distributed.get_world_size() if parallel is not None and torch.distributed.is_initialized() else 1
        device_type = resolve_device(cfg.device).type
        ep, cp = (parallel.ep, parallel.cp) if world > 1 else (1, 1)
        cfg, chosen = resolve_profile(cfg, device_type, world, ep, cp)
        parallel, planned = resolve_ep_plan(cfg, parallel, device_type, world)
        chosen = chosen + planned
        if world == 1 or torch.distributed.get_rank() == 0:
            print(f"profile {cfg.profile}: " + (", ".join(chosen) if chosen else
                  f"nothing changed (on {device_type} the reference settings are the fastest measured)"
                  if device_type != "cuda" else "nothing changed (every field was set)"), flush=True)
    run = _setup(model, cfg, parallel, tuple(first[0].shape) if first is not None else None)
    model, device = run.model, run.device
    optimizer = make_optimizer(model, cfg)
    masters = None
    if cfg.param_dtype != "float32" and (not run.distributed or shard_masters(cfg)):  # fp32 masters of bf16 params
        optimizer = masters = MasterWeightOptimizer(model, optimizer, moment_dtype=cfg.moment_dtype,
                                                    master_format=cfg.master_format)
    step_fn = _Step(run, cfg, optimizer, masters)
    torch.manual_seed(cfg.seed)
    step, tokens, elapsed_before, history, checkpoint = 0, 0, 0.0, [], None
    if resume_from is not None:
        shape = tuple(first[0].shape) if first is not None else None
        state = _resume(run, resume_from, cfg, optimizer, masters, shape or (), data, stop_at)
        checkpoint = Path(state["path"])
        step, history = state["step"], state["history"]
        tokens, elapsed_before = state.get("tokens", 0), state.get("elapsed", 0.0)
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    out_dir = Path(cfg.out_dir) if cfg.out_dir is not None else None
    lead = run.rank == 0  # the rank that logs (files, progress bar)
    metrics_file = None
    if out_dir is not None and lead:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics_file = open(out_dir / "metrics.jsonl", "w")  # rewritten: history up to the resumed step
        metrics_file.writelines(json.dumps(r) + "\n" for r in history)

    def record(row: dict) -> None:
        history.append(row)
        if metrics_file is not None:
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()

    def result() -> TrainResult:
        return TrainResult(history=history, step=step, checkpoint=checkpoint,
                           elapsed=elapsed_before + time.perf_counter() - t0, info=_run_info(run))

    def save(meta: dict) -> Path:
        if run.distributed:
            from k3lab.parallel.checkpoint import save_distributed

            return save_distributed(out_dir, step, model, optimizer, meta, keep=cfg.keep_checkpoints,
                                    group=run.groups.world, local_shards=run.local_shards)
        return save_checkpoint(out_dir, model, optimizer, meta, keep=cfg.keep_checkpoints)

    tty = sys.stdout.isatty()  # a notebook's stdout is not: redraw at most once a second (fewer saved outputs)
    bar = tqdm(total=cfg.steps, initial=step, desc=cfg.name, disable=not cfg.progress or not lead, file=sys.stdout,
               dynamic_ncols=tty, mininterval=0.1 if tty else 1.0)
    heartbeat = _heartbeat(run)
    t0 = time.perf_counter()
    batch_shape = None
    failed = True
    try:
        while step < end:
            t_step = time.perf_counter()
            lr = set_lr(optimizer, step, cfg.steps, cfg.warmup, cfg.min_lr_ratio)
            x, y = (first if step == 0 and first is not None else _next_batch(train_batches, step, iterator, "cpu"))
            batch_shape = list(x.shape)
            loss, grad_norm, metrics = step_fn.forward_backward(x, y, step)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                raise TrainingDiverged(
                    f"non-finite {'gradient norm' if math.isfinite(loss) else 'loss'} (loss={loss}, "
                    f"grad_norm={grad_norm}) at step {step + 1}: training stopped before this update. "
                    f"Last good checkpoint: {checkpoint or 'none (no out_dir, or none saved yet)'}.",
                    result())
            step_fn.update()
            step += 1
            tokens += x.numel()
            now = time.perf_counter()
            row = dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=tokens,
                       elapsed=round(elapsed_before + now - t0, 4), step_time=round(now - t_step, 6), **metrics)
            if val_batches is not None and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
                row["val_loss"] = evaluate(model, val_batches, cfg.eval_batches, device, cfg.dtype, plan=run)
            if step % cfg.log_every == 0 or step == end or "val_loss" in row:
                record(row)
                bar.set_postfix({k: f"{row[k]:.4g}" for k in ("loss", "val_loss", "lr") if k in row}, refresh=False)
            bar.update(1)
            if on_step is not None:
                on_step(step, row)
            if out_dir is not None and (step == end or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
                meta = dict(step=step, tokens=tokens, elapsed=elapsed_before + time.perf_counter() - t0,
                            history=history, train_config=plain_config(cfg), batch_shape=batch_shape, data=data,
                            world_size=run.dims.world_size)
                checkpoint = save(meta)
            if heartbeat is not None:
                heartbeat.beat(step)
        failed = False
    except (TrainingDiverged, ValueError):
        raise
    except RuntimeError as err:  # a collective that failed or timed out: name the rank that stopped, if one did
        stalled = heartbeat.diagnose() if heartbeat is not None else None
        if stalled is None:
            raise
        raise RuntimeError(f"{stalled} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from err
    finally:
        if heartbeat is not None:
            heartbeat.close(failed=failed)
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
    return result()


def _is_dtensor(p) -> bool:
    return type(p).__name__ == "DTensor"


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``cfg``'s optimizer over ``model`` as :func:`fit` builds it (before any master-weight wrapping), for any
    layout. A foreach kernel takes one kind of tensor: where FSDP2's DTensor shards and plain tensors (EP expert
    slices, one-process parameters) mix, AdamW's groups are split by kind (:func:`_split_groups_by_kind`) and keep
    the multi-tensor path (stepping ~450 shards one by one cost 5-10x the step on an H200), Muon's step one by one.
    On CUDA, AdamW over DTensor shards is the fused one (``fused=True``; ``optimizer_kwargs`` may override it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kinds = {_is_dtensor(p) for p in params}
    mixed = len(kinds) > 1
    kwargs = dict(cfg.optimizer_kwargs)
    if cfg.optimizer == "adamw" and True in kinds and all(p.is_cuda for p in params):
        kwargs.setdefault("fused", True)  # one fused kernel per group on the local shards (DTensor runs it shard-wise)
    elif cfg.optimizer == "adamw" and True in kinds:
        # on a CPU torch steps one tensor at a time by default: over DTensor shards that is one DTensor dispatch per
        # op and tensor (tiny, N = 8, 2 CPU cores: 43 ms a step, against 5 ms with foreach)
        kwargs.setdefault("foreach", True)
    kwargs.setdefault("foreach", False if mixed and cfg.optimizer != "adamw" else None)
    optimizer = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
                                **kwargs)
    if mixed and type(optimizer) is torch.optim.AdamW:
        _split_groups_by_kind(optimizer)
    return optimizer


def _split_groups_by_kind(optimizer) -> None:
    """Each param group split in two, DTensor shards and plain tensors, with the same settings (before any step)."""
    groups = []
    for g in optimizer.param_groups:
        for kind in (True, False):
            params = [p for p in g["params"] if _is_dtensor(p) == kind]
            if params:
                groups.append({**g, "params": params})
    optimizer.param_groups[:] = groups


def _heartbeat(run: _Run):
    """Under a process group: this rank's heartbeat (:mod:`k3lab.parallel.heartbeat`); rank 0 watches the others and
    ends the run naming a rank silent for the run's timeout (NCCL: half of it, since NCCL ends a process at its own
    timeout without raising). None in one process."""
    if not run.distributed:
        return None
    from k3lab.parallel.heartbeat import Heartbeat, default_store

    heartbeat = Heartbeat(default_store(), run.rank, run.dims.world_size)
    if run.rank == 0:
        heartbeat.start_watchdog(run.parallel.timeout * (0.5 if run.device.type == "cuda" else 1.0))
    return heartbeat


class _Step:
    """One training step of a run: forward + backward + the gradient norm (one host sync), then the update.
    The same code at every world size; what the layout adds is marked ``run.distributed``."""

    def __init__(self, run: _Run, cfg: TrainConfig, optimizer, masters):
        self.run, self.cfg, self.optimizer, self.masters = run, cfg, optimizer, masters
        self.params = [p for p in run.model.parameters() if p.requires_grad]
        self.clip = cfg.grad_clip or math.inf
        self.graphed = self.graphed_update = None
        self.counts = None  # [2] int64 on the device: a captured sharded step's global label counts, refilled each step
        if cfg.cuda_graph:
            if masters is not None and not masters.kernel:
                raise ValueError("TrainConfig.cuda_graph=True with param_dtype='bfloat16' needs the fused master AdamW "
                                 f"step ({masters.why_not_fused()}); use cuda_graph=False")
            forward = None
            if run.distributed:  # FSDP's rank: its loss divides by the global batch's label counts, device tensors here
                from k3lab.model import LossShard

                self.counts = torch.zeros(2, dtype=torch.int64, device=run.device)
                shard = LossShard(self.counts[0], self.counts[1], run.dims.world_size)

                def forward(x, y):
                    return run.model(x, labels=y, shard=shard)
            self.graphed = GraphedForwardBackward(run.model, torch.bfloat16 if cfg.dtype == "bfloat16" else None,
                                                  after_backward=self.clip_grad_norm, forward=forward)
            if masters is not None:  # the fused AdamW and the after-step work (a rank's all-reduces too): a second graph
                self.graphed_update = GraphedOptimizerStep(run.model, masters, self.graphed,
                                                           self.reduce_max_logits if run.distributed else None)

    def clip_grad_norm(self):
        """The global gradient norm (a tensor; not read back here) and the clip."""
        run = self.run
        if run.distributed:
            from k3lab.parallel.fsdp import clip_grad_norm_, grad_norm, sum_expert_grads_

            sum_expert_grads_([p for p in self.params if p in run.experts], run.groups.edp)
            replicas = run.dims.world_size // run.dims.ep
            if self.masters is not None:  # masters on the local shards: the global norm, the clip inside the step
                norm = grad_norm(self.params, run.experts, replicas, run.groups.world)
                self.masters.clip_grad_norm_(self.clip, norm=norm)
                return norm
            return clip_grad_norm_(self.params, self.clip, run.experts, replicas, run.groups.world)
        if self.masters is not None:  # the masters' clip (fp32 grads, or the fused step's norm from bf16 grads)
            return self.masters.clip_grad_norm_(self.clip)
        return nn.utils.clip_grad_norm_(self.params, self.clip)

    def forward_backward(self, x, y, step: int) -> tuple[float, float, dict]:
        """Loss, gradient norm and the logged metrics, read back together (the step's one host sync, after
        backward: a non-finite loss gives non-finite gradients, and the caller stops before the update)."""
        run, model = self.run, self.run.model
        shard = None
        if run.distributed:
            from k3lab.parallel.parallelize import global_label_counts, local_batch, maybe_inject_fault

            maybe_inject_fault(run.rank, step)
            x, y, shard = local_batch(x, y, run.dims, run.rank, *global_label_counts(y), run.parallel.cp_layout)
            if shard.mtp_input_ids is not None:
                shard.mtp_input_ids = shard.mtp_input_ids.to(run.device, non_blocking=True)
                shard.mtp_labels = shard.mtp_labels.to(run.device, non_blocking=True)
        if run.device.type == "cuda" and not x.is_cuda:  # pinned (cached by torch): the copy does not wait for the GPU
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        if self.graphed is not None:  # eager for two steps, then captured once and replayed
            if self.masters is not None and self.graphed_update is not None:
                self.masters.sync_from_params()  # QK-Clip's eager rescale before a capture stays out of it
            if self.counts is not None:  # this batch's global label counts, where the captured loss reads them
                self.counts[0].fill_(shard.lm_tokens)
                self.counts[1].fill_(shard.mtp_tokens)
            out, norm = self.graphed(x, y)  # forward, backward, gradient norm (and clip coefficient)
            if self.graphed.captured and self.masters is not None and not self.masters.keep_grads:
                self.masters.keep_grads = True  # the replays write into the captured gradient tensors
        else:
            with autocast(run.device, self.cfg.dtype):
                out = model(x, labels=y) if shard is None else model(x, labels=y, shard=shard)
            if out.loss is None:
                raise ValueError("fit: model(input_ids, labels=...) returned loss=None")
            out.loss.backward()
            norm = self.clip_grad_norm()
        values = {**_metric_values(out), " loss": out.loss.float()}
        if run.distributed:  # each rank's loss and metrics are its shares of the global batch's: their sum
            values = _all_reduce_sum(values, run.groups.world, run.device)
        metrics = _host_floats({**values, " grad_norm": norm})
        return metrics.pop(" loss"), metrics.pop(" grad_norm"), metrics

    def update(self) -> None:
        """The optimizer step and the model's after-step work (balancers, QK-Clip from the MAX-reduced logits)."""
        run, model = self.run, self.run.model
        if self.graphed_update is not None and self.graphed.captured:  # AdamW + balancers + QK-Clip: one replay
            self.graphed_update()
            return
        self.optimizer.step()
        if self.graphed is None or not self.graphed.captured:  # a replay overwrites the captured gradients itself
            self.optimizer.zero_grad(set_to_none=True)
        if run.distributed:
            self.reduce_max_logits()
        if hasattr(model, "after_optimizer_step"):
            model.after_optimizer_step()

    def reduce_max_logits(self) -> None:
        """QK-Clip's max logits over the global batch (MAX over the ranks), before the after-step work reads them."""
        from k3lab.parallel.parallelize import reduce_max_logits_

        reduce_max_logits_(self.run.model, self.run.groups.world)


def _all_reduce_sum(values: dict, group, device) -> dict:
    """``{name: 0-d tensor | number}`` summed over the ranks in one all-reduce."""
    import torch.distributed as dist

    names = list(values)
    flat = torch.stack([torch.as_tensor(values[k], dtype=torch.float64, device=device).detach().reshape(())
                        for k in names])
    dist.all_reduce(flat, group=group)
    return dict(zip(names, flat.unbind()))


def _run_info(run: _Run) -> dict:
    """What the layout was and what the experts saw: world size, dims, the MoE dispatchers that ran, per-MoE-layer
    loads and EP slots."""
    import dataclasses

    from k3lab.moe.latent import LatentMoE

    moes = [m for m in run.model.modules() if isinstance(m, LatentMoE)]
    slots = [getattr(m.dispatcher, "last_slots_per_rank", None) for m in moes if hasattr(m, "dispatcher")]
    peak = torch.cuda.max_memory_allocated(run.device) / 2**30 if run.device.type == "cuda" else None
    return dict(world_size=run.dims.world_size, dims=dataclasses.asdict(run.dims), device=str(run.device),
                ep_kind=getattr(run.parallel, "ep_kind", None), ep_plan=getattr(run.parallel, "ep_plan", None),
                dispatchers=sorted({type(m.dispatcher).__name__ for m in moes}), peak_mem_gib=peak,
                expert_loads=[m.balancer.metrics()["load"].tolist() for m in moes],
                slots_per_rank=[[int(v) for v in s.tolist()] for s in slots if s is not None])
