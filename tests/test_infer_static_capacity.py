"""One graph per batch bucket (issue 36, item 1): the static/graphed decoder's buffers hold a capacity chosen once.

CPU (``decoder="static"``, the graphed step's code): after one call at batch B, calls with other prompt lengths,
``max_new_tokens``, sampling values and stop tokens in B's bucket build nothing new (``builds`` unchanged) and give
the eager decoder's greedy tokens; a smaller batch in the bucket replays, a larger one builds one new set; the
step over the whole capacity (the graph's shapes, ``cpu_window=False``) gives the same tokens; speculative
decoding reuses its set across lengths too; a call past the capacity, and a capacity too large for memory, are
refused naming the argument before anything is allocated; the per-row tensor sampler equals the scalar one bit
for bit; ``decoder="auto"`` resolves as documented. GPU (``-m gpu``): the graph is captured once per bucket (and
sampling mode) and replayed for every length, ``max_new_tokens``, sampling value and stop set, = the static step.
"""

from __future__ import annotations

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.infer import GenerationStats, StaticDecoder, generate, next_token_probs, prefill
from k3lab.infer import static as static_mod
from k3lab.infer.sampling import next_token_probs_rows, sample_seeded
from k3lab.infer.static import AUTO_OFF_CUDA, DECODERS, decoder_for, resolve_decoder
from k3lab.model import K3ForCausalLM


def build(seed=0, device="cpu", **changes) -> K3ForCausalLM:
    base = dict(vocab_size=256, num_hidden_layers=2, full_attn_layers=[2], attn_res_block_size=1,
                initializer_range=0.1)  # a KDA layer, an MLA layer, the MoE; context-dependent tokens
    torch.manual_seed(seed)
    return K3ForCausalLM(ModelConfig.preset("tiny").replace(**{**base, **changes})).to(device).eval()


