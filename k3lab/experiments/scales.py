"""The scales of the claim notebooks (01, 05, 06, 07): their sizes in one place, and what a run at a GPU scale needs
(issue 29) — a time budget that cuts whole seeds rather than the notebook, a log of finished runs that survives a
cut call, and training through CUDA graphs with an eager fallback.

``SCALES[notebook][scale]`` is a dict of the notebook's sizes; a notebook's parameters left at ``None`` take
their value from it (:func:`resolve_scale`), so one papermill parameter, ``scale``, moves the whole notebook:

* ``"cpu"`` — the committed tiny runs (CI, a laptop; each notebook well under 90 s on 2 cores);
* ``"gpu"`` — one H200, one notebook per device call (``notebooks/gpu_runs/run_claims.py``; 3 seeds take 2.5-6 min a
  notebook at the per-run seconds measured on 2026-12-04, ``run_claims.py --plan``);
* ``"smoke"`` — the GPU scale's structure (its variants, data, budget and verdict code) at tiny sizes, so the
  GPU pipeline is tested on a CPU in seconds.

The measured GPU time per run and what fits in a call: ``notebooks/gpu_runs/run_claims.py --plan``.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

SCALE_NAMES = ("cpu", "gpu", "smoke")

# Model shape of the GPU scale of notebooks 05 and 06 (ModelConfig fields): D = 256, K3's head-dimension ratios
# (MLA: 64 nope + 32 rope per head, K3 128 + 64), 4 KDA heads of 64.
GPU_MODEL = dict(hidden_size=256, linear_attn_config=dict(num_heads=4, head_dim=64), num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                 v_head_dim=64, intermediate_size=704)

SCALES: dict[str, dict[str, dict]] = {
    # 15 · scaling laws (SCALE-3, AR-3, HYB-2; k3lab.experiments.scaling). GPU: depth 8, widths 64-192 (0.49-4.0 M
    # non-embedding parameters, 45x in training compute at 10 tokens a parameter), 32 x 512 byte tokens of the code
    # corpus a step, bf16, CUDA graphs; the KJV Bible as the out-of-distribution set. cpu: all-MLA (the torch KDA
    # reference is slow on a CPU) at widths 16-48, depth 4, undertrained by design (a demonstration of the pipeline).
    # smoke: the GPU scale's variants and code path at tiny sizes on a CPU.
    "15": {
        "cpu": dict(variants=["mla", "mla+attnres"], corpus="kjv", widths=[16, 24, 32, 48], depth=4, seq_len=64,
                    batch_size=8, tokens_per_param=0.15, min_steps=10, lr0=4e-2, lr_sweep=[0.5, 1.0, 2.0, 4.0],
                    eval_batches=4, cuda_graph=False, dtype="float32", budget_s=None, run_budget_s=None),
        "gpu": dict(variants=None, corpus="code", widths=[64, 96, 128, 192], depth=8, seq_len=512, batch_size=32,
                    tokens_per_param=10.0, min_steps=100, lr0=6e-3, lr_sweep=[0.5, 1.0, 2.0], eval_batches=16, cuda_graph=True,
                    dtype="bfloat16", budget_s=420, run_budget_s=150),
        "smoke": dict(variants=None, corpus="kjv", widths=[16, 32, 48, 64], depth=4, seq_len=32, batch_size=4,
                      tokens_per_param=0.02, min_steps=3, lr0=1e-2, lr_sweep=[1.0, 2.0], eval_batches=1, cuda_graph=True, dtype="float32",
                      budget_s=240, run_budget_s=60),
    },
    # 16 · KDA-9 where the mixers run out of state: MQAR, palindrome and stack (KL §5.1) against width. Per task its
    # vocabulary, row length and difficulty (MQAR pairs, stacks; unused for palindrome). GPU: zoology's hard MQAR
    # (T = 1,024, 128 pairs, 8,192 tokens), KL's 64 stacks at T = 1,024, a 128-token palindrome; 2 layers of 2 heads
    # at widths 64 and 128 (heads of 32 and 64), every mixer at lr 1e-3: in notebook 01's GPU sweep (1e-3 vs 3e-3,
    # 3 seeds) every mixer's recall at 1e-3 was within 0.01 of its best but one Gated DeltaNet seed, which stalled
    # at 3e-3 (0.84 against 0.97) -- one lr halves the cost of the planned sweep of two. 3 x 4 x 2 x 3 = 72 trainings
    # of 1,000 steps of 32 rows (about 1,200 s on one H100): several device calls resumed through the runs file
    # (run_claims.py --only 16 --resume). ``train_difficulty``: per task, the difficulties the training batches
    # cycle through (None: the test's alone). Trained on 128 pairs alone, MQAR stayed at chance for every mixer
    # (loss ln 4,096, one H100, 2026-12-06, 21 runs), so its training mixes 16-128 pairs, as zoology trains on mixed
    # pair counts and notebook 01's MQAR (which every mixer learned) does; the test stays at 128 pairs.
    "16": {
        "cpu": dict(tasks=["mqar", "palindrome", "stack"], mixers=["kda", "gated_deltanet", "linear"], widths=[16, 32],
                    seeds=[0, 1], vocab={"mqar": 32, "palindrome": 8, "stack": 16},
                    seq_len={"mqar": 16, "palindrome": 12, "stack": 16}, difficulty={"mqar": 2, "palindrome": 0, "stack": 2},
                    train_difficulty=None, n_layers=1, num_heads=2, steps=80, batch_size=16, lrs=[1e-2], chunk_size=8,
                    test_examples=64, cuda_graph=False, budget_s=None),
        "gpu": dict(tasks=["mqar", "palindrome", "stack"], mixers=["kda", "gated_deltanet", "mamba2", "linear"],
                    widths=[64, 128], seeds=[0, 1, 2], vocab={"mqar": 8192, "palindrome": 16, "stack": 256},
                    seq_len={"mqar": 1024, "palindrome": 256, "stack": 1024},
                    difficulty={"mqar": 128, "palindrome": 0, "stack": 64},
                    train_difficulty={"mqar": [16, 32, 64, 128], "palindrome": None, "stack": None},
                    n_layers=2, num_heads=2, steps=1000, batch_size=32, lrs=[1e-3], chunk_size=64, test_examples=512,
                    cuda_graph=True, budget_s=420),
        "smoke": dict(tasks=["mqar", "palindrome", "stack"], mixers=["kda", "gated_deltanet", "mamba2", "linear"],
                      widths=[16, 32], seeds=[0, 1], vocab={"mqar": 32, "palindrome": 8, "stack": 16},
                      seq_len={"mqar": 16, "palindrome": 12, "stack": 16},
                      difficulty={"mqar": 2, "palindrome": 0, "stack": 2},
                      train_difficulty={"mqar": [1, 2], "palindrome": None, "stack": None},
                      n_layers=2, num_heads=2, steps=3, batch_size=4, lrs=[1e-2, 3e-2], chunk_size=8, test_examples=8,
                      cuda_graph=True, budget_s=240),
    },
    # 01 · MQAR: KDA vs Gated DeltaNet vs Mamba2 (KL §5.1). GPU: two layers, 2 heads of 64 (a 64 x 64 state per
    # head), 256-token rows with up to 64 key-value pairs (zoology's standard length), 1,000 steps of 128 rows, each
    # mixer at its better of two learning rates (``lrs``, zoology's sweep: Gated DeltaNet stalled at 3e-3 alone on
    # 2026-12-04). ``lrs`` None: the one ``lr``.
    "01": {
        "cpu": dict(pairs_grid=[1, 2, 4, 8], steps=200, d_model=32, seq_len=32, n_layers=1, batch_size=32,
                    chunk_size=8, vocab_size=64, lr=1e-2, lrs=None, seeded=["kda", "gated_deltanet"],
                    cuda_graph=False, budget_s=None),
        "gpu": dict(pairs_grid=[8, 16, 32, 64], steps=1000, d_model=128, seq_len=256, n_layers=2, batch_size=128,
                    chunk_size=64, vocab_size=256, lr=3e-3, lrs=[1e-3, 3e-3],
                    seeded=["kda", "gated_deltanet", "mamba2"], cuda_graph=True, budget_s=420),
        "smoke": dict(pairs_grid=[2, 4], steps=12, d_model=16, seq_len=16, n_layers=1, batch_size=8, chunk_size=8,
                      vocab_size=32, lr=1e-2, lrs=[3e-3, 1e-2], seeded=["kda", "gated_deltanet", "mamba2"],
                      cuda_graph=True, budget_s=240),
    },
    # 05 · NoPE vs RoPE in the MLA layers of the hybrid (NOPE-2). GPU: K3's 3:1 schedule in 4 layers at D = 256,
    # trained on 256-token rows, passkey at 1x-8x (up to 2,048 tokens).
    "05": {
        "cpu": dict(model={}, layers=2, steps=100, batch_size=32, train_len=16, lr=1e-2, init_std=0.1,
                    max_multiple=16, eval_rows=32, cuda_graph=False, dtype="float32", budget_s=None),
        "gpu": dict(model=GPU_MODEL, layers=4, steps=500, batch_size=64, train_len=256, lr=3e-3, init_std=0.05,
                    max_multiple=8, eval_rows=128, cuda_graph=True, dtype="bfloat16", budget_s=240),
        "smoke": dict(model={}, layers=4, steps=6, batch_size=4, train_len=16, lr=1e-2, init_std=0.1,
                      max_multiple=4, eval_rows=4, cuda_graph=True, dtype="float32", budget_s=240),
    },
    # 06 · AttnRes vs PreNorm and the block count (AR-2, AR-3, AR-5). GPU: 8 decoder layers (16 sublayers; K3's
    # 3:1 KDA/MLA schedule) at D = 256, byte tokens of the code corpus (no window repeats), 250 steps of 64 x 512;
    # AttnRes with 1 and 8 blocks (S = 16 and 2 sublayers a block) and full against PreNorm: 4 variants x 3 seeds, about
    # 26 s a run alone on one H200 (measured 31 s at 300 steps) and 22-45 s on one H100 (PreNorm fastest, full slowest;
    # 12 runs about 410 s, 2026-12-06), so 3 seeds fit one call's 440 s budget (all 6 variants would not).
    # ``block_counts`` None: every power of 2 dividing num_layers.
    "06": {
        "cpu": dict(model={}, num_layers=4, hybrid=False, tokenizer="byte", corpus="kjv", block_counts=None, steps=30,
                    batch_size=8, seq_len=32, lr=1e-2, eval_batches=4, cuda_graph=False, dtype="float32", budget_s=None),
        "gpu": dict(model=GPU_MODEL, num_layers=8, hybrid=True, tokenizer="byte", corpus="code", block_counts=[1, 8],
                    steps=250, batch_size=64, seq_len=512, lr=3e-3, eval_batches=16, cuda_graph=True,
                    dtype="bfloat16", budget_s=440),
        "smoke": dict(model={}, num_layers=4, hybrid=True, tokenizer="byte", corpus="code", block_counts=[1, 4], steps=4,
                      batch_size=2, seq_len=16, lr=1e-2, eval_batches=1, cuda_graph=True, dtype="float32", budget_s=240),
    },
    # 07 · LatentMoE vs a standard MoE at equal dispatch bytes, routed parameters and active expert FLOPs (LMOE-3's
    # quality side). GPU: 4 layers at D = 256 (layer 1 dense, layers 2-4 MoE with one shared expert; every mixer MLA:
    # the mixer is not what is compared), standard MoE 16 experts top-2 at width 256 vs LatentMoE 32 experts top-4 at
    # width 128 (expert hidden 256), byte tokens of the code corpus (disjoint windows), 500 steps of 64 x 256, bf16:
    # 2 variants x 3 seeds. Not measured yet: estimated at ~30 s a run (05's dense 4-layer D = 256 model took 11-16 s
    # at these steps and tokens; the MoE layers' routing, QB balancer and dispatch counted as doubling it), 60 s for
    # the first, ~210 s for 3 seeds. ``stress``: §4's SiTU vs SwiGLU runs (cpu only; at gpu the budget goes to §3).
    "07": {
        "cpu": dict(model={}, num_layers=2, tokenizer="bpe", corpus="kjv", steps=30, lr=3e-3, batch_size=8, seq_len=32,
                    eval_batches=4, std_experts=8, std_topk=2, stress=True, stress_steps=50, stress_lr=3e-2,
                    cuda_graph=False, budget_s=None),
        "gpu": dict(model=dict(GPU_MODEL, moe_intermediate_size=256), num_layers=4, tokenizer="byte", corpus="code",
                    steps=500, lr=3e-3, batch_size=64, seq_len=256, eval_batches=16, std_experts=16, std_topk=2,
                    stress=False, stress_steps=50, stress_lr=3e-2, cuda_graph=True, budget_s=300),
        "smoke": dict(model={}, num_layers=2, tokenizer="byte", corpus="code", steps=4, lr=3e-3, batch_size=2,
                      seq_len=16, eval_batches=1, std_experts=8, std_topk=2, stress=False, stress_steps=4,
                      stress_lr=3e-2, cuda_graph=True, budget_s=240),
    },
}


def resolve_scale(notebook: str, scale: str, namespace: dict) -> dict:
    """The sizes a notebook runs with: ``SCALES[notebook][scale]``, with every name that ``namespace`` (the
    notebook's ``globals()``) sets to something other than None taking precedence. Returns the merged dict and
    writes it back into ``namespace``; raises ValueError for an unknown scale."""
    if notebook not in SCALES:
        raise ValueError(f"resolve_scale: no scales for notebook {notebook!r}; known: {sorted(SCALES)}")
    if scale not in SCALES[notebook]:
        raise ValueError(f"parameter scale={scale!r}: allowed values are {tuple(SCALES[notebook])}")
    sizes = dict(SCALES[notebook][scale])
    for name in sizes:
        if namespace.get(name) is not None:
            sizes[name] = namespace[name]
    namespace.update(sizes)
    return sizes


# ----------------------------------------------------------------------------------------------
# the time budget: whole runs, seeds first
# ----------------------------------------------------------------------------------------------
class Budget:
    """A wall-clock budget for a notebook's training runs (``seconds=None``: unlimited).

    ``allows(reserve, variant=None, upcoming=())`` says whether one more run fits with room left for the runs after
    it, and ``took(seconds, variant=None)`` records a finished run. A run is predicted by the latest run of its
    variant when the notebook names variants (their speeds differ: on an H200 notebook 01's KDA runs took 60 s, its
    Mamba2 runs 20 s), else by the longest run so far after the first (which also compiles kernels and captures
    graphs: 47 s against 14-16 s for 05; it is the prediction only while it is the one run measured); ``reserve``
    more runs are predicted that way, and the variants in ``upcoming`` each by its own latest run. A notebook that
    asks before each run finishes within its budget (give or take one run) with the runs it had time for, and says
    which it skipped, instead of being cut mid-cell by the caller's timeout."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start, self.durations, self.skipped, self.earlier = seconds, time.perf_counter(), [], [], []
        self.by_variant: dict = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, reserve: int = 0, variant=None, upcoming=()) -> bool:
        if self.seconds is None:
            return True
        per_run = max(self.durations[1:] + self.earlier or self.durations, default=0.0)
        ahead = self.by_variant.get(variant, per_run) + per_run * reserve
        ahead += sum(self.by_variant.get(v, per_run) for v in upcoming)
        return self.elapsed() + ahead <= self.seconds

    def took(self, seconds: float, variant=None) -> None:
        self.durations.append(seconds)
        if variant is not None:
            self.by_variant[variant] = seconds

    def took_earlier(self, seconds: float, variant=None) -> None:
        """A run reused from an earlier call (:meth:`RunLog.finished`): its time informs the prediction only."""
        self.earlier.append(seconds)
        if variant is not None:
            self.by_variant.setdefault(variant, seconds)

    def note(self) -> str:
        """One line: runs done, time used, runs skipped for the budget."""
        if self.seconds is None:
            return f"{len(self.durations)} runs in {self.elapsed():.0f} s (no time budget)"
        skipped = f"; skipped for the budget: {', '.join(map(str, self.skipped))}" if self.skipped else ""
        return f"{len(self.durations)} runs in {self.elapsed():.0f} s of a {self.seconds:.0f} s budget{skipped}"


