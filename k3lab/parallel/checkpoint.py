"""Distributed checkpoints with DCP (``torch.distributed.checkpoint``): sharded, re-shardable, atomic.

    path  = save_distributed(run_dir, step, model, optimizer, extra, keep=2, group=None)   # every rank
    extra = load_distributed(run_dir_or_ckpt, model, optimizer, group=None)               # every rank

Model and optimizer state come from ``get_state_dict(model, optimizer)`` (FQN-keyed; FSDP2
parameters and their optimizer moments are DTensor shards) and go back through
``set_state_dict``, so a checkpoint written at one world size loads at any other: DCP reads each
rank's slice of every tensor from whichever files hold it (2 -> 1, 2 -> 4, ...). A plain module
works the same, in a process group or with none (``no_dist``: world size 1, no collectives).

Run folder (the layout and ``latest`` rule of :mod:`k3lab.checkpoint`, shared with ``fit``):

    run_dir/ckpt-00000100/      one checkpoint
    run_dir/latest              the newest folder's name; it may name only a folder directly inside
                                run_dir (:func:`k3lab.checkpoint.read_latest`)
    run_dir/.tmp-ckpt-<step>/   a save in progress (or one that crashed: never read, removed by the
                                next successful save)

A checkpoint folder:

    .metadata               DCP's index (tensor shapes, dtypes, chunks -> files). A **pickle**, DCP's
                            own format: before DCP reads it, :func:`load_distributed` unpickles it
                            with an allow-list (DCP's metadata dataclasses, ``torch.Size``, dtypes,
                            ``pathlib`` paths) and refuses anything else, so a tampered index
                            cannot run code; DCP then unpickles the same file itself (a file
                            swapped between the two reads is not covered).
    __<rank>_0.distcp       the tensors each rank wrote (one copy of replicated tensors), as
                            ``torch.save`` blobs that DCP reads with ``torch.load(weights_only=True)``
    state.json              rank 0: ``format``, ``step``, ``world_size``, ``extra`` (the caller's
                            plain data), the model config, and ``structure``: the model and optimizer
                            state dicts with every tensor replaced by ``{"__tensor__": "<DCP key>"}``
                            (DCP keys: ``model/<fqn>``, ``optim/state/<fqn>/<name>``) and every
                            non-tensor value (param groups, scalar optimizer state) kept as JSON
    rng-rank<r>.json        rank r's RNG states: torch CPU (and CUDA) generator states as lists of
                            ints, python's and numpy's states
    checksums.json          every other file's size and sha256 (:data:`k3lab.checkpoint.CHECKSUMS`),
                            written by rank 0 once every rank's files are complete (the ranks hash a
                            share of the files each), before the folder is renamed into place

Only tensors go into DCP; every other value is JSON, so DCP's byte-item path (which unpickles with
``torch.load(weights_only=False)``) is never used, and a load refuses a ``.metadata`` that declares
any requested key as bytes.

Atomic save: every rank writes into ``run_dir/.tmp-ckpt-<step>`` (rank 0 creates it; barrier),
then (barrier; the ranks hash the files, rank 0 writes checksums.json) rank 0 renames it to
``ckpt-<step:08d>``, swaps ``latest`` (temporary file + ``os.replace``) and prunes to the ``keep``
newest (barrier); a crash before the rename leaves the previous ``latest`` valid. Each barrier is an all-reduce of an error flag, so a step that fails on
one rank raises on every rank instead of leaving the others waiting until the timeout. ``run_dir``
must be one folder that every rank sees (a shared filesystem on several hosts).

Plain (non-DTensor) tensors (FSDP2's ``ignored_params`` such as the router biases, AdamW's ``step``,
buffers) are replicated as far as DCP knows: one copy is saved. A save checks that they are equal on
every rank (two float64 checksums per tensor, all-reduced) and raises ValueError naming them
otherwise, since a per-rank slice held as a plain tensor (an expert-parallel slice) would silently
be saved from one rank only; such state must be a DTensor for DCP to know its layout.

Optimizer: its state must exist when saving (``get_state_dict`` would otherwise build it with a
zero-gradient, lr=0 step): an optimizer that has not stepped yet is recorded as such and a load
leaves the optimizer without state. Loading builds the fresh optimizer's state first (the same
zero step), which needs its parameters to hold no gradients. Optimizer state the saved run had not
built (a parameter that never got a gradient) stays absent after the load, as it was.

Loading checks, before the model changes (ValueError naming the file and the field): DCP's index
first (read with the allow-list below: small, and never unpickled unchecked), then the checksums
(each rank hashes a share of the files, every rank raises the same
:class:`~k3lab.checkpoint.CheckpointCorrupt` naming the first missing, truncated or changed file; a
folder without checksums.json, written before it existed, is not verified); every file the
load opens (state.json, ``.metadata``, the rank's RNG file, and each data file the index names in its
storage entries) must resolve, symlinks followed, inside the checkpoint folder
(:func:`k3lab.checkpoint.file_inside`: a tampered index cannot point DCP at ``../../x.distcp`` or an
absolute path); state.json's ``step`` and ``extra``'s ``step`` / ``history`` must be sane
(:func:`k3lab.checkpoint.check_state_fields`); the saved model config must equal the model's
(:func:`k3lab.checkpoint.check_model_config`); the checkpoint must hold every tensor this model and
optimizer need (a parameter's optimizer state may be absent only as a whole).

RNG: at the saved world size each rank gets its own states back (``"rng_restored": True``); at
another world size the ranks cannot be matched, nothing is restored, and the returned dict says so
(``"rng_restored": False`` and a ``"warnings"`` entry).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import sys
import warnings
from enum import Enum
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

from k3lab.precision import MasterWeightOptimizer
from k3lab.checkpoint import (LATEST, CheckpointCorrupt, checksum_files, checksum_problems, file_checksums,
                              json_value, plain_config, prune_checkpoints, rng_state, set_rng_state,
                              check_model_config, check_state_fields, file_inside, read_latest, read_state,
                              write_checksums, write_latest)

FORMAT = "k3lab-dcp-checkpoint-v1"
METADATA = ".metadata"  # DCP's index file inside a checkpoint folder
_TMP_RE = re.compile(r"^\.tmp-ckpt-\d+$")

__all__ = ["FORMAT", "save_distributed", "load_distributed", "resolve_distributed_checkpoint"]


# ----------------------------------------------------------------------------------------------
# process group helpers (no group = world size 1, no collectives)
# ----------------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world(group=None) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if _distributed() else (0, 1)


def _flag_device(group) -> torch.device:
    """Where a small tensor for a collective must live: CUDA for an NCCL-only group, else CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_ok(error: BaseException | None, what: str, group) -> None:
    """Every rank learns whether any rank failed ``what`` (an all-reduce), so all raise together
    instead of the healthy ones waiting in the next barrier until the timeout."""
    if not _distributed():
        if error is not None:
            raise error
        return
    failed = torch.tensor([0.0 if error is None else 1.0], device=_flag_device(group))
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if failed.item() > 0:
        raise RuntimeError(f"checkpoint: {what} failed on another rank (see its error)")


