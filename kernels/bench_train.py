"""Training throughput of k3lab models and of fla's KDAForCausalLM of the same shape, side by side in one run.

    python kernels/bench_train.py                                  # the four default configs, eager
    python kernels/bench_train.py --compile sublayer --fused-loss  # k3lab configs compiled per sublayer
    python kernels/bench_train.py --param-dtype bfloat16 --moment-dtype bfloat16 --master-format split --cuda-graph
    python kernels/bench_train.py --configs small-4x4096 kda-anchor-8x4096 --steps 20 --json out.json
    python kernels/bench_train.py --device cpu --configs tiny-2x64 --steps 2 --warmup 1   # CPU smoke test

Training settings: every :class:`k3lab.train.TrainConfig` field a benchmark sets is a flag (``--compile``, ``--recompute``,
``--recompute-layers``, ``--fused-loss``, ``--cuda-graph``, ``--param-dtype``, ``--moment-dtype``,
``--master-format``, ``--optimizer``, ``--lr``, ...; ``--help`` lists them), generated
by :mod:`k3lab.cli`, so a field added to TrainConfig is a flag here and reaches every config's process. Left
out (:data:`TRAIN_SKIP`): ``steps`` (here ``--steps`` counts the timed steps: fit runs 1 + ``--warmup`` +
``--steps``), ``device`` (this script's own ``--device``, resolved in each config's process), ``log_every``
(the timing needs every step), the evaluation, checkpoint and output fields (a benchmark writes no files and
has no validation data), ``progress`` (off) and ``name`` (the config's). Defaults are TrainConfig's except
:data:`TRAIN_DEFAULTS`: ``--dtype bfloat16``, ``--lr 1e-3``, ``--warmup-steps 0``. A bad value or combination
ends as argparse does (``error: --flag: reason``, TrainConfig's own check), before any config runs.

A config is ``MODEL-BxT`` (batch B of T tokens, synthetic random token ids, no downloads), optionally
with per-config settings that override the command line's: ``@key=value,...`` with any TrainConfig field
that is a flag as the key, typed as its flag (bools ``on|off``, ``none`` for None, a tuple's numbers separated
by ``/``; no value may hold a comma) and checked by constructing the config's TrainConfig, e.g.
``small-16x1024@compile=sublayer,recompute=selective,fused_loss=on,param_dtype=bfloat16``,
``kda-anchor-8x4096@recompute=mixer,recompute_layers=16`` or ``small-16x1024@cuda_graph=on,master_format=split``
(``TrainConfig.master_format``: the fp32 masters as the bf16 weights plus int16 low halves; needs
``param_dtype=bfloat16``, AdamW, CUDA). fla's model ignores the k3lab-only ones (:data:`FLA_SETTINGS`: its
row shows what it ran with). Models:

* ``small``      the ``small`` preset (hybrid KDA + Gated MLA, LatentMoE, Attention Residuals);
* ``kda-anchor`` a pure-KDA dense k3lab model shaped like fla's anchor: 24 layers, D = 1024, 8 KDA heads
  × 128, vocab 32000, PreNorm residual, SiTU MLP of width 2816, no MLA, no MoE;
* ``fla-kda-anchor`` fla's ``KDAForCausalLM`` of that shape (``safe_gate=True, lower_bound=-5``,
  ``attn=None``: pure KDA; fused cross-entropy, fla's default; bf16 weights unless ``--fla-weights
  float32``). Skipped, with the reason in its row, without CUDA or without fla;
* ``tiny``       the ``tiny`` preset (CPU tests).

``@via=fit`` / ``@via=cli`` (``small`` and ``tiny``; a benchmark option, not a TrainConfig field): the one
training loop reached two ways, on the same model (built on the CPU from seed 0, as the command line builds
it) and the same batches
(``k3lab.parallel.run.batches_for("random", ...)``): ``fit`` called in the process, or the command line
``torchrun --standalone --nproc_per_node 1 -m k3lab.parallel.run`` with every setting passed as the flags
``k3lab.cli.flags_for`` makes of the same TrainConfig. The table's last lines give CLI ÷ fit for tokens/s
and peak memory and the largest relative difference of their per-step losses.

``@via=fake-rank[,ranks=2|4|8][,reshard=true|false][,ep=2|4|8[,ep_plan=host|device][,exchange=stand-in|emulated]
[,overlap=true|false][,chunks=1|2|4][,placed=true|false]]``: ``fit`` as rank 0 of a
sharded run (FSDP alone, or with MoonEP over ``ep`` of the ranks; 8 ranks by
default) in PyTorch's fake process group, every collective free, the rank holding the config's B × T tokens: the
sharded step as ``fit`` runs it (masters, graphs and all), timed on one GPU, against the one-GPU ``@via=fit`` row
of the same call. This row is the rank's compute; its second step runs with ``kernels/predict_scaling.py``'s counter
on, and that script's step model (:func:`predicted_step`: the counted bytes over 8 H200s on NVLink, FSDP's hidden
under compute but the calls that open and close the step, the EP all-to-alls blocking) gives the line under
the table: the rank's predicted tokens/s per GPU against ``fit`` on one GPU. With ``ep_plan=device`` and
``cuda_graph=on`` the EP exchanges are that script's capturable stand-in (:func:`uses_stand_in`);
``exchange=emulated`` makes them its ``emulated_exchange``, each all-to-all holding the compute stream for its
modelled time on 16 SMs (CUDA), so the row's ms holds the exposed all-to-all time and the prediction adds the other
collectives only (:func:`emulates_exchange`); ``overlap=true`` runs the shared expert on a side stream beside them
(``ParallelOptions.shared_overlap``; default in line); ``chunks=2|4`` cuts each MoE layer's tokens into chunks whose
exchanges run on a communication stream beside the other chunks' experts (``ParallelOptions.ep_chunks``);
``placed=false`` makes the stand-in or emulated exchange leave the bank-major row orders to the dispatcher (its own
gathers, as for an exchange without a two-dimensional all-to-all; default: the exchange places them);
``edges=units|vocab`` puts the embedding and the head in FSDP2 units of their own, or the head so and the table
sharded by rows (``ParallelOptions.edges``).

Defaults: ``small-16x1024 small-8x4096 kda-anchor-8x4096 fla-kda-anchor-8x4096``.

``--torch-profile TOP``: each config runs one more step, under ``torch.profiler`` and left out of the timing (a
graphed step's kernels are listed too); the rows get its summary and the lines after the table print its TOP ops by
device and host time (``kernels/predict_scaling.py``'s ``summarize_profile``; ``docs/scaling.md``, section 4g).

Every config trains in a fresh process (so no memory, compile cache or autotuning state carries over)
through ``k3lab.train.fit`` — the trainer itself: bf16 autocast (``--dtype``) with fp32 weights, or bf16
weights and fp32 master weights with ``--param-dtype bfloat16`` (k3lab models; needs ``--dtype bfloat16``),
grad-norm clip ``--grad-clip`` (1.0), ``--optimizer`` from ``k3lab.optim.build_optimizer`` at ``--lr`` without
warm-up (the same for fla's model), ``--compile`` (k3lab models only), ``--fused-loss`` (k3lab models; fla's
model always fuses its loss). Steps: 1
first step (compilation, autotuning: "first step s"), ``--warmup`` untimed steps, then ``--steps`` timed
ones; ms/step is the median over the timed steps of fit's own per-step clock (fit reads the loss, the grad norm and the metrics back once a step, after backward).
tokens/s = B·T / step time. MFU = 6 · active parameters · tokens/s ÷ ``--peak-flops`` (default 790e12: the
bf16 dense matmul rate measured on an H200); active parameters exclude the input embedding and include the
LM head (k3lab: ``cfg.param_counts()["active"]``, routed experts counted at top-k; fla: all parameters but
the embedding); attention/KDA mixing FLOPs are not counted. Peak memory is
``torch.cuda.max_memory_allocated`` (on CPU: the process's max RSS). "loss" is the training loss of the last
step (random tokens: ≈ ln(vocab) is all there is to learn). An out-of-memory error ends that config's row as
"OOM"; any other error as "error: ...".

fla autotunes its Triton kernels on first use (minutes on an H200): unpack its autotune cache into
``TRITON_CACHE_DIR`` before running (``kernels/fla060-triton36-h200-autotune.tgz`` holds the chunk-KDA
configs for fla 0.6.0 + triton 3.6; ``--fla-autotune-cache TGZ`` unpacks a tarball there, into a fresh
folder when ``TRITON_CACHE_DIR`` is unset); the first-step column shows what remained.

Measured on one H200 (2026-12-02, torch 2.11, triton 3.6, fla 0.6.0 with its autotune caches), bf16
autocast, AdamW, 1 + 1 warm-up + 3 timed steps, one invocation, fla's model first and last, every k3lab row
with ``compile=sublayer, fused_loss=on, param_dtype=bfloat16`` (the whole table, two more invocations and a
profile: ``kernels/TRAIN_RESULTS.md``, last section):

| config | recompute | ms/step | tokens/s | MFU | peak GiB |
|---|---|---|---|---|---|
| fla-kda-anchor-8x4096 (first / last) | (fla) | 345.2 / 340.8 | 94,925 / 96,150 | 25.5% / 25.9% | 34.7 |
| kda-anchor-8x4096 | selective | 328.7 | 99,690 | 28.2% | 43.4 |
| kda-anchor-8x4096 | mixer | 344.7 | 95,062 | 26.9% | 28.9 |
| kda-anchor-8x4096 | sublayer, recompute_layers=12 | 346.1 | 94,678 | 26.8% | 32.8 |
| small-16x1024 | selective | 190.6 | 85,960 | 23.0% | 49.7 |
| small-16x1024 | sublayer | 244.7 | 66,955 | 17.9% | 36.3 |
| small-8x4096 | selective | 370.9 | 88,347 | 23.6% | 76.8 |
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run as a script from anywhere: the repo's k3lab first
    sys.path.insert(0, ROOT)

from k3lab.cli import add_dataclass_flags, field_value, flag_errors, flags_for  # noqa: E402
from k3lab.config import DEVICES, DTYPES  # noqa: E402
from k3lab.parallel.dims import EP_PLANS  # noqa: E402
from k3lab.parallel.fsdp import EDGES  # noqa: E402
from k3lab.train import TrainConfig  # noqa: E402

MODELS = ("small", "kda-anchor", "fla-kda-anchor", "tiny")
DEFAULT_CONFIGS = ("small-16x1024", "small-8x4096", "kda-anchor-8x4096", "fla-kda-anchor-8x4096")
PEAK_FLOPS = 790e12  # measured bf16 dense matmul rate of one H200
PEAK_SOURCE = "790 TFLOP/s: bf16 dense matmul rate measured on an H200"
# the shape of fla's anchor (fla KDAForCausalLM defaults: MLP width = 1024·4·2/3 rounded up to 256 = 2816)
ANCHOR = dict(vocab_size=32000, num_hidden_layers=24, hidden_size=1024, num_heads=8, head_dim=128,
              intermediate_size=2816)


@dataclass(frozen=True)
class Spec:
    name: str
    model: str
    B: int
    T: int
    options: tuple = ()  # ((key, value text), ...) from "@key=value,...": overrides of the command line's settings

    def option(self, key: str, default):
        return dict(self.options).get(key, default)

    def train_options(self) -> dict:
        """The config's own TrainConfig settings, typed as their flags (the benchmark options left out)."""
        return {k: field_value(TrainConfig, k, v) for k, v in self.options if k not in BENCH_OPTIONS}