def run_sizes(sizes: dict) -> dict:
    """The sizes that decide a run's result (a scale's sizes without its time budget): what a runs record keeps
    under ``sizes`` and what :meth:`RunLog.finished` matches."""
    return {k: v for k, v in sizes.items() if k != "budget_s"}


def complete_seeds(done, variants, seeds) -> list:
    """The seeds for which every variant in ``variants`` has a result (``(variant, seed) in done``), in order."""
    return [s for s in seeds if all((v, s) in done for v in variants)]


def seed_major(variants, seeds) -> list[tuple]:
    """Jobs ``(variant, seed)`` ordered seed by seed: a budget that stops early leaves whole seeds."""
    return [(v, s) for s in seeds for v in variants]


# ----------------------------------------------------------------------------------------------
# the log of finished runs
# ----------------------------------------------------------------------------------------------
class RunLog:
    """Finished runs appended to a JSON-lines file as they finish (``path=None``: nothing is written), so a
    call cut by its time limit still leaves every run that finished; ``load()`` reads them back, and
    ``finished(sizes)`` gives the runs an earlier call made at the same sizes, so a notebook run again on the same
    file trains only what is missing (``notebooks/gpu_runs/run_claims.py --resume``)."""

    def __init__(self, path: str | Path | None, notebook: str, scale: str):
        self.path, self.notebook, self.scale = (Path(path) if path else None), notebook, scale

    def add(self, variant: str, seed: int, **result) -> None:
        if self.path is None:
            return
        record = dict(notebook=self.notebook, scale=self.scale, variant=variant, seed=seed,
                      time=time.strftime("%Y-%m-%dT%H:%M:%S"), **result)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")

    def load(self) -> list[dict]:
        if self.path is None or not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def finished(self, sizes: dict) -> dict[tuple[str, int], dict]:
        """``{(variant, seed): record}`` of this notebook and scale whose recorded ``sizes`` equal ``sizes`` (as
        JSON); the later record wins. A record without ``sizes`` never matches."""
        want = json.loads(json.dumps(sizes, default=_jsonable))
        return self.finished_where(lambda got: got == want)

    def finished_where(self, match) -> dict[tuple[str, int], dict]:
        """As :meth:`finished`, with ``match(recorded sizes) -> bool`` deciding instead of equality (a notebook
        whose runs depend on part of its sizes: notebook 16's runs on their own task's)."""
        return {(r["variant"], r["seed"]): r for r in self.load()
                if r.get("notebook") == self.notebook and r.get("scale") == self.scale
                and r.get("sizes") is not None and match(r["sizes"])}


