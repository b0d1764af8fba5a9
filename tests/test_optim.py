"""Muon (Newton–Schulz, Per-Head Muon), AdamW groups, the cosine schedule and QK-Clip (docs/k3_reference.md §11)."""
import math

import pytest
import torch
from torch import nn

from k3lab.optim import (MuonAdamW, build_optimizer, cosine_lr, muon_direction, newton_schulz5, param_groups,
                         qk_clip_, set_lr)
from k3lab.config import ModelConfig
from k3lab.moe.latent import LatentMoE
from k3lab.testing import assert_close

FP32 = 1e-5


# ---------------------------------------------------------------------------------------------- Newton–Schulz
@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (48, 96)], ids=["wide", "tall", "2to1"])
def test_newton_schulz5_singular_values_near_one(shape):
    """NS5 is tuned for speed, not convergence: singular values land in ~[0.68, 1.14], not exactly 1."""
    torch.manual_seed(0)
    G = torch.randn(*shape)
    s = torch.linalg.svdvals(newton_schulz5(G).float())
    assert s.min().item() > 0.6 and s.max().item() < 1.2, (s.min().item(), s.max().item())
    # same singular vectors as the polar factor U Vᵀ of G
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    cos = (newton_schulz5(G).float() * (U @ Vh)).sum() / (U @ Vh).norm() / newton_schulz5(G).float().norm()
    assert cos.item() > 0.98


def test_newton_schulz5_leaves_tiny_singular_values_small():
    """What is true for a square Gaussian: σ/‖G‖_F below ~1e-3 are not lifted to 1 in 5 steps."""
    torch.manual_seed(0)
    G = torch.randn(64, 64)
    s_in = torch.linalg.svdvals(G) / G.norm()
    s_out = torch.linalg.svdvals(newton_schulz5(G).float())
    assert s_out.max().item() < 1.2
    assert s_out[s_in > 5e-3].min().item() > 0.6
    assert s_out.min().item() < 0.6  # the smallest directions stay under-amplified


def test_muon_direction_scale_and_per_head_blocks():
    torch.manual_seed(0)
    H, R, C = 4, 16, 64
    M = torch.randn(H * R, C) * torch.tensor([1.0, 10.0, 100.0, 0.1]).repeat_interleave(R)[:, None]
    per_head = muon_direction(M, heads=H)
    for h in range(H):  # each head's block is orthogonalised on its own, with its own shape's scale
        block = per_head[h * R:(h + 1) * R]
        assert_close(f"head {h}", muon_direction(M[h * R:(h + 1) * R]), block, FP32)
        s = torch.linalg.svdvals(block / (0.2 * math.sqrt(max(R, C))))
        assert s.min() > 0.6 and s.max() < 1.2
    # so the update RMS is the same for every head, whatever its gradient scale
    rms = per_head.view(H, R, C).pow(2).mean((1, 2)).sqrt()
    assert (rms / rms.mean() - 1).abs().max() < 0.1
    full = muon_direction(M)
    full_rms = full.view(H, R, C).pow(2).mean((1, 2)).sqrt()
    assert full_rms.max() / full_rms.min() > 2  # the whole-matrix NS does not balance the heads


def test_muon_direction_batched_experts_equal_one_by_one():
    torch.manual_seed(0)
    W = torch.randn(3, 24, 16)
    batched = muon_direction(W)
    for e in range(3):
        assert_close(f"expert {e}", muon_direction(W[e]), batched[e], FP32)
    with pytest.raises(ValueError, match="heads"):
        muon_direction(W, heads=2)


# ---------------------------------------------------------------------------------------------- groups, optimizer
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 16)
        self.attn = nn.Module()
        self.attn.q_proj = nn.Linear(16, 16, bias=False)
        self.attn.muon_head_splits = {"q_proj": 4}
        self.conv = nn.Conv1d(16, 16, 4, groups=16, padding=3, bias=False)
        self.norm = nn.RMSNorm(16)
        self.experts = nn.Parameter(torch.randn(2, 8, 16) * 0.02)
        self.bias = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.lm_head = nn.Linear(16, 32, bias=True)

    def forward(self, ids):
        h = self.embed_tokens(ids)                                   # [B, T, D]
        h = h + self.conv(h.transpose(1, 2))[..., : h.shape[1]].transpose(1, 2)
        h = self.norm(self.attn.q_proj(h))
        h = h + torch.einsum("btd,eid,eid->btd", h, self.experts, self.experts)
        return self.lm_head(h)


