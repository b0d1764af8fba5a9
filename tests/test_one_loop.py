"""The one training loop: every switch that runs on CPU gives the same losses at 2 ranks as in one process,
a resume honours changed settings and says so, and bad input is refused by name (config, fit, CLI)."""
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3lab.config import ModelConfig
from k3lab.data import batch_iterator
from k3lab.model import K3ForCausalLM
from k3lab.optim import cosine_lr
from k3lab.parallel.parallelize import ParallelOptions
from k3lab.parallel.spawn import run_ranks
from k3lab.train import TrainConfig, TrainingDiverged, fit

STEPS = 3


def _batches(seed=0, batch=4, seq=64):
    ids = torch.randint(0, 4096, (20000,), generator=torch.Generator().manual_seed(seed))
    return batch_iterator(ids, batch, seq, seed=seed)


def _cfg(**kw):
    return TrainConfig(**{**dict(steps=STEPS, lr=1e-2, progress=False, device="cpu"), **kw})


def _two_rank_jobs(rank, world, out_dir):
    """Every 2-rank worker of this module, one after another in one start-up of the ranks (each spawned process
    imports torch and k3lab: about 4 s of CPU). A job's exception is returned with its traceback, not raised, so
    that only the test that owns the job fails."""
    import traceback

    jobs = {"switch": (_switch_worker,), "refusal": (_refusal_worker, dict(cuda_graph=True), dict(ep=2)),
            "graph on cpu": (_refusal_worker, dict(cuda_graph=True), {}),
            "master switch": (_master_switch_worker,), "eval": (_eval_worker,),
            "shard step": (_shard_step_worker, os.path.join(out_dir, "shard_step")),
            "master resume": (_master_resume_worker, os.path.join(out_dir, "master_resume"))}
    out = {}
    for name, (worker, *args) in jobs.items():
        try:
            out[name] = ("ok", worker(rank, world, *args))
        except Exception:  # noqa: BLE001 — reported by the test that owns the job
            out[name] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_two_rank_jobs, 2, str(tmp_path_factory.mktemp("two_ranks")))


def _job(two_ranks, name):
    """Job ``name``'s result on each rank (a rank's error fails the calling test with its traceback)."""
    for rank, out in enumerate(two_ranks):
        status, value = out[name]
        if status == "error":
            pytest.fail(f"rank {rank}, job {name!r}:\n{value}")
    return [out[name][1] for out in two_ranks]


# every switch of TrainConfig that runs on CPU (and of ParallelOptions that one process does not have), and the
# tolerance of 2 ranks against one process: fp32 switches change only summation order (1e-5); bf16 weights are fp32
# masters in both, but one process rounds the gradients to bf16 before reducing them and FSDP2 reduces in fp32
# (bf16 noise, 2e-2)
SWITCHES = {
    "ep=2 (AdamW's groups split into DTensor shards and expert slices)": (dict(), 1e-5),
    "recompute=sublayer": (dict(recompute="sublayer"), 1e-5),
    "recompute=mixer": (dict(recompute="mixer"), 1e-5),
    "fused_loss": (dict(fused_loss=True), 1e-5),
    "bf16 weights, fp32 masters": (dict(dtype="bfloat16", param_dtype="bfloat16"), 2e-2),
    "reshard_after_forward=False (FSDP2 keeps the gathered weights to the backward)": (dict(), 1e-5),
}
PARALLEL = {name: (dict(ep=2) if name.startswith("ep=2") else
                   dict(reshard_after_forward=False) if name.startswith("reshard_after_forward") else {})
            for name in SWITCHES}


