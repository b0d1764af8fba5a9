"""k3lab.train: the loop, exact resume in a fresh process, NaN stop, safe checkpoints, config checks."""
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from torch import nn

from k3lab.data import batch_iterator
from k3lab.optim import build_optimizer
from k3lab.outputs import CausalLMOutput
from k3lab.train import TrainConfig, TrainingDiverged, fit, load_checkpoint

V, D, B, T = 64, 16, 4, 16
STREAM = torch.arange(4000) % 61  # a periodic stream: next token = token + 1 (mod 61), learnable


class TinyLM(nn.Module):
    """Embedding -> Linear mixer -> LayerNorm -> Linear head; pre-aligned labels, no shift."""

    def __init__(self, nan_at_call: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)  # a hidden matrix, so "muon" has something to orthogonalise
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V)
        self.nan_at_call, self.calls, self.after_steps = nan_at_call, 0, 0

    def forward(self, input_ids, labels=None, cache=None):
        logits = self.lm_head(self.norm(self.mix(self.embed(input_ids))))  # [B, T, V]
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            if self.training:
                self.calls += 1
                if self.calls == self.nan_at_call:
                    loss = loss * float("nan")
        return CausalLMOutput(loss=loss, logits=logits)

    def after_optimizer_step(self):
        self.after_steps += 1


def tiny_run(steps=20, stop_at=None, out_dir=None, resume_from=None, **kw):
    torch.manual_seed(0)
    model = TinyLM(kw.pop("nan_at_call", None))
    cfg = TrainConfig(steps=steps, lr=3e-2, warmup_steps=2, device="cpu", progress=False,
                      out_dir=None if out_dir is None else str(out_dir), **kw)
    result = fit(model, batch_iterator(STREAM, B, T, seed=1), cfg, resume_from=resume_from, stop_at=stop_at)
    return model, result


def test_loss_goes_down_and_hook_runs():
    val = batch_iterator(STREAM, B, T, seed=99)
    torch.manual_seed(0)
    model = TinyLM()
    cfg = TrainConfig(steps=40, lr=3e-2, warmup_steps=2, eval_every=20, eval_batches=2, device="cpu",
                      progress=False)
    result = fit(model, batch_iterator(STREAM, B, T, seed=1), cfg, val_batches=val)
    losses = [r["loss"] for r in result.history]
    assert len(losses) == 40 and result.step == 40 and model.after_steps == 40
    assert losses[-1] < 0.5 * losses[0]
    steps, val_losses = result.column("val_loss")
    assert steps == [20, 40] and val_losses[1] < val_losses[0]
    assert {"step", "loss", "lr", "grad_norm", "tokens", "elapsed"} <= set(result.history[0])
    assert result.history[-1]["tokens"] == 40 * B * T
    lrs = [r["lr"] for r in result.history]
    assert lrs[0] == pytest.approx(1.5e-2) and lrs[1] == pytest.approx(3e-2)  # warmup 2 steps
    assert lrs[-1] == pytest.approx(3e-3, rel=3e-2)                         # cosine to 0.1·lr


def test_bfloat16_autocast_runs():
    _, result = tiny_run(steps=3, dtype="bfloat16")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in result.history)


RESUME_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from test_train import tiny_run
model, result = tiny_run(steps=20, out_dir={out!r}, resume_from={out!r}, optimizer={opt!r})
print(json.dumps(dict(losses=[r["loss"] for r in result.history], steps_run=model.after_steps)))
"""


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_in_fresh_process_is_bitwise_identical(tmp_path, optimizer):
    _, full = tiny_run(steps=20, optimizer=optimizer)
    _, first = tiny_run(steps=20, stop_at=10, out_dir=tmp_path, optimizer=optimizer)
    assert first.step == 10 and first.checkpoint == tmp_path / "ckpt-00000010"
    script = RESUME_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path), opt=optimizer)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert resumed["steps_run"] == 10                              # it really resumed at step 10
    assert resumed["losses"] == [r["loss"] for r in full.history]  # exact float equality, 20 steps
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 21))


def k3_bf16_run(steps=6, stop_at=None, out_dir=None, resume_from=None, optimizer="adamw"):
    """The tiny preset cut to 2 layers (KDA + Gated MLA, LatentMoE, QK-Clip) with bf16 params + fp32 masters."""
    from k3lab.config import ModelConfig
    from k3lab.model import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.preset("tiny").replace(vocab_size=V, num_hidden_layers=2, full_attn_layers=[2]))
    cfg = TrainConfig(steps=steps, lr=1e-2, warmup_steps=1, device="cpu", progress=False, dtype="bfloat16",
                      param_dtype="bfloat16", optimizer=optimizer, out_dir=str(out_dir))
    return model, fit(model, batch_iterator(STREAM, B, T, seed=1), cfg, resume_from=resume_from, stop_at=stop_at)


K3_RESUME_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from test_train import k3_bf16_run
model, result = k3_bf16_run(steps=6, out_dir={out!r}, resume_from={out!r}, optimizer={opt!r})
print(json.dumps([r["loss"] for r in result.history]))
"""


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bf16_params_resume_in_fresh_process_is_bitwise_identical(tmp_path, optimizer):
    """param_dtype="bfloat16": 6 steps = 3 steps + resume (fresh process) + 3 steps, losses, bf16 weights,
    fp32 masters and optimizer state bit for bit (the masters travel in optimizer.safetensors)."""
    from safetensors.torch import load_file

    _, full = k3_bf16_run(out_dir=tmp_path / "full", optimizer=optimizer)
    _, first = k3_bf16_run(stop_at=3, out_dir=tmp_path / "half", optimizer=optimizer)
    assert first.step == 3 and "0.master" in load_file(str(first.checkpoint / "optimizer.safetensors"))
    script = K3_RESUME_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path / "half"), opt=optimizer)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [r["loss"] for r in full.history]
    for name in ("model.safetensors", "optimizer.safetensors"):
        want = load_file(str(tmp_path / "full" / "ckpt-00000006" / name))
        got = load_file(str(tmp_path / "half" / "ckpt-00000006" / name))
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), name
    assert {t.dtype for k, t in want.items() if k.endswith(".master")} == {torch.float32}


