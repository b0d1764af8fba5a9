"""Every reference in the repository resolves inside it (the rule in docs/README.md).

Scans the tracked ``.py``, ``.md`` and ``.ipynb`` files (notebooks: cell sources, not outputs) for

1. citations of material that exists only outside the repository (the research notes it was built
   from: the sibling research folder, the spec, claims and measurement files, the anchor scripts);
2. repository paths and relative markdown links to files that do not exist, and ``tests/x.py::name``
   citations of a test that is not defined there;
3. ``docs/<page> §N`` citations whose section N is not a heading of that page;
4. claim IDs (``KDA-2``, ``AR-5``, ...) that the claims ledger ``docs/claims.md`` does not define;

and checks that the ledger's status summary (its §13) matches the status column of its rows.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".md", ".ipynb")
SELF = "tests/test_references.py"  # names the patterns it forbids; not scanned

# Material that lives only outside the repository: (substring that must occur first, lower case;
# pattern; what it is). The substring keeps the scan fast: most files contain none of them.
OUTSIDE = [
    ("shared", r"\.\./shared\b|/work/shared\b|\bshared/(?:spec|anchors|design|hooks)\b", "the research folder outside the repo"),
    ("spec", r"(?i)\bK3[ _]spec\b|\bspec\s*§", "the K3 spec (cite docs/k3_reference.md §N)"),
    ("claims.md", r"\bCLAIMS\.md\b", "the claims notes (cite docs/claims.md)"),
    ("measured.md", r"\bMEASURED\.md\b", "the anchor measurements (cite docs/peer_figures.md)"),
    ("distributed.md", r"\bDISTRIBUTED\.md\b", "the distributed-training notes"),
    ("k3_checkpoint.md", r"\bK3_CHECKPOINT\.md\b", "the checkpoint notes (cite docs/hf_checkpoint.md)"),
    (".md", r"\b(?:LAYOUT|STYLE|DATA)\.md\b", "the design notes"),
    ("_anchor.py", r"\b\w+_anchor\.py\b", "an anchor script outside the repo (describe it; name the kernels/ script that exists)"),
    ("_probe.py", r"\b\w+_probe\.py\b", "a probe script outside the repo"),
    (".py", r"\b(?:probe_ops|k3_saved_bytes|autotune_cache)\.py\b", "a probe script outside the repo"),
]
OUTSIDE_RE = [(hint, re.compile(p), why) for hint, p, why in OUTSIDE]

# A path-looking token: segments of [\w.-] joined by "/", ending in a file suffix we track or ship.
PATH_RE = re.compile(r"(?<![\w./*{-])((?:\.\.?/)*[\w.-]+(?:/[\w.-]+)*\.(?:md|py|ipynb|json|tgz|cfg|toml|txt))"
                     r"(?:::(\w+))?(?![\w/*{-])")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
DOC_SECTION_RE = re.compile(r"docs/([\w.-]+\.md)`?\s*(§\s*\d+(?:\.\d+)*(?:\s*(?:,|–|-|and|or|&)\s*(?:§\s*)?\d+(?:\.\d+)*)*)")
SECTION_NUMBER_RE = re.compile(r"\d+(?:\.\d+)*")
HEADING_SECTION_RE = re.compile(r"^#{1,6}\s+§\s*(\d+(?:\.\d+)*)", re.MULTILINE)
ANCHOR_SECTION_RE = re.compile(r'<a id="s(\d+(?:\.\d+)*)"></a>')
CLAIM_PREFIXES = "KDA|HYB|NOPE|GMLA|AR|LMOE|SITU|QB|MEP|KCP|MUON|SCALE|LC|MTP|QAT|PC|INF"
CLAIM_ID_RE = re.compile(rf"\b(?:{CLAIM_PREFIXES})-\d+\b")
CLAIM_ROW_RE = re.compile(rf"^\|\s*((?:{CLAIM_PREFIXES})-\d+)\s*\|(.*)\|\s*$", re.MULTILINE)
STATUSES = ("confirmed", "same direction", "not reproduced at this scale", "contradicted", "not yet tested")


# ----------------------------------------------------------------------------------------------
# reading the repository
# ----------------------------------------------------------------------------------------------
def tracked_files(root: Path = ROOT) -> list[str]:
    """Every file ``git ls-files`` lists (paths relative to ``root``); skips the tests outside a checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"not a git checkout, cannot list tracked files: {err}")
    return sorted(p for p in out.split("\0") if p)


