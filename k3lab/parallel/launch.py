"""The notebook launcher: ``launch(nproc, *flags)`` runs torchrun, follows rank 0's steps with a bar and
returns rank 0's metrics; a failure raises one line that names the rank and its own error.

    metrics = launch(2, "--preset", "tiny", "--steps", "3", "--ep", "2")   # run.py's --metrics JSON, a dict
    launch(2, "--bogus", "1")   # LaunchError: launch: ranks 0, 1 failed: error: unrecognized arguments: --bogus 1

What torchrun reports about a failed worker is its own ``ChildFailedError`` traceback (~30 lines) with an
exit status and no reason; the reason is somewhere above, in the interleaved output of every rank. So:

* each worker gets ``K3LAB_ERROR_FILE`` (``<tmp>/error-rank{rank}.txt``); an entry point whose main runs
  inside :func:`worker_errors` writes there ``rank R: <its one-line error>`` when it fails (an exception,
  or a non-zero exit such as argparse's ``error: ...`` + status 2). :func:`launch` raises
  :class:`LaunchError` with the earliest such line (the root cause: ranks that fail later mostly fail
  *because* of it), naming every rank that failed with the same message. Without a file (an entry point
  not wrapped, a rank killed by a signal) it falls back to the output: the first argparse ``error:``
  line, else the first exception line, and torchrun's "Root Cause" rank and exit code. torch's own
  ``@record`` (``TORCHELASTIC_ERROR_FILE``) is not used: it records exceptions but not ``SystemExit``,
  and its file sits in torchrun's temporary log folder.
* the whole process tree is stopped on a timeout, on an exception or Ctrl-C in the caller, and when a
  rank has reported an error but torchrun has not ended the others within ``grace_s`` (torchrun waits
  30 s for a worker that ignores SIGTERM, forever-ish for a stopped one). torchrun starts every worker
  in a session of its own, so killing torchrun's process group would leave them running (and holding
  their GPUs): launch records torchrun's descendants while it waits and ends them, SIGTERM (and SIGCONT,
  so a stopped process acts on it), then SIGKILL after ``grace_s``.
* the timeout holds even when nothing is printed: a thread reads the output, the wait polls a queue.

The worker contract (``module`` run with ``-m``, or a ``script`` path): it takes ``--metrics FILE``
(rank 0 writes the JSON there) and ``--progress-lines`` (rank 0 prints ``K3LAB_PROGRESS step/steps loss``
lines for the bar). This module imports no torch, so a worker's :func:`worker_errors` costs nothing.
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

PROGRESS_PREFIX = "K3LAB_PROGRESS "  # rank 0 prints "K3LAB_PROGRESS step/steps loss" for launch()'s bar
PROGRESS_FLAG = "--progress-lines"    # asks the worker for those lines
ERROR_FILE_ENV = "K3LAB_ERROR_FILE"   # where a worker writes its one-line error; "{rank}" is its RANK
DEFAULT_MODULE = "k3lab.parallel.run"
GRACE_S = 5.0                         # SIGTERM -> SIGKILL; and a reported error -> stopping the tree
OUTPUT_LINES = 5000                   # output lines kept for LaunchError.output and the fallbacks

__all__ = ["launch", "LaunchError", "worker_errors", "write_error", "error_file_path",
           "PROGRESS_PREFIX", "PROGRESS_FLAG", "ERROR_FILE_ENV"]


class LaunchError(RuntimeError):
    """A failed or timed-out :func:`launch`: the message is one line; ``output`` holds what torchrun and
    the workers printed (its last lines), ``rank`` the failing rank when known, ``returncode`` torchrun's
    exit status (None after a timeout)."""

    def __init__(self, message: str, output: str = "", rank: int | None = None, returncode: int | None = None):
        super().__init__(message)
        self.output, self.rank, self.returncode = output, rank, returncode


# ----------------------------------------------------------------------------------------------
# the worker side: report this rank's error to launch()
# ----------------------------------------------------------------------------------------------
def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def error_file_path(rank: int | None = None) -> str | None:
    """This rank's error file (``K3LAB_ERROR_FILE`` with ``{rank}`` filled in), None outside launch()."""
    template = os.environ.get(ERROR_FILE_ENV)
    if not template:
        return None
    return template.replace("{rank}", str(_rank() if rank is None else rank))


def _one_line(text: str, limit: int = 1000) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def write_error(message: str, details: str = "") -> None:
    """Record ``rank R: <first line of message>`` (then ``details``, e.g. a traceback) for :func:`launch`.
    The first error of a rank wins (a later one is usually a consequence); outside launch() and on any
    I/O problem it does nothing, since it runs while an error is already on its way."""
    path = error_file_path()
    if path is None:
        return
    try:
        with open(path, "x") as f:
            f.write(f"rank {_rank()}: {_one_line(message) or 'failed'}\n{details}")
    except OSError:
        pass


