"""Speculative decoding on the static decoder (k3lab.infer.static.StaticDecoder.speculate): MTP drafts, one verify
forward, acceptance and rollback on the device — the step a CUDA graph replays.

CPU (fp32): the tokens equal plain greedy decoding for k = 1, 2, 3 with prompts of different lengths in one batch
(NoPE and RoPE), the acceptance counts equal the eager speculative path's row by row, the caches after decoding
equal the caches of feeding only the kept tokens (KDA state and conv tails, MLA latents and key mask, the MTP
head's cache), a drafter that is always right is always accepted, stop tokens end their row as on the eager path,
and the refusals are one line naming the argument. GPU (``-m gpu``): decoder="graph" = decoder="static" = plain
greedy, fp32 and bf16.

The model is the two-layer tiny one (a KDA layer, an MLA layer, the MoE, the MTP head) with a 6-token vocabulary:
an untrained MTP head then guesses right often enough (about one draft in ten) for steps that accept 0, 1, 2 and
all 3 drafts, and the last steps' shorter drafts (``k_eff < k``), to occur.
"""

from __future__ import annotations

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.infer import GenerationStats, StaticDecoder, generate, prefill, prefill_rows
from k3lab.infer.speculative import accept_greedy, accept_greedy_rows
from k3lab.mixers.kda import StaticKDAStepCache
from k3lab.mixers.mla import StaticMLACache
from k3lab.model import K3ForCausalLM
from k3lab.testing import rel_err

FP32_TOL = 1e-5  # static caches vs feeding the kept tokens: per-token vs chunked recurrence, fp32 rounding
VOCAB = 6


def build(seed=1, device="cpu", **changes) -> K3ForCausalLM:
    base = dict(vocab_size=VOCAB, num_hidden_layers=2, full_attn_layers=[2], attn_res_block_size=1,
                initializer_range=0.1, num_nextn_predict_layers=1)
    torch.manual_seed(seed)
    return K3ForCausalLM(ModelConfig.preset("tiny").replace(**{**base, **changes})).to(device).eval()


