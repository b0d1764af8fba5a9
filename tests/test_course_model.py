"""The committed course model (k3lab/assets/course_model/, tools/train_course_model.py): it loads, it is what its card
says (the validation loss and the greedy sample recomputed here), and it answers different prompts differently."""
import pytest
import torch

from k3lab.data import corpus_splits, get_batch, get_tokenizer
from k3lab.experiments.nb import COURSE_MODEL, course_model_card, load_course_model
from k3lab.infer import generate
from k3lab.train import evaluate

card = course_model_card()
pytestmark = pytest.mark.skipif(card is None, reason=f"no course model in {COURSE_MODEL}")


@pytest.fixture(scope="module")
def model():
    return load_course_model()


def test_the_card_is_recomputed(model):
    assert model.config.num_nextn_predict_layers == 1 and model.config.vocab_size == 4096  # K3 tiny + an MTP head
    tok = get_tokenizer("bpe")
    _, val_ids = corpus_splits(tok)
    val = evaluate(model, lambda s: get_batch(val_ids, card["batch_size"], card["seq_len"], s, seed=10_000), 8)
    assert val == pytest.approx(card["final_val_loss"], abs=1e-4)
    assert val < 0.6 * torch.log(torch.tensor(4096.0)).item()  # far below uniform (8.32 nats)
    prompt = tok.encode(card["sample"]["prompt"])
    assert tok.decode(generate(model, [prompt], 48)[0]) == card["sample"]["greedy_48"]
    assert card["curve"][-1]["step"] == card["steps"] and card["tokens"] == card["steps"] * card["batch_size"] * card["seq_len"]


def test_it_answers_each_prompt_differently(model):
    tok = get_tokenizer("bpe")
    prompts = ["And God said", "In the beginning", "Jesus wept", "The LORD is my shepherd"]
    outs = [tok.decode(generate(model, [tok.encode(p)], 24)[0])[len(p):] for p in prompts]
    assert len(set(outs)) == len(prompts), outs
    for out in outs:  # not one phrase looped: at least 6 distinct words in 24 tokens
        assert len(set(out.split())) >= 6, out


def test_the_doc_quotes_the_card():
    doc = (COURSE_MODEL.parents[2] / "docs" / "course_model.md").read_text()
    assert f"{card['final_val_loss']:.2f}" in doc and f"{card['steps']:,} steps" in doc
    assert f"{card['seconds']:,} s" in doc and f"--steps {card['steps']}" in doc
