"""The distributed training loop: the one-process loop of :mod:`k3lab.train`, on every rank of a
dp_shard × cp run with expert parallelism borrowed from those ranks.

Per step ``s`` every rank draws the same *global* batch ``batches(s) -> (x, y) [B, T]`` (cheap,
deterministic) and keeps its part: rows ``dp·B/dp_shard ..`` and, under context parallelism, the
sequence slice of its CP rank. Each rank's loss is its share of the global loss (CE summed over
its tokens divided by the global count of valid labels, :class:`k3lab.model.LossShard`), so the
ranks' gradients add up to the one-process gradient (FSDP2 sums them; EP expert slices are summed
over their replicas). Then: global grad-norm clip, optimizer step, QK-Clip on the MAX-reduced
logits, balancer updates from all-reduced statistics — every rank ends the step with the weights
and router biases one process would have, up to fp32 summation order.

World size 1 without torchrun runs the same code with no process group, no sharding and the
model's own mean loss: the losses equal :func:`k3lab.train.fit`'s.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm  # text bar on stdout, as k3lab.train.fit (a saved notebook keeps its finished state)

from k3lab.backend import resolve_device
from k3lab.config import ModelConfig
from k3lab.model import IGNORE_INDEX, K3ForCausalLM, LossShard
from k3lab.moe.latent import LatentMoE
from k3lab.optim import build_optimizer, set_lr
from k3lab.parallel.dims import DEFAULT_TIMEOUT_S, ParallelDims, init_groups, init_process_group_from_env
from k3lab.parallel.fsdp import clip_grad_norm_, sum_expert_grads_
from k3lab.parallel.materialize import materialize_from_rank0
from k3lab.parallel.parallelize import expert_parameters, parallelize, reduce_max_logits_
from k3lab.train import TrainConfig, _autocast

FAULT_ENV = "K3LAB_FAULT_RANK_STEP"  # "R:S": rank R exits at step S (tests of the no-hang guarantee)


@dataclass
class ParallelOptions:
    """How the run is split; validated by :class:`~k3lab.parallel.dims.ParallelDims` and the layers."""

    dp_shard: int = -1                 # -1: world_size / cp
    cp: int = 1
    ep: int = 1
    ep_kind: str = "moonep"            # "moonep" | "ep" (k3lab.parallel.expert.EP_KINDS)
    cp_layout: str = "contiguous"      # k3lab.parallel.context.CP_LAYOUTS
    activation_checkpointing: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S


def local_batch(x: torch.Tensor, y: torch.Tensor, dims: ParallelDims, rank: int, lm_tokens: int,
                mtp_tokens: int, cp_layout: str = "contiguous") -> tuple[torch.Tensor, torch.Tensor, LossShard]:
    """This rank's rows and sequence part(s) of the global batch ``[B, T]``, and its LossShard.

    Under context parallelism the shard also carries, for each local position, the global batch's
    next token and next label (MTP); the last position of the sequence gets a pad labelled -100."""
    at = dims.coords(rank)
    B, T = x.shape
    rows = slice(at["dp_shard"] * B // dims.dp_shard, (at["dp_shard"] + 1) * B // dims.dp_shard)
    x, y = x[rows], y[rows]
    if dims.cp == 1:
        return x, y, LossShard(lm_tokens, mtp_tokens, dims.world_size)
    from k3lab.parallel.context import CPContext

    pos = CPContext(group=None, rank=at["cp"], world=dims.cp, layout=cp_layout).positions(T // dims.cp)  # [T_local]
    ahead = (pos + 1).clamp_max(T - 1)
    last = (pos == T - 1)[None, :]                                                                      # [1, T_local]
    mtp_x = x[:, ahead].masked_fill(last, 0)
    mtp_y = y[:, ahead].masked_fill(last, IGNORE_INDEX)
    return x[:, pos], y[:, pos], LossShard(lm_tokens, mtp_tokens, dims.world_size, mtp_x, mtp_y)


def _maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{rank}:{step}":
        os._exit(17)


def _expert_loads(model: nn.Module) -> list[list[int]]:
    """Per MoE layer: token slots each expert got in the last step (global, all-reduced)."""
    return [m.balancer.metrics()["load"].tolist() for m in model.modules() if isinstance(m, LatentMoE)]


def _slots_per_rank(model: nn.Module) -> list[list[int]]:
    """Per MoE layer: token slots each EP rank computed in the last forward (EP dispatchers only)."""
    out = []
    for m in model.modules():
        slots = getattr(getattr(m, "dispatcher", None), "last_slots_per_rank", None)
        if isinstance(m, LatentMoE) and slots is not None:
            out.append([int(v) for v in slots.tolist()])
    return out


def _expert_layout(model: nn.Module, experts: set, groups) -> dict | None:
    """EP expert slices as DCP must see them: ``Shard(0)`` (experts) over "ep", replicated over "edp"."""
    if not experts:
        return None
    from torch.distributed.tensor import Replicate, Shard

    return {name: (groups.expert_mesh, [Replicate(), Shard(0)]) for name, p in model.named_parameters()
            if p in experts}


def train_parallel(model_cfg: ModelConfig, train_cfg: TrainConfig, opts: ParallelOptions, batches,
                   resume_from: str | None = None, stop_at: int | None = None, on_step=None) -> dict:
    """Train ``K3ForCausalLM(model_cfg)`` (built with ``torch.manual_seed(train_cfg.seed)``) on
    ``batches(step) -> (x, y)`` global batches; returns the metrics dict (rank 0's view; every rank
    returns the same losses). Checkpoints (DCP) go to ``train_cfg.out_dir`` every
    ``train_cfg.checkpoint_every`` steps and at the end. ``on_step(step, loss)`` is called after each step."""
    device = resolve_device(train_cfg.device)
    started = False
    if not dist.is_initialized():
        started = init_process_group_from_env(device.type, opts.timeout_s)
    try:
        return _train(model_cfg, train_cfg, opts, batches, device, resume_from, stop_at, on_step)
    finally:
        if started:
            dist.destroy_process_group()


# TrainConfig fields the distributed trainer does not run (field -> (the value it runs, what to use instead))
UNSUPPORTED_TRAIN_FIELDS = {
    "compile": ("none", "it runs eager"),
    "recompute": ("none", "use ParallelOptions.activation_checkpointing (per sublayer)"),
    "param_dtype": ("float32", "bf16 weights with fp32 masters are k3lab.train.fit's (k3lab.precision); "
                               "FSDP2's MixedPrecisionPolicy is the distributed counterpart, not wired here yet"),
    "cuda_graph": (False, "the distributed step runs eager (its collectives are not captured)"),
    "moment_dtype": ("float32", "bf16 AdamW moments are the fused master-weight step of k3lab.train.fit"),
    "master_format": ("float32", "split masters are the fused master-weight step of k3lab.train.fit"),
}


def check_train_config(train_cfg: TrainConfig) -> None:
    """ValueError naming each TrainConfig field set to a value the distributed trainer would not honour
    (:data:`UNSUPPORTED_TRAIN_FIELDS`): nothing is silently ignored."""
    for name, (runs, instead) in UNSUPPORTED_TRAIN_FIELDS.items():
        value = getattr(train_cfg, name)
        if value != runs:
            raise ValueError(f"TrainConfig.{name}={value!r}: the distributed trainer (k3lab.parallel) runs only "
                             f"{name}={runs!r}; {instead}")


def _train(model_cfg, train_cfg, opts, batches, device, resume_from, stop_at, on_step) -> dict:
    check_train_config(train_cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims(world, dp_shard=opts.dp_shard, cp=opts.cp, ep=opts.ep)
    x0, _ = batches(0)
    dims.check_model(model_cfg, x0.shape[0], x0.shape[1])
    groups = init_groups(dims, device.type, opts.timeout_s)
    rank, distributed = groups.rank, groups.world is not None and dims.world_size > 1

    torch.manual_seed(train_cfg.seed)
    if not distributed:
        model = K3ForCausalLM(model_cfg)
    else:  # meta on every rank; rank 0's seeded one-process model fills the shards (materialize.py)
        source = K3ForCausalLM(model_cfg) if rank == 0 else None
        with torch.device("meta"):
            model = K3ForCausalLM(model_cfg)
    model, experts = parallelize(model, groups, device, ep_kind=opts.ep_kind, cp_layout=opts.cp_layout,
                                 activation_checkpointing=opts.activation_checkpointing)
    if distributed:
        model.to_empty(device=device)
        materialize_from_rank0(model, source, device, groups.world)
        del source
        if experts:  # to_empty made new Parameter objects for the (unsharded) expert slices
            experts = set(expert_parameters(model))
    model.fused_loss = train_cfg.fused_loss  # the chunked linear cross-entropy (k3lab.losses), per rank
    model.train()
    optimizer = build_optimizer(model, train_cfg.optimizer, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
                                betas=train_cfg.betas, foreach=False if distributed else None,
                                **train_cfg.optimizer_kwargs)
    torch.manual_seed(train_cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    local_shards = _expert_layout(model, experts, groups)
    step, history = 0, []
    if resume_from is not None:
        from k3lab.parallel.checkpoint import load_distributed

        extra = load_distributed(resume_from, model, optimizer, local_shards=local_shards)
        step, history = extra["step"], extra["history"]
    end = train_cfg.steps if stop_at is None else min(train_cfg.steps, stop_at)
    bar = tqdm(total=train_cfg.steps, initial=step, desc=train_cfg.name, file=sys.stdout,
               disable=not train_cfg.progress or rank != 0, dynamic_ncols=sys.stdout.isatty(),
               mininterval=0.1 if sys.stdout.isatty() else 1.0)
    t_start, tokens_timed, t_timed = time.perf_counter(), 0, 0.0
    try:
        while step < end:
            _maybe_fault(rank, step)
            t0 = time.perf_counter()
            lr = set_lr(optimizer, step, train_cfg.steps, train_cfg.warmup, train_cfg.min_lr_ratio)
            x, y = batches(step)
            if distributed:
                lm_n, mtp_n = int((y != IGNORE_INDEX).sum()), int((y[:, 1:] != IGNORE_INDEX).sum())
                xs, ys, shard = local_batch(x, y, dims, rank, lm_n, mtp_n, opts.cp_layout)
                if shard.mtp_input_ids is not None:
                    shard.mtp_input_ids, shard.mtp_labels = shard.mtp_input_ids.to(device), shard.mtp_labels.to(device)
            else:
                xs, ys, shard = x, y, None
            with _autocast(device, train_cfg.dtype):
                out = model(xs.to(device), labels=ys.to(device), shard=shard)
            out.loss.backward()
            loss_t = out.loss.detach().float()
            if distributed:
                dist.all_reduce(loss_t, group=groups.world)
                sum_expert_grads_([p for p in params if p in experts], groups.edp)
                grad_norm = clip_grad_norm_(params, train_cfg.grad_clip or math.inf, experts,
                                            dims.world_size // dims.ep, groups.world)
            else:
                grad_norm = float(nn.utils.clip_grad_norm_(params, train_cfg.grad_clip or math.inf))
            loss = float(loss_t)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise RuntimeError(f"non-finite loss={loss} or grad_norm={grad_norm} at step {step + 1}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            reduce_max_logits_(model, groups.world)
            model.after_optimizer_step()
            step += 1
            dt = time.perf_counter() - t0
            if step > 1:  # the first step compiles / warms up
                tokens_timed, t_timed = tokens_timed + x.numel(), t_timed + dt
            history.append(dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm, step_time=dt))
            bar.set_postfix(loss=f"{loss:.4g}")
            bar.update(1)
            if on_step is not None:
                on_step(step, loss)
            if train_cfg.out_dir is not None and (step == end or (train_cfg.checkpoint_every
                                                                  and step % train_cfg.checkpoint_every == 0)):
                from k3lab.parallel.checkpoint import save_distributed

                save_distributed(train_cfg.out_dir, step, model, optimizer,
                                 dict(step=step, history=history, world_size=dims.world_size,
                                      dims=dataclasses.asdict(dims)), keep=train_cfg.keep_checkpoints,
                                 local_shards=local_shards)
    finally:
        bar.close()
    return dict(world_size=dims.world_size, dims=dataclasses.asdict(dims), ep_kind=opts.ep_kind,
                losses=[r["loss"] for r in history], grad_norms=[r["grad_norm"] for r in history],
                step_times=[r["step_time"] for r in history],
                tokens_per_s=tokens_timed / t_timed if t_timed > 0 else None,
                elapsed=time.perf_counter() - t_start, expert_loads=_expert_loads(model),
                slots_per_rank=_slots_per_rank(model), step=step, device=str(device))
