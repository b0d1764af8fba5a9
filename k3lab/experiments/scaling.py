r"""Scaling laws on one GPU (notebook 15): a model family per variant, training FLOPs counted from the model, a grid
of runs that resumes from its runs file, and the fits and compute multipliers of :mod:`k3lab.experiments.scaling_fit`.

**The family.** Every variant is built by one rule from a size's width ``D`` (:func:`family_config`):

* depth: ``depth`` decoder layers at every size (8 at the GPU scale: every KDA : MLA ratio of HYB-2 — 1:1, 3:1, 7:1 —
  divides it, so the ratio, not the depth, is what changes between variants);
* width ``D`` from the scale's ``widths``; KDA heads and MLA heads of 64 dimensions (``D / 64`` of each; at ``D < 64``
  one head of ``D``); MLA latents ``q_lora_rank = 3D/4``, ``kv_lora_rank = D/2``, per-head ``qk_nope = v = head``,
  ``qk_rope = head/2`` (K3's 128 : 64 : 128 ratios), NoPE;
* a dense SiTU-GLU MLP of ``intermediate = 8D/3`` rounded up to 32 (the MoE is not what these claims compare);
* the byte tokenizer (259 tokens: an LM head that does not dominate the small sizes).

**Variants** (:data:`VARIANTS`): the mixer schedule (``kda_per_mla`` KDA layers before each MLA layer; 0 = every layer
MLA) and the residual stream (``"prenorm"`` or K3's Block AttnRes with ``attn_res_block_size = 2`` layers a block).

**FLOPs.** ``C = 6·P·D_tok + 3·(D_tok/T)·Σ_layers F_mix(T)`` (:meth:`k3lab.costs.InferenceCosts.training_flops`):
``P`` the active parameters with the LM head (the embedding is a lookup), MLA's causal pairs ``2 H (d_qk + d_v)``
each, KDA's ``7 H K V`` a token. The same rule for every variant; norms, gates and the AttnRes depth mix (element-wise)
are not counted.

**Tokens per run** (:func:`plan_runs`): Chinchilla-like, ``tokens_per_param × P_nonemb`` tokens (P without the
embedding and the LM head), rounded to whole batches: each size trains near its compute-optimal point, so the fitted
curve is the compute-efficient frontier with one run per size rather than an envelope over many (a fixed compute grid
would need several runs per size to find each envelope, which the device time does not allow). The budget of every
size is stated before training, with the epochs of the corpus it reads (the code corpus: 88 M byte tokens; the
largest GPU run reads well under one epoch, so no window repeats).

**Learning rate** (:func:`lr_for`): AdamW, peak ``lr = lr0 · sqrt(D0 / D)`` (``D0`` the smallest width), cosine to
10% with 1% warmup (K3). ``lr0`` is tuned on the smallest size: ``lr_sweep`` multipliers of the scale's ``lr0`` are run
on the baseline variant at the smallest width first (seed 0), and the best validation loss picks ``lr0`` for every
size and variant (the baseline's hyper-parameters, as Kimi Linear tuned MLA's).

**Validation**: the same held-out batches for every run, in-distribution (held-out files of the training corpus) and
out-of-distribution (another source: the KJV Bible when training on code; this package's own Python source when
training on the KJV at the CPU scale). The fits use the in-distribution loss; the OOD loss is recorded beside it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from k3lab.config import ModelConfig
from k3lab.costs import InferenceCosts

VARIANTS: dict[str, dict] = {
    "mla": dict(kda_per_mla=0, residual="prenorm"),             # every layer Gated MLA (KL §5.3's baseline)
    "hybrid": dict(kda_per_mla=3, residual="prenorm"),          # Kimi Linear: 3 KDA : 1 MLA
    "kda1:1": dict(kda_per_mla=1, residual="prenorm"),          # HYB-2's ratios
    "kda7:1": dict(kda_per_mla=7, residual="prenorm"),
    "hybrid+attnres": dict(kda_per_mla=3, residual="attnres"),  # K3: the hybrid on Block AttnRes (AR-3 vs "hybrid")
    "mla+attnres": dict(kda_per_mla=0, residual="attnres"),     # the CPU scale's AR-3 (no KDA: the reference is slow)
    "mla+rope": dict(kda_per_mla=0, residual="prenorm", rope=True),  # SCALE-3's control: all-MLA with RoPE (K3: NoPE)
}
HEAD_DIM = 64            # KDA and MLA head width at D >= 64
ATTN_RES_BLOCK = 2       # decoder layers per AttnRes block
TOKENIZER = "byte"


def check_variant(name: str) -> dict:
    if name not in VARIANTS:
        raise ValueError(f"variant {name!r}: allowed values are {tuple(VARIANTS)}")
    return VARIANTS[name]


def mla_layers(depth: int, kda_per_mla: int) -> list[int]:
    """1-based MLA layer indices: every ``kda_per_mla + 1``-th layer (0: all); depth must be a multiple of it."""
    period = kda_per_mla + 1
    if depth % period:
        raise ValueError(f"depth={depth}: must be a multiple of {period} for {kda_per_mla} KDA layers per MLA layer")
    return [i for i in range(1, depth + 1) if i % period == 0]


def family_config(variant: str, width: int, depth: int, vocab_size: int, seq_len: int) -> ModelConfig:
    """The model of ``variant`` at width ``D = width`` (module docstring: the one shape rule)."""
    spec = check_variant(variant)
    if not isinstance(width, int) or width < 16 or width % 8:
        raise ValueError(f"width={width!r}: must be a multiple of 8, at least 16")
    head = min(HEAD_DIM, width)
    heads = max(1, width // HEAD_DIM)
    inter = -(-(8 * width // 3) // 32) * 32
    return ModelConfig.preset("tiny").replace(
        vocab_size=vocab_size, hidden_size=width, num_hidden_layers=depth,
        full_attn_layers=mla_layers(depth, spec["kda_per_mla"]),
        linear_attn_config=dict(ModelConfig.preset("tiny").linear_attn_config, num_heads=heads, head_dim=head),
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=3 * width // 4, kv_lora_rank=width // 2,
        qk_nope_head_dim=head, qk_rope_head_dim=head // 2, v_head_dim=head, mlp_kind="dense", intermediate_size=inter,
        residual=spec["residual"], attn_res_block_size=ATTN_RES_BLOCK, num_nextn_predict_layers=0,
        max_position_embeddings=max(seq_len, 64), mla_use_nope=not spec.get("rope", False))


def params_of(cfg: ModelConfig) -> dict:
    """``{"active": P with the LM head, "nonemb": P without the embedding and the LM head}``."""
    active = cfg.param_counts()["active"]
    head = cfg.vocab_size * cfg.hidden_size
    return dict(active=active, nonemb=active - head)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs a token (``C / D_tok``, module docstring)."""
    return InferenceCosts(cfg).training_flops(seq_len, seq_len) / seq_len


