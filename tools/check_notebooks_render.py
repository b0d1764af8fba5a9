"""Open every committed notebook in JupyterLab in headless Chromium and check what a reader sees.

    python tools/check_notebooks_render.py                    # all notebooks, untrusted and trusted
    python tools/check_notebooks_render.py --only 01 05 --out runs/render --modes trusted
    python tools/check_notebooks_render.py --explorers 04              # also run 04 and move its sliders

What it does, with nothing but the standard library, JupyterLab and the OS's Chromium:

1. copies ``notebooks/*.ipynb`` into a temporary folder (the committed files are never opened for
   writing), and for ``--modes trusted`` marks the copies trusted (``jupyter trust``, in a temporary
   data dir: that is when JupyterLab renders widget views and HTML);
2. starts ``jupyter lab --no-browser`` on a free port with a random token, with isolated settings
   (no workspace restore, every cell kept in the page: ``windowingMode = "none"``);
3. drives ``chromedriver`` (W3C WebDriver over HTTP) to open each notebook, waits until every cell
   and image has rendered, and reads the text of every rendered output area;
4. fails a notebook if any output shows an unfinished progress bar (``0%|``, ``7/30 [`` with 7 < 30),
   ``Loading widget...`` or a widget error, or if the file holds a widget-view output (it has no
   saved state, so a reader can never see it);
5. saves a screenshot of the top of each notebook and one of each progress bar, scrolled into view;
6. with ``--explorers 03 04 05``: *runs* those notebooks in JupyterLab (``notebook:run-all-cells``) and
   checks that the ``k3lab.experiments.nb.explore`` cell shows sliders and a plot, then moves the first slider one step
   and waits for the redrawn plot (screenshots ``NN_name-explorer.png`` and ``-explorer-moved.png``).

Exit status 0: all clean; 1: a notebook failed (listed); 2: setup failed (message);
77: Chromium, chromedriver or JupyterLab is missing (the test skips on it).
Chromium: the OS package (Debian/Ubuntu ``apt-get install chromium chromium-driver``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = 77  # exit status when a tool is missing (automake's "skipped")
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

# an unfinished bar: a percentage below 100 followed by tqdm's "|", or "n/total [" with n < total
PERCENT_BAR = re.compile(r"(?<![\d.])(\d{1,3})%\|")
COUNT_BAR = re.compile(r"(?<![\d.])(\d+)/(\d+) \[")
WIDGET_PROBLEMS = ("Loading widget", "Error displaying widget", "Widget Javascript not detected",
                   "Failed to display Jupyter Widget")


def find_tools() -> tuple[str | None, str | None, bool]:
    """(chromium path, chromedriver path, JupyterLab importable)."""
    chromium = next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)
    driver = shutil.which("chromedriver")
    try:
        import jupyterlab  # noqa: F401
        lab = True
    except ImportError:
        lab = False
    return chromium, driver, lab


def unfinished_bars(text: str) -> list[str]:
    """The unfinished progress bars (and widget placeholders) in one rendered output's text."""
    found = [m.group(0) for m in PERCENT_BAR.finditer(text) if int(m.group(1)) < 100]
    found += [m.group(0) for m in COUNT_BAR.finditer(text) if int(m.group(1)) < int(m.group(2))]
    found += [w for w in WIDGET_PROBLEMS if w in text]
    return found


def widget_view_outputs(path: Path) -> list[int]:
    """Indices of the cells whose saved outputs include a widget view (never renders from a file)."""
    nb = json.loads(path.read_text())
    return [i for i, c in enumerate(nb["cells"])
            if any(WIDGET_VIEW in o.get("data", {}) for o in c.get("outputs", []))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 60, token: str | None = None):
    """One JSON request to a local server this script started (chromedriver or JupyterLab on 127.0.0.1):
    the WebDriver protocol is HTTP. Nothing is downloaded; no other host is contacted."""
    if not url.startswith(("http://127.0.0.1:", "http://localhost:")):
        raise ValueError(f"http: {url!r} is not a local server this script started")
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"token {token}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


