"""Faults of a distributed run and how they are reported (CPU, gloo):

* launch() (k3lab.parallel.launch): a failing rank's own error in one line (not torchrun's
  ChildFailedError), a malformed ``--steps``, a timeout with a silent worker that ignores SIGTERM, and
  Ctrl-C (``_thread.interrupt_main`` under Python's own SIGINT handler, installed by the test whatever the
  process inherited): afterwards no process of the tree is left;
* process-group timeouts (k3lab.parallel.dims): validated, and every group, the device meshes' too, waits
  the run's timeout (not torch's 30-minute default);
* heartbeats (k3lab.parallel.heartbeat): a rank stopped with SIGSTOP is named, by diagnose() and by the
  watchdog within its timeout, also end to end through torchrun and launch().

Most runs use tests/fixtures/launch_worker.py (the worker contract without the model: no torch import
unless it needs a process group), two use the real command line (``-m k3lab.parallel.run``).
"""
import _thread
import contextlib
import math
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from k3lab.parallel.dims import ParallelDims, check_timeout, init_groups, init_process_group_from_env
from k3lab.parallel.launch import LaunchError, launch
from k3lab.parallel.spawn import TIMEOUT_S, run_ranks

WORKER = Path(__file__).parent / "fixtures" / "launch_worker.py"
REAL = ("--steps", "1", "--data", "random", "--batch-size", "4", "--seq-len", "32")


def _survivors(marker: str) -> list[str]:
    """Live (non-zombie) processes whose command line contains ``marker``: what a launch left behind."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if marker in cmdline and stat[stat.rfind(")") + 2] not in "ZX":
            found.append(f"{name}: {cmdline[:200]}")
    return found


def _assert_tree_gone(pid_dir: Path) -> None:
    pids = [int(p.read_text()) for p in pid_dir.glob("rank*.pid")]
    assert len(pids) == 2, f"the workers never started: {pids}"
    deadline = time.monotonic() + 5
    while _survivors(str(pid_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _survivors(str(pid_dir)), _survivors(str(pid_dir))


# ----------------------------------------------------------------------------------------------
# A. launch()
# ----------------------------------------------------------------------------------------------
def test_worker_errors_write_the_ranks_one_line(tmp_path, monkeypatch, capsys):
    """In process: argparse's exit (status 2, message only on stderr), an exception, a clean exit."""
    import argparse

    from k3lab.parallel.launch import worker_errors

    monkeypatch.setenv("K3LAB_ERROR_FILE", str(tmp_path / "error-rank{rank}.txt"))
    monkeypatch.setenv("RANK", "3")
    parser = argparse.ArgumentParser(prog="worker")
    parser.add_argument("--steps", type=int)

    @worker_errors()
    def main(argv):
        parser.parse_args(argv)

    with pytest.raises(SystemExit):
        main(["--steps", "x"])
    assert "error: argument --steps" in capsys.readouterr().err  # still printed as usual
    assert (tmp_path / "error-rank3.txt").read_text() == "rank 3: error: argument --steps: invalid int value: 'x'\n"
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError), worker_errors():
        raise ValueError("bad value\nsecond line")
    assert (tmp_path / "error-rank4.txt").read_text().startswith("rank 4: ValueError: bad value\nTraceback")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(SystemExit), worker_errors():
        raise SystemExit(0)
    assert not (tmp_path / "error-rank5.txt").exists()


def test_launch_returns_metrics_and_follows_progress(capsys):
    metrics = launch(2, "--mode", "ok", "--steps", "4", script=WORKER, timeout=120)
    assert metrics == {"world_size": 2, "losses": [1.0, 0.5, 1 / 3, 0.25]}
    assert "4/4" in capsys.readouterr().out  # the bar reached the last step


def test_launch_names_the_failing_rank_and_its_error(tmp_path):
    with pytest.raises(LaunchError) as err:
        launch(2, "--mode", "fail", "--fail-rank", "1", "--message", "boom: --bogus is bad\nsecond line",
               "--pid-dir", str(tmp_path), script=WORKER, timeout=120, progress=False)
    assert str(err.value) == "launch: rank 1 failed: ValueError: boom: --bogus is bad"
    assert err.value.rank == 1 and err.value.returncode != 0 and "boom" in err.value.output
    _assert_tree_gone(tmp_path)  # rank 0 was sleeping: torchrun (or launch) ended it


def test_launch_with_a_flag_missing_its_value():
    """``--steps`` last (launch appends ``--metrics FILE``): no IndexError in launch, the worker's argparse speaks."""
    with pytest.raises(LaunchError, match=r"^launch: ranks? [\d, ]+failed: error: argument --steps: expected one "
                                          r"argument$"):
        launch(2, "--steps", script=WORKER, timeout=120, progress=False)


