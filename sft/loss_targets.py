"""Which response tokens carry SFT loss (spec §9.3): the only place that decides it.

A training row is a chat `prompt` (messages up to the assistant turn) and the assistant `response`. It becomes
`prompt_text` (the chat template with its generation prompt, then a forced prefix) and `target_text` (what
the model must write after it, ending with the template's end-of-turn token). Each `LossTarget` is one small
function returning the character spans of `target_text` that are trained; `token_loss_mask` turns spans into a
token mask with the fast tokenizer's offset mapping (a token is trained when any of its characters is).

- `paper` (default): the whole target — span(<think>…</think>) ∪ span(<answer>…</answer>) with the
  ground-truth <observation>/<prediction> contents, and the end-of-turn token.
- `released`: the released code (§9.1–§9.2): states replaced by `<obs_content>`/`<pred_content>` in the
  prompt and the response, earlier assistant turns prefixed with `<think></think>`, target
  `</think>` + response + eos, every target token trained except the one right after a placeholder.
- `states_only`: only the contents of <observation>…</observation> and <prediction>…</prediction>.
- `answer_only`: only <answer>…</answer> (tags included) and the end-of-turn token.
- `without_prediction`: `paper` without the contents of <prediction>…</prediction> (its tags stay trained): the model
  learns to write the current state and the answer, not the next state. Ours, not the paper's: it separates what
  the transition model adds from what copying the current state in front of the answer adds (issue 43).
- `without_states`: `paper` without the contents of <observation>…</observation> and <prediction>…</prediction>
  (their tags stay trained): the model learns the response's format, its think and its answer, and neither state.
  Ours, not the paper's: beside `without_prediction`, it separates what copying the current state adds from what
  the add_worldmodel format alone adds (issue 43).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

THINK_OPEN = "<think>"
OBS_PLACEHOLDER = "<obs_content>"
PRED_PLACEHOLDER = "<pred_content>"
PLACEHOLDERS = (OBS_PLACEHOLDER, PRED_PLACEHOLDER)

_OBSERVATION = re.compile(r"<observation>(.*?)</observation>", re.DOTALL)
_PREDICTION = re.compile(r"<prediction>(.*?)</prediction>", re.DOTALL)
_ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)

Span = tuple[int, int]


class LossTarget(str, enum.Enum):
    """Config value `data.loss_target`."""

    PAPER = "paper"
    RELEASED = "released"
    STATES_ONLY = "states_only"
    ANSWER_ONLY = "answer_only"
    WITHOUT_PREDICTION = "without_prediction"
    WITHOUT_STATES = "without_states"

    @classmethod
    def parse(cls, value: str) -> LossTarget:
        try:
            return cls(value)
        except ValueError:
            names = [m.value for m in cls]
            raise ValueError(f"data.loss_target={value!r} is not one of {names}") from None


@dataclass(frozen=True)
class SftText:
    """One row rendered as text.

    prompt_text: chat template + generation prompt + forced prefix (never trained).
    target_text: the continuation the model is trained to write, ending with the end-of-turn token.
    loss_spans: [start, end) character ranges of `target_text` that carry loss.
    """

    prompt_text: str
    target_text: str
    loss_spans: list[Span]


def end_of_turn_token(tokenizer) -> str:
    """The special token the chat template closes an assistant message with (`<|im_end|>`, `<|eot_id|>`, …).

    Found by rendering a one-turn chat and reading the first token after the assistant content; falls back
    to `tokenizer.eos_token` when the template appends no special token there.
    """
    marker = "SPA_END_OF_TURN_PROBE"
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    suffix = rendered[rendered.rindex(marker) + len(marker):]
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(suffix, add_special_tokens=False)["input_ids"])
    special = set(tokenizer.get_added_vocab()) | set(tokenizer.all_special_tokens)
    if tokens and tokens[0] in special:
        return tokens[0]
    if tokenizer.eos_token is None:
        raise ValueError("the tokenizer's chat template ends no assistant turn with a special token and it has "
                         "no eos_token: set one with tokenizer.eos_token before SFT")
    return tokenizer.eos_token


def render_prompt(tokenizer, messages: Sequence[dict], forced_prefix: str) -> str:
    """Chat template with its generation prompt, then `forced_prefix` (e.g. "<think>")."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return text + forced_prefix


def _split_forced_prefix(response: str) -> tuple[str, str]:
    """(forced prefix, body): a response starting with <think> has it moved into the prompt (docs/interfaces.md)."""
    if response.startswith(THINK_OPEN):
        return THINK_OPEN, response[len(THINK_OPEN):]
    return "", response


def _paper(body: str, eot: str) -> list[Span]:
    return [(0, len(body) + len(eot))]


def _states_only(body: str, eot: str) -> list[Span]:
    return [m.span(1) for pattern in (_OBSERVATION, _PREDICTION) for m in pattern.finditer(body)]


