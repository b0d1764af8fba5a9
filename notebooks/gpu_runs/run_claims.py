"""Run the claim notebooks (01, 05, 06, 07, 16) at the GPU scale in one device call, through papermill (issue 29).

From the repository root on the GPU machine (k3lab importable, papermill and ipykernel installed):

    python notebooks/gpu_runs/run_claims.py --plan                        # measured seconds: what fits in one call
    python notebooks/gpu_runs/run_claims.py --out "$OUT" --only 01          # scale "gpu": one notebook per device call
    python notebooks/gpu_runs/run_claims.py --out /tmp/claims --smoke       # scale "smoke": the same pipeline on a CPU
    python notebooks/gpu_runs/run_claims.py --out "$OUT" --only 01 --resume notebooks/gpu_runs   # train what is missing

``--resume`` applies to the notebooks that reuse logged runs (:data:`RESUMABLE`: 01, 06 and 16; 06 trains its
first seed of AttnRes full and of its finest blocks again, whose models its heatmaps need); the others train all
their runs in one call and refuse it. A device call returns at most 8 files from ``$OUT``: one notebook leaves 4.

Each notebook runs as ``papermill <notebook> OUT/<notebook> -p scale gpu -p runs_file OUT/<name>.runs.jsonl
-p budget_s B``, in its own process and kernel, one at a time (``--jobs``, default 1: on 2026-12-04 three notebooks
sharing one H200 each ran 2.5-4x slower than alone, see :data:`MEASURED`). Nothing is cut mid-result:

* each notebook stops starting runs when its training budget ``B`` (``k3lab.experiments.scales.SCALES``, capped by
  the time left) is spent, and judges its claims on the whole seeds it finished;
* every finished run is appended to ``OUT/NN_x.runs.jsonl`` as it finishes, and papermill saves the executed
  notebook as it goes, so a notebook killed at its hard limit (``B`` + ``--grace`` seconds) still leaves both;
* after each notebook a first cell is added to its executed copy: date, machine, versions, parameters, wall time;
* the last lines printed are a summary table (notebook, status, seconds, the ``VERDICT`` lines), also written to
  ``OUT/summary.md``.

``--plan`` prints, from the per-run seconds measured on one H200 or H100 (:data:`MEASURED`, read from the committed
``notebooks/gpu_runs/*.runs.jsonl``), what 3 seeds of each notebook take at today's sizes and whether it fits in one
device call; ``--estimate`` adds the FLOP-based estimate (which was 3-5x too optimistic).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = {"01": "01_linear_attention_lineage", "05": "05_nope_vs_rope", "06": "06_attention_residuals",
             "07": "07_latent_moe_and_situ", "16": "16_mixers_hard_regime"}
MULTI_CALL = ("16",)  # notebooks whose 3 seeds need more than one call: each call trains what its budget allows and
# the next resumes from the runs file (--resume notebooks/gpu_runs)
RESUMABLE = ("01", "06", "16")  # notebooks that reuse the runs their runs file holds; the others train every run again
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
H200_BF16_PEAK = 990e12  # dense bf16 FLOP/s
MFU = 0.30  # what the small models are assumed to reach when compute-bound
CALL_S = 560.0  # one device call: 9 min 20 s (the device allows 10 a command; installing the wheels takes ~15 s)
OVERHEAD_S = 45.0  # per notebook outside its training budget: kernel start, imports, CUDA init, data, plots

# Seconds per training run measured on one NVIDIA H200 on 2026-12-04 (torch 2.11.0+cu130; 06 and 16 on one H100 on
# 2026-12-06, ``gpu``), from the committed runs files (``notebooks/gpu_runs/NN_*.runs.jsonl``, ``seconds``;
# ``tests/test_gpu_runs.py`` checks they agree) and, for 16, whose runs file did not come back, its progress bar.
# ``first``: the notebook's first run, which also compiles Triton kernels and captures CUDA graphs; ``per_run``: the
# mean of the later runs; ``steps``: the steps they ran;
# ``shared``: the notebook ran with two others on the same GPU (``--jobs 3``). Shared runs were 2.5-4x slower:
# 05's runs took 58.8-64.9 s at 800 steps shared, 14.4-14.7 s at 500 alone (0.073-0.081 vs 0.029 s a step).
SHARED_SLOWDOWN = 2.5  # the smallest ratio seen; a shared measurement divided by it is an optimistic "alone" figure
MEASURED = {
    # 01: a run is the better of two learning rates (two trainings): KDA 60-96 s (96.3 the first, with compilation),
    # Gated DeltaNet 27-28 s, Mamba2 19-20 s, linear attention 18 s, RetNet 39 s (an earlier call, sharing the GPU at
    # one lr: KDA 115.4, GDN 40.1, Mamba2 31.6 s)
    "01": dict(steps=1000, shared=False, first=96.3, per_run=32.1,
               runs_file="01_linear_attention_lineage.runs.jsonl"),
    "05": dict(steps=500, shared=False, first=47.0, per_run=14.2,  # 7 later runs 11.0-15.7 s; 8 runs in 146 s
               runs_file="05_nope_vs_rope.runs.jsonl"),
    # 06: two H100 calls, 14 runs (the first call 10 in 345 s of a 360 s budget: seed 2 was cut, so the budget is now
    # 440 s; the second call, resumed before 06 reused logged runs, trained seed 0 again): PreNorm 22 s, AttnRes 1 block 27 s,
    # 8 blocks 35 s, full 45 s (on one H200 at 300 steps: 65-78 s shared, 31 s alone); a third call (2026-12-06
    # evening) logged 3 runs before it ran out of memory: PreNorm 40 s (compiling), 1 block 28 s, 8 blocks 40 s (eager);
    # a fourth call (2026-12-06, late) finished it: 10 runs in 362 s (2 reused)
    "06": dict(steps=250, shared=False, first=38.3, per_run=34.5, gpu="H100",
               runs_file="06_attention_residuals.runs.jsonl"),
    "07": dict(steps=500, shared=False, first=19.1, per_run=13.8,  # 5 later runs 12.4-15.6 s (estimated 30 s before)
               runs_file="07_latent_moe_and_situ.runs.jsonl"),
    # 16: three H100 calls on 2026-12-06 (resumed through the runs file), 54 runs in 899 s: the first (MQAR, KDA,
    # D = 64, with compilation) 39 s; MQAR KDA 21-62 s, Gated DeltaNet 20-28 s, Mamba2 16-23 s, linear attention
    # 15-21 s; palindrome 3-11 s; stack 10-36 s (an earlier call whose runs file did not come back: 22 runs in 372 s).
    # Two more H100 calls on 2026-12-07 retrained MQAR on the 16-128 pair mix (KDA 21-65 s, Gated DeltaNet 20-28 s,
    # Mamba2 16-23 s, linear attention 15-22 s) and one palindrome run: 20 runs in 550 s; a third call that day the
    # rest of seed 2's MQAR and 11 palindrome and stack runs, 16 runs in 330 s; a fourth the last 3 stack runs
    # (Mamba2 16 s, linear attention 10 and 14 s), 64 s; 93 runs logged in all
    "16": dict(steps=1000, shared=False, first=39.4, per_run=18.3, gpu="H100",
               runs_file="16_mixers_hard_regime.runs.jsonl"),
}


def ensure_kernel(name: str = "python3") -> None:
    """Register this interpreter's Jupyter kernel when no kernel ``name`` exists (a fresh GPU machine)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user", "--name", name], check=True)


