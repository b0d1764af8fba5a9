"""Opening a notebook in JupyterLab and saving it changes nothing; the GPU run records cannot be saved at all.

A real ``jupyter server`` (free port, its own runtime and config folders, a token, the repository's
``jupyter_server_config.py`` given with ``--config``, as the README starts Lab) is driven through its REST contents
API the way JupyterLab drives it when a notebook is opened and saved:

1. GET the notebook (``type=notebook``, what Lab loads);
2. what the browser does to it: the JSON goes through JavaScript (an integral float such as ``195.0`` comes back
   as ``195``), and once the kernel starts, Lab writes the kernel's spec from ``GET /api/kernelspecs`` into
   ``metadata.kernelspec``;
3. PUT it back and compare the bytes on disk with the bytes before.

Copies of every notebook are saved, in a temporary folder. Not covered: ``metadata.language_info``, which Lab takes
from the running kernel (its Python version depends on the reader's machine; starting 23 kernels would take minutes).
The records' protection is checked against the real files: the PUT must be refused and the file left as it was.
Each step waits on the server's HTTP answers, never on a fixed sleep.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("jupyter_server")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "jupyter_server_config.py"
sys.path.insert(0, str(ROOT / "tools"))
import normalize_notebooks  # noqa: E402

NOTEBOOKS = normalize_notebooks.default_notebooks()
RECORDS = [p for p in NOTEBOOKS if p.parent.name == "gpu_runs"]
START_TIMEOUT_S = 60  # a deadline for a wedged server, not a wait: readiness is polled over HTTP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``jupyter server`` process and a tiny client for its REST API."""

    def __init__(self, url: str, token: str, proc: subprocess.Popen, log: Path):
        self.url, self.token, self.proc, self.log = url, token, proc, log

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def get_notebook(self, api_path: str) -> tuple[dict, str]:
        """The contents model (JSON text too: the browser parses that text, not Python's objects)."""
        status, text = self.request("GET", f"/api/contents/{api_path}?type=notebook&content=1")
        assert status == 200, (status, text)
        return json.loads(text), text


@contextmanager
def jupyter_server(root_dir: Path, tmp: Path):
    """Start ``python -m jupyter_server`` on ``root_dir``; yield a :class:`Server` once ``/api/status`` answers."""
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTER_NO_CONFIG="1")  # no user or system config: only the repository's, as --config names it
    log = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root", f"--config={CONFIG}",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.root_dir={root_dir}", f"--IdentityProvider.token={token}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
    server = Server(f"http://127.0.0.1:{port}", token, proc, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if server.request("GET", "/api/status")[0] == 200:
                    break
            except OSError:  # not listening yet
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter server did not answer in {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _js_number(text: str):
    """``JSON.parse`` then ``JSON.stringify`` of one number, as Python reads it back (the server's json.loads)."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 1e21 else value


def _as_lab_saves(text: str, kernelspecs: dict) -> dict:
    """The notebook model Lab PUTs after opening ``text`` (the GET answer) and starting its kernel."""
    model = json.loads(text, parse_float=_js_number)
    meta = model["content"]["metadata"]
    name = meta.get("kernelspec", {}).get("name")
    if name in kernelspecs:
        spec = kernelspecs[name]["spec"]
        meta["kernelspec"] = {"display_name": spec["display_name"], "language": spec["language"], "name": name}
    return {"type": "notebook", "format": "json", "content": model["content"]}


@pytest.fixture(scope="module")
def copies_server(tmp_path_factory):
    """A server on a temporary folder holding copies of every notebook (notebooks/..., same relative paths)."""
    tmp = tmp_path_factory.mktemp("open_clean")
    for path in NOTEBOOKS:
        target = tmp / "root" / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    with jupyter_server(tmp / "root", tmp) as server:
        status, text = server.request("GET", "/api/kernelspecs")
        assert status == 200, text
        server.kernelspecs = json.loads(text)["kernelspecs"]
        yield server, tmp / "root"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in NOTEBOOKS])
def test_open_and_save_in_lab_changes_no_byte(copies_server, path):
    server, root = copies_server
    api_path = path.relative_to(ROOT).as_posix()
    before = (root / api_path).read_bytes()
    model, text = server.get_notebook(api_path)
    assert model["writable"], f"{api_path}: a copy outside the repository's notebooks/gpu_runs/ is writable"
    status, answer = server.request("PUT", f"/api/contents/{api_path}", _as_lab_saves(text, server.kernelspecs))
    assert status == 200, (status, answer)  # the records' copies too: only this checkout's records are protected
    after = (root / api_path).read_bytes()
    assert after == before, (f"{api_path} changes when JupyterLab saves it: run "
                             f"`python tools/normalize_notebooks.py {api_path}`")


def test_committed_kernelspec_is_the_installed_ipykernels(copies_server):
    """The spec the normaliser writes is what the server offers for ``python3`` (ipykernel's own)."""
    server, _ = copies_server
    spec = server.kernelspecs.get("python3", {}).get("spec")
    if spec is None:
        pytest.skip("no python3 kernelspec installed")
    assert {k: spec[k] for k in ("display_name", "language")} == {
        k: normalize_notebooks.KERNELSPEC[k] for k in ("display_name", "language")}


@pytest.mark.skipif(not RECORDS, reason="no records under notebooks/gpu_runs/")
def test_gpu_run_records_are_read_only(tmp_path):
    """Lab sees the records as not writable, and a save onto one is refused with the reason; the file is left as it
    was. A notebook outside gpu_runs/ stays writable (the course notebooks are only read here)."""
    record = RECORDS[0]
    api_path = record.relative_to(ROOT / "notebooks").as_posix()
    before, mtime = record.read_bytes(), record.stat().st_mtime_ns
    with jupyter_server(ROOT / "notebooks", tmp_path) as server:
        try:
            for rec in RECORDS:
                model, _ = server.get_notebook(rec.relative_to(ROOT / "notebooks").as_posix())
                assert model["writable"] is False, rec
            course, _ = server.get_notebook(NOTEBOOKS[0].relative_to(ROOT / "notebooks").as_posix())
            assert course["writable"] is True
            model, _ = server.get_notebook(api_path)
            status, answer = server.request("PUT", f"/api/contents/{api_path}",
                                            {"type": "notebook", "format": "json", "content": model["content"]})
            assert status == 403, (status, answer)
            message = json.loads(answer)["message"]
            assert "read-only record" in message and "Save Notebook As" in message, message
            new = "gpu_runs/_k3lab_test_new_record.ipynb"  # a new notebook in the records' folder: refused too
            status, answer = server.request("PUT", f"/api/contents/{new}",
                                            {"type": "notebook", "format": "json", "content": model["content"]})
            assert status == 403 and not (ROOT / "notebooks" / new).exists(), (status, answer)
        finally:
            if record.read_bytes() != before:  # the protection failed: put the record back before failing
                record.write_bytes(before)
            (ROOT / "notebooks" / "gpu_runs" / "_k3lab_test_new_record.ipynb").unlink(missing_ok=True)
    assert record.read_bytes() == before and record.stat().st_mtime_ns == mtime
