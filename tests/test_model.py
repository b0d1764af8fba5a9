"""The K3 model (docs/k3_reference.md §1, §10): parameter count on the meta device, names, schedule, forward and
backward, cached decoding == full forward, prefix split, MTP, generation."""

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.infer import generate, sample_next
from k3lab.mixers.kda import KDA
from k3lab.mixers.mla import GatedMLA
from k3lab.model import K3ForCausalLM, K3Model
from k3lab.moe.latent import LatentMoE
from k3lab.moe.situ import SiTUMLP
from k3lab.testing import assert_close

FP32_TOL = 1e-5
FP64_TOL = 1e-10


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())  # tied weights count once


def tiny(**kw) -> ModelConfig:
    return ModelConfig.preset("tiny").replace(**kw)


def randomize_attn_res(model):
    """Move the pseudo-queries off zero so depth mixing is not uniform (a stronger check)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0, 0.5)


def test_k3_meta_param_count_equals_config():
    """The published K3 config built on the meta device (with and without its MTP head)."""
    cfg = ModelConfig.preset("k3").replace(num_nextn_predict_layers=1)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    counts = cfg.param_counts()
    assert n_params(model) == counts["total"]
    assert n_params(model) - n_params(model.mtp) == ModelConfig.preset("k3").param_counts()["total"]
    assert n_params(model.mtp) == counts["by_component"]["mtp"]["total"]
    assert n_params(model.model) == counts["total"] - counts["by_component"]["lm_head"]["total"] - n_params(model.mtp)
    assert model.model.layers[3].self_attn.kv_b_proj.weight.shape == (96 * 256, 512)


@pytest.mark.parametrize("kw", [dict(), dict(residual="prenorm"), dict(mlp_kind="dense"), dict(mlp_kind="moe"),
                                dict(tie_word_embeddings=True), dict(mla_use_output_gate=False),
                                dict(num_nextn_predict_layers=1, first_k_dense_replace=4)],
                         ids=["k3-tiny", "prenorm", "dense", "moe", "tied", "no-gate", "mtp-dense"])
def test_tiny_param_count_equals_config(kw):
    cfg = tiny(**kw)
    assert n_params(K3ForCausalLM(cfg)) == cfg.param_counts()["total"]


def test_schedule_and_names():
    cfg = tiny(num_hidden_layers=8, full_attn_layers=[4, 8], first_k_dense_replace=1)
    model = K3ForCausalLM(cfg)
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.self_attn, GatedMLA if i in (3, 7) else KDA)
        assert isinstance(getattr(layer, "mlp" if i == 0 else "block_sparse_moe"), SiTUMLP if i == 0 else LatentMoE)
    D = cfg.hidden_size
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for key, shape in {
        "model.embed_tokens.weight": (cfg.vocab_size, D), "lm_head.weight": (cfg.vocab_size, D),
        "model.norm.weight": (D,), "model.output_attn_res_norm.weight": (D,), "model.output_attn_res_proj.weight": (1, D),
        "model.layers.0.input_layernorm.weight": (D,), "model.layers.0.post_attention_layernorm.weight": (D,),
        "model.layers.0.self_attention_res_norm.weight": (D,), "model.layers.0.self_attention_res_proj.weight": (1, D),
        "model.layers.0.mlp_res_norm.weight": (D,), "model.layers.0.mlp_res_proj.weight": (1, D),
        "model.layers.0.mlp.gate_proj.weight": (cfg.intermediate_size, D),
        "model.layers.0.self_attn.q_proj.weight": (cfg.kda_heads * cfg.kda_head_dim, D),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D),
        "model.layers.3.block_sparse_moe.gate.weight": (cfg.n_routed_experts, D),
    }.items():
        assert shapes[key] == shape, key
    prenorm = {k for k in K3ForCausalLM(tiny(residual="prenorm")).state_dict() if "res_" in k}
    assert prenorm == set()


def test_init():
    cfg = tiny(initializer_range=0.02)
    model = K3ForCausalLM(cfg)
    for name, p in model.named_parameters():
        if name.endswith("res_proj.weight"):
            assert torch.count_nonzero(p) == 0, name
    w = model.model.embed_tokens.weight
    assert abs(w.std().item() - 0.02) < 2e-3 and abs(w.mean().item()) < 1e-3


def test_forward_backward():
    torch.manual_seed(0)
    cfg = tiny()
    model = K3ForCausalLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 24))
    labels = x.roll(-1, 1)
    labels[:, -1] = -100
    out = model(x, labels=labels)
    assert out.logits.shape == (2, 24, cfg.vocab_size)
    assert abs(out.loss.item() - torch.log(torch.tensor(cfg.vocab_size)).item()) < 0.1  # ~uniform at init
    out.loss.backward()
    unused = {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name in unused:  # layer 0's attention input is the embedding itself (docs/k3_reference.md §1.1)
            assert p.grad is None, name
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    model.after_optimizer_step()


@pytest.mark.parametrize("kw,dtype,tol", [
    (dict(), torch.float32, FP32_TOL),
    (dict(mla_use_nope=False, num_hidden_layers=4, full_attn_layers=[2, 4]), torch.float32, FP32_TOL),
    (dict(residual="prenorm", mlp_kind="dense"), torch.float64, FP64_TOL),
    (dict(mlp_kind="dense"), torch.float64, FP64_TOL),
], ids=["k3-tiny-fp32", "rope-fp32", "prenorm-fp64", "attnres-fp64"])
def test_cached_decoding_equals_full_forward(kw, dtype, tol):
    torch.manual_seed(0)
    cfg = tiny(**kw)
    model = K3ForCausalLM(cfg).to(dtype).eval()
    randomize_attn_res(model)
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :1])
        steps = [out.logits]
        for t in range(1, x.shape[1]):
            out = model(x[:, t:t + 1], cache=out.cache)
            steps.append(out.logits)
        assert_close("token-by-token vs full", full, torch.cat(steps, 1), tol)
        assert out.cache.offset == 12 and len(out.cache.layers) == cfg.num_hidden_layers
        first = model(x[:, :5])
        rest = model(x[:, 5:], cache=first.cache)
        assert_close("prefill 5 + 7 with the cache vs full", full, torch.cat([first.logits, rest.logits], 1), tol)


def test_cache_grows_only_in_mla_layers():
    cfg = tiny(mlp_kind="dense")
    model = K3ForCausalLM(cfg).eval()
    with torch.no_grad():
        a = model(torch.zeros(1, 10, dtype=torch.long)).cache.nbytes()
        b = model(torch.zeros(1, 20, dtype=torch.long)).cache.nbytes()
    mla_layers = len(cfg.full_attn_layers)
    assert b - a == 10 * mla_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4


def test_mtp_loss():
    torch.manual_seed(0)
    cfg = tiny(num_nextn_predict_layers=1, mtp_loss_weight=0.3)
    model = K3ForCausalLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    out = model(x, labels=x)
    assert {"lm_loss", "mtp_loss"} <= set(out.metrics)
    assert abs(out.metrics["mtp_loss"] - torch.log(torch.tensor(cfg.vocab_size)).item()) < 0.1
    assert_close("loss = lm + 0.3 mtp", out.metrics["lm_loss"] + 0.3 * out.metrics["mtp_loss"],
                 out.loss.detach(), FP32_TOL)
    out.loss.backward()
    assert model.mtp.eh_proj.weight.grad is not None
    assert tuple(model.mtp.eh_proj.weight.shape) == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert "mtp_loss" not in K3ForCausalLM(tiny())(x, labels=x).metrics


def test_moe_aux_loss_is_added():
    """out.aux_loss equals coef·E·Σ_j f_j·P_j recomputed from each MoE layer's input (switch-style loss)."""
    from k3lab.moe.latent import LatentMoE

    torch.manual_seed(0)
    coef = 0.01
    model = K3ForCausalLM(tiny(balancer="aux_loss", aux_loss_coef=coef))
    inputs = []
    for m in model.modules():
        if isinstance(m, LatentMoE):
            m.register_forward_hook(lambda mod, args, out: inputs.append((mod, args[0].detach())))
    x = torch.randint(0, 4096, (2, 8))
    out = model(x, labels=x)
    assert len(inputs) >= 1
    expected = 0.0
    for moe, h in inputs:
        h = h.reshape(-1, h.shape[-1]).float()                                   # [N, D]
        s = torch.sigmoid(h @ moe.gate.weight.float().T)                         # [N, E]
        N, E = s.shape
        k = moe.gate.top_k
        top = (s + moe.gate.e_score_correction_bias).topk(k, dim=-1).indices     # [N, k]
        f = torch.bincount(top.flatten(), minlength=E).float() / (N * k)
        P = (s / s.sum(-1, keepdim=True)).mean(0)
        expected = expected + coef * E * (f * P).sum()
    assert_close("aux loss vs recomputed", expected, out.aux_loss.detach(), FP32_TOL)
    assert_close("loss = lm + aux", out.metrics["lm_loss"] + out.aux_loss.detach(), out.loss.detach(), FP32_TOL)


