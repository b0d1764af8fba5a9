"""k3lab.precision: bf16 parameters with fp32 master weights (TrainConfig.param_dtype), and TrainConfig.fused_loss."""
import pytest
import torch
from torch import nn

from k3lab.config import ModelConfig
from k3lab.data import batch_iterator
from k3lab.model import K3ForCausalLM
from k3lab.optim import build_optimizer, set_lr
from k3lab.precision import (MASTER_FORMATS, MASTER_KEY, PARAM_DTYPES, MasterWeightOptimizer, cast_params_,
                             join_master, split_master)
from k3lab.testing import KERNELS_RUN_HERE
from k3lab.train import TrainConfig, fit

BF16 = torch.bfloat16
STREAM = torch.arange(4000) % 61  # next token = token + 1 (mod 61): learnable in a few steps


def bf16_linear(seed=0, shape=(8, 4)):
    torch.manual_seed(seed)
    model = nn.Linear(*shape)
    cast_params_(model, "bfloat16")
    return model


def backward(model, seed):
    x = torch.randn(5, model.in_features, generator=torch.Generator().manual_seed(seed)).to(BF16)
    (model(x).float() ** 2).mean().backward()


def small_k3(**changes):
    """The tiny preset cut to 2 layers (KDA + Gated MLA, dense then LatentMoE) and a 64-token vocab."""
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=64, num_hidden_layers=2, full_attn_layers=[2], **changes)
    return K3ForCausalLM(cfg)


def test_adamw_step_equals_hand_reference():
    """Three AdamW steps through the wrapper equal, bit for bit: w = fp32 copy; G = bf16 grad .float();
    torch.optim.AdamW on w; p = bf16(w)."""
    model = bf16_linear()
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = MasterWeightOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                                         weight_decay=0.1))
    for step in range(3):
        backward(model, seed=step)
        for w, p in zip(ref, model.parameters()):
            w.grad = p.grad.float()
        ref_opt.step()
        opt.grads_to_masters()
        assert all(p.grad is None for p in model.parameters())  # the bf16 grads are freed once copied
        opt.step()
        opt.zero_grad()
        for w, m, p in zip(ref, opt.masters, model.parameters()):
            assert m.dtype == torch.float32 and p.dtype == BF16
            assert torch.equal(m, w.detach()) and torch.equal(p, w.detach().to(BF16)), step


def test_masters_accumulate_updates_below_a_bf16_ulp():
    """lr·grad = 1e-3 against a weight of 1 is under half a bf16 ulp (2⁻⁸): plain bf16 never moves, the
    master does, and p = bf16(master) (within half an ulp of it) after every step."""
    plain = nn.Parameter(torch.ones(4, dtype=BF16))
    plain_opt = torch.optim.SGD([plain], lr=1e-3)
    model = nn.Module()
    model.w = nn.Parameter(torch.ones(4, dtype=BF16))
    opt = MasterWeightOptimizer(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    for _ in range(10):
        plain.sum().backward()
        plain_opt.step()
        plain_opt.zero_grad()
        model.w.sum().backward()
        opt.grads_to_masters()
        opt.step()
        opt.zero_grad()
        (master,) = opt.masters
        assert master.dtype == torch.float32 and torch.equal(model.w, master.to(BF16))
        assert ((model.w.float() - master).abs() <= master.abs() * 2.0 ** -8).all()
    assert torch.equal(plain, torch.ones(4, dtype=BF16))                       # every update rounded away
    assert torch.allclose(opt.masters[0], torch.full((4,), 0.99), atol=1e-6)   # 10 updates of 1e-3 kept
    assert torch.equal(model.w, torch.full((4,), 0.99).to(BF16)) and (model.w < 1).all()


def test_wraps_build_optimizer_groups_by_identity():
    """Muon's groups and per-parameter head counts survive the swap; set_lr reaches the masters' groups."""
    model = small_k3()
    cast_params_(model, "bfloat16")
    inner = build_optimizer(model, "muon", lr=1e-3)
    before = [[id(p) for p in g["params"]] for g in inner.param_groups]
    heads = [list(g["heads"]) if g["use_muon"] else None for g in inner.param_groups]
    opt = MasterWeightOptimizer(model, inner)
    by_id = {id(p): w for p, w in zip(opt.params, opt.masters)}
    for g, ids, h in zip(opt.param_groups, before, heads):
        assert [id(w) for w in g["params"]] == [id(by_id[i]) for i in ids]
        assert all(w.dtype == torch.float32 for w in g["params"])
        assert (list(g["heads"]) if g["use_muon"] else None) == h
    assert set_lr(opt, 0, 10, 2) == pytest.approx(5e-4)
    bias = model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and id(bias) not in by_id  # requires_grad=False: neither cast nor stepped
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {BF16}


def test_muon_bf16_params_loss_decreases():
    model = small_k3()
    cfg = TrainConfig(steps=10, lr=1e-2, warmup_steps=1, optimizer="muon", dtype="bfloat16", param_dtype="bfloat16",
                      device="cpu", progress=False)
    result = fit(model, batch_iterator(STREAM, 4, 16, seed=1), cfg)
    losses = [r["loss"] for r in result.history]
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < 0.7 * losses[0], losses
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {BF16}
    assert all(r["grad_norm"] > 0 for r in result.history)


def test_outside_updates_reach_the_masters():
    """An in-place change to a bf16 parameter after the step (QK-Clip's row scaling) is taken into the
    master where it changed the value; untouched elements keep their fp32 master."""
    model = bf16_linear()
    opt = MasterWeightOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    backward(model, 0)
    opt.grads_to_masters()
    opt.step()
    opt.zero_grad()
    master = opt.masters[0].clone()
    assert not torch.equal(master, model.weight.float())  # the master holds more bits than the bf16 weight
    with torch.no_grad():
        model.weight[0].mul_(0.5)  # as scale_rows_ does
    sd = opt.state_dict()          # syncs first: a checkpoint written now holds the clipped rows
    assert torch.equal(sd["state"][0][MASTER_KEY][0], model.weight[0].float())
    assert torch.equal(opt.masters[0][1:], master[1:])
    assert opt.sync_from_params() == 0  # nothing changed since


def test_state_dict_round_trip_and_refusals():
    model = bf16_linear()  # the unfused path (under TRITON_INTERPRET=1 the default would be the fused one)
    opt = MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=1e-2), fused=False)
    for step in range(2):
        backward(model, step)
        opt.grads_to_masters()
        opt.step()
        opt.zero_grad()
    fresh = bf16_linear(seed=1)
    fresh_opt = MasterWeightOptimizer(fresh, build_optimizer(fresh, "adamw", lr=1e-2), fused=False)
    fresh_opt.load_state_dict(opt.state_dict())
    for a, b in zip(opt.masters, fresh_opt.masters):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.state[fresh_opt.masters[0]]["exp_avg"].dtype == torch.float32
    assert all(MASTER_KEY not in s for s in fresh_opt.state.values())  # masters are not optimizer state
    plain = nn.Linear(8, 4)
    plain_sd = build_optimizer(plain, "adamw", lr=1e-2).state_dict()
    with pytest.raises(ValueError, match="no fp32 master.*param_dtype"):
        fresh_opt.load_state_dict(plain_sd)
    backward(fresh, 0)
    with pytest.raises(RuntimeError, match="grads_to_masters"):
        fresh_opt.step()  # bf16 grads not moved to the masters: refused, not silently ignored