def prompts(lengths, seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
    return build()


ROWS = prompts([5, 13, 1])  # three lengths (one a single token: an empty MTP cache) in one batch of bucket 4


@pytest.fixture(scope="module")
def plain(model):
    return generate(model, ROWS, 16, eos_token_id=None)  # plain greedy, eager decoder


@pytest.mark.parametrize("k", [1, 2, 3])
def test_static_speculative_equals_plain_greedy_and_counts_as_eager(model, plain, k):
    n = 16
    st, eager_st = GenerationStats(), GenerationStats()
    assert generate(model, ROWS, n, eos_token_id=None, draft=k, decoder="static", stats=st) == plain
    generate(model, ROWS, n, eos_token_id=None, draft=k, stats=eager_st)
    assert st.per_row == eager_st.per_row  # (drafted, accepted) of every row, the eager path's
    assert (st.drafted, st.accepted, st.mtp_forwards) == (eager_st.drafted, eager_st.accepted, eager_st.mtp_forwards)
    assert st.accepted > 0 and st.new_tokens == eager_st.new_tokens == 3 * n
    assert st.forwards == max(n - 1 - a for _, a in st.per_row)  # the longest row's verifies: each emits 1 + accepted


def test_static_speculative_rope_equals_plain_greedy():
    rope = build(seed=3, mla_use_nope=False)  # per-row positions: the MLA and MTP caches' RoPE angles
    rows = prompts([7, 2], seed=3)
    assert generate(rope, rows, 12, eos_token_id=None, draft=2, decoder="static") == generate(rope, rows, 12,
                                                                                              eos_token_id=None)


@torch.no_grad()
def test_caches_after_decoding_equal_feeding_the_kept_tokens(model):
    """The rollback on the device: every row's static caches equal a prefill of its prompt and kept tokens."""
    k, n = 3, 12
    dec = StaticDecoder(model)
    pres = [prefill(model, [r], mtp=True) for r in ROWS]
    dec.speculate(pres, k, n)
    (buf, _), = [v for key, v in dec.kept.items() if key[0] == "spec"]
    for b, prompt in enumerate(ROWS):
        emitted = int(buf.emitted[b])
        kept = prompt + buf.out[b, :emitted - 1].tolist()  # fed: the last emitted token is pending
        assert int(buf.tokens[b]) == int(buf.out[b, emitted - 1])
        ref = prefill_rows(model, torch.tensor([kept]), mtp=True)
        L = len(kept)
        for got, want in zip(buf.cache.layers, ref.cache.layers):
            if isinstance(got, StaticKDAStepCache):
                for name in ("recurrent", "conv_q", "conv_k", "conv_v"):
                    assert rel_err(getattr(got, name)[b], getattr(want, name)[0]) < FP32_TOL, (b, name)
            else:
                assert isinstance(got, StaticMLACache) and int(got.length[b]) == L
                assert got.key_mask[b].tolist() == [s < L for s in range(got.key_mask.shape[1])]
                assert rel_err(got.c_kv[b, :L], want.c_kv[0]) < FP32_TOL
        M = int(buf.mtp.length[b])  # the MTP head holds (h_t, x_{t+1}) up to the pending entries
        assert M == L - int(buf.pend_n[b]) and int(buf.mtp.key_mask[b].sum()) == M
        if M:
            assert rel_err(buf.mtp.c_kv[b, :M], ref.mtp_cache.c_kv[0, :M]) < FP32_TOL
    again = dec.speculate(pres, k, n)  # the kept buffers are reused and refilled
    assert again == dec.speculate([prefill(model, [r], mtp=True) for r in ROWS], k, n)
    assert sum(key[0] == "spec" for key in dec.kept) == 1


def test_a_right_drafter_is_always_accepted():
    sure = build(seed=2)
    with torch.no_grad():  # the final norms at 0: every logit is 0, main model and MTP head both pick token 0
        sure.model.norm.weight.zero_()
        sure.mtp.norm.weight.zero_()
    st, eager_st = GenerationStats(), GenerationStats()
    out = generate(sure, ROWS[:2], 11, eos_token_id=None, draft=3, decoder="static", stats=st)
    assert out == [r + [0] * 11 for r in ROWS[:2]]
    generate(sure, ROWS[:2], 11, eos_token_id=None, draft=3, stats=eager_st)
    assert st.per_row == eager_st.per_row == [(7, 7), (7, 7)]  # 3 + 3 drafts, then k_eff = min(3, 11 - 9 - 1) = 1
    assert st.forwards == 3  # 11 tokens = the prefill's 1 + 4 + 4 + 2 (the static step's 4 cut to 2)


def test_stop_tokens_end_their_row_as_on_the_eager_path(model, plain):
    free = plain
    stop = free[0][len(ROWS[0]) + 4]  # row 0's fifth new token
    for k in (1, 3):
        st, eager_st = GenerationStats(), GenerationStats()
        got = generate(model, ROWS, 16, eos_token_id=None, stop=stop, draft=k, decoder="static", stats=st)
        assert got == generate(model, ROWS, 16, eos_token_id=None, stop=stop, draft=k, stats=eager_st)
        assert got == generate(model, ROWS, 16, eos_token_id=None, stop=stop)
        assert st.per_row == eager_st.per_row and len(got[0]) <= len(ROWS[0]) + 5
    first = free[1][len(ROWS[1])]  # row 1's first new token, from the prefill: the row is done before any step
    got = generate(model, ROWS, 16, eos_token_id=None, stop=first, draft=2, decoder="static")
    assert got == generate(model, ROWS, 16, eos_token_id=None, stop=first) and got[1] == ROWS[1] + [first]
    assert generate(model, ROWS, 1, eos_token_id=None, draft=2, decoder="static") == [r[:len(p) + 1] for r, p in
                                                                                      zip(free, ROWS)]


def test_accept_greedy_rows_equals_accept_greedy():
    g = torch.Generator().manual_seed(0)
    best = torch.randint(0, 3, (64, 4), generator=g)
    drafts = torch.randint(0, 3, (64, 3), generator=g)
    logits = torch.nn.functional.one_hot(best, 3).float()  # argmax = best
    j = accept_greedy_rows(best, drafts)
    for b in range(64):
        assert (int(j[b]), int(best[b, j[b]])) == accept_greedy(logits[b], drafts[b].tolist())


def test_refusals_are_one_line_naming_the_argument(model):
    with pytest.raises(ValueError, match=r"^temperature=0\.7 with decoder='static' and draft=2: [^\n]*greedy only"):
        generate(model, ROWS, 4, temperature=0.7, draft=2, decoder="static")
    with pytest.raises(ValueError, match=r"^decoder='graph' needs a CUDA device"):
        generate(model, ROWS, 4, draft=2, decoder="graph")
    from k3lab.infer import PrefixCache

    with pytest.raises(ValueError, match=r"^draft and prefix_cache"):
        generate(model, ROWS, 4, draft=2, decoder="static", prefix_cache=PrefixCache(model, block_tokens=4))
    pres = [prefill(model, [ROWS[0]], mtp=True)]
    with pytest.raises(ValueError, match=r"^k=0: must be an integer >= 1$"):
        StaticDecoder(model).speculate(pres, 0, 4)
    with pytest.raises(ValueError, match=r"^model: has no MTP head"):
        StaticDecoder(build(num_nextn_predict_layers=0)).speculate(pres, 2, 4)
    with pytest.raises(ValueError, match=r"^pres: rows prefilled with mtp=True"):
        StaticDecoder(model).speculate(prefill(model, [ROWS[0]]), 2, 4)
    assert StaticDecoder(model).speculate(pres, 2, 0) == [[]]


# ----------------------------------------------------------------------------------------------
# GPU: the graph replays the static speculative step
# ----------------------------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", [256, VOCAB])  # drafts almost never right / right often enough for every j
def test_graph_speculative_equals_static_and_plain_greedy_gpu(dtype, vocab):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from k3lab.infer.static import decoder_for

    gpu = build(seed=4 if vocab == 256 else 1, device="cuda", backend="auto", vocab_size=vocab).to(getattr(torch, dtype))
    rows = prompts([37, 12, 64], seed=4, vocab=vocab)
    n = 40
    plain = generate(gpu, rows, n, eos_token_id=None)
    for k in (1, 2, 3):
        st = GenerationStats()
        static = generate(gpu, rows, n, eos_token_id=None, draft=k, decoder="static")
        captures = decoder_for(gpu, True).captures
        graph = generate(gpu, rows, n, eos_token_id=None, draft=k, decoder="graph", stats=st)
        assert decoder_for(gpu, True).captures == captures + 1
        assert graph == static, k  # the graph replays the static step: the same kernels, the same numbers
        assert generate(gpu, rows, n, eos_token_id=None, draft=k, decoder="graph") == graph  # replayed, not recaptured
        assert decoder_for(gpu, True).captures == captures + 1
        where = [first_difference(g, p) for g, p in zip(graph, plain)]
        if dtype == "float32":  # bf16: a k+1-token verify rounds differently from k+1 one-token steps, and this
            # random-init model's near-tied logits flip (measured on the H200, 2026-12-04: rows first differ after
            # 15-40 new tokens), as they do on the eager speculative path; the bf16 check is graph == static above
            assert graph == plain, f"k={k} {dtype}: first differences from plain greedy at {where} (prompt lengths " \
                                   f"{[len(r) for r in rows]})"
        assert st.new_tokens == 3 * n and st.drafted > 0 and (vocab == 256 or st.accepted > 0)
