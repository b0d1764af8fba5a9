"""`python -m k3lab course`: run the course notebooks through papermill and summarise them.

Each notebook ``notebooks/<NN>_<topic>.ipynb`` is executed (kernel ``python3``, working directory = the
notebooks folder) into the output folder under the same name. The runner

* passes ``preset`` and ``device`` to every notebook whose ``parameters`` cell defines them, and each
  ``-p NAME VALUE`` to the notebooks that define ``NAME``;
* parses VALUE with :func:`ast.literal_eval` (``-p steps 50`` is the int 50, ``-p lr 3e-4`` a float,
  ``-p sizes "[64, 128]"`` a list) and falls back to the plain string (``-p mode chunk``); values go to
  papermill as Python objects, never through a shell;
* rejects, before running anything, a parameter that no selected notebook's ``parameters`` cell
  defines (papermill itself only warns), naming it and the allowed names;
* keeps going past a failing notebook, prints a table (notebook, status, seconds, headline) and writes
  it to ``summary.md`` in the output folder; the exit status is 1 if any notebook failed.

In a git checkout, ``course`` and ``course --list`` first print one line naming the notebooks that differ from the
last commit (``git status --porcelain``: a Try-this edit, an autosave) and the ``git checkout`` that resets them;
edited notebooks run as they are. Outside a checkout (or without git) nothing is printed.

The headline of a notebook is the last stdout line starting with ``HEADLINE: `` (printed by
``k3lab.experiments.nb.headline``). Papermill starts the Jupyter kernel named ``python3`` (``--kernel`` picks
another). If that kernel is missing, or belongs to a different Python than the one running the
course, register this interpreter's kernel with ``python -m ipykernel install --user``.
"""

import argparse
import ast
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from k3lab.config import DEVICES, RUNNABLE_PRESETS

NOTEBOOK_NAME = re.compile(r"^(\d+)_\w+\.ipynb$")
HEADLINE_PREFIX = "HEADLINE: "
DEVICE_PATTERN = re.compile(rf"^({'|'.join(DEVICES)}|cuda:\d+)$")  # DEVICES or cuda:N, as k3lab.backend.resolve_device
DEFAULT_NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


class CourseError(ValueError):
    """A usage error found before any notebook runs (bad --only, unknown parameter, ...)."""


@dataclass
class NotebookResult:
    """One row of the summary table."""

    name: str
    status: str  # "ok" | "failed"
    seconds: float
    headline: str


