"""Inference on one GPU: a 1,048,576-token chunked prefill of the ``small`` preset, decoding at that
context, MTP speculative decoding, and passkey retrieval past the training length (k3lab.infer).

    python kernels/bench_infer.py                       # one H200: every section at full size
    python kernels/bench_infer.py --sections prefill    # only the long-context prefill + decode
    python kernels/bench_infer.py --cpu-smoke           # CPU, tiny sizes: checks the script runs (~minutes)

Sections (``--sections``, default all):

* ``check``   — the fast paths against the references at a small size, in the benchmark's dtype:
  chunked prefill vs one forward (logits), the MLA chunk-on-cache path (on CUDA without grad: prefix +
  chunk on cuDNN merged by log-sum-exp) vs the fp32 math path, decoding on ``--backend`` (Triton decode step on CUDA) vs the torch backend;
* ``prefill`` — ``--context`` random tokens through the ``--preset`` model (weights in ``--dtype``) in
  chunks of ``--chunk`` (``k3lab.infer.prefill_rows``): wall time (synchronised), tokens/s, peak memory
  (``torch.cuda.max_memory_allocated`` after a reset; weights included), the cache bytes held at the
  end (``K3Cache.nbytes()``) against ``k3lab.costs.InferenceCosts(cfg, "k3", kv_bytes, state_bytes=4)
  .cache_bytes(context)`` (they must be equal: the row says so); then ``--decode-tokens`` greedy tokens
  at that context and at ``--short-context`` (tokens/s; the number of Triton decode-step calls is counted);
* ``spec``    — the preset with an MTP head, trained ``--spec-steps`` steps on the KJV corpus (bf16
  autocast, AdamW); ``--spec-prompts`` validation prompts of ``--spec-prompt-len`` tokens, each decoded
  alone (batch 1: the latency case speculative decoding is for) for ``--spec-new`` tokens, plain greedy
  vs ``draft=k`` for each ``--spec-k``: acceptance (accepted / drafted), tokens per verify forward,
  decode tokens/s, speedup = plain decode time / speculative decode time, and how many rows came out
  identical to plain greedy (in bf16 a verify forward over k+1 tokens rounds differently from k+1 one-token
  steps, so a near-tie can flip; in fp32 on CPU they are identical, tests/test_infer.py); first the graphed decoder
  (batch 1, 4K context): graphed plain vs graphed ``draft=k``;
* ``passkey`` — the tiny preset (dense MLPs, a 64-token synthetic vocabulary, as notebook 05) trained
  ``--passkey-steps`` steps on passkey rows of ``--passkey-train-len`` tokens, then asked for the key
  at 1×, 4×, 16×, … ``--passkey-max-multiple``× that length through ``k3lab.infer.generate`` (chunked
  prefill, one greedy token): accuracy per length, for the 3:1 hybrid and all-MLA.

* ``decode``  — decoding speed, the three implementations side by side: k3lab's eager decoder (functional
  caches), k3lab's graphed decoder (``decoder="graph"``: preallocated caches, one CUDA graph replay a
  step; ``static`` off CUDA) and, for the pure-KDA shape of fla's anchor (``kda-anchor``: 24 layers ×
  1024, 8 heads × 128, dense MLP, vocab 32,000), fla's ``KDAForCausalLM`` decoded by transformers'
  ``generate``. For each model of ``--decode-models``, batch of ``--decode-batches`` and context of
  ``--decode-contexts``: tokens/s per row and aggregate over ``--decode-new`` greedy tokens, the first
  call's time (warm-up + capture for the graph), peak memory, and the roofline: the bytes one step must
  read (weights touched: every non-expert matrix, the ``lm_head``, the expected number of distinct routed
  experts ``E·(1 − (1 − k/E)^B)`` per MoE layer; the KDA states read and written; the MLA latents read)
  over ``--hbm-tb-s`` (H200: 4.8 TB/s). The prompt's cache is made by prefilling 256 tokens and tiling
  the MLA latents to the context (a step's work does not depend on what the cache holds), so a 1M-token
  context costs no 1M-token prefill here; fla's rows prefill their prompt for real.

The table at the end is the summary; ``--json`` (default ``runs/bench_infer.json``) gets every number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3lab.backend import resolve_backend, resolve_device  # noqa: E402
from k3lab.config import DEVICES, RUNNABLE_PRESETS, ModelConfig  # noqa: E402
from k3lab.costs import InferenceCosts  # noqa: E402
from k3lab.infer import GenerationStats, StaticDecoder, decode, generate, prefill, prefill_rows  # noqa: E402
from k3lab.infer.static import slots_for  # noqa: E402
from k3lab.infer.step import Prefilled  # noqa: E402
from k3lab.mixers.mla import MLACache  # noqa: E402
from k3lab.model import K3Cache  # noqa: E402
from k3lab.model import K3ForCausalLM  # noqa: E402
from k3lab.testing import rel_err  # noqa: E402

SECTIONS = ("check", "prefill", "spec", "passkey", "decode")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def build(cfg: ModelConfig, device, dtype, seed=0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


class count_triton_decode:
    """Counts calls of k3lab.kernels.kda_decode_step (the KDA layer imports it at every call)."""

    def __enter__(self):
        self.calls = 0
        try:
            import k3lab.kernels as kernels
        except ImportError:
            self.kernels = None
            return self
        self.kernels, self.real = kernels, kernels.kda_decode_step

        def counted(*a, **k):
            self.calls += 1
            return self.real(*a, **k)

        kernels.kda_decode_step = counted
        return self

    def __exit__(self, *exc):
        if self.kernels is not None:
            self.kernels.kda_decode_step = self.real


# ----------------------------------------------------------------------------------------------
def efficient_attention_usable(cfg, device, dtype) -> bool | None:
    """Whether SDPA's memory-efficient kernel takes MLA's shapes (qk = nope + rope, v) — the kernel the
    lower-right causal mask of a prefill chunk on a cache dispatches to; without it torch materialises the
    [chunk, context] mask (and the math path its scores), which a 1M-token context cannot hold."""
    if device.type != "cuda":
        return None
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention

    H, dqk, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    q = torch.empty(1, H, 64, dqk, device=device, dtype=dtype)
    k = torch.empty(1, H, 128, dqk, device=device, dtype=dtype)
    v = torch.empty(1, H, 128, dv, device=device, dtype=dtype)
    try:
        return bool(can_use_efficient_attention(SDPAParams(q, k, v, None, 0.0, False, False), True))
    except TypeError:  # older SDPAParams signature (no enable_gqa)
        return bool(can_use_efficient_attention(SDPAParams(q, k, v, None, 0.0, False), True))


def section_check(args, cfg, device, dtype) -> dict:
    """Fast paths vs references at a small size."""
    model = build(cfg, device, dtype)
    T = args.check_tokens
    ids = torch.randint(0, cfg.vocab_size, (1, T), device=device)
    with torch.no_grad():
        one = model(ids)
        chunked = prefill_rows(model, ids, chunk_size=max(1, T // 4))
        out = dict(tokens=T, chunked_vs_one_forward=rel_err(chunked.logits, one.logits[:, -1]))
        # MLA: a chunk on top of a cache, the layer's own path (SDPA lower-right on CUDA bf16) vs fp32 math
        mla = next(layer.self_attn for layer in model.model.layers if layer.is_mla)
        x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype)
        _, cache = mla(x[:, : T // 2])
        y_fast, _ = mla(x[:, T // 2:], cache)
        ref = build(cfg, device, torch.float32)
        ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        mla32 = next(layer.self_attn for layer in ref.model.layers if layer.is_mla)
        _, c32 = mla32(x[:, : T // 2].float())
        y_ref, _ = mla32(x[:, T // 2:].float(), c32)
        out["mla_chunk_on_cache_vs_fp32"] = rel_err(y_fast, y_ref)
        out["mla_efficient_attention_usable"] = efficient_attention_usable(cfg, device, dtype)
        # decode: backend of the run vs torch, three greedy steps
        backend = resolve_backend(cfg.backend, device)
        torch_model = build(cfg.replace(backend="torch"), device, dtype)
        torch_model.load_state_dict(model.state_dict())
        with count_triton_decode() as counter:
            a = decode(model, prefill(model, ids[:, :T // 2]), 3)
            toks = [t for _, t in a]
        b = [t for _, t in decode(torch_model, prefill(torch_model, ids[:, :T // 2]), 3)]
        step_fast = model(torch.tensor([[toks[0]]], device=device), cache=model(ids[:, :T // 2]).cache).logits
        step_ref = torch_model(torch.tensor([[toks[0]]], device=device), cache=torch_model(ids[:, :T // 2]).cache).logits
        out.update(backend=backend, decode_step_vs_torch=rel_err(step_fast, step_ref), decode_tokens_equal=toks == b,
                   triton_decode_calls=counter.calls)
    return out


def section_prefill(args, cfg, device, dtype) -> dict:
    N, chunk = args.context, args.chunk
    model = build(cfg, device, dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, N), generator=g).to(device)
    kv_bytes = torch.empty((), dtype=dtype).element_size()
    predicted = InferenceCosts(cfg, "k3", kv_bytes=kv_bytes, state_bytes=4).cache_bytes(N)
    with torch.no_grad():
        prefill_rows(model, ids[:, : min(N, 2 * chunk)], chunk_size=chunk)  # warm-up: kernels compiled
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        pre = prefill_rows(model, ids, chunk_size=chunk)
        sync(device)
        seconds = time.perf_counter() - t0
        peak = peak_bytes(device)
        held = pre.cache.nbytes()
        out = dict(context=N, chunk=chunk, dtype=str(dtype), prefill_s=seconds, prefill_tokens_per_s=N / seconds,
                   peak_bytes=peak, weight_bytes=weights, cache_bytes=held, cache_bytes_predicted=predicted,
                   cache_bytes_match=held == predicted, backend=resolve_backend(cfg.backend, device))
        print(f"prefill {N:,} tokens in {seconds:.1f} s ({N / seconds:,.0f} tok/s), peak "
              f"{'n/a' if peak is None else f'{peak / 2**30:.1f} GiB'}, cache {held / 2**30:.3f} GiB (costs.py: {predicted / 2**30:.3f} GiB, "
              f"{'equal' if held == predicted else 'DIFFERENT'})", flush=True)
        for name, pre_ctx in (("long", pre), ("short", None)):
            if pre_ctx is None:
                short = min(args.short_context, N)
                pre_ctx = prefill_rows(model, ids[:, :short], chunk_size=chunk)
            list(decode(model, pre_ctx, 2))  # warm-up
            st = GenerationStats()
            with count_triton_decode() as counter:
                list(decode(model, pre_ctx, args.decode_tokens, stats=st))
            out[f"decode_{name}_context"] = pre_ctx.cache.offset
            out[f"decode_{name}_tokens_per_s"] = (args.decode_tokens - 1) / st.decode_s  # first token: prefill's logits
            out[f"decode_{name}_ms_per_token"] = 1e3 * st.decode_s / max(1, args.decode_tokens - 1)
            out[f"decode_{name}_triton_calls"] = counter.calls
            del pre_ctx
        out["decode_peak_bytes"] = peak_bytes(device)
    return out


def section_spec(args, cfg, device, dtype) -> dict:
    """MTP speculative decoding after ``--spec-steps`` of training: first the graphed decoder (``static`` off CUDA)
    at ``--short-context`` (4,096; prompts of ``context − --spec-new`` tokens, batch 1, no EOS stop) — plain graphed
    greedy vs graphed ``draft=k`` for each ``--spec-k``: acceptance, tokens per verify, tokens/s, speedup over
    graphed plain, rows identical to it (``out["graph"]``, printed as it goes); then the eager decoder
    (``--spec-prompt-len`` prompts: plain vs ``draft=k``)."""
    from k3lab.data import batch_iterator, corpus_splits, get_tokenizer
    from k3lab.train import TrainConfig, fit

    tok = get_tokenizer("bpe")
    train_ids, val_ids = corpus_splits(tok)
    mcfg = cfg.replace(num_nextn_predict_layers=1, vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    model = K3ForCausalLM(mcfg)
    t0 = time.perf_counter()
    run = fit(model, batch_iterator(train_ids, args.spec_batch, args.spec_seq, seed=0),
              TrainConfig(steps=args.spec_steps, lr=args.spec_lr, seed=0, device=str(device),
                          dtype="bfloat16" if device.type == "cuda" else "float32", progress=False))
    train_s = time.perf_counter() - t0
    model = model.to(dtype).eval()
    last = run.history[-1]
    L = args.spec_prompt_len
    prompts = [val_ids[i * 3 * L: i * 3 * L + L].tolist() for i in range(args.spec_prompts)]
    out = dict(train_steps=args.spec_steps, train_s=train_s, lm_loss=last.get("lm_loss"), mtp_loss=last.get("mtp_loss"),
               prompts=len(prompts), prompt_len=L, new_tokens=args.spec_new, rows=[])
    print(f"spec: MTP model trained {args.spec_steps} steps in {train_s:.0f} s, lm loss {out['lm_loss']:.2f}, "
          f"mtp loss {out['mtp_loss']:.2f}", flush=True)
    # first (printed as it goes, in case a time limit cuts the slower eager rows) the graphed decoder (static off
    # CUDA): batch 1 at --short-context (4,096), plain vs draft=k, each step one graph replay; the prompts end
    # `spec_new` tokens before the context, so the decode stays inside the trained one
    decoder = "graph" if device.type == "cuda" else "static"
    ctx, new = args.short_context, args.spec_new
    P = max(1, min(ctx - new, len(val_ids)))  # prompt tokens
    stride = (len(val_ids) - P) // max(1, len(prompts))  # the prompts' starts, spread over the validation split
    long_prompts = [val_ids[i * stride: i * stride + P].tolist() for i in range(len(prompts))]
    kw = dict(eos_token_id=None, decoder=decoder)  # every row makes `new` tokens: equal work for plain and draft
    graph = dict(decoder=decoder, context=ctx, prompt_len=P, new_tokens=new, prompts=len(long_prompts), rows=[])
    generate(model, long_prompts[:1], new, **kw)  # warm-up: buffers and graph of this batch bucket
    plain_g, plain_out = GenerationStats(), []
    for p in long_prompts:
        plain_out += generate(model, [p], new, stats=plain_g, **kw)
    graph["plain_tokens_per_s"] = plain_g.decode_tokens_per_s
    graph["plain_ms_per_token"] = 1e3 * plain_g.decode_s / plain_g.new_tokens
    print(f"spec {decoder}: plain greedy at {P + new:,} tokens, batch 1: {graph['plain_tokens_per_s']:,.1f} tok/s",
          flush=True)
    for k in args.spec_k:
        generate(model, long_prompts[:1], new, draft=k, **kw)  # warm-up: this k's buffers and graph
        st, got = GenerationStats(), []
        for p in long_prompts:
            got += generate(model, [p], new, draft=k, stats=st, **kw)
        graph["rows"].append(dict(
            k=k, acceptance=st.acceptance_rate, drafted=st.drafted, accepted=st.accepted, verifies=st.forwards,
            tokens_per_verify=(st.new_tokens - len(long_prompts)) / max(1, st.forwards),  # the first: the prefill's
            decode_tokens_per_s=st.decode_tokens_per_s, ms_per_token=1e3 * st.decode_s / st.new_tokens,
            speedup=plain_g.decode_s / st.decode_s, identical_rows=sum(a == b for a, b in zip(got, plain_out))))
        r = graph["rows"][-1]
        print(f"spec {decoder} k={k}: acceptance {r['acceptance']:.2f}, {r['tokens_per_verify']:.2f} tok/verify, "
              f"{r['decode_tokens_per_s']:,.1f} tok/s, speedup over {decoder} plain {r['speedup']:.2f}x, identical "
              f"{r['identical_rows']}/{len(long_prompts)}", flush=True)
    out["graph"] = graph
    # the eager decoder: plain vs draft=k on --spec-prompt-len prompts
    generate(model, prompts[:1], 8, decoder="eager")  # warm-up
    generate(model, prompts[:1], 8, draft=max(args.spec_k), decoder="eager")
    plain_st, plain = GenerationStats(), []
    for p in prompts:
        plain += generate(model, [p], args.spec_new, stats=plain_st, decoder="eager")
    out["plain_decode_tokens_per_s"] = plain_st.decode_tokens_per_s
    out["sample"] = tok.decode(plain[0][L:L + 48])
    for k in args.spec_k:
        st, got = GenerationStats(), []
        for p in prompts:
            got += generate(model, [p], args.spec_new, draft=k, stats=st, decoder="eager")
        out["rows"].append(dict(k=k, acceptance=st.acceptance_rate, tokens_per_forward=st.new_tokens / max(1, st.forwards + len(prompts)),
                                decode_tokens_per_s=st.decode_tokens_per_s, speedup=plain_st.decode_s / st.decode_s,
                                identical_rows=sum(a == b for a, b in zip(got, plain)), drafted=st.drafted,
                                accepted=st.accepted))
        r = out["rows"][-1]
        print(f"spec k={k}: acceptance {r['acceptance']:.2f}, speedup {r['speedup']:.2f}x, identical "
              f"{r['identical_rows']}/{len(prompts)}", flush=True)
    return out


def passkey_batch(vocab, batch_size, train_len, step, seed=0, question_rate=0.2):
    """Training rows as notebook 05: filler 12..V-1, a needle [10, d], questions (11) after it whose label is d."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randint(12, vocab, (batch_size, train_len), generator=g)
    d = torch.randint(0, 10, (batch_size,), generator=g)
    rows, pos = torch.arange(batch_size), torch.randint(0, train_len // 2, (batch_size,), generator=g)
    x[rows, pos], x[rows, pos + 1] = 10, d
    question = (torch.rand(batch_size, train_len, generator=g) < question_rate) & (torch.arange(train_len) > pos[:, None] + 1)
    question[:, -1] = True
    x = x.masked_fill(question, 11)
    y = torch.cat([x[:, 1:], torch.full((batch_size, 1), -100)], 1)
    return x, torch.where(question, d[:, None].expand_as(y), y)


def section_passkey(args, device) -> dict:
    from k3lab.data import passkey
    from k3lab.train import TrainConfig, fit

    vocab, n = 64, args.passkey_train_len
    base = ModelConfig.preset("tiny").replace(vocab_size=vocab, mlp_kind="dense", initializer_range=0.1,
                                              bos_token_id=0, eos_token_id=1, pad_token_id=2)
    L = base.num_hidden_layers
    variants = {"3:1 NoPE (K3)": base, "all-MLA (NoPE)": base.replace(full_attn_layers=list(range(1, L + 1)))}
    multiples = [4 ** i for i in range(int(math.log(args.passkey_max_multiple, 4)) + 1)]
    out = dict(train_len=n, steps=args.passkey_steps, multiples=multiples, accuracy={})
    for name, vcfg in variants.items():
        torch.manual_seed(0)
        model = K3ForCausalLM(vcfg)
        fit(model, lambda s: passkey_batch(vocab, 32, n, s), TrainConfig(steps=args.passkey_steps, lr=5e-3, seed=0,
                                                                          device=str(device), progress=False))
        model.eval()
        acc = {}
        for m in multiples:
            x, y = passkey(vocab, args.passkey_rows, m * n, depth=None, seed=7919 * m, num_digits=1, filler="random")
            got = generate(model, x.to(device), 1, chunk_size=args.chunk_passkey, allow_longer=True)  # past the trained context on purpose
            acc[m] = (got[:, -1].cpu() == y[:, -1]).float().mean().item()
        out["accuracy"][name] = acc
        print(f"passkey {name}: " + ", ".join(f"{m}x {a:.2f}" for m, a in acc.items()), flush=True)
    return out


# ----------------------------------------------------------------------------------------------
# decode: eager vs graphed vs fla + transformers
# ----------------------------------------------------------------------------------------------
ANCHOR_KDA = dict(vocab_size=32000, num_hidden_layers=24, hidden_size=1024, num_heads=8, head_dim=128,
                  intermediate_size=2816)  # fla's KDAForCausalLM anchor shape (as kernels/bench_train.py)


def decode_config(name: str, smoke: bool) -> ModelConfig:
    """``small`` / ``tiny`` presets, or ``kda-anchor``: the pure-KDA shape of fla's anchor (dense, PreNorm)."""
    if name in RUNNABLE_PRESETS:
        return ModelConfig.preset(name)
    a = ANCHOR_KDA if not smoke else dict(ANCHOR_KDA, num_hidden_layers=2, hidden_size=64, num_heads=2, head_dim=32,
                                          intermediate_size=128, vocab_size=256)
    L = a["num_hidden_layers"]
    return ModelConfig.preset("small").replace(
        vocab_size=a["vocab_size"], num_hidden_layers=L, full_attn_layers=[], hidden_size=a["hidden_size"],
        intermediate_size=a["intermediate_size"], linear_attn_config=dict(num_heads=a["num_heads"], head_dim=a["head_dim"]),
        mlp_kind="dense", first_k_dense_replace=L, residual="prenorm", qk_clip_tau=None)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def tiled_prefill(model, B: int, context: int, seed: int = 0) -> Prefilled:
    """A prefilled batch at ``context`` tokens: 256 real prompt tokens per row, the MLA latents tiled to
    ``context`` (decode work depends on the cache's size, not its values)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    n = min(256, context)
    ids = torch.randint(3, cfg.vocab_size, (B, n), generator=g).to(model_device(model))
    pre = prefill_rows(model, ids)
    if context == n:
        return pre
    reps = -(-context // n)
    layers = [e if not isinstance(e, MLACache) else
              MLACache(e.c_kv.repeat(1, reps, 1)[:, :context].contiguous(),
                       e.k_rope.repeat(1, reps, 1)[:, :context].contiguous())
              for e in pre.cache.layers]
    return Prefilled(K3Cache(layers, context), pre.logits, pre.residual, [context] * B)


def step_bytes(model, B: int, context: int) -> int:
    """Bytes one decode step must move (the roofline's numerator; the module docstring says what counts)."""
    from k3lab.mixers.kda import KDA
    from k3lab.mixers.mla import GatedMLA
    from k3lab.moe.latent import RoutedExperts

    experts = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters(recurse=False)}
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in experts and p is not embed)
    total += B * embed.shape[1] * embed.element_size()  # the B embedding rows read
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            E, k = m.num_experts, model.config.num_experts_per_tok
            per_expert = sum(p.numel() * p.element_size() for p in (m.w1, m.w3, m.w2)) / E
            total += int(E * (1 - (1 - k / E) ** B) * per_expert)  # expected distinct experts, uniform routing
        elif isinstance(m, KDA):
            total += 2 * B * m.num_heads * m.head_k_dim * m.head_v_dim * 4  # fp32 state read + written
        elif isinstance(m, GatedMLA):
            total += B * context * m.cache_numbers_per_token() * embed.element_size()
    return total


