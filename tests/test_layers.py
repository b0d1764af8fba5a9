"""The core package never imports the course wing (issue 29 item 5).

``k3lab/experiments/`` holds the course code (notebook helpers, the course runner, toy models, simulations,
the notebooks' gloo workers); everything else under ``k3lab/`` is the core: the model, kernels and trainer.
The course may import the core, never the other way round. Each core module is parsed with :mod:`ast`
and every import in it is checked: top-level, inside functions, relative, and ``import_module("...")``
/ ``__import__("...")`` calls with a literal name.

The one exception is ``k3lab/__main__.py``, the command line (``python -m k3lab course``): it is the top of
the stack, and no core module imports it (checked below too).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "k3lab"
COURSE = "k3lab.experiments"
ENTRY_POINT = "k3lab.__main__"  # the command line: may import the course, and nothing imports it


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module name ``source`` (the text of ``module``) imports, at any depth of the syntax tree;
    ``from a import b`` yields ``a`` and ``a.b`` (b may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                absolute = ".".join(base + ([node.module] if node.module else []))
            else:
                absolute = node.module or ""
            names.add(absolute)
            names.update(f"{absolute}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in ("import_module", "__import__")):
            names.add(node.args[0].value)
    return names


def is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def core_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
            if not is_under(module_name(p), COURSE) and "__pycache__" not in p.parts}


def test_the_checker_sees_every_kind_of_import():
    src = ("import k3lab.experiments.nb\n"
           "def f():\n    from k3lab.experiments import toy\n"
           "def g():\n    from ..experiments.numerics import log_range\n"
           "import importlib\nimportlib.import_module('k3lab.experiments.course')\n")
    names = imported_names(src, "k3lab.mixers.kda")
    assert {"k3lab.experiments.nb", "k3lab.experiments.toy", "k3lab.experiments.numerics",
            "k3lab.experiments.course"} <= names
    assert "k3lab.experiments" in imported_names("from . import experiments", "k3lab.model")
    assert "k3lab.experiments" in imported_names("from . import experiments", "k3lab", is_package=True)
    assert not any(is_under(n, COURSE) for n in imported_names("from k3lab.mixers import kda", "k3lab.model"))


def test_core_never_imports_course_code():
    modules = core_modules()
    assert {"k3lab.model", "k3lab.train", "k3lab.mixers.kda", ENTRY_POINT} <= set(modules)
    offenders = []
    for name, path in modules.items():
        if name == ENTRY_POINT:
            continue
        for imported in imported_names(path.read_text(encoding="utf-8"), name, path.stem == "__init__"):
            if is_under(imported, COURSE) or is_under(imported, ENTRY_POINT):
                offenders.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not offenders, "core modules import course code:\n" + "\n".join(offenders)