def find_notebooks(folder: Path) -> dict[int, Path]:
    """Map notebook number -> path for every ``NN_topic.ipynb`` in ``folder``, sorted by number."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CourseError(f"notebooks folder {str(folder)!r} does not exist")
    found: dict[int, Path] = {}
    for path in sorted(folder.glob("*.ipynb")):
        match = NOTEBOOK_NAME.match(path.name)
        if match is None:
            continue
        number = int(match.group(1))
        if number in found:
            raise CourseError(f"two notebooks share the number {number:02d}: {found[number].name}, {path.name}")
        found[number] = path
    if not found:
        raise CourseError(f"no NN_topic.ipynb notebooks in {str(folder)!r}")
    return dict(sorted(found.items()))


def select_notebooks(notebooks: dict[int, Path], only: str | None) -> list[Path]:
    """The notebooks named by ``--only`` ("00,03" or "0,3"), in course order; all when None."""
    if only is None:
        return list(notebooks.values())
    available = ", ".join(f"{n:02d}" for n in notebooks)
    wanted = set()
    for item in only.split(","):
        item = item.strip()
        if not item.isdecimal():
            raise CourseError(f"--only: {item!r} is not a notebook number; available: {available}")
        if int(item) not in notebooks:
            raise CourseError(f"--only: no notebook numbered {item}; available: {available}")
        wanted.add(int(item))
    return [path for number, path in notebooks.items() if number in wanted]


def parse_value(text: str):
    """A ``-p`` value as a Python literal (``ast.literal_eval``), else the plain string.

    Only the types papermill writes back as literals are accepted: None, bool, int, float, str,
    and lists / str-keyed dicts of them (a tuple or set would reach the notebook as a string).
    """
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    _check_literal(text, value)
    return value


def _check_literal(text: str, value) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for item in value:
            _check_literal(text, item)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CourseError(f"value {text!r}: dict keys must be strings")
            _check_literal(text, item)
        return
    raise CourseError(
        f"value {text!r} is a {type(value).__name__}; allowed: None, bool, int, float, str, list, dict"
    )


def notebook_parameters(path: Path) -> dict:
    """Names and default values assigned in the notebook's cell tagged ``parameters``.

    The cell's source is parsed with :mod:`ast` (no code runs); a default that is not a literal is
    returned as its source text. A notebook without a ``parameters`` cell has no parameters.
    """
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])]
    if not cells:
        return {}
    source = cells[0].source  # papermill injects after the first tagged cell, so that one counts
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise CourseError(f"{path.name}: the parameters cell is not valid Python ({err.msg}, line {err.lineno})")
    params = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                try:
                    params[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    params[target.id] = ast.get_source_segment(source, node.value)
    return params


def plan_parameters(paths: list[Path], preset: str, device: str, extra: dict) -> dict[Path, dict]:
    """The parameters each notebook receives; raises CourseError for a name no notebook defines."""
    defined = {path: notebook_parameters(path) for path in paths}
    allowed = sorted(set().union(*defined.values()))
    for name in extra:
        if name in ("preset", "device"):
            raise CourseError(f"-p {name}: use --{name} instead")
        if not any(name in names for names in defined.values()):
            scope = ", ".join(p.name for p in paths)
            raise CourseError(
                f"-p {name}: no parameters cell defines {name!r} (in {scope}); allowed names: {', '.join(allowed)}"
            )
    given = {"preset": preset, "device": device, **extra}
    return {path: {k: v for k, v in given.items() if k in names} for path, names in defined.items()}


def parse_param_pairs(pairs: list[list[str]] | None) -> dict:
    """``[[name, value], ...]`` from repeated ``-p NAME VALUE`` -> {name: typed value}."""
    params = {}
    for name, text in pairs or []:
        if not name.isidentifier():
            raise CourseError(f"-p {name!r}: a parameter name must be a Python identifier")
        if name in params:
            raise CourseError(f"-p {name}: given more than once")
        params[name] = parse_value(text)
    return params


def headline_of(nb) -> str:
    """The last stdout line of an executed notebook that starts with ``HEADLINE: `` (prefix removed)."""
    found = ""
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stdout":
                for line in output.get("text", "").splitlines():
                    if line.startswith(HEADLINE_PREFIX):
                        found = line[len(HEADLINE_PREFIX):].strip()
    return found


def check_kernel(kernel_name: str) -> None:
    """Fail clearly when the Jupyter kernel is missing; warn when it runs another Python."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    fix = "register this interpreter's kernel with: python -m ipykernel install --user"
    try:
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
    except NoSuchKernel:
        raise CourseError(f"no Jupyter kernel named {kernel_name!r}; {fix}") from None
    exe = shutil.which(spec.argv[0]) if spec.argv else None
    if exe is None or os.path.realpath(exe) != os.path.realpath(sys.executable):
        print(f"warning: kernel {kernel_name!r} runs {spec.argv[0]!r}, not {sys.executable}; "
              f"if k3lab is missing there, {fix}", file=sys.stderr)


