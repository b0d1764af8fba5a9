"""Repository-wide pytest hooks: after a run that included notebooks (nbval), print the slowest ones; before a
run of the GPU tests, restore fla's recorded autotuning into Triton's cache.

nbval makes one test item per cell, so pytest's ``--durations`` lists cells; this adds up setup, call
and teardown of every cell (the kernel start included) per notebook and flags any notebook over the
course budget (90 s on 2 CPU cores).
"""

import os
import tarfile
from collections import defaultdict
from pathlib import Path

# Tests and the notebooks' kernels (which inherit this environment) run torch single-threaded unless
# told otherwise: the tiny models' small ops are faster on one thread, and it lets pytest-xdist use
# one worker per core without oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

NOTEBOOK_BUDGET_S = 90.0
ROOT = Path(__file__).resolve().parent
FLA_AUTOTUNE_CACHES = sorted((ROOT / "kernels").glob("fla*-autotune.tgz"))  # recorded fla autotuning (H200)


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels and autotuning results: ``TRITON_CACHE_DIR`` or ``~/.triton/cache``."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def restore_fla_autotuning(dest: Path) -> int:
    """Unpack the recorded ``*.autotune.json`` files of fla's kernels (``kernels/fla*-autotune.tgz``: fla 0.6.0 +
    triton 3.6 on an H200) into Triton's cache; returns the files written. Triton keys each folder by kernel
    source, version and GPU, so on another setup the entries are simply never read. On the H200 fla's first
    chunk_kda call took 217.1 s with an empty cache and 16.9 s with these (docs/peer_figures.md)."""
    written = 0
    for archive in FLA_AUTOTUNE_CACHES:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                target = dest / member.name
                if member.isfile() and member.name.endswith(".autotune.json") and not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())
                    written += 1
    return written


def pytest_configure(config):
    """A run that selects the GPU tests (``-m gpu``) starts with fla's recorded autotuning restored, so its
    first calls compile without minutes of autotuning (issue 27: GPU tests that fit a working session)."""
    markexpr = (config.getoption("markexpr", "") or "").replace(" ", "")
    if markexpr.startswith("gpu") or "orgpu" in markexpr or "andgpu" in markexpr:
        restore_fla_autotuning(triton_cache_dir())


def notebook_seconds(stats: dict) -> dict[str, float]:
    """Total seconds per ``.ipynb`` file from the terminal reporter's collected test reports."""
    totals: dict[str, float] = defaultdict(float)
    for reports in stats.values():
        for report in reports:
            path = getattr(report, "nodeid", "").split("::")[0]
            if path.endswith(".ipynb"):
                totals[path] += getattr(report, "duration", 0.0)
    return dict(totals)


def pytest_terminal_summary(terminalreporter):
    totals = notebook_seconds(terminalreporter.stats)
    if not totals:
        return
    terminalreporter.write_sep("=", "slowest notebooks (all cells, kernel start included)")
    for path, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        flag = f"   OVER the {NOTEBOOK_BUDGET_S:.0f} s budget" if seconds > NOTEBOOK_BUDGET_S else ""
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}{flag}")
    terminalreporter.write_line(f"{sum(totals.values()):8.1f} s  all {len(totals)} notebooks")
