"""Checkpoint loading is loud on bad input, in both formats (k3lab.checkpoint: safetensors + JSON;
k3lab.parallel.checkpoint: DCP, here at world size 1 without a process group): each fault is planted
by editing the saved files and must raise a ValueError naming the file/field, before the model changes.

Faults: a file (or DCP index entry) that resolves outside the checkpoint folder; malformed resume
fields in state.json; a missing optimizer tensor; a saved model config that differs from the model's.
Every checkpoint carries checksums.json (tests/test_operator_faults.py: a changed, truncated or missing
file is refused by it); the faults here are planted by someone who also rewrites it (:func:`reseal`), so
that the checks behind the checksums are what refuses them.
"""
import dataclasses
import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from k3lab.checkpoint import CHECKPOINT_FILES, checksum_files, file_checksums, load_checkpoint, save_checkpoint, \
    write_checksums
from k3lab.config import ModelConfig
from k3lab.model import K3ForCausalLM
from k3lab.parallel.checkpoint import load_distributed, save_distributed

CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=2, full_attn_layers=[2], vocab_size=256)
FORMATS = ("safetensors", "dcp")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def small(seed=0):
    """A plain module (no config) and AdamW with state."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def save(fmt, run_dir, model, opt, step=1, **meta):
    """One checkpoint of ``fmt`` in ``run_dir``; returns its folder."""
    if fmt == "safetensors":
        return save_checkpoint(run_dir, model, opt, dict(step=step, **meta))
    return save_distributed(run_dir, step, model, opt, dict(step=step, **meta))


def load(fmt, path, model, opt=None):
    return (load_checkpoint if fmt == "safetensors" else load_distributed)(path, model, opt)


def reseal(path):
    """Rewrite ``path/checksums.json`` for the files as they are now (a tamperer who updates it too)."""
    write_checksums(path, file_checksums(path, checksum_files(path)))


def edit_state(path, change):
    """Rewrite ``path/state.json`` with ``change(state)`` applied (and reseal)."""
    state = json.loads((path / "state.json").read_text())
    change(state)
    (path / "state.json").write_text(json.dumps(state))
    reseal(path)


def weights(model):
    return [t.clone() for t in model.state_dict().values()]


def unchanged(model, before):
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before))


# ----------------------------------------------------------------------------------------------
# a valid checkpoint still loads (catches an over-eager check)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_valid_checkpoint_loads(tmp_path, fmt):
    """A K3 model with its config, optimizer state, resume fields; loaded through a symlinked folder
    (inside is judged after resolving) into a model that differs only in ``backend`` (ignored)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, CFG.vocab_size, (2, 8))
    model(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    path = save(fmt, tmp_path / "run", model, opt, step=1, tokens=16, elapsed=0.5, history=[dict(step=1)])
    os.symlink(path, tmp_path / "alias", target_is_directory=True)
    torch.manual_seed(1)
    fresh = K3ForCausalLM(CFG.replace(backend="torch", initializer_range=0.01))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = load(fmt, tmp_path / "alias", fresh, fresh_opt)
    assert state["step"] == 1 and state["tokens"] == 16 and state["history"] == [dict(step=1)]
    assert unchanged(fresh, weights(model))
    assert fresh_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


# ----------------------------------------------------------------------------------------------
# 1. files outside the checkpoint folder
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_symlink_out_of_checkpoint_refused(tmp_path, name):
    """Each fixed file of the one-process format, replaced by a symlink to another checkpoint's."""
    model, opt = small()
    other = save_checkpoint(tmp_path / "elsewhere", model, opt, dict(step=1))
    path = save_checkpoint(tmp_path / "run", model, opt, dict(step=1))
    (path / name).unlink()
    os.symlink(other / name, path / name)
    reseal(path)
    with pytest.raises(ValueError, match=rf"{name} resolves to .* outside the checkpoint folder"):
        load_checkpoint(path, small(1)[0], small(1)[1])


def tamper_storage(path, relative_path):
    """Rewrite DCP's index so that every storage entry names ``relative_path`` (the test wrote the
    file itself, so plain pickle is safe here)."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=relative_path)
                             for k, v in metadata.storage_data.items()}
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(path)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_dcp_index_pointing_outside_refused(tmp_path, where):
    """A tampered .metadata naming a data file of another checkpoint (valid, so DCP would read it)."""
    model, opt = small()
    save_distributed(tmp_path / "elsewhere", 1, *small(2), dict(step=1))
    path = save_distributed(tmp_path / "run", 1, model, opt, dict(step=1))
    target = "../../elsewhere/ckpt-00000001/__0_0.distcp"
    tamper_storage(path, target if where == "relative" else str((path / target).resolve()))
    fresh = small(1)[0]
    before = weights(fresh)
    with pytest.raises(ValueError, match=r"\.metadata: file '.*elsewhere/ckpt-00000001/__0_0\.distcp' resolves to "
                                         r".* outside the checkpoint folder"):
        load_distributed(path, fresh, None)
    assert unchanged(fresh, before)


def test_dcp_symlinked_data_file_refused(tmp_path):
    save_distributed(tmp_path / "elsewhere", 1, *small(2), dict(step=1))
    path = save_distributed(tmp_path / "run", 1, *small(), dict(step=1))
    (path / "__0_0.distcp").unlink()
    os.symlink(tmp_path / "elsewhere" / "ckpt-00000001" / "__0_0.distcp", path / "__0_0.distcp")
    reseal(path)
    # the checksum pass, which opens every file checksums.json lists, refuses it first
    with pytest.raises(ValueError, match=r"(\.metadata|checksums\.json): file '__0_0\.distcp' resolves to .* outside "
                                         r"the checkpoint"):
        load_distributed(path, small(1)[0], None)


# ----------------------------------------------------------------------------------------------
# 2. malformed resume fields in state.json
# ----------------------------------------------------------------------------------------------
BAD_FIELDS = [("step", -5, "an int >= 0"), ("step", True, "an int >= 0"), ("step", 2.0, "an int >= 0"),
              ("history", {"step": 1}, "a list"), ("tokens", -1, "a finite number >= 0"),
              ("elapsed", "1s", "a finite number >= 0")]


@pytest.mark.parametrize("field,value,rule", BAD_FIELDS)
def test_bad_state_field_named(tmp_path, field, value, rule):
    model, opt = small()
    path = save_checkpoint(tmp_path, model, opt, dict(step=1, tokens=24, elapsed=0.1, history=[]))
    edit_state(path, lambda s: s.update({field: value}))
    with pytest.raises(ValueError, match=rf"state\.json: {field}={value!r}: must be {rule}"):
        load_checkpoint(path, small(1)[0])


@pytest.mark.parametrize("field,value,rule", [("step", -5, "an int >= 0"), ("extra.step", -5, "an int >= 0"),
                                              ("extra.step", "3", "an int >= 0"), ("extra.history", "x", "a list")])
def test_dcp_bad_state_field_named(tmp_path, field, value, rule):
    path = save_distributed(tmp_path, 1, *small(), dict(step=1, history=[]))

    def change(state):
        *parents, name = field.split(".")
        (state[parents[0]] if parents else state)[name] = value

    edit_state(path, change)
    with pytest.raises(ValueError, match=rf"state\.json: {field}={value!r}: must be {rule}"):
        load_distributed(path, small(1)[0], None)


# ----------------------------------------------------------------------------------------------
# 3. a missing optimizer tensor
# ----------------------------------------------------------------------------------------------
def test_missing_optimizer_tensor_named(tmp_path):
    path = save_checkpoint(tmp_path, *small(), dict(step=1))
    tensors = load_file(path / "optimizer.safetensors")
    del tensors["0.exp_avg"]
    save_file(tensors, path / "optimizer.safetensors")
    reseal(path)
    fresh, fresh_opt = small(1)
    before = weights(fresh)
    with pytest.raises(ValueError, match=r"optimizer\.safetensors: optimizer tensors missing \['0\.exp_avg'\]"):
        load_checkpoint(path, fresh, fresh_opt)
    assert unchanged(fresh, before)


def test_dcp_missing_tensor_named(tmp_path):
    """One optimizer tensor gone from state.json's structure (the rest of that parameter's state
    present), or one key gone from DCP's index."""
    path = save_distributed(tmp_path, 1, *small(), dict(step=1))
    state = json.loads((path / "state.json").read_text())
    edit_state(path, lambda s: s["structure"]["optim"]["state"]["0.weight"].pop("exp_avg"))
    with pytest.raises(ValueError, match=r"state\.json: .* not in the checkpoint \['optim/state/0\.weight/exp_avg'\]"):
        load_distributed(path, *small(1))
    (path / "state.json").write_text(json.dumps(state))
    metadata = pickle.loads((path / ".metadata").read_bytes())
    del metadata.state_dict_metadata["model/2.bias"]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(path)
    with pytest.raises(ValueError, match=r"\.metadata: keys missing \['model/2\.bias'\]"):
        load_distributed(path, *small(1))


# ----------------------------------------------------------------------------------------------
# 4. the saved model config differs from the model's
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_model_config_difference_named(tmp_path, fmt):
    """situ vs swiglu: identical shapes, so the weights would load silently."""
    model = K3ForCausalLM(CFG)
    path = save(fmt, tmp_path, model, torch.optim.AdamW(model.parameters()))
    other = K3ForCausalLM(CFG.replace(hidden_act="swiglu", rms_norm_eps=1e-6))
    before = weights(other)
    with pytest.raises(ValueError, match=r"state\.json: checkpoint model config differs: hidden_act='situ' "
                                         r"\(checkpoint\) vs 'swiglu' \(this model\), rms_norm_eps=1e-05 "
                                         r"\(checkpoint\) vs 1e-06 \(this model\); build the model with the "
                                         r"checkpoint's config$"):
        load(fmt, path, other)
    assert unchanged(other, before)
