"""Which part of a response each sampled token belongs to: state, reasoning, answer or other (issue 18).

Spans come from the token ids the policy sampled, not from re-tokenized text: each sampled token is decoded on
its own, the pieces are concatenated behind the forced prefix (`<think>`, or `<answer>` without thinking, which
the prompt holds and the sampled ids continue), and every character is labelled by the innermost block it lies
in. Tags are ASCII, so they survive per-token decoding even where a token holds part of a multi-byte character.

    state      inside <observation>…</observation> or <prediction>…</prediction> (the world-model text)
    reasoning  inside <think>…</think>, outside the state blocks
    answer     inside <answer>…</answer>
    other      the tags themselves, text outside every block, the end-of-turn token

A token takes the label of its first non-space character inside a block (so `Up</` is an answer token); a
token of spaces only takes the label of where it stands; any other token (a tag, a tag with spaces glued to it) is
`other`. An unclosed block runs to the end of its turn. Every
assistant turn of a multi-turn row is labelled on its own, each behind its own forced prefix.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

SPANS = ("state", "reasoning", "answer", "other")
STATE, REASONING, ANSWER, OTHER = range(len(SPANS))

_TAG = re.compile(r"<(/?)(think|observation|prediction|answer)>")
_BLOCK_LABEL = {"think": REASONING, "observation": STATE, "prediction": STATE, "answer": ANSWER}


def char_labels(text: str) -> list[int]:
    """One span label per character of `text` (a whole assistant turn, forced prefix included)."""
    labels, open_blocks, pos = [], [], 0
    for match in _TAG.finditer(text):
        inside = _BLOCK_LABEL[open_blocks[-1]] if open_blocks else OTHER
        labels += [inside] * (match.start() - pos) + [OTHER] * (match.end() - match.start())
        closing, name = match.group(1) == "/", match.group(2)
        if not closing:
            open_blocks.append(name)
        elif name in open_blocks:  # close it and any block left open inside it; a stray closing tag is text
            del open_blocks[len(open_blocks) - 1 - open_blocks[::-1].index(name):]
        pos = match.end()
    inside = _BLOCK_LABEL[open_blocks[-1]] if open_blocks else OTHER
    return labels + [inside] * (len(text) - pos)


def turn_token_labels(pieces: Sequence[str], prefix: str, is_stop: Sequence[bool]) -> list[int]:
    """Span labels of one assistant turn's sampled tokens.

    Args:
        pieces: each sampled token decoded on its own, in order.
        prefix: the forced opening of the turn that precedes the sampled tokens ("<think>" or "<answer>").
        is_stop: per token, whether it is an end-of-turn id (always `other`).
    """
    chars = char_labels(prefix + "".join(pieces))
    labels, pos = [], len(prefix)
    for piece, stop in zip(pieces, is_stop):
        labels.append(OTHER if stop else _token_label(piece, chars[pos:pos + len(piece)]))
        pos += len(piece)
    return labels


def _token_label(piece: str, chars: list[int]) -> int:
    """The label of the token's first non-space character inside a block; a token of spaces only takes its
    first character's label; otherwise (a tag, with or without the spaces glued to it) `other`."""
    inside = [(char, label) for char, label in zip(piece, chars) if label != OTHER]
    solid = [label for char, label in inside if not char.isspace()]
    if solid:
        return solid[0]
    return inside[0][1] if inside and piece.isspace() else OTHER


def turn_runs(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) column ranges of the consecutive 1s of a (T-1,) mask: one per assistant turn (the forced
    prefix, a context token, always separates two turns)."""
    padded = torch.cat([torch.zeros(1), mask_row.float().cpu(), torch.zeros(1)])
    edges = (padded[1:] - padded[:-1]).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


class SpanLabeler:
    """Labels the sampled tokens of rollout batches for one tokenizer and forced prefix."""

    def __init__(self, decode: Callable[[int], str], prefix: str, stop_ids: Sequence[int]):
        """`decode(token_id)` gives one token's text with special tokens kept (see `token_decoder`)."""
        self.decode, self.prefix, self.stop_ids = decode, prefix, set(stop_ids)
        self._pieces: dict[int, str] = {}

    def _piece(self, token_id: int) -> str:
        if token_id not in self._pieces:
            self._pieces[token_id] = self.decode(token_id)
        return self._pieces[token_id]

    def turn(self, ids: Sequence[int]) -> list[int]:
        """Span labels of one turn given its sampled ids."""
        return turn_token_labels([self._piece(i) for i in ids], self.prefix, [i in self.stop_ids for i in ids])

    def batch(self, input_ids: torch.Tensor, assistant_mask: torch.Tensor) -> torch.Tensor:
        """(B, T-1) long labels aligned with `responses = input_ids[:, 1:]`; `other` off the assistant turns.

        Args:
            input_ids: (B, T) the rollout's conversations, left padded.
            assistant_mask: (B, T-1) 1 where `input_ids[:, 1:]` holds a token the policy sampled.
        """
        labels = torch.full(assistant_mask.shape, OTHER, dtype=torch.long)
        for row in range(assistant_mask.shape[0]):
            for start, end in turn_runs(assistant_mask[row]):
                ids = input_ids[row, start + 1:end + 1].tolist()
                labels[row, start:end] = torch.tensor(self.turn(ids))
        return labels


def token_decoder(tokenizer) -> Callable[[int], str]:
    """One token's text, special tokens kept and spaces not cleaned up (so tags stay as sampled)."""
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False)