def test_resume_with_another_param_dtype_is_refused(tmp_path):
    tiny_run(steps=4, stop_at=2, out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"TrainConfig\.param_dtype='bfloat16': the checkpoint .* param_dtype='float32'"):
        tiny_run(steps=4, out_dir=tmp_path, resume_from=tmp_path, dtype="bfloat16", param_dtype="bfloat16")


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path):
    with pytest.raises(TrainingDiverged, match="non-finite loss .* at step 5") as err:
        tiny_run(steps=20, out_dir=tmp_path, checkpoint_every=2, nan_at_call=5)
    assert err.value.result.step == 4 and len(err.value.result.history) == 4
    assert (tmp_path / "latest").read_text() == "ckpt-00000004"
    assert "ckpt-00000004" in str(err.value)
    model = TinyLM()
    state = load_checkpoint(tmp_path, model)
    assert state["step"] == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_nan_stops_with_bf16_params():
    with pytest.raises(TrainingDiverged, match="non-finite loss .* at step 3"):
        tiny_run(steps=6, nan_at_call=3, dtype="bfloat16", param_dtype="bfloat16")


class Boom:
    """Unpickling this creates a marker file: proof that something unpickled it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_loading_never_unpickles(tmp_path):
    tiny_run(steps=4, stop_at=2, out_dir=tmp_path)
    ckpt = tmp_path / "ckpt-00000002"
    marker = tmp_path / "pwned"
    for name in ("optimizer.pt", "rng.pkl", "model.bin", "training_args.bin"):
        (ckpt / name).write_bytes(pickle.dumps(Boom(str(marker))))
    _, result = tiny_run(steps=4, out_dir=tmp_path, resume_from=tmp_path)  # stray pickles ignored
    assert result.step == 4 and not marker.exists()
    (ckpt / "model.safetensors").write_bytes(pickle.dumps(Boom(str(marker))))
    with pytest.raises(SafetensorError, match="deserializing header"):
        load_checkpoint(ckpt, TinyLM())  # a pickle in place of the weights is refused by the safetensors reader
    assert not marker.exists()


def test_adamw_groups_no_decay_on_norms_and_biases():
    model = TinyLM()
    opt = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1)
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decay_of[id(model.norm.weight)] == 0.0 and decay_of[id(model.norm.bias)] == 0.0
    assert decay_of[id(model.lm_head.bias)] == 0.0 and decay_of[id(model.mix.bias)] == 0.0
    assert decay_of[id(model.lm_head.weight)] == 0.1 and decay_of[id(model.embed.weight)] == 0.1
    assert len(decay_of) == len(list(model.parameters()))


@pytest.mark.parametrize("kwargs, field", [
    (dict(steps=0), "steps"),
    (dict(lr=-1.0), "lr"),
    (dict(optimizer="sgd"), "optimizer"),
    (dict(dtype="float16"), "dtype"),
    (dict(warmup_steps=500, steps=100), "warmup_steps"),
    (dict(betas=(0.9, 1.5)), "betas"),
    (dict(grad_clip=-1.0), "grad_clip"),
    (dict(device="tpu"), "device"),
    (dict(min_lr_ratio=2.0), "min_lr_ratio"),
    (dict(eval_every=-1), "eval_every"),
    (dict(param_dtype="float16"), "param_dtype"),
    (dict(param_dtype="bfloat16", dtype="float32"), "param_dtype"),
    (dict(fused_loss=1), "fused_loss"),
])
def test_bad_train_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field}="):
        TrainConfig(**kwargs)