# TrainConfig fields that are not flags here (every other field is one, through k3lab.cli; see the docstring):
# steps: --steps counts the timed steps (fit runs 1 + --warmup + --steps); device: this script's own --device,
# resolved in each config's process; log_every: the timing needs every step's record; eval_*, checkpoint_every,
# keep_checkpoints, out_dir: a benchmark has no validation data and writes no files; progress: off (the output is
# the table); name: the config's name
TRAIN_SKIP = ("steps", "device", "log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
              "out_dir", "progress", "name")
TRAIN_DEFAULTS = {"dtype": "bfloat16", "lr": 1e-3, "warmup_steps": 0}  # where the benchmark differs from TrainConfig
# per-config options that are not TrainConfig fields (ranks, reshard, ep, ep_plan: via=fake-rank only)
BENCH_OPTIONS = {"via": ("fit", "cli", "fake-rank"), "ranks": ("2", "4", "8"), "reshard": ("true", "false"),
                 "ep": ("1", "2", "4", "8"), "ep_plan": EP_PLANS, "exchange": ("stand-in", "emulated"),
                 "overlap": ("true", "false"), "chunks": ("1", "2", "4"), "placed": ("true", "false"),
                 "edges": EDGES}
RANK_OPTIONS = ("ranks", "reshard", "ep", "ep_plan", "exchange", "overlap", "chunks", "placed", "edges")
# fla's model: the k3lab-only settings, whatever the command line or the config says (its row shows them)
FLA_SETTINGS = dict(param_dtype="float32", moment_dtype="float32", master_format="float32", compile="none",
                    recompute="none", recompute_layers=None, cuda_graph=False, fused_loss=False)