def prompts(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def new_tokens(rows, n, model, **kw):
    """The eager decoder's continuations of ``rows`` (the reference)."""
    return [r[len(p):] for r, p in zip(generate(model, rows, n, eos_token_id=None, decoder="eager", **kw), rows)]


@pytest.fixture(scope="module")
def model():
    return build()


def test_one_build_per_bucket_across_prompt_lengths_and_new_tokens(model):
    dec = StaticDecoder(model)
    assert dec.capacity == model.config.max_position_embeddings  # the default: the trained context
    warm = prompts([9, 9], seed=1)
    assert dec.decode(prefill(model, warm), 6) == new_tokens(warm, 6, model)
    assert (dec.builds, len(dec.kept)) == (1, 1)
    for lengths, n in (([5, 5], 12), ([37, 5], 3), ([200, 37], 40), ([5, 200], 1), ([2, 3], 57)):
        rows = prompts(lengths, seed=n)
        assert dec.decode(prefill(model, rows), n) == new_tokens(rows, n, model), (lengths, n)
    stop = new_tokens(warm, 6, model)[1][2]
    assert dec.decode(prefill(model, warm), 6, stop={stop}) == new_tokens(warm, 6, model, stop=stop)
    pre = prefill(model, prompts([30, 7], seed=2))
    sampled = [dec.decode(pre, 20, temperature=t, top_k=k, top_p=p, seeds=torch.tensor([5, 6]))
               for t, k, p in ((0.8, 20, None), (1.3, None, 0.9), (0.5, 3, 0.5))]
    assert dec.builds == 1 and len(dec.kept) == 1 and dec.captures == 0  # nothing built again
    fresh = [StaticDecoder(model).decode(pre, 20, temperature=t, top_k=k, top_p=p, seeds=torch.tensor([5, 6]))
             for t, k, p in ((0.8, 20, None), (1.3, None, 0.9), (0.5, 3, 0.5))]
    assert sampled == fresh  # refilled buffers: no state of an earlier call leaks into a later one
    assert sampled[0] != sampled[1]  # the sampling values reach the step (tensors, not a stale key)
    # through generate: the model's kept decoder, counted in the stats
    st = GenerationStats()
    generate(model, prompts([4, 8], seed=3), 5, decoder="static", stats=st)
    st2 = GenerationStats()
    got = generate(model, prompts([150, 3], seed=4), 33, eos_token_id=None, decoder="static", stats=st2)
    assert got == generate(model, prompts([150, 3], seed=4), 33, eos_token_id=None, decoder="eager")
    assert st2.builds == 0 and st2.captures == 0 and decoder_for(model, False).builds >= st.builds


def test_a_bucket_replays_for_fewer_rows_and_a_larger_batch_builds_one_set(model):
    dec = StaticDecoder(model)
    for lengths in ([6, 9, 4], [12, 3, 3, 40], [7]):  # bucket 4, bucket 4, then bucket 1
        rows = prompts(lengths, seed=len(lengths))
        assert dec.decode(prefill(model, rows), 8) == new_tokens(rows, 8, model)
    assert dec.builds == 2 and sorted(k.rows for k in dec.kept) == [1, 4]
    rows = prompts([3, 8, 5], seed=9)  # 3 rows: bucket 4 again
    assert dec.decode(prefill(model, rows), 10) == new_tokens(rows, 10, model)
    assert dec.builds == 2
    rows = prompts([5, 6, 7, 8, 9], seed=10)  # 5 rows: bucket 8, one new set
    assert dec.decode(prefill(model, rows), 10) == new_tokens(rows, 10, model)
    assert dec.builds == 3 and sorted(k.rows for k in dec.kept) == [1, 4, 8]


def test_the_whole_capacity_gives_the_windowed_tokens(model):
    """``cpu_window=False``: the step attends to all ``capacity`` slots, the shapes a CUDA graph captures."""
    full = StaticDecoder(model, capacity=1024)
    full.cpu_window = False
    for lengths, n in (([5, 37], 20), ([200, 9], 12)):
        rows = prompts(lengths, seed=n)
        pre = prefill(model, rows)
        assert full.decode(pre, n) == new_tokens(rows, n, model)
        seeds = torch.tensor([3, 4])
        assert full.decode(pre, n, temperature=0.9, top_p=0.8, seeds=seeds) == StaticDecoder(model).decode(
            pre, n, temperature=0.9, top_p=0.8, seeds=seeds)
    assert full.builds == 1


def test_speculative_buffers_serve_every_length_of_one_k():
    mtp = build(seed=1, vocab_size=6, num_nextn_predict_layers=1)
    dec = StaticDecoder(mtp)
    for lengths, n in (([5, 13, 1], 16), ([40, 2, 9], 9), ([3], 25), ([90, 7, 7, 2], 4)):  # buckets 4, 4, 1, 4
        rows = prompts(lengths, seed=n, vocab=6)
        got = dec.speculate([prefill(mtp, [r], mtp=True) for r in rows], 2, n)
        assert got == new_tokens(rows, n, mtp), (lengths, n)
    assert sorted((k.kind, k.rows, k.k) for k in dec.kept) == [("spec", 1, 2), ("spec", 4, 2)] and dec.builds == 2


def test_past_the_capacity_or_the_memory_is_refused_by_name_before_allocating(model, monkeypatch):
    dec = StaticDecoder(model, capacity=64)
    pre = prefill(model, prompts([40, 12], seed=5))
    with pytest.raises(ValueError, match=r"^max_new_tokens=25: the longest prompt \(40 tokens\) \+ max_new_tokens > "
                                         r"capacity=64 [^\n]*at most 24 here$"):
        dec.decode(pre, 25)
    mtp = build(seed=1, vocab_size=6, num_nextn_predict_layers=1)
    spec = StaticDecoder(mtp, capacity=16)
    with pytest.raises(ValueError, match=r"^max_new_tokens=7: the longest prompt \(10 tokens\) .* capacity=16"):
        spec.speculate([prefill(mtp, [r], mtp=True) for r in prompts([10, 3], vocab=6)], 2, 7)
    assert dec.kept == {} and dec.builds == 0 and spec.kept == {} and spec.builds == 0
    assert dec.decode(pre, 24) == new_tokens(prompts([40, 12], seed=5), 24, model)  # exactly full: fine
    for bad in (0, -3, 2.5, True, "4096"):
        with pytest.raises(ValueError, match=rf"^capacity={bad!r}: must be an integer >= 1$"):
            StaticDecoder(model, capacity=bad)
    with pytest.raises(ValueError, match=r"^capacity=10000000000000: the static caches of 1 row\(s\) need .* GiB, more "
                                         r"than the .* GiB free on cpu; pass a smaller capacity"):
        StaticDecoder(model, capacity=10**13)  # ~1.6 PB of latents for one row: refused at construction
    small = StaticDecoder(model, capacity=512)
    monkeypatch.setattr(static_mod, "free_bytes", lambda device: 10_000)  # a device with 10 kB free
    with pytest.raises(ValueError, match=r"^capacity=512: the static caches of 2 row\(s\) need"):
        small.decode(pre, 4)
    assert small.kept == {} and small.builds == 0
    with pytest.raises(ValueError, match=r"^stop=\{300\}: token ids must be integers in \[0, vocab_size=256\)$"):
        dec.decode(pre, 4, stop={300})


def test_row_tensor_sampler_equals_the_scalar_one_bit_for_bit():
    z = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)) * 3
    params = [(0.7, None, None), (1.3, 50, None), (0.37, None, 0.9), (1.0, 7, 0.5)]  # one row each
    t = torch.tensor([p[0] for p in params])
    k = torch.tensor([3000 if p[1] is None else p[1] for p in params])
    p = torch.tensor([1.0 if p[2] is None else p[2] for p in params])
    rows = next_token_probs_rows(z, t, k, p)
    seeds, step = torch.tensor([4, 5, 6, 7]), torch.tensor(11)
    drawn = sample_seeded(z, t, k, p, seeds, step)
    for i, (ti, ki, pi) in enumerate(params):
        assert torch.equal(rows[i:i + 1], next_token_probs(z[i:i + 1], ti, ki, pi)), params[i]
        assert torch.equal(drawn[i:i + 1], sample_seeded(z[i:i + 1], ti, ki, pi, seeds[i:i + 1], step))


