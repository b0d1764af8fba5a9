"""The MQAR state-capacity experiment of notebook 01: train a :class:`k3lab.experiments.toy.MixerLM`
with :func:`k3lab.train.fit` on a mix of key-value-pair counts and report recall accuracy per count
(zoology's convention). Kept apart from the model (``k3lab.experiments.toy``) so that the model never
imports the trainer or the data module.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from k3lab.data import mqar
from k3lab.experiments.toy import MixerLM
from k3lab.train import TrainConfig

__all__ = ["mqar_mixture", "recall_accuracy", "train_mqar"]


def mqar_mixture(vocab_size: int, seq_len: int, pairs_grid, batch_size: int, num_batches: int, seed: int = 0):
    """``step -> (inputs, labels)``: MQAR batches cycling through ``pairs_grid`` (batch ``s`` has
    ``pairs_grid[s % len]`` pairs), fixed in advance so that a step always gets the same batch."""
    P = len(pairs_grid)
    per_count = -(-num_batches // P) * batch_size
    sets = [mqar(vocab_size, per_count, seq_len, pairs, seed=seed + 1000 * i) for i, pairs in enumerate(pairs_grid)]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = sets[step % P]
        rows = slice((step // P) * batch_size % per_count, (step // P) * batch_size % per_count + batch_size)
        return inputs[rows], labels[rows]

    return batch


@torch.no_grad()
def recall_accuracy(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of query positions (``labels != -100``) where the argmax logit is the bound value."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    logits = model(inputs.to(device)).logits
    model.train(was_training)
    query = labels.to(device) != -100
    return (logits.argmax(-1)[query] == labels.to(device)[query]).float().mean().item()


def train_mqar(mixer: str, pairs_grid=(2, 4, 8, 16), *, vocab_size: int = 64, seq_len: int = 64, d_model: int = 32,
               n_layers: int = 1, num_heads: int = 2, steps: int = 250, batch_size: int = 32, lr: float = 1e-2,
               test_examples: int = 256, device: str = "cpu", seed: int = 0, chunk_size: int = 16,
               backend: str = "auto", cuda_graph: bool = False) -> dict:
    """Train a :class:`MixerLM` on MQAR mixed over ``pairs_grid`` and measure recall per pair count.

    Returns ``{"accuracy": {pairs: acc}, "params": n, "seconds": s, "final_loss": l}``; the test sets
    are fresh MQAR draws (other seeds) of ``test_examples`` sequences per pair count. ``chunk_size``: of
    the chunkwise mixers (the same function for any size); 8 keeps KDA's in-chunk decay range within
    8·5 = 40, where the chunk scores are one matmul (``k3lab.mixers.chunk.decayed_scores_anchored``).
    ``backend``: KDA's (``MixerLM``); ``cuda_graph``: train through CUDA graphs on CUDA
    (:func:`k3lab.experiments.scales.fit_graphed`: eager again if the capture fails; ignored on a CPU).
    """
    from k3lab.experiments.scales import fit_graphed

    torch.manual_seed(seed)
    batches = mqar_mixture(vocab_size, seq_len, pairs_grid, batch_size, steps, seed=seed)
    cfg = TrainConfig(steps=steps, lr=lr, warmup_frac=0.05, device=device, seed=seed, progress=False,
                      log_every=steps, name=mixer, cuda_graph=cuda_graph)
    model, result = fit_graphed(lambda: MixerLM(vocab_size, d_model, n_layers, mixer, num_heads,
                                                chunk_size=chunk_size, backend=backend),
                                batches, cfg, variant=mixer)
    accuracy = {}
    for i, pairs in enumerate(pairs_grid):
        inputs, labels = mqar(vocab_size, test_examples, seq_len, pairs, seed=seed + 10_000 + i)
        accuracy[pairs] = recall_accuracy(model, inputs, labels)
    return {"accuracy": accuracy, "params": sum(p.numel() for p in model.parameters()),
            "seconds": result.elapsed, "final_loss": result.history[-1]["loss"]}


def train_mqar_best_lr(mixer: str, pairs_grid, lrs, **kwargs) -> dict:
    """:func:`train_mqar` at each learning rate in ``lrs``; returns the run with the highest mean recall over
    ``pairs_grid`` (ties: the first), with ``"lr"`` (the one kept), ``"sweep"`` (``{lr: mean recall}``) and
    ``"seconds"`` (all runs together) added.

    Zoology's protocol for MQAR (Arora et al. 2023, "Zoology: measuring and improving recall in efficient language
    models"): every architecture is trained at several learning rates and reported at its best, so that a ranking
    does not reflect one learning rate that happens to suit one mixer. One lr is one run (``lrs=[lr]``).
    """
    if not lrs:
        raise ValueError(f"lrs={lrs!r}: give at least one learning rate")
    best, sweep, seconds = None, {}, 0.0
    for lr in lrs:
        r = train_mqar(mixer, pairs_grid, lr=lr, **kwargs)
        mean = sum(r["accuracy"].values()) / len(r["accuracy"])
        sweep[lr], seconds = mean, seconds + r["seconds"]
        if best is None or mean > sweep[best["lr"]]:
            best = dict(r, lr=lr)
    return dict(best, sweep=sweep, seconds=seconds)


def mqar_result_from_record(record: dict) -> dict:
    """A :func:`train_mqar_best_lr` result read back from a JSON runs record (keys of ``accuracy`` are pair
    counts, of ``sweep`` learning rates; JSON made them strings)."""
    out = {k: record[k] for k in ("accuracy", "params", "seconds", "final_loss", "lr", "sweep") if k in record}
    out["accuracy"] = {int(k): v for k, v in record["accuracy"].items()}
    if "sweep" in out:
        out["sweep"] = {float(k): v for k, v in out["sweep"].items()}
    return dict(out, reused=record.get("time", "an earlier call"))

