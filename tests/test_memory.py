"""What a training step keeps for backward (k3lab.memory): each recompute mode gives the same numbers as
"none" — bit for bit on CPU fp32 — while saving less; bad modes and impossible combinations are refused."""
import copy

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.memory import RECOMPUTE_MODES, apply_recompute, checkpoint_targets, decoder_layers, recompute_layer_indices
from k3lab.mixers.kda import KDA
from k3lab.model import K3ForCausalLM
from k3lab.moe.latent import LatentMoE
from k3lab.testing import saved_bytes
from k3lab.train import TrainConfig, fit


def tiny_model(**overrides):
    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.preset("tiny").replace(**overrides))


def batches(vocab, B=2, T=32):
    gen = torch.Generator().manual_seed(1)

    def batch(step):
        ids = torch.randint(0, vocab, (B, T + 1), generator=gen)
        return ids[:, :-1], ids[:, 1:]
    return batch


def test_sublayer_recompute_trains_bit_identically():
    """Two steps with every mixer, dense MLP and (inside each LatentMoE) the experts checkpointed: the same
    losses, weights and balancer state as saving everything — the router is not recomputed, so the
    balancer counts each token once (a checkpointed LatentMoE would count it twice)."""
    base = tiny_model()
    assert any(isinstance(m, LatentMoE) for m in base.modules())
    runs = {}
    for mode in ("none", "sublayer"):
        model = copy.deepcopy(base)
        cfg = TrainConfig(steps=2, lr=1e-2, warmup_steps=0, device="cpu", progress=False, recompute=mode)
        result = fit(model, batches(model.config.vocab_size), cfg)
        runs[mode] = ([r["loss"] for r in result.history], model.state_dict())
    assert runs["none"][0] == runs["sublayer"][0]
    for key, ref in runs["none"][1].items():
        assert torch.equal(ref, runs["sublayer"][1][key]), key


def test_sublayer_targets_keep_the_router_outside():
    model = tiny_model()
    apply_recompute(model, "sublayer")
    targets = checkpoint_targets(model)
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    assert all(m not in targets and m.experts in targets for m in moes)
    assert all(getattr(t.forward, "_k3lab_checkpointed", False) for t in targets)
    apply_recompute(model, "sublayer")  # idempotent: no checkpoint inside a checkpoint
    assert all(not hasattr(t.forward.__wrapped__, "_k3lab_checkpointed") for t in targets)


def test_attn_res_mix_recompute_exact_and_smaller():
    """AttnRes mixes recomputed in backward: bit-identical gradients, and the fp32 [S, B, T, D] stacks
    and normalised keys are no longer saved."""
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(3))
    grads, saved = {}, {}
    for recompute in (False, True):
        model = tiny_model(mlp_kind="dense", first_k_dense_replace=4)
        model.model.recompute_residual_mix = recompute
        params = list(model.parameters())
        out, seen = saved_bytes(lambda: model(ids[:, :-1], labels=ids[:, 1:]), exclude=params)
        out.loss.backward()
        grads[recompute] = [p.grad for p in params if p.grad is not None]
        D = model.config.hidden_size
        stacks = [b for b, dtype, shape in seen.values() if len(shape) == 4 and shape[1:] == (2, 47, D)]
        saved[recompute] = (sum(b for b, _, _ in seen.values()), sum(stacks))
    assert len(grads[True]) == len(grads[False]) > 0
    for ref, got in zip(grads[False], grads[True]):
        assert torch.equal(ref, got)
    (total_ref, stacks_ref), (total, stacks) = saved[False], saved[True]
    assert stacks_ref > 0 and stacks == 0, saved  # the [S, B, T, D] depth stacks
    assert total <= total_ref - stacks_ref, saved


def test_selective_needs_the_triton_kda_op():
    model = tiny_model(backend="torch")
    apply_recompute(model, "selective")
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="recompute='selective'.*backend='triton'"):
        model(ids, labels=ids)
    with torch.no_grad():  # inference never recomputes: allowed
        model(ids)


def _checkpointed(module) -> bool:
    return getattr(module.forward, "_k3lab_checkpointed", False)