class _StderrTail:
    """``sys.stderr`` that keeps its last lines: argparse prints its ``error: ...`` there and then exits
    with status 2 only, so the message is nowhere else."""

    def __init__(self, stream, keep: int = 50):
        self.stream, self.lines, self.partial = stream, collections.deque(maxlen=keep), ""

    def write(self, text):
        written = self.stream.write(text)
        try:
            *done, self.partial = (self.partial + text).split("\n")
            self.lines.extend(done)
            self.partial = self.partial[-4000:]
        except TypeError:  # bytes or another oddity: forwarded, not kept
            pass
        return written

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _exit_message(code, stderr_lines: list[str]) -> str:
    if isinstance(code, str):
        return code
    for line in reversed(stderr_lines):
        m = re.search(r"\berror: (.*\S)", line)
        if m:
            return f"error: {m.group(1)}"
    return f"exit status {code}"


@contextlib.contextmanager
def worker_errors():
    """Run a worker's main inside it (``with worker_errors(): main()``, or ``@worker_errors()`` on main):
    an exception, or an exit with a non-zero status (argparse's ``error: ...``, ``SystemExit(1)`` after an
    ``error:`` line), is written to this rank's error file (:func:`write_error`) and re-raised unchanged,
    so the worker prints and exits as it would without it. Outside launch() it only passes errors on."""
    tail = _StderrTail(sys.stderr)
    sys.stderr = tail
    try:
        yield
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            write_error(_exit_message(exit_.code, [*tail.lines, tail.partial]))
        raise
    except BaseException as err:
        text = _one_line(str(err))
        write_error(f"{type(err).__name__}: {text}" if text else type(err).__name__, traceback.format_exc())
        raise
    finally:
        if sys.stderr is tail:
            sys.stderr = tail.stream


