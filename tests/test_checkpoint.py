"""k3lab.checkpoint: save/load round-trip, keep/prune, and the `latest` pointer's safety rule."""
import json
import os

import pytest
import torch
from torch import nn

from k3lab.checkpoint import load_checkpoint, read_latest, resolve_checkpoint, save_checkpoint
from k3lab.optim import build_optimizer
from k3lab.precision import MasterWeightOptimizer, cast_params_


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 32))


def trained(optimizer="adamw", steps=3):
    model = tiny_model()
    opt = build_optimizer(model, optimizer, lr=1e-2)
    x = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_round_trip_restores_weights_and_optimizer(tmp_path, optimizer):
    model, opt = trained(optimizer)
    path = save_checkpoint(tmp_path, model, opt, dict(step=3, note="hello"))
    assert path == tmp_path / "ckpt-00000003" and (tmp_path / "latest").read_text() == "ckpt-00000003"
    fresh = tiny_model(seed=1)
    fresh_opt = build_optimizer(fresh, optimizer, lr=1e-2)
    state = load_checkpoint(tmp_path, fresh, fresh_opt)
    assert state["step"] == 3 and state["note"] == "hello" and state["path"] == str(path)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    assert want["state"].keys() == got["state"].keys()
    for index, entries in want["state"].items():
        for name, value in entries.items():
            assert torch.equal(value, got["state"][index][name]), (index, name)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_round_trip_restores_fp32_masters(tmp_path, optimizer):
    """bf16 parameters + fp32 masters: the masters go into optimizer.safetensors and come back exactly."""
    def bf16_model(seed):
        model = tiny_model(seed)
        cast_params_(model, "bfloat16")
        return model, MasterWeightOptimizer(model, build_optimizer(model, optimizer, lr=1e-2))

    model, opt = bf16_model(0)
    x = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
        opt.grads_to_masters()
        opt.step()
        opt.zero_grad()
    save_checkpoint(tmp_path, model, opt, dict(step=3))
    fresh, fresh_opt = bf16_model(1)
    load_checkpoint(tmp_path, fresh, fresh_opt)
    for a, b in zip(opt.masters, fresh_opt.masters):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert opt.state_dict()["param_groups"] == fresh_opt.state_dict()["param_groups"]


def test_keep_prunes_to_newest(tmp_path):
    model, opt = trained(steps=1)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, model, opt, dict(step=step), keep=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-00000002", "ckpt-00000003"]
    assert resolve_checkpoint(tmp_path) == tmp_path / "ckpt-00000003"


def run_with_pointer(tmp_path, value):
    model, opt = trained(steps=1)
    save_checkpoint(tmp_path / "run", model, opt, dict(step=1))
    (tmp_path / "run" / "latest").write_text(value)
    return tmp_path / "run"


def test_good_pointer_resolves(tmp_path):
    run = run_with_pointer(tmp_path, "ckpt-00000001\n")
    assert resolve_checkpoint(run) == run / "ckpt-00000001"
    assert read_latest(run) == run / "ckpt-00000001"
    assert load_checkpoint(run, tiny_model())["step"] == 1


def elsewhere_checkpoint(tmp_path):
    """A valid checkpoint outside the run folder: what a malicious pointer would aim at."""
    model, opt = trained(steps=1)
    return save_checkpoint(tmp_path / "elsewhere", model, opt, dict(step=7))


def test_absolute_pointer_refused(tmp_path):
    target = elsewhere_checkpoint(tmp_path)
    run = run_with_pointer(tmp_path, str(target))
    with pytest.raises(ValueError, match=rf"latest: value '{target}' is not a plain checkpoint folder name"):
        resolve_checkpoint(run)
    with pytest.raises(ValueError, match="latest"):
        load_checkpoint(run, tiny_model())


@pytest.mark.parametrize("value", ["../elsewhere/ckpt-00000007", "..", ".", "", "ckpt-00000001/../..",
                                   "sub\\ckpt"])
def test_relative_escape_refused(tmp_path, value):
    elsewhere_checkpoint(tmp_path)
    run = run_with_pointer(tmp_path, value)
    with pytest.raises(ValueError, match=r"latest: value .* is not a plain checkpoint folder name"):
        resolve_checkpoint(run)


def test_symlink_escaping_the_run_folder_refused(tmp_path):
    target = elsewhere_checkpoint(tmp_path)
    run = run_with_pointer(tmp_path, "ckpt-evil")
    os.symlink(target, run / "ckpt-evil", target_is_directory=True)
    with pytest.raises(ValueError, match=r"latest: value 'ckpt-evil' resolves to .* outside the run folder"):
        resolve_checkpoint(run)


def test_missing_or_wrong_format_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no k3lab checkpoint"):
        resolve_checkpoint(tmp_path)
    model, opt = trained(steps=1)
    path = save_checkpoint(tmp_path, model, opt, dict(step=1))
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps(dict(state, format="other")))
    with pytest.raises(ValueError, match=r"state\.json: format 'other'"):
        load_checkpoint(path, tiny_model())