_FIELD_ERROR = re.compile(r"^TrainConfig\.(\w+)=.*?: (.*)$", re.S)


def train_flags() -> tuple[str, ...]:
    """The TrainConfig fields that are flags (and ``@key=value`` keys) here: all but :data:`TRAIN_SKIP`."""
    import dataclasses

    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.init and f.name not in TRAIN_SKIP)


def train_settings(args) -> dict:
    """The command line's TrainConfig settings (over :data:`TRAIN_DEFAULTS`), with fit's step count
    (1 + warm-up + timed) and no progress bar."""
    values = dict(TRAIN_DEFAULTS, **{k: getattr(args, k) for k in train_flags() if hasattr(args, k)})
    profiled = 1 if getattr(args, "torch_profile", 0) else 0  # --torch-profile: one more step, the profiled one
    return dict(values, steps=1 + args.warmup + args.steps + profiled, progress=False)


class StepProfiler:
    """``--torch-profile TOP``: ``torch.profiler`` over fit's last step (its ``on_step`` hook starts the profiler after
    the step before and stops it after that one, each after a device sync); ``result`` is
    ``kernels/predict_scaling.py``'s ``summarize_profile`` of it (None until then)."""

    def __init__(self, last_step: int, device, top: int):
        self.last_step, self.device, self.top = last_step, device, top
        self.prof, self.t0, self.result = None, 0.0, None

    def _sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_step(self, step: int, _row) -> None:
        from torch.profiler import ProfilerActivity, profile

        if step == self.last_step - 1:
            self._sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof, self.t0 = profile(activities=activities), time.perf_counter()
            self.prof.start()
        elif step == self.last_step and self.prof is not None:
            self._sync()
            wall = time.perf_counter() - self.t0
            self.prof.stop()
            ps = sys.modules.get("predict_scaling") or load_script_here("predict_scaling.py")
            self.result = ps.summarize_profile(self.prof, wall, self.top)


def train_config(spec: Spec, base: dict, **fixed) -> TrainConfig:
    """The TrainConfig of config ``spec``: the command line's settings ``base``, the config's own ``@key=value``
    over them, then ``fixed``. TrainConfig's validation; its ValueError named after the config (and the option)."""
    try:
        return TrainConfig(**{**base, **spec.train_options(), **fixed})
    except ValueError as err:
        m = _FIELD_ERROR.match(str(err))
        item = next((f"{k}={v}" for k, v in spec.options if m and k == m.group(1)), None)
        raise ValueError(f"config {spec.name!r}: " + (f"option {item!r}: {m.group(2)}" if item else str(err))) from None


