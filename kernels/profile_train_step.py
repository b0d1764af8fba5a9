"""Where one training step of a K3 preset spends its time on a GPU: wall time per step, GPU busy time,
and the kernels and ops that take it (torch profiler). Used to explain notebook 09's tokens/s and MFU.

    python kernels/profile_train_step.py --preset small --batch-size 16 --seq-len 1024 --optimizer adamw
    python kernels/profile_train_step.py --preset small --compile sublayer --recompute selective --fused-loss
    python kernels/profile_train_step.py --preset kda-anchor --batch-size 8 --seq-len 4096 --compile sublayer

Same step as ``k3lab.train.fit`` (bf16 autocast, clip, optimizer step, ``after_optimizer_step``), on
random token ids. ``--param-dtype bfloat16``: bf16 weights with fp32 master weights, as fit's
``param_dtype="bfloat16"`` (:class:`k3lab.precision.MasterWeightOptimizer`: grads into the masters, clip
those, step, copy back); ``--master-format split``: the masters as the bf16 weights plus int16 low halves
(``TrainConfig.master_format``; the fused AdamW step, CUDA). Prints: ms per step (median of the timed
steps), the share of it the GPU was busy, the GPU time by kind of kernel (:data:`KINDS`), the top CUDA
kernels, and the top CPU-side ops by self time.
``--saved``: also what one forward keeps for backward, by module class and dtype (:func:`saved_bytes`: an
eager copy of the model with the same recompute mode, storages counted once, attributed to the innermost
module running when autograd saved them; tensors a checkpointed region recomputes are not counted).
``--live``: what is allocated at the end of one forward of the model as it runs (compiled too), by the
line of k3lab code that allocated it (:func:`live_after_forward`, from ``torch.cuda.memory`` history with
Python stacks): parameters, optimizer state and what the forward keeps for backward.
``--preset kda-anchor``: the pure-KDA shape of ``kernels/bench_train.py``.
"""

import argparse
import re
import statistics
import time

import torch

from k3lab.compile import COMPILE_MODES, compile_model, compile_sublayers
from k3lab.config import RUNNABLE_PRESETS, ModelConfig
from k3lab.cuda_graph import GraphedForwardBackward, GraphedOptimizerStep
from k3lab.memory import RECOMPUTE_MODES, apply_recompute
from k3lab.model import K3ForCausalLM
from k3lab.optim import build_optimizer
from k3lab.precision import MASTER_FORMATS, MOMENT_DTYPES, PARAM_DTYPES, MasterWeightOptimizer, cast_params_
from k3lab.train import OPTIMIZERS

KINDS = [  # (kind, regex on the CUDA kernel name), first match wins
    ("our KDA kernels (Triton)", r"^kda_"),
    ("our AttnRes mix kernels (Triton)", r"^attn_res_"),
    ("our fused AdamW (Triton)", r"master_adamw"),
    ("inductor-fused Triton", r"^triton_"),  # before the GEMMs: inductor names some SiTU kernels "..._grouped_mm_..."
    # torch's CUTLASS 3.x kernels (at::cuda::detail): in a bf16 step, F.grouped_mm's expert GEMMs
    ("grouped expert GEMMs", r"enable_3x_kernel_for_sm9x|GroupProblemShape|grouped|group_gemm"),
    ("dense GEMMs (cuBLAS/CUTLASS)", r"gemm|Gemm|cutlass|nvjet|sm90_xmma|ampere_|wgrad|dgrad|splitK"),
    ("SDPA / flash attention", r"flash|fmha|attention|cudnn"),
    ("reductions / norms (aten)", r"reduce|Reduce|norm|softmax|Softmax"),
    ("copies / casts (aten)", r"copy|Copy|CatArray|index|Index|gather|scatter|Scatter"),
    ("elementwise (aten)", r"elementwise|vectorized|unrolled"),
    ("other", r""),
]


def kind_of(name: str) -> str:
    return next(kind for kind, pattern in KINDS if re.search(pattern, name))