def machine() -> dict:
    """Date, machine and versions for the record cell."""
    import torch

    info = {"date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda or "none",
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)",
            "cpu cores": os.cpu_count()}
    for package in ("triton", "papermill", "numpy"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = "absent"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "k3lab", "notebooks"], cwd=ROOT,
                               capture_output=True, text=True).stdout.split("\n")
        changed = [line[3:] for line in dirty if line[:2].strip() and not line.startswith("??")]
        if changed:
            info["commit"] += f" with uncommitted changes to {', '.join(changed[:5])}"
    except OSError:
        info["commit"] = "unknown"
    return info


def verdicts_of(path: Path) -> list[str]:
    """The ``VERDICT ...`` lines an executed notebook printed (stdout streams), in order."""
    if not path.is_file():
        return []
    try:
        nb = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    found = []
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stdout":
                text = "".join(out.get("text", ""))
                found += [line for line in text.splitlines() if line.startswith("VERDICT ")]
    return found


READ_ONLY_NOTE = ("*A read-only record: JupyterLab started as the README says (`jupyter lab "
                  "--config=jupyter_server_config.py notebooks/`) opens it read-only and never saves it. To run it, "
                  "save a copy outside `notebooks/gpu_runs/` (File > Save Notebook As…); to rerun it on a GPU, use "
                  "the command below.*")