def test_auto_resolves_as_documented(model):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert DECODERS == ("auto", "eager", "static", "graph") and AUTO_OFF_CUDA in ("eager", "static")
    assert resolve_decoder("auto", cpu) == AUTO_OFF_CUDA and resolve_decoder("auto", cuda) == "graph"
    assert resolve_decoder("auto", cuda, draft=2, temperature=0.7) == "eager"  # static drafts are greedy only
    assert resolve_decoder("auto", cuda, draft=2) == "graph"
    assert resolve_decoder("auto", cuda, in_context=False) == "eager"  # past the context: caches that grow
    assert [resolve_decoder(d, cuda) for d in ("eager", "static", "graph")] == ["eager", "static", "graph"]
    rows = prompts([6, 11], seed=7)
    assert generate(model, rows, 9, eos_token_id=None) == generate(model, rows, 9, eos_token_id=None, decoder="eager")


# ----------------------------------------------------------------------------------------------
# GPU: one capture per bucket (and sampling mode), replayed for every call in it
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_is_captured_once_per_bucket_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gpu = build(seed=4, device="cuda", backend="auto").to(getattr(torch, dtype))
    graphed, static = StaticDecoder(gpu, graph=True), StaticDecoder(gpu)
    warm = prompts([9, 9], seed=1)
    graphed.decode(prefill(gpu, warm), 6)
    assert (graphed.builds, graphed.captures) == (1, 1)
    for lengths, n in (([5, 5], 12), ([37, 5], 3), ([200, 37], 40), ([2, 3], 57)):
        rows = prompts(lengths, seed=n)
        pre = prefill(gpu, rows)
        got = graphed.decode(pre, n)
        assert got == static.decode(pre, n), (lengths, n)  # the replay = the static step
        if dtype == "float32":
            assert got == new_tokens(rows, n, gpu), (lengths, n)
    assert (graphed.builds, graphed.captures) == (1, 1)  # greedy: one graph for every length and max_new_tokens
    pre = prefill(gpu, prompts([30, 7], seed=2))
    seeds = torch.tensor([5, 6])
    for t, k, p, stop in ((0.8, 20, None, ()), (1.3, None, 0.9, (7, 9)), (0.5, 3, 0.5, (11,))):
        got = graphed.decode(pre, 20, temperature=t, top_k=k, top_p=p, stop=set(stop), seeds=seeds)
        assert got == static.decode(pre, 20, temperature=t, top_k=k, top_p=p, stop=set(stop), seeds=seeds)
    assert (graphed.builds, graphed.captures) == (1, 2)  # + the sampling graph, once
    rows = prompts([4, 8, 15], seed=3)  # 3 rows: bucket 4, one new set and graph
    pre = prefill(gpu, rows)
    assert graphed.decode(pre, 10) == static.decode(pre, 10)
    assert (graphed.builds, graphed.captures) == (2, 3)
    st = GenerationStats()  # generate's kept graphed decoder, counted in the stats
    generate(gpu, warm, 6, eos_token_id=None, decoder="graph")
    generate(gpu, prompts([100, 3], seed=8), 21, eos_token_id=None, stats=st)  # decoder="auto": the graph on CUDA
    assert st.builds == 0 and st.captures == 0


@pytest.mark.gpu
def test_graph_speculative_is_captured_once_per_bucket_and_k_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    mtp = build(seed=1, device="cuda", backend="auto", vocab_size=6, num_nextn_predict_layers=1)
    graphed = StaticDecoder(mtp, graph=True)
    for lengths, n in (([5, 13], 16), ([40, 2], 9), ([3, 64], 25)):
        rows = prompts(lengths, seed=n, vocab=6)
        got = graphed.speculate([prefill(mtp, [r], mtp=True) for r in rows], 2, n)
        assert got == new_tokens(rows, n, mtp), (lengths, n)
    assert (graphed.builds, graphed.captures) == (1, 1)


def test_auto_shrinks_the_caches_to_the_call_where_the_context_does_not_fit(monkeypatch):
    """``decoder="auto"`` (``fit``): where the static caches of the model's whole context (4,096 slots) do not fit,
    the call runs on a decoder sized for its own prompt + new tokens — the eager tokens; an explicit decoder
    (``fit=False``) raises the CapacityError naming ``capacity``."""
    from k3lab.infer.generate import static_run
    from k3lab.infer.static import CapacityError, config_bytes, slots_for

    model = build(seed=3)
    rows = prompts([30, 9], seed=2)
    need = 30 + 12
    budget = 4 * config_bytes(model.config, 2, slots_for(need), 4)  # room for the call, not for 4,096 slots
    assert config_bytes(model.config, 1, model.config.max_position_embeddings, 4) > budget
    monkeypatch.setattr(static_mod, "free_bytes", lambda device: budget)
    pre = prefill(model, rows)
    with pytest.raises(CapacityError, match=r"^capacity=4096: the static caches of 1 row\(s\) need"):
        static_run(model, False, need, False, lambda dec: dec.decode(pre, 12))
    got = static_run(model, False, need, True, lambda dec: dec.decode(pre, 12))
    assert got == new_tokens(rows, 12, model)
