"""TrainConfig.profile (issue 37 item 4): one switch for the measured-best settings of the device."""
import argparse
import dataclasses

import pytest
import torch

from k3lab.cli import add_dataclass_flags
from k3lab.config import ModelConfig
from k3lab.data import batch_iterator
from k3lab.model import K3ForCausalLM
from k3lab.parallel.parallelize import ParallelOptions
from k3lab.train import FAST_CUDA, PROFILES, TrainConfig, fit, resolve_ep_plan, resolve_profile


def test_fast_on_cuda_fills_the_defaults_with_the_measured_best():
    cfg, chosen = resolve_profile(TrainConfig(profile="fast"), "cuda")
    assert {k: getattr(cfg, k) for k in FAST_CUDA} == FAST_CUDA
    assert len(chosen) == len(FAST_CUDA) and "cuda_graph=True" in chosen


def test_only_fields_left_at_their_defaults_are_filled_and_impossible_settings_are_left_out():
    cfg, chosen = resolve_profile(TrainConfig(profile="fast", recompute="selective", lr=1e-3), "cuda")
    assert cfg.recompute == "selective" and cfg.lr == 1e-3 and cfg.dtype == "bfloat16"
    muon, chosen = resolve_profile(TrainConfig(profile="fast", optimizer="muon"), "cuda")  # no fused AdamW step
    assert (muon.moment_dtype, muon.master_format, muon.param_dtype, muon.cuda_graph) == \
        ("float32", "float32", "bfloat16", False)
    assert not any(c.startswith(("moment_dtype", "master_format")) for c in chosen)
    sharded, chosen = resolve_profile(TrainConfig(profile="fast"), "cuda", world_size=8)  # FSDP alone: captured
    assert sharded.cuda_graph is True and "cuda_graph=True" in chosen
    for ep, cp in ((8, 1), (1, 2), (4, 2)):  # MoonEP and CP are not captured: the profile leaves graphs off
        split, chosen = resolve_profile(TrainConfig(profile="fast"), "cuda", 8, ep, cp)
        assert split.cuda_graph is False and split.compile == "sublayer" and not any("cuda_graph" in c for c in chosen)
        TrainConfig(**{f.name: getattr(split, f.name) for f in dataclasses.fields(TrainConfig)})  # a valid config


def test_fast_plans_moonep_on_the_device_only_where_that_was_measured_faster():
    """Fast, CUDA, EP above 1 with MoonEP, no CP, compiled, the plan left at its default: planned on the device, the
    shared expert on a side stream. Every other case keeps what it was given (the reference profile, a CPU, one rank,
    no EP, plain EP, EP with CP, eager)."""
    fast = resolve_profile(TrainConfig(profile="fast"), "cuda", 8, 8)[0]
    assert resolve_ep_plan(fast, ParallelOptions(ep=8), "cuda", 8) == (
        ParallelOptions(ep=8, ep_plan="device", shared_overlap=True), ["ep_plan='device'", "shared_overlap=True"])
    # a shared_overlap the run set keeps; so does a plan the run set (and with it the side stream)
    assert resolve_ep_plan(fast, ParallelOptions(ep=8, shared_overlap=True), "cuda", 8) == (
        ParallelOptions(ep=8, ep_plan="device", shared_overlap=True), ["ep_plan='device'"])
    assert resolve_ep_plan(fast, ParallelOptions(ep=8, ep_plan="device"), "cuda", 8) == (
        ParallelOptions(ep=8, ep_plan="device"), [])
    kept = [(fast, ParallelOptions(ep=8), "cpu", 8), (fast, ParallelOptions(ep=8), "cuda", 1),
            (fast, ParallelOptions(), "cuda", 8), (fast, ParallelOptions(ep=8, ep_kind="ep"), "cuda", 8),
            (fast, ParallelOptions(ep=4, cp=2), "cuda", 8),
            (dataclasses.replace(fast, compile="none"), ParallelOptions(ep=8), "cuda", 8),
            (TrainConfig(compile="sublayer"), ParallelOptions(ep=8), "cuda", 8), (fast, None, "cuda", 8)]
    for cfg, parallel, device, world in kept:
        assert resolve_ep_plan(cfg, parallel, device, world) == (parallel, []), (cfg.profile, parallel, device, world)


@pytest.mark.parametrize("device", ["cpu"])
def test_fast_changes_nothing_on_a_cpu_and_says_so(device, capsys):
    cfg = TrainConfig(profile="fast")
    assert resolve_profile(cfg, device) == (cfg, [])
    assert resolve_profile(TrainConfig(), "cuda") == (TrainConfig(), [])  # the reference profile: as given
    ids = torch.randint(0, 4096, (5000,), generator=torch.Generator().manual_seed(0))
    result = fit(K3ForCausalLM(ModelConfig.preset("tiny")), batch_iterator(ids, 2, 16),
                 dataclasses.replace(cfg, steps=2, progress=False, device="cpu"))
    assert len(result.history) == 2
    out = capsys.readouterr().out
    assert "profile fast: nothing changed (on cpu the reference settings are the fastest measured)" in out


def test_the_flag_and_its_choices():
    assert PROFILES == ("reference", "fast") and TrainConfig().profile == "reference"
    with pytest.raises(ValueError, match="profile='turbo': allowed values are"):
        TrainConfig(profile="turbo")
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, TrainConfig)
    assert parser.parse_args(["--profile", "fast"]).profile == "fast"
    with pytest.raises(SystemExit):
        parser.parse_args(["--profile", "turbo"])