@pytest.mark.parametrize("flags, reason", [
    (("--bogus", "1"), "error: unrecognized arguments: --bogus 1"),
    (("--ep", "3", *REAL), "error: --ep: must divide the dp_shard·cp = 2 ranks"),
])
def test_launch_real_cli_errors_name_the_flag(flags, reason):
    """The training command line (whether or not its main runs inside worker_errors: then the output's
    argparse line is the fallback): one line naming the flag, not torchrun's 31."""
    with pytest.raises(LaunchError) as err:
        launch(2, *flags, timeout=240, progress=False)
    message = str(err.value)
    assert message.startswith("launch: rank") and reason in message and "\n" not in message, message


def test_launch_timeout_kills_a_silent_tree_that_ignores_sigterm(tmp_path):
    """The workers print nothing (the timeout must not wait for a line) and ignore SIGTERM (SIGKILL
    after grace_s); each runs in its own session (torchrun's), so killing torchrun's group is not enough."""
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"^launch: torchrun ran past 6\.0 s") as err:
        launch(2, "--mode", "hang", "--pid-dir", str(tmp_path), script=WORKER, timeout=6.0, grace_s=1.0,
               progress=False)
    took = time.monotonic() - t0
    assert err.value.returncode is None
    assert took < 6.0 + 1.0 + 6, took
    _assert_tree_gone(tmp_path)


@contextlib.contextmanager
def python_sigint_handler():
    """SIGINT handled by Python's ``default_int_handler`` (KeyboardInterrupt in the main thread) inside, the
    previous disposition put back after. ``_thread.interrupt_main()`` runs the installed handler and does nothing
    at all where SIGINT is ignored or at its OS default: a pytest started in the background of a shell without job
    control (``pytest &``, ``nohup pytest &``, some CI runners) inherits SIG_IGN, its xdist workers too, and the
    simulated Ctrl-C would never reach launch(), which then runs into its timeout (issue 38)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


@pytest.fixture
def python_sigint():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Ctrl-C reaches the main thread only, and this test does not run there")
    with python_sigint_handler():
        yield


def _let_an_interrupt_in(seconds: float) -> None:
    """Run Python bytecode for ``seconds``: interrupt_main()'s KeyboardInterrupt is raised at the loop's jump."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


@pytest.mark.parametrize("inherited", [signal.SIG_IGN, signal.SIG_DFL, lambda signum, frame: None],
                         ids=["ignored", "os-default", "another-handler"])
def test_the_simulated_ctrl_c_holds_whatever_sigint_the_process_has(inherited, python_sigint):
    """What made the Ctrl-C test below depend on how pytest was started: with SIGINT ignored, at its OS default
    or handled by another function, interrupt_main() raises nothing; python_sigint_handler() gives the test
    Python's own handler whatever was there, and puts that back."""
    previous = signal.signal(signal.SIGINT, inherited)
    try:
        _thread.interrupt_main()
        _let_an_interrupt_in(0.2)  # nothing happens: this Ctrl-C never reaches the test
        with python_sigint_handler():
            with pytest.raises(KeyboardInterrupt):
                _thread.interrupt_main()
                _let_an_interrupt_in(5.0)
        assert signal.getsignal(signal.SIGINT) is inherited
    finally:
        signal.signal(signal.SIGINT, previous)


def test_launch_ctrl_c_kills_the_tree(tmp_path, python_sigint):
    def interrupt_once_started():
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()  # KeyboardInterrupt in the main thread, as Ctrl-C in a notebook

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        launch(2, "--mode", "hang", "--pid-dir", str(tmp_path), script=WORKER, timeout=120, grace_s=1.0,
               progress=False)
    _assert_tree_gone(tmp_path)


# ----------------------------------------------------------------------------------------------
# B. process-group timeouts
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -5, math.nan, math.inf, True, "30"])
def test_bad_timeout_is_refused(bad):
    with pytest.raises(ValueError, match=r"^--timeout=.*: must be a finite number of seconds > 0$"):
        check_timeout(bad)
    with pytest.raises(ValueError, match="--timeout="):
        init_process_group_from_env("cpu", bad)  # before anything starts
    with pytest.raises(ValueError, match="--timeout="):
        init_groups(ParallelDims(1), timeout_s=bad)
    assert check_timeout(2) == 2.0 and check_timeout(0.5) == 0.5


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _group_timeouts_worker(rank, world):
    """Every group of two plans, by name; the run's timeout is spawn's (the default group's)."""
    out = {"default": _timeout_s(dist.group.WORLD)}
    g = init_groups(ParallelDims(world, cp=2, ep=2), "cpu", TIMEOUT_S)  # ep == world: a 1-rank edp mesh axis
    out |= {"cp": _timeout_s(g.cp), "ep": _timeout_s(g.ep), "mesh/fsdp": _timeout_s(g.mesh.get_group("fsdp"))}
    out |= {f"expert_mesh/{axis}": _timeout_s(g.expert_mesh.get_group(axis)) for axis in ("edp", "ep")}
    out["expert_mesh ranks"] = g.expert_mesh.mesh.tolist()
    g = init_groups(ParallelDims(world, ep=1), "cpu", TIMEOUT_S)
    out["edp"] = _timeout_s(g.edp)
    return out