def sources(path: str, text: str) -> list[tuple[str, bool, str]]:
    """``[(where, is_markdown, text)]``: the whole file, or for a notebook one entry per cell source
    (outputs are not scanned)."""
    if not path.endswith(".ipynb"):
        return [(path, path.endswith(".md"), text)]
    cells = json.loads(text)["cells"]
    return [(f"{path} cell {i}", c["cell_type"] == "markdown",
             "".join(c["source"]) if isinstance(c["source"], list) else c["source"]) for i, c in enumerate(cells)]


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def doc_sections(text: str) -> set[str]:
    """Section numbers a page defines: ``## §2.3 ...`` headings and ``<a id="s2.3"></a>`` anchors."""
    return set(HEADING_SECTION_RE.findall(text)) | set(ANCHOR_SECTION_RE.findall(text))


def claim_rows(ledger: str) -> dict[str, str]:
    """``{claim ID: its status cell}`` from the ledger's tables (the status is the last column)."""
    rows = {}
    for cid, rest in CLAIM_ROW_RE.findall(ledger):
        if cid in rows:
            raise AssertionError(f"docs/claims.md: claim {cid} has two rows")
        rows[cid] = rest.rsplit("|", 1)[-1].strip()
    return rows


def status_of(cell: str) -> str:
    """The status a ledger cell starts with (bold), one of STATUSES; AssertionError otherwise."""
    m = re.match(r"\*\*([^*]+)\*\*", cell)
    if not m or m.group(1) not in STATUSES:
        raise AssertionError(f"status cell {cell!r} must start with one of {['**' + s + '**' for s in STATUSES]}")
    return m.group(1)


class Repo:
    """The tracked files of a checkout, read once; every check works on it (a fake one in the self-test)."""

    def __init__(self, files: dict[str, str]):
        self.files = files  # path -> text
        self.all_paths = set(files)
        self.top = {p.split("/")[0] for p in files}
        self.dirs = {str(parent) for p in files for parent in Path(p).parents if str(parent) != "."}

    @classmethod
    def from_disk(cls, root: Path = ROOT) -> "Repo":
        files = {p: (root / p).read_text(encoding="utf-8") if p.endswith(SUFFIXES) and (root / p).exists() else ""
                 for p in tracked_files(root)}
        return cls(files)

    def exists(self, rel: str, base: str = "") -> bool:
        """``rel`` names a tracked file or folder, from ``base``'s folder or from the repository root."""
        for start in ((str(Path(base).parent),) if base else ()) + ("",):
            cand = Path(start) / rel if start not in ("", ".") else Path(rel)
            norm = _normalise(cand)
            if norm is not None and (norm in self.all_paths or norm in self.dirs):
                return True
        return False

    def scanned(self):
        """``(path, where, is_markdown, text)`` for every scanned source, read once."""
        if not hasattr(self, "_scanned"):
            self._scanned = [(path, where, md, text) for path in sorted(self.files)
                             if path.endswith(SUFFIXES) and path != SELF
                             for where, md, text in sources(path, self.files[path])]
        return self._scanned


def _normalise(p: Path) -> str | None:
    parts: list[str] = []
    for part in p.parts:
        if part == "..":
            if not parts:
                return None  # leaves the repository
            parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


# ----------------------------------------------------------------------------------------------
# the checks (each returns a list of "where:line: problem" strings)
# ----------------------------------------------------------------------------------------------
def outside_citations(repo: Repo) -> list[str]:
    found = []
    for path, where, _, text in repo.scanned():
        lower = text.lower()
        for hint, rx, why in OUTSIDE_RE:
            if hint not in lower:
                continue
            for m in rx.finditer(text):
                found.append(f"{where}:{line_of(text, m.start())}: {m.group(0)!r} — {why}")
    return found


