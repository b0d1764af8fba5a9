"""k3lab.parallel.checkpoint: DCP save at W=2 (FSDP2, gloo on CPU), exact resume at W=2, re-shard to
W=1 (no process group and a 1-rank group) and W=4, the atomic run-folder protocol, no stray unpickling.

The distributed scenario is one spawn of four fresh processes (to keep the file short on 2 cores),
in three phases: ranks 0-1, in their own 2-rank group, train 2 steps, save, and record step 3;
ranks 2-3, another 2-rank group of processes that never saw the run, resume it (W=2 -> 2); then
all four load it (2 -> 4). This process loads it alone (2 -> 1). The tests read the recorded
measurements. Model: ``K3ForCausalLM`` (tiny, 2 layers), ``fully_shard`` (explicit CPU mesh) on
every ``self_attn``, every MLP and the root, with the routers' ``e_score_correction_bias`` left out
(``ignored_params``: in torch 2.11 and 2.13) and set to non-zero values so that restoring it matters.
Optimizer: ``torch.optim.AdamW``.
"""
import json
import os
import pickle
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from k3lab.config import ModelConfig
from k3lab.model import K3ForCausalLM
from k3lab.moe.latent import LatentMoE
from k3lab.optim import build_optimizer
from k3lab.parallel.checkpoint import load_distributed, resolve_distributed_checkpoint, save_distributed
from k3lab.parallel.spawn import rank_context

B, T, LR = 4, 16, 1e-2
# two layers: KDA + dense MLP, then Gated MLA + LatentMoE
CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=2, full_attn_layers=[2], vocab_size=512)


