"""A training step as two CUDA graphs (``TrainConfig(cuda_graph=True)``): forward + backward + gradient norm,
then the optimizer update.

A compiled ``small`` step launches about 5,000 kernels from Python: compiled graphs, the KDA op, the
grouped expert GEMMs, the AttnRes mixes, the residual adds. The GPU finishes many of them faster than
the host issues them, so it idles between them. Captured once as a CUDA graph, the whole forward and
backward is one ``graph.replay()``: the same kernels on the same addresses, no Python, no dispatcher,
no launch gaps.

    step = GraphedForwardBackward(model, autocast_dtype=torch.bfloat16, after_backward=clip_norm)
    update = GraphedOptimizerStep(model, master_optimizer, step)
    out, norm = step(x, y)  # steps 1, 2, ...: eager forward + backward, then capture; later: replay
    out.loss, p.grad, norm  # valid after each call (the same tensors every replay)
    ...                     # read the loss and the norm back (the step's one host sync), check them
    update()                # once step is captured: AdamW + the model's after-step work, captured, then replayed

Between the two graphs the host reads the loss and the norm and stops a diverged run before the update,
as the eager loop does; the GPU waits only for that read and the second graph's launch. The update's
step-dependent scalars (learning rate, bias corrections) are written by the host into device buffers before
each replay (:class:`k3lab.kernels.adamw.AdamWLaunch`).

What a replay needs, and what this module checks or arranges:

* **Static addresses.** The batch is copied into fixed input buffers; the outputs (loss, metrics, norm) and
  the parameters' gradients are the tensors allocated during capture, overwritten by each replay. So the
  gradients must not be freed or replaced between steps: :meth:`GraphedForwardBackward.__call__` needs
  every ``.grad`` to be None before the capture, and afterwards the optimizer must leave them in place
  (``MasterWeightOptimizer.keep_grads``: it then also keeps its kernel launches, whose address tables the
  update graph replays; fit skips ``zero_grad``). The captured backward *assigns* the gradients (they were
  None when it was recorded), so nothing needs zeroing.
* **No host work inside.** Nothing in the captured forward or backward may read a value back to the host
  (a ``.item()``, a ``nonzero``): capture fails with CUDA's error if it does. k3lab's MoE, balancers (but
  ``quantile_exact``, refused: it keeps a Python list of the step's margins), losses and KDA op are sync-free.
  Python-side state changed in a forward happens once, at capture; tensors changed in place (the balancer's
  load and histogram, QK-Clip's max logits) are updated on every replay, and that is all the model keeps.
* **Shapes fixed.** Every batch must have the capture's shape (ValueError otherwise).
* **Autocast without its weight cache** (``cache_enabled=False``), as CUDA graph capture requires.
* **One side stream** for the eager steps, the capture and the replays (ordered against the caller's
  stream both ways): autograd's gradient accumulators remember the stream they were made on, and one
  made on the default stream would make the captured backward wait on it, which capture forbids.

* **A sharded rank** (FSDP2 alone, world size > 1) passes ``forward`` (its model call with the
  :class:`~k3lab.model.LossShard`, whose global label counts are device tensors that ``fit`` refills before
  each replay). FSDP2's all-gathers, reduce-scatters and side-stream waits are recorded in the capture. Its
  update is a graph too: ``before_after_step`` records the rank's QK-Clip max all-reduce before the balancers'
  update, whose own all-reduces are recorded with it (eager, it was ~650 launches a step outside the graph: a
  profile of a fake rank of 8 on one H100, 2026-12-07, ``docs/scaling.md`` section 4g). Expert parallelism is captured with MoonEP planned on
  the device and a capturable exchange (:mod:`k3lab.parallel.expert_static`); the host-planned dispatcher reads its
  all-to-all sizes on the host and cannot be.

The first ``warmup`` calls run eagerly (compilation and the libraries' lazy initialisation happen
there, outside the capture); the next call captures and replays. Each call is one training step: the
eager ones and the replays compute the same numbers (tested on the GPU).
"""
from __future__ import annotations