# ----------------------------------------------------------------------------------------------
# the launcher side: the process tree
# ----------------------------------------------------------------------------------------------
def _process_table() -> dict[int, tuple[int, str, bool]]:
    """``pid -> (parent pid, start time, alive)`` of the processes this user can see (alive: not a zombie):
    /proc on Linux, psutil elsewhere if installed, else nothing (then only torchrun's group is signalled)."""
    table = {}
    if os.path.isdir("/proc/self"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid ... starttime (#20)
            table[int(name)] = (int(fields[1]), fields[19], fields[0] not in ("Z", "X"))
        return table
    try:
        import psutil
    except ImportError:
        return table
    for p in psutil.process_iter(["ppid", "create_time", "status"]):
        table[p.pid] = (p.info["ppid"], str(p.info["create_time"]), p.info["status"] != psutil.STATUS_ZOMBIE)
    return table


def _kill(pid: int, sig: int, group: bool = False) -> None:
    with contextlib.suppress(OSError):
        (os.killpg if group else os.kill)(pid, sig)


class _Torchrun:
    """torchrun started in a session of its own, its output read by a thread, its descendants recorded."""

    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     errors="replace", start_new_session=True)
        self.lines: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
        self.queue: queue.Queue = queue.Queue()
        self.tree: dict[int, str] = {}  # pid -> start time of every descendant seen (workers: own sessions)
        self.reader = threading.Thread(target=self._read, daemon=True, name="k3lab-launch-reader")
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.queue.put(line)
        self.queue.put(None)

    def track(self) -> None:
        """Record the descendants of torchrun now (orphans lose the link once torchrun is gone)."""
        if self.proc.poll() is not None:
            return
        table = _process_table()
        children = collections.defaultdict(list)
        for pid, (ppid, _, _) in table.items():
            children[ppid].append(pid)
        todo = list(children[self.proc.pid])
        while todo:
            pid = todo.pop()
            self.tree.setdefault(pid, table[pid][1])
            todo.extend(children[pid])

    def alive(self) -> list[int]:
        table = _process_table()
        return [pid for pid, start in self.tree.items() if pid in table and table[pid][1] == start and table[pid][2]]

    def stop(self, grace_s: float) -> None:
        """End torchrun and every descendant recorded: SIGTERM (+SIGCONT), SIGKILL after ``grace_s``;
        nothing to do after a clean exit but the check for orphans."""
        self.track()
        running = self.proc.poll() is None
        left = self.alive()
        if running or left:
            if running:
                _kill(self.proc.pid, signal.SIGTERM, group=True)
                _kill(self.proc.pid, signal.SIGCONT, group=True)
            for pid in left:
                _kill(pid, signal.SIGTERM)
                _kill(pid, signal.SIGCONT)
            end = time.monotonic() + grace_s
            while time.monotonic() < end and (self.proc.poll() is None or self.alive()):
                self.track()
                time.sleep(0.05)
            self.track()
            if self.proc.poll() is None:
                _kill(self.proc.pid, signal.SIGKILL, group=True)
            for pid in self.alive():
                _kill(pid, signal.SIGKILL)
        self.proc.wait()
        end = time.monotonic() + 5.0  # SIGKILL is asynchronous: wait until the processes are gone
        while self.alive() and time.monotonic() < end:
            time.sleep(0.05)
        self.reader.join(timeout=2.0)  # the pipe closes once the last writer is gone
        self.drain()

    def drain(self) -> list[str]:
        got = []
        with contextlib.suppress(queue.Empty):
            while True:
                line = self.queue.get_nowait()
                if line is not None:
                    got.append(line)
                    self.lines.append(line)
        return got


# ----------------------------------------------------------------------------------------------
# messages
# ----------------------------------------------------------------------------------------------
def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _reported(folder: Path) -> tuple[str, int] | None:
    """The earliest error file's message, and every rank that reported the same: ``(text, first rank)``."""
    found = []
    for path in folder.glob("error-rank*.txt"):
        with contextlib.suppress(OSError, ValueError):
            first = path.read_text(errors="replace").split("\n", 1)[0]
            m = re.match(r"rank (\d+): (.*)", first)
            if m:
                found.append((path.stat().st_mtime_ns, int(m.group(1)), m.group(2)))
    if not found:
        return None
    found.sort()
    message = found[0][2]
    ranks = sorted({rank for _, rank, text in found if text == message})
    return f"{_ranks_text(ranks)} failed: {message}", ranks[0]


def _from_output(lines: list[str]) -> tuple[str, int | None]:
    """What failed, read from the output alone (no error file): ``(text, rank or None)``."""
    text = "".join(lines)
    root = re.search(r"Root Cause[\s\S]*?rank\s*:\s*(\d+)[\s\S]*?exitcode\s*:\s*(-?\d+)"
                     r"(?:[\s\S]*?traceback\s*:\s*(Signal \d+ \(\w+\)))?", text)
    rank = int(root.group(1)) if root else None
    reason = None
    for line in lines:
        m = re.search(r"(?:^|: )error: (.*\S)", line)
        if m:
            reason = f"error: {m.group(1)}"
            break
    if reason is None:
        for line in lines:
            m = re.match(r"((?:\w+\.)*\w*(?:Error|Exception|Interrupt)): (.*\S)", line.strip())
            if m and not m.group(1).endswith(("ChildFailedError", "SignalException")):  # torchrun's own
                reason = f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"
                break
    if reason is None and root:
        reason = f"exit code {root.group(2)}" + (f" ({root.group(3)})" if root.group(3) else "")
    who = _ranks_text([rank]) if rank is not None else "a rank"
    return f"{who} failed: {reason or 'no error message found (see LaunchError.output)'}", rank


# What gloo and NCCL print when the ranks of a group entered different collectives, or the same one with other sizes
# (a collective decision one rank made differently from the others): the rank that failed first is often not the
# one that diverged, and its own error ("Connection reset by peer") names neither.
COLLECTIVE_MISMATCH = (
    "Received data size doesn't match expected size",        # gloo: a peer sent more or fewer bytes than expected
    "Mismatch between collective operation",                 # NCCL / torch's collective fingerprint check
    "Detected mismatch between collectives",                 # TORCH_DISTRIBUTED_DEBUG=DETAIL
)


def name_collective_mismatch(message: str, lines: list[str]) -> str:
    """``message``, followed by a named collective mismatch when any rank's output shows one (COLLECTIVE_MISMATCH)."""
    for line in lines:
        for sign in COLLECTIVE_MISMATCH:
            if sign in line:
                return (f"{message} — a collective mismatch: the ranks of a group entered different collectives or "
                        f"the same one with different sizes (a rank's output: {sign!r})")
    return message


def _steps_in(args: list[str]) -> int | None:
    """``--steps N`` (or ``--steps=N``) among the flags, for the bar's length; None when absent or not an
    int (the progress lines carry the total anyway, and the worker's argparse reports a bad flag)."""
    value = None
    for i, arg in enumerate(args):
        if arg == "--steps" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--steps="):
            value = arg.split("=", 1)[1]
    try:
        return int(value) if value is not None and int(value) > 0 else None
    except ValueError:
        return None


def launch(nproc: int, *args, timeout: float = 600.0, progress: bool = True, env: dict | None = None,
           module: str = DEFAULT_MODULE, script: str | os.PathLike | None = None,
           grace_s: float = GRACE_S) -> dict:
    """Run ``torchrun --standalone --nproc_per_node nproc -m module *args --metrics FILE --progress-lines``
    (``script`` instead of ``-m module`` when given) and return rank 0's metrics JSON as a dict. A tqdm bar
    follows rank 0's steps. Raises :class:`LaunchError` (a RuntimeError) naming the failing rank and its own
    error when the run fails, ``launch: torchrun ran past {timeout} s ...`` when it takes longer than
    ``timeout`` seconds; in both cases, and on Ctrl-C, every process it started has ended when it returns.
    ``env`` adds to (or overrides) the environment; ``OMP_NUM_THREADS`` is 1 unless set."""
    from tqdm import tqdm  # the text bar: its final state is what a saved notebook shows (a widget's is not)

    if type(nproc) is not int or nproc < 1:
        raise ValueError(f"launch: nproc={nproc!r} must be an int >= 1")
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout)
            and timeout > 0):
        raise ValueError(f"launch: timeout={timeout!r} must be a finite number of seconds > 0")
    args = [str(a) for a in args]
    target = [str(script)] if script is not None else ["-m", module]
    with tempfile.TemporaryDirectory(prefix="k3lab-run-") as tmp:
        folder = Path(tmp)
        metrics = folder / "metrics.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *target, *args, "--metrics", str(metrics), PROGRESS_FLAG]
        full_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
        full_env[ERROR_FILE_ENV] = str(folder / "error-rank{rank}.txt")
        full_env.update({k: str(v) for k, v in (env or {}).items()})
        run = _Torchrun(cmd, full_env)
        bar = None
        try:
            bar = tqdm(total=_steps_in(args), desc=f"torchrun ×{nproc}", disable=not progress, file=sys.stdout)
            rc, why = _follow(run, bar, folder, timeout, grace_s)
            if why == "exited" and rc == 0 and metrics.exists():  # the bar's final state from the metrics themselves
                done = json.loads(metrics.read_text())  # (a last progress line can still be in flight at exit)
                if done.get("losses"):
                    bar.n = done.get("step", len(done["losses"]))
                    bar.set_postfix(loss=f"{done['losses'][-1]:.6g}", refresh=False)
                    bar.refresh()
        finally:
            if bar is not None:
                bar.close()
            try:
                run.stop(grace_s)
            except KeyboardInterrupt:  # a second Ctrl-C while stopping: no more grace
                run.stop(0.0)
                raise
        output = "".join(run.lines)
        if why == "timeout":
            reported = _reported(folder)
            also = f"; {reported[0]}" if reported else ""
            tail = "".join(list(run.lines)[-10:])
            raise LaunchError(f"launch: torchrun ran past {timeout} s; stopped it and its workers{also}; "
                              f"last output:\n{tail}", output, reported[1] if reported else None, None)
        if why == "reported" or rc != 0:
            message, rank = _reported(folder) or _from_output(list(run.lines))
            raise LaunchError(f"launch: {name_collective_mismatch(message, list(run.lines))}", output, rank, rc)
        if not metrics.exists():
            raise LaunchError("launch: torchrun exited with status 0 but rank 0 wrote no metrics (the worker "
                              "must write --metrics FILE)", output, 0, rc)
        return json.loads(metrics.read_text())


