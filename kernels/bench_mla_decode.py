"""Time the split-K MLA decode kernel (k3lab.kernels.mla_decode) against latent_attention_lowp's bmm path on CUDA.

    python kernels/bench_mla_decode.py                  # the table (about 30-40 s on an H200)
    python kernels/bench_mla_decode.py --ranks 256      # small's kv_lora_rank only (default: small's and K3's 512)
    python kernels/bench_mla_decode.py --sweep          # also re-time launch-parameter candidates of the kernel
    python kernels/bench_mla_decode.py --json out.json  # also write every number
    python kernels/bench_mla_decode.py --smoke          # a tiny case on CPU under TRITON_INTERPRET=1 (tests run it)

One decode step's absorbed attention of one MLA layer: T = 1 new token, H heads and ρ (qk_rope_head_dim) from
the ``small`` preset, kv_lora_rank R (``--ranks``), a bf16 cache [B, S, R] + [B, S, ρ] under an all-True key mask,
fp32 queries, for (B, S) in (1, 4K), (1, 64K), (1, 1M), (16, 64K), (64, 4K), (64, 64K). Each path is captured in a
CUDA graph of many calls (as graphed decoding runs it: no launch overhead) over enough copies of the cache that a
replay reads at least 256 MiB — not served from the 50 MB L2 — and the time is the median of five replays
divided by the calls. GB/s = bytes of c_kv + k_rope read ÷ time; % of the H200's 4.8 TB/s. Error: the largest
per-row relative error ‖kernel − bmm‖ / ‖bmm‖ over the rows (b, h, t).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [(1, 4096), (1, 65536), (1, 1 << 20), (16, 65536), (64, 4096), (64, 65536)]
PEAK_GBPS = 4800.0  # H200 HBM3e
FLUSH_BYTES = 256 << 20  # a replay reads at least this much cache (copies cycled): beyond the L2
MAX_COPIES = 128
REPLAY_SECONDS = 0.03  # calls per graph: about this long a replay
MAX_CALLS = 256
SWEEP = [dict(block_s=bs, num_stages=st, programs_per_sm=pp) for bs in (32, 64, 128) for st in (2, 3, 4)
         for pp in (1, 2, 4)]


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, one tiny case")
    ap.add_argument("--ranks", default=None, help="comma-separated kv_lora_rank values (default: small's, 512)")
    ap.add_argument("--sweep", action="store_true", help="re-time launch-parameter candidates per case")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    return ap.parse_args(argv)


def row_rel_err(got, want) -> float:
    """Largest ‖got − want‖ / ‖want‖ over the last-dim rows."""
    return ((got - want).double().norm(dim=-1) / want.double().norm(dim=-1).clamp_min(1e-30)).max().item()


def fmt_row(r: dict) -> str:
    return (f"| {r['B']:>3} | {r['S']:>9,} | {r['R']:>3} | {r['path']:<6} | {r['ms']:9.4f} | {r['gbps']:8.1f} | "
            f"{r['pct_peak']:5.1f}% | {r['max_rel_err']:.2e} |")


HEADER = ("| B | S | R | path | ms | GB/s | % 4.8 TB/s | max rel err vs bmm |\n"
          "|---|---|---|---|---|---|---|---|")


def smoke() -> int:
    """A tiny case under the interpreter: the kernel against the float64 reference (the bmm path needs CUDA),
    through the same row formatting."""
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from k3lab.kernels.mla_decode import mla_decode_attention, mla_decode_reference

    gen = torch.Generator().manual_seed(0)
    B, T, H, R, rho, S = 2, 1, 4, 32, 8, 100
    q_latent, q_rope = torch.randn(B, T, H, R, generator=gen), torch.randn(B, T, H, rho, generator=gen)
    c_kv = torch.randn(B, S, R, generator=gen).bfloat16()
    k_rope = torch.randn(B, S, rho, generator=gen).bfloat16()
    key_mask = torch.ones(B, S, dtype=torch.bool)
    key_mask[1, :30] = False
    scale = (R + rho) ** -0.5
    mla_decode_attention(q_latent, q_rope, c_kv, k_rope, scale, key_mask, splits=2)  # first call: trace
    t0 = time.perf_counter()
    got = mla_decode_attention(q_latent, q_rope, c_kv, k_rope, scale, key_mask, splits=2)
    ms = (time.perf_counter() - t0) * 1e3
    want = mla_decode_reference(q_latent, q_rope, c_kv, k_rope, scale, key_mask).float()
    err = row_rel_err(got, want)
    nbytes = c_kv.numel() * c_kv.element_size() + k_rope.numel() * k_rope.element_size()
    print("# smoke: CPU, TRITON_INTERPRET=1; the error column is against the float64 reference (bmm needs CUDA)")
    print(HEADER)
    print(fmt_row(dict(B=B, S=S, R=R, path="kernel", ms=ms, gbps=nbytes / ms / 1e6,
                       pct_peak=100 * nbytes / ms / 1e6 / PEAK_GBPS, max_rel_err=err)))
    if not err < 1e-2:
        print(f"smoke: FAILED, max relative error {err:.3e} vs the float64 reference")
        return 1
    print("smoke: ok (CPU interpreter: the times mean nothing)")
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    if args.smoke:
        return smoke()
    import torch

    from k3lab.config import ModelConfig
    from k3lab.kernels import mla_decode
    from k3lab.mixers.mla import latent_attention_lowp

    if not torch.cuda.is_available():
        print("needs CUDA (or --smoke)")
        return 2
    t_start = time.perf_counter()
    cfg = ModelConfig.preset("small")
    H, rho = cfg.num_attention_heads, cfg.qk_rope_head_dim
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else sorted({cfg.kv_lora_rank, 512})
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; small: H={H}, ρ={rho}, "
          f"kv_lora_rank={cfg.kv_lora_rank}; T=1, bf16 cache, fp32 q")
    print(HEADER)
    rows = []

    def graph_ms(fn, copies: int) -> float:
        """fn(i) one call on cache copy i; per-call ms of a CUDA graph of many calls, median of 5 replays."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(0)  # compile / warm up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(0)
        torch.cuda.synchronize()
        est = time.perf_counter() - t0  # launch overhead included: an upper bound
        calls = max(1, min(MAX_CALLS, math.ceil(REPLAY_SECONDS / est)))
        calls = max(calls, min(copies, MAX_CALLS))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i % copies)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        del graph
        return statistics.median(times)

    def run_case(R: int, B: int, S: int) -> None:
        """Both paths on one (B, S, R): rows printed and appended; the cache copies are freed on return."""
        nbytes = B * S * (R + rho) * 2
        copies = max(1, min(MAX_COPIES, math.ceil(FLUSH_BYTES / nbytes)))
        g = torch.Generator(device=dev).manual_seed(B + S + R)
        c_all = torch.randn(copies * B, S, R, device=dev, generator=g, dtype=torch.bfloat16)
        k_all = torch.randn(copies * B, S, rho, device=dev, generator=g, dtype=torch.bfloat16)
        q_lat = torch.randn(B, 1, H, R, device=dev, generator=g) * 4.0  # logits of a few units
        q_rope = torch.randn(B, 1, H, rho, device=dev, generator=g)
        key_mask = torch.ones(B, S, dtype=torch.bool, device=dev)

        def kernel(i):
            c, k = c_all[i * B:(i + 1) * B], k_all[i * B:(i + 1) * B]
            return mla_decode.mla_decode_attention(q_lat, q_rope, c, k, scale, key_mask)

        def bmm(i):
            c, k = c_all[i * B:(i + 1) * B], k_all[i * B:(i + 1) * B]
            mla_decode.ENABLED = False
            try:
                return latent_attention_lowp(q_lat, q_rope, c, k, scale, S - 1, key_mask)
            finally:
                mla_decode.ENABLED = True

        err = row_rel_err(kernel(0), bmm(0))
        for path, fn in (("kernel", kernel), ("bmm", bmm)):
            ms = graph_ms(fn, copies)
            row = dict(B=B, S=S, R=R, H=H, rho=rho, path=path, ms=ms, gbps=nbytes / ms / 1e6,
                       pct_peak=100 * nbytes / ms / 1e6 / PEAK_GBPS, max_rel_err=err if path == "kernel" else 0.0)
            if path == "kernel":
                launch = mla_decode.launch_config(H, R, rho)
                groups = math.ceil(H / launch["BLOCK_M"])
                row["splits"] = mla_decode.num_splits(B, groups, S, launch["BLOCK_S"], mla_decode.sm_count(dev))[0]
            rows.append(row)
            print(fmt_row(row), flush=True)
        if args.sweep:
            saved = {k: (dict(v) if isinstance(v, dict) else v) for k, v in mla_decode.LAUNCH.items()}
            results = []
            for cand in SWEEP:
                mla_decode.LAUNCH.update(block_s={256: cand["block_s"], 512: cand["block_s"]},
                                         num_stages=cand["num_stages"], programs_per_sm=cand["programs_per_sm"])
                try:
                    results.append((graph_ms(kernel, copies), cand))
                except Exception as exc:  # out of shared memory and the like (at the warm-up call): skip it
                    print(f"#   sweep {cand}: {type(exc).__name__}")
                finally:
                    mla_decode.LAUNCH.clear()
                    mla_decode.LAUNCH.update(saved)
            for ms, cand in sorted(results, key=lambda x: x[0])[:3]:
                print(f"#   sweep B={B} S={S} R={R}: {ms:.4f} ms ({nbytes / ms / 1e6:.0f} GB/s) {cand}")
                rows.append(dict(B=B, S=S, R=R, path="sweep", ms=ms, launch=cand))

    with torch.no_grad():
        for R in ranks:
            for B, S in CASES:
                run_case(R, B, S)
                torch.cuda.empty_cache()
    print(f"# {time.perf_counter() - t_start:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                                                   rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
