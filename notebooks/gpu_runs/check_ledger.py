"""Read the verdicts back out of the executed GPU notebooks and check that the claims ledger agrees (issue 29).

Each claim notebook prints one line per claim it judges, computed from its numbers::

    VERDICT AR-3: confirmed — 3 seeds, 300 steps of 64 x 512 code tokens, 8 layers, scale gpu: PreNorm ...

For every executed notebook in ``notebooks/gpu_runs/`` (``*.ipynb``), this script collects those lines and checks, for
each claim, that the row of ``docs/claims.md`` with that ID has the same status (the bold word of its status
column) and cites the executed notebook by path. A "not tested" verdict (the budget left fewer than 3 whole seeds)
judges nothing: the row must cite the notebook, as a record of what ran, but keeps the status its other evidence
gives it (a CPU-scale verdict over 3 seeds is not undone by a GPU run of 1 seed).

    python notebooks/gpu_runs/check_ledger.py             # check; exit 1 listing every disagreement
    python notebooks/gpu_runs/check_ledger.py --markdown  # the verdicts and headlines as a notebooks/GPU_RUNS.md section

``tests/test_gpu_runs.py`` runs the check.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LEDGER = ROOT / "docs" / "claims.md"
VERDICT_RE = re.compile(r"^VERDICT ([A-Z]+-\d+): (.+?) — (.*)$")
ROW_RE = re.compile(r"^\|\s*([A-Z]+-\d+)\s*\|(.*)\|\s*$", re.MULTILINE)
STATUS_WORDS = {"not tested": "not yet tested", "reproduced": "confirmed"}  # notebook 15's rule words -> the ledger's
NOT_TESTED = "not yet tested"  # a run that judged nothing (too few seeds): cited, but it sets no status


def stdout_lines(nb: dict) -> list[str]:
    lines = []
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stdout":
                text = out.get("text", "")
                lines += ("".join(text) if isinstance(text, list) else text).splitlines()
    return lines


def verdicts(nb: dict) -> dict[str, tuple[str, str]]:
    """``{claim: (status, evidence)}`` from the notebook's ``VERDICT`` lines (the last line per claim wins)."""
    found = {}
    for line in stdout_lines(nb):
        m = VERDICT_RE.match(line)
        if m:
            found[m.group(1)] = (STATUS_WORDS.get(m.group(2), m.group(2)), m.group(3))
    return found


def headline(nb: dict) -> str:
    return next((line[len("HEADLINE: "):] for line in reversed(stdout_lines(nb)) if line.startswith("HEADLINE: ")), "")


def record(nb: dict) -> str:
    """The run-record cell ``run_claims.py`` puts first (markdown), or ''."""
    cell = nb.get("cells", [{}])[0]
    if "gpu-run-record" not in cell.get("metadata", {}).get("tags", []):
        return ""
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def ledger_rows(text: str) -> dict[str, list[str]]:
    """``{claim ID: [claim, source, experiment, result, status]}`` from the ledger's tables."""
    return {m.group(1): [c.strip() for c in m.group(2).split("|")] for m in ROW_RE.finditer(text)}


def row_status(cells: list[str]) -> str:
    m = re.match(r"\*\*(.+?)\*\*", cells[-1]) if cells else None
    return m.group(1) if m else ""


def executed_notebooks(folder: Path = HERE) -> list[Path]:
    return sorted(folder.glob("*.ipynb"))


def check(folder: Path = HERE, ledger: Path = LEDGER) -> list[str]:
    """Every disagreement between the executed notebooks' verdicts and the ledger (empty: they agree)."""
    rows = ledger_rows(ledger.read_text())
    problems = []
    for path in executed_notebooks(folder):
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        for claim, (status, _) in verdicts(json.loads(path.read_text())).items():
            if claim not in rows:
                problems.append(f"{rel}: {claim} has no row in docs/claims.md")
                continue
            if status != NOT_TESTED and row_status(rows[claim]) != status:
                problems.append(f"{rel}: {claim} is '{status}' in the notebook, "
                                f"'{row_status(rows[claim])}' in docs/claims.md")
            if rel not in " ".join(rows[claim]):
                problems.append(f"{rel}: the docs/claims.md row of {claim} does not cite {rel}")
    return problems


def markdown(folder: Path = HERE) -> str:
    """A ``notebooks/GPU_RUNS.md`` section from the executed notebooks: record, headline, verdicts."""
    parts = []
    for path in executed_notebooks(folder):
        nb = json.loads(path.read_text())
        parts.append(f"### {path.stem}\n\n`{path.relative_to(ROOT).as_posix()}`\n\n{record(nb)}\n\n"
                     f"HEADLINE: {headline(nb)}\n")
        parts += [f"- **{claim}: {status}** — {evidence}" for claim, (status, evidence) in verdicts(nb).items()]
        parts.append("")
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", type=Path, default=HERE, help="where the executed notebooks are")
    ap.add_argument("--markdown", action="store_true", help="print a GPU_RUNS.md section instead of checking")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.folder))
        return 0
    problems = check(args.folder)
    for p in problems:
        print(p)
    n = sum(len(verdicts(json.loads(p.read_text()))) for p in executed_notebooks(args.folder))
    print(f"{n} verdicts in {len(executed_notebooks(args.folder))} executed notebooks; "
          f"{len(problems)} disagreement(s) with docs/claims.md")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
