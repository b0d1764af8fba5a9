"""Single-process checkpoints: safetensors + JSON only, written atomically, never unpickled.

A run folder holds numbered checkpoint folders and a ``latest`` pointer:

    out_dir/ckpt-00000100/     one checkpoint (written to ``out_dir/.tmp-ckpt-*`` and renamed into place)
    out_dir/latest             a text file holding one folder name, e.g. ``ckpt-00000100``; swapped
                               atomically (temporary file + ``os.replace``) after the rename

A checkpoint folder:

    model.safetensors      weights (``safetensors.torch.save_model``: tied weights handled)
    optimizer.safetensors  every tensor of the optimizer state, keyed "<param index>.<name>" (with
                           ``param_dtype="bfloat16"`` also each fp32 master weight, "<param index>.master":
                           :class:`k3lab.precision.MasterWeightOptimizer`)
    rng.safetensors        torch CPU (and CUDA) generator states
    state.json             step, tokens, elapsed, the optimizer's param groups and non-tensor state
                           (and the names of its tensors), python/numpy RNG states, TrainConfig,
                           model config, metric history (``format`` = :data:`CHECKPOINT_FORMAT`)

Loading reads only JSON and safetensors, so a checkpoint cannot run code; any other file in the
folder (a ``.pt``, a pickle) is ignored. ``latest`` may name only a folder directly inside the run
folder (:func:`read_latest`): a pointer to an absolute path, to ``../x`` or through a symlink that
leaves the run folder is refused, so a run folder cannot redirect a load elsewhere.
:mod:`k3lab.parallel.checkpoint` (DCP, sharded) uses the same run-folder layout and pointer rule.

A load is loud on bad input, before it changes the model: every file it (or ``fit``, for
rng.safetensors) reads must resolve, symlinks followed, inside the checkpoint folder
(:func:`file_inside`); state.json must be a JSON object of this format whose resume fields are sane
(:func:`read_state`: a negative ``step`` would otherwise surface as a ZeroDivisionError far away);
optimizer.safetensors must hold exactly the tensors state.json lists; and the saved model config must
equal the model's (:func:`check_model_config`: equal shapes would otherwise load another model's
weights silently). Each is a ValueError naming the file and the field.

Checksums: every checkpoint folder (this format's and :mod:`k3lab.parallel.checkpoint`'s) holds
``checksums.json`` (:data:`CHECKSUMS`), written after every other file of the save is complete and
before the folder is renamed into place: each file's size and sha256. A load verifies it first
(:func:`verify_checksums`) and refuses a missing, truncated or changed file with
:class:`CheckpointCorrupt` (a ValueError) naming the file, in one line; a folder without the manifest
(written before it existed) is loaded unverified. (In this format state.json's format and fields and
the safetensors headers are checked first, as they were before the checksums existed: a file that is not
safetensors at all is refused by the safetensors reader, now naming the file.)

Run-folder lock: :class:`RunDirLock` takes an exclusive ``flock`` on ``run_dir/.lock`` and writes its
holder (host, pid, start time, command) into it. A second run given the same folder is refused with
:class:`RunDirBusy` naming the holder; the kernel drops the lock when its holder dies, so a run that
crashed leaves only the holder's record, which the next run takes over (and says so).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

CHECKPOINT_FORMAT = "k3lab-checkpoint-v1"
LATEST = "latest"  # the pointer file's name inside a run folder
CHECKPOINT_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")
CHECKSUMS = "checksums.json"  # every other file's size and sha256, written last by the save
CHECKSUMS_FORMAT = "k3lab-checksums-v1"
LOCK = ".lock"  # the run folder's lock file (RunDirLock)
# ModelConfig fields a checkpoint loads under with another value: they change neither the math nor
# the tensor layout of the loaded model (check_model_config skips them)
MODEL_CONFIG_FIELDS_IGNORED = (
    "backend",  # which kernels run an op (torch / triton / fla): the same function, up to rounding
    "initializer_range",  # only draws the initial weights, which the load overwrites
)

__all__ = ["CHECKPOINT_FORMAT", "CHECKPOINT_FILES", "CHECKSUMS", "LOCK", "MODEL_CONFIG_FIELDS_IGNORED",
           "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "read_latest", "write_latest", "file_inside", "read_state",
           "check_state_fields", "check_model_config", "CheckpointCorrupt", "file_checksums", "write_checksums",
           "checksum_problems", "verify_checksums", "RunDirLock", "RunDirBusy"]


# ----------------------------------------------------------------------------------------------
# checksums (shared with k3lab.parallel.checkpoint)
# ----------------------------------------------------------------------------------------------
class CheckpointCorrupt(ValueError):
    """A checkpoint file is missing, truncated or changed since its save (its checksums.json says so)."""


def _sha256(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checksum_files(folder: str | os.PathLike) -> list[str]:
    """The files a checksum manifest covers: every regular file directly in ``folder`` but the manifest, sorted."""
    return sorted(p.name for p in Path(folder).iterdir() if p.is_file() and p.name != CHECKSUMS)


def file_checksums(folder: str | os.PathLike, names) -> dict:
    """``{name: {"size": bytes, "sha256": hex}}`` of the files ``names`` in ``folder``."""
    folder = Path(folder)
    return {name: {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)} for name in names}


def write_checksums(folder: str | os.PathLike, entries: dict) -> None:
    """Write ``folder/checksums.json`` (``entries`` from :func:`file_checksums`), flushed and fsynced."""
    data = {"format": CHECKSUMS_FORMAT, "algorithm": "sha256", "files": dict(sorted(entries.items()))}
    with open(Path(folder) / CHECKSUMS, "w") as f:
        json.dump(data, f, indent=0)
        f.flush()
        os.fsync(f.fileno())


def _read_checksums(folder: Path) -> dict | None:
    """The manifest's ``files`` entry (None: no manifest); CheckpointCorrupt when it is unreadable."""
    file = folder / CHECKSUMS
    if not file.exists():
        return None
    try:
        data = json.loads(file.read_text())
        files = data["files"]
        if data.get("format") != CHECKSUMS_FORMAT or not isinstance(files, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
                for e in files.values()):
            raise ValueError("unexpected layout")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointCorrupt(f"{file}: not a readable checksum manifest ({type(err).__name__}: {err}); "
                                "the checkpoint cannot be verified; refused") from None
    return files