def _jsonable(value):
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:
        pass
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


# ----------------------------------------------------------------------------------------------
# training through CUDA graphs, with an eager fallback
# ----------------------------------------------------------------------------------------------
GRAPH_FAILURES: dict[str, str] = {}  # variant -> why its capture failed (the later runs of it go eager)


def fit_graphed(build, batches, cfg, *, variant: str, val_batches=None):
    """:func:`k3lab.train.fit` of ``build()`` (a fresh model, built under the caller's seed) with ``cfg``; when
    ``cfg.cuda_graph`` is set and the capture fails, the error is printed, remembered for ``variant`` in
    :data:`GRAPH_FAILURES`, and the run restarts eagerly on a freshly built model. Returns ``(model, result)``,
    the model without gradients: a graphed run's gradients live in its graph's private memory pool, and a model
    kept after its run (notebook 06 keeps two for its heatmaps) would pin that pool's segments."""
    import dataclasses
    import gc

    import torch

    from k3lab.train import fit

    if cfg.cuda_graph and not torch.cuda.is_available():
        cfg = dataclasses.replace(cfg, cuda_graph=False)  # CUDA graphs need CUDA; the smoke scale runs eagerly
    if cfg.cuda_graph and variant in GRAPH_FAILURES:
        cfg = dataclasses.replace(cfg, cuda_graph=False)
    rng = torch.get_rng_state()
    model = build()
    try:
        result = fit(model, batches, cfg, val_batches=val_batches)
    except Exception as err:  # noqa: BLE001 — only a graphed run is retried; anything else is re-raised
        if not cfg.cuda_graph:
            raise
        GRAPH_FAILURES[variant] = f"{type(err).__name__}: {str(err)[:300]}"
        print(f"CUDA graph capture failed for {variant} ({GRAPH_FAILURES[variant]}); running it eagerly")
        result = None  # the retry runs outside this block, once the traceback (and the failed graph) is gone
    if result is None:
        model = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the failed capture's pool
        torch.set_rng_state(rng)
        model = build()
        result = fit(model, batches, dataclasses.replace(cfg, cuda_graph=False), val_batches=val_batches)
    model.zero_grad(set_to_none=True)
    return model, result


def claim_verdict(comparisons: dict, seeds_done: int, seeds_wanted: int) -> str:
    """One ledger word from ``compare_seeds`` results that must all hold for a claim: ``"confirmed"`` when all
    are confirmed, ``"contradicted"`` when any is, else ``"not reproduced at this scale"``; ``"not tested"``
    with fewer than 3 complete seeds (the budget stopped the runs) — a claim is judged on 3 or more."""
    if seeds_done < min(3, seeds_wanted) or seeds_done < 2:
        return "not tested"
    statuses = [c["status"] for c in comparisons.values()]
    if any(s == "contradicted" for s in statuses):
        return "contradicted"
    if statuses and all(s == "confirmed" for s in statuses):
        return "confirmed"
    return "not reproduced at this scale"


def verdict_line(claim: str, status: str, evidence: str) -> str:
    """The line ``notebooks/gpu_runs/check_ledger.py`` reads back: ``VERDICT <claim>: <status> — <evidence>``."""
    return f"VERDICT {claim}: {status} — {evidence}"


def fmt_seconds(s: float) -> str:
    return f"{s:.0f} s" if math.isfinite(s) else "—"