def lr_for(width: int, lr0: float, width0: int) -> float:
    """``lr0 · sqrt(D0 / D)``: the peak AdamW learning rate at width ``D``."""
    return lr0 * math.sqrt(width0 / width)


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    variant: str
    width: int
    seed: int
    steps: int
    lr: float
    tokens: int          # training tokens
    flops: float         # training FLOPs (C)
    params: int          # non-embedding parameters
    shape: str = ""      # depth, sequence length, batch size: "L8|T512|B32"
    kind: str = "grid"   # "grid" or "sweep"

    @property
    def key(self) -> str:
        """What the runs file matches on (the run's identity: any change of these trains it again)."""
        return f"{self.kind}|{self.variant}|D{self.width}|s{self.seed}|{self.shape}|{self.steps}|{self.lr:.6g}"


def plan_runs(variants, widths, seeds, *, depth: int, seq_len: int, batch_size: int, tokens_per_param: float,
              lr0: float, vocab_size: int, min_steps: int = 20) -> list[PlannedRun]:
    """The grid, seed-major then size then variant (a budget that stops early leaves whole sizes of whole seeds)."""
    for v in variants:
        check_variant(v)
    widths = sorted(widths)
    runs = []
    for seed in seeds:
        for width in widths:
            for v in variants:
                cfg = family_config(v, width, depth, vocab_size, seq_len)
                p = params_of(cfg)
                steps = max(min_steps, round(tokens_per_param * p["nonemb"] / (batch_size * seq_len)))
                tokens = steps * batch_size * seq_len
                runs.append(PlannedRun(v, width, seed, steps, lr_for(width, lr0, widths[0]), tokens,
                                       flops_per_token(cfg, seq_len) * tokens, p["nonemb"],
                                       f"L{depth}|T{seq_len}|B{batch_size}"))
    return runs