# ----------------------------------------------------------------------------------------------
# helpers (module level: spawned workers import them)
# ----------------------------------------------------------------------------------------------
def build(shard: bool, set_bias: bool = False, group=None):
    """The same initial weights on every rank (seed 0); FSDP2-wrapped over ``group`` (None: all
    ranks) when ``shard``."""
    torch.manual_seed(0)
    model = K3ForCausalLM(CFG)
    routers = [m.gate for m in model.modules() if isinstance(m, LatentMoE)]
    if set_bias:
        with torch.no_grad():
            for i, r in enumerate(routers):
                bias = r.e_score_correction_bias
                bias.copy_(torch.linspace(-0.05, 0.05, bias.numel()) * (i + 1))
    if shard:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        # an explicit CPU mesh: fully_shard's default mesh is CUDA wherever a GPU is visible
        mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")
        ignored = {r.e_score_correction_bias for r in routers}
        for layer in model.model.layers:
            fully_shard(layer.self_attn, mesh=mesh, ignored_params=ignored)
            fully_shard(getattr(layer, layer.mlp_name), mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    return model, opt


def batch(step: int, rank: int = 0, world: int = 1):
    """Fixed global batch of ``step``; rank ``rank`` of ``world`` gets its equal share of rows."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    y = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    rows = slice(rank * B // world, (rank + 1) * B // world)
    return x[rows], y[rows]


def train_step(model, opt, step: int, rank: int = 0, world: int = 1, group=None) -> float:
    """One step; returns the mean of the ranks' losses (= the full-batch loss: equal shards, every
    label valid; FSDP2 averages the gradients over the ranks)."""
    x, y = batch(step, rank, world)
    out = model(x, labels=y)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = out.loss.detach().clone()
    if world > 1:
        dist.all_reduce(loss, group=group)
    return float(loss) / world


def full_state(model, opt) -> tuple[dict, list]:
    """Whole (unsharded) model + optimizer tensors, flat ``model/<fqn>``, ``optim/<fqn>/<name>``; param groups."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    flat = {f"model/{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, entries in osd["state"].items():
        flat.update({f"optim/{fqn}/{n}": v.detach().clone() for n, v in entries.items()})
    return flat, json.loads(json.dumps(osd["param_groups"]))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def phase_train_save(rank, world, group, tmp):
    """W=2: steps 1-2, save, probe the RNG, step 3 (L3 and the weights after it)."""
    model, opt = build(shard=True, set_bias=True, group=group)
    losses = [train_step(model, opt, s, rank, world, group) for s in range(2)]
    t0 = time.perf_counter()
    path = save_distributed(tmp / "run", 2, model, opt, dict(step=2, history=losses, note="w2"), group=group)
    save_s = time.perf_counter() - t0
    probe = torch.rand(4).tolist()  # the generator right after the save
    (tmp / f"probe-{rank}.json").write_text(json.dumps(probe))
    full2, groups2 = full_state(model, opt)
    loss3 = train_step(model, opt, 2, rank, world, group)
    full3, _ = full_state(model, opt)
    # a plain (non-DTensor) tensor that differs across ranks is refused on every rank, before any file
    bias = next(m.gate.e_score_correction_bias for m in model.modules() if isinstance(m, LatentMoE))
    with torch.no_grad():
        bias.add_(rank)
    try:
        save_distributed(tmp / "bad", 3, model, opt, dict(step=3), group=group)
        refused = None
    except ValueError as err:
        refused = str(err)
    (tmp / f"refused-{rank}.json").write_text(json.dumps(refused))
    if rank == 0:
        save_file(full2, str(tmp / "full2.safetensors"))
        save_file(full3, str(tmp / "full3.safetensors"))
        (tmp / "train.json").write_text(json.dumps(dict(losses=losses, loss3=loss3, path=str(path),
                                                        groups2=groups2, save_s=save_s)))


def phase_load(rank, world, group, tmp):
    """Fresh model at this world size: load latest, compare with the saved state, do step 3."""
    model, opt = build(shard=True, group=group)
    t0 = time.perf_counter()
    extra = load_distributed(tmp / "run", model, opt, group=group)
    load_s = time.perf_counter() - t0
    probe = torch.rand(4).tolist()
    loaded, groups = full_state(model, opt)
    loss3 = train_step(model, opt, 2, rank, world, group)
    after, _ = full_state(model, opt)
    saved_probe = json.loads((tmp / f"probe-{rank}.json").read_text()) if rank < 2 else None
    res = dict(extra=extra, probe_equal=probe == saved_probe, loss3=loss3, load_s=load_s, groups=groups,
               loaded_diff=max_diff(loaded, load_file(str(tmp / "full2.safetensors"))),
               after_diff=max_diff(after, load_file(str(tmp / "full3.safetensors"))))
    (tmp / f"load-w{world}-rank{rank}.json").write_text(json.dumps(res))


def run_scenario(rank: int, tmp: str) -> None:
    """Four fresh processes, three phases: ranks 0-1 (their own 2-rank group) train and save;
    ranks 2-3 (another 2-rank group: processes that never saw the run) resume it; all four load it."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # FSDP2's "returned a view tensor" notes
    tmp = Path(tmp)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=4,
                            timeout=timedelta(seconds=60))
    try:
        savers, resumers = dist.new_group([0, 1]), dist.new_group([2, 3])
        if rank < 2:
            phase_train_save(rank, 2, savers, tmp)
        dist.barrier()
        if rank >= 2:
            phase_load(rank - 2, 2, resumers, tmp)
        dist.barrier()
        phase_load(rank, 4, None, tmp)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    t0 = time.perf_counter()
    method = rank_context().get_start_method()  # ranks forked from a server that imported torch and k3lab once
    mp.start_processes(run_scenario, args=(str(tmp),), nprocs=4, join=True, start_method=method)
    print(f"scenario: {time.perf_counter() - t0:.1f} s")
    train = json.loads((tmp / "train.json").read_text())
    return dict(tmp=tmp, train=train,
                w2=[json.loads((tmp / f"load-w2-rank{r}.json").read_text()) for r in range(2)],
                w4=[json.loads((tmp / f"load-w4-rank{r}.json").read_text()) for r in range(4)])


# ----------------------------------------------------------------------------------------------
# the scenario's checks
# ----------------------------------------------------------------------------------------------
def test_saved_folder_layout(scenario):
    run = scenario["tmp"] / "run"
    ckpt = run / "ckpt-00000002"
    assert scenario["train"]["path"] == str(ckpt) and (run / "latest").read_text() == "ckpt-00000002"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "rng-rank0.json", "rng-rank1.json",
                     "state.json"]
    assert not list(run.glob(".tmp-ckpt-*"))
    state = json.loads((ckpt / "state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 2 and state["extra"]["note"] == "w2"
    assert state["model_config"]["hidden_size"] == CFG.hidden_size
    rng = json.loads((ckpt / "rng-rank1.json").read_text())
    assert rng["rank"] == 1 and len(rng["torch_cpu"]) > 100 and all(0 <= v < 256 for v in rng["torch_cpu"])


def test_rank_divergent_plain_tensor_refused(scenario):
    """A router bias (ignored by FSDP, so a plain tensor) made to differ between the ranks: DCP would
    keep one rank's copy, so the save is refused on both ranks and writes nothing."""
    tmp = scenario["tmp"]
    for r in range(2):
        refused = json.loads((tmp / f"refused-{r}.json").read_text())
        assert refused is not None and "differ across ranks" in refused and "e_score_correction_bias" in refused
    assert not (tmp / "bad").exists()


def test_resume_same_world_size_is_exact(scenario):
    """(a) new W=2 processes: the loaded state equals the saved one bit for bit, RNG restored per
    rank, and step 3 gives the same loss and weights as the uninterrupted run."""
    for r, res in enumerate(scenario["w2"]):
        assert res["extra"]["rng_restored"] is True and res["probe_equal"], r
        assert res["extra"]["step"] == 2 and res["extra"]["history"] == scenario["train"]["losses"]
        assert res["loaded_diff"] == 0.0
        assert res["groups"] == scenario["train"]["groups2"]
        assert res["loss3"] == scenario["train"]["loss3"]
        assert res["after_diff"] <= 1e-6, res["after_diff"]


def test_reshard_to_four_ranks(scenario):
    """(c) W=4 loads a W=2 checkpoint: every weight and optimizer tensor equals the saved one
    exactly; RNG is not restored (and says so); step 3's mean loss matches L3."""
    for r, res in enumerate(scenario["w4"]):
        assert res["loaded_diff"] == 0.0, r
        assert res["extra"]["rng_restored"] is False and "world size 2, loading at 4" in res["extra"]["warnings"][0]
        assert res["extra"]["world_size_saved"] == 2
        assert abs(res["loss3"] - scenario["train"]["loss3"]) <= 1e-5


@pytest.mark.parametrize("mode", ["no_process_group", "one_rank_group"])
def test_reshard_to_one_plain_process(scenario, tmp_path, mode):
    """(b) one process, plain (unwrapped) model: loads the W=2 checkpoint (no process group at all,
    and in a 1-rank gloo group); weights equal the saved ones exactly; the full-batch step-3 loss
    is within 1e-5 of the W=2 mean loss."""
    tmp = scenario["tmp"]
    if mode == "one_rank_group":
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
    try:
        model, opt = build(shard=False)
        extra = load_distributed(tmp / "run", model, opt)
        loaded, groups = full_state(model, opt)
        loss3 = train_step(model, opt, 2)
        after, _ = full_state(model, opt)
    finally:
        if mode == "one_rank_group":
            dist.destroy_process_group()
    assert extra["rng_restored"] is False and extra["world_size_saved"] == 2
    assert max_diff(loaded, load_file(str(tmp / "full2.safetensors"))) == 0.0
    assert groups == scenario["train"]["groups2"]
    assert abs(loss3 - scenario["train"]["loss3"]) <= 1e-5
    assert max_diff(after, load_file(str(tmp / "full3.safetensors"))) <= 1e-4  # grads summed in another order


# ----------------------------------------------------------------------------------------------
# the run-folder protocol, in this process (no process group, plain model)
# ----------------------------------------------------------------------------------------------
def small():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_latest_keep_and_crash_leftover(tmp_path):
    model, opt = small()
    for step in (1, 2):
        save_distributed(tmp_path, step, model, opt, dict(step=step))
    assert (tmp_path / "latest").read_text() == "ckpt-00000002"
    assert resolve_distributed_checkpoint(tmp_path) == tmp_path / "ckpt-00000002"
    save_distributed(tmp_path, 3, model, opt, dict(step=3), keep=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-00000002", "ckpt-00000003"]
    # a save of step 4 that crashed before its rename: a half-written temporary folder
    crashed = tmp_path / ".tmp-ckpt-4"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"partial")
    assert load_distributed(tmp_path, small()[0], None)["step"] == 3
    save_distributed(tmp_path, 5, model, opt, dict(step=5), keep=1)  # a later save cleans it up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000005", "latest"]


def test_save_before_first_step_leaves_optimizer_alone(tmp_path):
    """get_state_dict would build an empty optimizer's state with a zero step (step count 1): a save
    at step 0 must not change the live optimizer, and the load leaves the optimizer without state."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    save_distributed(tmp_path, 0, model, opt, dict(step=0))
    assert not opt.state and all(p.grad is None for p in model.parameters())
    fresh = torch.nn.Linear(4, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_opt.state[fresh.weight]["step"] = torch.tensor(5.0)
    assert load_distributed(tmp_path, fresh, fresh_opt)["step"] == 0
    assert not fresh_opt.state and torch.equal(fresh.weight, model.weight)


def test_round_trip_muon_and_nonjson_refused(tmp_path):
    """MuonAdamW (param groups with lists, strings, bools; tensor and momentum state) round-trips;
    extra must be JSON data."""
    model, _ = small()
    opt = build_optimizer(model, "muon", lr=1e-2)
    model(torch.randn(3, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    save_distributed(tmp_path, 1, model, opt, dict(step=1, tokens=96))
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    fresh_opt = build_optimizer(fresh, "muon", lr=5e-3)
    extra = load_distributed(tmp_path, fresh, fresh_opt)
    assert extra["tokens"] == 96 and extra["rng_restored"] is True
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i in want["state"]:
        assert want["state"][i].keys() == got["state"][i].keys()
        assert all(torch.equal(want["state"][i][k], got["state"][i][k]) for k in want["state"][i])
    with pytest.raises(TypeError, match=r"extra = .* is not plain data"):
        save_distributed(tmp_path, 2, model, opt, dict(step=2, when=object()))
    assert not (tmp_path / ".tmp-ckpt-2").exists()


class Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_tampered_metadata_never_unpickled(tmp_path):
    model, opt = small()
    path = save_distributed(tmp_path, 1, model, opt, dict(step=1))
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(Boom(str(marker))))
    with pytest.raises(ValueError, match=r"\.metadata: references \w+\.open, which a DCP index does not hold"):
        load_distributed(tmp_path, small()[0], None)
    assert not marker.exists()


def test_unsafe_latest_refused(tmp_path):
    model, opt = small()
    save_distributed(tmp_path / "elsewhere", 1, model, opt, dict(step=1))
    run = tmp_path / "run"
    save_distributed(run, 1, model, opt, dict(step=1))
    for value in (str(tmp_path / "elsewhere" / "ckpt-00000001"), "../elsewhere/ckpt-00000001"):
        (run / "latest").write_text(value)
        with pytest.raises(ValueError, match="latest: value"):
            load_distributed(run, model, opt)
    os.symlink(tmp_path / "elsewhere" / "ckpt-00000001", run / "ckpt-00000009")
    (run / "latest").write_text("ckpt-00000009")
    with pytest.raises(ValueError, match="outside the run folder"):
        resolve_distributed_checkpoint(run)


def test_mismatched_model_named(tmp_path):
    model, opt = small()
    save_distributed(tmp_path, 1, model, opt, dict(step=1))
    other = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"state\.json: the checkpoint does not match"):
        load_distributed(tmp_path, other, None)
