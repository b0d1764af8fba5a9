"""k3lab.data: corpus, tokenizers, splits, batches, MQAR, passkey."""
import re

import pytest
import torch

from k3lab.data import (
    IGNORE_INDEX,
    batch_iterator,
    corpus_books,
    corpus_splits,
    get_batch,
    get_tokenizer,
    load_corpus,
    mqar,
    palindrome,
    stacks,
    passkey,
)


# ---------------------------------------------------------------------------- corpus, tokenizers
def test_corpus_is_the_whole_kjv_in_order():
    books = corpus_books()
    assert len(books) == 66
    assert books[0][0] == "Genesis" and books[-1][0] == "Revelation"
    text = load_corpus()
    assert text.startswith("Genesis\n\nIn the beginning God created the heaven and the earth.\n")
    assert text.endswith("The grace of our Lord Jesus Christ be with you all. Amen.\n")
    assert 4_000_000 < len(text) < 4_300_000


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_tokenizer_round_trip_on_corpus_text(kind):
    tok = get_tokenizer(kind)
    text = load_corpus()[1_000_000:1_020_000] + " 0123456789 ½ — 😀\n"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    specials = {tok.bos_id, tok.eos_id, tok.pad_id}
    assert len(specials) == 3 and not specials & set(ids)
    assert tok.decode([tok.bos_id] + ids[:50] + [tok.eos_id]) == tok.decode(ids[:50])


def test_tokenizer_vocab_and_specials():
    bpe, byte = get_tokenizer("bpe"), get_tokenizer("byte")
    assert (bpe.vocab_size, bpe.bos_id, bpe.eos_id, bpe.pad_id) == (4096, 0, 1, 2)
    assert (byte.vocab_size, byte.bos_id, byte.eos_id, byte.pad_id) == (259, 256, 257, 258)
    assert len(bpe.encode("And God said, Let there be light")) == 8  # BPE really merges
    with pytest.raises(ValueError, match="kind"):
        get_tokenizer("tiktoken")


def test_corpus_splits_deterministic_and_contiguous():
    tok = get_tokenizer("bpe")
    train, val = corpus_splits(tok, val_fraction=0.01)
    train2, val2 = corpus_splits(tok, val_fraction=0.01)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    assert train.dtype == val.dtype == torch.long and train.ndim == val.ndim == 1
    assert abs(len(val) / (len(train) + len(val)) - 0.01) < 1e-4
    # one stream cut in two: the split re-joins into the encoded corpus
    assert tok.decode(torch.cat([train, val]).tolist()) == load_corpus()
    assert "Amen." in tok.decode(val[-20:].tolist())
    with pytest.raises(ValueError, match="val_fraction"):
        corpus_splits(tok, val_fraction=0.0)


# ---------------------------------------------------------------------------- batches
def test_batches_aligned_deterministic_and_resumable():
    ids = torch.arange(1000)
    it = batch_iterator(ids, batch_size=4, seq_len=16, seed=3)
    batches = [next(it) for _ in range(5)]
    for x, y in batches:
        assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
        assert torch.equal(y[:, :-1], x[:, 1:])          # y[t] = x[t+1]
        assert torch.equal(y, x + 1)                     # windows of a contiguous stream
    resumed = batch_iterator(ids, batch_size=4, seq_len=16, seed=3, start_step=3)
    assert torch.equal(next(resumed)[0], batches[3][0])
    assert torch.equal(it(1)[0], batches[1][0])          # random access by step
    assert not torch.equal(batch_iterator(ids, 4, 16, seed=4)(0)[0], batches[0][0])
    with pytest.raises(ValueError, match="seq_len"):
        get_batch(torch.arange(10), 2, 10, step=0)