def test_every_group_waits_the_runs_timeout():
    """init_device_mesh would give the expert mesh's groups torch's default (1800 s for gloo)."""
    for got in run_ranks(_group_timeouts_worker, 2):
        assert got.pop("expert_mesh ranks") == [[0, 1]]
        assert got == {name: float(TIMEOUT_S) for name in got}, got


# ----------------------------------------------------------------------------------------------
# C. heartbeats
# ----------------------------------------------------------------------------------------------
def _stall_worker(rank, world, timeout_s):
    """Rank 1 beats steps 1..3 and stops itself (SIGSTOP); rank 0 reaches step 4. Rank 0's diagnose() is
    None while both pulse, then its watchdog names rank 1; rank 0 then wakes rank 1 (SIGCONT)."""
    from k3lab.parallel.heartbeat import Heartbeat, default_store

    store = default_store()
    hb = Heartbeat(store, rank, world, interval_s=0.2)
    for step in range(1, 4):
        hb.beat(step)
    dist.barrier()
    if rank == 1:
        store.set("test/pid1", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # until rank 0 sends SIGCONT
        hb.close()
        return None
    try:
        hb.beat(4)
        healthy = hb.diagnose()
        store.wait(["test/pid1"])
        time.sleep(0.1)  # rank 1 has stopped
        fired, t0 = [], time.monotonic()
        done = threading.Event()
        hb.start_watchdog(timeout_s, lambda message: (fired.append((message, time.monotonic() - t0)), done.set()),
                          check_s=0.2)
        done.wait(timeout_s + 10)
        diagnosis = hb.diagnose(stale_s=timeout_s)
    finally:
        if store.check(["test/pid1"]):
            os.kill(int(store.get("test/pid1")), signal.SIGCONT)
    hb.close()
    return healthy, fired, diagnosis


def test_heartbeat_names_the_stopped_rank_within_the_timeout():
    timeout_s = 2.0
    healthy, fired, diagnosis = run_ranks(_stall_worker, 2, timeout_s)[0]
    assert healthy is None
    assert len(fired) == 1, fired
    message, took = fired[0]
    pattern = r"^rank 1 stopped responding: last heartbeat at step 3, [\d.]+ s ago \(the others reached step 4\)$"
    assert re.match(pattern, message), message
    assert took < timeout_s + 2, took
    assert diagnosis is not None and diagnosis.startswith("rank 1 stopped responding"), diagnosis


def test_launch_reports_the_stopped_rank_end_to_end(tmp_path):
    """torchrun, gloo all-reduces, rank 1 SIGSTOPs itself at step 3: rank 0's watchdog (3 s) names it and
    ends the run (the all-reduce alone would wait 120 s and blame rank 0); launch() stops the tree, the
    stopped rank included, and raises with the watchdog's line."""
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch(2, "--mode", "stall", "--fail-rank", "1", "--stall-step", "3", "--steps", "5", "--timeout", "3",
               "--pid-dir", str(tmp_path), script=WORKER, timeout=100, grace_s=1.0, progress=False)
    assert str(err.value).startswith("launch: rank 0 failed: rank 1 stopped responding: last heartbeat at step 2"), \
        str(err.value)
    assert time.monotonic() - t0 < 60
    _assert_tree_gone(tmp_path)


def test_a_collective_mismatch_is_named_as_such():
    """What gloo printed when MoonEP's ranks disagreed on the replica all-to-all (issue 37): the launch error names a
    collective mismatch instead of only the first rank's 'Connection reset by peer'; other failures are left as they are."""
    from k3lab.parallel.launch import name_collective_mismatch

    lines = ["[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
             "[127.0.0.1]:3425: Connection reset by peer\n",
             "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n",
             "  what():  [enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length <= "
             "op.nbytes. Received data size doesn't match expected size\n"]
    got = name_collective_mismatch("rank 3 failed: Connection reset by peer", lines)
    assert got.startswith("rank 3 failed: Connection reset by peer — a collective mismatch")
    assert "Received data size doesn't match expected size" in got
    assert name_collective_mismatch("rank 1 failed: error: --steps: bad", ["error: --steps: bad\n"]) == \
        "rank 1 failed: error: --steps: bad"