def _answer_only(body: str, eot: str) -> list[Span]:
    return [m.span() for m in _ANSWER.finditer(body)] + [(len(body), len(body) + len(eot))]


def _paper_without_contents(body: str, eot: str, *blocks: re.Pattern) -> list[Span]:
    """`paper`'s one span with the contents of every matched block (group 1) cut out; the blocks' tags stay."""
    spans, start = [], 0
    for hole_start, hole_end in sorted(m.span(1) for pattern in blocks for m in pattern.finditer(body)):
        spans.append((start, hole_start))
        start = hole_end
    return spans + [(start, len(body) + len(eot))]


def _without_prediction(body: str, eot: str) -> list[Span]:
    return _paper_without_contents(body, eot, _PREDICTION)


def _without_states(body: str, eot: str) -> list[Span]:
    return _paper_without_contents(body, eot, _OBSERVATION, _PREDICTION)


SPAN_FUNCTIONS: dict[LossTarget, Callable[[str, str], list[Span]]] = {
    LossTarget.PAPER: _paper,
    LossTarget.STATES_ONLY: _states_only,
    LossTarget.ANSWER_ONLY: _answer_only,
    LossTarget.WITHOUT_PREDICTION: _without_prediction,
    LossTarget.WITHOUT_STATES: _without_states,
}


def substitute_placeholders(text: str) -> str:
    """The released code's state masking (§9.1 step 1): every observation/prediction block, tags included,
    becomes one placeholder token."""
    text = re.sub(r"<observation>.*?</observation>", OBS_PLACEHOLDER, text, flags=re.DOTALL)
    return re.sub(r"<prediction>.*?</prediction>", PRED_PLACEHOLDER, text, flags=re.DOTALL)


def _released_text(tokenizer, messages: Sequence[dict], response: str, eot: str) -> SftText:
    """§9.1 steps 1–2: placeholders in prompt and response, `<think></think>` before earlier assistant turns,
    prompt ending in `<think>`, target `</think>` + response + eos (all of it trained)."""
    prompt = [
        {"role": m["role"], "content": ("<think></think>" if m["role"] == "assistant" else "")
         + substitute_placeholders(m["content"])}
        for m in messages
    ]
    target = "</think>" + substitute_placeholders(response) + eot
    return SftText(render_prompt(tokenizer, prompt, THINK_OPEN), target, [(0, len(target))])


def build_text(tokenizer, messages: Sequence[dict], response: str, loss_target: LossTarget,
               eot: str) -> SftText:
    """Render one parquet row as (prompt text, target text, trained character spans)."""
    if loss_target is LossTarget.RELEASED:
        return _released_text(tokenizer, messages, response, eot)
    prefix, body = _split_forced_prefix(response)
    spans = SPAN_FUNCTIONS[loss_target](body, eot)
    return SftText(render_prompt(tokenizer, messages, prefix), body + eot, spans)


def token_loss_mask(offsets: np.ndarray, spans: Sequence[Span]) -> np.ndarray:
    """(T,) int64: 1 for each token that overlaps a trained span; offsets: (T, 2) [start, end) characters of each
    token."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 1, 2)
    overlaps = (offsets[:, 0] < spans[..., 1]) & (offsets[:, 1] > spans[..., 0])  # (spans, T)
    return overlaps.any(axis=0).astype(np.int64)


def released_off_by_one(input_ids: np.ndarray, loss_mask: np.ndarray, placeholder_ids: set[int]) -> np.ndarray:
    """§9.2: the released trainer drops the loss of the token *after* each placeholder (not the placeholder).

    input_ids, loss_mask: (T,) for the whole sequence; returns a new (T,) mask.
    """
    mask = loss_mask.copy()
    mask[1:][np.isin(input_ids[:-1], list(placeholder_ids))] = 0
    return mask


def prepare_tokenizer(tokenizer, loss_target: LossTarget) -> int:
    """Add the released code's placeholder tokens when `loss_target` is `released`; returns how many were added."""
    if loss_target is not LossTarget.RELEASED:
        return 0
    return tokenizer.add_special_tokens({"additional_special_tokens": list(PLACEHOLDERS)},
                                        replace_extra_special_tokens=False)


def placeholder_ids(tokenizer) -> set[int]:
    """Ids of `<obs_content>`/`<pred_content>`; ValueError if `prepare_tokenizer` was not called first."""
    vocab = tokenizer.get_added_vocab()
    missing = [p for p in PLACEHOLDERS if p not in vocab]
    if missing:
        raise ValueError(f"loss_target=released needs the tokens {missing} in the tokenizer: "
                         "call sft.loss_targets.prepare_tokenizer first")
    return {vocab[p] for p in PLACEHOLDERS}
