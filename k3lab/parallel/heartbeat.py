"""Heartbeats through the c10d store: the rank that stopped responding is named, within ``--timeout``.

When one rank stops (SIGSTOP, a stuck kernel or file read, a node swapping) the others wait in their
next collective until the process group's timeout, and the error that ends the run comes from a healthy
rank: ``rank 0: ... timed out in allreduce``, the one rank not to blame. The step a rank reached cannot
tell who stopped either: a rank that stops inside step s leaves the others blocked inside step s, all
with the same last step. So each rank also *pulses*: a daemon thread writes the wall time to the store
every ``interval_s``. A healthy rank blocked in a collective goes on pulsing (the wait releases the GIL);
a stopped process cannot. The record of each rank is one key, ``"<step> <step time> <pulse time>
<state>"`` (state ``run``, ``done`` after :meth:`Heartbeat.close`, ``failed`` when closed by an exception).

    hb = Heartbeat(default_store(), rank, world)       # starts this rank's pulse
    if rank == 0:
        hb.start_watchdog(timeout_s)                    # a rank silent for timeout_s: named, the run ends
    try:
        for step in ...:
            ...                                         # the step's collectives
            hb.beat(step)                               # one store.set
    except Exception as err:                            # e.g. a collective that timed out
        raise RuntimeError(hb.diagnose() or str(err)) from err
    finally:
        hb.close()                                      # a rank that finished is not "silent"

Ending the run (the watchdog's default, :func:`exit_on_stall`): rank 0 prints and reports the message, then,
under torchrun, ends the culprits that run on its own node itself (SIGKILL: a stopped process ignores the
SIGTERM torchrun would send it, and torchrun waits 30 s for it), after writing the message into each one's
torchelastic error file. torchrun then sees the culprit fail first, names it as the root cause (not rank 0),
and ends the healthy ranks at once: the run is over within the timeout plus :data:`END_GRACE_S`. Rank 0 waits
for that, and ends itself after :data:`END_GRACE_S` if nobody does (a culprit on another node: rank 0 ends
at once, as a rank of its own can only be named there).

A Heartbeat made with ``phase="start-up"`` (``python -m k3lab.parallel.run`` makes one on the rendezvous store
before the process group exists) names a rank that stopped, or never came, before training began.

Every rank must make its Heartbeats in the same order (keys are numbered per process, so that a second
run in the same process group never reads the first one's records). Times are wall clocks
(``time.time()``) of the writing and the reading host: on several nodes their skew (NTP: milliseconds)
must stay well below the thresholds (seconds).
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from k3lab.parallel.dims import check_timeout
from k3lab.parallel.launch import write_error

INTERVAL_S = 1.0   # seconds between two pulses of a rank
END_GRACE_S = 10.0  # after naming a stalled rank: how long rank 0 waits for torchrun to end the run
_NUMBERS = itertools.count()  # this process's Heartbeats: the same sequence on every rank (SPMD)
_ENDING = threading.Event()   # set once a watchdog has named a stalled rank and is ending the run
_END_LOCK = threading.Lock()


def default_store() -> dist.Store:
    """The default process group's store (under torchrun the agent's TCPStore, under
    :func:`k3lab.parallel.spawn.run_ranks` a FileStore). torch has no public accessor for it;
    ``_get_default_store`` has been there since torch 1.x."""
    return dist.distributed_c10d._get_default_store()


def _local_workers() -> dict[int, tuple[int, dict]]:
    """``rank -> (pid, environment)`` of the other workers the torchrun agent of this process started on this
    node (its children with this run's ``TORCHELASTIC_RUN_ID``), read from /proc; empty outside torchrun or
    without /proc."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or not os.path.isdir("/proc/self"):
        return {}
    agent, found = os.getppid(), {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            if int(stat[stat.rfind(")") + 2:].split()[1]) != agent:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if env.get("TORCHELASTIC_RUN_ID") == run_id and env.get("RANK", "").isdigit():
            found[int(env["RANK"])] = (int(name), env)
    return found


def _end_culprits(ranks, message: str) -> list[int]:
    """SIGKILL the workers of ``ranks`` that run on this node (torchrun's), after writing ``message`` into each
    one's torchelastic error file (torchrun's summary then shows it as that rank's error); the ranks ended."""
    if not ranks:
        return []
    workers, ended = _local_workers(), []
    me = os.environ.get("RANK", "?")
    for rank in sorted(set(ranks)):
        if rank not in workers:
            continue
        pid, env = workers[rank]
        error_file = env.get("TORCHELASTIC_ERROR_FILE")
        if error_file and error_file != os.devnull:
            try:
                with open(error_file, "w") as f:
                    json.dump({"message": f"{message} (ended by rank {me}'s watchdog)",
                               "timestamp": int(time.time())}, f)
            except OSError:
                pass
        try:
            os.kill(pid, signal.SIGKILL)
            ended.append(rank)
        except OSError:
            pass
    return ended


def ending() -> bool:
    """Whether a watchdog of this process has named a stalled rank and is ending the run: an error the main
    thread meets now is a consequence (a collective whose peer was ended), not news."""
    return _ENDING.is_set()


def wait_if_ending(timeout_s: float = END_GRACE_S + 5.0) -> None:
    """When :func:`ending`: wait for the end (torchrun's SIGTERM, or the watchdog's own exit after
    :data:`END_GRACE_S`) instead of printing a traceback of the consequence. Returns at once otherwise."""
    if _ENDING.is_set():
        time.sleep(timeout_s)


def exit_on_stall(message: str, ranks=()) -> None:
    """The watchdog's default: print ``error: <message>``, write it to the error file that
    :func:`k3lab.parallel.launch.launch` reads, end the stalled ``ranks`` that run on this node under torchrun
    (:func:`_end_culprits`: torchrun then blames them and ends this process) and end this process after
    :data:`END_GRACE_S` if nothing else does; with no such rank, end this process at once (``os._exit``: the
    main thread sits in a collective that would return only at the process group's timeout; torchrun then ends
    the other ranks). Acts once per process (a second watchdog that fires too only returns)."""
    with _END_LOCK:
        if _ENDING.is_set():
            return
        _ENDING.set()
    print(f"error: {message}", file=sys.stderr, flush=True)
    write_error(message)
    if not _end_culprits(ranks, message):
        os._exit(1)

    def end_later():
        time.sleep(END_GRACE_S)
        os._exit(1)

    threading.Thread(target=end_later, daemon=False, name="k3lab-stall-exit").start()  # not daemon: holds the exit


class Heartbeat:
    """This rank's heartbeat in ``store`` and a reader of every rank's (``world`` ranks). Making one starts
    the pulse thread; :meth:`close` (or leaving a ``with`` block) stops it and marks the rank done."""

    def __init__(self, store: dist.Store, rank: int, world: int, *, interval_s: float = INTERVAL_S,
                 stale_s: float | None = None, phase: str | None = None):
        self.store = dist.PrefixStore(f"k3lab/heartbeat/{next(_NUMBERS)}", store)
        self.rank, self.world = rank, world
        self.phase = phase  # e.g. "start-up": what a rank silent before its first beat was doing (the messages say)
        self.interval_s = float(interval_s)
        self.stale_s = float(stale_s) if stale_s is not None else max(5.0, 5 * self.interval_s)
        self.step, self.step_time = 0, time.time()
        self.created = self.step_time
        self._lock = threading.Lock()       # one record at a time: a pulse never writes an older step back
        self._stop = threading.Event()
        self._closed = False
        self._write("run")
        self._pulse = threading.Thread(target=self._pulse_loop, daemon=True, name=f"k3lab-heartbeat-{rank}")
        self._pulse.start()
        self._watchdog: threading.Thread | None = None

    # -- this rank ----------------------------------------------------------------------------------
    def _write(self, state: str) -> None:
        with self._lock:
            self.store.set(str(self.rank), f"{self.step} {self.step_time:.3f} {time.time():.3f} {state}")

    def _pulse_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write("run")
            except Exception:  # the store is gone: the run is ending
                return

    def beat(self, step: int) -> None:
        """This rank finished ``step`` (one ``store.set``)."""
        self.step, self.step_time = int(step), time.time()
        self._write("run")

    def close(self, failed: bool = False) -> None:
        """Stop the pulse and the watchdog; record this rank as done (or failed: its own error names it)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._pulse.join(timeout=5.0)
        try:
            self._write("failed" if failed else "done")
        except Exception:
            pass

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(failed=kind is not None)

    # -- every rank ---------------------------------------------------------------------------------
    def records(self) -> dict[int, tuple[int, float, float, str] | None]:
        """``rank -> (step, step time, pulse time, state)``, None for a rank that wrote nothing yet."""
        out = {}
        for r in range(self.world):
            key = str(r)
            if not self.store.check([key]):
                out[r] = None
                continue
            step, step_time, pulse_time, state = self.store.get(key).decode().split()
            out[r] = (int(step), float(step_time), float(pulse_time), state)
        return out

    def _problems(self, stale_s: float) -> list[tuple[str, str, int]]:
        """``(kind, text, rank)`` for each other rank in trouble: kind "silent", "missing", "behind" or "failed"."""
        recs, now = self.records(), time.time()
        during = f" during {self.phase}" if self.phase else ""
        silent = {r for r, rec in recs.items() if r != self.rank and rec is not None and rec[3] == "run"
                  and now - rec[2] > stale_s}
        steps = [rec[0] for r, rec in recs.items() if rec is not None and r not in silent]
        top = max(steps, default=0)
        found = []
        for r, rec in recs.items():
            if r == self.rank:
                continue  # this rank is answering: it is running this
            if rec is None:
                if now - self.created > stale_s:  # (during: no record at all is before any step)
                    found.append(("missing", f"rank {r} sent no heartbeat in {now - self.created:.1f} s{during} "
                                             "(it stopped, or never started)", r))
                continue
            step, step_time, pulse_time, state = rec
            if state == "failed":
                found.append(("failed", f"rank {r} exited with an error at step {step}", r))
            elif r in silent:
                if self.phase and step == 0:
                    found.append(("silent", f"rank {r} stopped responding{during}: last heartbeat "
                                            f"{now - pulse_time:.1f} s ago", r))
                    continue
                others = (f"the others reached step {top}" if top > step else f"the others are at step {step} too")
                found.append(("silent", f"rank {r} stopped responding: last heartbeat at step {step}, "
                                        f"{now - pulse_time:.1f} s ago ({others})", r))
            elif state == "run" and step < top and now - step_time > stale_s:
                found.append(("behind", f"rank {r} is stuck at step {step} for {now - step_time:.1f} s while the "
                                        f"others reached step {top} (it still answers heartbeats)", r))
        return found

    def diagnose(self, stale_s: float | None = None) -> str | None:
        """The other ranks in trouble, one ``; ``-separated line (None: none seen): silent for longer than
        ``stale_s`` (default ``self.stale_s``), never heard from, a step behind for that long though
        alive, or closed by an exception. Call it where a collective failed, to name the culprit."""
        found = self._problems(self.stale_s if stale_s is None else stale_s)
        return "; ".join(text for _, text, _ in found) or None

    def end_if_stalled(self, stale_s: float | None = None) -> bool:
        """Where a collective failed or timed out: when another rank has been silent (or a step behind, or
        never heard from) for ``stale_s`` (default ``self.stale_s``), :func:`exit_on_stall` with it (name it,
        end it where it runs on this node, and so the run) and return True; else False. Any rank may call it."""
        try:
            found = [(text, r) for kind, text, r in self._problems(self.stale_s if stale_s is None else stale_s)
                     if kind != "failed"]
        except Exception:  # the store is gone
            return False
        if not found:
            return False
        exit_on_stall("; ".join(text for text, _ in found), [r for _, r in found])
        return True

    def start_watchdog(self, timeout_s: float, on_stall=None, *, check_s: float = 1.0) -> threading.Thread:
        """Check every ``check_s`` whether another rank has been silent (or a step behind while alive, or
        never heard from) for ``timeout_s``; if so call ``on_stall(message)`` once (default
        :func:`exit_on_stall` with the culprits: print, report to launch(), end them and the run), so the
        culprit is named within ``timeout_s`` + a few seconds even if the collective waiting for it would
        wait longer. Ranks closed by an exception are left to their own error. One reader of every rank's
        key per check: run it on one rank (rank 0)."""
        timeout_s = check_timeout(timeout_s)

        def watch():
            while not self._stop.wait(check_s):
                try:
                    found = [(text, r) for kind, text, r in self._problems(timeout_s) if kind != "failed"]
                except Exception:  # the store is gone: the run is ending
                    return
                if found:
                    message = "; ".join(text for text, _ in found)
                    if on_stall is None:
                        exit_on_stall(message, [r for _, r in found])
                    else:
                        on_stall(message)
                    return

        self._watchdog = threading.Thread(target=watch, daemon=True, name=f"k3lab-watchdog-{self.rank}")
        self._watchdog.start()
        return self._watchdog