def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[dict, int]:
    """``({(module class, dtype): bytes}, total)`` that one autocast bf16 forward of ``model`` on ``x``
    saves for backward (unique storages; the innermost running module gets them)."""
    stack, saved, seen, handles = [], {}, set(), []
    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_pre_hook(lambda m, a: stack.append(type(m).__name__)))
            handles.append(mod.register_forward_hook(lambda m, a, o: [stack.pop()] and None))

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen and t.device.type == x.device.type:
            seen.add(key)
            k = (stack[-1] if stack else "K3ForCausalLM (loss, AttnRes mixes)", str(t.dtype).replace("torch.", ""))
            saved[k] = saved.get(k, 0) + t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
    del loss
    for h in handles:
        h.remove()
    return saved, sum(saved.values())


def _site(frames: list[dict]) -> str:
    """The innermost two k3lab frames of an allocation's stack, as ``file:line`` (innermost first)."""
    ours = [f for f in frames if "/k3lab/" in f["filename"] or "/kernels/" in f["filename"]]
    return " < ".join(f"{f['filename'].rsplit('/k3lab/', 1)[-1]}:{f['line']}" for f in ours[:2]) or "(no k3lab frame)"


def live_after_forward(step_forward, dev) -> tuple[dict, int]:
    """``({allocation site: bytes}, total)`` of the CUDA blocks live after ``step_forward()`` returns and
    allocated during it (``torch.cuda.memory._record_memory_history`` with Python stacks)."""
    torch.cuda.synchronize(dev)
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    keep = step_forward()
    torch.cuda.synchronize(dev)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    sites = {}
    for seg in snap["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated" and block.get("frames"):
                site = _site(block["frames"])
                sites[site] = sites.get(site, 0) + block["size"]
    del keep
    return sites, sum(sites.values())


def print_live(step_forward, dev, tokens: int, top: int) -> None:
    sites, total = live_after_forward(step_forward, dev)
    print(f"allocated during one forward and live at its end: {total / 2**30:.2f} GiB, {total / tokens / 1024:.1f} KiB a token")
    for site, b in sorted(sites.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {b / 2**30:8.2f} GiB  {b / tokens / 1024:7.1f} KiB/token  {site}")


def gpu_gaps(prof, min_us: float = 10.0) -> tuple[list[tuple[float, float]], float]:
    """The GPU's idle intervals inside the profiled step, ``([(start_us, length_us), ...], total_us)``: the
    gaps between consecutive kernels (merged over streams) longer than ``min_us``."""
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA and not getattr(ev, "is_user_annotation", False))
    gaps, end = [], None
    for start, stop in spans:
        if end is not None and start - end > min_us:
            gaps.append((end, start - end))
        end = stop if end is None else max(end, stop)
    return gaps, sum(g for _, g in gaps)


def print_gaps(prof, top: int) -> None:
    """GPU idle time by what the host was doing then: each gap is charged to the innermost CPU op running at
    its middle (an aten op, a compiled graph, an autograd node...), shown with the outermost one around it."""
    import heapq

    gaps, total = gpu_gaps(prof)
    cpu = sorted(((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                  if ev.device_type == torch.autograd.DeviceType.CPU), key=lambda e: e[0])
    by, active, i = {}, [], 0  # active: heap of (end, start, name) of the CPU ops begun before the gap's middle
    for start, length in sorted(gaps):
        mid = start + length / 2
        while i < len(cpu) and cpu[i][0] <= mid:
            heapq.heappush(active, (cpu[i][1], cpu[i][0], cpu[i][2]))
            i += 1
        while active and active[0][0] < mid:
            heapq.heappop(active)
        running = sorted(active, key=lambda e: e[0] - e[1])  # innermost (shortest) first
        name = running[0][2] if running else "(no CPU op: Python between ops)"
        outer = running[-1][2] if running else ""
        key = f"{name[:70]}  [in {outer[:50]}]" if outer and outer != name else name[:120]
        n, t = by.get(key, (0, 0.0))
        by[key] = (n + 1, t + length)
    print(f"GPU idle inside the step: {total / 1e3:.1f} ms in {len(gaps)} gaps > 10 us; by the host op running then:")
    for key, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {t / 1e3:8.2f} ms  {n:5d} gaps  {key}")


def export_trace(prof, path: str) -> None:
    """The profiled step as a Chrome trace (gzipped when ``path`` ends in .gz)."""
    import gzip
    import os
    import tempfile

    if not path.endswith(".gz"):
        prof.export_chrome_trace(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())
    print(f"trace written to {path}")


def print_saved(cfg, args, dev, x) -> None:
    model = K3ForCausalLM(cfg).to(dev).train()
    model.fused_loss = args.fused_loss
    if args.param_dtype != "float32":
        cast_params_(model, args.param_dtype)
    apply_recompute(model, args.recompute, args.recompute_layers)
    saved, total = saved_bytes(model, x)
    tokens = x.numel()
    print(f"saved for backward by one eager forward (recompute={args.recompute}): {total / 2**30:.2f} GiB, "
          f"{total / tokens / 1024:.1f} KiB a token")
    by_class = {}
    for (cls, dt), b in saved.items():
        by_class.setdefault(cls, {})[dt] = b
    for cls, dts in sorted(by_class.items(), key=lambda kv: -sum(kv[1].values())):
        parts = ", ".join(f"{dt} {b / 2**30:.2f}" for dt, b in sorted(dts.items(), key=lambda kv: -kv[1]))
        print(f"  {sum(dts.values()) / 2**30:8.2f} GiB  {sum(dts.values()) / tokens / 1024:7.1f} KiB/token  {cls:<22} ({parts})")
    del model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=RUNNABLE_PRESETS + ("kda-anchor",))
    parser.add_argument("--compile", default="none", choices=COMPILE_MODES)
    parser.add_argument("--recompute", default="none", choices=RECOMPUTE_MODES)
    parser.add_argument("--recompute-layers", type=int, default=None,
                        help="with --recompute mixer|sublayer: checkpoint this many decoder layers (TrainConfig.recompute_layers)")
    parser.add_argument("--compile-mode", default=None, choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                        help="torch.compile's mode for --compile sublayer (an experiment: fit compiles with the default)")
    parser.add_argument("--functorch", action="append", default=[], metavar="KEY=VALUE",
                        help="an experiment: set torch._functorch.config.KEY (a Python literal) before compiling, e.g. "
                             "activation_memory_budget=0.5 (AOTAutograd's partitioner: what compiled graphs save)")
    parser.add_argument("--fused-loss", action="store_true", help="chunked linear cross-entropy (model.fused_loss)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="the step as two CUDA graphs after two eager steps, as fit runs it (TrainConfig.cuda_graph)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument("--param-dtype", default="float32", choices=PARAM_DTYPES,
                        help="bfloat16: bf16 weights with fp32 master weights (TrainConfig.param_dtype)")
    parser.add_argument("--moment-dtype", default="float32", choices=MOMENT_DTYPES,
                        help="bfloat16: AdamW moments in bf16 (TrainConfig.moment_dtype; needs --param-dtype bfloat16)")
    parser.add_argument("--master-format", default="float32", choices=MASTER_FORMATS,
                        help="split: fp32 masters kept as the bf16 weights + int16 low halves (TrainConfig.master_format; "
                             "needs --param-dtype bfloat16, --optimizer adamw and the fused step)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 3 warm-up steps)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test only")
    parser.add_argument("--saved", action="store_true", help="also print what one forward saves for backward")
    parser.add_argument("--live", action="store_true", help="also print what one forward leaves allocated (CUDA)")
    parser.add_argument("--trace", default=None, help="write the profiled step's Chrome trace here (.json.gz: gzipped)")
    args = parser.parse_args()
    if args.master_format != "float32" and args.param_dtype == "float32":
        parser.error(f"--master-format {args.master_format} needs --param-dtype bfloat16 (the masters of bf16 weights)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    dev = torch.device(args.device)
    for item in args.functorch:
        import ast

        import torch._functorch.config as functorch_config

        key, _, value = item.partition("=")
        if not hasattr(functorch_config, key):
            raise SystemExit(f"--functorch {item!r}: torch._functorch.config has no {key!r}")
        setattr(functorch_config, key, ast.literal_eval(value))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    if args.preset == "kda-anchor":
        from bench_train import k3lab_config  # kernels/ is on sys.path when this file runs

        cfg = k3lab_config("kda-anchor")
    else:
        cfg = ModelConfig.preset(args.preset)
    model = K3ForCausalLM(cfg).to(dev).train()
    model.fused_loss = args.fused_loss
    if args.param_dtype != "float32":
        cast_params_(model, args.param_dtype)  # as fit: before recompute and compile
    apply_recompute(model, args.recompute, args.recompute_layers)
    if args.compile_mode and args.compile == "sublayer":  # torch.compile(mode=...): an experiment, fit uses the default
        compile_sublayers(model, None, mode=args.compile_mode)
    else:
        compile_model(model, args.compile)
    opt = build_optimizer(model, args.optimizer, lr=1e-3, weight_decay=0.1)
    if args.param_dtype != "float32":
        opt = MasterWeightOptimizer(model, opt, moment_dtype=args.moment_dtype, master_format=args.master_format)
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), device=dev)
    masters = opt if isinstance(opt, MasterWeightOptimizer) else None

    def clip_norm():  # fused AdamW on CUDA: the norm here, the clip inside the step
        return masters.clip_grad_norm_(1.0) if masters is not None else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    graphed = GraphedForwardBackward(model, after_backward=clip_norm) if args.cuda_graph else None  # ValueError off CUDA
    if graphed is not None and masters is not None and not masters.fused:
        raise SystemExit("--cuda-graph with --param-dtype bfloat16 needs the fused AdamW step (--optimizer adamw)")
    graphed_update = GraphedOptimizerStep(model, masters, graphed) if graphed is not None and masters is not None else None

    def step():
        if args.compile_mode == "reduce-overhead":  # CUDA graphs: a new step may overwrite the last one's outputs
            torch.compiler.cudagraph_mark_step_begin()
        if graphed is not None:  # as fit with cuda_graph=True: eager twice, then capture, then replays
            if masters is not None:
                masters.sync_from_params()
            graphed(x, x)
            if graphed.captured and masters is not None and not masters.keep_grads:
                masters.keep_grads = True
        else:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out = model(x, labels=x)
            out.loss.backward()
            clip_norm()
        if graphed_update is not None and graphed.captured:  # the optimizer graph, as fit
            graphed_update()
            return
        opt.step()
        if graphed is None or not graphed.captured:  # a replay writes the captured gradients itself
            opt.zero_grad(set_to_none=True)
        model.after_optimizer_step()

    for _ in range(3):
        step()
    sync()
    if args.compile != "none":  # dynamo's graph breaks while compiling the warm-up steps, by reason
        from torch._dynamo.utils import counters

        breaks = sorted(counters["graph_break"].items(), key=lambda kv: -kv[1])
        print(f"graph breaks: {sum(n for _, n in breaks)}" + "".join(f"\n  {n:4d}  {reason[:160]}" for reason, n in breaks))
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync()
    ms = 1e3 * statistics.median(times)
    tokens = args.batch_size * args.seq_len
    flops = 6 * cfg.param_counts()["active"] * tokens
    gpu = {}
    for ev in prof.events():  # kernels only: not the GPU-side ranges of annotations such as Optimizer.step
        if ev.device_type == torch.autograd.DeviceType.CUDA and not getattr(ev, "is_user_annotation", False):
            gpu[ev.name] = gpu.get(ev.name, 0.0) + ev.device_time / 1e3
    busy = sum(gpu.values())
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    print(f"{args.preset} {args.optimizer} B{args.batch_size} T{args.seq_len} compile={args.compile} "
          f"recompute={args.recompute} fused_loss={args.fused_loss} param_dtype={args.param_dtype} "
          f"moment_dtype={args.moment_dtype} master_format={args.master_format} cuda_graph={args.cuda_graph}: "
          f"peak {peak:.1f} GiB, "
          f"{ms:.1f} ms/step, {tokens / ms * 1e3:,.0f} tokens/s, {flops / ms / 1e9:.0f} TFLOP/s (6N), GPU busy {busy:.1f} ms "
          f"({100 * busy / ms:.0f}% of the step)")
    kinds = {}
    for name, t in gpu.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + t
    print("GPU time by kind (ms in one step, share of GPU busy time):")
    for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {t:8.2f}  {100 * t / max(busy, 1e-9):5.1f}%  {kind}")
    launches = sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(ev, "is_user_annotation", False))
    print(f"  {launches} kernel launches")
    print("top CUDA kernels (ms in one step):")
    for name, t in sorted(gpu.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {t:8.2f}  {name[:100]}")
    print_gaps(prof, args.top)
    if args.trace:
        export_trace(prof, args.trace)
    print("top CPU ops by self time (ms in one step):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    if args.live and dev.type == "cuda":
        def forward():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                return model(x, labels=x).loss
        print_live(forward, dev, x.numel(), args.top)
    if args.saved:
        del model, opt
        print_saved(cfg, args, dev, x)


if __name__ == "__main__":
    main()
