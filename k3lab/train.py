"""The k3lab training loop: one process, any causal LM, exact resume, never unpickles.

    result = fit(model, batch_iterator(train_ids, 16, 128), TrainConfig(steps=200), val_batches=...)

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
``p ← bf16(master)``. ``fused_loss=True`` sets the model's ``fused_loss`` (K3: the chunked linear
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
from k3lab.checkpoint import (CHECKPOINT_FORMAT, _plain_config, _set_rng_state,  # noqa: F401 (re-exported)
                              load_checkpoint, resolve_checkpoint, save_checkpoint)
from k3lab.compile import COMPILE_MODES, compile_model
from k3lab.cuda_graph import GraphedForwardBackward, GraphedOptimizerStep
from k3lab.memory import LAYERED_MODES, RECOMPUTE_MODES, apply_recompute
from k3lab.optim import build_optimizer, set_lr
from k3lab.precision import MASTER_FORMATS, MOMENT_DTYPES, PARAM_DTYPES, MasterWeightOptimizer, cast_params_

OPTIMIZERS = ("adamw", "muon")
DTYPES = ("float32", "bfloat16")
# (dtype, param_dtype) pairs fit runs: bf16 parameters need bf16 autocast (fp32 inputs would meet bf16 weights)
PRECISIONS = (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"))
# fields whose change alters the trajectory of a resumed run (a warning names them)
TRAJECTORY_FIELDS = ("steps", "lr", "min_lr_ratio", "warmup_steps", "warmup_frac", "weight_decay", "betas",
                     "grad_clip", "optimizer", "optimizer_kwargs", "seed", "dtype", "param_dtype", "moment_dtype",
                     "master_format")


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
                                              # AdamW and the fused step (CUDA): 4 bytes a parameter less
    master_format: str = "float32"            # MASTER_FORMATS: how the fp32 masters are kept; "split" = the bf16
                                              # param is the master's high half, an int16 tensor the rest (exact;
                                              # k3lab.precision): needs param_dtype="bfloat16", AdamW and the fused
                                              # step (CUDA): 2 bytes a parameter less
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

    def __post_init__(self):
        def need(ok: bool, name: str, rule: str):
            if not ok:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: {rule}")

        for name in ("steps", "eval_batches", "log_every", "keep_checkpoints"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an int >= 1")
        for name in ("eval_every", "checkpoint_every", "seed"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, name, "must be an int >= 0")
        need(self.lr > 0, "lr", "must be > 0")
        need(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        need(self.warmup_steps is None or (isinstance(self.warmup_steps, int)
                                           and 0 <= self.warmup_steps <= self.steps),
             "warmup_steps", f"must be None or an int in [0, steps={self.steps}]")
        need(0.0 <= self.warmup_frac <= 1.0, "warmup_frac", "must be in [0, 1]")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "betas",
             "must be two numbers in [0, 1)")
        need(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 = no clipping)")
        need(self.optimizer in OPTIMIZERS, "optimizer", f"allowed values are {OPTIMIZERS}")
        need(isinstance(self.optimizer_kwargs, dict), "optimizer_kwargs", "must be a dict")
        need(self.dtype in DTYPES, "dtype", f"allowed values are {DTYPES}")
        need(self.param_dtype in PARAM_DTYPES, "param_dtype", f"allowed values are {PARAM_DTYPES}")
        need((self.dtype, self.param_dtype) in PRECISIONS, "param_dtype",
             f"needs TrainConfig.dtype='bfloat16' (bf16 autocast), got TrainConfig.dtype={self.dtype!r}; "
             f"allowed (dtype, param_dtype) combinations are {PRECISIONS}")
        need(self.moment_dtype in MOMENT_DTYPES, "moment_dtype", f"allowed values are {MOMENT_DTYPES}")
        need(self.moment_dtype == "float32" or (self.param_dtype == "bfloat16" and self.optimizer == "adamw"),
             "moment_dtype", "'bfloat16' needs TrainConfig.param_dtype='bfloat16' and optimizer='adamw' (the fused "
             f"master-weight AdamW step keeps them), got param_dtype={self.param_dtype!r}, optimizer={self.optimizer!r}")
        need(self.master_format in MASTER_FORMATS, "master_format", f"allowed values are {MASTER_FORMATS}")
        need(self.master_format == "float32" or (self.param_dtype == "bfloat16" and self.optimizer == "adamw"),
             "master_format", "'split' needs TrainConfig.param_dtype='bfloat16' and optimizer='adamw' (the fused "
             f"master-weight AdamW step splits the masters), got param_dtype={self.param_dtype!r}, "
             f"optimizer={self.optimizer!r}")
        need(isinstance(self.fused_loss, bool), "fused_loss", "must be a bool")
        need(self.compile in COMPILE_MODES, "compile", f"allowed values are {COMPILE_MODES}")
        need(isinstance(self.cuda_graph, bool), "cuda_graph", "must be a bool")
        need(not self.cuda_graph or self.param_dtype == "float32" or self.optimizer == "adamw", "cuda_graph",
             "with param_dtype='bfloat16' needs optimizer='adamw' (the fused master step keeps the captured "
             f"gradients; the unfused master path frees them), got optimizer={self.optimizer!r}")
        need(self.recompute in RECOMPUTE_MODES, "recompute", f"allowed values are {RECOMPUTE_MODES}")
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
    """What :func:`fit` returns: the metric history (one dict per logged step), the number of
    optimizer steps done, the newest checkpoint folder (None without ``out_dir``), wall seconds."""

    history: list[dict]
    step: int
    checkpoint: Path | None
    elapsed: float

    def column(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the records that have it, e.g. ``column("val_loss")``."""
        rows = [r for r in self.history if key in r]
        return [r["step"] for r in rows], [r[key] for r in rows]


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