def test_recompute_layer_indices_spread_over_depth():
    assert recompute_layer_indices(24, 12) == list(range(1, 24, 2))  # every second layer
    assert recompute_layer_indices(24, 8) == list(range(2, 24, 3))
    assert recompute_layer_indices(4, 1) == [3] and recompute_layer_indices(4, 0) == []
    assert recompute_layer_indices(4, None) == recompute_layer_indices(4, 4) == [0, 1, 2, 3]
    for L in (1, 5, 24, 61):
        for n in range(L + 1):
            picked = recompute_layer_indices(L, n)
            assert len(picked) == n and picked == sorted(set(picked)), (L, n)
    for bad in (-1, 5, 2.0):
        with pytest.raises(ValueError, match=r"TrainConfig.recompute_layers=.*\[0, 4\]"):
            recompute_layer_indices(4, bad)


def test_partial_recompute_checkpoints_the_chosen_layers_only():
    """"mixer" / "sublayer" with ``layers``: the chosen decoder layers' sublayers are checkpointed (their
    KDA op then needs no kernel recompute); every other KDA layer runs as "selective"."""
    for mode, layers in (("mixer", None), ("mixer", 2), ("sublayer", 1), ("sublayer", 3)):
        model = tiny_model()
        apply_recompute(model, mode, layers)
        found = decoder_layers(model)
        picked = set(recompute_layer_indices(len(found), layers))
        for i, layer in enumerate(found):
            mlp = getattr(layer, layer.mlp_name)
            parts = [mlp.experts, mlp.shared_experts] if isinstance(mlp, LatentMoE) else [mlp]
            assert _checkpointed(layer.self_attn) == (i in picked), (mode, layers, i)
            assert all(_checkpointed(p) == (mode == "sublayer" and i in picked) for p in parts if p is not None)
            if isinstance(layer.self_attn, KDA):
                assert layer.self_attn.kernel_recompute == (i not in picked), (mode, layers, i)
        assert model.model.recompute_residual_mix
        assert len(checkpoint_targets(model, mode, layers)) >= len(picked)


def test_partial_sublayer_recompute_trains_bit_identically():
    """Half of the layers checkpointed whole, the others "selective" (an all-MLA model with dense MLPs,
    so the CPU runs it: "selective" KDA needs the Triton op): the same losses and weights as "none"."""
    base = tiny_model(full_attn_layers=[1, 2, 3, 4], mlp_kind="dense", first_k_dense_replace=4)
    runs = {}
    for mode, layers in (("none", None), ("sublayer", 2), ("mixer", 3)):
        model = copy.deepcopy(base)
        cfg = TrainConfig(steps=2, lr=1e-2, warmup_steps=0, device="cpu", progress=False, recompute=mode,
                          recompute_layers=layers)
        result = fit(model, batches(model.config.vocab_size), cfg)
        assert sum(_checkpointed(layer.self_attn) for layer in decoder_layers(model)) == (layers or 0)
        runs[mode] = ([r["loss"] for r in result.history], model.state_dict())
    for mode in ("sublayer", "mixer"):
        assert runs["none"][0] == runs[mode][0], mode
        for key, ref in runs["none"][1].items():
            assert torch.equal(ref, runs[mode][1][key]), (mode, key)


def test_recompute_layers_needs_a_layered_mode():
    with pytest.raises(ValueError, match=r"TrainConfig.recompute_layers=4: needs TrainConfig.recompute in \('mixer', "):
        TrainConfig(recompute="selective", recompute_layers=4)
    with pytest.raises(ValueError, match="TrainConfig.recompute_layers=-1: must be None"):
        TrainConfig(recompute="sublayer", recompute_layers=-1)
    with pytest.raises(ValueError, match=r"TrainConfig.recompute_layers=9: must be None \(all\) or an int in \[0, 4\]"):
        apply_recompute(tiny_model(), "sublayer", 9)
    with pytest.raises(ValueError, match="TrainConfig.recompute_layers=2 needs recompute in"):
        apply_recompute(tiny_model(), "none", 2)


def test_bad_mode_named():
    assert RECOMPUTE_MODES == ("none", "selective", "mixer", "sublayer")
    with pytest.raises(ValueError, match="TrainConfig.recompute='all'"):
        TrainConfig(recompute="all")
    with pytest.raises(ValueError, match="recompute='all': allowed values"):
        apply_recompute(tiny_model(), "all")
