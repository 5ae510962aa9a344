"""Token ids of many texts at once, equal to `tokenizer(texts, add_special_tokens=False)`'s, in a fraction of its time
(issue 42: tokenizing was most of the SFT trainer's start-up).

Two costs are avoided. transformers turns every row's Rust `Encoding` into Python lists and dicts; here the Rust
tokenizer (`rust_tokenizer`) is called directly and its ids go to numpy. And an SFT data set's prompts repeat one
another: a trajectory's row k holds the system message, the instructions and all k − 1 earlier turns again.

The Rust tokenizer cuts a text at its added tokens (`<|im_start|>`, `<|im_end|>`, ...) before anything else and
encodes the pieces between them one by one, so a text's ids are the ids of its *segments* one after another: each
added token with the text that follows it up to the next one (and the text before the first). `encode_texts` encodes
every distinct segment once and joins them; SmolLM2's prompts of 4,170 Sokoban rows hold 12.5 M characters, their
distinct segments 3.4 M. A segment keeps the added token it starts with so that its text is encoded as it is inside the
whole text, never as a text's first piece (Metaspace's `prepend_scheme="first"` gives that one a leading "▁").

The cuts are the Rust tokenizer's own first cuts (its `AddedVocabulary`): the added tokens matched on the raw text
(`normalized=False`), leftmost-longest. Where they are not plain cuts (a token that strips the whitespace beside it,
`lstrip`/`rstrip`, or matches whole words only, `single_word`) or special tokens are encoded as text
(`split_special_tokens`), texts are encoded whole, still without transformers' conversion.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np


def rust_tokenizer(tokenizer):
    """The Rust tokenizer of a fast transformers tokenizer, set as `tokenizer(texts, add_special_tokens=False)` sets
    it before each call: no truncation, no padding, special tokens split or not as `tokenizer.split_special_tokens`
    says."""
    tokenizer([""], add_special_tokens=False)
    return tokenizer.backend_tokenizer


def segment_pattern(rust) -> re.Pattern | None:
    """The added tokens before which `rust` (a tokenizers.Tokenizer) cuts every text, longest first (Python's
    regular expressions then match leftmost-longest, as the Rust tokenizer does); None where cutting there could
    change an id (see the module docstring) or there is no such token."""
    tokens = [token for token in rust.get_added_tokens_decoder().values() if not token.normalized]
    if not tokens or rust.encode_special_tokens or any(t.lstrip or t.rstrip or t.single_word for t in tokens):
        return None
    contents = sorted({token.content for token in tokens}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, contents)))


def segments(text: str, pattern: re.Pattern | None) -> list[str]:
    """`text` cut before every match of `pattern` (the whole text when None); empty pieces left out."""
    if pattern is None:
        return [text] if text else []
    bounds = [0, *(match.start() for match in pattern.finditer(text)), len(text)]
    return [text[start:end] for start, end in zip(bounds, bounds[1:]) if end > start]


def encode_texts(tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """(T_i,) int64 ids of each text, `tokenizer(texts, add_special_tokens=False)["input_ids"]`; each distinct segment
    is encoded once."""
    rust = rust_tokenizer(tokenizer)
    pattern = segment_pattern(rust)
    pieces = [segments(text, pattern) for text in texts]
    distinct = list(dict.fromkeys(piece for row in pieces for piece in row))
    encoded = rust.encode_batch(distinct, add_special_tokens=False)
    ids = {piece: np.array(encoding.ids, dtype=np.int64) for piece, encoding in zip(distinct, encoded)}
    empty = np.zeros(0, dtype=np.int64)
    return [np.concatenate([ids[piece] for piece in row]) if row else empty for row in pieces]


def encode_with_offsets(tokenizer, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """((T_i,) int64 ids, (T_i, 2) int64 [start, end) character offsets) of each text: `input_ids` and
    `offset_mapping` of `tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)`."""
    encoded = rust_tokenizer(tokenizer).encode_batch(list(texts), add_special_tokens=False)
    return [(np.array(e.ids, dtype=np.int64), np.array(e.offsets, dtype=np.int64).reshape(-1, 2)) for e in encoded]
