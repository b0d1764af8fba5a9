"""Exact sampling and state on the static/graphed decoder's path (issue 36, "What to build" 4).

The tests of these faults failed before the fix (CPU, ``decoder="static"``, which runs the graphed step's code;
the V = 12 chi-square cases, the helpers' own tests and the normal-mode-first order are controls that passed
before too; ``-m gpu``: the same inside the CUDA graph, where the stale graph after ``model.float()`` gave garbage):

* the seeded sampler (:func:`k3lab.infer.sampling.sample_seeded`) drew tokens outside top-k / top-p — a 24-bit
  float32 uniform that rounds to 1.0 gives an infinite Gumbel noise, ``-inf + inf = NaN`` and argmax picks the
  masked token (≈ 1% of draws at K3's vocabulary); ``top_k=1`` was not always argmax; the chi-square test of the
  draws against the exact renormalised distribution failed on the masked cases and on a peaked unmasked one;
* kept static-decoder buffers survived a change of the model's dtype (bf16 buffers after ``model.float()``);
* a call under ``torch.inference_mode()`` left inference tensors in the kept buffers: the next normal call raised;
* ``draft=10**9`` on the static decoder allocated ``k + 1`` KDA states (terabytes) where eager clamps it;
  ``prefill()`` and ``PrefixCache.prefill`` took prompts past ``max_position_embeddings`` without a word.
"""

from __future__ import annotations

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.infer import GenerationStats, PrefixCache, StaticDecoder, generate, next_token_probs, prefill
from k3lab.infer.sampling import sample_seeded
from k3lab.model import K3ForCausalLM

K3_VOCAB = 163_840
DRAWS = 20_000
P_MIN = 1e-3  # chi-square p-value below which the draws do not follow the exact distribution


def build(seed=0, **changes) -> K3ForCausalLM:
    base = dict(vocab_size=256, num_hidden_layers=2, full_attn_layers=[2], attn_res_block_size=1,
                initializer_range=0.1)  # a KDA layer, an MLA layer, the MoE
    torch.manual_seed(seed)
    return K3ForCausalLM(ModelConfig.preset("tiny").replace(**{**base, **changes})).eval()


