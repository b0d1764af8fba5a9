"""Repository-wide pytest hooks: after a run that included notebooks (nbval), print the slowest ones; before a
run of the GPU tests, restore fla's recorded autotuning into Triton's cache and pin every Triton autotuner to one
configuration (``k3lab.kernels.autotune``; ``K3LAB_PIN_AUTOTUNE=0`` leaves autotuning as it is); around every
test (notebook cells too), the process's SIGINT / SIGTERM handlers: a test that leaves one changed gets an error
at teardown naming it, and the handler is put back, so no test sees another's (pytest-xdist runs many files in
one process, in an order that varies; tests/test_launch_faults.py's Ctrl-C test relies on SIGINT).

nbval makes one test item per cell, so pytest's ``--durations`` lists cells; this adds up setup, call
and teardown of every cell (the kernel start included) per notebook and flags any notebook over the
course budget (90 s on 2 CPU cores).
"""

import json
import os
import signal
import tarfile
import threading
from collections import defaultdict
from pathlib import Path

import pytest

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


def recorded_best_configs(archives=FLA_AUTOTUNE_CACHES) -> dict[str, list[dict]]:
    """Kernel name -> the fastest configuration of each recorded autotuning of it in ``archives`` (the
    ``*.autotune.json`` files of ``kernels/fla*-autotune.tgz``: bf16, an H200), as ``{"kwargs", "num_warps",
    "num_stages"}`` dicts, each once: the configurations a pinned test run tries first (``k3lab.kernels.autotune``)."""
    table: dict[str, list[dict]] = defaultdict(list)
    for archive in archives:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if not (member.isfile() and member.name.endswith(".autotune.json")):
                    continue
                timings = json.loads(tar.extractfile(member).read())["configs_timings"]  # [[config, [ms, ...]], ...]
                best, _ = min(timings, key=lambda entry: entry[1])  # Infinity: did not compile or fit
                entry = {"kwargs": best["kwargs"], "num_warps": best["num_warps"], "num_stages": best["num_stages"]}
                name = Path(member.name).name[: -len(".autotune.json")]
                if entry not in table[name]:
                    table[name].append(entry)
    return dict(table)


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a ``-m`` expression selects the ``gpu`` tests (``gpu``, ``slow or gpu``, ``gpu and not dist``, ...)."""
    markexpr = (markexpr or "").replace(" ", "")
    return markexpr.startswith("gpu") or "orgpu" in markexpr or "andgpu" in markexpr


def pin_test_autotuning(env=os.environ):
    """Pin every Triton autotuner (fla's) to one configuration, fla's recorded fastest first, unless
    ``K3LAB_PIN_AUTOTUNE=0``: GPU tests check results, and autotuning fla's kernels for each new dtype and
    shape took minutes (issue 27 item 5). Returns the undo function, or None where nothing was pinned."""
    if env.get("K3LAB_PIN_AUTOTUNE", "1") == "0":
        return None
    try:
        from k3lab.kernels.autotune import pin_autotuning
    except ImportError:  # no triton here: nothing autotunes
        return None
    return pin_autotuning(recorded_best_configs())


def pytest_configure(config):
    """A run that selects the GPU tests (``-m gpu``) starts with every autotuner pinned to one configuration, so
    first calls compile once, without minutes of autotuning (issue 27: GPU tests that fit a working session); and
    with fla's recorded autotuning restored, which the pinned autotuners do not read but an unpinned run does."""
    if selects_gpu_tests(config.getoption("markexpr", "")):
        restore_fla_autotuning(triton_cache_dir())
        pin_test_autotuning()


GUARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # process-wide: what one test changes, the next one inherits
_HANDLERS_BEFORE = pytest.StashKey[dict]()


def signal_handlers() -> dict:
    """``{signal: handler}`` of :data:`GUARDED_SIGNALS` (None: installed outside Python, which cannot be put back)."""
    return {sig: signal.getsignal(sig) for sig in GUARDED_SIGNALS}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_HANDLERS_BEFORE] = signal_handlers()  # before the test's fixtures
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield  # after the test's fixtures: a fixture that restores what it changed is fine
    before = item.stash.get(_HANDLERS_BEFORE, {})
    changed = {sig: (old, signal.getsignal(sig)) for sig, old in before.items()
               if old is not None and signal.getsignal(sig) != old}
    if changed and threading.current_thread() is threading.main_thread():
        for sig, (old, _) in changed.items():
            signal.signal(sig, old)
        what = "; ".join(f"{signal.Signals(sig).name} {old!r} -> {new!r}" for sig, (old, new) in changed.items())
        raise RuntimeError(f"{item.nodeid} left the process's signal handling changed ({what}); put back for the "
                           "tests after it: a test that changes a signal handler must restore it")
    return result


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


def pytest_collection_modifyitems(config, items):
    """The ``gpu`` tests skip where there is no CUDA GPU, as the marker says, rather than fail: some start a script
    with ``--device cuda`` and would end in its error (a run given ``-m gpu``, or no ``-m``, on a CPU)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="a gpu test: no CUDA GPU here")
    for item in gpu:
        item.add_marker(skip)