def test_param_groups_rule():
    g = {k: sorted(n for n, _ in v) for k, v in param_groups(TinyLM()).items()}
    assert g == {"muon": ["attn.q_proj.weight", "experts"],
                 "adamw_decay": ["embed_tokens.weight", "lm_head.weight"],
                 "adamw_no_decay": ["conv.weight", "lm_head.bias", "norm.weight"]}


def test_k3_model_groups_and_head_splits():
    from k3lab.config import ModelConfig
    from k3lab.model import K3ForCausalLM

    cfg = ModelConfig.preset("tiny")
    model = K3ForCausalLM(cfg)
    g = {k: {n for n, _ in v} for k, v in param_groups(model).items()}
    assert "model.embed_tokens.weight" in g["adamw_decay"] and "lm_head.weight" in g["adamw_decay"]
    assert not any(n.endswith("e_score_correction_bias") for v in g.values() for n in v)
    assert all(not n.endswith(("norm.weight", "res_proj.weight", "A_log", "dt_bias")) for n in g["muon"] | g["adamw_decay"])
    assert any(n.endswith("experts.w1") for n in g["muon"]) and any(n.endswith("gate.weight") for n in g["muon"])
    opt = build_optimizer(model, name="muon", lr=1e-3)
    named = {id(p): n for n, p in model.named_parameters()}
    heads = {named[id(p)]: h for grp in opt.param_groups if grp["use_muon"] for p, h in zip(grp["params"], grp["heads"])}
    mla, kda = cfg.full_attn_layers[0] - 1, 0
    assert heads[f"model.layers.{mla}.self_attn.q_b_proj.weight"] == cfg.num_attention_heads
    assert heads[f"model.layers.{mla}.self_attn.kv_b_proj.weight"] == cfg.num_attention_heads
    assert heads[f"model.layers.{kda}.self_attn.v_proj.weight"] == cfg.kda_heads
    assert heads[f"model.layers.{kda}.self_attn.o_proj.weight"] == 1


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_trains_and_state_dict_roundtrips(name):
    torch.manual_seed(0)
    model = TinyLM()
    opt = build_optimizer(model, name=name, lr=1e-2)
    ids = torch.randint(0, 32, (4, 8))
    losses = []
    for _ in range(20):
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert all(g["initial_lr"] == 1e-2 for g in opt.param_groups)
    fresh = build_optimizer(model, name=name, lr=1e-2)
    fresh.load_state_dict(opt.state_dict())
    assert len(fresh.state) == len(opt.state)
    if name == "muon":
        assert isinstance(opt, MuonAdamW)
        heads = {id(p): h for g in opt.param_groups if g["use_muon"] for p, h in zip(g["params"], g["heads"])}
        assert heads[id(model.attn.q_proj.weight)] == 4 and heads[id(model.experts)] == 1


def test_muon_step_equals_its_equation():
    """W ← W(1 − ηλ) − η·0.2·sqrt(max(n,m))·NS5(U), U = (1−β)G + βM, M = (1−β)G after the first step."""
    torch.manual_seed(0)
    lin = nn.Linear(12, 20, bias=False)
    W0 = lin.weight.detach().clone()
    opt = build_optimizer(lin, name="muon", lr=0.1, weight_decay=0.1, momentum=0.9)
    lin.weight.grad = torch.randn(20, 12)
    G = lin.weight.grad.clone()
    opt.step()
    U = 0.1 * G + 0.9 * (0.1 * G)
    ref = W0 * (1 - 0.1 * 0.1) - 0.1 * 0.2 * math.sqrt(20) * newton_schulz5(U).float()
    assert_close("muon step", ref, lin.weight.detach(), 1e-3)  # bf16 NS


def test_cosine_lr_schedule():
    assert cosine_lr(0, 100, 10, 1.0) == pytest.approx(0.1)
    assert cosine_lr(9, 100, 10, 1.0) == pytest.approx(1.0)
    assert cosine_lr(55, 100, 10, 1.0) == pytest.approx(0.55)
    assert cosine_lr(100, 100, 10, 1.0, min_ratio=0.1) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="warmup_steps"):
        cosine_lr(0, 10, 20, 1.0)
    opt = build_optimizer(TinyLM(), name="muon", lr=2e-3, muon_lr=2e-2)
    set_lr(opt, 100, 100, 1)
    assert sorted(g["lr"] for g in opt.param_groups) == pytest.approx([2e-4, 2e-4, 2e-3])