def k3lab_decode_row(model, name: str, decoder: str, B: int, context: int, new: int, hbm: float) -> dict:
    device = model_device(model)
    reset_peak(device)
    pre = tiled_prefill(model, B, context)
    row = dict(impl=f"k3lab {decoder}", model=name, B=B, context=context, new=new)
    with torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        if decoder == "eager":
            list(decode(model, pre, 3))  # first call (warm-up)
        else:
            dec = StaticDecoder(model, graph=decoder.startswith("graph"), compile=decoder.endswith("compiled"),
                                capacity=slots_for(context + new))  # contexts past the config's: caches of their own
            dec.decode(pre, new)  # first call: buffers, warm-up, capture
        sync(device)
        row["first_call_s"] = time.perf_counter() - t0
        st = GenerationStats()
        if decoder == "eager":
            tokens = [[] for _ in range(B)]
            for r, t in decode(model, pre, new, stats=st):
                tokens[r].append(t)
        else:
            tokens = dec.decode(pre, new, stats=st)
    row["first_tokens"] = tokens[0][:16]  # row 0's first 16 greedy tokens: decoders compared in the table
    row["tokens_per_s_row"] = (new - 1) / st.decode_s  # the first token comes from the prefill's logits
    row["tokens_per_s"] = row["tokens_per_s_row"] * B
    row["ms_per_step"] = 1e3 * st.decode_s / (new - 1)
    row["peak_gib"] = (peak_bytes(device) or 0) / 2**30
    row["step_bytes"] = step_bytes(model, B, context)
    row["floor_ms"] = 1e3 * row["step_bytes"] / (hbm * 1e12)
    return row


