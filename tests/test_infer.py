"""k3lab.infer: chunked prefill, batched generation of prompts of different lengths, streaming,
sampling rules, speculative decoding with the MTP head (KDA rollback), the prefix cache.

References are independent of the engine: a full forward without a cache (argmax appended token by
token) for greedy outputs, one unchunked forward for prefill logits and caches."""

import math

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.infer import (GenerationStats, PrefixCache, generate, next_token_probs, prefill, prefill_rows, sample_next,
                         stream)
from k3lab.infer import cache as hcache
from k3lab.infer import speculative as spec
from k3lab.mixers.kda import KDACache
from k3lab.model import K3ForCausalLM
from k3lab.testing import rel_err

FP32_TOL = 1e-5  # chunked vs one forward, prefix hit vs cold: fp32 rounding only


def small_cfg(**changes) -> ModelConfig:
    """Two layers — KDA (dense MLP) then Gated MLA (LatentMoE) — and a 256-token vocabulary: every cache kind
    and the MoE in as few modules as possible (CPU time is per module call, not per FLOP)."""
    base = dict(vocab_size=256, num_hidden_layers=2, full_attn_layers=[2], attn_res_block_size=1,
                initializer_range=0.1)  # larger than K3's 0.02: the untrained model's tokens depend on context
    return ModelConfig.preset("tiny").replace(**{**base, **changes})