class _CountGathers(TorchDispatchMode):
    """Counts the all-gather collectives issued under it (FSDP2's, and the balancer's: the same in every run)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += "allgather" in func.name() or "all_gather" in func.name()
        return func(*args, **(kwargs or {}))


def _switch_worker(rank, world):
    cfg = ModelConfig.preset("tiny")
    out, gathers = {}, {}
    for name, (kw, _) in SWITCHES.items():
        opts = ParallelOptions(**PARALLEL[name])
        with _CountGathers() as count:
            result = fit(lambda: K3ForCausalLM(cfg), _batches(), _cfg(**kw), parallel=opts)
        out[name], gathers[name] = result.losses, count.calls
    return out, gathers


def test_switches_at_two_ranks_equal_one_process(two_ranks):
    ranks, gathers = zip(*_job(two_ranks, "switch"))
    # the switch took effect: the sublayers' weights are not gathered again for the backward
    assert gathers[0]["reshard_after_forward=False (FSDP2 keeps the gathered weights to the backward)"] < (
        gathers[0]["fused_loss"]), gathers[0]
    cfg = ModelConfig.preset("tiny")
    for name, (kw, tol) in SWITCHES.items():
        torch.manual_seed(0)
        one = fit(K3ForCausalLM(cfg), _batches(), _cfg(**kw)).losses
        assert ranks[0][name] == ranks[1][name], name  # every rank reports the global loss
        for a, b in zip(ranks[0][name], one):
            assert abs(a - b) / abs(b) < tol, (name, ranks[0][name], one)


def test_graph_refused_with_expert_parallel_and_on_a_cpu_with_the_reason(two_ranks):
    """The CUDA-graph step with EP is refused at 2 ranks naming the field, the degrees and why, before any group is
    made (never silently ignored); FSDP alone takes it on CUDA, and on a CPU is refused as at world size 1."""
    errors = _job(two_ranks, "refusal")
    assert all("TrainConfig.cuda_graph=True" in e and "ep=2, cp=1" in e and "host" in e for e in errors), errors
    errors = _job(two_ranks, "graph on cpu")
    assert all("TrainConfig.cuda_graph=True needs a CUDA device" in e for e in errors), errors


def test_graphs_with_expert_parallel_need_a_device_plan_over_a_capturable_exchange():
    """``ep_cp_refusal`` (what ``fit`` checks before any group is made): CUDA graphs with EP only where MoonEP is
    planned on the device and its exchange reads nothing on the host: today only inside ``default_exchange`` with the
    timing harness's stand-in. CP, the host plan, and the reference exchange are refused naming the field and why."""
    from k3lab.parallel.expert_static import capturable, default_exchange, exchange_reference
    from k3lab.parallel.parallelize import ParallelOptions
    from k3lab.train import ep_cp_refusal

    def stand_in(x, send, recv, rows_out, group):  # noqa: ARG001 — a capturable exchange's signature
        return x

    stand_in.capturable = True
    graphed = _cfg(cuda_graph=True)
    device_plan = ParallelOptions(ep=2, ep_plan="device")
    assert not capturable(exchange_reference) and capturable(stand_in)
    assert "TrainConfig.cuda_graph=True: with ep=2, cp=1" in ep_cp_refusal(graphed, device_plan, 2)
    with default_exchange(stand_in):
        assert ep_cp_refusal(graphed, device_plan, 2) is None
        for other in (ParallelOptions(ep=2), ParallelOptions(ep=2, cp=2, ep_plan="device")):
            assert "TrainConfig.cuda_graph=True" in ep_cp_refusal(graphed, other, 4)
    assert "TrainConfig.cuda_graph=True" in ep_cp_refusal(graphed, device_plan, 2)  # the block's end restores it
    assert ep_cp_refusal(_cfg(), device_plan, 2) is None and ep_cp_refusal(graphed, ParallelOptions(), 2) is None


# ---------------------------------------------------------------------------------------------
# bf16 moments and split masters on FSDP2's local shards (k3lab.train.shard_masters)
# ---------------------------------------------------------------------------------------------
MASTER_SETTINGS = {"bf16 moments": dict(moment_dtype="bfloat16"), "split masters": dict(master_format="split"),
                   "both": dict(moment_dtype="bfloat16", master_format="split")}
