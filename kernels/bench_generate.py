"""Decoding speed measured through ``k3lab.infer.generate`` — the call a user makes (issue 36 item 5).

    python kernels/bench_generate.py                         # one GPU: small at batch 1/16/64, prompts 100/1,000/4,000
    python kernels/bench_generate.py --long 1048576          # + batch 1 with a real 1M-token prompt (~40 s of prefill)
    python kernels/bench_generate.py --cpu-smoke             # CPU, tiny preset, tiny sizes: checks the script runs

What one row is: ``generate(model, prompts, new, eos_token_id=None, decoder=D, stats=s)`` with ``B`` random prompts of
``prompt`` tokens each (greedy; no stop token, so every row decodes ``new`` tokens), timed by the call's own
:class:`~k3lab.infer.GenerationStats` (``decode_s``: device-synchronised wall seconds of the decode loop, the prefill
apart). Before the timed rows of a batch size, one warm-up call per batch bucket (the shortest prompt, 8 new tokens)
pays the first-call cost — for ``decoder="auto"`` on CUDA: the static buffers at the model's context and the CUDA
graph capture — which the row ``first call`` reports with ``stats.builds`` / ``stats.captures``; every timed row then
asserts it captured nothing (``captures == 0``): one graph per batch bucket serves every prompt length and
``max_new_tokens``.

Columns: tokens/s per row (``(new_tokens / B − 1) / decode_s``: the first token comes from the prefill's logits), aggregate (× B), ms a step, and the roofline: the bytes one
step must read (:func:`bench_infer.step_bytes`: every non-expert matrix, the expected distinct routed experts, the KDA
states read and written, the MLA latents at the row's mean context) over ``--hbm-tb-s`` (H100 SXM: 3.35 TB/s; H200:
4.8). The peer, in the same invocation: fla's ``KDAForCausalLM`` decoded by transformers' ``generate`` at fla's
anchor shape (pure KDA, 24 × 1024), beside k3lab's ``generate`` at the same shape (``kda-anchor``).
``--decoders`` adds rows for other decoders (``eager``: the reference path; ``compiled``: ``decoder="graph"`` with
``k3lab.infer.static.COMPILE_GRAPHED`` on; ``fused`` / ``unfused``: ``auto`` with the three fused decode kernels
switched on / off — the GEMV of :mod:`k3lab.kernels.gemv` in place of cuBLAS, the routed experts of
:mod:`k3lab.kernels.moe_decode` in place of the sorted grouped-GEMM path and the KDA step of
:mod:`k3lab.kernels.kda_decode_fused`, issue 36 item 2; all three are on by default, so ``auto`` = ``fused``).

The table at the end is the summary; ``--json`` (default ``runs/bench_generate.json``) gets every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import k3lab.infer.static as static_mod  # noqa: E402
from bench_infer import build, decode_config, fla_decode_row, reset_peak, step_bytes, sync  # noqa: E402
from k3lab.backend import resolve_device  # noqa: E402
from k3lab.config import DEVICES  # noqa: E402
from k3lab.infer import GenerationStats, generate  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DECODER_ROWS = ("auto", "eager", "compiled", "fused", "unfused")
# "compiled": decoder="graph" with COMPILE_GRAPHED on; "fused" / "unfused": decoder="auto" with the three fused decode
# kernels switched on / off (k3lab.kernels.gemv's GEMV, k3lab.kernels.moe_decode's routed experts and
# k3lab.kernels.kda_decode_fused's KDA step; "auto" runs them as the modules' ENABLED defaults say)
HBM_TB_S = {"H100": 3.35, "H200": 4.8}  # HBM bandwidth, TB/s (NVIDIA's data sheets: H100 SXM, H200)
FUSED_KERNELS = ("gemv", "moe_decode", "kda_decode_fused")


@contextlib.contextmanager
def fused_decode_kernels(on: bool | None):
    """The switch of the ``fused`` / ``unfused`` rows: the three kernels' ``ENABLED`` set to ``on`` while inside (a
    model's graphs are captured under it, so each decoder row gets its own model); ``None`` leaves the defaults."""
    if on is None:
        yield
        return
    import importlib

    modules = [importlib.import_module(f"k3lab.kernels.{name}") for name in FUSED_KERNELS]
    kept = [m.ENABLED for m in modules]
    for m in modules:
        m.ENABLED = on
    try:
        yield
    finally:
        for m, k in zip(modules, kept):
            m.ENABLED = k


def prompts_of(B: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (B, length), generator=g)