def fla_decode_row(B: int, context: int, new: int, device) -> dict:
    """fla's KDAForCausalLM (anchor shape, safe gate, lower bound -5) decoded by transformers' generate."""
    from fla.models import KDAConfig, KDAForCausalLM

    a = ANCHOR_KDA
    cfg = KDAConfig(hidden_size=a["hidden_size"], num_hidden_layers=a["num_hidden_layers"], num_heads=a["num_heads"],
                    head_dim=a["head_dim"], vocab_size=a["vocab_size"], intermediate_size=a["intermediate_size"],
                    safe_gate=True, lower_bound=-5.0, attn=None)
    torch.manual_seed(0)
    reset_peak(device)
    with device:
        model = KDAForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, cfg.vocab_size, (B, context), generator=g).to(device)
    kw = dict(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    row = dict(impl="fla + transformers generate", model="kda-anchor", B=B, context=context, new=new)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(x[:, :256], max_new_tokens=3, min_new_tokens=3, **kw)
        sync(device)
        row["first_call_s"] = time.perf_counter() - t0
        model.generate(x, max_new_tokens=2, min_new_tokens=2, **kw)  # the full-size shapes once (autotuning)
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)  # the prefill alone, subtracted below
        sync(device)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=new, min_new_tokens=new, **kw)
        sync(device)
        wall = time.perf_counter() - t0
    n = out.shape[1] - context
    row["tokens_per_s_row"] = (n - 1) / (wall - prefill_s)
    row["tokens_per_s"] = row["tokens_per_s_row"] * B
    row["ms_per_step"] = 1e3 * (wall - prefill_s) / (n - 1)
    row["peak_gib"] = (peak_bytes(device) or 0) / 2**30
    return row


