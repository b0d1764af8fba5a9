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
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

CHECKPOINT_FORMAT = "k3lab-checkpoint-v1"
LATEST = "latest"  # the pointer file's name inside a run folder
CHECKPOINT_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")
# ModelConfig fields a checkpoint loads under with another value: they change neither the math nor
# the tensor layout of the loaded model (check_model_config skips them)
MODEL_CONFIG_FIELDS_IGNORED = (
    "backend",  # which kernels run an op (torch / triton / fla): the same function, up to rounding
    "initializer_range",  # only draws the initial weights, which the load overwrites
)

__all__ = ["CHECKPOINT_FORMAT", "CHECKPOINT_FILES", "MODEL_CONFIG_FIELDS_IGNORED", "save_checkpoint",
           "load_checkpoint", "resolve_checkpoint", "read_latest", "write_latest", "file_inside", "read_state",
           "check_state_fields", "check_model_config"]


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


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load weights (and optimizer state) from a checkpoint into ``model`` in place; return its
    state.json as a dict (``step``, ``history``, ...) plus ``path``. Reads safetensors and JSON only,
    and checks them before it changes the model (module docstring: ValueError naming the fault)."""
    path = resolve_checkpoint(path)
    for name in CHECKPOINT_FILES:
        file_inside(path, name)
    state = read_state(path / "state.json", CHECKPOINT_FORMAT)
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
