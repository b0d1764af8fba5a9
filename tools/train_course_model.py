"""Train the course model: K3's ``tiny`` preset with one MTP head, on the KJV corpus (BPE), and save it where the
notebooks load it (``k3lab/assets/course_model/``: config.json, model.safetensors, card.json).

    python tools/train_course_model.py                       # the committed model's command (CPU, 2 cores)
    python tools/train_course_model.py --steps 40 --out /tmp/cm   # a quick check of the pipeline

One run of :func:`k3lab.train.fit` (the one training loop), Muon with K3's cosine schedule (1% warmup), batches of
``--batch-size`` windows of ``--seq-len`` tokens from the training split, the validation loss on fixed held-out
batches every ``--eval-every`` steps. Checkpoints go to ``--work`` as it trains, so a cut run continues with
``--resume``. The card records the command, versions, steps, tokens, the loss curve, and a greedy sample.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3lab.config import ModelConfig  # noqa: E402
from k3lab.data import corpus_splits, get_batch, get_tokenizer  # noqa: E402
from k3lab.hf.checkpoint import save_hf_checkpoint  # noqa: E402
from k3lab.infer import generate  # noqa: E402
from k3lab.model import K3ForCausalLM  # noqa: E402
from k3lab.train import TrainConfig, fit  # noqa: E402

OUT = ROOT / "k3lab" / "assets" / "course_model"
PROMPT = "And God said"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "course_model", help="checkpoints while training")
    ap.add_argument("--resume", action="store_true", help="continue the run in --work")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    tok = get_tokenizer("bpe")
    train_ids, val_ids = corpus_splits(tok)
    cfg = ModelConfig.preset("tiny").replace(num_nextn_predict_layers=1)
    tcfg = TrainConfig(steps=args.steps, lr=args.lr, optimizer="muon", eval_every=args.eval_every, eval_batches=8,
                       log_every=10, checkpoint_every=args.eval_every, out_dir=str(args.work), seed=args.seed,
                       name="course_model")
    t0 = time.time()
    torch.manual_seed(args.seed)
    model = K3ForCausalLM(cfg)
    result = fit(model, lambda s: get_batch(train_ids, args.batch_size, args.seq_len, s, seed=args.seed),
                 tcfg, val_batches=lambda s: get_batch(val_ids, args.batch_size, args.seq_len, s, seed=10_000),
                 resume_from=str(args.work) if args.resume else None, data="kjv-bpe")
    model.eval()
    prompt = tok.encode(PROMPT)
    sample = tok.decode(generate(model, [prompt], 48)[0])  # the prompt and its continuation
    args.out.mkdir(parents=True, exist_ok=True)
    save_hf_checkpoint(model, args.out, dtype=None)
    curve = [{k: r[k] for k in ("step", "loss", "val_loss", "lm_loss") if k in r} for r in result.history]
    card = dict(what="K3 tiny preset + 1 MTP head, trained on the KJV Bible (BPE 4096) by tools/train_course_model.py",
                command="python tools/train_course_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                date=time.strftime("%Y-%m-%d", time.gmtime()), seconds=round(time.time() - t0),
                machine=f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
                steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, optimizer="muon",
                tokens=args.steps * args.batch_size * args.seq_len, train_tokens_in_corpus=len(train_ids),
                final_val_loss=next(r["val_loss"] for r in reversed(result.history) if "val_loss" in r),
                sample={"prompt": PROMPT, "greedy_48": sample}, curve=curve)
    (args.out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    print(f"saved {args.out}: val loss {card['final_val_loss']:.3f} after {args.steps} steps; sample: {sample!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