@contextlib.contextmanager
def _kernel_environment():
    """Kernels inherit the environment: keep figures in the notebook even under MPLBACKEND=Agg, and
    run torch on one thread unless OMP_NUM_THREADS says otherwise (the tiny models' small ops run
    faster single-threaded, and two threads thrash on a busy 2-core machine)."""
    changes = {"MPLBACKEND": INLINE_BACKEND, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    old = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def edited_notebooks(notebooks_dir: Path) -> list[Path]:
    """Notebooks under ``notebooks_dir`` (records in subfolders too) that differ from the last commit: modified,
    deleted or staged, as ``git status --porcelain`` lists them (a new notebook, untracked or added, is not an edit). Empty
    outside a git checkout or when git is missing."""
    folder = Path(notebooks_dir).resolve()
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=folder, capture_output=True, text=True,
                             timeout=30)
        if top.returncode != 0:
            return []
        status = subprocess.run(["git", "status", "--porcelain", "-z", "--", "."], cwd=folder, capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if status.returncode != 0:
        return []
    root, found = Path(top.stdout.strip()), []
    entries = iter(status.stdout.split("\0"))
    for entry in entries:
        code, name = entry[:2], entry[3:]
        if "R" in code or "C" in code:
            next(entries, None)  # a rename or copy: the next entry is the old name
        if not name or code in ("??", "!!") or code[0] == "A" or not name.endswith(".ipynb"):  # "A": new, staged
            continue
        found.append(root / name)
    return sorted(found)


def edited_note(notebooks_dir: Path) -> str:
    """One line naming the edited notebooks and the command that resets them (paths relative to the working
    directory), or '' when none is edited."""
    edited = edited_notebooks(notebooks_dir)
    if not edited:
        return ""
    shown = []
    for path in edited:
        try:
            shown.append(os.path.relpath(path))
        except ValueError:  # another drive (Windows)
            shown.append(str(path))
    return (f"note: edited since the last commit (run as edited): {', '.join(shown)}; "
            f"to reset: git checkout -- {' '.join(shown)}")


def run_notebook(path: Path, out_dir: Path, parameters: dict, kernel_name: str) -> NotebookResult:
    """Execute one notebook into ``out_dir`` with papermill; never raises for a notebook error."""
    import papermill

    out_path = out_dir / path.name
    start = time.perf_counter()
    try:
        with _kernel_environment():
            nb = papermill.execute_notebook(
                str(path), str(out_path), parameters=parameters, kernel_name=kernel_name,
                cwd=str(path.parent), progress_bar=False,
            )
        status, headline = "ok", headline_of(nb)
    except Exception as err:  # a failing notebook is a result, not the end of the course
        status = "failed"
        if isinstance(err, papermill.PapermillExecutionError):
            headline = f"{err.ename}: {err.evalue}"
        else:
            headline = f"{type(err).__name__}: {err}"
        headline = " ".join(headline.split())[:200] + f" (see {out_path})"
    return NotebookResult(path.stem, status, time.perf_counter() - start, headline)


def summary_markdown(results: list[NotebookResult], header: str = "") -> str:
    """The summary as a markdown table (also what the terminal shows)."""
    lines = [header, ""] if header else []
    lines += ["| notebook | status | seconds | headline |", "|---|---|---:|---|"]
    for r in results:
        headline = r.headline.replace("|", "\\|") or "—"
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} | {headline} |")
    failed = sum(r.status != "ok" for r in results)
    total = sum(r.seconds for r in results)
    lines += ["", f"{len(results) - failed}/{len(results)} ok, {total:.1f} s in all"]
    return "\n".join(lines) + "\n"