def test_build_optimizer_bad_name():
    with pytest.raises(ValueError, match="adamw"):
        build_optimizer(TinyLM(), name="sgd")


# ---------------------------------------------------------------------------------------------- QK-Clip
class MLAStandIn(nn.Module):
    """The attributes QK-Clip reads from GatedMLA, and the logits they produce (NoPE MLA, docs/k3_reference.md §3)."""

    def __init__(self, H=3, dn=8, dr=4, dv=8, q_lora=12, kv_lora=10):
        super().__init__()
        self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = H, dn, dr, dv
        self.q_b_proj = nn.Linear(q_lora, H * (dn + dr), bias=False)
        self.kv_b_proj = nn.Linear(kv_lora, H * (dn + dv), bias=False)
        self.register_buffer("max_logit", torch.zeros(H))

    def logits(self, c_q, c_kv, k_rope):
        """c_q [N, q_lora], c_kv [N, kv_lora], k_rope [N, dr] -> [H, N, N]; updates max_logit."""
        H, dn, dr = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        q = self.q_b_proj(c_q).view(-1, H, dn + dr)                             # [N, H, dn+dr]
        k_nope = self.kv_b_proj(c_kv).view(-1, H, dn + self.v_head_dim)[..., :dn]  # [N, H, dn]
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, H, -1)], -1)         # [N, H, dn+dr]
        s = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(dn + dr)
        self.max_logit = s.flatten(1).max(1).values.detach()
        return s


def test_qk_clip_caps_max_logit_at_tau():
    torch.manual_seed(0)
    mla = MLAStandIn()
    with torch.no_grad():
        mla.q_b_proj.weight.view(3, 12, -1)[0] *= 30.0  # head 0 explodes
        mla.q_b_proj.weight.view(3, 12, -1)[2] *= 15.0
    c_q, c_kv, k_rope = torch.randn(16, 12), torch.randn(16, 10), torch.randn(16, 4) * 3
    before = mla.logits(c_q, c_kv, k_rope).flatten(1).max(1).values
    tau = 20.0
    assert before[0] > tau and before[1] < tau
    v_before = mla.kv_b_proj.weight.view(3, 16, -1)[:, 8:].clone()
    gamma = qk_clip_(mla, tau=tau)
    after = mla.logits(c_q, c_kv, k_rope).flatten(1).max(1).values
    for h in range(3):
        if before[h] > tau:
            assert after[h].item() == pytest.approx(tau, rel=1e-4)
            assert gamma[h].item() == pytest.approx(tau / before[h].item(), rel=1e-6)
        else:
            assert after[h].item() == pytest.approx(before[h].item(), rel=1e-6) and gamma[h] == 1
    assert torch.equal(mla.kv_b_proj.weight.view(3, 16, -1)[:, 8:], v_before)  # values untouched


def test_qk_clip_on_gated_mla():
    from k3lab.config import ModelConfig
    from k3lab.mixers.mla import GatedMLA

    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny")
    mla = GatedMLA(cfg, layer_idx=cfg.full_attn_layers[0] - 1).train()
    with torch.no_grad():
        mla.q_b_proj.weight.mul_(40.0)
        mla.kv_b_proj.weight.mul_(10.0)
    x = torch.randn(2, 12, cfg.hidden_size)
    mla(x)
    before = mla.max_logit.clone()
    tau = float(before.min()) * 0.5
    qk_clip_(mla, tau=tau)
    mla(x)
    assert_close("clipped max logit", torch.full_like(before, tau), mla.max_logit, 1e-4)


def test_one_expert_slice_is_still_a_muon_matrix():
    """An expert-parallel slice holding one expert, w1 [1, I, L], is a stack of one matrix: Muon, as in one
    process (it went to AdamW without decay, so `--ep 8` on tiny's 8 experts trained differently from one GPU)."""
    moe = LatentMoE(ModelConfig.preset("tiny"))
    for name in ("w1", "w3", "w2"):
        setattr(moe.experts, name, torch.nn.Parameter(getattr(moe.experts, name).detach()[:1].clone()))
    groups = {g: [n for n, _ in ps] for g, ps in param_groups(moe).items()}
    assert {"experts.w1", "experts.w3", "experts.w2"} <= set(groups["muon"]), groups