def _autocast(device: torch.device, dtype: str):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


@torch.no_grad()
def evaluate(model: nn.Module, batches, num_batches: int = 8, device: str | torch.device = "cpu",
             dtype: str = "float32") -> float:
    """Mean language-modelling loss over the first ``num_batches`` batches, in eval mode: the
    model's ``metrics["lm_loss"]`` when it reports one (K3: CE without the MTP/MoE terms), else ``loss``.

    ``batches``: a callable ``i -> (x, y)`` (batches 0..num_batches-1, the same every time) or an
    iterable (a fresh ``iter()`` each call: a list gives the same batches each time, a generator
    continues where it stopped; fewer batches than ``num_batches`` is fine).
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
        with _autocast(device, dtype):
            out = model(x.to(device), labels=y.to(device))
        losses.append(float(out.metrics.get("lm_loss", out.loss)))
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


def _saved_train_config(resume_from: str | os.PathLike) -> dict:
    """The TrainConfig a checkpoint was written with (state.json), fields it predates at their defaults."""
    saved = json.loads((resolve_checkpoint(resume_from) / "state.json").read_text()).get("train_config") or {}
    return {**_plain_config(TrainConfig()), **saved}


def fit(model: nn.Module, train_batches, cfg: TrainConfig, val_batches=None,
        resume_from: str | os.PathLike | None = None, stop_at: int | None = None) -> TrainResult:
    """Train ``model`` for ``cfg.steps`` optimizer steps; see the module docstring.

    train_batches: callable ``step -> (input_ids [B, T], labels [B, T])`` (preferred: exact resume)
        or an iterable of such pairs (on resume it must start at the resumed step).
    val_batches:   callable or iterable for :func:`evaluate`, run every ``cfg.eval_every`` steps and
        at step ``cfg.steps``; the record of that step gets ``val_loss``.
    resume_from:   a checkpoint folder or a run folder (``out_dir`` with ``latest``): weights,
        optimizer, RNG states, step and history are restored; build the same model first.
    stop_at:       end this call after that many steps (the schedule still spans ``cfg.steps``);
        a later ``fit(..., resume_from=out_dir)`` continues, as after an interruption.
    ``cfg.param_dtype="bfloat16"`` casts the model's trainable floating parameters to bf16 in place
    and ``cfg.fused_loss=True`` sets ``model.fused_loss``; both stay so after fit returns. A resume
    must use the ``param_dtype`` the checkpoint was written with (ValueError otherwise); it may change
    ``master_format`` (the masters are saved as fp32 in either format; a warning names the changed field).
    Raises :class:`TrainingDiverged` on a non-finite loss or gradient norm, before that step
    changes the weights; the checkpoints already written are kept.
    """
    device = resolve_device(cfg.device)
    if cfg.fused_loss:
        if not hasattr(model, "fused_loss"):
            raise ValueError(f"TrainConfig.fused_loss=True: {type(model).__name__} has no fused_loss attribute "
                             "(K3ForCausalLM has); use fused_loss=False for this model")
        model.fused_loss = True
    model.to(device).train()
    if cfg.param_dtype != "float32":
        cast_params_(model, cfg.param_dtype)  # trainable floating params only; buffers stay as the model made them
    apply_recompute(model, cfg.recompute, cfg.recompute_layers)  # before compiling: the checkpoint wrappers are traced too
    compile_model(model, cfg.compile)  # "sublayer": torch.compile each mixer and MLP in place (same state_dict)
    optimizer = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                betas=cfg.betas, **cfg.optimizer_kwargs)
    masters = None
    if cfg.param_dtype != "float32":  # step fp32 masters of the parameters (set_lr and checkpoints see its groups, state)
        optimizer = masters = MasterWeightOptimizer(model, optimizer, moment_dtype=cfg.moment_dtype,
                                                    master_format=cfg.master_format)
    clip = cfg.grad_clip or math.inf

    def clip_grad_norm():  # param_dtype="bfloat16": the masters' clip (fp32 grads, or the fused step's norm from bf16 grads)
        return nn.utils.clip_grad_norm_(model.parameters(), clip) if masters is None else masters.clip_grad_norm_(clip)

    graphed = graphed_update = None
    if cfg.cuda_graph:
        if masters is not None and not masters.fused:
            raise ValueError("TrainConfig.cuda_graph=True with param_dtype='bfloat16' needs the fused master AdamW "
                             f"step ({masters._why_not_fused()}); use cuda_graph=False")
        graphed = GraphedForwardBackward(model, torch.bfloat16 if cfg.dtype == "bfloat16" else None,
                                         after_backward=clip_grad_norm)
        if masters is not None:  # the fused AdamW and the model's after-step work: a second graph
            graphed_update = GraphedOptimizerStep(model, masters, graphed)
    torch.manual_seed(cfg.seed)
    step, tokens, elapsed_before, history, checkpoint = 0, 0, 0.0, [], None
    if resume_from is not None:
        saved_cfg = _saved_train_config(resume_from)
        if saved_cfg["param_dtype"] != cfg.param_dtype:
            raise ValueError(f"TrainConfig.param_dtype={cfg.param_dtype!r}: the checkpoint at {resume_from} was "
                             f"trained with param_dtype={saved_cfg['param_dtype']!r}; resume with that value "
                             "(the fp32 master weights exist only in a param_dtype='bfloat16' run)")
        state = load_checkpoint(resume_from, model, optimizer)
        checkpoint, plain_cfg = Path(state["path"]), _plain_config(cfg)
        changed = [k for k in TRAJECTORY_FIELDS if json.dumps(saved_cfg.get(k)) != json.dumps(plain_cfg[k])]
        if changed:
            warnings.warn(f"resuming {state['path']} with changed TrainConfig fields {changed}: "
                          "the run will not match an uninterrupted one")
        step, tokens, elapsed_before, history = state["step"], state["tokens"], state["elapsed"], state["history"]
        _set_rng_state(load_file(str(Path(state["path"]) / "rng.safetensors")), state["rng"])
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    out_dir = Path(cfg.out_dir) if cfg.out_dir is not None else None
    metrics_file = None
    if out_dir is not None:
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
                           elapsed=elapsed_before + time.perf_counter() - t0)

    iterator = None if callable(train_batches) else iter(train_batches)
    tty = sys.stdout.isatty()  # a notebook's stdout is not: redraw at most once a second (fewer saved outputs)
    bar = tqdm(total=cfg.steps, initial=step, desc=cfg.name, disable=not cfg.progress, file=sys.stdout,
               dynamic_ncols=tty, mininterval=0.1 if tty else 1.0)
    t0 = time.perf_counter()
    try:
        while step < end:
            lr = set_lr(optimizer, step, cfg.steps, cfg.warmup, cfg.min_lr_ratio)
            x, y = _next_batch(train_batches, step, iterator, device)
            # backward before reading anything back: the step's one host sync comes after it (a non-finite
            # loss gives non-finite gradients, and the check below stops the run before they are applied)
            if graphed is not None:  # eager for two steps, then captured once and replayed
                if masters is not None:
                    masters.sync_from_params()  # QK-Clip's eager rescale before a capture stays out of it
                out, norm = graphed(x, y)  # forward, backward, gradient norm (and clip coefficient)
                if graphed.captured and masters is not None and not masters.keep_grads:
                    masters.keep_grads = True  # the replays write into the captured gradient tensors
            else:
                with _autocast(device, cfg.dtype):
                    out = model(x, labels=y)
                if out.loss is None:
                    raise ValueError("fit: model(input_ids, labels=...) returned loss=None")
                out.loss.backward()
                norm = clip_grad_norm()
            metrics = _host_floats({**_metric_values(out), " loss": out.loss.float(), " grad_norm": norm})
            loss, grad_norm = metrics.pop(" loss"), metrics.pop(" grad_norm")
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                raise TrainingDiverged(
                    f"non-finite {'gradient norm' if math.isfinite(loss) else 'loss'} (loss={loss}, "
                    f"grad_norm={grad_norm}) at step {step + 1}: training stopped before this update. "
                    f"Last good checkpoint: {checkpoint or 'none (no out_dir, or none saved yet)'}.",
                    result())
            if graphed_update is not None and graphed.captured:  # AdamW + balancers + QK-Clip: one graph replay
                graphed_update()
            else:
                optimizer.step()
                if graphed is None or not graphed.captured:  # a replay overwrites the captured gradients itself
                    optimizer.zero_grad(set_to_none=True)
                if hasattr(model, "after_optimizer_step"):
                    model.after_optimizer_step()
            step += 1
            tokens += x.numel()
            row = dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=tokens,
                       elapsed=round(elapsed_before + time.perf_counter() - t0, 4), **metrics)
            if val_batches is not None and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
                row["val_loss"] = evaluate(model, val_batches, cfg.eval_batches, device, cfg.dtype)
            if step % cfg.log_every == 0 or step == end or "val_loss" in row:
                record(row)
                bar.set_postfix({k: f"{row[k]:.4g}" for k in ("loss", "val_loss", "lr") if k in row}, refresh=False)
            bar.update(1)
            if out_dir is not None and (step == end or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
                meta = dict(step=step, tokens=tokens, elapsed=elapsed_before + time.perf_counter() - t0,
                            history=history, train_config=_plain_config(cfg))
                checkpoint = save_checkpoint(out_dir, model, optimizer, meta, keep=cfg.keep_checkpoints)
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
    return result()