def _follow(run: _Torchrun, bar, folder: Path, timeout: float, grace_s: float) -> tuple[int | None, str]:
    """Read the output until torchrun ends: ``(exit status, "exited")``, ``(None, "timeout")``, or
    ``(None, "reported")`` when a rank wrote an error file and torchrun had not ended ``grace_s`` later."""
    start = time.monotonic()
    next_scan, eof, exited_at, reported_at = 0.0, False, None, None
    while True:
        now = time.monotonic()
        if now - start > timeout:
            return None, "timeout"
        if now >= next_scan:
            run.track()
            if reported_at is None and any(folder.glob("error-rank*.txt")):
                reported_at = now
            next_scan = now + 0.25
        with contextlib.suppress(queue.Empty):
            line = run.queue.get(timeout=0.1)
            if line is None:
                eof = True
            else:
                run.lines.append(line)
                m = re.match(rf"{PROGRESS_PREFIX}(\d+)/(\d+) (\S+)", line)
                if m:
                    bar.total = int(m.group(2))
                    bar.n = int(m.group(1))
                    bar.set_postfix(loss=m.group(3), refresh=False)
                    bar.refresh()
                continue  # read on while lines come
        rc = run.proc.poll()
        if rc is not None:
            exited_at = now if exited_at is None else exited_at
            if eof or now - exited_at > 2.0:  # orphans may hold the pipe open: stop() ends them
                return rc, "exited"
        elif reported_at is not None and now - reported_at > grace_s:
            return None, "reported"
