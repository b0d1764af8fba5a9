"""The embedding and head outside the root unit (ParallelOptions.edges) against one process, at gloo ranks: the table
sharded by rows (k3lab.parallel.vocab) against nn.Embedding (the lookup exactly, the table's gradient: every rank's
tokens summed; uneven and empty shards), and fit with edges="vocab" and edges="units" against one process."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from k3lab.config import ModelConfig
from k3lab.model import K3ForCausalLM
from k3lab.parallel.parallelize import ParallelOptions
from k3lab.parallel.spawn import run_ranks
from k3lab.parallel.vocab import ShardedEmbedding
from k3lab.train import TrainConfig, fit

from test_parallel_train import _batches, _train_cfg


def _lookup_worker(rank, world, vocab, dtype, grad_dtype):
    """Each rank looks up its own tokens, as many as every other (every id, repeats, the last row); returns the
    lookup's error against nn.Embedding, the gradient's against Σ over ranks of one process's, and the rows this rank
    holds."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    one = nn.Embedding(vocab, 6).to(dtype)
    table = ShardedEmbedding(nn.Embedding(vocab, 6).to(dtype).requires_grad_(), init_device_mesh("cpu", (world,)),
                             grad_dtype=grad_dtype)
    with torch.no_grad():  # the same weights: each rank takes its rows of one's
        table.weight.to_local().copy_(one.weight[slice(*table.row_range())])
    g = torch.Generator().manual_seed(rank)
    ids = torch.cat([torch.arange(vocab), torch.randint(0, vocab, (2 * vocab,), generator=g),
                     torch.full((3,), vocab - 1)]).view(1, -1)                          # [1, N]
    weights = torch.randn(ids.shape[1], 6, generator=g).to(dtype)                        # [N, D]
    h = table(ids)                                                                        # [1, N, D]
    (h[0].float() * weights.float()).sum().backward()
    ref = one(ids)
    (ref[0].float() * weights.float()).sum().backward()
    want = one.weight.grad.float()
    dist.all_reduce(want)                                                                 # Σ over the ranks' tokens
    got = table.weight.grad.full_tensor().float()
    return dict(lookup=(h.float() - ref.float()).abs().max().item(), dtype=str(h.dtype),
                grad=((got - want).abs().max() / want.abs().max()).item(), rows=table.row_range(),
                local=tuple(table.weight.to_local().shape), grad_dtype=str(table.weight.grad.dtype))


@pytest.mark.parametrize("world,vocab", [(3, 10), (3, 2)])
def test_sharded_lookup_equals_nn_embedding(world, vocab):
    """fp32: the lookup bit for bit, the gradient to summation order; rows split as torch.chunk (10 = 4 + 4 + 2; 2
    rows at 3 ranks leave the last one none)."""
    ranks = run_ranks(_lookup_worker, world, vocab, torch.float32, None)
    size = -(-vocab // world)
    for r, out in enumerate(ranks):
        assert out["lookup"] == 0.0 and out["grad"] < 1e-6, out
        lo = min(r * size, vocab)
        assert out["rows"] == (lo, min(lo + size, vocab)) and out["local"][0] == out["rows"][1] - lo, out
    assert [out["rows"] for out in ranks][-1] == ((2, 2) if vocab == 2 else (8, 10))


def test_sharded_lookup_of_bf16_weights_sums_gradients_in_fp32():
    """bf16 weights: the lookup is exact (one nonzero term a sum); the gradient rows are summed in fp32 and rounded
    to bf16 once (the weight's dtype)."""
    ranks = run_ranks(_lookup_worker, 2, 10, torch.bfloat16, torch.float32)
    for out in ranks:
        assert out["lookup"] == 0.0 and out["dtype"] == "torch.bfloat16" and out["grad_dtype"] == "torch.bfloat16"
        assert out["grad"] < 1e-2, out


FIT_CASES = {"vocab, fp32": ("vocab", {}, 1e-5), "vocab, muon": ("vocab", dict(optimizer="muon"), 1e-5),
             "vocab, fused bf16": ("vocab", dict(fused_loss=True, dtype="bfloat16", param_dtype="bfloat16"), 2e-2),
             "vocab, mtp": ("vocab", {}, 1e-5),  # the table looked up twice a forward (the MTP head's shifted ids)
             "units, fp32": ("units", {}, 1e-5),
             "units, fused bf16": ("units", dict(fused_loss=True, dtype="bfloat16", param_dtype="bfloat16"), 2e-2)}


def _case(name):
    edges, kw, tol = FIT_CASES[name]
    train_cfg = _train_cfg(kw.pop("optimizer", "adamw"))
    cfg = ModelConfig.preset("tiny").replace(num_nextn_predict_layers=1 if name.endswith("mtp") else 0)
    return edges, cfg, dataclasses.replace(train_cfg, **kw), tol


def _fit_worker(rank, world):
    out = {}
    for name in FIT_CASES:
        edges, cfg, train_cfg, _ = _case(name)
        out[name] = fit(lambda: K3ForCausalLM(cfg), _batches(), train_cfg, parallel=ParallelOptions(edges=edges)).losses
    return out


def test_fit_with_the_edges_apart_equals_one_process():
    """fit at 2 gloo ranks (the model built on meta and filled from rank 0) equals one process: the table sharded by
    rows (AdamW; Muon, under which it stays on AdamW; bf16 with the fused loss; an MTP head, which looks it up twice
    a forward) and the embedding and head as units (the fused loss reads the head's weight through its registered
    method; without the registration the step fails on a sharded weight)."""
    ranks = run_ranks(_fit_worker, 2)
    for name in FIT_CASES:
        _, cfg, train_cfg, tol = _case(name)
        torch.manual_seed(0)
        one = fit(K3ForCausalLM(cfg), _batches(), train_cfg).losses
        assert ranks[0][name] == ranks[1][name], name
        for a, b in zip(ranks[0][name], one):
            assert abs(a - b) / abs(b) < tol, (name, ranks[0][name], one)


def _resume_worker(rank, world, run_dir):
    """3 steps with the table sharded by rows; the same run stopped after 2, saved (DCP), and resumed with the table
    in FSDP2's root unit: the same layout (``Shard(0)`` on the same mesh) under the same names, so the checkpoint
    serves both."""
    cfg, tc = ModelConfig.preset("tiny"), _train_cfg("adamw")
    vocab, fsdp = ParallelOptions(edges="vocab"), ParallelOptions(edges="root")
    full = fit(lambda: K3ForCausalLM(cfg), _batches(), tc, parallel=vocab).losses
    saved = dataclasses.replace(tc, out_dir=run_dir)
    fit(lambda: K3ForCausalLM(cfg), _batches(), saved, parallel=vocab, stop_at=2)
    resumed = fit(lambda: K3ForCausalLM(cfg), _batches(), saved, parallel=fsdp, resume_from=run_dir).losses
    return full, resumed


def test_a_checkpoint_of_the_sharded_table_resumes_in_the_root_unit(tmp_path):
    for full, resumed in run_ranks(_resume_worker, 2, str(tmp_path / "run")):
        assert len(full) == len(resumed) == 3, (full, resumed)  # (the resumed history holds the 2 saved steps)
        assert abs(resumed[-1] - full[-1]) / abs(full[-1]) < 1e-5, (full, resumed)