BF16_WEIGHTS = dict(dtype="bfloat16", param_dtype="bfloat16")
# 2 ranks against one process with bf16 weights and the masters on the shards: the same fused step on the same
# elements (exact: test_master_step_on_local_shards_is_the_one_process_step); what differs is the gradient's
# bf16 rounding: one process rounds the whole batch's gradient once, 2 ranks round each half, sum them in
# float32 and round the sum (measured: < 4e-4 relative over 3 steps)
BF16_GRADIENTS = 2e-3


def _master_switch_worker(rank, world):
    cfg = ModelConfig.preset("tiny")
    return {name: fit(lambda: K3ForCausalLM(cfg), _batches(), _cfg(**BF16_WEIGHTS, **kw),
                      parallel=ParallelOptions()).losses for name, kw in MASTER_SETTINGS.items()}


def test_bf16_moments_and_split_masters_at_two_ranks_equal_one_process(two_ranks):
    ranks = _job(two_ranks, "master switch")
    cfg = ModelConfig.preset("tiny")
    for name, kw in MASTER_SETTINGS.items():
        torch.manual_seed(0)
        one = fit(K3ForCausalLM(cfg), _batches(), _cfg(**BF16_WEIGHTS, **kw)).losses
        assert ranks[0][name] == ranks[1][name], name
        for a, b in zip(ranks[0][name], one):
            assert abs(a - b) / abs(b) < BF16_GRADIENTS, (name, ranks[0][name], one)


