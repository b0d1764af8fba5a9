"""The static (preallocated) decoder and its CUDA graph (k3lab.infer.static) against the eager decoder.

CPU: the static step = the eager step (fp32 logits to 1e-5, greedy tokens equal, mixed batches = rows
alone, RoPE too), seeded sampling draws from the right distribution and a row's draws do not depend on
its batch. GPU (``-m gpu``): the graphed step = the static step = the eager one (fp32 and bf16).
"""

from __future__ import annotations

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.infer import GenerationStats, StaticDecoder, generate, next_token_probs, prefill
from k3lab.infer import cache as hcache
from k3lab.infer.sampling import counter_uniform, sample_seeded
from k3lab.infer.static import BATCH_BUCKETS, allocate, batch_bucket, load, slots_for
from k3lab.model import K3ForCausalLM
from k3lab.testing import rel_err

FP32_TOL = 1e-5  # static vs eager step: the same math over a longer, masked buffer (fp32 rounding)


def build(seed=0, device="cpu", **changes) -> K3ForCausalLM:
    base = dict(vocab_size=256, num_hidden_layers=2, full_attn_layers=[2], attn_res_block_size=1,
                initializer_range=0.1)  # two layers: a KDA cache and an MLA cache, the MoE; context-dependent tokens
    torch.manual_seed(seed)
    return K3ForCausalLM(ModelConfig.preset("tiny").replace(**{**base, **changes})).to(device).eval()


