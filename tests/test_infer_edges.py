"""k3lab.infer at its edges, as a new user meets them (issue 27, item 6), and the module layout (item 7).

Each test failed before its fix: a prefix-cache hit that shared memory with the store, a tiny temperature
that overflowed to NaN, ``max_new_tokens`` and prompts past the trained context accepted (and a tensor
result padded to ``max_new_tokens``), a negative ``k`` in speculative decoding, EOS not a stop by default,
and an import circle generate <-> prefix / speculative."""

import ast
from pathlib import Path

import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.infer import PrefixCache, generate, next_token_probs, prefill, sample_next, speculative_decode, stream
from k3lab.model import K3ForCausalLM

INFER = Path(__file__).resolve().parents[1] / "k3lab" / "infer"


def build(seed=0, **changes) -> K3ForCausalLM:
    """tests/test_infer.py's two-layer model (KDA then Gated MLA, 256-token vocabulary)."""
    base = dict(vocab_size=256, num_hidden_layers=2, full_attn_layers=[2], attn_res_block_size=1,
                initializer_range=0.1)
    torch.manual_seed(seed)
    return K3ForCausalLM(ModelConfig.preset("tiny").replace(**{**base, **changes})).eval()


def prompts_of(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
    return build()


def tensors(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]


# ----------------------------------------------------------------------------------------------
# a. a prefix-cache hit is the caller's own
# ----------------------------------------------------------------------------------------------
def test_prefix_lookup_returns_copies_a_write_cannot_corrupt_the_store(model):
    (doc,) = prompts_of([13], seed=1)
    pc = PrefixCache(model, block_tokens=4)
    cold = prefill(model, [doc])
    prefill(model, [doc], prefix_cache=pc)  # stores blocks 1..3
    first, hit = pc.lookup(doc)
    assert hit == 12
    kept = [t.clone() for t in tensors(first)]
    for t in tensors(first):  # a caller writing into the hit in place (KDA state, conv tails, MLA latents)
        t.add_(0.5)
    again, _ = pc.lookup(doc)
    assert all(torch.equal(a, k) for a, k in zip(tensors(again), kept))
    warm = prefill(model, [doc], prefix_cache=pc)
    assert torch.allclose(warm.logits, cold.logits, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# b. tiny temperatures: finite, or refused by name
# ----------------------------------------------------------------------------------------------
def test_tiny_temperature_stays_finite_or_is_refused(model):
    logits = torch.tensor([[1000.0, 999.0, -1000.0, 3.0]])
    for t in (1e-36, 1e-30, 1e-6):  # logits / t would overflow float32 to inf (softmax: NaN)
        p = next_token_probs(logits, t)
        assert torch.isfinite(p).all() and p[0].tolist() == [1.0, 0.0, 0.0, 0.0], t
        assert sample_next(logits, t).tolist() == [0]
    p = next_token_probs(logits, 1e-36, top_k=2, top_p=0.5)
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    for t in (1e-40, 5e-324):  # below float32's smallest normal number
        with pytest.raises(ValueError, match=r"temperature=.*must be 0 \(greedy\) or a finite number >= 1.2e-38"):
            generate(model, [[5, 6, 7]], 2, temperature=t)
        with pytest.raises(ValueError, match="temperature="):
            sample_next(logits, t)
    (prompt,) = prompts_of([6], seed=2)
    assert generate(model, [prompt], 4, temperature=1e-30) == generate(model, [prompt], 4)  # = greedy


# ----------------------------------------------------------------------------------------------
# c, d. the trained context: max_new_tokens and prompt length; no padding to max_new_tokens
# ----------------------------------------------------------------------------------------------
def test_max_new_tokens_past_the_context_is_refused_and_the_tensor_is_not_padded_to_it(model):
    ids = torch.tensor(prompts_of([5, 5], seed=3))
    # allowed past the context, every row stops after one token: the result is [B, T + 1], not [B, T + 10**7]
    out = generate(model, ids, 10**7, stop=range(256), allow_longer=True)
    assert out.shape == (2, 6)
    with pytest.raises(ValueError, match=r"max_new_tokens=10000000: .*max_position_embeddings=4096.* at most 4091"):
        generate(model, ids, 10**7)
    with pytest.raises(ValueError, match=r"max_new_tokens=1000000000000"):
        stream(model, ids, 10**12)  # checked when called, before the first token
    assert generate(model, ids, 4).shape == (2, 9)  # no stop: the full width, as before


def test_prompt_longer_than_the_trained_context_is_refused_unless_allowed():
    short = build(max_position_embeddings=16)
    long_prompt, ok = prompts_of([17, 10], seed=4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: 17 tokens > max_position_embeddings=16"):
        generate(short, [ok, long_prompt], 1)
    assert len(generate(short, [ok], 6)[0]) == 16  # 10 + 6 = the context: fine
    with pytest.raises(ValueError, match=r"max_new_tokens=7: .* at most 6"):
        generate(short, [ok], 7)
    with pytest.raises(ValueError, match="allow_longer='yes'"):
        generate(short, [ok], 1, allow_longer="yes")
    (got,) = generate(short, [long_prompt], 3, allow_longer=True, eos_token_id=None)
    assert len(got) == 20


# ----------------------------------------------------------------------------------------------
# e. speculative_decode checks k
# ----------------------------------------------------------------------------------------------
def test_speculative_decode_checks_k():
    mtp = build(seed=1, num_nextn_predict_layers=1)
    pre = prefill(mtp, [[5, 6, 7, 8]], mtp=True)
    for k in (-2, 0, 1.5, True):
        with pytest.raises(ValueError, match=rf"k={k!r}: must be an integer >= 1"):
            speculative_decode(mtp, pre, k, 4)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        speculative_decode(mtp, pre, 2, -1)
    assert list(speculative_decode(mtp, pre, 2, 0)) == []
    assert len(list(speculative_decode(mtp, pre, 2, 5, stop=frozenset()))) == 5


# ----------------------------------------------------------------------------------------------
# f. EOS stops a row by default
# ----------------------------------------------------------------------------------------------
def test_eos_from_the_config_stops_by_default_and_none_turns_it_off(model):
    (prompt,) = prompts_of([6], seed=5)
    n = 8
    (full,) = generate(model, [prompt], n, eos_token_id=None)
    new = full[len(prompt):]
    eos = new[2]
    first = new.index(eos)
    eos_model = build(eos_token_id=eos)  # same seed: the same weights, the config's EOS is `eos`
    (stopped,) = generate(eos_model, [prompt], n)
    assert stopped == full[:len(prompt) + first + 1]  # EOS kept, as transformers does
    assert generate(eos_model, [prompt], n, eos_token_id=None) == [full]
    assert generate(model, [prompt], n, eos_token_id=eos) == [stopped]  # an explicit id
    assert [t for _, t in stream(eos_model, [prompt], n)] == new[:first + 1]
    mtp = build(seed=1, num_nextn_predict_layers=1)
    (spec_full,) = generate(mtp, [prompt], n, draft=2, eos_token_id=None)
    spec_eos = spec_full[len(prompt) + 1]
    (spec_stopped,) = generate(mtp, [prompt], n, draft=2, eos_token_id=spec_eos)
    assert spec_stopped == spec_full[:spec_full.index(spec_eos, len(prompt)) + 1]
    ids = torch.tensor([prompt, prompt])
    out = generate(eos_model, ids, n)  # tensor rows: width of the longest row, padded after EOS
    assert out.shape == (2, len(prompt) + first + 1)
    for bad in ("yes", 256, -1, 1.0):
        with pytest.raises(ValueError, match=rf"eos_token_id={bad!r}: must be 'config'"):
            generate(model, [prompt], 2, eos_token_id=bad)


# ----------------------------------------------------------------------------------------------
# 7. the import graph of k3lab.infer has no cycle
# ----------------------------------------------------------------------------------------------
def infer_imports() -> dict[str, set[str]]:
    """Module -> the k3lab.infer modules it imports (top-level and function-level imports alike).
    ``from k3lab.infer import X`` is an edge to the submodule X when X is one, else to the package."""
    modules = {("k3lab.infer" if p.stem == "__init__" else f"k3lab.infer.{p.stem}"): p for p in INFER.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # relative: resolve against the package
                base = "k3lab.infer" + (f".{node.module}" if node.module else "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_infer_imports_run_one_way():
    graph = infer_imports()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the checker finds one
    assert "k3lab.infer.step" in graph["k3lab.infer.prefix"] & graph["k3lab.infer.speculative"]
    assert {"k3lab.infer.prefix", "k3lab.infer.speculative"} <= graph["k3lab.infer.generate"]
    assert "k3lab.infer.generate" not in graph["k3lab.infer.step"] | graph["k3lab.infer.prefix"] \
        | graph["k3lab.infer.speculative"]
