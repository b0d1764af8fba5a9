"""Normalise notebooks so that JupyterLab has nothing to rewrite when it opens and saves them.

What Lab changes in a notebook it opens, and so what this tool does to the saved file:

* **The JSON layout.** Jupyter's contents manager saves with ``nbformat.write``: keys sorted, indent of 1 space,
  ``ensure_ascii=False``, multi-line strings (sources, stream text, text outputs) split into lists of lines, and a
  trailing newline. papermill and ``nbformat.writes`` omit that newline; hand edits and other tools may differ in
  indentation, key order or string splitting.
* **nbformat minor version and cell ids.** A notebook older than 4.5 is upgraded and every cell gets an ``id``; ids
  that are missing or invalid are (re)generated. ``nbformat.validator.normalize`` does both.
* **Stream outputs.** Lab's output area merges consecutive ``stream`` outputs of the same name (stdout/stderr)
  into one, and applies carriage returns and backspaces to the text (a tqdm bar that rewrote one line 20 times is
  kept as its last state). Papermill stores every write as its own output, ``\\r`` included; Lab's merged form
  differs from the file, so the notebook comes up changed. This tool merges the same way (JupyterLab 4's
  ``OutputAreaModel._add`` / ``Private.processText``).

* **The kernelspec.** When the kernel starts, Lab writes the kernel's spec into ``metadata.kernelspec``; for
  ``python3`` that is ipykernel's ``{"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}``
  (:data:`KERNELSPEC`). A notebook that says ``"Python 3"`` (papermill copies what it was given) opens modified.
* **Numbers.** Lab holds the notebook as JavaScript values and sends them back as JSON: a float with an integral
  value loses its ``.0`` (``"budget_s": 195.0`` is saved as ``195``, widget state ``1.0`` as ``1``). This tool
  writes such floats as ints (below 1e21, where JavaScript stops writing integers in full).

Not normalised (Lab never rewrites them on open): execution counts, cell and notebook metadata other than the
above (papermill's timings are kept), output data. What Lab may still change once a kernel starts is
``metadata.language_info`` (the kernel's Python version): that depends on the reader's machine (the records under
notebooks/gpu_runs/ keep the Python they ran on; ``jupyter_server_config.py`` keeps Lab from saving them).

These were found by opening every notebook in JupyterLab 4.6 in a browser and saving it (2026-12-06);
``tests/test_notebooks_open_clean.py`` does the server's half (GET and PUT through a real ``jupyter server``).

Usage (from the repository root)::

    python tools/normalize_notebooks.py --check               # exit 1 and list the notebooks that would change
    python tools/normalize_notebooks.py                       # rewrite every notebook under notebooks/ in place
    python tools/normalize_notebooks.py notebooks/00_tour.ipynb notebooks/03_*.ipynb   # only these files

``tests/test_notebooks_normalized.py`` asserts that every committed notebook is a fixed point.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat
from nbformat.v4.nbbase import random_cell_id
from nbformat.validator import normalize as _nbformat_normalize

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIRS = (ROOT / "notebooks", ROOT / "notebooks" / "gpu_runs")
_CONTROL = re.compile(r"[\n\b\r]")
_CELL_ID = re.compile(r"[a-zA-Z0-9-_]{1,64}")  # nbformat 4.5's cell id schema
# What JupyterLab writes into metadata.kernelspec once ipykernel's python3 kernel starts (ipykernel >= 6:
# ``ipykernel.kernelspec.get_kernel_dict()``; tests/test_notebooks_normalized.py checks it against the installed one)
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def default_notebooks() -> list[Path]:
    """Every ``.ipynb`` under notebooks/ and notebooks/gpu_runs/ (checkpoints excluded)."""
    found = []
    for folder in NOTEBOOK_DIRS:
        if folder.is_dir():
            found += [p for p in sorted(folder.glob("*.ipynb")) if ".ipynb_checkpoints" not in p.parts]
    return found


def _process_text(index: int, text: str, buffer: str = "") -> tuple[str, int]:
    """JupyterLab's ``Private.processText``: write ``text`` into ``buffer`` at ``index`` as a terminal would
    (``\\r`` returns to the start of the line and overwrites, ``\\b`` deletes the previous character of the
    line); returns the new buffer and the cursor index."""
    if not ("\b" in text or "\r" in text or "\n" in text):
        return buffer[:index] + text + buffer[index + len(text):], index + len(text)
    cursor, start = index, 0
    while True:
        match = _CONTROL.search(text, start)
        stop = match.start() if match else len(text)
        chunk = text[start:stop]
        buffer = buffer[:cursor] + chunk + buffer[cursor + len(chunk):]
        cursor += len(chunk)
        if match is None:
            return buffer, cursor
        start = stop + 1
        char = text[stop]
        if char == "\b":
            if cursor > 0 and buffer[cursor - 1] != "\n":
                buffer = buffer[:cursor - 1] + buffer[cursor + 1:]
                cursor -= 1
        elif char == "\r":
            while cursor > 0 and buffer[cursor - 1] != "\n":
                cursor -= 1
        else:  # "\n"
            buffer += "\n"
            cursor = len(buffer)


def merge_streams(outputs: list) -> list:
    """Consecutive stream outputs of the same name merged, control characters applied (JupyterLab 4's output area
    model). Other outputs are returned as they are."""
    merged: list = []
    last_name, cursor = "", 0
    for output in outputs:
        if output.get("output_type") != "stream":
            merged.append(output)
            last_name = ""
            continue
        text = output.get("text", "")
        text = "".join(text) if isinstance(text, list) else text
        if merged and output.get("name") == last_name:
            previous = merged[-1]
            previous["text"], cursor = _process_text(cursor, text, previous["text"])
        else:
            output = copy.deepcopy(output)
            output["text"], cursor = _process_text(0, text)
            merged.append(output)
            last_name = output.get("name", "")
    return merged


def js_numbers(value):
    """``value`` as it comes back from a JSON round trip through JavaScript: integral floats become ints (JavaScript
    has one number type and ``JSON.stringify(195.0)`` is ``"195"``); everything else is returned as it is."""
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 1e21 else value
    if isinstance(value, dict):
        return {k: js_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [js_numbers(v) for v in value]
    return value


def normalized(text: str) -> str:
    """The bytes (as str) JupyterLab would save for the notebook whose file content is ``text``."""
    nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
    if nb.nbformat == 4 and nb.nbformat_minor < 5:
        nb = nbformat.v4.upgrade(nb, from_version=nb.nbformat, from_minor=nb.nbformat_minor)
    _, nb = _nbformat_normalize(nb, version=4, version_minor=5)
    nb = nbformat.from_dict(js_numbers(nb))
    if nb.metadata.get("kernelspec", {}).get("name") == KERNELSPEC["name"]:
        nb.metadata.kernelspec = dict(nb.metadata.kernelspec, **KERNELSPEC)
    seen = set()
    for cell in nb.cells:
        if not isinstance(cell.get("id"), str) or not _CELL_ID.fullmatch(cell["id"]) or cell["id"] in seen:
            cell["id"] = random_cell_id()  # missing, invalid or duplicate: what Jupyter does on load
        seen.add(cell["id"])
        if cell.get("cell_type") == "code" and cell.get("outputs"):
            cell.outputs = [nbformat.from_dict(o) for o in merge_streams(cell.outputs)]
    out = nbformat.writes(nb, version=nbformat.NO_CONVERT)
    return out if out.endswith("\n") else out + "\n"  # what nbformat.write (the contents manager) appends


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: notebooks/*.ipynb and notebooks/gpu_runs/*.ipynb)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any notebook is not normalised")
    args = parser.parse_args(argv)
    paths = args.paths or default_notebooks()
    changed = []
    for path in paths:
        raw = path.read_bytes().decode("utf-8")
        want = normalized(raw)
        if want != raw:
            changed.append(path)
            if not args.check:
                path.write_bytes(want.encode("utf-8"))
    verb = "not normalised" if args.check else "normalised"
    for path in changed:
        print(f"{verb}: {path}")
    print(f"{len(changed)} of {len(paths)} notebooks {verb}" if changed else f"all {len(paths)} notebooks normalised")
    return 1 if (changed and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
