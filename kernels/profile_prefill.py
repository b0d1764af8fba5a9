"""Where the time of a long chunked prefill goes, and the least it can cost (issue 27 item 2).

    python kernels/profile_prefill.py            # one H200: `small`, bf16, 65,536 tokens in 16,384-token chunks
    python kernels/profile_prefill.py --smoke    # CPU, tiny preset, tiny sizes: checks the script runs (< 30 s)

Three parts, each printed as a short table (``--json`` gets every number):

1. **profile** — ``--preset`` (random init, ``--dtype``) prefills ``--context`` random tokens in ``--chunk``-token
   chunks through ``k3lab.infer.prefill_rows`` (after a warm-up prefill of two chunks), once for each MLA prefill
   path of ``--paths``, twice (the first run, with one-off work at new shapes, and the second, reported)
   (``k3lab.mixers.mla.PREFILL_ATTENTION``: ``sdpa`` = one SDPA call with the lower-right
   causal mask, the memory-efficient kernel — the path of before; ``cudnn``/``flash``/``efficient`` = the chunk's
   prefix and its own keys apart, merged by log-sum-exp, ``prefill_chunk_attention``); then the chunk at
   ``--profile-offset`` runs again on the cache of the tokens before it, twice as warm-up and once under
   ``torch.profiler``. Printed: GPU time per op category — the kernels classified by name (:data:`CATEGORIES`:
   KDA chunk kernels, MLA attention, MoE grouped GEMMs, dense GEMMs, elementwise/copy/reduce, other) — and the
   top ``--top`` kernels of the last path. On a CPU the categories are read from aten op names (self CPU time)
   and the MLA path does not apply (it is CUDA-only): the smoke checks that the script runs, nothing more.
2. **attention** — one MLA layer's chunk attention alone: q ``[1, H, T, d_qk]`` (T = ``--chunk``) against
   S = offset + T keys laid out as ``GatedMLA.attend_naive`` lays them out (``[B, S, H, d]`` transposed), at each
   of ``--attn-offsets``: the old path (offset 0: cuDNN ``is_causal``, as ``attend_naive``'s fused branch; else
   SDPA with ``causal_lower_right``) against ``prefill_chunk_attention`` on each ``--attn-backends``: ms (mean of
   ``--reps`` calls after the first; the first call's ms below it: cuDNN builds a graph per new shape, and a real
   prefill meets a new S at every chunk), TFLOP/s (``2·H·(d_qk + d_v)·(T·offset + T(T+1)/2)`` FLOPs) and the
   relative error against the old path. Then the
   attention time of a whole prefill of (last offset + T) tokens, predicted per path from a straight-line fit of
   ms against S: (number of MLA layers) × Σ over its chunks.
3. **floor** — the matmul FLOPs of a ``--floor-context``-token prefill of ``--floor-preset`` (:func:`flop_floor`)
   over ``--peak-tflops`` (H200 dense bf16: 989 TFLOP/s): the time no implementation can beat on that GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3lab.backend import resolve_device, synchronize  # noqa: E402
from k3lab.config import DEVICES, PRESETS, RUNNABLE_PRESETS, ModelConfig  # noqa: E402
from k3lab.costs import InferenceCosts  # noqa: E402
from k3lab.infer import cache as hcache  # noqa: E402
from k3lab.infer import prefill_rows  # noqa: E402
from k3lab.mixers import mla as mla_mod  # noqa: E402
from k3lab.model import K3ForCausalLM  # noqa: E402
from k3lab.testing import rel_err  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SECTIONS = ("profile", "attention", "floor")
H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA H200 SXM, dense (no sparsity) bf16 tensor-core peak
KDA_CHUNK = 64  # tokens per chunk of the KDA chunk kernel (k3lab.kernels.kda.CHUNK; not imported: needs triton)

# (category, regex on the kernel name, lower case), first match wins; CPU runs match aten op names
CATEGORIES = (
    ("KDA chunk kernels", r"kda|chunk_gated_delta|chunk_fwd|fused_recurrent"),
    ("MLA attention", r"fmha|flash|attention|sdpa|cudnn|scaled_dot_product"),
    ("MoE grouped GEMMs", r"group"),
    ("dense GEMMs", r"gemm|gemv|nvjet|xmma|cublas|cutlass|wgmma|s16816|splitk|aten::(mm|bmm|addmm|baddbmm)$"),
    ("elementwise/copy/reduce", r"elementwise|vectorized|reduce|copy|cat|index|scatter|gather|fill|softmax|norm|"
                                r"sort|radix|scan|cumsum|arange|where|unrolled|combine|attn_res|topk|memcpy|memset|"
                                r"pad|aten::"),
)
OTHER = "other"


def classify(name: str) -> str:
    """The op category of a kernel (or, on a CPU, an aten op) by its name: :data:`CATEGORIES`, else "other"."""
    low = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, low):
            return category
    return OTHER


# ----------------------------------------------------------------------------------------------
def flop_floor(cfg: ModelConfig, n_tokens: int, kda_chunk: int = KDA_CHUNK) -> dict:
    r"""Matmul FLOPs of one N-token prefill (batch 1), counted per component (FLOPs = 2 × multiply-accumulates):

    * weights: ``2·P_w·N`` with ``P_w`` the active parameters a token multiplies with
      (``ModelConfig.param_counts``: KDA and MLA projections, ``kv_b_proj`` once per token, the dense MLP, shared
      experts, top-k routed experts, router, LatentMoE projections, norms/AttnRes), the LM head excluded;
    * LM head: ``2·V·D`` once — the prefill computes the last position's logits only;
    * KDA chunk work per token, head and KDA layer, as the chunkwise kernel does it (chunk C, K = V = head dim):
      ``2·(3·K·V + C·(3·K + 2·V))`` — ``w S``, ``q S``, the state update ``kᵀ v_new`` (K·V each), the in-chunk
      ``A_kk``, ``A_qk``, ``w = A k`` (C·K each), ``u = A v`` and ``A_qk v_new`` (C·V each); the C×C triangular
      solve (O(C²)) not counted;
    * MLA causal attention per MLA layer: every (query, key) pair with key ≤ query costs ``2·H·(d_qk + d_v)``
      (scores and value sum), ``N(N+1)/2`` pairs: ``2·H·(d_qk + d_v)·N(N+1)/2 ≈ H·(d_qk + d_v)·N²``.

    Not counted (not matmuls, or not needed): softmax, norms, gates, activations, routing; the chunked path's
    re-expansion of the cached latent by ``kv_b_proj`` at every chunk (``reexpand`` below, reported apart).
    Returns a dict of FLOPs per row and the total.
    """
    N = int(n_tokens)
    counts = cfg.param_counts()
    by = counts["by_component"]
    lm_head = by["lm_head"]["active"]
    mixers = by["kda"]["active"] + by["mla"]["active"]
    mlp = sum(by[c]["active"] for c in ("dense_mlp", "routed_experts", "shared_experts", "router", "latent_projections"))
    rest = counts["active"] - lm_head - mixers - mlp  # norms, AttnRes pseudo-queries
    L = cfg.num_hidden_layers
    n_mla = sum(cfg.is_mla_layer(i) for i in range(L))
    n_kda = L - n_mla
    H, K = cfg.kda_heads, cfg.kda_head_dim
    V = K
    Hm, dqk, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    rows = {
        "mixer projections (KDA, MLA)": 2 * mixers * N,
        "MLP (dense, shared + top-k experts, router, latent)": 2 * mlp * N,
        "norms, AttnRes": 2 * rest * N,
        "LM head (last position)": 2 * lm_head,
        "KDA chunk work": n_kda * H * N * 2 * (3 * K * V + kda_chunk * (3 * K + 2 * V)),
        "MLA causal attention": n_mla * 2 * Hm * (dqk + dv) * N * (N + 1) // 2,
    }
    return dict(rows=rows, total=sum(rows.values()), n_tokens=N, kda_chunk=kda_chunk, mla_layers=n_mla, kda_layers=n_kda)


def reexpand_flops(cfg: ModelConfig, n_tokens: int, chunk: int) -> int:
    """FLOPs of the chunked path's ``kv_b_proj`` over each chunk's cached prefix (every chunk re-expands all earlier
    latents to per-head keys and values): ``n_mla · 2·r·H·(nope + v) · Σ_chunks offset`` — not in the floor."""
    n_mla = sum(cfg.is_mla_layer(i) for i in range(cfg.num_hidden_layers))
    per_key = 2 * cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return n_mla * per_key * sum(range(0, n_tokens - chunk + 1, chunk))


def print_floor(args, out: dict) -> None:
    cfg = ModelConfig.preset(args.floor_preset)
    N = args.floor_context
    fl = flop_floor(cfg, N, args.kda_chunk)
    peak = args.peak_tflops * 1e12
    print(f"\n## FLOP floor: a {N:,}-token prefill of `{args.floor_preset}` at {args.peak_tflops:g} TFLOP/s "
          f"(dense bf16 peak)")
    print("assumptions: batch 1; FLOPs = 2 x multiply-accumulates of matmuls only (softmax, norms, gates, routing "
          "not counted);\n  weights: 2 x active parameters per token (top-k routed experts, kv_b_proj once per token), "
          "LM head at the last position only;\n  KDA: the chunk kernel's work, 2(3KV + C(3K + 2V)) per token and head, "
          f"C = {fl['kda_chunk']}; MLA: causal pairs only, 2H(d_qk + d_v) N(N+1)/2 per layer;\n  every FLOP at the "
          "peak rate (no kernel reaches it: the floor bounds, it does not predict)")
    for name, flops in fl["rows"].items():
        print(f"  {name:<52} {flops:12.4e} FLOPs  {flops / peak:9.3f} s  {100 * flops / fl['total']:5.1f}%")
    print(f"  {'total':<52} {fl['total']:12.4e} FLOPs  {fl['total'] / peak:9.3f} s")
    extra = reexpand_flops(cfg, N, args.chunk_floor)
    costs = InferenceCosts(cfg).prefill_flops(N)
    print(f"  not in the floor: kv_b_proj re-expanding the cached prefix at each {args.chunk_floor:,}-token chunk "
          f"{extra:.4e} FLOPs ({extra / peak:.3f} s)")
    print(f"  for reference, k3lab.costs prefill_flops (KDA as 7HKV a token, LM head at every position): {costs:.4e}")
    out["floor"] = dict(fl, preset=args.floor_preset, peak_tflops=args.peak_tflops, seconds=fl["total"] / peak,
                        reexpand_flops=extra, costs_prefill_flops=costs)


# ----------------------------------------------------------------------------------------------
def old_attention(q, k, v, scale: float):
    """The chunk attention as ``GatedMLA.attend_naive`` ran it before the split: on CUDA in bf16/fp16 at offset 0
    cuDNN with ``is_causal``, on a cache SDPA with the lower-right causal mask (memory-efficient kernel);
    elsewhere the float32 math path."""
    T, S = q.shape[2], k.shape[2]
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return mla_mod.attention_math(q, k, v, scale, S - T)[0]
    if S == T:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S), scale=scale)


def first_call(fn, device: torch.device):
    """(``fn()``, its milliseconds, synchronised): the first call at a new shape includes one-off work (cuDNN builds
    and caches an execution graph per shape)."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, 1e3 * (time.perf_counter() - t0)