def section_decode(args, device, dtype) -> dict:
    rows = []
    for name in args.decode_models:
        model = build(decode_config(name, args.cpu_smoke), device, dtype)
        contexts = args.decode_contexts if name != "kda-anchor" else args.decode_contexts[:1]  # no MLA: context-free
        for context in contexts:
            for B in args.decode_batches:
                if B * context > args.decode_max_row_tokens:
                    continue
                for decoder in args.decoders:
                    new = args.decode_new if decoder != "eager" else min(args.decode_new, args.decode_eager_new)
                    try:
                        row = k3lab_decode_row(model, name, decoder, B, context, new, args.hbm_tb_s)
                    except Exception as err:  # keep the run going; the row says what failed
                        row = dict(impl=f"k3lab {decoder}", model=name, B=B, context=context, error=repr(err)[:300])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del model
        reset_peak(device)
    if args.decode_peer and device.type == "cuda":
        for B in args.decode_batches:
            try:
                row = fla_decode_row(B, args.decode_contexts[0], min(args.decode_new, args.decode_eager_new), device)
            except Exception as err:
                row = dict(impl="fla + transformers generate", model="kda-anchor", B=B, error=repr(err)[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return dict(rows=rows, hbm_tb_s=args.hbm_tb_s)


def decode_table(d: dict) -> str:
    lines = ["| implementation | model | batch | context | tokens/s per row | aggregate tokens/s | ms/step | "
             f"floor ms ({d['hbm_tb_s']} TB/s) | floor / step | first call s | peak GiB |", "|---" * 11 + "|"]
    for r in d["rows"]:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['model']} | {r['B']} | {r.get('context', '')} | error: "
                         f"{r['error'][:120]} |" + " |" * 6)
            continue
        floor = r.get("floor_ms")
        lines.append(f"| {r['impl']} | {r['model']} | {r['B']} | {r['context']:,} | {r['tokens_per_s_row']:,.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['ms_per_step']:.3f} | {'–' if floor is None else f'{floor:.3f}'} | "
                     f"{'–' if floor is None else format(floor / r['ms_per_step'], '.0%')} | {r['first_call_s']:.1f} | "
                     f"{r['peak_gib']:.1f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
def table(results: dict) -> str:
    lines = ["| measurement | value |", "|---|---|"]

    def row(k, v):
        lines.append(f"| {k} | {v} |")

    if "check" in results:
        c = results["check"]
        row("check: chunked prefill vs one forward (rel err)", f"{c['chunked_vs_one_forward']:.1e}")
        row("check: MLA chunk on cache vs fp32 (rel err)", f"{c['mla_chunk_on_cache_vs_fp32']:.1e} "
            f"(memory-efficient SDPA usable: {c['mla_efficient_attention_usable']})")
        row(f"check: decode step {c['backend']} vs torch (rel err)", f"{c['decode_step_vs_torch']:.1e} "
            f"(tokens equal: {c['decode_tokens_equal']}, Triton decode calls: {c['triton_decode_calls']})")
    if "prefill" in results:
        p = results["prefill"]
        row("prefill tokens / chunk", f"{p['context']:,} / {p['chunk']:,} ({p['dtype']}, KDA backend {p['backend']})")
        row("prefill time / tokens/s", f"{p['prefill_s']:.1f} s / {p['prefill_tokens_per_s']:,.0f}")
        if p["peak_bytes"] is not None:
            row("peak memory (weights included)", f"{p['peak_bytes'] / 2**30:.2f} GiB (weights {p['weight_bytes'] / 2**30:.2f} GiB)")
        row("cache held vs costs.py", f"{p['cache_bytes']:,} B vs {p['cache_bytes_predicted']:,} B "
            f"({'equal' if p['cache_bytes_match'] else 'DIFFERENT'})")
        for name in ("long", "short"):
            row(f"decode at {p[f'decode_{name}_context']:,} tokens",
                f"{p[f'decode_{name}_tokens_per_s']:,.1f} tok/s ({p[f'decode_{name}_ms_per_token']:.2f} ms/token; "
                f"Triton decode calls {p[f'decode_{name}_triton_calls']})")
    if "spec" in results:
        s = results["spec"]
        row("spec: MTP model trained", f"{s['train_steps']} steps, {s['train_s']:.0f} s, lm loss {s['lm_loss']:.2f}, "
            f"mtp loss {s['mtp_loss']:.2f}")
        row("spec: plain greedy, batch 1", f"{s['plain_decode_tokens_per_s']:,.1f} tok/s")
        for r in s["rows"]:
            row(f"spec: draft k={r['k']}", f"acceptance {r['acceptance']:.2f}, {r['tokens_per_forward']:.2f} tok/forward, "
                f"{r['decode_tokens_per_s']:,.1f} tok/s, speedup {r['speedup']:.2f}x, identical rows "
                f"{r['identical_rows']}/{s['prompts']}")
    if "passkey" in results:
        p = results["passkey"]
        for name, acc in p["accuracy"].items():
            row(f"passkey {name} (train {p['train_len']} tokens)",
                ", ".join(f"{m * p['train_len']:,}: {a:.2f}" for m, a in acc.items()))
    out = "\n".join(lines)
    if "decode" in results:
        out += "\n\n" + decode_table(results["decode"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny preset, tiny sizes: a quick check that it runs")
    ap.add_argument("--device", default="auto", choices=DEVICES)
    ap.add_argument("--preset", default="small", choices=RUNNABLE_PRESETS)
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    ap.add_argument("--context", type=int, default=1 << 20, help="prefill tokens (default %(default)s)")
    ap.add_argument("--chunk", type=int, default=16384, help="prefill chunk (default %(default)s)")
    ap.add_argument("--decode-tokens", type=int, default=33)
    ap.add_argument("--short-context", type=int, default=4096)
    ap.add_argument("--check-tokens", type=int, default=512)
    ap.add_argument("--spec-steps", type=int, default=400)
    ap.add_argument("--spec-batch", type=int, default=16)
    ap.add_argument("--spec-seq", type=int, default=512)
    ap.add_argument("--spec-lr", type=float, default=2e-3)
    ap.add_argument("--spec-k", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--spec-prompts", type=int, default=8)
    ap.add_argument("--spec-prompt-len", type=int, default=64)
    ap.add_argument("--spec-new", type=int, default=128)
    ap.add_argument("--passkey-steps", type=int, default=600)
    ap.add_argument("--passkey-train-len", type=int, default=16)
    ap.add_argument("--passkey-max-multiple", type=int, default=4096)
    ap.add_argument("--passkey-rows", type=int, default=64)
    ap.add_argument("--chunk-passkey", type=int, default=256)
    ap.add_argument("--decode-models", nargs="+", default=["small", "kda-anchor"],
                    choices=RUNNABLE_PRESETS + ("kda-anchor",))
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--decode-contexts", type=int, nargs="+", default=[4096, 65536, 1 << 20])
    ap.add_argument("--decode-max-row-tokens", type=int, default=1 << 22,
                    help="skip batch x context above this (default %(default)s: 64 rows at 64K, one at 1M)")
    ap.add_argument("--decoders", nargs="+", default=["eager", "graph"], choices=("eager", "static", "graph", "graph-compiled"))
    ap.add_argument("--decode-new", type=int, default=128, help="greedy tokens a row (static/graph)")
    ap.add_argument("--decode-eager-new", type=int, default=16, help="greedy tokens a row (eager, fla: slower)")
    ap.add_argument("--decode-peer", action=argparse.BooleanOptionalAction, default=True,
                    help="fla KDAForCausalLM + transformers generate rows (CUDA only)")
    ap.add_argument("--hbm-tb-s", type=float, default=4.8, help="HBM bandwidth for the roofline (H200: 4.8 TB/s)")
    ap.add_argument("--json", default="runs/bench_infer.json")
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # smoke defaults; explicit flags still win
        ap.set_defaults(device="cpu", preset="tiny", dtype="float32", context=2048, chunk=512, decode_tokens=5,
                        short_context=256, check_tokens=64, spec_steps=3, spec_batch=2, spec_seq=32, spec_k=[1, 2],
                        spec_prompts=2, spec_prompt_len=16, spec_new=10, passkey_steps=3, passkey_max_multiple=16,
                        passkey_rows=8, chunk_passkey=64, decode_models=["tiny", "kda-anchor"], decode_batches=[1, 3],
                        decode_contexts=[300, 600], decoders=["eager", "static"], decode_new=6, decode_eager_new=4)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    cfg = ModelConfig.preset(args.preset)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__}, preset {args.preset}, {args.dtype}, sections {args.sections}", flush=True)
    results = dict(settings=vars(args), device=str(device), torch=torch.__version__,
                   gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    for name in args.sections:
        if name == "prefill" and "check" in results and results["check"]["mla_efficient_attention_usable"] is False \
                and args.context > 65536:
            print("prefill: skipped, SDPA's memory-efficient kernel refuses MLA's shapes here (see the check row); "
                  "the fallback would materialise a [chunk, context] mask", flush=True)
            continue
        t0 = time.perf_counter()
        if name == "check":
            results["check"] = section_check(args, cfg, device, dtype)
        elif name == "prefill":
            results["prefill"] = section_prefill(args, cfg, device, dtype)
        elif name == "spec":
            results["spec"] = section_spec(args, cfg, device, dtype)
        elif name == "decode":
            results["decode"] = section_decode(args, device, dtype)
        else:
            results["passkey"] = section_passkey(args, device)
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    print()
    print(table(results))
    if args.json:
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