# ---------------------------------------------------------------------------- MQAR
def test_mqar_labels_match_the_bound_values():
    V, N, T, P = 256, 64, 64, 8
    x, y = mqar(V, N, T, P, seed=0)
    assert x.shape == y.shape == (N, T) and x.dtype == y.dtype == torch.long
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        keys, values = row_x[0:2 * P:2], row_x[1:2 * P:2]
        assert all(1 <= k < V // 2 for k in keys) and all(V // 2 <= v < V for v in values)
        assert len(set(keys)) == P and len(set(values)) == P
        kv = dict(zip(keys, values))
        queried = [t for t, label in enumerate(row_y) if label != IGNORE_INDEX]
        assert len(queried) == P and min(queried) >= 2 * P        # queries come after the pairs
        assert sorted(row_x[t] for t in queried) == sorted(keys)  # every key queried once
        for t in queried:
            assert row_y[t] == kv[row_x[t]]
    assert torch.all(y[:, : 2 * P] == IGNORE_INDEX)


def test_mqar_deterministic_and_filler_modes():
    a = mqar(128, 8, 32, 4, seed=7)
    b = mqar(128, 8, 32, 4, seed=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(mqar(128, 8, 32, 4, seed=8)[0], a[0])
    x0, y0 = mqar(128, 8, 32, 4, seed=7, random_non_queries=False)
    assert torch.equal(y0, a[1])
    filler = (y0 == IGNORE_INDEX) & (torch.arange(32) >= 8)
    assert torch.all(x0[filler] == 0) and (a[0][filler] != 0).float().mean() > 0.9


@pytest.mark.parametrize("kwargs, field", [
    (dict(vocab_size=64, seq_len=15, num_kv_pairs=4), "seq_len"),
    (dict(vocab_size=8, seq_len=64, num_kv_pairs=4), "vocab_size"),
    (dict(vocab_size=64, seq_len=64, num_kv_pairs=0), "num_kv_pairs"),
])
def test_mqar_impossible_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        mqar(num_examples=2, seed=0, **kwargs)


# ---------------------------------------------------------------------------- passkey
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_answer_positions_and_depth(depth):
    tok = get_tokenizer("bpe")
    L, k = 256, 5
    x, y = passkey(tok, 3, L, depth=depth, seed=1, num_digits=k)
    assert x.shape == y.shape == (3, L)
    assert torch.all(y[:, :-k] == IGNORE_INDEX)
    digit_ids = {tok.encode(str(d))[0] for d in range(10)}
    needle_head = tok.encode("\nThe pass key is ")
    needle_len = len(needle_head) + len(tok.encode(". Remember it. ")) + len(tok.encode(" is the pass key.\n")) + 2 * k
    question_len = len(tok.encode("\nWhat is the pass key? The pass key is "))
    filler_len = L + 1 - needle_len - question_len - k
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        answer = row_y[-k:]
        assert set(answer) <= digit_ids
        assert row_x[-k + 1:] == answer[:-1]                     # teacher-forced answer
        key = tok.decode(answer)
        text = tok.decode(row_x)
        assert text.count(f"The pass key is {key}. Remember it. {key} is the pass key.") == 1
        start = next(t for t in range(L) if row_x[t:t + len(needle_head)] == needle_head)
        assert start == round(depth * filler_len)


def test_passkey_bare_vocab_lengths_and_errors():
    x, y = passkey(64, 4, 40, depth=None, seed=0, filler="random")
    assert x.shape == (4, 40) and torch.all(y[:, :-5] == IGNORE_INDEX)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        n = row_x.index(10)
        assert row_x[n + 1:n + 6] == row_y[-5:]                   # needle holds the answer
        assert row_x[-5] == 11                                    # question marker
    long_x, _ = passkey(64, 4, 40 * 16, depth=0.5, seed=0, filler="random")
    assert long_x.shape == (4, 640)
    with pytest.raises(ValueError, match="context_len"):
        passkey(get_tokenizer("bpe"), 1, 20, depth=0.5)
    with pytest.raises(ValueError, match="depth"):
        passkey(64, 1, 40, depth=1.5, filler="random")
    with pytest.raises(ValueError, match="filler"):
        passkey(64, 1, 40, depth=0.5)


def test_mqar_docstring_worked_row_is_real():
    """The worked row in mqar's docstring (its call, inputs and labels) is what mqar returns, read
    from the docstring itself, so the two cannot drift apart; and the row obeys the task's rules:
    each label is the value paired with the query key in the first 2·P positions."""
    doc = mqar.__doc__
    call = re.search(r"``mqar\((vocab_size=.*?)\)``", doc).group(1)  # "vocab_size=16, num_examples=1, ..."
    kwargs = {k.strip(): int(v) for k, v in (item.split("=") for item in call.split(","))}
    table = {}
    for line in doc.splitlines():
        words = line.replace("|", " ").split("(")[0].split()
        if words and words[0] in ("inputs", "labels"):
            table[words[0]] = [IGNORE_INDEX if w == "." else int(w) for w in words[1:]]
    assert len(table["inputs"]) == len(table["labels"]) == kwargs["seq_len"]
    inputs, labels = mqar(**kwargs)
    assert inputs[0].tolist() == table["inputs"]
    assert labels[0].tolist() == table["labels"]
    P = kwargs["num_kv_pairs"]
    pairs = dict(zip(table["inputs"][0:2 * P:2], table["inputs"][1:2 * P:2]))
    queried = {t: table["inputs"][t] for t, v in enumerate(table["labels"]) if v != IGNORE_INDEX}
    assert sorted(queried.values()) == sorted(pairs)  # every key queried once
    assert all(table["labels"][t] == pairs[key] for t, key in queried.items())


def test_palindrome_labels_are_the_reversal():
    x, y = palindrome(50, 16, 12, seed=3)
    assert x.shape == y.shape == (16, 12)
    n = 6
    for row, lab in zip(x.tolist(), y.tolist()):
        first = row[:n]
        assert row[n] == 0 and all(1 <= t < 50 for t in first)
        assert lab[:n] == [-100] * n and lab[n:] == first[::-1]          # x_n ... x_1 from the separator on
        assert row[n + 1:] == first[::-1][:-1]                           # teacher forcing: the reversal so far
    assert torch.equal(palindrome(50, 16, 12, seed=3)[0], x) and not torch.equal(palindrome(50, 16, 12, seed=4)[0], x)
    for bad in (dict(seq_len=7), dict(seq_len=2), dict(vocab_size=2), dict(num_examples=0)):
        kw = dict(vocab_size=50, num_examples=4, seq_len=8) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            palindrome(**kw)


def test_stacks_labels_follow_a_plain_list_simulation():
    """Every label re-derived by replaying the row's operations on Python lists (an independent reference)."""
    S, D, V = 5, 3, 40
    x, y = stacks(V, 64, 60, num_stacks=S, max_depth=D, seed=1)
    pops = 0
    for row, lab in zip(x.tolist(), y.tolist()):
        held = [[] for _ in range(S)]
        for t in range(0, 60, 2):
            op, v = row[t], row[t + 1]
            assert 1 + 2 * S <= v < V and lab[t + 1] == -100
            if op <= S:                                      # push_s
                held[op - 1].append(v)
                assert len(held[op - 1]) <= D and lab[t] == -100
            else:                                            # pop_s: the label (and the next input) is the top
                s = op - 1 - S
                assert held[s], "a pop from an empty stack"
                assert lab[t] == v == held[s].pop()
                pops += 1
    assert pops > 64 * 30 * 0.3                              # both kinds occur (push_prob 0.5)
    assert torch.equal(stacks(V, 64, 60, num_stacks=S, max_depth=D, seed=1)[1], y)
    with pytest.raises(ValueError, match="vocab_size=12"):
        stacks(12, 4, 8, num_stacks=5)
    with pytest.raises(ValueError, match="push_prob"):
        stacks(V, 4, 8, num_stacks=2, push_prob=1.0)