def _all_gather(value, group) -> list:
    """Every rank's ``value`` (plain data), in rank order; ``[value]`` without a process group."""
    if not _distributed():
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _verify_checksums(path: Path, group) -> None:
    """Every rank checks a share of the files checksums.json lists (their sizes all of them), and every rank
    raises the same :class:`CheckpointCorrupt` naming the first bad file, or none does."""
    rank, world = _rank_world(group)
    try:
        mine = checksum_problems(path, share=(rank, world)) or []
    except (OSError, ValueError) as err:  # an unreadable manifest, or a path that leaves the folder
        mine = [str(err).splitlines()[0]]
    found = sorted(set().union(*map(set, _all_gather(mine, group))))
    if found:
        raise CheckpointCorrupt(found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns that it assumes one process: that is what we asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# ----------------------------------------------------------------------------------------------
# state dict <-> (DCP tensors, JSON structure)
# ----------------------------------------------------------------------------------------------
def _split(obj, path: tuple[str, ...], tensors: dict):
    """Replace every tensor in a nested state dict by ``{"__tensor__": key}`` (collected into
    ``tensors[key]``, key = "/".join(path)); tuples become ``{"__tuple__": [...]}``; the rest must
    be JSON data (TypeError naming the entry)."""
    where = "/".join(path)
    if isinstance(obj, torch.Tensor):
        tensors[where] = obj
        return {"__tensor__": where}
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"checkpoint: {where} has non-string keys {bad[:5]} (state dicts are FQN-keyed)")
        return {k: _split(v, (*path, k), tensors) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {"__tuple__": [_split(v, (*path, str(i)), tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_split(v, (*path, str(i)), tensors) for i, v in enumerate(obj)]
    return json_value(obj, where)


def _join(obj, tensors: dict):
    """Inverse of :func:`_split`."""
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"}:
            return tuple(_join(v, tensors) for v in obj["__tuple__"])
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


def _tensor_keys(obj) -> set[str]:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return {obj["__tensor__"]}
        return set().union(*(_tensor_keys(v) for v in obj.values()))
    if isinstance(obj, list):
        return set().union(*(_tensor_keys(v) for v in obj))
    return set()


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """FQN-keyed (model, optimizer) state dicts; optimizer None gives None. Note: on an optimizer
    with no state yet, ``get_state_dict`` first builds it with a zero-gradient, lr=0 step; a
    :class:`~k3lab.precision.MasterWeightOptimizer` gets zero state (step 0) where it has none (its ``init_state``)."""
    if optimizer is None:
        return get_model_state_dict(model), None
    if isinstance(optimizer, MasterWeightOptimizer):  # every parameter's state, zero where it has not stepped (a
        optimizer.init_state()  # step-0 state steps as none does), so a save and a load see the same tensors
        return get_model_state_dict(model), _master_state_by_fqn(model, optimizer)
    return get_state_dict(model, optimizer)


def _master_state_by_fqn(model: nn.Module, optimizer: MasterWeightOptimizer) -> dict:
    """A master-weight optimizer's ``state_dict()`` (each parameter's AdamW state plus its fp32 master under
    ``MASTER_KEY``; DTensors where the parameters are FSDP2 shards) keyed by the parameters' FQNs, as
    ``get_state_dict`` keys a torch optimizer's: ``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn]}]}``."""
    fqn = {id(p): name for name, p in model.named_parameters()}
    order = [fqn[id(optimizer.param_of(w))] for g in optimizer.param_groups for w in g["params"]]
    sd = optimizer.state_dict()
    groups, start = [], 0
    for g in sd["param_groups"]:
        groups.append({**g, "params": order[start:start + len(g["params"])]})
        start += len(g["params"])
    return {"state": {order[i]: s for i, s in sd["state"].items()}, "param_groups": groups}


def _load_master_state(optimizer: MasterWeightOptimizer, osd: dict) -> None:
    """:func:`_master_state_by_fqn`'s inverse: the FQN-keyed state back into ``optimizer`` (index-keyed)."""
    order = [fqn for g in osd["param_groups"] for fqn in g["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    groups, start = [], 0
    for g in osd["param_groups"]:
        groups.append({**g, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    optimizer.load_state_dict({"state": {index[k]: v for k, v in osd["state"].items()}, "param_groups": groups})


def _check_replicated(tensors: dict, group) -> None:
    """Raise ValueError when a plain (non-DTensor) tensor differs between ranks: DCP saves one copy."""
    if not _distributed() or dist.get_world_size(group) == 1:
        return
    plain = sorted(k for k, t in tensors.items() if not isinstance(t, DTensor))
    if not plain:
        return
    device = _flag_device(group)
    sums = []
    for key in plain:
        t = tensors[key].detach().flatten()
        if t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex()):
            t = t.to(torch.float64)
        t = torch.view_as_real(t).flatten() if t.is_complex() else t
        t = torch.nan_to_num(t.to(torch.float64), nan=7.0, posinf=11.0, neginf=-13.0)
        weights = torch.arange(t.numel(), device=t.device, dtype=torch.float64).remainder_(997).add_(1)
        count = torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device)
        sums.append(torch.stack([t.sum(), (t * weights).sum(), count]).to(device))  # tensors may sit on CPU and GPU
    local = torch.stack(sums)
    high, low = local.clone(), -local
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MAX, group=group)
    differ = [key for key, row in zip(plain, (high != -low).any(dim=1).tolist()) if row]
    if differ:
        raise ValueError(f"save_distributed: plain (non-DTensor) tensors differ across ranks: {differ[:8]}"
                         f"{' ...' if len(differ) > 8 else ''}; DCP would save one rank's copy. Keep them "
                         "replicated (all-reduce) or make them DTensors so DCP knows their layout")


# ----------------------------------------------------------------------------------------------
# DCP's .metadata: check it with an allow-list unpickler before DCP reads it
# ----------------------------------------------------------------------------------------------
_TORCH_OK = {"Size"}
_FUNCS_OK = {("torch.serialization", "_get_layout")}  # name -> torch.layout lookup (TensorProperties)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP index holds; any other raises ValueError."""

    def __init__(self, data: bytes, path: Path):
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str):
        ok = False
        if "." not in name:
            if (module, name) in _FUNCS_OK:
                ok = True
            elif module == "torch":
                obj = getattr(torch, name, None)
                ok = name in _TORCH_OK or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
            elif module == "pathlib":
                ok = name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
            elif module.startswith("torch.distributed.checkpoint."):  # only modules already imported
                obj = getattr(sys.modules.get(module), name, None)
                ok = (isinstance(obj, type) and obj.__module__ == module
                      and (dataclasses.is_dataclass(obj) or issubclass(obj, Enum)))
        if not ok:
            raise CheckpointCorrupt(f"{self.path}: references {module}.{name}, which a DCP index does not hold; "
                                    "refused (unpickling it could run code)")
        return super().find_class(module, name)


def _read_metadata(path: Path):
    """DCP's Metadata from ``path/.metadata``, unpickled with the allow-list; every data file its
    storage entries name must lie inside ``path`` (:func:`_check_storage_paths`)."""
    file = file_inside(path, METADATA)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing (not a DCP checkpoint?)")
    try:
        metadata = _MetadataUnpickler(file.read_bytes(), file).load()
    except ValueError:
        raise
    except Exception as err:  # truncated or garbage
        raise CheckpointCorrupt(f"{file}: not a readable DCP index ({type(err).__name__}: {err})") from None
    _check_storage_paths(metadata, path, file)
    return metadata


def _check_storage_paths(metadata, path: Path, file: Path) -> None:
    """DCP's FileSystemReader opens ``path / relative_path`` for each storage entry: a tampered index
    saying ``../../elsewhere/x.distcp`` or an absolute path (or a data file that is a symlink out)
    would make it read from outside the checkpoint. Refuse any such path, naming it, before DCP reads."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise ValueError(f"{file}: storage_data={type(storage).__name__}: not a DCP index (expected a dict)")
    names = {getattr(info, "relative_path", None) for info in storage.values()}
    for name in sorted(names, key=repr):
        if not isinstance(name, (str, os.PathLike)):
            raise ValueError(f"{file}: storage path {name!r}: must be a file name inside the checkpoint folder")
        file_inside(path, name, source=file)


# ----------------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------------
def _write_json(file: Path, data) -> None:
    with open(file, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _rng_json(rank: int, world: int) -> dict:
    tensors, plain = rng_state()
    return dict(rank=rank, world_size=world, **{k: v.tolist() for k, v in tensors.items()}, **plain)


def _as_dtensors(tensors: dict, local_shards: dict | None) -> dict:
    """Present the plain per-rank slices named in ``local_shards`` (model FQN -> (mesh, placements),
    e.g. expert-parallel expert slices: ``[Replicate(), Shard(0)]`` on the ``(edp, ep)`` mesh) as the
    DTensors they are, for the parameter and each of its optimizer moments of the same shape, so that
    DCP saves every slice and re-shards them on load. Other entries are returned unchanged."""
    if not local_shards:
        return tensors
    out = dict(tensors)
    for key, t in tensors.items():
        parts = key.split("/")
        fqn = parts[1] if parts[0] == "model" else parts[2] if parts[:2] == ["optim", "state"] else None
        if fqn in local_shards and not isinstance(t, DTensor) and t.ndim >= 1:
            mesh, placements = local_shards[fqn]
            out[key] = DTensor.from_local(t, mesh, placements, run_check=False)
    return out


def save_distributed(run_dir, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     extra: dict, keep: int = 2, group=None, local_shards: dict | None = None) -> Path:
    """Save ``model`` and ``optimizer`` (sharded, via DCP) plus ``extra`` (plain JSON data) as
    ``run_dir/ckpt-<step:08d>``; call on every rank of ``group`` (None: the default group, or no
    group at all). Atomic (see the module docstring); keeps the ``keep`` newest checkpoints.
    ``local_shards``: plain parameters that are per-rank slices (:func:`_as_dtensors`).
    Returns the checkpoint folder."""
    run_dir = Path(run_dir)
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"save_distributed: step={step!r}: must be an int >= 0")
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"save_distributed: keep={keep!r}: must be an int >= 1")
    rank, world = _rank_world(group)
    tmp, final = run_dir / f".tmp-ckpt-{step}", run_dir / f"ckpt-{step:08d}"

    error = None
    try:  # everything that can fail on bad input, before any rank touches the disk
        # an optimizer that has not stepped is saved as such (get_state_dict would build its state
        # with a zero-gradient step, changing the live optimizer's step count)
        unstepped = optimizer is not None and not optimizer.state
        msd, osd = _states(model, None if unstepped else optimizer)
        tensors: dict = {}
        structure = {"model": _split(msd, ("model",), tensors),
                     "optim": None if osd is None else _split(osd, ("optim",), tensors),
                     "optim_unstepped": unstepped}
        state = dict(format=FORMAT, step=step, world_size=world, extra=json_value(extra, "extra"),
                     model_config=plain_config(getattr(model, "config", None)), structure=structure)
        state_text = json.dumps(state)
    except Exception as err:  # noqa: BLE001 (re-raised on this rank by _all_ok)
        error = err
    _all_ok(error, "building the state dicts", group)
    tensors = _as_dtensors(tensors, local_shards)
    _check_replicated(tensors, group)

    error = None
    if rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crashed save of the same step
                shutil.rmtree(tmp)
            tmp.mkdir()
        except Exception as err:  # noqa: BLE001
            error = err
    _all_ok(error, f"creating {tmp}", group)

    with _single_process_quiet():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), process_group=group, no_dist=not _distributed())
    error = None
    try:
        _write_json(tmp / f"rng-rank{rank}.json", _rng_json(rank, world))
        if rank == 0:
            (tmp / "state.json").write_text(state_text)
    except Exception as err:  # noqa: BLE001
        error = err
    _all_ok(error, f"writing the JSON files in {tmp}", group)

    error, sums = None, {}
    try:  # every file is complete: each rank hashes a share of them, rank 0 writes the manifest
        names = checksum_files(tmp)
        sums = file_checksums(tmp, names[rank::world])
    except Exception as err:  # noqa: BLE001
        error = err
    _all_ok(error, f"hashing the files in {tmp}", group)
    sums = {name: entry for part in _all_gather(sums, group) for name, entry in part.items()}

    error = None
    if rank == 0:
        try:
            write_checksums(tmp, sums)
            if final.exists():  # the same step saved again (a resumed run that stops where it started)
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_latest(run_dir, final)
            prune_checkpoints(run_dir, final, keep)
            for stale in run_dir.glob(".tmp-ckpt-*"):  # crashed saves' leftovers
                if stale.is_dir() and _TMP_RE.match(stale.name):
                    shutil.rmtree(stale, ignore_errors=True)
        except Exception as err:  # noqa: BLE001
            error = err
    _all_ok(error, f"publishing {final}", group)
    return final


# ----------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------
def resolve_distributed_checkpoint(path) -> Path:
    """A DCP checkpoint folder (holds state.json and .metadata), or a run folder whose ``latest``
    names one directly inside it (:func:`k3lab.checkpoint.read_latest`: absolute paths, ``..`` and
    symlinks out of the run folder are refused with ValueError)."""
    path = Path(path)
    if (path / LATEST).is_file():
        path = read_latest(path)
    missing = [name for name in ("state.json", METADATA) if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"no k3lab DCP checkpoint at {path}: missing {missing} "
                                f"(expected a checkpoint folder or a run folder with a '{LATEST}' file)")
    return path


def load_distributed(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                     group=None, local_shards: dict | None = None) -> dict:
    """Load a :func:`save_distributed` checkpoint (folder, or run folder with ``latest``) into
    ``model`` (and ``optimizer``) in place, at any world size; call on every rank of ``group``
    (None: the default group, or no group at all). Build the same model (and optimizer, same param
    groups, no gradients held) first, sharded as this run needs; ``local_shards`` as for the save
    (this run's per-rank slices; they may differ from the saved run's).

    Returns ``extra`` as saved, plus ``path``, ``step`` (when extra has none), ``world_size_saved``,
    ``rng_restored`` and, when something could not be restored, ``warnings`` (a list of strings).
    """
    path = Path(path)
    if (path / LATEST).is_file():
        path = read_latest(path)
    if (path / METADATA).is_file():  # the index first, with the allow-list: a tampered one is never unpickled
        _read_metadata(path)
    _verify_checksums(path, group)  # then every file's bytes: a missing one is named as such
    path = resolve_distributed_checkpoint(path)
    state_file = file_inside(path, "state.json")
    state = read_state(state_file, FORMAT)
    if not isinstance(state.get("extra"), dict):
        raise ValueError(f"{state_file}: extra={state.get('extra')!r}: must be a JSON object (the caller's data)")
    check_state_fields(state["extra"], state_file, prefix="extra.", need_step=False)
    check_model_config(state.get("model_config"), model, state_file)
    structure = state["structure"]
    if optimizer is not None and structure.get("optim") is None:
        if not structure.get("optim_unstepped"):
            raise ValueError(f"{state_file}: the checkpoint holds no optimizer state (saved with optimizer=None)")
        optimizer.state.clear()  # saved before the optimizer's first step: no state, as then
        optimizer = None
    rank, world = _rank_world(group)
    rng_file = file_inside(path, f"rng-rank{rank}.json") if state["world_size"] == world else None

    msd, osd = _states(model, optimizer)  # this run's layout (an empty optimizer gets its state built)
    targets: dict = {}
    _split(msd, ("model",), targets)
    saved = _tensor_keys(structure["model"])
    if osd is not None:
        _split(osd, ("optim",), targets)
        saved |= _tensor_keys(structure["optim"])
    # this run may hold optimizer state the saved run had not built yet (a parameter that got no
    # gradient before the save): it is not loaded, and set_state_dict drops it, as saved. Only a
    # parameter's whole state may be absent: one tensor of it missing would fail at the next step
    saved_fqns = set((structure.get("optim") or {}).get("state") or {})
    missing = sorted(k for k in set(targets) - saved
                     if not (k.startswith("optim/state/") and k.split("/")[2] not in saved_fqns))
    unexpected = sorted(saved - set(targets))
    targets = {k: v for k, v in targets.items() if k in saved}
    if missing or unexpected:
        raise ValueError(f"{state_file}: the checkpoint does not match this model/optimizer: "
                         f"not in the checkpoint {missing[:8]}, not in this model/optimizer {unexpected[:8]} "
                         "(same model config and optimizer param groups? an optimizer whose parameters hold "
                         "gradients is not initialised for loading: zero_grad(set_to_none=True) first)")
    metadata = _read_metadata(path)
    entries = getattr(metadata, "state_dict_metadata", {})
    absent = sorted(k for k in targets if k not in entries)
    not_tensor = sorted(k for k in targets if k in entries and not isinstance(entries[k], TensorStorageMetadata))
    if absent or not_tensor:
        raise ValueError(f"{path / METADATA}: keys missing {absent[:8]} or not stored as tensors {not_tensor[:8]}")

    wrapped = _as_dtensors(targets, local_shards)
    with _single_process_quiet():
        dcp.load(wrapped, storage_reader=dcp.FileSystemReader(path), process_group=group, no_dist=not _distributed())
    targets = {k: (wrapped[k].to_local() if wrapped[k] is not t else t) for k, t in targets.items()}
    model_sd = _join(structure["model"], targets)
    if optimizer is None:
        set_model_state_dict(model, model_sd)
    elif isinstance(optimizer, MasterWeightOptimizer):  # the weights, then the masters (split: p and lo) and moments
        set_model_state_dict(model, model_sd)
        _load_master_state(optimizer, _join(structure["optim"], targets))
    else:
        # strict=False: optimizer state the saved run never built stays absent (the model's keys
        # were checked above); newer torch refuses that otherwise
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=_join(structure["optim"], targets),
                       options=StateDictOptions(strict=False))

    out = dict(state["extra"])
    out.setdefault("step", state["step"])
    out.update(path=str(path), world_size_saved=state["world_size"])
    if rng_file is not None:  # the saved world size: this rank's own RNG states
        rng = json.loads(rng_file.read_text())
        if rng.get("rank") != rank:
            raise ValueError(f"{rng_file}: rank {rng.get('rank')!r}, expected {rank}")
        tensors = {k: torch.tensor(rng[k], dtype=torch.uint8) for k in ("torch_cpu", "torch_cuda") if k in rng}
        set_rng_state(tensors, rng)
        out["rng_restored"] = True
    else:
        out["rng_restored"] = False
        out.setdefault("warnings", []).append(
            f"RNG states not restored: saved at world size {state['world_size']}, loading at {world} "
            "(per-rank generators cannot be matched); randomness after this step differs from an "
            "uninterrupted run")
    return out