import gc
from typing import Callable

import torch
from torch import nn

Tensor = torch.Tensor
WARMUP_CALLS = 2  # eager steps before the capture: the first compiles, the second runs what was compiled


class GraphedForwardBackward:
    """``model(x, labels=y)``, ``loss.backward()`` and ``after_backward()`` (the gradient norm) as one CUDA graph
    after ``warmup`` eager calls."""

    def __init__(self, model: nn.Module, autocast_dtype: torch.dtype | None = torch.bfloat16,
                 warmup: int = WARMUP_CALLS, after_backward=None, forward=None):
        for module in model.modules():
            balancer = getattr(module, "balancer", None)
            if getattr(balancer, "exact", False):
                raise ValueError("TrainConfig.cuda_graph=True: the 'quantile_exact' balancer keeps a Python list of "
                                 "the step's margins, which a replayed graph would not extend; use balancer="
                                 "'quantile_hist' (K3's) or cuda_graph=False")
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"TrainConfig.cuda_graph=True needs a CUDA device, the model is on {device} "
                             "(use cuda_graph=False)")
        for module in model.modules():  # the padded experts' capacity fixed at S from the first (eager) step on
            if hasattr(module, "static_capacity"):
                module.static_capacity = True
        self.model, self.autocast_dtype, self.warmup = model, autocast_dtype, warmup
        self.after_backward = after_backward  # () -> tensor, run after backward (the gradient norm and clip), captured too
        # (x, y) -> the model's output with its loss; default model(x, labels=y) (a sharded rank also passes its shard)
        self.forward = forward if forward is not None else (lambda x, y: model(x, labels=y))
        self.calls = 0
        self.stream = torch.cuda.Stream(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple[Tensor, Tensor] | None = None
        self.out = self.after = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _forward_backward(self, x: Tensor, y: Tensor):
        with torch.autocast("cuda", dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None, cache_enabled=False):
            out = self.forward(x, y)
        if out.loss is None:
            raise ValueError("fit: model(input_ids, labels=...) returned loss=None")
        out.loss.backward()
        return out, (None if self.after_backward is None else self.after_backward())

    def __call__(self, x: Tensor, y: Tensor):
        """One step's forward and backward on the batch ``(x, y)``; returns the model's output and what
        ``after_backward`` returned (None without it)."""
        self.calls += 1
        caller = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(caller)  # the batch, the last optimizer step
        with torch.cuda.stream(self.stream):
            if self.calls <= self.warmup:
                result = self._forward_backward(x, y)
            elif self.graph is None:
                result = self._capture(x, y)
            else:
                if x.shape != self.inputs[0].shape or y.shape != self.inputs[1].shape:
                    raise ValueError(f"TrainConfig.cuda_graph=True: batch shapes {tuple(x.shape)}, {tuple(y.shape)} "
                                     f"differ from the captured {tuple(self.inputs[0].shape)}, "
                                     f"{tuple(self.inputs[1].shape)}; every training batch must have one shape "
                                     "(or use cuda_graph=False)")
                self.inputs[0].copy_(x)
                self.inputs[1].copy_(y)
                self.graph.replay()
                result = self.out, self.after
        caller.wait_stream(self.stream)  # the optimizer reads the gradients
        return result

    def _capture(self, x: Tensor, y: Tensor):
        stale = [name for name, p in self.model.named_parameters() if p.grad is not None]
        if stale:
            raise RuntimeError(f"GraphedForwardBackward: {len(stale)} parameters hold gradients before the capture "
                               f"(e.g. {stale[0]}); the captured backward must allocate them (zero_grad(set_to_none=True))")
        self.inputs = (x.clone(), y.clone())
        torch.cuda.synchronize()
        # the graph allocates from a private pool: hand back what the eager steps cached, and first collect the
        # dead cycles torch.cuda.graph no longer collects (an earlier run's graph and pool held in one stay reserved
        # until a full collection: notebook 06 on an H100 found 36.8 GiB in private pools and ran out of memory)
        gc.collect()
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            self.out, self.after = self._forward_backward(*self.inputs)
        self.graph = graph
        graph.replay()  # capture only records: this replay computes the step
        return self.out, self.after


class GraphedOptimizerStep:
    """The fused master AdamW step and ``model.after_optimizer_step()`` (balancer updates, QK-Clip, and QK-Clip's
    rescale taken into the fp32 masters) as one CUDA graph, for a :class:`GraphedForwardBackward` that has
    captured its step.

    Each call is one update: the host half of the step (:meth:`MasterWeightOptimizer.prepare_fused_step`:
    step counts, and the learning rate and bias corrections written into the launches' device buffers) runs
    in Python every time; the device half is captured on the first call and replayed after it. The captured
    kernels read the gradients and the clip coefficient that the forward-backward graph writes, so that graph
    must be captured first (``forward_backward.captured``), the optimizer must keep its gradients
    (``keep_grads``) and hold the clip coefficient of the captured gradient norm. The optimizer's state must
    exist (at least one eager step before): a capture only records, it would not create it.
    """

    def __init__(self, model: nn.Module, optimizer, forward_backward: GraphedForwardBackward,
                 before_after_step: Callable[[], None] | None = None):
        if not getattr(optimizer, "fused", False):
            raise ValueError("GraphedOptimizerStep: needs a MasterWeightOptimizer with the fused AdamW step "
                             "(TrainConfig.param_dtype='bfloat16', optimizer='adamw', on CUDA)")
        self.model, self.optimizer, self.forward_backward = model, optimizer, forward_backward
        self.before_after_step = before_after_step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.launch_ids: list[int] = []
        self.clip = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _device_half(self, launches) -> None:
        self.optimizer.run_fused_step(launches)
        if self.before_after_step is not None:  # a sharded rank's collectives the after-step reads (QK-Clip's max)
            self.before_after_step()
        if hasattr(self.model, "after_optimizer_step"):
            self.model.after_optimizer_step()
        self.optimizer.sync_from_params()  # QK-Clip rescaled bf16 rows in place: into the masters, every replay

    def __call__(self) -> None:
        if not self.forward_backward.captured:
            raise RuntimeError("GraphedOptimizerStep: the forward-backward graph is not captured yet (its gradients "
                               "are what this graph reads); step the optimizer eagerly until it is")
        if not self.optimizer.keep_grads or self.optimizer.clip_coef is None:
            raise RuntimeError("GraphedOptimizerStep: the optimizer must keep the captured gradients (keep_grads=True) "
                               "and hold the captured clip coefficient (clip_grad_norm_ inside the captured step)")
        if not self.optimizer.state:
            raise RuntimeError("GraphedOptimizerStep: the optimizer has no state yet; take one eager step first")
        stream = self.forward_backward.stream
        launches = self.optimizer.prepare_fused_step()  # host: counts, scalars -> device (on the caller's stream)
        caller = torch.cuda.current_stream(stream.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            if self.graph is None:
                self.optimizer.sync_from_params()  # anything changed eagerly before: not part of the capture
                self.launch_ids, self.clip = [id(launch) for launch, _, _ in launches], self.optimizer.clip_coef
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    self._device_half(launches)
                self.graph = graph
            elif [id(launch) for launch, _, _ in launches] != self.launch_ids or self.optimizer.clip_coef is not self.clip:
                raise RuntimeError("GraphedOptimizerStep: the optimizer's launches or clip coefficient changed since the "
                                   "capture (a parameter gained or lost its gradient, or the state was reloaded); "
                                   "a replay would update stale tensors")
            self.graph.replay()  # capture only records: the first replay computes the first graphed update
        caller.wait_stream(stream)