def run_course(
    notebooks_dir: Path = DEFAULT_NOTEBOOKS,
    out_dir: Path = Path("runs"),
    preset: str = "tiny",
    device: str = "auto",
    only: str | None = None,
    params: dict | None = None,
    kernel_name: str = "python3",
) -> list[NotebookResult]:
    """Validate everything, run the selected notebooks in order, write ``summary.md``; return the rows."""
    if preset not in RUNNABLE_PRESETS:
        raise CourseError(f"--preset {preset!r}: allowed values are {RUNNABLE_PRESETS}")
    if not DEVICE_PATTERN.match(device):
        raise CourseError(f"--device {device!r}: allowed values are auto, cpu, cuda, cuda:N")
    notebooks_dir, out_dir = Path(notebooks_dir).resolve(), Path(out_dir).resolve()
    if out_dir == notebooks_dir:
        raise CourseError("--out must differ from the notebooks folder (the course would overwrite itself)")
    paths = select_notebooks(find_notebooks(notebooks_dir), only)
    plan = plan_parameters(paths, preset, device, params or {})
    check_kernel(kernel_name)
    out_dir.mkdir(parents=True, exist_ok=True)
    note = edited_note(notebooks_dir)
    if note:
        print(note, flush=True)

    results = []
    for i, path in enumerate(paths, 1):
        shown = ", ".join(f"{k}={v!r}" for k, v in plan[path].items())
        print(f"[{i}/{len(paths)}] {path.name}  ({shown})", flush=True)
        result = run_notebook(path, out_dir, plan[path], kernel_name)
        print(f"      {result.status} in {result.seconds:.1f} s  {result.headline}", flush=True)
        results.append(result)

    given = ", ".join(f"{k}={v!r}" for k, v in {"preset": preset, "device": device, **(params or {})}.items())
    summary = summary_markdown(results, header=f"# k3lab course summary\n\n{given}")
    (out_dir / "summary.md").write_text(summary)
    print("\n" + summary + f"\nwritten: {out_dir / 'summary.md'}")
    return results


def add_course_parser(subparsers) -> None:
    """Register the ``course`` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "course",
        help="run the course notebooks through papermill and summarise them",
        description="Run the course notebooks (notebooks/<NN>_<topic>.ipynb, in number order) through papermill "
                    "into --out, then print and write summary.md (notebook, status, seconds, headline). "
                    "Exit status 1 if a notebook failed, 2 for a usage error.",
        epilog="examples:\n  python -m k3lab course\n  python -m k3lab course --only 00,03 --out runs/\n"
               "  python -m k3lab course --preset small --device cuda -p steps 2000 -p lr 3e-4\n"
               "  python -m k3lab course --only 05 -p mode chunk -p flag \"'True'\"   (the string 'True', not the bool)\n"
               "  python -m k3lab course --list",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="tiny", help=f"model preset passed to every notebook {RUNNABLE_PRESETS} (default tiny)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--only", metavar="NN,NN", help="run only these notebook numbers, e.g. 00,03")
    p.add_argument("--out", default="runs", type=Path, help="output folder for executed notebooks and summary.md")
    p.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="set a notebook parameter; VALUE is a Python literal or a plain string (repeatable)")
    p.add_argument("--kernel", default="python3", help="Jupyter kernel name (default python3)")
    p.add_argument("--notebooks", type=Path, default=DEFAULT_NOTEBOOKS, help="notebooks folder (default: the repository's)")
    p.add_argument("--list", action="store_true", help="list the notebooks and their parameters, run nothing")
    p.set_defaults(func=course_main)


def list_notebooks(notebooks_dir: Path, only: str | None) -> None:
    """Print each selected notebook with its parameters and defaults (after the edited-notebooks line, if any)."""
    paths = select_notebooks(find_notebooks(notebooks_dir), only)
    note = edited_note(notebooks_dir)
    if note:
        print(note)
    for path in paths:
        params = ", ".join(f"{k}={v!r}" for k, v in notebook_parameters(path).items())
        print(f"{path.name}: {params or '(no parameters cell)'}")


def course_main(args: argparse.Namespace) -> int:
    """Entry point of ``python -m k3lab course``; returns the exit status."""
    if args.list:
        list_notebooks(args.notebooks, args.only)
        return 0
    results = run_course(args.notebooks, args.out, args.preset, args.device, args.only,
                         parse_param_pairs(args.param), args.kernel)
    return 1 if any(r.status != "ok" for r in results) else 0
