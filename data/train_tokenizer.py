"""Train k3lab's byte-level BPE tokenizer once, offline, and write k3lab/assets/tokenizer.json.

    python data/train_tokenizer.py            # rewrites k3lab/assets/tokenizer.json

Byte-level BPE (GPT-2 style pre-tokenisation, no prefix space) on the KJV corpus from
`k3lab.data.load_corpus()`, 4096 tokens in all: ids 0-2 are <|bos|>, <|eos|>, <|pad|>, then the
256 byte symbols, then 3837 merges. Training is deterministic for a given corpus and
`tokenizers` version; the committed file is what k3lab uses, so re-running is only needed to
change the recipe.
"""
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from k3lab.data import BPE_VOCAB_SIZE, SPECIAL_TOKENS, TOKENIZER_FILE, corpus_verses

OUT = Path(__file__).resolve().parent.parent / "k3lab" / "assets" / TOKENIZER_FILE


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_verses(), trainer=trainer)
    return tok


if __name__ == "__main__":
    tokenizer = train()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(OUT))
    print(f"wrote {OUT} (vocab {tokenizer.get_vocab_size()})")
