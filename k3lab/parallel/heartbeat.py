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

Every rank must make its Heartbeats in the same order (keys are numbered per process, so that a second
run in the same process group never reads the first one's records). Times are wall clocks
(``time.time()``) of the writing and the reading host: on several nodes their skew (NTP: milliseconds)
must stay well below the thresholds (seconds).
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time

import torch.distributed as dist

from k3lab.parallel.dims import check_timeout
from k3lab.parallel.launch import write_error

INTERVAL_S = 1.0   # seconds between two pulses of a rank
_NUMBERS = itertools.count()  # this process's Heartbeats: the same sequence on every rank (SPMD)


def default_store() -> dist.Store:
    """The default process group's store (under torchrun the agent's TCPStore, under
    :func:`k3lab.parallel.spawn.run_ranks` a FileStore). torch has no public accessor for it;
    ``_get_default_store`` has been there since torch 1.x."""
    return dist.distributed_c10d._get_default_store()


def exit_on_stall(message: str) -> None:
    """The watchdog's default: print ``error: <message>``, write it to the error file that
    :func:`k3lab.parallel.launch.launch` reads, and end this process at once (``os._exit``: the main
    thread sits in a collective that would return only at the process group's timeout; torchrun then
    ends the other ranks)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    write_error(message)
    os._exit(1)


class Heartbeat:
    """This rank's heartbeat in ``store`` and a reader of every rank's (``world`` ranks). Making one starts
    the pulse thread; :meth:`close` (or leaving a ``with`` block) stops it and marks the rank done."""

    def __init__(self, store: dist.Store, rank: int, world: int, *, interval_s: float = INTERVAL_S,
                 stale_s: float | None = None):
        self.store = dist.PrefixStore(f"k3lab/heartbeat/{next(_NUMBERS)}", store)
        self.rank, self.world = rank, world
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

    def _problems(self, stale_s: float) -> list[tuple[str, str]]:
        """``(kind, text)`` for each other rank in trouble: kind "silent", "missing", "behind" or "failed"."""
        recs, now = self.records(), time.time()
        silent = {r for r, rec in recs.items() if r != self.rank and rec is not None and rec[3] == "run"
                  and now - rec[2] > stale_s}
        steps = [rec[0] for r, rec in recs.items() if rec is not None and r not in silent]
        top = max(steps, default=0)
        found = []
        for r, rec in recs.items():
            if r == self.rank:
                continue  # this rank is answering: it is running this
            if rec is None:
                if now - self.created > stale_s:
                    found.append(("missing", f"rank {r} sent no heartbeat in {now - self.created:.1f} s"))
                continue
            step, step_time, pulse_time, state = rec
            if state == "failed":
                found.append(("failed", f"rank {r} exited with an error at step {step}"))
            elif r in silent:
                others = (f"the others reached step {top}" if top > step else f"the others are at step {step} too")
                found.append(("silent", f"rank {r} stopped responding: last heartbeat at step {step}, "
                                        f"{now - pulse_time:.1f} s ago ({others})"))
            elif state == "run" and step < top and now - step_time > stale_s:
                found.append(("behind", f"rank {r} is stuck at step {step} for {now - step_time:.1f} s while the "
                                        f"others reached step {top} (it still answers heartbeats)"))
        return found

    def diagnose(self, stale_s: float | None = None) -> str | None:
        """The other ranks in trouble, one ``; ``-separated line (None: none seen): silent for longer than
        ``stale_s`` (default ``self.stale_s``), never heard from, a step behind for that long though
        alive, or closed by an exception. Call it where a collective failed, to name the culprit."""
        found = self._problems(self.stale_s if stale_s is None else stale_s)
        return "; ".join(text for _, text in found) or None

    def start_watchdog(self, timeout_s: float, on_stall=None, *, check_s: float = 1.0) -> threading.Thread:
        """Check every ``check_s`` whether another rank has been silent (or a step behind while alive, or
        never heard from) for ``timeout_s``; if so call ``on_stall(message)`` once (default
        :func:`exit_on_stall`: print, report to launch(), end the process), so the culprit is named
        within ``timeout_s`` + a few seconds even if the collective waiting for it would wait longer.
        Ranks closed by an exception are left to their own error. One reader of every rank's key per
        check: run it on one rank (rank 0)."""
        timeout_s = check_timeout(timeout_s)
        on_stall = on_stall or exit_on_stall

        def watch():
            while not self._stop.wait(check_s):
                try:
                    found = [text for kind, text in self._problems(timeout_s) if kind != "failed"]
                except Exception:  # the store is gone: the run is ending
                    return
                if found:
                    on_stall("; ".join(found))
                    return

        self._watchdog = threading.Thread(target=watch, daemon=True, name=f"k3lab-watchdog-{self.rank}")
        self._watchdog.start()
        return self._watchdog