def parse_config(name: str, base: dict | None = None) -> Spec:
    """``MODEL-BxT[@key=value,...]`` -> Spec; ValueError naming the allowed forms otherwise. The options (any
    TrainConfig field that is a flag: :func:`train_flags`; and ``via=fit|cli``) override the command line's
    settings ``base`` (default: :data:`TRAIN_DEFAULTS`) for this config; the values are checked by constructing
    the config's TrainConfig (:func:`train_config`)."""
    m = re.fullmatch(r"(.+?)-(\d+)x(\d+)(?:@(.+))?", name)
    if m is None or m.group(1) not in MODELS or int(m.group(2)) < 1 or int(m.group(3)) < 2:
        raise ValueError(f"config {name!r}: must be MODEL-BxT[@key=value,...] with MODEL in {MODELS}, B >= 1, "
                         f"T >= 2 (e.g. {', '.join(DEFAULT_CONFIGS)}, small-16x1024@compile=sublayer,recompute=selective)")
    options = []
    for item in filter(None, (m.group(4) or "").split(",")):
        key, _, value = item.partition("=")
        if key in BENCH_OPTIONS:
            if value not in BENCH_OPTIONS[key]:
                raise ValueError(f"config {name!r}: option {item!r}: allowed values are {'|'.join(BENCH_OPTIONS[key])}")
        elif key in train_flags():
            try:
                field_value(TrainConfig, key, value)
            except ValueError as err:
                raise ValueError(f"config {name!r}: option {item!r}: {str(err).split(': ', 1)[-1]}") from None
        else:
            bench = ", ".join(f"{k}={'|'.join(v)}" for k, v in BENCH_OPTIONS.items())
            raise ValueError(f"config {name!r}: option {item!r}: the keys are TrainConfig's fields "
                             f"({', '.join(train_flags())}) and {bench}")
        options.append((key, value))
    keys = dict(options)
    if keys.get("via") != "fake-rank" and any(k in keys for k in RANK_OPTIONS):
        raise ValueError(f"config {name!r}: options {'=, '.join(RANK_OPTIONS)}= need via=fake-rank")
    if keys.get("exchange") == "emulated" and (keys.get("ep", "1") == "1" or keys.get("ep_plan") != "device"):
        raise ValueError(f"config {name!r}: option 'exchange=emulated' needs ep=2|4|8 and ep_plan=device (the "
                         "capturable exchange it times)")
    if "placed" in keys and (keys.get("ep", "1") == "1" or keys.get("ep_plan") != "device"):
        raise ValueError(f"config {name!r}: option 'placed=' needs ep=2|4|8 and ep_plan=device (the stand-in or "
                         "emulated exchange whose row orders it sets)")
    spec = Spec(name, m.group(1), int(m.group(2)), int(m.group(3)), tuple(options))
    train_config(spec, TRAIN_DEFAULTS if base is None else base)  # the values: TrainConfig's own check
    return spec


# ----------------------------------------------------------------------------------------------
# one config (in the child process)
# ----------------------------------------------------------------------------------------------
def k3lab_config(model: str):
    from k3lab.config import ModelConfig

    if model == "tiny":
        return ModelConfig.preset("tiny")
    small = ModelConfig.preset("small")
    if model == "small":
        return small
    L = ANCHOR["num_hidden_layers"]
    return small.replace(vocab_size=ANCHOR["vocab_size"], num_hidden_layers=L, full_attn_layers=[],
                         hidden_size=ANCHOR["hidden_size"], intermediate_size=ANCHOR["intermediate_size"],
                         linear_attn_config=dict(num_heads=ANCHOR["num_heads"], head_dim=ANCHOR["head_dim"]),
                         mlp_kind="dense", first_k_dense_replace=L, residual="prenorm", qk_clip_tau=None)