def prompts(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
    return build()


def test_static_greedy_equals_eager_mixed_batch(model):
    rows = prompts([5, 9, 3])
    eager = generate(model, rows, 12, eos_token_id=None)
    static = generate(model, rows, 12, eos_token_id=None, decoder="static")
    assert static == eager
    alone = [generate(model, [r], 12, eos_token_id=None, decoder="static")[0] for r in rows]
    assert static == alone  # batch bucket 4 (3 rows + 1 copy of row 0): each row = the row alone


@torch.no_grad()
def test_static_step_logits_equal_eager(model):
    rows = prompts([6, 4])
    pre = prefill(model, rows)
    buf = allocate(pre, 2, slots_for(pre.cache.offset + 8))
    load(buf, pre, torch.arange(2))
    cache, tok = pre.cache, pre.logits.argmax(-1)  # [B]
    for _ in range(6):
        step = hcache.forward(model, tok[:, None], cache, last=1)
        static = hcache.forward(model, tok[:, None], buf.cache, last=1)  # writes slot `length` in place
        buf.length.add_(1)
        assert rel_err(static.logits, step.logits) < FP32_TOL
        cache, tok = step.cache, step.logits[:, -1].argmax(-1)


def test_static_rope_equals_eager():
    model = build(seed=3, mla_use_nope=False)
    rows = prompts([7, 2], seed=3)
    assert generate(model, rows, 10, eos_token_id=None, decoder="static") == generate(model, rows, 10,
                                                                                      eos_token_id=None)


def test_stop_token_ends_only_its_row(model):
    rows = prompts([5, 8], seed=1)
    free = generate(model, rows, 10, eos_token_id=None, decoder="static")
    stop = free[0][5 + 2]  # row 0's third new token
    got = generate(model, rows, 10, eos_token_id=None, stop=stop, decoder="static")
    want = generate(model, rows, 10, eos_token_id=None, stop=stop)
    assert got == want and len(got[0]) <= 5 + 3


def test_seeded_sampling_row_alone_equals_batch(model):
    rows = prompts([4, 6, 5], seed=2)
    pre = prefill(model, rows)
    seeds = torch.tensor([11, 22, 33])
    dec = StaticDecoder(model)
    batch = dec.decode(pre, 9, temperature=0.9, top_k=50, seeds=seeds)
    for i, r in enumerate(rows):
        alone = dec.decode(prefill(model, [r]), 9, temperature=0.9, top_k=50, seeds=seeds[i:i + 1])
        assert alone[0] == batch[i]
    again = dec.decode(pre, 9, temperature=0.9, top_k=50, seeds=torch.tensor([11, 22, 34]))
    assert again[:2] == batch[:2] and again[2] != batch[2]  # a row's draws follow its own seed only


def test_seeded_sampling_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 1.5
    probs = next_token_probs(logits, 0.8, top_k=6)
    n = 4000
    toks = torch.stack([sample_seeded(logits, 0.8, 6, None, torch.tensor([5]), torch.tensor(s)) for s in range(n)])
    freq = torch.bincount(toks.flatten(), minlength=12).double() / n
    assert (freq[probs[0] == 0] == 0).all()  # never outside the top 6
    sd = (probs[0].double() * (1 - probs[0].double()) / n).sqrt()
    assert ((freq - probs[0].double()).abs() <= 5 * sd + 1e-12).all()  # every frequency within 5 standard errors


def test_counter_uniform_is_uniform_and_row_independent():
    u = counter_uniform(torch.tensor([1, 2]), torch.tensor(0), 100_000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.005
    assert (u[0] != u[1]).float().mean() > 0.99
    assert torch.equal(counter_uniform(torch.tensor([2]), torch.tensor(0), 100_000)[0], u[1])


def test_decoder_argument_errors(model):
    with pytest.raises(ValueError, match=r"decoder='graph' needs a CUDA device"):
        generate(model, [[1, 2, 3]], 4, decoder="graph")
    allowed = r"allowed values are \('auto', 'eager', 'static', 'graph'\)$"
    with pytest.raises(ValueError, match=r"^decoder='fast': " + allowed):
        generate(model, [[1, 2, 3]], 4, decoder="fast")
    with pytest.raises(ValueError, match=r"^decoder=None: allowed values are \('auto', "):
        generate(model, [[1, 2, 3]], 4, decoder=None)
    mtp = build(seed=1, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match=r"temperature=1.0 with decoder='static' and draft=2"):
        generate(mtp, [[1, 2, 3]], 4, temperature=1.0, draft=2, decoder="static")


def test_batch_buckets():
    assert [batch_bucket(b) for b in (1, 3, 5, 64, 65, 300)] == [1, 4, 8, 64, 128, 300]
    assert BATCH_BUCKETS[0] == 1 and slots_for(1) == slots_for(256) == 256 and slots_for(257) == 512


# ----------------------------------------------------------------------------------------------
# GPU: the graph replays the static step
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_equals_static_and_eager_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = build(seed=4, device="cuda", backend="auto").to(getattr(torch, dtype))
    rows = prompts([37, 12, 64], seed=4)
    eager = generate(model, rows, 40, eos_token_id=None)
    static = generate(model, rows, 40, eos_token_id=None, decoder="static")
    graph = generate(model, rows, 40, eos_token_id=None, decoder="graph")
    assert graph == static == eager
    dec = StaticDecoder(model, graph=True)
    pre = prefill(model, rows)
    first = dec.decode(pre, 40, temperature=1.0, top_p=0.9, seeds=torch.tensor([1, 2, 3]))
    again = dec.decode(pre, 40, temperature=1.0, top_p=0.9, seeds=torch.tensor([1, 2, 3]))
    assert dec.captures == 1 and first == again  # the second call replays the kept graph
    assert StaticDecoder(model).decode(pre, 40, temperature=1.0, top_p=0.9, seeds=torch.tensor([1, 2, 3])) == first


@pytest.mark.gpu
def test_latent_attention_lowp_matches_fp32_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from k3lab.mixers.mla import attention_math, latent_attention_lowp

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, R, rho, S = 3, 1, 4, 64, 16, 777
    q_lat = torch.randn(B, T, H, R, device="cuda", generator=g)
    q_rope = torch.randn(B, T, H, rho, device="cuda", generator=g)
    c_kv = torch.randn(B, S, R, device="cuda", generator=g).bfloat16()
    k_rope = torch.randn(B, S, rho, device="cuda", generator=g).bfloat16()
    mask = torch.rand(B, S, device="cuda", generator=g) > 0.3
    got = latent_attention_lowp(q_lat, q_rope, c_kv, k_rope, 0.1, S - 1, mask)
    q = torch.cat([q_lat, q_rope], -1).transpose(1, 2)
    want, _ = attention_math(q, torch.cat([c_kv, k_rope], -1)[:, None].float(), c_kv[:, None].float(), 0.1, S - 1, mask)
    assert rel_err(got, want) < 1e-2  # bf16 q and p: bf16 tolerance


def test_decoder_keeps_at_most_max_kept_buffer_sets(model):
    from k3lab.infer.static import MAX_KEPT

    dec = StaticDecoder(model)
    for n in range(MAX_KEPT + 2):  # batch sizes of a new bucket each call (1, 2, 4, 8, ...): a new key each time
        dec.decode(prefill(model, prompts([4] * 2 ** n, seed=n)), 3)
    assert len(dec.kept) == MAX_KEPT and dec.builds == MAX_KEPT + 2
    assert max(k.rows for k in dec.kept) == 2 ** (MAX_KEPT + 1)  # the newest stays


def test_static_with_prefix_cache_equals_eager(model):
    from k3lab.infer import PrefixCache

    doc = prompts([48], seed=5)[0]
    rows = [doc + q for q in prompts([3, 6], seed=6)]
    eager = generate(model, rows, 8, eos_token_id=None)
    cache = PrefixCache(model, block_tokens=16)
    generate(model, rows[:1], 2, eos_token_id=None, prefix_cache=cache)  # fills the cache with the document
    st = GenerationStats()
    assert generate(model, rows, 8, eos_token_id=None, prefix_cache=cache, decoder="static", stats=st) == eager
    assert st.cached_tokens >= 2 * 32  # both rows start from cached document blocks