def missing_paths(repo: Repo) -> list[str]:
    found = []
    for path, where, is_markdown, text in repo.scanned():
        links = list(LINK_RE.finditer(text)) if is_markdown else []
        in_link = {pos for m in links for pos in range(*m.span(1))}
        for m in PATH_RE.finditer(text):
            rel, test_name = m.group(1), m.group(2)
            if "/" not in rel or m.start(1) in in_link:
                continue  # a bare file name (its folder is unknown: 00_echo.ipynb, muon.py), or a link below
            first = rel.split("/")[0]
            if first not in repo.top and first not in ("..", "."):
                continue  # another project's path (fla/..., flash_kda/...): not ours to resolve
            if not repo.exists(rel, path):
                found.append(f"{where}:{line_of(text, m.start())}: {rel} does not exist in the repository")
            elif test_name and rel.startswith("tests/") and rel.endswith(".py"):
                body = repo.files.get(_normalise(Path(rel)) or "", "")
                if not re.search(rf"^\s*(?:async\s+)?def {re.escape(test_name)}\b|^class {re.escape(test_name)}\b",
                                 body, re.MULTILINE):
                    found.append(f"{where}:{line_of(text, m.start())}: {rel}::{test_name} is not defined there")
        for m in links:
            target = m.group(1).split("#")[0]
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # an anchor in the same page, or a URL
            if not repo.exists(target, path):
                found.append(f"{where}:{line_of(text, m.start())}: link to {target}, which does not exist")
    return found


def missing_sections(repo: Repo) -> list[str]:
    found = []
    sections = {p: doc_sections(t) for p, t in repo.files.items() if p.startswith("docs/") and p.endswith(".md")}
    for path, where, _, text in repo.scanned():
        if "docs/" not in text:
            continue
        for m in DOC_SECTION_RE.finditer(text):
            page = f"docs/{m.group(1)}"
            if page not in sections:
                found.append(f"{where}:{line_of(text, m.start())}: {page} does not exist")
                continue
            for number in SECTION_NUMBER_RE.findall(m.group(2)):
                if number not in sections[page]:
                    found.append(f"{where}:{line_of(text, m.start())}: {page} has no §{number} "
                                 f"(it has §{', §'.join(sorted(sections[page], key=_section_key))})")
    return found


def _section_key(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split("."))


def unknown_claim_ids(repo: Repo) -> list[str]:
    ledger = repo.files.get("docs/claims.md")
    if ledger is None:
        return ["docs/claims.md does not exist"]
    known = set(claim_rows(ledger))
    found = []
    for path, where, _, text in repo.scanned():
        for m in CLAIM_ID_RE.finditer(text):
            if m.group(0) not in known:
                found.append(f"{where}:{line_of(text, m.start())}: claim {m.group(0)} is not in docs/claims.md")
    return found


def summary_mismatches(ledger: str) -> list[str]:
    """The §13 summary table's counts against a recount of the rows' status cells."""
    rows = claim_rows(ledger)
    counted = Counter(status_of(cell) for cell in rows.values())
    setup = sum("(setup)" in cell for cell in rows.values())
    section = ledger.split('<a id="s13"></a>', 1)[-1].split('<a id="s14"></a>', 1)[0]
    problems = []
    m_total = re.search(r"\((\d+) claims\)", section)
    if not m_total or int(m_total.group(1)) != len(rows):
        problems.append(f"§13 says {m_total.group(1) if m_total else '?'} claims, the tables have {len(rows)}")
    for status in STATUSES:
        m = re.search(rf"^\|\s*{re.escape(status)}\s*\|\s*(\d+)(?:\s*\((\d+) of them setup\))?\s*\|", section, re.MULTILINE)
        if not m:
            problems.append(f"§13 has no row for {status!r}")
            continue
        if int(m.group(1)) != counted[status]:
            problems.append(f"§13 counts {m.group(1)} {status!r}, the rows have {counted[status]}")
        if status == "confirmed" and int(m.group(2) or 0) != setup:
            problems.append(f"§13 counts {m.group(2) or 0} setup rows, the rows have {setup}")
    return problems


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def repo() -> Repo:
    return Repo.from_disk()


def _report(problems: list[str], what: str) -> str:
    shown = "\n  ".join(problems[:60])
    more = f"\n  ... and {len(problems) - 60} more" if len(problems) > 60 else ""
    by_file = Counter(p.split(":")[0].split(" cell ")[0] for p in problems)
    return f"{len(problems)} {what} in {len(by_file)} files ({dict(by_file)}):\n  {shown}{more}"


def test_no_citation_leaves_the_repository():
    if problems := outside_citations(repo()):
        pytest.fail(_report(problems, "citations of material outside the repository"), pytrace=False)