def run_generate(model, prompts: torch.Tensor, new: int, decoder: str) -> tuple[GenerationStats, torch.Tensor]:
    """One ``generate`` call as a user makes it (``decoder`` one of :data:`DECODER_ROWS`)."""
    st = GenerationStats()
    kept = static_mod.COMPILE_GRAPHED
    static_mod.COMPILE_GRAPHED = decoder == "compiled"
    try:
        with torch.no_grad(), fused_decode_kernels({"fused": True, "unfused": False}.get(decoder)):
            out = generate(model, prompts, new, eos_token_id=None, stats=st,
                           decoder={"compiled": "graph", "fused": "auto", "unfused": "auto"}.get(decoder, decoder))
    finally:
        static_mod.COMPILE_GRAPHED = kept
    return st, out


def rows_for(model, name: str, decoder: str, batches, lengths, new: int, hbm: float, device) -> list[dict]:
    """The warm-up (first-call) row and one timed row per prompt length, for each batch size."""
    vocab, rows = model.config.vocab_size, []
    for B in batches:
        t0 = time.perf_counter()
        st, _ = run_generate(model, prompts_of(B, min(lengths), vocab, seed=99), 8, decoder)
        sync(device)
        rows.append(dict(impl=f"k3lab generate({decoder})", model=name, B=B, prompt=min(lengths), new=8,
                         first_call_s=time.perf_counter() - t0, builds=st.builds, captures=st.captures,
                         capture_s=st.capture_s, kind="first call"))
        print(json.dumps(rows[-1]), flush=True)
        for length in lengths:
            st, out = run_generate(model, prompts_of(B, length, vocab, seed=length), new, decoder)
            per_row = (st.new_tokens / B - 1) / st.decode_s  # the first token comes from the prefill's logits
            row = dict(impl=f"k3lab generate({decoder})", model=name, B=B, prompt=length, new=new, kind="timed",
                       tokens_per_s_row=per_row, tokens_per_s=per_row * B, ms_per_step=1e3 * st.decode_s / (new - 1),
                       prefill_s=st.prefill_s, builds=st.builds, captures=st.captures,
                       first_tokens=out[0, length:length + 8].tolist())
            row["floor_ms"] = 1e3 * step_bytes(model, B, length + new // 2) / (hbm * 1e12)
            if decoder != "eager" and (st.captures or st.builds):
                row["error"] = f"replayed nothing: {st.builds} builds, {st.captures} captures after the warm-up"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def long_row(args, device, dtype) -> dict:
    """Batch 1 with a real ``--long``-token prompt through ``generate`` (the ``small`` preset with its context set to
    the prompt plus the new tokens, as K3's 1M: the static caches are sized by the model's context)."""
    cfg = decode_config(args.preset, args.cpu_smoke).replace(max_position_embeddings=args.long + args.new)
    model = build(cfg, device, dtype)
    st, _ = run_generate(model, prompts_of(1, 256, cfg.vocab_size, seed=7), 8, "auto")  # warm-up: build + capture
    warm = dict(builds=st.builds, captures=st.captures, capture_s=st.capture_s)
    st, out = run_generate(model, prompts_of(1, args.long, cfg.vocab_size, seed=8), args.new, "auto")
    row = dict(impl="k3lab generate(auto)", model=f"{args.preset} (context {args.long + args.new:,})", B=1,
               prompt=args.long, new=args.new, kind="timed", tokens_per_s_row=(st.new_tokens - 1) / st.decode_s,
               ms_per_step=1e3 * st.decode_s / (args.new - 1), prefill_s=st.prefill_s, warm_up=warm,
               builds=st.builds, captures=st.captures,
               floor_ms=1e3 * step_bytes(model, 1, args.long + args.new // 2) / (args.hbm_tb_s * 1e12))
    row["tokens_per_s"] = row["tokens_per_s_row"]
    del model
    reset_peak(device)
    return row


def table(rows: list[dict], hbm: float) -> str:
    lines = ["| implementation | model | batch | prompt | tokens/s per row | aggregate | ms/step | "
             f"floor ms ({hbm} TB/s) | floor / step | first call s (builds, captures) |", "|---" * 10 + "|"]
    for r in rows:
        if r.get("kind") == "first call":
            lines.append(f"| {r['impl']} | {r['model']} | {r['B']} | {r['prompt']:,} (warm-up) | | | | | | "
                         f"{r['first_call_s']:.1f} ({r['builds']}, {r['captures']}) |")
            continue
        if "tokens_per_s_row" not in r:
            lines.append(f"| {r['impl']} | {r['model']} | {r['B']} | {r.get('prompt', '')} | error: "
                         f"{r.get('error', '?')[:100]} |" + " |" * 5)
            continue
        floor = r.get("floor_ms")
        note = f" **{r['error']}**" if "error" in r else ""
        lines.append(f"| {r['impl']} | {r['model']} | {r['B']} | {r.get('prompt', r.get('context', 0)):,} | "
                     f"{r['tokens_per_s_row']:,.1f} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.3f} | "
                     f"{'–' if floor is None else f'{floor:.3f}'} | "
                     f"{'–' if floor is None else format(floor / r['ms_per_step'], '.0%')} |{note} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny preset, tiny sizes: a quick check that it runs")
    ap.add_argument("--device", default="auto", choices=DEVICES)
    ap.add_argument("--preset", default="small", choices=("tiny", "small"))
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompts", type=int, nargs="+", default=[100, 1000, 4000], help="prompt lengths, in one run")
    ap.add_argument("--new", type=int, default=64, help="greedy tokens a row")
    ap.add_argument("--decoders", nargs="+", default=["auto"], choices=DECODER_ROWS)
    ap.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=True,
                    help="k3lab generate at fla's pure-KDA anchor shape, batch 1 and the largest batch")
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                    help="fla KDAForCausalLM + transformers generate at the anchor shape (CUDA only)")
    ap.add_argument("--peer-new", type=int, default=16, help="greedy tokens a row for the peer (slower)")
    ap.add_argument("--long", type=int, default=0, help="also batch 1 with a real prompt of this many tokens")
    ap.add_argument("--hbm-tb-s", type=float, default=None,
                    help="HBM bandwidth for the roofline; default from the GPU's name (H100 SXM 3.35, H200 4.8)")
    ap.add_argument("--json", default="runs/bench_generate.json")
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):
        ap.set_defaults(device="cpu", preset="tiny", dtype="float32", batches=[1, 3], prompts=[20, 50], new=6,
                        decoders=["auto", "eager"], peer=False)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    if args.hbm_tb_s is None:
        args.hbm_tb_s = HBM_TB_S["H200"] if gpu and "H200" in gpu else HBM_TB_S["H100"]
    print(f"device {device} ({gpu or 'cpu'}), torch {torch.__version__}, preset {args.preset}, {args.dtype}, roofline at "
          f"{args.hbm_tb_s} TB/s", flush=True)
    rows: list[dict] = []

    def save():  # after every section: a run cut by its call's limit keeps the rows it measured
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(dict(settings=vars(args), device=str(device), gpu=gpu, torch=torch.__version__, rows=rows),
                          f, indent=1, default=str)
    for decoder in args.decoders:  # a model each: a decoder's buffers and graphs are kept per model
        model = build(decode_config(args.preset, args.cpu_smoke), device, dtype)
        try:
            rows += rows_for(model, args.preset, decoder, args.batches, args.prompts, args.new, args.hbm_tb_s, device)
        except Exception as err:  # keep the run going (the other decoders' rows still come); the row says what failed
            rows.append(dict(impl=f"k3lab generate({decoder})", model=args.preset, B=0, error=repr(err)[:300]))
            print(json.dumps(rows[-1]), flush=True)
        del model
        reset_peak(device)
        save()
    if args.anchor:
        model = build(decode_config("kda-anchor", args.cpu_smoke), device, dtype)
        for B in sorted({args.batches[0], args.batches[-1]}):
            rows += rows_for(model, "kda-anchor", "auto", [B], [max(args.prompts)], args.new, args.hbm_tb_s, device)
        del model
        reset_peak(device)
    save()
    if args.peer and device.type == "cuda":
        for B in sorted({args.batches[0], args.batches[-1]}):
            try:
                row = fla_decode_row(B, max(args.prompts), args.peer_new, device)
            except Exception as err:  # keep the run going; the row says what failed
                row = dict(impl="fla + transformers generate", model="kda-anchor", B=B, error=repr(err)[:300])
            row["prompt"] = max(args.prompts)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
    if args.long:
        try:
            rows.append(long_row(args, device, dtype))
        except Exception as err:
            rows.append(dict(impl="k3lab generate(auto)", model=args.preset, B=1, prompt=args.long,
                             error=repr(err)[:300]))
        print(json.dumps(rows[-1]), flush=True)
    save()
    print()
    print(table(rows, args.hbm_tb_s))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