def test_bad_values_name_the_field():
    assert PARAM_DTYPES == ("float32", "bfloat16")
    with pytest.raises(ValueError, match=r"TrainConfig\.param_dtype='float16': allowed values are \('float32', 'bfloat16'\)"):
        TrainConfig(param_dtype="float16")
    with pytest.raises(ValueError, match=r"TrainConfig\.param_dtype='bfloat16': needs TrainConfig\.dtype='bfloat16'.*"
                                         r"got TrainConfig\.dtype='float32'; allowed \(dtype, param_dtype\)"):
        TrainConfig(param_dtype="bfloat16", dtype="float32")
    with pytest.raises(ValueError, match=r"TrainConfig\.fused_loss='yes': must be a bool"):
        TrainConfig(fused_loss="yes")
    with pytest.raises(ValueError, match=r"TrainConfig\.param_dtype='bfloat16'.*no trainable floating parameter"):
        cast_params_(nn.Linear(2, 2).requires_grad_(False))
    model = bf16_linear()
    inner = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    backward(model, 0)
    inner.step()  # it has stepped the bf16 parameters: its momentum would belong to them, not to masters
    with pytest.raises(ValueError, match="before its first step"):
        MasterWeightOptimizer(model, inner)


def bits(x):
    """float32 -> its bit patterns as int64 in [0, 2³²) (NaNs compare too)."""
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def special_floats():
    """Random fp32 values of every size and sign, exact ties, and the edge cases of the split."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(-2**31, 2**31, (20000,), generator=gen, dtype=torch.int64)  # every bit pattern, NaNs too
    normal = torch.randn(5000, generator=gen) * torch.logspace(-30, 30, 5000)
    ties = ((normal.view(torch.int32) & ~0xFFFF) | 0x8000).view(torch.float32)  # low 16 bits exactly 0x8000
    edges = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), torch.finfo().max,
                          -torch.finfo().max, torch.finfo().tiny, 1e-45, -1e-45, 1e-40])
    patterns = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0xFFFF8000, 0x7F800001, 0x7FC08000, 0x7F7F8000,
                             0x80008000, 0x00008000, 0x3F808000, 0x3F818000], dtype=torch.int64)
    as_float = lambda b: (((b + 2**31) & 0xFFFFFFFF) - 2**31).to(torch.int32).view(torch.float32)  # noqa: E731
    return torch.cat([as_float(raw), normal, -normal, ties, -ties, edges, as_float(patterns)])


def test_split_master_round_trip_and_tie_rule():
    """join(split(x)) == x bit for bit (NaNs: a NaN); lo in int16; p == bf16(x) (round to nearest even) except
    where x's low 16 bits are exactly 0x8000, where p is the high half rounded away from zero, and at NaNs (both
    NaN); ±inf -> lo 0, ±max finite -> (±inf, -1), NaN -> the quiet NaN 0x7FC0, lo 0."""
    x = special_floats()
    p, lo = split_master(x)
    assert p.dtype == torch.bfloat16 and lo.dtype == torch.int16 and p.shape == lo.shape == x.shape
    w = join_master(p, lo)
    nan = torch.isnan(x)
    assert nan.sum() > 50 and torch.equal(bits(w)[~nan], bits(x)[~nan]) and torch.isnan(w[nan]).all()
    b = bits(x)
    p_bits = p.view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(p_bits[~nan], ((b + 0x8000) >> 16 & 0xFFFF)[~nan])  # the rule, on the uint32 bits
    assert (p_bits[nan] == 0x7FC0).all() and (lo[nan] == 0).all()
    tie = ((b & 0xFFFF) == 0x8000) & ~nan
    assert tie.sum() > 1000
    nearest_even = x.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(p.view(torch.int16)[~tie & ~nan], nearest_even[~tie & ~nan])
    assert torch.isnan(x[nan].to(torch.bfloat16)).all()  # both NaN (torch's vectorized cast makes 0xFFFF)
    assert torch.equal(p_bits[tie], (b[tie] >> 16) + 1)  # away from zero: the magnitude's high half + 1
    assert (p.view(torch.int16)[tie] != nearest_even[tie]).any()  # ... which nearest-even is not, at even halves
    inf, big = torch.isinf(x), x.abs() == torch.finfo().max
    assert torch.equal(p[inf].float(), x[inf]) and (lo[inf] == 0).all()
    assert torch.isinf(p[big]).all() and (lo[big] == -1).all()
    zeros = torch.zeros(3)  # a bf16 parameter's master: lo = 0
    assert torch.equal(split_master(zeros)[1], torch.zeros(3, dtype=torch.int16))
    with pytest.raises(ValueError, match="split_master: w must be a float32 tensor"):
        split_master(x.double())
    with pytest.raises(ValueError, match="join_master: p must be bfloat16 and lo int16 of one shape"):
        join_master(p, lo.int())


def test_master_format_refusals_name_the_field():
    """master_format: a value not in MASTER_FORMATS; "split" without the fused step (asked unfused, Muon, float32
    parameters; where no kernel runs, the CPU, its reference does) or without param_dtype="bfloat16" and AdamW in TrainConfig: ValueError naming it."""
    assert MASTER_FORMATS == ("float32", "split")
    model = bf16_linear()
    bogus = r"TrainConfig\.master_format='bogus': allowed values are \('float32', 'split'\)"
    with pytest.raises(ValueError, match=bogus):
        MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=1e-2), master_format="bogus")
    with pytest.raises(ValueError, match=r"TrainConfig\.master_format='split' needs the fused AdamW step .*"
                                         r"which does not run here: .+; use master_format='float32'"):
        MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=1e-2), fused=False, master_format="split")
    with pytest.raises(ValueError, match=r"TrainConfig\.master_format='split' needs the fused AdamW step .*"
                                         r"the wrapped optimizer is Muon"):
        MasterWeightOptimizer(model, build_optimizer(model, "muon", lr=1e-2), master_format="split")
    fp32 = nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"TrainConfig\.master_format='split' needs .*every parameter to be a bf16"):
        MasterWeightOptimizer(fp32, build_optimizer(fp32, "adamw", lr=1e-2), master_format="split")
    if not KERNELS_RUN_HERE:  # CPU without the interpreter: the fused step as its plain-PyTorch reference
        opt = MasterWeightOptimizer(model, build_optimizer(model, "adamw", lr=1e-2), master_format="split")
        assert opt.fused and not opt.kernel
    with pytest.raises(ValueError, match=bogus):
        TrainConfig(master_format="bogus")
    with pytest.raises(ValueError, match=r"TrainConfig\.master_format='split': 'split' needs TrainConfig\.param_dtype="
                                         r"'bfloat16' and optimizer='adamw'.*got param_dtype='float32'"):
        TrainConfig(dtype="bfloat16", master_format="split")
    with pytest.raises(ValueError, match=r"TrainConfig\.master_format='split':.*optimizer='muon'"):
        TrainConfig(dtype="bfloat16", param_dtype="bfloat16", optimizer="muon", master_format="split")
    cfg = TrainConfig(dtype="bfloat16", param_dtype="bfloat16", master_format="split", steps=1, warmup_steps=0,
                      device="cpu", progress=False)
    assert fit(small_k3(), batch_iterator(STREAM, 2, 8, seed=1), cfg).step == 1  # the kernel, or its reference


def test_fused_loss_switch():
    model = small_k3()
    assert model.fused_loss is False
    cfg = TrainConfig(steps=1, warmup_steps=0, fused_loss=True, device="cpu", progress=False)
    result = fit(model, batch_iterator(STREAM, 2, 8, seed=1), cfg)
    assert model.fused_loss is True and result.step == 1
    with pytest.raises(ValueError, match=r"TrainConfig\.fused_loss=True: Linear has no fused_loss attribute"):
        fit(nn.Linear(2, 2), batch_iterator(STREAM, 2, 8, seed=1), cfg)