def checksum_problems(folder: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> list[str] | None:
    """What is wrong with the files of ``folder`` that its checksums.json lists (None: no manifest; [] all good),
    one line each: missing, another size (truncated), another sha256 (changed). ``share = (i, n)`` checks only
    every n-th listed file from the i-th (the ranks of a load split the reading); sizes are checked for all."""
    folder = Path(folder)
    files = _read_checksums(folder)
    if files is None:
        return None
    problems, names = [], sorted(files)
    mine = set(names[share[0]::share[1]])
    for name in names:
        file = file_inside(folder, name, source=folder / CHECKSUMS)
        want = files[name]
        if not file.is_file():
            problems.append(f"{file}: missing ({CHECKSUMS} lists it, {want['size']} bytes): the checkpoint is "
                            "incomplete; refused")
        elif file.stat().st_size != want["size"]:
            problems.append(f"{file}: {file.stat().st_size} bytes, the save wrote {want['size']} ({CHECKSUMS}): "
                            "truncated or overwritten; refused")
        elif name in mine and _sha256(file) != want["sha256"]:
            problems.append(f"{file}: sha256 differs from the one the save wrote ({CHECKSUMS}): the file is "
                            "corrupt; refused")
    return problems


def verify_checksums(folder: str | os.PathLike) -> bool:
    """Check every file ``folder/checksums.json`` lists; raise :class:`CheckpointCorrupt` naming the first bad
    one (and how many more). Returns False when the folder has no manifest (nothing verified), else True."""
    problems = checksum_problems(folder)
    if problems:
        raise CheckpointCorrupt(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return problems is not None


# ----------------------------------------------------------------------------------------------
# the run folder's lock
# ----------------------------------------------------------------------------------------------
class RunDirBusy(ValueError):
    """Another live run holds the run folder's lock."""


def _describe_holder(text: str) -> str:
    try:
        who = json.loads(text)
        return (f"pid {who['pid']} on host {who['host']}, started {who['started']}"
                + (f" ({who['command']})" if who.get("command") else ""))
    except (ValueError, KeyError, TypeError):
        return "a run that has not written its details yet" if not text.strip() else f"{text.strip()[:200]!r}"


class RunDirLock:
    """An exclusive lock on a run folder (``run_dir/.lock``, ``fcntl.flock``), held until :meth:`release` or the
    process ends (the kernel drops it then, even after SIGKILL). The file holds the holder's host, pid, start
    time and command; it is emptied on release, so a record found by the next holder is a run that ended
    without releasing (a crash): :meth:`acquire` returns a note saying so. Locks are advisory: every k3lab run
    that writes into a run folder takes it (``python -m k3lab.parallel.run --out-dir``, rank 0)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.file = self.run_dir / LOCK
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock or raise :class:`RunDirBusy` naming the holder (NotADirectoryError when ``run_dir`` is
        a file). Returns None, or a one-line note when the lock is taken over from a run that ended without
        releasing it."""
        import fcntl

        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise NotADirectoryError(f"{self.run_dir} exists and is not a folder")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 65536, 0).decode(errors="replace")
            os.close(fd)
            raise RunDirBusy(f"{self.run_dir} is in use by another run: {_describe_holder(holder)}; wait for it to "
                             f"end or give another folder (the lock: {self.file})") from None
        except BaseException:
            os.close(fd)
            raise
        previous = os.pread(fd, 65536, 0).decode(errors="replace")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
              "command": " ".join(getattr(sys, "orig_argv", sys.argv))[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        if previous.strip():
            return (f"{self.run_dir}: took over the lock of {_describe_holder(previous)}, which ended without "
                    "releasing it (a crash?)")
        return None

    def release(self) -> None:
        """Empty the record and drop the lock (idempotent)."""
        import fcntl

        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ----------------------------------------------------------------------------------------------
# the run folder's `latest` pointer (shared with k3lab.parallel.checkpoint)
# ----------------------------------------------------------------------------------------------
def read_latest(run_dir: str | os.PathLike) -> Path:
    """The checkpoint folder that ``run_dir/latest`` names, after checking that it is safe.

    The pointer holds a plain folder name (``ckpt-00000100``): no path separator, not ``.``/``..``,
    not absolute, and the resolved folder's parent must be the resolved run folder (a symlink that
    leads out of it is refused). Anything else raises ValueError naming the file and the value.
    Whether the folder holds a checkpoint is the caller's check.
    """
    run_dir = Path(run_dir)
    pointer = run_dir / LATEST
    name = pointer.read_text().strip()
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if (not name or name in (".", "..") or any(s in name for s in seps) or "\0" in name
            or Path(name).is_absolute() or Path(name).name != name):
        raise ValueError(f"{pointer}: value {name!r} is not a plain checkpoint folder name "
                         "(it must name a folder directly inside the run folder, e.g. 'ckpt-00000100')")
    target = run_dir / name
    if target.resolve().parent != run_dir.resolve():
        raise ValueError(f"{pointer}: value {name!r} resolves to {target.resolve()}, outside the run folder "
                         f"{run_dir.resolve()} (a symlink?); refused")
    return target


def write_latest(run_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> None:
    """Point ``run_dir/latest`` at ``checkpoint`` (a folder directly inside ``run_dir``) atomically:
    a temporary file in the same folder, flushed and fsynced, then ``os.replace``."""
    run_dir, checkpoint = Path(run_dir), Path(checkpoint)
    if checkpoint.resolve().parent != run_dir.resolve():
        raise ValueError(f"write_latest: {checkpoint} is not directly inside the run folder {run_dir}")
    tmp = run_dir / f".{LATEST}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(checkpoint.name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, run_dir / LATEST)


def _resolve(path: str | os.PathLike, marker: str) -> Path:
    """``path`` itself when it holds ``marker``; else, when it has a ``latest`` file, the folder that
    names (checked by :func:`read_latest`); FileNotFoundError when neither holds ``marker``."""
    path = Path(path)
    if (path / LATEST).is_file():
        path = read_latest(path)
    if not (path / marker).is_file():
        raise FileNotFoundError(f"no k3lab checkpoint at {path} (expected {marker} or a '{LATEST}' file)")
    return path


# ----------------------------------------------------------------------------------------------
# load-time checks (shared with k3lab.parallel.checkpoint)
# ----------------------------------------------------------------------------------------------
def file_inside(folder: str | os.PathLike, name: str | os.PathLike, source: str | os.PathLike | None = None) -> Path:
    """``folder / name`` after checking that it resolves (symlinks followed) to a path strictly inside
    the resolved ``folder``: a symlink, an absolute name or ``..`` that leads elsewhere could make a
    load read another checkpoint's (or any) file. ValueError naming it otherwise (``source``: the file
    that gave ``name``, e.g. DCP's index). The file need not exist."""
    file = Path(folder) / name
    root, real = Path(os.path.realpath(folder)), Path(os.path.realpath(file))
    if root not in real.parents:
        where = f"{source}: file {os.fspath(name)!r}" if source is not None else str(file)
        raise ValueError(f"{where} resolves to {real}, outside the checkpoint folder {root}; refused "
                         "(a load reads only files inside the checkpoint folder)")
    return file


def _nonnegative_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


_STATE_FIELDS = {  # name -> (check, what it must be): the plain values a resume uses
    "step": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
    "tokens": (_nonnegative_number, "a finite number >= 0"),
    "elapsed": (_nonnegative_number, "a finite number >= 0 (seconds)"),
    "history": (lambda v: isinstance(v, list), "a list (the metric history)"),
}


def check_state_fields(state: dict, source: str | os.PathLike, prefix: str = "", need_step: bool = True) -> None:
    """Raise ValueError naming ``source`` and the field (``prefix`` + name) when a value a resume uses
    is malformed: ``step`` an int >= 0 (bool refused; required unless ``need_step`` is False),
    ``tokens`` / ``elapsed`` finite numbers >= 0, ``history`` a list, each where present. A bad value
    would otherwise fail later, far from its cause (a negative step: a ZeroDivisionError)."""
    if need_step and "step" not in state:
        raise ValueError(f"{source}: {prefix}step missing (the step the checkpoint was saved at)")
    for name, (ok, rule) in _STATE_FIELDS.items():
        if name in state and not ok(state[name]):
            raise ValueError(f"{source}: {prefix}{name}={state[name]!r}: must be {rule}")


def read_state(file: str | os.PathLike, fmt: str) -> dict:
    """A checkpoint's state.json as a dict: a JSON object of format ``fmt`` whose top-level resume
    fields pass :func:`check_state_fields`; ValueError naming the file otherwise."""
    try:
        state = json.loads(Path(file).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{file}: must hold a JSON object, not {type(state).__name__}")
    if state.get("format") != fmt:
        raise ValueError(f"{file}: format {state.get('format')!r} is not {fmt!r}")
    check_state_fields(state, file)
    return state


def check_model_config(saved: dict | None, model: nn.Module, source: str | os.PathLike | None = None) -> None:
    """Refuse a checkpoint whose model config (``saved``, as state.json recorded it) differs from
    ``model.config``: two configs can give the same tensor shapes (``hidden_act`` situ vs swiglu) and
    the weights would load silently into a model that computes something else. ValueError naming every
    differing field with both values. Skipped when either side has no config; fields of
    :data:`MODEL_CONFIG_FIELDS_IGNORED` are not compared; fields the checkpoint predates count as
    their defaults."""
    config = getattr(model, "config", None)
    current = plain_config(config)
    if saved is None or current is None:
        return
    if not isinstance(saved, dict):
        raise ValueError(f"{source}: model_config={saved!r}: must be a JSON object (the model's config)")
    defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(config)
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    saved = {**json.loads(json.dumps(defaults, default=repr)), **saved}
    absent = object()

    def show(value):
        return "absent" if value is absent else repr(value)

    differ = [f"{name}={show(saved.get(name, absent))} (checkpoint) vs {show(current.get(name, absent))} (this model)"
              for name in sorted(set(saved) | set(current)) if name not in MODEL_CONFIG_FIELDS_IGNORED
              and saved.get(name, absent) != current.get(name, absent)]
    if differ:
        raise ValueError(f"{f'{source}: ' if source is not None else ''}checkpoint model config differs: "
                         f"{', '.join(differ)}; build the model with the checkpoint's config")


def _check_optimizer_tensors(tensors: dict, plain: dict, file: Path) -> None:
    """optimizer.safetensors must hold exactly the tensors state.json lists (``optimizer.tensors``;
    checkpoints written before that list existed are not checked): a missing one would otherwise
    fail as a KeyError deep inside the optimizer, at its next step."""
    listed = plain.get("tensors")
    if listed is None:
        return
    missing, unexpected = sorted(set(listed) - set(tensors)), sorted(set(tensors) - set(listed))
    if missing or unexpected:
        raise ValueError(f"{file}: optimizer tensors missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                         f"not listed in state.json {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
                         "(an incomplete or replaced file)")


# ----------------------------------------------------------------------------------------------
# state pieces
# ----------------------------------------------------------------------------------------------
def rng_state() -> tuple[dict, dict]:
    """(tensors, plain data) describing every RNG the loop may touch."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    py = random.getstate()
    np_state = np.random.get_state()
    plain = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [np_state[0], np_state[1].tolist(), *(x for x in np_state[2:])]}
    return tensors, plain


def set_rng_state(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["torch_cuda"]))
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def json_value(value, where: str):
    """Refuse anything JSON cannot hold, loudly (JSON is the only non-tensor format we read)."""
    try:
        json.dumps(value)
    except TypeError as err:
        raise TypeError(f"checkpoint: {where} = {value!r} is not plain data (JSON); {err}") from None
    return value


def _split_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """optimizer.state_dict() -> (tensors keyed "<index>.<name>", plain data for JSON)."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(index), {})[name] = json_value(value, f"optimizer state {index}.{name}")
    groups = [{k: json_value(list(v) if isinstance(v, tuple) else v, f"param group key {k!r}")
               for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars, "tensors": sorted(tensors)}


def _join_optimizer_state(tensors: dict, plain: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    for index, values in plain["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in plain["param_groups"]]
    return {"state": state, "param_groups": groups}


def plain_config(obj):
    """A dataclass (TrainConfig, ModelConfig) as JSON data (odd values as their repr); else None."""
    if dataclasses.is_dataclass(obj):
        return json.loads(json.dumps(dataclasses.asdict(obj), default=repr))
    return None


def prune_checkpoints(out_dir: Path, final: Path, keep: int) -> None:
    """Keep ``final`` and the ``keep - 1`` highest-numbered other ``ckpt-*`` folders."""
    others = [p for p in sorted(out_dir.glob("ckpt-*")) if p != final]
    for old in others[:max(0, len(others) - (keep - 1))]:
        shutil.rmtree(old)


# ----------------------------------------------------------------------------------------------
# save / load
# ----------------------------------------------------------------------------------------------
def save_checkpoint(out_dir: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                    meta: dict, keep: int = 2) -> Path:
    """Write ``out_dir/ckpt-<step>`` atomically and point ``out_dir/latest`` at it; keep it and the
    ``keep - 1`` highest-numbered other checkpoints. ``meta`` (plain data, with ``step``) goes into
    state.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"ckpt-{meta['step']:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-ckpt-", dir=out_dir))
    opt_tensors, opt_plain = _split_optimizer_state(optimizer)
    rng_tensors, rng_plain = rng_state()
    save_model(model, str(tmp / "model.safetensors"))
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    state = dict(meta, format=CHECKPOINT_FORMAT, optimizer=opt_plain, rng=rng_plain,
                 model_config=plain_config(getattr(model, "config", None)))
    (tmp / "state.json").write_text(json.dumps(state))
    write_checksums(tmp, file_checksums(tmp, checksum_files(tmp)))  # last: every file is complete
    if final.exists():  # the same step saved again (a resumed run that stops where it started)
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_latest(out_dir, final)
    prune_checkpoints(out_dir, final, keep)
    return final


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder (holds state.json), or a run folder whose ``latest`` file names one
    (only a folder directly inside the run folder: see :func:`read_latest`)."""
    return _resolve(path, "state.json")


def _check_safetensors_headers(path: Path) -> None:
    """A file that is not safetensors at all (a pickle in its place) is refused by the safetensors reader,
    as it always was, now naming the file; a missing one is left to the checksums (or to the load)."""
    from safetensors import SafetensorError, safe_open

    for name in CHECKPOINT_FILES:
        if name.endswith(".safetensors") and (path / name).is_file():
            try:
                with safe_open(str(path / name), framework="pt"):
                    pass
            except SafetensorError as err:
                raise SafetensorError(f"{path / name}: {err}") from None


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load weights (and optimizer state) from a checkpoint into ``model`` in place; return its
    state.json as a dict (``step``, ``history``, ...) plus ``path``. Reads safetensors and JSON only,
    and checks them before it changes the model (module docstring: ValueError naming the fault)."""
    path = resolve_checkpoint(path)
    for name in CHECKPOINT_FILES:
        file_inside(path, name)
    state = read_state(path / "state.json", CHECKPOINT_FORMAT)
    _check_safetensors_headers(path)
    verify_checksums(path)
    check_model_config(state.get("model_config"), model, path / "state.json")
    if optimizer is not None:
        tensors = load_file(str(path / "optimizer.safetensors"))
        _check_optimizer_tensors(tensors, state["optimizer"], path / "optimizer.safetensors")
    device = next(model.parameters()).device
    load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
    if optimizer is not None:
        optimizer.load_state_dict(_join_optimizer_state(tensors, state["optimizer"]))
    state["path"] = str(path)
    return state