def build(seed=0, **changes) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(small_cfg(**changes)).eval()


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards without any cache."""
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0].tolist()


def random_prompts(lengths, vocab=256, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
    return build()


@pytest.fixture(scope="module")
def mtp_model():
    return build(seed=1, num_nextn_predict_layers=1)


# ----------------------------------------------------------------------------------------------
# prefill and batched generation
# ----------------------------------------------------------------------------------------------
def test_chunked_prefill_equals_one_forward(model):
    (prompt,) = random_prompts([23])
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model(ids)
    for chunk in (1, 4, 7, 64):
        got = prefill_rows(model, ids, chunk_size=chunk)
        assert rel_err(got.logits, ref.logits[:, -1]) < FP32_TOL, chunk
        assert got.cache.offset == ref.cache.offset == 23
        assert got.cache.nbytes() == ref.cache.nbytes()
        for g, r in zip(got.cache.layers, ref.cache.layers):
            for name, t in vars(r).items():
                if isinstance(t, torch.Tensor):
                    assert rel_err(getattr(g, name), t) < FP32_TOL, (chunk, type(r).__name__, name)


@pytest.mark.parametrize("nope", [True, False], ids=["nope", "rope"])
def test_batch_of_different_lengths_equals_each_alone(nope):
    model = build(mla_use_nope=nope)
    prompts = random_prompts([3, 11, 6, 11])
    n = 6
    batch = generate(model, prompts, n, chunk_size=4)
    alone = [generate(model, [p], n)[0] for p in prompts]
    assert batch == alone
    assert alone[0] == greedy_reference(model, prompts[0], n)
    assert alone[2] == greedy_reference(model, prompts[2], n)
    # the padded batch cache: key mask True exactly on the real slots; two decode steps' logits = alone
    pre = prefill(model, prompts, chunk_size=4)
    nxt = torch.tensor([[a[len(p)], a[len(p) + 1]] for a, p in zip(alone, prompts)])  # [4, 2]
    step = hcache.forward(model, nxt[:, :1], pre.cache)
    step = hcache.forward(model, nxt[:, 1:], step.cache)
    for i, p in enumerate(prompts):
        one = prefill(model, [p])
        ref = hcache.forward(model, nxt[i:i + 1, :2], one.cache, last=1)
        assert rel_err(step.logits[i], ref.logits[0]) < FP32_TOL, i
    (mla,) = [e for e in pre.cache.layers if not isinstance(e, KDACache)]
    assert mla.key_mask.sum(1).tolist() == [3, 11, 6, 11] and pre.cache.offset == 11


def test_tensor_prompts_keep_the_old_api_and_pad_after_stop(model):
    prompts = random_prompts([5, 5], seed=3)
    ids = torch.tensor(prompts)
    out = generate(model, ids, 5)
    assert out.shape == (2, 10) and out.dtype == ids.dtype
    assert out[1].tolist() == greedy_reference(model, prompts[1], 5)
    stop_tok = out[0, 6].item()  # row 0's second new token
    stopped = generate(model, ids, 5, stop=stop_tok)
    row0 = out[0].tolist()
    first = row0.index(stop_tok, 5)
    assert stopped[0].tolist() == row0[:first + 1] + [model.config.pad_token_id] * (9 - first)


def test_stream_yields_tokens_as_they_come(model):
    prompts = random_prompts([4, 7], seed=5)
    events = list(stream(model, prompts, 3))
    assert [r for r, _ in events] == [0, 1, 0, 1, 0, 1]  # step by step, row by row
    full = generate(model, prompts, 3)
    assert [[t for r, t in events if r == i] for i in (0, 1)] == [f[len(p):] for f, p in zip(full, prompts)]
    st = GenerationStats()
    generate(model, prompts, 3, stats=st)
    assert (st.prompt_tokens, st.computed_tokens, st.new_tokens, st.forwards) == (11, 11, 6, 2)


def test_bad_inputs_name_the_argument(model, mtp_model):
    ok = [[5, 6, 7]]
    cases = [
        (dict(prompts=[]), "prompts: empty"),
        (dict(prompts=[[5], []]), r"prompts\[1\]: empty"),
        (dict(prompts=[5, 6]), "flat list"),
        (dict(prompts=[[5, 999]]), r"prompts\[0\]: token ids"),
        (dict(prompts=[[5] * 9], max_prompt_tokens=8), "max_prompt_tokens=8"),
        (dict(max_new_tokens=-1), "max_new_tokens=-1"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=0), "top_k=0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(stop=[4096]), "stop="),
        (dict(chunk_size=0), "chunk_size=0"),
        (dict(draft=2), "draft=2: the model has no MTP head"),
        (dict(draft=0, use_mtp=True), "draft=0"),
        (dict(prefix_cache="yes"), "prefix_cache"),
    ]
    for kwargs, message in cases:
        m = mtp_model if kwargs.pop("use_mtp", False) else model
        args = dict(prompts=ok, max_new_tokens=2) | kwargs
        with pytest.raises(ValueError, match=message):
            generate(m, **args)
    with pytest.raises(ValueError, match="prefix_cache: it was built for another model"):
        generate(model, ok, 2, prefix_cache=PrefixCache(mtp_model))


# ----------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------
def test_sampling_distribution_rules():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    p = next_token_probs(logits, 1.0)
    assert rel_err(p, logits.softmax(-1)) < 1e-7
    p_k = next_token_probs(logits, 0.5, top_k=2)
    ref = torch.zeros(5)
    ref[:2] = (logits[0, :2] / 0.5).softmax(-1)
    assert rel_err(p_k[0], ref) < 1e-7
    # top-p: sorted probs of p are [0.47, 0.17, 0.10(0.0), ...]; 0.6 keeps the first two, 0.4 only the first
    two = p[0, :2] / p[0, :2].sum()
    assert rel_err(next_token_probs(logits, 1.0, top_p=0.6)[0, :2], two) < 1e-6
    assert next_token_probs(logits, 1.0, top_p=0.4)[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits.expand(1000, 5), 1.0, top_k=3, generator=g) for _ in range(4)]).flatten()
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    ref3 = torch.zeros(5)
    ref3[:3] = logits[0, :3].softmax(-1)
    assert (freq - ref3).abs().max() < 0.03 and freq[3:].sum() == 0
    assert sample_next(logits).tolist() == [0]


def test_speculative_sampling_keeps_the_target_distribution():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])  # target at the draft position, then bonus
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])  # a bad draft distribution
    g = torch.Generator().manual_seed(0)
    firsts = []
    for _ in range(4000):
        d = torch.multinomial(q[0], 1, generator=g).item()
        j, nxt = spec.accept_sampled(p, q, [d], g)
        firsts.append(d if j == 1 else nxt)
    freq = torch.bincount(torch.tensor(firsts), minlength=4).float() / len(firsts)
    assert (freq - p[0]).abs().max() < 0.03, freq


# ----------------------------------------------------------------------------------------------
# speculative decoding
# ----------------------------------------------------------------------------------------------
def test_mtp_step_matches_the_head_and_its_cache(mtp_model):
    (prompt,) = random_prompts([12], seed=7)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        res = mtp_model.model(ids).residual
        emb = mtp_model.model.embed_tokens(ids[:, 1:])
        ref = mtp_model.mtp(emb, res[:, :-1])  # [1, 11, D]
        hidden, _, _ = spec.mtp_step(mtp_model.mtp, emb, res[:, :-1])
        assert torch.equal(hidden, ref)
        pre = prefill_rows(mtp_model, ids, chunk_size=5, mtp=True)  # MTP cache built chunk by chunk
        assert pre.mtp_cache.offset == 11
        tail, _, _ = spec.mtp_step(mtp_model.mtp, emb[:, -1:], res[:, -2:-1], hcache.truncate(
            hcache.K3Cache([pre.mtp_cache], 11), 10).layers[0])
        assert rel_err(tail[:, -1], ref[:, -1]) < FP32_TOL


def test_rollback_equals_feeding_only_the_kept_tokens(mtp_model):
    (prompt,) = random_prompts([9], seed=8)
    pre = prefill_rows(mtp_model, torch.tensor([prompt]), chunk_size=4)
    extra = torch.tensor([[11, 12, 13, 14]])
    with torch.no_grad(), spec.record_kda_inputs(mtp_model) as rec:
        after = hcache.forward(mtp_model, extra, pre.cache).cache
    for keep in (1, 2, 4):
        got = spec.rollback(mtp_model, pre.cache, after, rec.inputs, keep)
        ref = hcache.forward(mtp_model, extra[:, :keep], pre.cache).cache
        assert got.offset == ref.offset == 9 + keep
        for g, r in zip(got.layers, ref.layers):
            for name, t in vars(r).items():
                if isinstance(t, torch.Tensor):
                    assert rel_err(getattr(g, name), t) < FP32_TOL, (keep, name)


def test_speculative_greedy_is_identical_to_plain_greedy(mtp_model):
    prompts = random_prompts([5, 13], seed=9)
    n = 10
    plain = generate(mtp_model, prompts, n)
    for k in (1, 3):
        st = GenerationStats()
        assert generate(mtp_model, prompts, n, draft=k, stats=st, decoder="eager") == plain, k  # eager's counts
        assert st.new_tokens == 2 * n and st.forwards == st.new_tokens - 2 - st.accepted  # one verify per step
    assert plain[1] == greedy_reference(mtp_model, prompts[1], n)
    g = torch.Generator().manual_seed(0)  # sampling through the drafts: runs, right length, ids in range
    (sampled,) = generate(mtp_model, prompts[:1], 5, temperature=1.0, top_k=20, draft=2, generator=g)
    assert len(sampled) == 10 and all(0 <= t < 256 for t in sampled)


def test_speculative_with_right_drafts_accepts_them(mtp_model, monkeypatch):
    """An oracle drafter (the true greedy continuation, one wrong token every 4th step) exercises every
    accepted length 0..k and the all-accepted path; the MTP head still runs to keep its cache in step."""
    (prompt,) = random_prompts([7], seed=10)
    n, k = 14, 3
    truth = greedy_reference(mtp_model, prompt, n + k)[len(prompt):]
    real = spec.draft_tokens
    calls = []

    def oracle(model, pend_x, pend_h, mtp_cache, k_eff, *args):
        _, q, kept = real(model, pend_x, pend_h, mtp_cache, k_eff, *args)
        drafts = truth[oracle.emitted:oracle.emitted + k_eff]  # the tokens after the pending (last emitted) one
        if len(calls) % 4 == 3:  # a wrong token in the middle
            drafts[len(drafts) // 2] = (drafts[len(drafts) // 2] + 1) % model.config.vocab_size
        calls.append(len(drafts))
        return drafts, q, kept

    oracle.emitted = 1
    monkeypatch.setattr(spec, "draft_tokens", oracle)
    st = GenerationStats()
    out = []
    pre = prefill(mtp_model, [prompt], mtp=True)
    for tok in spec.speculative_decode(mtp_model, pre, k, n, stats=st):
        out.append(tok)
        oracle.emitted = len(out)
    assert out == truth[:n]
    assert st.accepted > st.drafted / 2 and st.forwards < n - 3


# ----------------------------------------------------------------------------------------------
# prefix cache
# ----------------------------------------------------------------------------------------------
def test_prefix_hit_gives_the_cold_logits(model):
    (doc,) = random_prompts([29], seed=11)
    cold = prefill(model, [doc])
    pc = PrefixCache(model, block_tokens=4)
    first = prefill(model, [doc], prefix_cache=pc)  # miss: inserts blocks 1..7
    assert pc.stats()["hit_tokens"] == 0 and len(pc) == 7
    st = GenerationStats()
    again = prefill(model, [doc], prefix_cache=pc, stats=st)  # hit: 28 tokens (at most len - 1)
    other = doc[:18] + [7, 8, 9, 10, 11]  # shares 4 whole blocks
    cold_other = prefill(model, [other])
    warm_other = prefill(model, [other], prefix_cache=pc)
    for got, ref in ((first, cold), (again, cold), (warm_other, cold_other)):
        assert rel_err(got.logits, ref.logits) < FP32_TOL
    assert (st.cached_tokens, st.computed_tokens) == (28, 1)
    s = pc.stats()
    assert s["hit_tokens"] == 28 + 16 and s["lookup_tokens"] == 28 + 28 + 22
    assert math.isclose(s["token_hit_rate"], 44 / 78) and math.isclose(s["request_hit_rate"], 2 / 3)
    assert "time_saved_s" not in s and len(pc) == 7 + 1  # other's 5th block [16, 20) is new; no time estimate
    # generation through the cache equals generation without it
    assert generate(model, [doc, other], 4, prefix_cache=pc) == generate(model, [doc, other], 4)


def test_prefix_cache_lru_budget_and_host_tier(model):
    prompts = random_prompts([17, 17, 17], seed=12)
    probe = PrefixCache(model, block_tokens=4)
    prefill(model, [prompts[0]], prefix_cache=probe)
    per_block = probe.stats()["device_bytes"] // 4
    pc = PrefixCache(model, block_tokens=4, max_bytes=6 * per_block, host_max_bytes=3 * per_block)
    for p in prompts:
        prefill(model, [p], prefix_cache=pc)
    s = pc.stats()
    assert s["device_bytes"] <= 6 * per_block and s["host_bytes"] <= 3 * per_block
    assert s["to_host"] == 6 and s["dropped"] == 3 and len(pc) == 9
    # every stored entry's ancestors are stored too (eviction takes leaves)
    for e in pc._entries.values():
        assert e.parent is None or e.parent in pc._entries
    # prompt 0 lost its deepest blocks first; its first block went to the host tier and comes back on a hit
    cold = prefill(model, [prompts[0]])
    warm = prefill(model, [prompts[0]], prefix_cache=pc)
    assert rel_err(warm.logits, cold.logits) < FP32_TOL
    assert pc.stats()["from_host"] >= 1


def test_bench_infer_cpu_smoke(tmp_path, capsys):
    """kernels/bench_infer.py at a tiny size on CPU: the check and prefill sections run, the cache held after
    a chunked prefill equals k3lab.costs' prediction, and the table is printed last."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "kernels" / "bench_infer.py"
    module_spec = importlib.util.spec_from_file_location("bench_infer", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--cpu-smoke", "--sections", "check", "prefill", "--context", "192", "--chunk", "64",
                       "--short-context", "32", "--decode-tokens", "3", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["prefill"]["cache_bytes_match"] and res["prefill"]["context"] == 192
    assert res["check"]["chunked_vs_one_forward"] < FP32_TOL and res["check"]["decode_tokens_equal"]
    assert capsys.readouterr().out.rstrip().splitlines()[-3].startswith("| decode at 32 tokens")


def test_bench_generate_cpu_smoke(tmp_path, capsys):
    """kernels/bench_generate.py at a tiny size on CPU: rows through generate() for two prompt lengths after a
    warm-up, greedy tokens equal between the default decoder and "eager", the table printed last."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "kernels" / "bench_generate.py"
    module_spec = importlib.util.spec_from_file_location("bench_generate", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--cpu-smoke", "--batches", "2", "--prompts", "9", "17", "--new", "4", "--no-anchor",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    timed = {(r["impl"], r["prompt"]): r for r in rows if r["kind"] == "timed"}
    assert len(timed) == 4 and all(r["tokens_per_s_row"] > 0 and r["floor_ms"] > 0 for r in timed.values())
    for length in (9, 17):
        assert timed[("k3lab generate(auto)", length)]["first_tokens"] == timed[("k3lab generate(eager)", length)][
            "first_tokens"]
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("| k3lab generate(eager) | tiny | 2 | 17 |")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decode_uses_the_triton_step_and_matches_torch():
    """On CUDA (backend "auto" -> our Triton KDA kernels) greedy generation in fp32 equals the torch backend's,
    each decode step of a KDA layer goes through one Triton step — the fused step (k3lab.kernels.kda_decode_fused,
    on by default) or, with it switched off, k3lab.kernels.kda_decode_step — and MLA's bf16 chunk-on-cache path
    (SDPA, lower-right causal mask) matches the fp32 math path."""
    import k3lab.kernels as kernels
    from k3lab.kernels import kda_decode_fused as fused

    prompts = random_prompts([9, 70])
    fast = build().cuda()
    ref = build(backend="torch").cuda()
    want = generate(ref, prompts, 6, chunk_size=32, eos_token_id=None, decoder="eager")
    for on in (True, False):
        calls = {"step": 0, "fused": 0}
        real_step, real_fused, kept = kernels.kda_decode_step, fused.kda_decode_fused, fused.ENABLED
        kernels.kda_decode_step = lambda *a, **k: calls.__setitem__("step", calls["step"] + 1) or real_step(*a, **k)
        fused.kda_decode_fused = lambda *a, **k: calls.__setitem__("fused", calls["fused"] + 1) or real_fused(*a, **k)
        fused.ENABLED = on
        try:
            # the eager decoder: one call a step (the graphed default calls it only while warming up and capturing)
            got = generate(fast, prompts, 6, chunk_size=32, eos_token_id=None, decoder="eager")  # no EOS: 5 steps
        finally:
            kernels.kda_decode_step, fused.kda_decode_fused, fused.ENABLED = real_step, real_fused, kept
        assert got == want, on
        used, unused = ("fused", "step") if on else ("step", "fused")
        assert calls[unused] == 0 and calls[used] == 5, (on, calls)  # one KDA layer, 5 decode steps
    from k3lab.mixers.mla import MLACache

    mla = fast.model.layers[1].self_attn
    x = torch.randn(2, 96, fast.config.hidden_size, device="cuda")
    with torch.no_grad():
        _, c32 = mla(x[:, :64])
        y32, _ = mla(x[:, 64:], c32)  # fp32: the math path
        mla.bfloat16()
        y, _ = mla(x[:, 64:].bfloat16(), MLACache(c32.c_kv.bfloat16(), c32.k_rope.bfloat16()))  # 32 > 16 queries: naive
    assert rel_err(y, y32) < 2e-2  # bf16