def sweep_runs(baseline: str, widths, multipliers, **plan_kw) -> list[PlannedRun]:
    """The learning-rate sweep: the baseline at the smallest width, seed 0, at ``lr0 × m`` for each multiplier."""
    base = plan_runs([baseline], [min(widths)], [0], **plan_kw)[0]
    return [dataclasses.replace(base, lr=base.lr * m, kind="sweep") for m in multipliers]


def plan_table(runs: list[PlannedRun], corpus_tokens: int | None = None, tokens_per_s: dict | None = None) -> str:
    """Markdown: one row per (variant, width) of the first seed — params, steps, tokens, epochs, FLOPs, seconds."""
    first = runs[0].seed if runs else 0
    rows = ["| variant | D | non-emb params | steps | tokens | epochs | FLOPs | est. s |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r.seed != first or r.kind != "grid":
            continue
        ep = f"{r.tokens / corpus_tokens:.2f}" if corpus_tokens else "—"
        est = (tokens_per_s or {}).get((r.variant, r.width))
        rows.append(f"| {r.variant} | {r.width} | {r.params:,} | {r.steps} | {r.tokens:,} | {ep} | {r.flops:.2e} | "
                    f"{r.tokens / est:.0f} |" if est else
                    f"| {r.variant} | {r.width} | {r.params:,} | {r.steps} | {r.tokens:,} | {ep} | {r.flops:.2e} | — |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------
# the runs file
# ----------------------------------------------------------------------------------------------
class RunsFile:
    """Finished runs as JSON lines (``path=None``: kept in memory only), appended as each finishes, so a call cut by
    its limit loses at most the run in flight; :meth:`done` maps each run key to its record (the later wins)."""

    def __init__(self, path: str | Path | None, scale: str):
        self.path, self.scale, self.memory = (Path(path) if path else None), scale, []

    def load(self) -> list[dict]:
        import json

        if self.path is None or not self.path.is_file():
            return list(self.memory)
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def done(self) -> dict[str, dict]:
        return {r["key"]: r for r in self.load() if r.get("scale") == self.scale and "key" in r}

    def add(self, record: dict) -> None:
        import json

        record = dict(record, scale=self.scale, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self.memory.append(record)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------------------------
# one run
# ----------------------------------------------------------------------------------------------
def train_run(run: PlannedRun, *, depth: int, seq_len: int, batch_size: int, train_ids, val_sets: dict, device: str,
              dtype: str, cuda_graph: bool, eval_batches: int, vocab_size: int) -> dict:
    """Train ``run`` from its seed on disjoint windows of ``train_ids`` and return its record: the final training
    loss, the validation loss of each set in ``val_sets`` (name -> token ids, the same batches for every run),
    seconds and tokens/s."""
    import torch

    from k3lab.data import batch_iterator, window_batches
    from k3lab.experiments.scales import fit_graphed
    from k3lab.model import K3ForCausalLM
    from k3lab.train import TrainConfig

    cfg = family_config(run.variant, run.width, depth, vocab_size, seq_len)
    torch.manual_seed(run.seed)
    batches = window_batches(train_ids, batch_size, seq_len, seed=run.seed)
    if batches.capacity < run.steps:
        raise ValueError(f"steps={run.steps}: the training corpus holds {batches.capacity} disjoint batches of "
                         f"{batch_size} x {seq_len}; lower tokens_per_param or the widths")
    tc = TrainConfig(steps=run.steps, lr=run.lr, seed=run.seed, device=device, dtype=dtype, cuda_graph=cuda_graph,
                     eval_batches=eval_batches, progress=False)
    names = list(val_sets)
    t0 = time.perf_counter()
    model, result = fit_graphed(lambda: K3ForCausalLM(cfg), batches, tc, variant=f"{run.variant}/{run.width}",
                                val_batches=batch_iterator(val_sets[names[0]], batch_size, seq_len, seed=10_000))
    seconds = time.perf_counter() - t0
    losses = {names[0]: result.column("val_loss")[1][-1]}
    for name in names[1:]:
        losses[name] = evaluate(model, batch_iterator(val_sets[name], batch_size, seq_len, seed=10_000), eval_batches,
                                device, dtype)
    final = result.history[-1]["loss"]
    if not all(math.isfinite(x) for x in [final, *losses.values()]):
        raise FloatingPointError(f"{run.key}: loss is not finite (train {final}, val {losses})")
    return dict(key=run.key, kind=run.kind, variant=run.variant, width=run.width, seed=run.seed, steps=run.steps,
                lr=run.lr, tokens=run.tokens, flops=run.flops, params=run.params, train_loss=final,
                val_loss=losses[names[0]], val_losses=losses, seconds=seconds, tokens_per_s=run.tokens / seconds)


def evaluate(model, batches, n_batches: int, device: str, dtype: str) -> float:
    """Mean cross-entropy of ``model`` over ``n_batches`` batches of ``batches`` (step -> (x, y))."""
    import torch

    from k3lab.backend import resolve_device

    dev = resolve_device(device)
    model.eval()
    total = 0.0
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        for i in range(n_batches):
            x, y = batches(i) if callable(batches) else batches[i]
            out = model(x.to(dev), labels=y.to(dev))
            total += float(out.loss)
    model.train()
    return total / n_batches


def run_grid(runs: list[PlannedRun], runs_file: RunsFile, *, budget_s: float | None, run_budget_s: float | None,
             progress=None, **train_kw) -> dict:
    """Train every run of ``runs`` that ``runs_file`` does not hold yet, in order, each appended as it finishes.
    Stops starting runs when the next one is predicted (from the last run of its variant, scaled by its tokens) to
    end past ``budget_s``, and skips a run predicted to take longer than ``run_budget_s`` alone.
    Returns ``{"records": [...all finished...], "trained": n, "reused": n, "skipped": [keys], "seconds": s}``."""
    done = runs_file.done()
    start, trained, skipped, rate = time.perf_counter(), 0, [], {}
    todo = [r for r in runs if r.key not in done]
    for r in runs:
        if r.key in done:
            rate[r.variant] = done[r.key]["tokens_per_s"]
    bar = progress(total=len(todo), desc="runs") if progress else None
    for r in todo:
        predicted = r.tokens / rate[r.variant] if r.variant in rate else 0.0
        if run_budget_s is not None and predicted > run_budget_s:
            skipped.append(r.key)
        elif budget_s is not None and time.perf_counter() - start + predicted > budget_s:
            skipped.append(r.key)
        else:
            rec = train_run(r, **train_kw)
            runs_file.add(rec)
            rate[r.variant] = rec["tokens_per_s"]
            trained += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(r.key)
    if bar is not None:
        bar.close()
    keys = {r.key for r in runs}
    records = [rec for k, rec in runs_file.done().items() if k in keys]
    return dict(records=records, trained=trained, reused=len(runs) - len(todo), skipped=skipped,
                seconds=time.perf_counter() - start)


def fit_runs(records: list[dict], variant: str, loss: str = "val_loss") -> list[dict]:
    """The grid records of one variant as :func:`k3lab.experiments.scaling_fit.fit_power_law` runs (compute, loss,
    size, seed)."""
    return [dict(compute=r["flops"], loss=r[loss] if loss == "val_loss" else r["val_losses"][loss],
                 size=r["width"], seed=r["seed"]) for r in records if r["variant"] == variant and r["kind"] == "grid"]


# ----------------------------------------------------------------------------------------------
# the experiments and their data
# ----------------------------------------------------------------------------------------------
EXPERIMENTS: dict[str, dict] = {
    # SCALE-3 (KL §5.3): Kimi Linear (3 KDA : 1 MLA) vs all-MLA, MLA's hyper-parameters; paper 1.16x at equal loss
    "SCALE-3": dict(kind="multiplier", baseline="mla", variant="hybrid", paper=1.16),
    # AR-3 (AR §5.1): Block AttnRes matches a PreNorm baseline trained with 1.25x the compute
    "AR-3": dict(kind="multiplier", baseline="hybrid", variant="hybrid+attnres", paper=1.25),
    # HYB-2 (KL §5.2): of KDA : MLA = 0:1, 1:1, 3:1, 7:1, 3:1 has the lowest validation loss
    "HYB-2": dict(kind="losses", variants=["mla", "kda1:1", "hybrid", "kda7:1"], best="hybrid"),
}


def experiment_variants(experiment: str, variants=None) -> tuple[list[str], str]:
    """``(variants, baseline)`` of an experiment; ``variants`` given (a list) overrides the experiment's, the first
    being the baseline (e.g. the CPU scale's all-MLA AR-3: ``["mla", "mla+attnres"]``)."""
    if experiment not in EXPERIMENTS:
        raise ValueError(f"experiment={experiment!r}: allowed values are {tuple(EXPERIMENTS)}")
    spec = EXPERIMENTS[experiment]
    if variants:
        for v in variants:
            check_variant(v)
        return list(variants), variants[0]
    if spec["kind"] == "multiplier":
        return [spec["baseline"], spec["variant"]], spec["baseline"]
    return list(spec["variants"]), spec["variants"][0]


def package_source_ids(tokenizer):
    """This package's Python source, encoded (files sorted by path): the CPU scale's out-of-distribution set."""
    import numpy as np
    import torch

    root = Path(__file__).resolve().parents[1]
    text = "\n".join(p.read_text() for p in sorted(root.rglob("*.py")))
    return torch.from_numpy(np.asarray(tokenizer.encode(text), dtype=np.int64))


def validation_sets(corpus: str, tokenizer) -> tuple:
    """``(train_ids, {"in-distribution": ids, "out-of-distribution": ids})`` for the training corpus ``corpus``:
    code → held-out code files and the KJV Bible; kjv → held-out KJV and this package's own source."""
    from k3lab.data import corpus_ids, corpus_splits

    train, val = corpus_splits(tokenizer, corpus=corpus)
    ood = corpus_ids(tokenizer) if corpus == "code" else package_source_ids(tokenizer)
    return train, {"in-distribution": val, "out-of-distribution": ood}


def hyb2_verdict(means: dict, best: str) -> str:
    """HYB-2's rule at one size, ``means`` = variant -> (mean, lo, hi): "reproduced" when ``best`` has the lowest mean
    and its upper bound lies below every other ratio's mean; "contradicted" when another ratio's upper bound lies
    below ``best``'s mean; otherwise "not reproduced at this scale"."""
    m, lo, hi = means[best]
    others = {k: v for k, v in means.items() if k != best}
    if all(hi < v[0] for v in others.values()):
        return "reproduced"
    if any(v[2] < m for v in others.values()):
        return "contradicted"
    return "not reproduced at this scale"