class SetupError(RuntimeError):
    """JupyterLab, chromedriver or a page did not come up."""


def wait_until(check, timeout: float, what: str, every: float = 0.25):
    end = time.monotonic() + timeout
    while True:
        try:
            value = check()
            if value:
                return value
        except SetupError:
            raise
        except Exception:  # noqa: BLE001 (not up yet)
            pass
        if time.monotonic() > end:
            raise SetupError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class WebDriver:
    """The few W3C WebDriver commands this check needs, over chromedriver's HTTP API."""

    def __init__(self, chromium: str, driver: str, width: int, height: int, log: Path):
        self.port = free_port()
        self.proc = subprocess.Popen([driver, f"--port={self.port}"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        wait_until(lambda: http("GET", f"{self.base}/status")["value"]["ready"], 30, "chromedriver")
        args = ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--hide-scrollbars", f"--window-size={width},{height}", "--force-device-scale-factor=1"]
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome",
                                                 "goog:chromeOptions": {"binary": chromium, "args": args}}}}
        self.session = http("POST", f"{self.base}/session", caps, timeout=120)["value"]["sessionId"]
        self.url = f"{self.base}/session/{self.session}"

    def get(self, url: str):
        http("POST", f"{self.url}/url", {"url": url}, timeout=120)

    def js(self, script: str, *args):
        return http("POST", f"{self.url}/execute/sync", {"script": script, "args": list(args)}, timeout=120)["value"]

    def screenshot(self, path: Path):
        import base64

        path.write_bytes(base64.b64decode(http("GET", f"{self.url}/screenshot", timeout=120)["value"]))

    def close(self):
        try:
            http("DELETE", self.url, timeout=30)
        except Exception:  # noqa: BLE001
            pass
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Lab:
    """``jupyter lab --no-browser`` on a free port with a token, in ``root``, with isolated settings."""

    def __init__(self, root: Path, home: Path, log: Path):
        self.port, self.token = free_port(), secrets.token_hex(16)
        settings = home / "settings" / "@jupyterlab" / "notebook-extension"
        settings.mkdir(parents=True)
        (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
        apputils = home / "settings" / "@jupyterlab" / "apputils-extension"
        apputils.mkdir(parents=True)
        (apputils / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                                "checkForUpdates": False}))
        self.env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
                        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), JUPYTER_DATA_DIR=str(home / "data"),
                        JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_CONFIG_DIR=str(home / "config"))
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
               "--ServerApp.open_browser=False", "--LabApp.news_url=None", "--ServerApp.disable_check_xsrf=True",
               "--LabApp.expose_app_in_browser=True"]  # window.jupyterapp: run cells for --explorers
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")  # containers often run as root
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=root)
        self.base = f"http://127.0.0.1:{self.port}"

        def up():
            if self.proc.poll() is not None:
                raise SetupError(f"jupyter lab exited with status {self.proc.returncode}; see {log}")
            return http("GET", f"{self.base}/api/status", token=self.token)

        wait_until(up, 120, "jupyter lab")

    def shutdown_kernels(self):
        """End the sessions that opening notebooks started (their kernels idle, but hold memory)."""
        for s in http("GET", f"{self.base}/api/sessions", token=self.token) or []:
            try:
                http("DELETE", f"{self.base}/api/sessions/{s['id']}", token=self.token)
            except urllib.error.HTTPError:
                pass

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


READY_JS = """
const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
if (!nb) return null;
const cells = nb.querySelectorAll('.jp-Cell').length;
const imgs = Array.from(nb.querySelectorAll('.jp-OutputArea-output img'));
const pending = imgs.filter(i => !i.complete).length;
const spin = document.querySelectorAll('.jp-Spinner').length;
return {cells: cells, images: imgs.length, pending: pending, spinners: spin};
"""