def _toy_bf16(seed=0):
    """Parameters of several shapes, one with an uneven split over 2 ranks (5 rows: 3 + 2), in bf16."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 4, bias=False))
    return model.to(torch.bfloat16)


def _sharded(model, mesh):
    """``model`` with every parameter replaced by its Shard(0) DTensor over ``mesh`` (FSDP2's layout)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shard_step_worker(rank, world, out_dir):
    """The master-weight step on Shard(0) DTensors at 2 ranks against the same step on the whole tensors in
    this process (the CPU: the kernel's plain-PyTorch reference), three steps with clipping active, then a DCP
    save and a load into a fresh model and optimizer: whether each tensor is bit for bit equal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from k3lab.optim import build_optimizer
    from k3lab.parallel.checkpoint import load_distributed, save_distributed
    from k3lab.parallel.fsdp import grad_norm
    from k3lab.precision import MasterWeightOptimizer

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, kw in MASTER_SETTINGS.items():
        def build(model):
            return MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=3e-2, weight_decay=0.1), **kw)

        one, sharded = _toy_bf16(), _sharded(_toy_bf16(), mesh)
        opt_one, opt_sharded = build(one), build(sharded)
        same = []

        def compare(tag, a_opt, a_model, b_opt, b_model):
            same.append((tag, all(torch.equal(_full(p), _full(q)) for p, q in zip(a_model.parameters(),
                                                                                  b_model.parameters()))
                         and all(torch.equal(_full(w), _full(v)) for w, v in zip(a_opt.float32_masters(),
                                                                                b_opt.float32_masters()))
                         and all(torch.equal(_full(a_opt.state[w][k]), _full(b_opt.state[v][k]))
                                 for w, v in zip(a_opt.masters, b_opt.masters) for k in ("exp_avg", "exp_avg_sq", "step"))))

        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p, q in zip(one.parameters(), sharded.parameters()):
                p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
                q.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
            for group in (*opt_one.param_groups, *opt_sharded.param_groups):
                group["lr"] = 3e-2 / (step + 1)
            norms = [grad_norm(list(m.parameters()), set(), 1, g) for m, g in ((one, None), (sharded, mesh.get_group()))]
            same.append((f"norm {step}", torch.equal(norms[0].float(), norms[1].float())  # what the clip reads
                         and abs(float(norms[0]) / float(norms[1]) - 1) < 1e-12))
            opt_one.clip_grad_norm_(0.5, norm=norms[0])
            opt_sharded.clip_grad_norm_(0.5, norm=norms[1])
            opt_one.step()
            opt_sharded.step()
            compare(f"step {step}", opt_one, one, opt_sharded, sharded)
        save_distributed(out_dir, 3, sharded, opt_sharded, {})
        fresh = _sharded(_toy_bf16(seed=1), mesh)
        opt_fresh = build(fresh)
        load_distributed(out_dir, fresh, opt_fresh)
        compare("loaded", opt_sharded, sharded, opt_fresh, fresh)
        out[name] = same
    return out


def test_master_step_on_local_shards_is_the_one_process_step(two_ranks):
    """bf16 moments and split masters on FSDP2-style shards: the fused step is elementwise, so each rank stepping
    its rows gives, bit for bit, the one-process step of the whole tensors (given the same global norm, itself
    equal in float32, what the step reads, and within 1e-12 in float64: per-tensor float64 norms); a DCP checkpoint restores weights, masters (split: p and lo), moments
    and step counts bit for bit."""
    for rank_out in _job(two_ranks, "shard step"):
        for name, checks in rank_out.items():
            assert all(ok for _, ok in checks), (name, [tag for tag, ok in checks if not ok])


def _master_resume_worker(rank, world, out_dir):
    cfg = ModelConfig.preset("tiny")
    kw = dict(BF16_WEIGHTS, **MASTER_SETTINGS["both"], steps=4)
    runs = {}
    for name, stop_at, resume in (("full", None, False), ("half", 2, False), ("resumed", None, True)):
        folder = os.path.join(out_dir, "full" if name == "full" else "half")
        runs[name] = fit(lambda: K3ForCausalLM(cfg), _batches(), _cfg(**kw, out_dir=folder), stop_at=stop_at,
                         resume_from=folder if resume else None, parallel=ParallelOptions()).losses
    try:  # the same checkpoint under FSDP2 mixed precision (fp32 shards as the masters): another layout
        fit(lambda: K3ForCausalLM(cfg), _batches(), _cfg(**BF16_WEIGHTS, steps=4),
            resume_from=os.path.join(out_dir, "half"), parallel=ParallelOptions())
        runs["other layout"] = "no error"
    except ValueError as err:
        runs["other layout"] = str(err)
    return runs


def test_resume_with_bf16_moments_and_split_masters_at_two_ranks(two_ranks):
    """A 2-rank run with bf16 moments and split masters, stopped after 2 of 4 steps and resumed from its DCP
    checkpoint, gives the uninterrupted run's losses bit for bit (steps 3 and 4 read the restored masters, moments
    and step counts); resuming it with the fp32-moment layout is refused naming the fields."""
    for runs in _job(two_ranks, "master resume"):
        assert runs["half"] + runs["resumed"][2:] == runs["full"] and runs["resumed"] == runs["full"], runs
        assert "TrainConfig.moment_dtype='float32', master_format='float32'" in runs["other layout"], runs


def _refusal_worker(rank, world, kw, parallel):
    try:
        fit(lambda: K3ForCausalLM(ModelConfig.preset("tiny")), _batches(), _cfg(**kw), parallel=ParallelOptions(**parallel))
    except ValueError as err:
        return str(err)
    return "no error"


def test_world_size_one_plan_runs_every_switch_as_fit():
    """parallel=ParallelOptions() without a process group is fit itself (bit for bit), with switches on."""
    cfg = ModelConfig.preset("tiny")
    kw = dict(recompute="sublayer", fused_loss=True, dtype="bfloat16", param_dtype="bfloat16")
    torch.manual_seed(0)
    ref = fit(K3ForCausalLM(cfg), _batches(), _cfg(**kw)).losses
    got = fit(lambda: K3ForCausalLM(cfg), _batches(), _cfg(**kw), parallel=ParallelOptions())
    assert got.losses == ref
    assert got.info["world_size"] == 1 and got.tokens_per_s > 0


# ---------------------------------------------------------------------------------------------
# resume: a changed setting is honoured and named
# ---------------------------------------------------------------------------------------------
def _run(tmp, stop_at=None, resume=False, batches=None, data=None, **kw):
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.preset("tiny"))
    cfg = _cfg(steps=4, out_dir=str(tmp), **kw)
    return fit(model, batches or _batches(), cfg, stop_at=stop_at, resume_from=str(tmp) if resume else None,
               data=data)


@pytest.fixture(scope="module")
def half_run(tmp_path_factory):
    """A run stopped after 2 of 4 steps; each test resumes a copy of it."""
    import shutil

    src = tmp_path_factory.mktemp("half")
    _run(src, stop_at=2, data="random-ids")

    def copy(tmp_path):
        dst = tmp_path / "run"
        shutil.copytree(src, dst)
        return dst
    return copy


def test_resume_honours_a_changed_lr_and_says_so(half_run, tmp_path):
    same = _run(half_run(tmp_path / "a"), resume=True, data="random-ids")
    with pytest.warns(UserWarning, match=r"honoured \(this run's values\): lr 0\.01 -> 0\.005"):
        changed = _run(half_run(tmp_path / "b"), resume=True, data="random-ids", lr=5e-3)
    cfg = _cfg(steps=4, lr=5e-3)
    assert changed.history[2]["lr"] == cosine_lr(2, 4, cfg.warmup, 5e-3, cfg.min_lr_ratio)  # this run's schedule
    assert changed.history[2]["loss"] == same.history[2]["loss"]   # step 3's loss is before step 3's update
    assert changed.history[3]["loss"] != same.history[3]["loss"]   # the changed lr moved the weights


@pytest.mark.parametrize("change", [dict(weight_decay=0.5), dict(betas=(0.5, 0.9))])
def test_resume_honours_changed_optimizer_settings(half_run, tmp_path, change):
    same = _run(half_run(tmp_path / "a"), resume=True, data="random-ids")
    name = next(iter(change))
    with pytest.warns(UserWarning, match=rf"honoured \(this run's values\): {name} "):
        changed = _run(half_run(tmp_path / "b"), resume=True, data="random-ids", **change)
    assert changed.history[3]["loss"] != same.history[3]["loss"]


def test_resume_warns_when_seed_batch_or_data_differ(half_run, tmp_path):
    with pytest.warns(UserWarning, match=r"differ from the checkpoint .*seed 0 -> 1.*batch_shape \[4, 64\] -> "
                                         r"\[2, 64\].*data 'random-ids' -> 'other'"):
        _run(half_run(tmp_path), resume=True, seed=1, batches=_batches(batch=2), data="other")


def test_resume_with_another_optimizer_is_refused(half_run, tmp_path):
    with pytest.raises(ValueError, match=r"TrainConfig.optimizer='muon': the checkpoint was trained with "
                                         r"optimizer='adamw'"):
        _run(half_run(tmp_path), resume=True, optimizer="muon")


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("lr", math.inf), ("lr", math.nan), ("weight_decay", math.inf),
                                          ("steps", True), ("grad_clip", math.inf), ("betas", (0.9, math.nan)),
                                          ("seed", 1.5), ("progress", 1)])
def test_train_config_refuses_non_finite_and_mistyped_values(field, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field}="):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("timeout", 0), ("timeout", -5), ("timeout", math.nan), ("cp", 0),
                                          ("ep_kind", "pipeline"), ("dp_shard", 0)])
def test_parallel_options_refuse_bad_values(field, value):
    with pytest.raises(ValueError, match=rf"ParallelOptions\.{field}="):
        ParallelOptions(**{field: value})


def test_stop_at_must_be_positive():
    with pytest.raises(ValueError, match=r"stop_at=-1: must be None or an int >= 1"):
        fit(K3ForCausalLM(ModelConfig.preset("tiny")), _batches(), _cfg(), stop_at=-1)


def test_diverged_weights_stop_the_run_by_name():
    """NaN weights (what a huge learning rate makes) end the run with TrainingDiverged, not a crash in the
    router's histogram."""
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.preset("tiny"))
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(math.nan)
    with pytest.raises(TrainingDiverged, match=r"non-finite loss \(loss=nan.*at step 1"):
        fit(model, _batches(), _cfg())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "k3lab.parallel.run", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("args, message", [
    (["--lr", "inf"], "error: --lr: must be a finite number > 0"),
    (["--stop-at", "-1"], "error: argument --stop-at: -1: must be an int >= 1"),
    (["--timeout", "0"], "error: --timeout: must be a finite number of seconds > 0"),
    (["--ep", "3"], "error: --ep: must divide the dp_shard·cp = 1 ranks it borrows"),
    (["--ep-plan", "device", "--ep-kind", "ep"], "error: --ep-plan: 'device' plans MoonEP only: with ep_kind='ep' use"),
    (["--ep-chunks", "2"], "error: --ep-chunks: chunks need MoonEP planned on the device: set ep_plan='device'"),
    (["--recompute-layers", "2"], "error: --recompute-layers: needs TrainConfig.recompute in"),
    (["--bogus", "1"], "error: unrecognized arguments: --bogus 1"),
    (["--steps"], "error: argument --steps: expected one argument"),
])
def test_cli_errors_name_the_flag(args, message, capsys):
    """Each case fails before anything starts, so it runs in this process (a real process: the next test)."""
    from k3lab.parallel.run import main

    with pytest.raises(SystemExit) as exit_:
        main(["--data", "random", "--steps", "1", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.strip().splitlines()[-1], err[-2000:]


def test_cli_error_from_the_command_line_is_one_line_and_exit_2():
    run = _cli("--data", "random", "--steps", "1", "--lr", "inf")
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert "error: --lr: must be a finite number > 0" in lines[-1] and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_cli_exposes_every_training_and_plan_field():
    from k3lab.parallel.run import build_parser

    flags = {a.dest for a in build_parser()._actions}
    for cls in (TrainConfig, ParallelOptions):
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in flags]
        assert not missing, (cls.__name__, missing)


def test_flags_for_gives_the_config_back():
    """k3lab.cli.flags_for is the inverse of the generated parser: a script that starts another run (bench_train's
    via=cli rows) passes every field of its TrainConfig as flags and the run gets the same TrainConfig."""
    from k3lab.cli import dataclass_from_flags, flags_for
    from k3lab.parallel.run import build_parser

    cfg = TrainConfig(steps=7, lr=1e-3, betas=(0.8, 0.9), warmup_steps=0, dtype="bfloat16", param_dtype="bfloat16",
                      fused_loss=True, optimizer_kwargs={"muon_lr": 0.02}, recompute="mixer", recompute_layers=2,
                      progress=False, name="x")
    opts = ParallelOptions(cp=2, ep_kind="ep", timeout=30.0, shared_overlap=True)
    args = build_parser().parse_args(flags_for(cfg) + flags_for(opts))
    assert dataclass_from_flags(TrainConfig, args) == cfg
    assert dataclass_from_flags(ParallelOptions, args) == opts


def test_a_stalled_rank_is_named_within_the_timeout():
    """Rank 1 stops (SIGSTOP) at step 2 of a torchrun run: the run ends within about --timeout with an error that
    names rank 1 (not the healthy rank 0 whose collective waited), and launch() leaves no process behind."""
    import time

    from k3lab.parallel.launch import LaunchError, launch

    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 stopped responding") as err:
        launch(2, "--steps", "6", "--data", "random", "--batch-size", "4", "--seq-len", "32", "--timeout", "8",
               "--device", "cpu", timeout=120, progress=False,
               env={"K3LAB_FAULT_RANK_STEP": "1:2:stop", "K3LAB_TEST_MARKER": str(os.getpid())})
    took = time.monotonic() - t0
    assert took < 60, took
    assert "rank 0 failed" in str(err.value), str(err.value)[:500]  # rank 0's watchdog named rank 1
    marker = f"K3LAB_TEST_MARKER={os.getpid()}".encode()  # this test's processes, found by their environment
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes():
                left.append(proc.name)
        except OSError:
            continue
    assert not left, f"processes left running: {left}"


def _eval_worker(rank, world):
    cfg = ModelConfig.preset("tiny").replace(num_nextn_predict_layers=1)
    result = fit(lambda: K3ForCausalLM(cfg), _batches(), _cfg(eval_every=2, eval_batches=2),
                 val_batches=_batches(seed=1), parallel=ParallelOptions(cp=2))
    return result.column("val_loss")


def test_evaluation_under_the_plan_equals_one_process(two_ranks):
    """Validation under context parallelism (each rank evaluates its slice of every global batch, the shares summed)
    gives the one-process validation loss."""
    ranks = _job(two_ranks, "eval")
    cfg = ModelConfig.preset("tiny").replace(num_nextn_predict_layers=1)
    torch.manual_seed(0)
    one = fit(K3ForCausalLM(cfg), _batches(), _cfg(eval_every=2, eval_batches=2), val_batches=_batches(seed=1))
    steps, ref = one.column("val_loss")
    assert ranks[0] == ranks[1] and ranks[0][0] == steps == [2, 3]
    for a, b in zip(ranks[0][1], ref):
        assert abs(a - b) / b < 1e-5, (ranks[0][1], ref)


@pytest.mark.gpu
def test_master_step_on_cuda_shards_is_the_one_gpu_step():
    """The fused master step (the Triton kernel) on CUDA DTensor shards: rank 0 of a 2-rank group (PyTorch's fake
    process group; no second GPU needed) steps the first rows of each parameter exactly as the one-GPU step of the
    whole tensors steps them, for bf16 moments and split masters, three steps with clipping active (the same
    global norm given to both: the fake group does not sum it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from k3lab.optim import build_optimizer
    from k3lab.precision import MasterWeightOptimizer

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    world = 2
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cuda", (world,))

        def first_rows(t):  # rank 0's Shard(0) chunk (torch.chunk: ceil(n / world) rows)
            return t.chunk(world, 0)[0]

        def sharded_copy(model):
            out = _toy_bf16().cuda()
            for (_, p), (mod, name) in zip(model.named_parameters(),
                                           [(m, n) for m in out.modules() for n, _ in m.named_parameters(recurse=False)]):
                local = first_rows(p.detach()).clone()
                setattr(mod, name, torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                                         shape=p.shape, stride=p.stride())))
            return out

        for name, kw in MASTER_SETTINGS.items():
            def build(model):
                return MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=3e-2, weight_decay=0.1), **kw)

            one = _toy_bf16().cuda()
            sharded = sharded_copy(one)
            opt_one, opt_sharded = build(one), build(sharded)
            assert opt_one.kernel and opt_sharded.kernel, (name, opt_one.why_not_fused(), opt_sharded.why_not_fused())
            for step in range(3):
                gen = torch.Generator().manual_seed(step)
                for p, q in zip(one.parameters(), sharded.parameters()):
                    p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16).cuda()
                    q.grad = DTensor.from_local(first_rows(p.grad).clone(), mesh, [Shard(0)], run_check=False,
                                                shape=p.shape, stride=p.stride())
                for group in (*opt_one.param_groups, *opt_sharded.param_groups):
                    group["lr"] = 3e-2 / (step + 1)
                norm = torch.stack([p.grad.double().pow(2).sum() for p in one.parameters()]).sum().sqrt()
                opt_one.clip_grad_norm_(0.5, norm=norm)
                opt_sharded.clip_grad_norm_(0.5, norm=norm.clone())
                opt_one.step()
                opt_sharded.step()
                for (pn, p), q in zip(one.named_parameters(), sharded.parameters()):
                    assert torch.equal(first_rows(p.detach()), q.to_local()), (name, step, pn)
                for w, v in zip(opt_one.masters, opt_sharded.masters):
                    for k in ("exp_avg", "exp_avg_sq"):
                        local = opt_sharded.state[v][k]
                        local = local.to_local() if hasattr(local, "to_local") else local
                        assert torch.equal(first_rows(opt_one.state[w][k]), local), (name, step, k)
    finally:
        dist.destroy_process_group()