def build_model(spec: Spec, args, device):
    """(model, active params, total params) on ``device``."""
    import torch

    if spec.model != "fla-kda-anchor":
        from k3lab.model import K3ForCausalLM

        cfg = k3lab_config(spec.model)
        with device:
            model = K3ForCausalLM(cfg)
        counts = cfg.param_counts()
        return model, counts["active"], counts["total"]
    from fla.models import KDAConfig, KDAForCausalLM

    cfg = KDAConfig(hidden_size=ANCHOR["hidden_size"], num_hidden_layers=ANCHOR["num_hidden_layers"],
                    num_heads=ANCHOR["num_heads"], head_dim=ANCHOR["head_dim"], vocab_size=ANCHOR["vocab_size"],
                    intermediate_size=ANCHOR["intermediate_size"], safe_gate=True, lower_bound=-5.0,
                    attn=None,  # fla's softmax-attention layers need the flash-attn package
                    fuse_cross_entropy=True)
    with device:
        model = KDAForCausalLM(cfg)
    if args.fla_weights == "bfloat16":
        model = model.to(torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    active = total - model.model.embeddings.weight.numel()
    return model, active, total


def _oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def _peak_memory_gib(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss * (1 if sys.platform != "darwin" else 1 / 1024) / 2**20


def run_config(spec: Spec, args) -> dict:
    """Train one config through k3lab.train.fit; the row of the table (numbers, or a status)."""
    import torch

    from k3lab.backend import resolve_device
    from k3lab.train import TrainingDiverged, fit

    device = resolve_device(args.device)
    is_fla = spec.model == "fla-kda-anchor"
    fla_fixed = dict(FLA_SETTINGS, **({"dtype": "float32"} if args.fla_weights == "bfloat16" else {})) if is_fla else {}
    cfg = train_config(spec, train_settings(args), device=str(device), name=spec.name, **fla_fixed)
    row = dict(config=spec.name, model="fla" if is_fla else "k3lab", B=spec.B, T=spec.T, tokens_per_step=spec.B * spec.T,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               torch=torch.__version__, dtype=cfg.dtype, optimizer=cfg.optimizer, compile=cfg.compile,
               recompute=cfg.recompute, status="ok")
    if cfg.cuda_graph:
        row["cuda_graph"] = True
    if cfg.recompute_layers is not None:
        row["recompute_layers"] = cfg.recompute_layers
    try:
        import triton

        row["triton"] = triton.__version__
    except ImportError:
        pass
    if is_fla:
        if device.type != "cuda":
            return dict(row, status="skipped: fla's kernels need CUDA")
        try:
            import fla
        except ImportError as err:
            return dict(row, status=f"skipped: fla is not importable ({err})")
        row["fla"] = fla.__version__
        row["weights"] = args.fla_weights
        row["fused_loss"] = "on (fla fuse_cross_entropy)"
    torch.manual_seed(0)
    try:
        model, active, total = build_model(spec, args, device)
        row.update(params_active=active, params_total=total)
        if not is_fla:
            master = " (split fp32 master)" if cfg.master_format == "split" else " (fp32 master)"
            row["weights"] = (cfg.param_dtype + (master if cfg.param_dtype != "float32" else "")
                              + (f", {cfg.moment_dtype} moments" if cfg.moment_dtype != "float32" else ""))
            row["fused_loss"] = "on" if cfg.fused_loss else "off"
        vocab = model.config.vocab_size
        gen = torch.Generator(device=device).manual_seed(1)

        def batches(step):
            ids = torch.randint(0, vocab, (spec.B, spec.T + 1), device=device, generator=gen)
            if is_fla:  # HF convention: labels = input ids, shifted inside the model
                return ids[:, :-1], ids[:, :-1]
            return ids[:, :-1], ids[:, 1:]  # k3lab: pre-aligned labels

        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        profiler = StepProfiler(cfg.steps - 1, device, args.torch_profile) if args.torch_profile else None
        on_step = profiler.on_step if profiler is not None else None
        via = None if is_fla else spec.option("via", None)
        t0 = time.perf_counter()
        try:
            if via is None:
                history, peak, counted = fit(model, batches, cfg, on_step=on_step).history, None, None
            else:
                row["via"] = via if via != "fake-rank" else (
                    f"fake rank of {spec.option('ranks', '8')}" + (", reshard=false" if spec.option("reshard", "true")
                                                                   == "false" else "")
                    + (f", EP = {spec.option('ep', '1')}, {spec.option('ep_plan', 'host')}-planned MoonEP"
                       if spec.option("ep", "1") != "1" else "")
                    + (", emulated exchange" if emulates_exchange(spec) else
                       ", stand-in exchange" if uses_stand_in(spec, cfg) else "")
                    + (", shared expert on a side stream" if spec.option("overlap", "false") == "true" else "")
                    + (f", {spec.option('chunks', '1')} chunks" if spec.option("chunks", "1") != "1" else "")
                    + (", rows placed by the dispatcher" if spec.option("placed", "true") == "false" else "")
                    + (f", edges={spec.option('edges', 'root')}" if spec.option("edges", "root") != "root" else ""))
                del model
                history, peak, counted = run_via(via, spec, cfg, device, on_step=on_step)
        except TrainingDiverged as err:
            return dict(row, status=f"diverged: {err}", peak_mem_gib=_peak_memory_gib(device))
        wall = time.perf_counter() - t0
        elapsed = [r["elapsed"] for r in history]
        times = [b - a for a, b in zip(elapsed[:-1], elapsed[1:])][args.warmup:][:args.steps]  # not the profiled one
        dt = statistics.median(times)
        tokens_per_s = spec.B * spec.T / dt
        row.update(ms_per_step=1e3 * dt, ms_per_step_min=1e3 * min(times), tokens_per_s=tokens_per_s,
                   mfu=6 * active * tokens_per_s / args.peak_flops,
                   peak_mem_gib=peak if peak is not None else _peak_memory_gib(device), losses=[r["loss"] for r in history],
                   grad_norms=[r.get("grad_norm") for r in history],
                   **({} if not counted else dict(counted=counted, **predicted_step(
                       1e3 * dt, counted, in_compute=("all_to_all",) if emulates_exchange(spec) else ()))),
                   first_step_s=elapsed[0], loss_first=history[0]["loss"], loss=history[-1]["loss"],
                   steps_timed=len(times), wall_s=wall,
                   **({"profile": profiler.result} if profiler is not None and profiler.result else {}))
    except Exception as err:  # noqa: BLE001 — a row per config, whatever happened
        if _oom(err):
            return dict(row, status="OOM", peak_mem_gib=_peak_memory_gib(device), error=str(err)[:500])
        import traceback

        traceback.print_exc()
        return dict(row, status=f"error: {type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}")
    return row


def run_via(via: str, spec: Spec, train_cfg, device, on_step=None) -> tuple[list[dict], float | None, dict | None]:
    """``@via=fit|cli|fake-rank``: (history, peak GiB or None, a fake rank's counted collectives or None) of the one
    loop reached in the process or by the command line, on the model and batches the command line builds (seed 0 on
    the CPU; ``batches_for("random", ...)``)."""
    from k3lab.cli import flags_for
    from k3lab.model import K3ForCausalLM
    from k3lab.parallel.run import batches_for
    from k3lab.train import fit

    if spec.model not in ("small", "tiny"):
        raise ValueError(f"config {spec.name!r}: via= runs the command line's presets only (small, tiny)")
    cfg = k3lab_config(spec.model)
    if via == "fit":
        history = fit(lambda: K3ForCausalLM(cfg), batches_for("random", cfg, spec.B, spec.T, 0), train_cfg,
                      on_step=on_step).history
        return history, None, None
    if via == "fake-rank":
        history, counted = fit_as_fake_rank(spec, cfg, train_cfg, device, on_step)
        return history, None, counted
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        out = os.path.join(tmp, "metrics.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               "-m", "k3lab.parallel.run", "--preset", spec.model, "--data", "random", "--batch-size", str(spec.B),
               "--seq-len", str(spec.T), *flags_for(train_cfg, skip=("device", "progress")), "--device", device.type,
               "--no-progress", "--metrics", out]
        print("   " + " ".join(cmd[1:]), flush=True)
        run = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"the command line exited with {run.returncode}: {run.stderr.strip().splitlines()[-1:]}")
        with open(out) as f:
            summary = json.load(f)
    return summary["history"], summary.get("peak_mem_gib"), None


def fit_as_fake_rank(spec: Spec, cfg, train_cfg, device, on_step=None) -> tuple[list[dict], dict]:
    """``@via=fake-rank``: ``fit`` as rank 0 of ``ranks`` (default 8) in PyTorch's fake process group, FSDP alone or
    with ``ep=N`` (MoonEP over N of the ranks, ``ep_plan=host|device``: ``ParallelOptions.ep_plan``; every rank
    routes like this one, so the plan's split sizes agree) (``reshard=false``:
    ``ParallelOptions.reshard_after_forward=False``), on a global batch of ranks·B rows, so the
    rank holds B × T tokens, as the one-GPU row does. Every collective is free (the fake group returns this rank's
    data; ``kernels/predict_scaling.py``'s wrappers fill what an older torch leaves empty), so the row times the
    rank's own step: what the graphed, sharded ``fit`` costs a GPU before communication. Returns ``fit``'s history and
    the second step's counted collectives (``CommCounter.summary()``: ``comm`` and ``fsdp_edges``)."""
    from k3lab.model import K3ForCausalLM
    from k3lab.parallel.fsdp import exposed_calls
    from k3lab.parallel.parallelize import ParallelOptions
    from k3lab.parallel.run import batches_for
    from k3lab.train import fit

    ps = sys.modules.get("predict_scaling") or load_script_here("predict_scaling.py")
    ranks = int(spec.option("ranks", "8"))
    parallel = ParallelOptions(reshard_after_forward=spec.option("reshard", "true") == "true",
                               ep=int(spec.option("ep", "1")), ep_plan=spec.option("ep_plan", "host"),
                               shared_overlap=spec.option("overlap", "false") == "true",
                               ep_chunks=int(spec.option("chunks", "1")), edges=spec.option("edges", "root"))
    exchange = contextlib.nullcontext()
    if emulates_exchange(spec) or uses_stand_in(spec, train_cfg):
        from k3lab.parallel.expert_static import default_exchange

        chosen = ps.emulated_exchange(ps.LINKS[LINK]) if emulates_exchange(spec) else ps.fixed_size_exchange
        exchange = default_exchange(chosen if spec.option("placed", "true") == "true" else ps.unplaced(chosen))
    counted = {}

    def count_step_two(step, row):  # the second step runs eager at every setting (a graph captures the third)
        if on_step is not None:
            on_step(step, row)
        counter.counting = step == 1
        if step == 2:
            counted.update(counter.summary(edge_calls=exposed_calls(parallel.edges)))

    with ps.fake_rank(ranks, 0, device) as counter, exchange:
        history = fit(lambda: K3ForCausalLM(cfg), batches_for("random", cfg, ranks * spec.B, spec.T, 0), train_cfg,
                      parallel=parallel, on_step=count_step_two).history
    # the fake group's writes of the counted step, timed on their own per kind
    counted["fake_writes_ms"] = {k: w["ms"] for k, w in counter.timed_writes(device).items()}
    return history, counted


LINK = "nvlink8"  # the step model's link for a fake rank's prediction and its emulated exchange


def predicted_step(compute_ms: float, counted: dict, link: str = LINK, in_compute: tuple[str, ...] = ()) -> dict:
    """``kernels/predict_scaling.py``'s step model for a fake rank: its measured ms and the bytes its collectives moved
    in one counted step -> ``{comm_ms, predicted_ms}`` (predicted: FSDP-realistic, the EP all-to-alls and small
    all-reduces blocking) under ``link``. ``in_compute``: kinds whose time the measured ms already holds (the
    emulated exchange's all-to-alls, :func:`emulates_exchange`): left out of the sum, their ms reported apart. The
    fake group's writes of the other kinds (``counted["fake_writes_ms"]``) are taken out of the compute, as
    ``predict_scaling.add_predictions`` does; those of ``in_compute`` kinds stay inside their emulated time."""
    ps = sys.modules.get("predict_scaling") or load_script_here("predict_scaling.py")
    comm = [r for r in counted.get("comm", []) if r["kind"] not in in_compute]
    writes = sum(ms for kind, ms in counted.get("fake_writes_ms", {}).items() if kind not in in_compute)
    pred = ps.predict_step((compute_ms - writes) / 1e3, comm, ps.LINKS[link], counted.get("fsdp_edges", []))
    inside = sum(ps.collective_seconds(r["kind"], r["bytes"], r["n"], r["calls"], ps.LINKS[link])
                 for r in counted.get("comm", []) if r["kind"] in in_compute)
    return dict(comm_ms=1e3 * pred["comm"], predicted_ms=1e3 * pred["realistic"], link=link, fake_writes_ms=writes,
                **({"in_compute_ms": 1e3 * inside} if in_compute else {}))


def load_script_here(name: str):
    """A script of this folder as a module (``kernels/`` is not a package)."""
    from k3lab.testing import load_script

    return load_script(os.path.join(HERE, name), name.removesuffix(".py"))


def emulates_exchange(spec: Spec) -> bool:
    """``@exchange=emulated`` (with ``ep_plan=device``): the EP exchanges are ``kernels/predict_scaling.py``'s
    ``emulated_exchange``, which holds the compute stream for each all-to-all's modelled time (CUDA), so the row's ms
    holds the exposed all-to-all time, what the shared expert's side stream hides (``@overlap=true``) taken off."""
    return spec.option("exchange", "stand-in") == "emulated"


def uses_stand_in(spec: Spec, train_cfg) -> bool:
    """Whether a fake EP rank exchanges through ``kernels/predict_scaling.py``'s capturable stand-in (the fixed
    buffers' bytes each way, routing nothing) rather than ``exchange_reference``: with ``ep_plan=device`` and
    ``cuda_graph`` on, which the reference's host read forbids (``k3lab.train.ep_cp_refusal``)."""
    return spec.option("ep", "1") != "1" and spec.option("ep_plan", "host") == "device" and train_cfg.cuda_graph


def via_comparison(rows: list[dict]) -> list[str]:
    """For each config run ``@via=fit`` and ``@via=cli`` or ``@via=fake-rank``: the lines under the table, CLI ÷ fit
    and fake rank ÷ fit (tokens/s per GPU)."""
    lines = []
    for fit_row in (r for r in rows if r.get("via") == "fit" and "tokens_per_s" in r):
        base = fit_row["config"].split("@")[0]
        cli_row = next((r for r in rows if r.get("via") == "cli" and r["config"].split("@")[0] == base
                        and "tokens_per_s" in r), None)
        if cli_row is not None:
            diff = max(abs(a - b) / abs(b) for a, b in zip(cli_row["losses"], fit_row["losses"]))
            lines.append(f"{base}: CLI (torchrun ×1) ÷ fit: tokens/s "
                         f"{cli_row['tokens_per_s'] / fit_row['tokens_per_s']:.3f}×, peak memory "
                         f"{cli_row['peak_mem_gib'] / fit_row['peak_mem_gib']:.3f}×; per-step losses "
                         f"({len(fit_row['losses'])} steps) differ by at most {diff:.2e} (relative)")
        for rank_row in (r for r in rows if str(r.get("via", "")).startswith("fake rank") and "tokens_per_s" in r
                         and r["config"].split("@")[0] == base):
            lines.append(f"{base}: fit as a {rank_row['via']} ÷ fit on one GPU: tokens/s per GPU "
                         f"{rank_row['tokens_per_s'] / fit_row['tokens_per_s']:.3f}× (the rank's compute; its "
                         "collectives are free in the fake group: kernels/predict_scaling.py adds them)")
            if "predicted_ms" in rank_row:
                per_gpu = rank_row["tokens_per_step"] / (rank_row["predicted_ms"] / 1e3)
                lines.append(f"{base}: the same rank with its counted collectives on {rank_row['link']} "
                             f"(kernels/predict_scaling.py's step model: {rank_row['comm_ms']:.1f} ms of them, "
                             f"{rank_row['predicted_ms']:.1f} ms predicted): {per_gpu:,.0f} tokens/s per GPU, "
                             f"{per_gpu / fit_row['tokens_per_s']:.3f}× fit on one GPU")
    return lines


# ----------------------------------------------------------------------------------------------
# the table (in the parent)
# ----------------------------------------------------------------------------------------------
def _fmt(value, spec: str, scale: float = 1.0) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "–"
    return format(value * scale, spec)


def _millions(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2g}M"


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table (a status instead of numbers where a config was skipped or failed)."""
    head = ("| config | model | compile | recompute | fused loss | weights | active / total params | ms/step | tokens/s | "
            "MFU | peak GiB | first step s | loss (first → last) | status |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        params = f"{_millions(r['params_active'])} / {_millions(r['params_total'])}" if "params_active" in r else "–"
        loss = f"{_fmt(r.get('loss_first'), '.3f')} → {_fmt(r.get('loss'), '.3f')}" if "loss" in r else "–"
        lines.append("| " + " | ".join([
            r["config"].split("@")[0] + (f" via {r['via']}" if "via" in r else ""), r.get("model", "?"), r.get("compile", "–") + (" + CUDA graph" if r.get("cuda_graph") else ""),
            r.get("recompute", "–") + (f" ({r['recompute_layers']} layers)" if "recompute_layers" in r else ""),
            r.get("fused_loss", "–"), r.get("weights", "–"), params,
            _fmt(r.get("ms_per_step"), ".1f"), _fmt(r.get("tokens_per_s"), ",.0f"),
            _fmt(r.get("mfu"), ".1f", 100) + ("%" if "mfu" in r else ""), _fmt(r.get("peak_mem_gib"), ".1f"),
            _fmt(r.get("first_step_s"), ".1f"), loss, r.get("status", "?")]) + " |")
    return "\n".join(lines)


def use_autotune_cache(tgz: str) -> str:
    """Unpack ``tgz`` into ``TRITON_CACHE_DIR`` (a fresh folder when unset) for the child processes."""
    cache = os.environ.get("TRITON_CACHE_DIR") or tempfile.mkdtemp(prefix="triton-cache-")
    with tarfile.open(tgz) as tar:
        tar.extractall(cache)
    os.environ["TRITON_CACHE_DIR"] = cache
    return cache


def child_command(name: str, out: str, args) -> list[str]:
    """The command that runs config ``name`` in a fresh process: this script's own flags, and every TrainConfig
    setting of the command line as the flags :func:`k3lab.cli.flags_for` makes of it (a new field included)."""
    return [sys.executable, os.path.abspath(__file__), "--child", name, "--child-out", out,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
            "--peak-flops", repr(args.peak_flops), "--fla-weights", args.fla_weights,
            "--torch-profile", str(args.torch_profile),
            *flags_for(TrainConfig(**train_settings(args)), skip=TRAIN_SKIP)]


def run_in_child(name: str, args) -> dict:
    """One config in a fresh Python process; its row (a crash or a timeout becomes the row's status)."""
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        out = os.path.join(tmp, "row.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        try:
            proc = subprocess.run(child_command(name, out, args), env=env, timeout=args.timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            return dict(config=name, status=f"error: timed out after {args.timeout} s")
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        return dict(config=name, status=f"error: the process exited with code {code} before writing its row"
                                        + (" (killed: out of host memory?)" if code in (-9, 137) else ""))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="MODEL-BxT",
                        help=f"configs to run, in order; MODEL in {MODELS} (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first one (default %(default)s)")
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="where every config trains (resolved in its process; default %(default)s)")
    parser.add_argument("--peak-flops", type=float, default=PEAK_FLOPS,
                        help="the FLOP/s that MFU divides by (default 790e12: H200 bf16 dense, measured)")
    parser.add_argument("--fla-weights", default="bfloat16", choices=DTYPES,
                        help="fla model: bf16 weights without autocast (fla's anchor), or fp32 weights under "
                             "--dtype autocast like the k3lab models (default %(default)s)")
    parser.add_argument("--fla-autotune-cache", default=None, metavar="TGZ",
                        help="unpack this tarball of Triton autotune results into TRITON_CACHE_DIR first")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per config (default %(default)s)")
    parser.add_argument("--json", default=None, help="write every row (and the settings) to this file")
    parser.add_argument("--torch-profile", type=int, default=0, metavar="TOP",
                        help="run one more step per config under torch.profiler (not timed) and print its TOP ops "
                             "by device and host time, its kernel count and kernel time (default 0: off)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    add_dataclass_flags(parser, TrainConfig, skip=TRAIN_SKIP, defaults=TRAIN_DEFAULTS,
                        title="training (k3lab.train.TrainConfig; per config: @key=value)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    with flag_errors(parser):  # TrainConfig's own checks, before any child starts: "error: --flag: reason"
        base = train_settings(args)
        TrainConfig(**base)
        specs = [parse_config(name, base) for name in ([args.child] if args.child else args.configs)]

    if args.child:  # one config, in this fresh process
        row = run_config(specs[0], args)
        with open(args.child_out, "w") as f:
            json.dump(row, f)
        return

    if args.fla_autotune_cache:
        print(f"TRITON_CACHE_DIR={use_autotune_cache(args.fla_autotune_cache)}", flush=True)
    peak_source = PEAK_SOURCE if args.peak_flops == PEAK_FLOPS else f"{args.peak_flops / 1e12:g} TFLOP/s (--peak-flops)"
    rows = []
    for spec in specs:
        cfg = train_config(spec, base)
        print(f"== {spec.name}: {cfg.steps} steps (1 first, {args.warmup} warm-up, {args.steps} timed), "
              f"dtype {cfg.dtype}, {cfg.optimizer}, compile {cfg.compile}, recompute {cfg.recompute}, "
              f"param_dtype {cfg.param_dtype}", flush=True)
        if spec.model == "fla-kda-anchor" and (args.device == "cpu" or importlib.util.find_spec("fla") is None):
            row = dict(config=spec.name, model="fla", B=spec.B, T=spec.T, compile="none",
                       status="skipped: fla's kernels need CUDA" if args.device == "cpu" else
                       "skipped: fla is not importable (pip install flash-linear-attention)")
        else:
            row = run_in_child(spec.name, args)
        rows.append(row)
        print(f"   {json.dumps(row)}", flush=True)
    first = next((r for r in rows if "torch" in r), {})
    print()
    print(f"device {first.get('device', '?')}, torch {first.get('torch', '?')}, triton {first.get('triton', '–')}"
          + (f", fla {r['fla']}" if (r := next((r for r in rows if "fla" in r), None)) else "")
          + f"; MFU = 6·active params·tokens/s ÷ {peak_source}")
    print(markdown_table(rows))
    for line in via_comparison(rows):
        print(line)
    if args.torch_profile:  # one untimed step of each config under torch.profiler
        ps = sys.modules.get("predict_scaling") or load_script_here("predict_scaling.py")
        for row in rows:
            ps.print_profile(row)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if not k.startswith("child")}
        with open(args.json, "w") as f:
            json.dump(dict(settings=settings, peak_flops=args.peak_flops, peak_source=peak_source, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