OUTPUTS_JS = """
const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
return Array.from(nb.querySelectorAll('.jp-Cell')).map((cell, i) => ({
    cell: i,
    code: cell.classList.contains('jp-CodeCell'),
    outputs: Array.from(cell.querySelectorAll('.jp-OutputArea-output')).map(o => o.textContent)}));
"""

SCROLL_JS = """
const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
const cells = nb.querySelectorAll('.jp-Cell');
if (arguments[0] < 0) { nb.scrollTop = 0; return true; }
const outs = cells[arguments[0]].querySelectorAll('.jp-OutputArea-output');
outs[arguments[1]].scrollIntoView({block: 'center'});
return true;
"""


def check_notebook(driver: WebDriver, lab: Lab, path: Path, shots: Path, mode: str, max_bar_shots: int) -> dict:
    """Open one notebook and return ``{"problems": [...], "bars": [...], "screenshots": [...]}``."""
    nb = json.loads(path.read_text())
    n_cells = len(nb["cells"])
    driver.get(f"{lab.base}/lab/tree/{path.name}?reset&token={lab.token}")

    def ready():
        state = driver.js(READY_JS)
        return state if state and state["cells"] == n_cells and state["pending"] == 0 and not state["spinners"] else None

    wait_until(ready, 120, f"{path.name} to render ({n_cells} cells)", every=0.5)
    time.sleep(1.0)  # let late renderers (widget manager, images' layout) settle
    cells = driver.js(OUTPUTS_JS)
    problems, bars = [], []
    for cell in cells:
        for j, text in enumerate(cell["outputs"]):
            bad = unfinished_bars(text)
            if bad:
                problems.append(f"cell {cell['cell']} output {j}: {', '.join(sorted(set(bad)))}")
            if "%|" in text or "it/s]" in text or "s/it]" in text or bad:
                last = [line for line in text.splitlines() if "%|" in line][-1:] or [text.strip()[-120:]]
                bars.append((cell["cell"], j, last[0].strip()))
    for i in widget_view_outputs(path):
        problems.append(f"cell {i}: saved widget-view output (no widget state is saved: a reader sees "
                        "'Loading widget...' or the text fallback)")
    stem = f"{path.stem}-{mode}"
    driver.js(SCROLL_JS, -1, 0)
    time.sleep(0.3)
    driver.screenshot(shots / f"{stem}.png")
    taken = [shots / f"{stem}.png"]
    for n, (cell, j, _) in enumerate(bars[:max_bar_shots]):
        driver.js(SCROLL_JS, cell, j)
        time.sleep(0.3)
        driver.screenshot(shots / f"{stem}-bar{n + 1}.png")
        taken.append(shots / f"{stem}-bar{n + 1}.png")
    lab.shutdown_kernels()
    return {"problems": problems, "bars": [b[2] for b in bars], "screenshots": [str(p) for p in taken]}


RUN_ALL_JS = """
const done = arguments[arguments.length - 1];
(async () => {
    const app = window.jupyterapp, panel = app.shell.currentWidget;
    await panel.sessionContext.ready;
    for (let i = 0; i < 1200 && panel.sessionContext.kernelDisplayStatus !== 'idle'; i++) {
        await new Promise(r => setTimeout(r, 100));
    }
    await app.commands.execute('notebook:run-all-cells');
    done(panel.sessionContext.kernelDisplayStatus);
})().catch(e => done(String(e)));
"""

