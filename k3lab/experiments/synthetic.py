"""Kimi Linear §5.1's three synthetic tasks in a regime that can separate the mixers (KDA-9, notebook 16).

KL trains 2-layer models on **MQAR**, **palindrome** and **stack** and reports KDA best on all three (Mamba2 failing
them); our notebook 01 found every mixer at 0.98-0.995 recall at zoology's standard MQAR (T = 256, <= 64 pairs): too
easy to rank them. Separation needs a fixed state that runs out of room — long rows, many associations, a small width
(zoology: T >= 1,024, >= 128 pairs, width 64-128). Here each task is a function of one ``difficulty`` knob:

* ``"mqar"`` — :func:`k3lab.data.mqar` with ``difficulty`` key-value pairs;
* ``"palindrome"`` — :func:`k3lab.data.palindrome`: reverse the first half (``difficulty`` unused: the row length
  ``T`` sets the ``T / 2`` tokens to hold);
* ``"stack"`` — :func:`k3lab.data.stacks` with ``difficulty`` independent stacks (KL: 64).

:func:`train_task` trains a :class:`k3lab.experiments.toy.MixerLM` with :func:`k3lab.train.fit` on batches drawn
once per (task, seed) and cycled, then scores accuracy over the labelled positions of fresh rows (other seeds);
:func:`train_task_best_lr` keeps the best of a learning-rate sweep (zoology's and KL's protocol: every mixer at its
own best lr). Accuracy against width, per mixer and task, is the experiment.

Training may mix difficulties (``train_difficulty``: batch ``s`` has ``train_difficulty[s % n]``) while the test
keeps ``difficulty``: trained on 128 pairs alone at T = 1,024, no mixer left MQAR's chance plateau in 1,000 steps of
32 rows (one H100, 2026-12-06: loss ln 4,096 = 8.318 in all 21 runs), and zoology trains on mixed pair counts.
:func:`mqar_chance` is the accuracy of a uniform guess among the values, the floor those runs sat on.
"""
from __future__ import annotations

import json
from functools import lru_cache

import torch

from k3lab.data import mqar, palindrome, stacks
from k3lab.experiments.mqar import recall_accuracy
from k3lab.experiments.toy import MixerLM
from k3lab.train import TrainConfig

__all__ = ["RUN_KEYS", "TASKS", "kda9_verdict", "mqar_chance", "task_batches", "task_rows", "task_sizes", "train_task",
           "train_task_best_lr"]

TASKS = ("mqar", "palindrome", "stack")
# the sizes one run of a task depends on (notebook 16's scales): per-task dicts give that task's entry. ``tasks``,
# ``mixers``, ``widths`` and ``seeds`` only say which runs there are; the run's key names its mixer, width and seed.
RUN_KEYS = ("vocab", "seq_len", "difficulty", "train_difficulty", "n_layers", "num_heads", "steps", "batch_size", "lrs",
            "chunk_size", "test_examples", "cuda_graph")


def task_rows(task: str, vocab_size: int, num_examples: int, seq_len: int, difficulty: int, seed: int):
    """``(inputs, labels)`` [N, T] of ``task`` (module docstring); labels pre-aligned, ``-100`` where unscored."""
    if task == "mqar":
        return mqar(vocab_size, num_examples, seq_len, difficulty, seed=seed)
    if task == "palindrome":
        return palindrome(vocab_size, num_examples, seq_len, seed=seed)
    if task == "stack":
        return stacks(vocab_size, num_examples, seq_len, num_stacks=difficulty, seed=seed)
    raise ValueError(f"task={task!r}: allowed values are {TASKS}")


def task_sizes(sizes: dict, task: str) -> dict:
    """What one run of ``task`` depends on: :data:`RUN_KEYS` of ``sizes``, each per-task dict replaced by ``task``'s
    entry, as JSON. A key ``sizes`` lacks reads None: runs logged before ``train_difficulty`` existed trained at
    their test difficulty alone, which None means. Notebook 16 reuses a logged run when this agrees, so a change to
    one task's settings retrains that task only."""
    picked = {k: (sizes.get(k).get(task) if isinstance(sizes.get(k), dict) else sizes.get(k)) for k in RUN_KEYS}
    return json.loads(json.dumps(picked))