def add_record_cell(path: Path, info: dict, params: dict, status: str, seconds: float, command: str,
                    sizes: dict | None = None, by: str = "run_claims.py") -> None:
    """Put a markdown cell first in the executed notebook: when, where, with what (the scale's sizes too), how it
    went."""
    if not path.is_file():
        return
    nb = json.loads(path.read_text())
    lines = [f"**GPU run record** (added by `notebooks/gpu_runs/{by}`)", "", READ_ONLY_NOTE, "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += [f"| parameters | {', '.join(f'`{k}={v!r}`' for k, v in params.items())} |"]
    if sizes:
        lines.append(f"| sizes | {', '.join(f'`{k}={v!r}`' for k, v in sizes.items())} (`SCALES`, without `model`) |")
    lines += [
              f"| status | {status}, {seconds:.0f} s wall |", f"| command | `{command}` |"]
    cell = {"cell_type": "markdown", "id": "gpu-run-record", "metadata": {"tags": ["gpu-run-record"]},
            "source": [line + "\n" for line in lines[:-1]] + [lines[-1]]}
    nb["cells"] = [c for c in nb["cells"] if c.get("id") != "gpu-run-record"]
    nb["cells"].insert(0, cell)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def normalize(path: Path) -> None:
    """Save the executed notebook as JupyterLab would (``tools/normalize_notebooks.py``), so it opens unmodified."""
    tool = ROOT / "tools" / "normalize_notebooks.py"
    if path.is_file() and tool.is_file():
        subprocess.run([sys.executable, str(tool), str(path)], cwd=ROOT, capture_output=True)


def runs_for_three_seeds(nb: str, sizes: dict) -> int:
    """Training runs a notebook needs for its claims over 3 seeds at ``sizes`` (``SCALES[nb][scale]``)."""
    if nb == "01":
        return 3 * len(sizes["seeded"])  # the lineage's other mixers run at seed 0 only when time is left
    if nb == "05":
        return 3 * 2 + 2  # NoPE and RoPE hybrids x 3 seeds, all-KDA and all-MLA once
    if nb == "16":
        return 3 * len(sizes["tasks"]) * len(sizes["mixers"]) * len(sizes["widths"])  # x 3 seeds, one lr each
    if nb == "07":
        return 3 * 2 + (3 * 2 if sizes.get("stress") else 0)  # LatentMoE and standard MoE (and SiTU, SwiGLU) x 3 seeds
    blocks = sizes.get("block_counts") or [2 ** i for i in range(sizes["num_layers"].bit_length())]
    return 3 * (2 + len(blocks))  # PreNorm, AttnRes full and the block variants, x 3 seeds


def plan_seconds(nb: str, sizes: dict) -> dict:
    """Seconds for 3 seeds of ``nb`` at ``sizes``, alone on one H200, from :data:`MEASURED` (per-run time scaled by
    steps; a shared measurement divided by :data:`SHARED_SLOWDOWN`, and also kept as the worst case)."""
    m = MEASURED[nb]
    ratio = sizes["steps"] / m["steps"]
    runs = runs_for_three_seeds(nb, sizes)
    worst = m["first"] + (runs - 1) * m["per_run"] * ratio
    alone = worst / SHARED_SLOWDOWN if m["shared"] else worst
    return dict(runs=runs, per_run=m["per_run"] * ratio / (SHARED_SLOWDOWN if m["shared"] else 1), alone=alone,
                worst=worst, budget=sizes["budget_s"])


def plan(wanted=tuple(NOTEBOOKS)) -> str:
    """What 3 seeds of each notebook take at the GPU scale, from the measured per-run seconds, and what fits in one
    9-minute call (:data:`CALL_S`, less :data:`OVERHEAD_S` a notebook)."""
    sys.path.insert(0, str(ROOT))
    from k3lab.experiments.scales import SCALES

    lines = [f"plan from measured seconds (MEASURED: one H200 unless a row says H100; one call = {CALL_S:.0f} s, "
             f"{OVERHEAD_S:.0f} s a notebook outside training):",
             f"{'nb':3s} {'runs':>4s} {'s/run':>6s} {'3 seeds':>8s} {'budget':>7s}  verdict"]
    for nb in wanted:
        p = plan_seconds(nb, SCALES[nb]["gpu"])
        fits_budget = p["alone"] <= p["budget"]
        fits_call = p["alone"] + OVERHEAD_S <= CALL_S
        shared = (f" (measured sharing the GPU: up to {p['worst']:.0f} s)" if MEASURED[nb]["shared"] else
                  " (ESTIMATED, not yet measured)" if MEASURED[nb].get("estimated") else "")
        shared += f" (measured on one {MEASURED[nb]['gpu']})" if MEASURED[nb].get("gpu") else ""
        lines.append(f"{nb:3s} {p['runs']:4d} {p['per_run']:6.1f} {p['alone']:8.0f} {p['budget']:7.0f}  "
                     + ("fits its budget" if fits_budget else "does NOT fit its budget (whole seeds are cut)")
                     + ("; alone in one call" if fits_call else
                        f"; needs more than one call (about {math.ceil(p['alone'] / p['budget'])} resumed calls)")
                     + shared)
    total = sum(plan_seconds(nb, SCALES[nb]["gpu"])["alone"] + OVERHEAD_S for nb in wanted)
    lines.append(f"{', '.join(wanted)}: about {total:.0f} s of GPU in all; one notebook a call (--only NN), each call "
                 f"stopped by --deadline {CALL_S - 60:.0f} s + --grace 60 s")
    return "\n".join(lines)


def estimate() -> None:
    """FLOPs of each notebook's GPU scale and the time they take at 30% of the H200's bf16 peak, with a floor per
    step for kernel launches (the models are small: most steps are launch-bound, see the notes printed)."""
    sys.path.insert(0, str(ROOT))
    from k3lab.config import ModelConfig
    from k3lab.experiments.scales import SCALES
    from k3lab.experiments.toy import MixerLM
    from k3lab.model import K3ForCausalLM

    def n_params(model, skip=("embed", "lm_head")):
        return sum(p.numel() for n, p in model.named_parameters() if not any(s in n for s in skip))

    rows = []
    g = SCALES["01"]["gpu"]
    n = n_params(MixerLM(g["vocab_size"], g["d_model"], g["n_layers"], "kda", 2, chunk_size=64))
    runs = len(g["seeded"]) * 3 + (7 - len(g["seeded"]))
    tokens = g["steps"] * g["batch_size"] * g["seq_len"]
    rows.append(("01 MQAR", runs, g["steps"], tokens, n, 6 * n * tokens * runs, 2 * 600))
    g = SCALES["05"]["gpu"]
    cfg = ModelConfig.preset("tiny").replace(**g["model"], vocab_size=64, mlp_kind="dense", num_hidden_layers=g["layers"],
                                             full_attn_layers=[g["layers"]])
    n = n_params(K3ForCausalLM(cfg))
    tokens = g["steps"] * g["batch_size"] * g["train_len"]
    rows.append(("05 NoPE/RoPE", 8, g["steps"], tokens, n, 6 * n * tokens * 8, g["layers"] * 600))
    g = SCALES["06"]["gpu"]
    cfg = ModelConfig.preset("tiny").replace(**g["model"], vocab_size=259, mlp_kind="dense", num_hidden_layers=g["num_layers"],
                                             full_attn_layers=[4, 8])
    n = n_params(K3ForCausalLM(cfg))
    tokens = g["steps"] * g["batch_size"] * g["seq_len"]
    runs = runs_for_three_seeds("06", g)  # PreNorm, AttnRes full and the block variants x 3 seeds
    rows.append(("06 AttnRes", runs, g["steps"], tokens, n, 6 * n * tokens * runs, g["num_layers"] * 600))
    print(f"{'notebook':14s} {'runs':>4s} {'steps':>6s} {'tokens/run':>11s} {'params':>9s} {'PFLOP':>7s} "
          f"{'compute s':>9s} {'launch s (graph / eager)':>25s}")
    for name, runs, steps, tokens, n, flops, kernels in rows:
        compute = flops / (MFU * H200_BF16_PEAK)
        graph, eager = runs * steps * kernels * 3e-6, runs * steps * kernels * 10e-6
        print(f"{name:14s} {runs:4d} {steps:6d} {tokens:11,d} {n / 1e6:8.2f}M {flops / 1e15:7.2f} {compute:9.1f} "
              f"{graph:12.0f} / {eager:5.0f}")
    print("compute: 6 x non-embedding parameters x tokens at 30% of 990 TFLOP/s; launch: ~600 kernels per layer and\n"
          "step (forward, backward, update), 3 us each replayed from a CUDA graph, 10 us each launched eagerly. A step\n"
          "takes the larger of the two; the budgets (SCALES[nb]['gpu']['budget_s']) cut whole seeds if it runs slower.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/claims")), help="output folder ($OUT)")
    ap.add_argument("--smoke", action="store_true", help="scale 'smoke': tiny sizes, runs on a CPU")
    ap.add_argument("--only", default=",".join(NOTEBOOKS), help="notebook numbers, e.g. 01,06 (default all)")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks at once (default 1: notebooks sharing a GPU slow "
                    "each other 2.5-4x)")
    ap.add_argument("--deadline", type=float, default=CALL_S - 60.0, help="seconds from start after which nothing runs")
    ap.add_argument("--grace", type=float, default=60.0, help="seconds past a notebook's budget before it is killed")
    ap.add_argument("--resume", type=Path, default=None, metavar="DIR",
                    help="start each notebook's runs file from DIR/<notebook>.runs.jsonl (e.g. notebooks/gpu_runs): "
                         "runs logged there at the same sizes are reused, only the missing ones train")
    ap.add_argument("--kernel", default="python3")
    ap.add_argument("--plan", action="store_true", help="print the measured seconds and what fits in a call; exit")
    ap.add_argument("--estimate", action="store_true", help="--plan, then the FLOP-based estimate; exit")
    args = ap.parse_args(argv)
    if args.plan or args.estimate:
        print(plan())
        if args.estimate:
            estimate()
        return 0
    t_start = time.monotonic()
    import torch  # noqa: F401 (the record's versions; also fails early where torch is missing)

    sys.path.insert(0, str(ROOT))
    from k3lab.experiments.scales import SCALES

    scale = "smoke" if args.smoke else "gpu"
    wanted = [n.strip().zfill(2) for n in args.only.split(",") if n.strip()]
    for n in wanted:
        if n not in NOTEBOOKS:
            ap.error(f"--only: {n} is not one of {sorted(NOTEBOOKS)}")
        if args.resume is not None and n not in RESUMABLE:  # it would train every run again and log each twice
            ap.error(f"--resume: notebook {n} does not reuse logged runs (only {', '.join(RESUMABLE)} do); run it "
                     "without --resume")
    jobs = max(1, args.jobs)
    if not args.smoke:
        print(plan(wanted), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_kernel(args.kernel)
    info = machine()
    print("  ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    env = dict(os.environ, MPLBACKEND=INLINE_BACKEND, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("OMP_NUM_THREADS", "4" if torch.cuda.is_available() else "1")

    pending, running, results, sizes = list(wanted), {}, {}, {}
    while pending or running:
        now = time.monotonic() - t_start
        while pending and len(running) < jobs:  # start the next notebook with what time is left
            nb = pending.pop(0)
            name = NOTEBOOKS[nb]
            left = args.deadline - now - args.grace
            waves = -(-(len(pending) + 1) // jobs)  # this notebook and the ones after it, `jobs` at a time
            budget = min(SCALES[nb][scale]["budget_s"] or 1e9, left / max(waves, 1))
            if budget < 30:
                results[nb] = dict(status="not run (no time left)", seconds=0.0, params={}, command="")
                continue
            if args.resume is not None and (args.resume / f"{name}.runs.jsonl").is_file():
                (args.out / f"{name}.runs.jsonl").write_text((args.resume / f"{name}.runs.jsonl").read_text())
            params = dict(scale=scale, runs_file=str((args.out / f"{name}.runs.jsonl").resolve()),
                          budget_s=float(round(budget)))
            sizes[nb] = {k: v for k, v in SCALES[nb][scale].items() if k != "model"}
            out = (args.out / f"{name}.ipynb").resolve()
            cmd = [sys.executable, "-m", "papermill", f"{name}.ipynb", str(out), "-k", args.kernel, "--no-progress-bar",
                   "--log-output"] + [x for k, v in params.items() for x in ("-p", k, str(v))]
            log = (args.out / f"{name}.log").open("w")
            proc = subprocess.Popen(cmd, cwd=ROOT / "notebooks", env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            limit = budget + args.grace
            running[nb] = dict(proc=proc, start=time.monotonic(), limit=limit, params=params, log=log,
                               command="papermill " + " ".join(cmd[3:]))
            print(f"[{time.monotonic() - t_start:5.0f} s] start {name}: budget {budget:.0f} s, killed after "
                  f"{limit:.0f} s", flush=True)
        time.sleep(1.0)
        for nb, r in list(running.items()):
            elapsed = time.monotonic() - r["start"]
            code = r["proc"].poll()
            late = elapsed > r["limit"] or time.monotonic() - t_start > args.deadline + args.grace
            if code is None and not late:
                continue
            if code is None:  # past its hard limit: stop the kernel and papermill (their own process group)
                os.killpg(r["proc"].pid, signal.SIGTERM)
                try:
                    r["proc"].wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(r["proc"].pid, signal.SIGKILL)
                    r["proc"].wait()
                status = f"cut at {elapsed:.0f} s (partial notebook and runs file kept)"
            else:
                status = "ok" if code == 0 else f"failed (exit {code}; see {NOTEBOOKS[nb]}.log)"
            r["log"].close()
            del running[nb]
            results[nb] = dict(status=status, seconds=elapsed, params=r["params"], command=r["command"])
            path = args.out / f"{NOTEBOOKS[nb]}.ipynb"
            add_record_cell(path, info, r["params"], status, elapsed, r["command"], sizes.get(nb))
            normalize(path)
            print(f"[{time.monotonic() - t_start:5.0f} s] {NOTEBOOKS[nb]}: {status} in {elapsed:.0f} s", flush=True)

    lines = [f"# Claim notebooks, scale {scale}", "", "  ".join(f"{k}={v}" for k, v in info.items()), "",
             "| notebook | status | seconds | runs logged | verdicts |", "|---|---|---:|---:|---|"]
    for nb in wanted:
        name, r = NOTEBOOKS[nb], results[nb]
        runs_file = args.out / f"{name}.runs.jsonl"
        n_runs = len(runs_file.read_text().splitlines()) if runs_file.is_file() else 0
        verdicts = "<br>".join(v.replace("|", "\\|") for v in verdicts_of(args.out / f"{name}.ipynb")) or "—"
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.0f} | {n_runs} | {verdicts} |")
    lines += ["", f"total wall time {time.monotonic() - t_start:.0f} s"]
    summary = "\n".join(lines) + "\n"
    (args.out / "summary.md").write_text(summary)
    print("\n" + summary, flush=True)
    return 0 if all(results[nb]["status"] == "ok" for nb in wanted) else 1


if __name__ == "__main__":
    sys.exit(main())