EXPLORER_JS = """
const panel = window.jupyterapp.shell.currentWidget;
const cells = panel.content.widgets.filter(w => w.model.type === 'code');
const idx = cells.findIndex(w => w.model.sharedModel.getSource().includes('explore('));
const cell = idx >= 0 ? cells[idx] : null;
if (cell && arguments[0]) { (cell.node.querySelector('.jp-Cell-outputWrapper') || cell.node).scrollIntoView({block: 'start'}); }
if (cell && arguments[1]) {  // move the first slider one step (left, or right when it sits at its minimum)
    const handle = cell.node.querySelector('.noUi-handle');
    if (handle) {
        const atMin = handle.getAttribute('aria-valuenow') === handle.getAttribute('aria-valuemin');
        handle.dispatchEvent(new KeyboardEvent('keydown', {key: atMin ? 'ArrowRight' : 'ArrowLeft', bubbles: true}));
    }
}
return {status: panel.sessionContext.kernelDisplayStatus, found: idx >= 0,
        done: cells.filter(w => w.model.executionCount !== null).length, cells: cells.length,
        sliders: cell ? cell.node.querySelectorAll('.widget-slider').length : 0,
        images: cell ? cell.node.querySelectorAll('.jp-OutputArea-output img').length : 0,
        text: cell ? Array.from(cell.node.querySelectorAll('.jp-OutputArea-output')).map(o => o.textContent).join(' ') : ''};
"""