def mean_ms(fn, reps: int, device: torch.device) -> float:
    """Mean milliseconds of ``fn()`` over ``reps`` calls (CUDA events on a GPU), after the caller's warm-up."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def attention_inputs(cfg: ModelConfig, T: int, S: int, device, dtype, seed: int = 0):
    """q [1, H, T, d_qk], k [1, H, S, d_qk], v [1, H, S, d_v] strided as in ``attend_naive`` (per-token rows
    ``[S, H, d]`` transposed; v a slice of the ``kv_b_proj`` output ``[S, H, nope + v]``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    H, nope, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    dqk = nope + cfg.qk_rope_head_dim
    q = torch.randn(1, T, H, dqk, device=device, dtype=dtype, generator=g).transpose(1, 2)
    k = torch.randn(1, S, H, dqk, device=device, dtype=dtype, generator=g).transpose(1, 2)
    v = torch.randn(1, S, H, nope + dv, device=device, dtype=dtype, generator=g)[..., nope:].transpose(1, 2)
    return q, k, v


def section_attention(args, cfg, device, dtype, out: dict) -> None:
    T = args.chunk
    H, dqk, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    scale = dqk ** -0.5
    paths = ["old"] + list(args.attn_backends)
    print(f"\n## MLA chunk attention alone: one layer of `{args.preset}` (H={H}, d_qk={dqk}, d_v={dv}), "
          f"T={T:,} queries, {args.dtype}, {device.type}")
    print(f"{'offset':>10} {'S':>10}  " + "  ".join(f"{p + ' ms':>12} {'TF/s':>6}" for p in paths) + "  rel err vs old")
    rows = []
    for offset in args.attn_offsets:
        S = offset + T
        q, k, v = attention_inputs(cfg, T, S, device, dtype)
        flops = 2 * H * (dqk + dv) * (T * offset + T * (T + 1) // 2)
        row = dict(offset=offset, S=S, flops=flops, ms={}, first_ms={}, tflops={}, rel_err={}, error={})
        with torch.no_grad():
            ref, row["first_ms"]["old"] = first_call(lambda: old_attention(q, k, v, scale), device)
            row["ms"]["old"] = mean_ms(lambda: old_attention(q, k, v, scale), args.reps, device)
            for b in args.attn_backends:
                try:
                    got, row["first_ms"][b] = first_call(lambda: mla_mod.prefill_chunk_attention(q, k, v, scale, b), device)
                    row["rel_err"][b] = rel_err(got, ref)
                    del got
                    row["ms"][b] = mean_ms(lambda: mla_mod.prefill_chunk_attention(q, k, v, scale, b), args.reps, device)
                except (RuntimeError, ValueError) as e:  # a backend this torch/GPU refuses: reported, not fatal
                    row["error"][b] = str(e).splitlines()[0][:160]
        ref = q = k = v = None  # free [S, H, d] keys and values before the next offset
        for p, ms in row["ms"].items():
            row["tflops"][p] = flops / (ms * 1e-3) / 1e12
        cells = "  ".join(f"{row['ms'][p]:12.2f} {row['tflops'][p]:6.1f}" if p in row["ms"] else f"{'failed':>12} {'':>6}"
                          for p in paths)
        errs = ", ".join(f"{b} {e:.1e}" for b, e in row["rel_err"].items())
        print(f"{offset:>10,} {S:>10,}  {cells}  {errs}", flush=True)
        print(f"{'':>10} {'first call':>10}  " + "  ".join(f"{row['first_ms'][p]:12.2f} {'':>6}" if p in row["first_ms"]
                                                         else f"{'':>12} {'':>6}" for p in paths))
        for b, e in row["error"].items():
            print(f"           {b} failed: {e}")
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["attention"] = dict(T=T, H=H, d_qk=dqk, d_v=dv, rows=rows)
    # a whole prefill of (last offset + T) tokens: ms = a + b·S fitted per path, summed over the chunks, × MLA layers
    total_tokens = max(args.attn_offsets) + T
    n_mla = sum(cfg.is_mla_layer(i) for i in range(cfg.num_hidden_layers))
    chunk_S = [c + T for c in range(0, total_tokens - T + 1, T)]
    predicted = {}
    for p in paths:
        pts = [(r["S"], r["ms"][p]) for r in rows if p in r["ms"]]
        if len(pts) < 2:
            continue
        xs = torch.tensor([s for s, _ in pts], dtype=torch.float64)
        ys = torch.tensor([m for _, m in pts], dtype=torch.float64)
        b = ((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum()
        a = ys.mean() - b * xs.mean()
        predicted[p] = n_mla * sum(float(a + b * s) for s in chunk_S) / 1e3
    if predicted:
        print(f"attention over a {total_tokens:,}-token prefill in {T:,}-token chunks (MLA layers: {n_mla}; ms = a + b·S "
              "fitted to the rows above): " + ", ".join(f"{p} {s:.2f} s" for p, s in predicted.items()))
    out["attention"]["predicted_prefill_s"] = predicted
    out["attention"]["predicted_tokens"] = total_tokens


# ----------------------------------------------------------------------------------------------
def kernel_times(prof, device: torch.device) -> dict[str, list]:
    """{name: [calls, µs]}: GPU kernels (device time) on CUDA; on a CPU the ops' self CPU time."""
    per = defaultdict(lambda: [0, 0.0])
    if device.type == "cuda":
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name][0] += 1
                per[e.name][1] += e.device_time
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                per[e.key][0] += e.count
                per[e.key][1] += e.self_cpu_time_total
    return dict(per)


def section_profile(args, cfg, device, dtype, out: dict) -> None:
    N, chunk, off = args.context, args.chunk, args.profile_offset
    if off % chunk or not 0 <= off <= N - chunk:
        raise ValueError(f"--profile-offset={off}: must be a multiple of --chunk={chunk} in [0, {N - chunk}]")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, N), generator=g).to(device)
    default = mla_mod.PREFILL_ATTENTION
    res = dict(context=N, chunk=chunk, offset=off, paths={})
    print(f"\n## prefill of {N:,} tokens in {chunk:,}-token chunks (`{args.preset}`, {args.dtype}, {device.type})")
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            prefill_rows(model, ids[:, : min(N, 2 * chunk)], chunk_size=chunk)  # warm-up: kernels compiled
            synchronize(device)
            print(f"warm-up prefill of {min(N, 2 * chunk):,} tokens: {time.perf_counter() - t0:.1f} s", flush=True)
            for path in args.paths:
                mla_mod.PREFILL_ATTENTION = path
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                seconds = []
                for _ in range(2):  # the first run includes one-off work at new shapes (cuDNN graphs), the second not
                    t0 = time.perf_counter()
                    pre = prefill_rows(model, ids, chunk_size=chunk)
                    synchronize(device)
                    seconds.append(time.perf_counter() - t0)
                    del pre
                peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
                s = seconds[1]
                res["paths"][path] = dict(prefill_s=s, first_prefill_s=seconds[0], tokens_per_s=N / s, peak_gib=peak)
                print(f"MLA path {path:<9}: {s:.2f} s, {N / s:,.0f} tokens/s (first run {seconds[0]:.2f} s)"
                      + ("" if peak is None else f", peak {peak:.2f} GiB"), flush=True)
            cache = prefill_rows(model, ids[:, :off], chunk_size=chunk).cache if off else None
            piece = ids[:, off: off + chunk]
            for path in args.paths:
                mla_mod.PREFILL_ATTENTION = path
                for _ in range(2):
                    hcache.forward(model, piece, cache, last=1)
                synchronize(device)
                t0 = time.perf_counter()
                hcache.forward(model, piece, cache, last=1)
                synchronize(device)
                wall_ms = 1e3 * (time.perf_counter() - t0)
                act = torch.profiler.ProfilerActivity
                with torch.profiler.profile(activities=[act.CUDA if device.type == "cuda" else act.CPU]) as prof:
                    hcache.forward(model, piece, cache, last=1)
                    synchronize(device)
                per = kernel_times(prof, device)
                res["paths"].setdefault(path, {}).update(chunk_wall_ms=wall_ms, kernels=per)
    finally:
        mla_mod.PREFILL_ATTENTION = default
    unit = "GPU" if device.type == "cuda" else "self CPU"
    how = "kernel name" if device.type == "cuda" else "aten op name; the MLA path is CUDA-only, the paths run the same code"
    print(f"\none {chunk:,}-token chunk at offset {off:,}, {unit} time per op category (ms; by {how}):")
    names = [c for c, _ in CATEGORIES] + [OTHER]
    print(f"  {'category':<26}" + "".join(f"{p:>12}" for p in args.paths))
    cats = {}
    for path in args.paths:
        acc = defaultdict(float)
        for name, (_, us) in res["paths"][path]["kernels"].items():
            acc[classify(name)] += us / 1e3
        cats[path] = dict(acc)
        res["paths"][path]["categories_ms"] = cats[path]
        res["paths"][path]["total_ms"] = sum(acc.values())
        res["paths"][path]["kernel_calls"] = sum(c for c, _ in res["paths"][path]["kernels"].values())
    for c in names:
        print(f"  {c:<26}" + "".join(f"{cats[p].get(c, 0.0):12.2f}" for p in args.paths))
    print(f"  {'total (' + unit + ')':<26}" + "".join(f"{res['paths'][p]['total_ms']:12.2f}" for p in args.paths))
    print(f"  {'kernel/op calls':<26}" + "".join(f"{res['paths'][p]['kernel_calls']:12d}" for p in args.paths))
    print(f"  {'chunk wall (synchronised)':<26}" + "".join(f"{res['paths'][p]['chunk_wall_ms']:12.2f}" for p in args.paths))
    last = args.paths[-1]
    print(f"\ntop {args.top} by {unit} time, path {last}:")
    top = sorted(res["paths"][last]["kernels"].items(), key=lambda kv: -kv[1][1])[: args.top]
    for name, (calls, us) in top:
        print(f"  {us / 1e3:9.3f} ms {calls:5d}x  {classify(name):<24} {name[:100]}")
    for p in res["paths"].values():  # the JSON keeps the top kernels only
        p["kernels"] = dict(sorted(p["kernels"].items(), key=lambda kv: -kv[1][1])[: args.top])
    out["profile"] = res
    del model, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, tiny sizes: checks the script runs")
    ap.add_argument("--device", default="auto", choices=DEVICES)
    ap.add_argument("--preset", default="small", choices=RUNNABLE_PRESETS)
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--context", type=int, default=65536, help="prefill tokens of the profile (default %(default)s)")
    ap.add_argument("--chunk", type=int, default=16384,
                    help="prefill chunk = queries of the attention rows (default %(default)s)")
    ap.add_argument("--profile-offset", type=int, default=49152, help="the profiled chunk starts here (default %(default)s)")
    ap.add_argument("--paths", nargs="+", default=["sdpa", mla_mod.PREFILL_ATTENTION],
                    choices=mla_mod.PREFILL_ATTENTION_BACKENDS,
                    help="MLA prefill paths profiled, the last one's top kernels printed (default %(default)s)")
    ap.add_argument("--attn-offsets", type=int, nargs="+", default=[0, 65536, 262144, (1 << 20) - 16384])
    ap.add_argument("--attn-backends", nargs="+", default=["cudnn", "flash", "efficient"], choices=mla_mod.LSE_BACKENDS)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per attention row after one warm-up")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--floor-preset", default="small", choices=PRESETS)
    ap.add_argument("--floor-context", type=int, default=1 << 20)
    ap.add_argument("--chunk-floor", type=int, default=16384, help="chunk of the floor's re-expansion row")
    ap.add_argument("--kda-chunk", type=int, default=KDA_CHUNK)
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    ap.add_argument("--json", default="runs/profile_prefill.json", help="every number ('' = none)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--smoke" in argv:  # smoke defaults; explicit flags still win
        ap.set_defaults(device="cpu", preset="tiny", dtype="float32", context=256, chunk=64, profile_offset=192,
                        paths=["sdpa"], attn_offsets=[0, 64, 192], attn_backends=["math"], reps=1, json="")
    args = ap.parse_args(argv)
    for name in ("context", "chunk", "reps", "floor_context", "chunk_floor", "kda_chunk", "top"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.peak_tflops <= 0:
        ap.error(f"--peak-tflops={args.peak_tflops}: must be > 0")
    if any(o < 0 for o in args.attn_offsets):
        ap.error(f"--attn-offsets={args.attn_offsets}: must be >= 0")
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    cfg = ModelConfig.preset(args.preset)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    print(f"device {device} ({gpu or 'cpu'}), torch {torch.__version__}, cuDNN {cudnn}, preset {args.preset}, "
          f"{args.dtype}, default MLA prefill path {mla_mod.PREFILL_ATTENTION!r}", flush=True)
    out = dict(settings=vars(args), device=str(device), gpu=gpu, torch=torch.__version__, cudnn=cudnn)
    t_start = time.perf_counter()
    if "profile" in args.sections:
        section_profile(args, cfg, device, dtype, out)
    if "attention" in args.sections:
        section_attention(args, cfg, device, dtype, out)
    if "floor" in args.sections:
        print_floor(args, out)
    out["seconds"] = time.perf_counter() - t_start
    print(f"\n[{out['seconds']:.0f} s]")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