def test_generate_greedy_matches_full_forward_argmax():
    torch.manual_seed(0)
    cfg = tiny(mlp_kind="dense")
    model = K3ForCausalLM(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 5))
    got = generate(model, prompt, max_new_tokens=4)
    ids = prompt
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, ids)


def test_sample_next():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    assert sample_next(logits).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=1.0, top_k=1, generator=g).tolist() == [1, 0]
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, temperature=-1.0)


def test_bad_inputs():
    model = K3ForCausalLM(tiny(mlp_kind="dense"))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        model(torch.zeros(1, 3, dtype=torch.long), labels=torch.zeros(1, 2, dtype=torch.long))
    assert isinstance(model.model, K3Model)


def test_after_optimizer_step_applies_qk_clip():
    """A forced-large logit is clipped to cfg.qk_clip_tau by the model's post-step hook."""
    from k3lab.config import ModelConfig
    from k3lab.mixers.mla import GatedMLA
    from k3lab.model import K3ForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(qk_clip_tau=0.5)
    model = K3ForCausalLM(cfg).train()
    mla = next(m for m in model.modules() if isinstance(m, GatedMLA))
    with torch.no_grad():
        mla.q_b_proj.weight.mul_(200.0)
        mla.kv_b_proj.weight.mul_(200.0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    model(ids, labels=ids)
    assert mla.max_logit.max().item() > 0.5
    model.after_optimizer_step()
    model(ids, labels=ids)
    assert mla.max_logit.max().item() <= 0.5 * (1 + 1e-4)
