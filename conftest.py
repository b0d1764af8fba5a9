"""Repository-wide pytest hook: after a run that included notebooks (nbval), print the slowest ones.

nbval makes one test item per cell, so pytest's ``--durations`` lists cells; this adds up setup, call
and teardown of every cell (the kernel start included) per notebook and flags any notebook over the
course budget (90 s on 2 CPU cores).
"""

import os
from collections import defaultdict

# Tests and the notebooks' kernels (which inherit this environment) run torch single-threaded unless
# told otherwise: the tiny models' small ops are faster on one thread, and it lets pytest-xdist use
# one worker per core without oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

NOTEBOOK_BUDGET_S = 90.0


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