def test_repository_paths_and_links_exist():
    if problems := missing_paths(repo()):
        pytest.fail(_report(problems, "paths or links that do not resolve"), pytrace=False)


def test_docs_section_citations_exist():
    if problems := missing_sections(repo()):
        pytest.fail(_report(problems, "docs §-citations that do not resolve"), pytrace=False)


def test_claim_ids_are_in_the_ledger():
    if problems := unknown_claim_ids(repo()):
        pytest.fail(_report(problems, "unknown claim IDs"), pytrace=False)


def test_claims_summary_matches_rows():
    ledger = repo().files.get("docs/claims.md")
    assert ledger is not None, "docs/claims.md does not exist"
    if problems := summary_mismatches(ledger):
        pytest.fail("docs/claims.md §13 disagrees with its rows:\n  " + "\n  ".join(problems), pytrace=False)


OUTSIDE_DIR = "../" + "shared"  # the research folder next to the repository: planted below, never cited literally


def test_scanner_catches_each_kind():
    """The checks on a made-up repository: each planted problem is found once, the good references pass."""
    ledger = ("# ledger\n| ID | claim | status |\n|---|---|---|\n| KDA-2 | x | **confirmed** |\n"
              "| AR-5 | y | **not yet tested** |\n| QB-1 | z | **confirmed** (setup) |\n"
              '<a id="s13"></a>\n## §13 Summary\n(3 claims)\n| status | claims |\n|---|---|\n'
              "| confirmed | 2 (1 of them setup) |\n| not reproduced at this scale | 0 |\n| contradicted | 0 |\n| same direction | 0 |\n"
              '| not yet tested | 1 |\n<a id="s14"></a>\n')
    notebook = json.dumps({"cells": [
        {"cell_type": "markdown", "source": ["See K3_SPEC.md §2.2 and `kernels/GONE.md`.\n"],
         "outputs": []},
        {"cell_type": "code", "source": ["print('docs/ref.md §2.3')  # fine\n"],
         "outputs": [{"output_type": "stream", "text": [f"{OUTSIDE_DIR}/anchors in an output is not a source\n"]}]},
    ]})
    fake = Repo({
        "docs/ref.md": "# ref\n## §2 KDA\n### §2.3 Chunks\n[claims](claims.md), [missing](nothing.md), "
                       "[web](https://example.org/x.md), [here](#s2)\n",
        "docs/claims.md": ledger,
        "kernels/RESULTS.md": f"ran `python kernels/bench.py`; see {OUTSIDE_DIR}/anchors/MEASURED.md\n",
        "kernels/bench.py": '"""K3 spec §2.3; docs/ref.md §2.3, §9; fla/ops/kda/chunk.py; '
                            'tests/test_x.py::test_real, tests/test_x.py::test_gone"""\n',
        "tests/test_x.py": "def test_real():\n    pass  # claim AR-5, claim NOPE-9\n",
        "notebooks/01.ipynb": notebook,
    })
    outside = outside_citations(fake)
    assert sorted(p.split(": ", 1)[1].split(" — ")[0] for p in outside) == \
        [f"'{OUTSIDE_DIR}'", "'K3 spec'", "'K3_SPEC'", "'MEASURED.md'"], outside
    assert all("cell 1" not in p for p in outside)  # outputs are not scanned
    missing = missing_paths(fake)
    assert sorted(p.split(": ", 1)[1] for p in missing) == [
        f"{OUTSIDE_DIR}/anchors/MEASURED.md does not exist in the repository",
        "kernels/GONE.md does not exist in the repository",
        "link to nothing.md, which does not exist",
        "tests/test_x.py::test_gone is not defined there",
    ], missing
    sections = missing_sections(fake)
    assert len(sections) == 1 and "docs/ref.md has no §9 (it has §2, §2.3)" in sections[0], sections
    ids = unknown_claim_ids(fake)
    assert len(ids) == 1 and "claim NOPE-9" in ids[0], ids
    assert summary_mismatches(ledger) == []
    wrong = ledger.replace("| not yet tested | 1 |", "| not yet tested | 2 |")
    assert summary_mismatches(wrong) == ["§13 counts 2 'not yet tested', the rows have 1"]
    with pytest.raises(AssertionError, match="must start with one of"):
        status_of("maybe")
