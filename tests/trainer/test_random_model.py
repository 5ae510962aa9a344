"""benchmarks/random_model.py's padded tokenizer: a full-vocabulary random model's sampled ids must decode and
encode back to themselves (the trainer decodes every turn and re-encodes the conversation)."""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from model_shapes import SHAPES  # noqa: E402
from random_model import pad_tokenizer  # noqa: E402


def test_padded_tokenizer_has_the_shapes_vocabulary_and_round_trips_every_id(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    own = len(tokenizer)
    size = SHAPES["0.5b"]["vocab_size"]
    pad_tokenizer(tokenizer, size)
    assert len(tokenizer) == size == 151936
    sampled = [own, own + 1, 100000, size - 1, 5, own + 7]  # placeholders and one of the tokenizer's own ids
    text = tokenizer.decode(sampled)
    assert tokenizer.encode(text, add_special_tokens=False) == sampled
    assert len(pad_tokenizer(tokenizer, size)) == size  # already full: unchanged
