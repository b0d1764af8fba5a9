"""Run one scaling-law experiment of notebook 15 at the GPU scale in one device call, through papermill (issue 35).

From the repository root on the GPU machine (k3lab importable, papermill and ipykernel installed):

    python notebooks/gpu_runs/run_scaling.py --experiment SCALE-3 --out "$OUT" --resume notebooks/gpu_runs
    python notebooks/gpu_runs/run_scaling.py --experiment AR-3 --out /tmp/s --smoke     # the same pipeline on a CPU

The notebook runs as ``papermill 15_scaling_laws.ipynb OUT/15_<exp>.ipynb -p scale gpu -p experiment EXP
-p seeds [..] -p runs_file OUT/15_<exp>.runs.jsonl -p budget_s B`` (``<exp>``: ``scale3``, ``ar3``, ``hyb2``). The
runs file starts from ``--resume DIR``'s copy, so only the missing runs train; every finished run is appended as it
finishes, and a notebook past ``B`` + ``--grace`` seconds is stopped with both files kept. A record cell (date,
machine, versions, commit — ``--commit``, as the GPU machine's copy has no git history — parameters, status) is put
first in the executed notebook, as ``run_claims.py`` does for the claim notebooks.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from run_claims import INLINE_BACKEND, add_record_cell, ensure_kernel, machine, normalize, verdicts_of  # noqa: E402

NOTEBOOK = "15_scaling_laws"


def stem(experiment: str) -> str:
    """``SCALE-3`` -> ``15_scale3``: the executed notebook's and runs file's name."""
    return "15_" + experiment.lower().replace("-", "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", required=True, choices=("SCALE-3", "AR-3", "HYB-2"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/scaling")))
    ap.add_argument("--seeds", default="[0, 1, 2]", help="a JSON list (default '[0, 1, 2]')")
    ap.add_argument("--budget", type=float, default=420.0, help="training seconds (the notebook's budget_s)")
    ap.add_argument("--grace", type=float, default=90.0, help="seconds past the budget before the notebook is killed")
    ap.add_argument("--resume", type=Path, default=None, metavar="DIR", help="start from DIR/15_<exp>.runs.jsonl")
    ap.add_argument("--commit", default=os.environ.get("K3LAB_COMMIT"), help="commit of this copy, for the record")
    ap.add_argument("--variants", default=None, help="a JSON list: the notebook's variants (first = baseline)")
    ap.add_argument("--tag", default="", help="suffix of the file names: 15_<exp><tag>.ipynb / .runs.jsonl")
    ap.add_argument("--widths", default=None, help="a JSON list: the notebook's widths")
    ap.add_argument("--lr-sweep", default=None, help="a JSON list: the notebook's lr_sweep (multipliers of lr0)")
    ap.add_argument("--smoke", action="store_true", help="scale 'smoke': tiny sizes, runs on a CPU")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_kernel()
    info = machine()
    if args.commit:
        info["commit"] = args.commit
    print("  ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    name = stem(args.experiment) + args.tag
    runs = (args.out / f"{name}.runs.jsonl").resolve()
    if args.resume is not None and (args.resume / runs.name).is_file():
        runs.write_text((args.resume / runs.name).read_text())
    params = dict(scale="smoke" if args.smoke else "gpu", experiment=args.experiment, seeds=json.loads(args.seeds),
                  runs_file=str(runs), budget_s=float(round(args.budget)))
    for key, value in (("variants", args.variants), ("widths", args.widths), ("lr_sweep", args.lr_sweep)):
        if value is not None:
            params[key] = json.loads(value)
    out = (args.out / f"{name}.ipynb").resolve()
    cmd = [sys.executable, "-m", "papermill", f"{NOTEBOOK}.ipynb", str(out), "-k", "python3", "--no-progress-bar",
           "--log-output", "-y", json.dumps(params)]  # YAML (JSON) keeps the seeds a list
    env = dict(os.environ, MPLBACKEND=INLINE_BACKEND, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with (args.out / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT / "notebooks", env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=args.budget + args.grace)
            status = "ok" if code == 0 else f"failed (exit {code}; see {name}.log)"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            status = "cut at its hard limit (partial notebook and runs file kept)"
    seconds = time.monotonic() - t0
    add_record_cell(out, info, params, status, seconds, "papermill " + " ".join(cmd[3:-2]) + f" -y '{cmd[-1]}'",
                    by="run_scaling.py")
    normalize(out)
    n_runs = len(runs.read_text().splitlines()) if runs.is_file() else 0
    print(f"{name}: {status} in {seconds:.0f} s; {n_runs} runs logged", flush=True)
    for line in verdicts_of(out):
        print(line, flush=True)
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