def check_explorer(driver: WebDriver, lab: Lab, path: Path, shots: Path, timeout: float) -> dict:
    """Run a notebook in JupyterLab (``notebook:run-all-cells``) and check that its ``k3lab.experiments.nb.explore``
    cell shows sliders and a plot (the kernel runs under a Jupyter server, so ``interactive="auto"`` is on)."""
    driver.get(f"{lab.base}/lab/tree/{path.name}?reset&token={lab.token}")
    n_cells = len(json.loads(path.read_text())["cells"])
    wait_until(lambda: (driver.js(READY_JS) or {}).get("cells") == n_cells, 120, f"{path.name} to open")
    http("POST", f"{driver.url}/timeouts", {"script": int(timeout * 1000)})
    t0 = time.monotonic()
    started = http("POST", f"{driver.url}/execute/async", {"script": RUN_ALL_JS, "args": []},
                   timeout=timeout + 30)["value"]
    state = wait_until(lambda: (lambda s: s if s["done"] == s["cells"] and s["status"] == "idle" else None)(
        driver.js(EXPLORER_JS, False, False)), max(timeout - (time.monotonic() - t0), 10), f"{path.name} to run", every=2.0)
    time.sleep(2.0)  # the widget's first plot
    state = driver.js(EXPLORER_JS, True, False)
    time.sleep(0.5)
    shot, moved_shot = shots / f"{path.stem}-explorer.png", shots / f"{path.stem}-explorer-moved.png"
    driver.screenshot(shot)
    problems = [] if state["found"] and state["sliders"] and state["images"] else [
        f"explorer cell: {state['sliders']} slider(s), {state['images']} plot(s) (run-all: {started!r})"]
    if "static plot at" in state["text"]:
        problems.append("the explorer fell back to its static plot inside JupyterLab")
    driver.js(EXPLORER_JS, False, True)  # one step on the first slider: the plot must be redrawn
    time.sleep(2.0)  # the kernel picks up the change (busy), then redraws
    moved = wait_until(lambda: (lambda s: s if s["status"] == "idle" and s["images"] and s["text"] != state["text"]
                                 else None)(driver.js(EXPLORER_JS, True, False)), 90,
                       "the explorer to redraw after a slider step", every=1.0)
    time.sleep(2.0)
    driver.screenshot(moved_shot)
    lab.shutdown_kernels()
    return {"problems": problems, "sliders": state["sliders"], "screenshots": [str(shot), str(moved_shot)],
            "text_before": state["text"][-300:], "text_after": moved["text"][-300:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", default=str(ROOT / "notebooks"), help="folder of committed notebooks")
    parser.add_argument("--only", nargs="*", default=None, help="notebook name prefixes, e.g. 01 05")
    parser.add_argument("--out", default=None, help="folder for screenshots and logs (default: a temp folder)")
    parser.add_argument("--modes", default="untrusted,trusted", help="comma list of untrusted, trusted")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1100)
    parser.add_argument("--bar-shots", type=int, default=2, help="screenshots of progress bars per notebook")
    parser.add_argument("--explorers", nargs="*", default=[], help="notebook prefixes to *run* in JupyterLab "
                        "(untrusted mode) and check that their explorer shows sliders, e.g. 04")
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds to run one notebook (--explorers)")
    args = parser.parse_args(argv)

    chromium, driver_path, lab_ok = find_tools()
    missing = [name for name, ok in (("chromium", chromium), ("chromedriver", driver_path), ("jupyterlab", lab_ok))
               if not ok]
    if missing:
        print(f"SKIP: missing {', '.join(missing)} (Debian/Ubuntu: apt-get install chromium chromium-driver; "
              "pip install jupyterlab)")
        return SKIP
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("untrusted", "trusted") for m in modes):
        print(f"--modes={args.modes!r}: allowed values are untrusted, trusted (comma-separated)")
        return 2
    sources = sorted(Path(args.notebooks).glob("*.ipynb"))
    if args.only:
        sources = [p for p in sources if any(p.name.startswith(o) for o in args.only)]
    if not sources:
        print(f"no notebooks matched in {args.notebooks} (--only {args.only})")
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="k3lab-render-"))
    out.mkdir(parents=True, exist_ok=True)
    failed, report = [], {}
    with tempfile.TemporaryDirectory(prefix="k3lab-lab-") as tmp:
        tmp = Path(tmp)
        for mode in modes:
            root, home = tmp / mode / "notebooks", tmp / mode / "home"
            root.mkdir(parents=True)
            home.mkdir(parents=True)
            for p in sources:
                shutil.copy2(p, root / p.name)
            lab = driver = None
            try:
                lab = Lab(root, home, out / f"jupyterlab-{mode}.log")
                if mode == "trusted":
                    subprocess.run([sys.executable, "-m", "jupyter", "trust", *[str(root / p.name) for p in sources]],
                                   env=lab.env, check=True, capture_output=True)
                driver = WebDriver(chromium, driver_path, args.width, args.height, out / f"chromedriver-{mode}.log")
                t0 = time.monotonic()
                for p in sources:
                    r = check_notebook(driver, lab, root / p.name, out, mode, args.bar_shots)
                    report[f"{p.name} ({mode})"] = r
                    status = "FAIL" if r["problems"] else "ok"
                    print(f"{status:4s} {p.name} ({mode}): {len(r['bars'])} progress bar(s)"
                          + (f", last: {r['bars'][-1]!r}" if r["bars"] else ""))
                    for problem in r["problems"]:
                        print(f"     {problem}")
                    if r["problems"]:
                        failed.append(f"{p.name} ({mode})")
                print(f"{mode}: {len(sources)} notebooks in {time.monotonic() - t0:.0f} s")
                for p in (sources if mode == modes[0] else []):
                    if not any(p.name.startswith(e) for e in args.explorers):
                        continue
                    t1 = time.monotonic()
                    r = check_explorer(driver, lab, root / p.name, out, args.run_timeout)
                    report[f"{p.name} (run in JupyterLab)"] = r
                    status = "FAIL" if r["problems"] else "ok"
                    print(f"{status:4s} {p.name} run in JupyterLab: explorer shows {r['sliders']} slider(s) "
                          f"({time.monotonic() - t1:.0f} s)")
                    for problem in r["problems"]:
                        print(f"     {problem}")
                    if r["problems"]:
                        failed.append(f"{p.name} (explorer)")
            except (SetupError, OSError, urllib.error.URLError, subprocess.CalledProcessError, KeyError) as err:
                print(f"setup failed ({mode}): {err}; logs in {out}")
                return 2
            finally:
                if driver is not None:
                    driver.close()
                if lab is not None:
                    lab.close()
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"screenshots and report: {out}")
    if failed:
        print(f"{len(failed)} notebook view(s) show an unfinished progress bar or widget: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
