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
    state.json             step, tokens, elapsed, the optimizer's param groups and non-tensor state,
                           python/numpy RNG states, TrainConfig, model config, metric history
                           (``format`` = :data:`CHECKPOINT_FORMAT`)

Loading reads only JSON and safetensors, so a checkpoint cannot run code; any other file in the
folder (a ``.pt``, a pickle) is ignored. ``latest`` may name only a folder directly inside the run
folder (:func:`read_latest`): a pointer to an absolute path, to ``../x`` or through a symlink that
leaves the run folder is refused, so a run folder cannot redirect a load elsewhere.
:mod:`k3lab.parallel.checkpoint` (DCP, sharded) uses the same run-folder layout and pointer rule.
"""
from __future__ import annotations

import dataclasses
import json
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

__all__ = ["CHECKPOINT_FORMAT", "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "read_latest",
           "write_latest"]


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
# state pieces
# ----------------------------------------------------------------------------------------------
def _rng_state() -> tuple[dict, dict]:
    """(tensors, plain data) describing every RNG the loop may touch."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    py = random.getstate()
    np_state = np.random.get_state()
    plain = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [np_state[0], np_state[1].tolist(), *(x for x in np_state[2:])]}
    return tensors, plain


def _set_rng_state(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["torch_cuda"]))
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _json_value(value, where: str):
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
                scalars.setdefault(str(index), {})[name] = _json_value(value, f"optimizer state {index}.{name}")
    groups = [{k: _json_value(list(v) if isinstance(v, tuple) else v, f"param group key {k!r}")
               for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _join_optimizer_state(tensors: dict, plain: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    for index, values in plain["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in plain["param_groups"]]
    return {"state": state, "param_groups": groups}


def _plain_config(obj):
    """A dataclass (TrainConfig, ModelConfig) as JSON data (odd values as their repr); else None."""
    if dataclasses.is_dataclass(obj):
        return json.loads(json.dumps(dataclasses.asdict(obj), default=repr))
    return None


def _prune(out_dir: Path, final: Path, keep: int) -> None:
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
    rng_tensors, rng_plain = _rng_state()
    save_model(model, str(tmp / "model.safetensors"))
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    state = dict(meta, format=CHECKPOINT_FORMAT, optimizer=opt_plain, rng=rng_plain,
                 model_config=_plain_config(getattr(model, "config", None)))
    (tmp / "state.json").write_text(json.dumps(state))
    if final.exists():  # the same step saved again (a resumed run that stops where it started)
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_latest(out_dir, final)
    _prune(out_dir, final, keep)
    return final


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder (holds state.json), or a run folder whose ``latest`` file names one
    (only a folder directly inside the run folder: see :func:`read_latest`)."""
    return _resolve(path, "state.json")


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load weights (and optimizer state) from a checkpoint into ``model`` in place; return its
    state.json as a dict (``step``, ``history``, ...) plus ``path``. Reads safetensors and JSON only."""
    path = resolve_checkpoint(path)
    state = json.loads((path / "state.json").read_text())
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path / 'state.json'}: format {state.get('format')!r} is not {CHECKPOINT_FORMAT!r}")
    device = next(model.parameters()).device
    load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
    if optimizer is not None:
        tensors = load_file(str(path / "optimizer.safetensors"))
        optimizer.load_state_dict(_join_optimizer_state(tensors, state["optimizer"]))
    state["path"] = str(path)
    return state
