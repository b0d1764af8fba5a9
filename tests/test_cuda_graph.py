"""TrainConfig(cuda_graph=True): forward + backward captured as one CUDA graph (k3lab.cuda_graph).

On the GPU: a graphed run of fit equals the eager run step for step (losses, gradient norms, weights,
the balancer's bias), with compiled sublayers, bf16 weights and the fused master AdamW. Everywhere: the
configurations it cannot run are refused, naming the field.
"""
import dataclasses

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.cuda_graph import GraphedForwardBackward
from k3lab.model import K3ForCausalLM
from k3lab.testing import assert_close
from k3lab.train import TrainConfig, fit


def batches(vocab, B=2, T=64, device="cpu"):
    gen = torch.Generator().manual_seed(5)
    data = [torch.randint(0, vocab, (B, T + 1), generator=gen) for _ in range(8)]
    return lambda step: (data[step % 8][:, :-1].to(device), data[step % 8][:, 1:].to(device))


def test_refusals_name_the_field():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="TrainConfig.cuda_graph=True needs a CUDA device"):
        fit(K3ForCausalLM(cfg), batches(cfg.vocab_size), TrainConfig(steps=1, device="cpu", cuda_graph=True, progress=False))
    exact = dataclasses.replace(cfg, balancer="quantile_exact")
    with pytest.raises(ValueError, match="cuda_graph=True: the 'quantile_exact' balancer"):
        GraphedForwardBackward(K3ForCausalLM(exact))
    with pytest.raises(ValueError, match="TrainConfig.cuda_graph=True: with param_dtype='bfloat16' needs optimizer='adamw'"):
        TrainConfig(dtype="bfloat16", param_dtype="bfloat16", optimizer="muon", cuda_graph=True)
    with pytest.raises(ValueError, match="TrainConfig.cuda_graph='yes': must be a bool"):
        TrainConfig(cuda_graph="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_mode", ["none", "sublayer"])
def test_graphed_fit_equals_eager_fit(compile_mode):
    """Six steps (two eager, the capture, three replays) against six eager steps of the same model: the same
    losses and grad norms (the same kernels; 1e-5 allows atomics' order), weights and router biases after."""
    cfg = ModelConfig.preset("tiny")
    runs = {}
    for graph in (False, True):
        torch.manual_seed(0)
        model = K3ForCausalLM(cfg)
        train = TrainConfig(steps=6, lr=3e-3, device="cuda", dtype="bfloat16", param_dtype="bfloat16",
                            compile=compile_mode, recompute="selective", fused_loss=True, cuda_graph=graph,
                            progress=False)
        result = fit(model, batches(cfg.vocab_size, device="cuda"), train)
        runs[graph] = (result, model)
    (eager, m_eager), (graphed, m_graph) = runs[False], runs[True]
    for key in ("loss", "grad_norm"):
        a, b = torch.tensor(eager.column(key)[1]), torch.tensor(graphed.column(key)[1])
        assert_close(key, a, b, 1e-5)
    assert len(set(graphed.column("loss")[1])) == 6  # each replay saw its own batch (eight different ones)
    biases = 0
    for (name, p), q in zip(m_eager.named_parameters(), m_graph.parameters()):
        assert_close(name, p.float(), q.float(), 1e-2)  # bf16 weights: a rounding flip is 1 ulp
        biases += name.endswith("e_score_correction_bias") and bool(p.abs().sum() > 0)  # the balancer moved them
    assert biases > 0