def prompts(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


# ----------------------------------------------------------------------------------------------
# the seeded sampler
# ----------------------------------------------------------------------------------------------
def draws(logits: torch.Tensor, temperature, top_k, top_p, n=DRAWS, by_step=False) -> torch.Tensor:
    """``n`` seeded draws [n] from one row of logits [1, V]: seeds 0..n-1 at step 0, or (``by_step``) seed 7 at
    steps 0..n-1 — the two ways a row's noise changes. In chunks (the pre-fix sampler builds [n, V] noise)."""
    V = logits.shape[-1]
    chunk = max(1, (1 << 25) // V)
    out = []
    for i in range(0, n, chunk):
        idx = torch.arange(i, min(n, i + chunk))
        seeds, step = (torch.tensor([7]), idx) if by_step else (idx, torch.tensor(0))
        out.append(sample_seeded(logits, temperature, top_k, top_p, seeds, step).reshape(-1))
    got = torch.cat(out)
    assert got.shape == (n,)
    return got


def exact_probs(z: torch.Tensor, temperature, top_k=None, top_p=None) -> torch.Tensor:
    """The sampling distribution [V] float64, computed apart from the sampler: softmax(z / τ), top-k (ties at
    the k-th kept), renormalised, top-p (the smallest prefix by probability reaching top_p), renormalised."""
    s = (z.double() - z.double().max()) / temperature
    p = s.softmax(0)
    if top_k is not None and top_k < z.numel():
        p = torch.where(s >= s.sort(descending=True).values[top_k - 1], p, 0.0)
        p = p / p.sum()
    if top_p is not None and top_p < 1:
        sp, order = p.sort(descending=True)
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order] = (sp.cumsum(0) - sp) < top_p
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    return p


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's goodness of fit of ``tokens`` to ``p`` [V]: (statistic, degrees of freedom, p-value).

    Tokens with expected count >= 5 are bins of their own, the rest of the support is pooled (and merged into the
    smallest bin while its expected count is < 5); a draw where ``p = 0`` makes the statistic infinite (p = 0).
    p-value = Q(df/2, x/2), the regularised upper incomplete gamma function (``torch.special.gammaincc``)."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    if counts[p == 0].sum() > 0:
        return float("inf"), 0, 0.0
    expected = n * p
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    tail = (~big) & (p > 0)
    if tail.any():
        o, e = counts[tail].sum(), expected[tail].sum()
        if e < 5:
            j = min(range(len(exp)), key=lambda i: exp[i])
            obs[j], exp[j] = obs[j] + o, exp[j] + e
        else:
            obs, exp = obs + [o], exp + [e]
    obs, exp = torch.stack(obs), torch.stack(exp)
    x = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    f64 = dict(dtype=torch.float64)
    pval = float(torch.special.gammaincc(torch.tensor(df / 2, **f64), torch.tensor(x / 2, **f64)))
    return x, df, pval


def test_chi_square_helper_rejects_and_accepts():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    fair = torch.multinomial(p, DRAWS, replacement=True, generator=g)
    assert chi_square(fair, p)[2] > P_MIN
    assert chi_square(torch.cat([fair, torch.tensor([3])]), p)[2] == 0.0  # one impossible draw
    skew = torch.multinomial(torch.tensor([0.52, 0.29, 0.19, 0.0], dtype=torch.float64), DRAWS, replacement=True,
                             generator=g)
    assert chi_square(skew, p)[2] < P_MIN
    # df 2, x 2: Q(1, 1) = e^-1
    assert abs(float(torch.special.gammaincc(torch.tensor(1.0), torch.tensor(1.0))) - 0.36787944) < 1e-6


def k3_logits(seed=0, scale=2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, K3_VOCAB, generator=g) * scale


@pytest.mark.parametrize("top_k, top_p", [(50, None), (None, 0.9), (50, 0.5)])
def test_seeded_draws_never_leave_top_k_top_p_at_k3_vocabulary(top_k, top_p):
    """20,000 draws, V = 163,840: not one outside the allowed set (before: ≈ 1%, n·(V − k)/2^24)."""
    z = k3_logits(seed=1)
    allowed = next_token_probs(z, 1.0, top_k, top_p)[0] > 0
    assert 1 < int(allowed.sum()) < K3_VOCAB // 2
    tok = draws(z, 1.0, top_k, top_p)
    outside = int((~allowed[tok]).sum())
    assert outside == 0, f"{outside} of {DRAWS} draws outside top_k={top_k} / top_p={top_p}"


def test_top_k_1_is_greedy_for_every_seed():
    """top_k=1 = argmax for 20,000 seeds (and steps) at V = 163,840, with and without top_p or a low temperature."""
    for i, (t, p, by_step) in enumerate([(1.0, None, False), (0.7, 0.9, True), (2.0, None, True), (1.0, 0.3, False)]):
        z = k3_logits(seed=10 + i)
        tok = draws(z, t, 1, p, n=DRAWS // 4, by_step=by_step)
        assert (tok == z.argmax(-1)).all(), f"case {i}: {int((tok != z.argmax(-1)).sum())} draws differ from argmax"


def peaked_logits(V: int, head: int, seed: int, gap: float = 16.0) -> torch.Tensor:
    """Like a trained model's: ``head`` plausible tokens, the rest ``gap`` nats below (a tail of tiny total mass)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g) - gap
    z[torch.randperm(V, generator=g)[:head]] = torch.randn(head, generator=g) * 1.5
    return z[None]


def gaussian_logits(V: int, seed: int, scale: float) -> torch.Tensor:
    return torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * scale


CHI_CASES = {  # name: (V, logits, temperature, top_k, top_p, by_step)
    # V = 12: controls (a 24-bit uniform of 1.0 is too rare there to show: ~0.007 bad draws in 20,000)
    "small-unmasked": (12, lambda: gaussian_logits(12, 3, 1.5), 0.8, None, None, False),
    "small-top_k": (12, lambda: gaussian_logits(12, 3, 1.5), 0.8, 6, None, True),
    # the tail (16,344 tokens) expects ~5 of the 20,000 draws: before, ~20 more landed there (a uniform of 1.0
    # made some token's noise infinite, whatever its probability)
    "peaked-unmasked": (16_384, lambda: peaked_logits(16_384, 40, 4, gap=15.0), 1.0, None, None, False),
    "top_k": (16_384, lambda: peaked_logits(16_384, 400, 5), 1.0, 20, None, True),
    "top_p": (16_384, lambda: peaked_logits(16_384, 60, 6), 0.9, None, 0.8, False),
    "top_k+top_p": (16_384, lambda: gaussian_logits(16_384, 7, 3.0), 1.3, 50, 0.9, True),
}


@pytest.mark.parametrize("case", list(CHI_CASES))
def test_seeded_draws_follow_the_exact_distribution(case):
    """Chi-square of 20,000 draws against the exact renormalised distribution (computed apart): p > 0.001."""
    V, make, t, top_k, top_p, by_step = CHI_CASES[case]
    z = make()
    p = exact_probs(z[0], t, top_k, top_p)
    assert torch.equal(p > 0, next_token_probs(z, t, top_k, top_p)[0] > 0)  # the same support as the eager sampler
    x, df, pval = chi_square(draws(z, t, top_k, top_p, by_step=by_step), p)
    assert pval > P_MIN, f"{case}: chi-square {x:.1f} on {df} degrees of freedom, p = {pval:.3g}"


def test_seeded_sampler_is_deterministic_and_row_independent():
    z = torch.randn(3, 300, generator=torch.Generator().manual_seed(8))
    seeds, step = torch.tensor([4, 5, 6]), torch.tensor(9)
    batch = sample_seeded(z, 0.9, 40, 0.95, seeds, step)
    assert torch.equal(batch, sample_seeded(z, 0.9, 40, 0.95, seeds, step))
    for i in range(3):
        assert torch.equal(sample_seeded(z[i:i + 1], 0.9, 40, 0.95, seeds[i:i + 1], step), batch[i:i + 1])


# ----------------------------------------------------------------------------------------------
# kept buffers: dtype, inference mode
# ----------------------------------------------------------------------------------------------
def test_kept_buffers_follow_the_models_dtype():
    """A bf16 call, ``model.float()``, the same call again: the static decoder's tokens = the eager decoder's."""
    model = build(seed=3).to(torch.bfloat16)
    rows = prompts([6, 3], seed=3)
    bf16 = generate(model, rows, 48, eos_token_id=None, decoder="static")
    assert bf16 == generate(model, rows, 48, eos_token_id=None)
    model.float()
    eager = generate(model, rows, 48, eos_token_id=None)
    assert generate(model, rows, 48, eos_token_id=None, decoder="static") == eager  # before: 26 tokens differed
    model.to(torch.bfloat16)
    assert generate(model, rows, 48, eos_token_id=None, decoder="static") == bf16


def test_kept_buffers_are_rebuilt_when_the_weights_are_replaced():
    model = build(seed=2)
    rows = prompts([5], seed=3)
    dec = StaticDecoder(model)
    dec.decode(prefill(model, rows), 6)
    (old,) = dec.kept.values()
    assert dec.decode(prefill(model, rows), 6) and next(iter(dec.kept.values()))[0] is old[0]  # same weights: reused
    model.double().float()  # new parameter tensors (same values): a graph captured on the old ones would read
    assert dec.decode(prefill(model, rows), 6) == [generate(model, rows, 6, eos_token_id=None)[0][5:]]  # freed memory
    assert len(dec.kept) == 1 and next(iter(dec.kept.values()))[0] is not old[0]


@pytest.mark.parametrize("draft", [None, 2])
@pytest.mark.parametrize("first_in_inference_mode", [True, False])
def test_static_decoder_under_inference_mode_and_out(first_in_inference_mode, draft):
    """A call under torch.inference_mode() then a normal one (and the other way round): both work, = eager."""
    model = build(seed=1, num_nextn_predict_layers=1)
    rows = prompts([7, 4], seed=5)
    want = generate(model, rows, 10, eos_token_id=None)
    grad_modes = set()  # the decoder leaves inference mode without turning grad mode on (no autograd graph)
    model.model.register_forward_hook(lambda *_: grad_modes.add(torch.is_grad_enabled()))
    for inference in (first_in_inference_mode, not first_in_inference_mode):
        with torch.inference_mode(inference):
            assert generate(model, rows, 10, eos_token_id=None, decoder="static", draft=draft) == want
            sampled = generate(model, rows, 10, eos_token_id=None, decoder="static", temperature=1.0, top_k=20,
                               generator=torch.Generator().manual_seed(0)) if draft is None else None
        if draft is None:
            if inference == first_in_inference_mode:
                first_sampled = sampled
            else:
                assert sampled == first_sampled  # the same seeds, the same draws
    assert grad_modes == {False}


# ----------------------------------------------------------------------------------------------
# size arguments: capped or refused by name before any allocation
# ----------------------------------------------------------------------------------------------
def test_huge_draft_on_the_static_decoder_is_clamped_like_eager():
    """draft=10**9: clamped to what a step can use (max_new_tokens − 1) as the eager path clamps it — the same
    tokens and counts, no terabyte allocation (before: 16 TB asked of the allocator)."""
    model = build(seed=1, vocab_size=6, num_nextn_predict_layers=1)
    rows = prompts([5, 9], seed=1, vocab=6)
    plain = generate(model, rows, 8, eos_token_id=None)
    st, eager_st = GenerationStats(), GenerationStats()
    assert generate(model, rows, 8, eos_token_id=None, draft=10**9, decoder="static", stats=st) == plain
    generate(model, rows, 8, eos_token_id=None, draft=10**9, stats=eager_st)
    assert st.per_row == eager_st.per_row and (st.drafted, st.accepted) == (eager_st.drafted, eager_st.accepted)
    dec = StaticDecoder(model)
    pres = [prefill(model, [r], mtp=True) for r in rows]
    assert dec.speculate(pres, 10**9, 8) == [r[len(p):] for r, p in zip(plain, rows)]
    assert all(key.k == 7 for key in dec.kept)  # k = max_new_tokens − 1
    assert dec.speculate(pres, 10**9, 1) == [r[len(p):len(p) + 1] for r, p in zip(plain, rows)]


def test_prefill_refuses_prompts_past_the_trained_context_by_name():
    short = build(max_position_embeddings=16)
    long_prompt, ok = prompts([17, 10], seed=4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: 17 tokens > max_position_embeddings=16"):
        prefill(short, [ok, long_prompt])
    assert prefill(short, [ok]).cache.offset == 10
    assert prefill(short, [long_prompt], allow_longer=True).cache.offset == 17
    cache = PrefixCache(short, block_tokens=4)
    with pytest.raises(ValueError, match=r"17 tokens > max_position_embeddings=16"):
        cache.prefill(long_prompt)
    with pytest.raises(ValueError, match=r"prompts\[0\]: 17 tokens > max_position_embeddings=16"):
        prefill(short, [long_prompt], prefix_cache=cache)
    assert len(cache) == 0  # refused before anything was computed or stored
    pre, hit = cache.prefill(long_prompt, allow_longer=True)
    assert pre.cache.offset == 17 and hit == 0
    # generate(allow_longer=True) still runs past the context, with or without the prefix cache
    want = generate(short, [long_prompt], 3, allow_longer=True, eos_token_id=None)
    assert generate(short, [long_prompt], 3, allow_longer=True, eos_token_id=None, prefix_cache=cache) == want
    assert generate(short, [long_prompt], 3, allow_longer=True, eos_token_id=None, decoder="static") == want


def test_static_decode_checks_max_new_tokens_and_seeds_by_name():
    model = build(seed=2)
    pre = prefill(model, prompts([4, 4], seed=6))
    dec = StaticDecoder(model)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=rf"max_new_tokens={bad!r}: must be an integer >= 0"):
            dec.decode(pre, bad)
    with pytest.raises(ValueError, match=r"seeds: need one per row \(2\), got 3"):
        dec.decode(pre, 3, seeds=torch.tensor([1, 2, 3]))
    assert dec.kept == {}


# ----------------------------------------------------------------------------------------------
# GPU: the same inside the CUDA graph
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_graphed_sampler_and_kept_state_gpu():
    """The sampler captured in the graph draws what the static step draws (top-k, top-p, top_k=1 = greedy) and
    what it draws on CPU; a dtype change drops the captured graphs (they read the old weights by address);
    inference mode and back; draft=10**9 clamped."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    z = torch.randn(4, K3_VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    seeds, step = torch.tensor([3, 1, 4, 1]), torch.tensor(5)
    for k, p in ((50, None), (None, 0.9), (50, 0.5)):
        cpu = sample_seeded(z, 1.0, k, p, seeds, step)
        gpu = sample_seeded(z.cuda(), 1.0, k, p, seeds.cuda(), step.cuda())
        assert torch.equal(cpu, gpu.cpu())
        assert (next_token_probs(z, 1.0, k, p).gather(1, cpu[:, None]) > 0).all()
    model = build(seed=4, backend="auto").cuda()
    rows = prompts([37, 12, 64], seed=4)
    pre = prefill(model, rows)
    graphed, static = StaticDecoder(model, graph=True), StaticDecoder(model)
    greedy = static.decode(pre, 40)
    for k, p in ((50, None), (None, 0.9), (1, None), (1, 0.5)):
        got = graphed.decode(pre, 40, temperature=1.0, top_k=k, top_p=p, seeds=torch.tensor([1, 2, 3]))
        assert got == static.decode(pre, 40, temperature=1.0, top_k=k, top_p=p, seeds=torch.tensor([1, 2, 3]))
        if k == 1:
            assert got == greedy
    model.to(torch.bfloat16)
    bf16 = generate(model, rows, 40, eos_token_id=None, decoder="graph")
    assert bf16 == generate(model, rows, 40, eos_token_id=None)
    model.float()
    want = generate(model, rows, 40, eos_token_id=None)
    assert generate(model, rows, 40, eos_token_id=None, decoder="graph") == want
    with torch.inference_mode():
        assert generate(model, rows, 40, eos_token_id=None, decoder="graph") == want
    assert generate(model, rows, 40, eos_token_id=None, decoder="graph") == want
    mtp = build(seed=1, vocab_size=6, num_nextn_predict_layers=1, backend="auto").cuda()
    few = prompts([5, 9], seed=1, vocab=6)
    assert generate(mtp, few, 8, eos_token_id=None, draft=10**9, decoder="graph") == generate(mtp, few, 8,
                                                                                              eos_token_id=None)