def mqar_chance(vocab_size: int) -> float:
    """Accuracy of a uniform guess among MQAR's values (the upper half of the vocabulary, :func:`k3lab.data.mqar`):
    ``1 / (V - V // 2)``; a model that has learned nothing sits here, at loss ``ln(V - V // 2)``."""
    return 1.0 / (vocab_size - vocab_size // 2)


@lru_cache(maxsize=8)
def _train_rows(task, vocab_size, rows, seq_len, difficulty, seed):
    inputs, labels = task_rows(task, vocab_size, rows, seq_len, difficulty, seed)
    return inputs.to(torch.int32), labels.to(torch.int32)  # [R, T]: drawn once per (task, seed), shared by the runs


def task_batches(task: str, vocab_size: int, seq_len: int, difficulty: int, *, batch_size: int, pool_batches: int,
                 seed: int, train_difficulty=None):
    """``step -> (inputs, labels)`` [B, T]: ``pool_batches`` batches drawn once and cycled. With ``train_difficulty``
    (a list) batch ``s`` comes from rows of difficulty ``train_difficulty[s % n]`` (seed ``seed + 1000 i`` for the
    ``i``-th), ``ceil(pool_batches / n)`` batches of each; without, every batch has ``difficulty``."""
    mix = list(train_difficulty) if train_difficulty else [difficulty]
    if task == "palindrome" and len(set(mix)) > 1:
        raise ValueError(f"train_difficulty={mix!r}: palindrome has no difficulty to mix (its row length sets it)")
    per = -(-pool_batches // len(mix))
    pools = [_train_rows(task, vocab_size, per * batch_size, seq_len, d, seed + 1000 * i) for i, d in enumerate(mix)]

    def batch(step: int):
        inputs, labels = pools[step % len(mix)]
        j = (step // len(mix)) % per
        rows = slice(j * batch_size, (j + 1) * batch_size)
        return inputs[rows].long(), labels[rows].long()

    return batch


def train_task(task: str, mixer: str, *, d_model: int, seq_len: int, vocab_size: int, difficulty: int,
               n_layers: int = 2, num_heads: int = 2, steps: int = 200, batch_size: int = 32, lr: float = 1e-3,
               pool_batches: int | None = None, test_examples: int = 256, device: str = "cpu", seed: int = 0,
               chunk_size: int = 64, cuda_graph: bool = False, train_difficulty=None) -> dict:
    """Train ``mixer`` on ``task`` and score it. Returns ``{"accuracy", "params", "seconds", "final_loss"}``.

    The training rows are ``pool_batches`` batches (default: one per step, no row seen twice) drawn once for
    (task, seed) and cycled, at ``difficulty`` or cycling through ``train_difficulty`` (:func:`task_batches`); the
    test rows are ``test_examples`` fresh rows (seed + 10,000) at ``difficulty``."""
    from k3lab.experiments.scales import fit_graphed

    batch = task_batches(task, vocab_size, seq_len, difficulty, batch_size=batch_size, pool_batches=pool_batches or steps,
                         seed=seed, train_difficulty=train_difficulty)

    torch.manual_seed(seed)
    cfg = TrainConfig(steps=steps, lr=lr, warmup_frac=0.05, device=device, seed=seed, progress=False, log_every=steps,
                      name=f"{task}/{mixer}", cuda_graph=cuda_graph)
    model, result = fit_graphed(lambda: MixerLM(vocab_size, d_model, n_layers, mixer, num_heads, chunk_size=chunk_size),
                                batch, cfg, variant=mixer)
    test_x, test_y = task_rows(task, vocab_size, test_examples, seq_len, difficulty, seed + 10_000)
    return {"accuracy": recall_accuracy(model, test_x, test_y), "params": sum(p.numel() for p in model.parameters()),
            "seconds": result.elapsed, "final_loss": result.history[-1]["loss"]}


def train_task_best_lr(task: str, mixer: str, lrs, **kwargs) -> dict:
    """:func:`train_task` at each lr of ``lrs``; the run with the highest accuracy (ties: the first), with ``"lr"``,
    ``"sweep"`` (``{lr: accuracy}``) and ``"seconds"`` (all runs) added."""
    if not lrs:
        raise ValueError(f"lrs={lrs!r}: give at least one learning rate")
    best, sweep, seconds = None, {}, 0.0
    for lr in lrs:
        r = train_task(task, mixer, lr=lr, **kwargs)
        sweep[lr], seconds = r["accuracy"], seconds + r["seconds"]
        if best is None or r["accuracy"] > best["accuracy"]:
            best = dict(r, lr=lr)
    return dict(best, sweep=sweep, seconds=seconds)


def kda9_verdict(acc: dict, kda: str = "kda") -> tuple[str, dict]:
    """KDA-9's rule, written before the GPU runs. ``acc[task][width][mixer]`` = per-seed accuracies (>= 2 seeds).

    Per task: *KDA best* when at some width KDA's mean exceeds every other mixer's mean by more than the sum of the
    two half-ranges (:func:`k3lab.experiments.nb.compare_seeds`) and at no width another mixer leads KDA that way;
    *other best* when at some width another mixer leads KDA beyond the spread; otherwise *no separation*.
    Overall: ``"confirmed"`` when KDA is best on every task (KL: "KDA is best on all three"), ``"contradicted"``
    when another mixer is best on any task, else ``"not reproduced at this scale"``. Returns ``(overall, {task:
    per-task word})``."""
    from k3lab.experiments.nb import compare_seeds

    per_task = {}
    for task, by_width in acc.items():
        ahead_somewhere, behind_somewhere = False, False
        for by_mixer in by_width.values():
            others = [m for m in by_mixer if m != kda]
            if kda not in by_mixer or not others:
                continue
            cmp = [compare_seeds(kda, by_mixer[kda], m, by_mixer[m]) for m in others]
            ahead_somewhere |= all(c["status"] == "confirmed" for c in cmp)
            behind_somewhere |= any(c["status"] == "contradicted" for c in cmp)
        per_task[task] = "other best" if behind_somewhere else "KDA best" if ahead_somewhere else "no separation"
    if per_task and all(w == "KDA best" for w in per_task.values()):
        return "confirmed", per_task
    if any(w == "other best" for w in per_task.values()):
        return "contradicted", per_task
    return "not reproduced at this scale", per_task
