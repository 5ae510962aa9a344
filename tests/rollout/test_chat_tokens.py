"""Exact token ids and roles of a hand-checked two-turn conversation, for ChatML and Llama-3 templates (Qwen3:
tests/rollout/test_qwen3_template.py)."""

import pytest

from SPA_agent.rollout.chat_tokens import CONTEXT, SAMPLED, SYSTEM, AssistantTurn, ChatTokenizer

MESSAGES = [
    {"role": "system", "content": "You're a helpful assistant. "},
    {"role": "user", "content": "Turn 1: go"},
    {"role": "assistant", "content": "ignored: the ids below are used"},
    {"role": "user", "content": "Reward:\n-0.1\n"},
    {"role": "assistant", "content": "ignored"},
]


def _turns(tok, truncated_second=False):
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    first = enc("a</think><answer>Up</answer>") + [tok.eos_token_id]
    second = enc("b</think><answer>Down") + ([] if truncated_second else [tok.eos_token_id])
    return [AssistantTurn("<think>", first), AssistantTurn("<think>", second)]


def test_chatml_conversation_ids_and_roles_are_exact(tiny_tokenizer):
    tok = tiny_tokenizer
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = _turns(tok)
    ids, roles = ChatTokenizer(tok).build(MESSAGES, turns)
    system = enc("<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n")
    user1 = enc("<|im_start|>user\nTurn 1: go<|im_end|>\n<|im_start|>assistant\n<think>")
    user2 = enc("\n<|im_start|>user\nReward:\n-0.1\n<|im_end|>\n<|im_start|>assistant\n<think>")
    tail = enc("\n")
    assert ids == system + user1 + turns[0].ids + user2 + turns[1].ids + tail
    assert roles == ([SYSTEM] * len(system) + [CONTEXT] * len(user1) + [SAMPLED] * len(turns[0].ids)
                     + [CONTEXT] * len(user2) + [SAMPLED] * len(turns[1].ids) + [CONTEXT] * len(tail))


def test_each_distinct_text_is_tokenized_once_and_ids_stay_exact(tiny_tokenizer, monkeypatch):
    from SPA_agent.rollout import chat_tokens

    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tiny_tokenizer, name)

        def __call__(self, text, **kwargs):
            calls.append(text)
            return tiny_tokenizer(text, **kwargs)

    chat = ChatTokenizer(Counting())
    turns = _turns(tiny_tokenizer)
    expected = ChatTokenizer(tiny_tokenizer).build(MESSAGES, turns)
    first = chat.build(MESSAGES, turns)
    tokenized = len(calls)
    assert chat.build(MESSAGES, turns) == first == expected and len(calls) == tokenized  # all remembered
    first[0].append(-1)  # a caller extending the ids it got does not change what is remembered
    assert chat.build(MESSAGES, turns) == expected
    # the first turn's generation prompt is the conversation's first pieces (system turn, first user turn)
    chat.build(MESSAGES[:2], [], generation_prefix="<think>")
    assert len(calls) == tokenized and len(set(calls)) == len(calls)
    monkeypatch.setattr(chat_tokens, "ENCODED_TEXTS_KEPT", 2)  # four texts: emptied when full, then filled again
    small = ChatTokenizer(tiny_tokenizer)
    assert small.build(MESSAGES, turns) == expected and len(small._encoded) == 2


def test_truncated_turn_gets_the_template_end_of_turn_as_context(tiny_tokenizer):
    tok = tiny_tokenizer
    turns = _turns(tok, truncated_second=True)
    ids, roles = ChatTokenizer(tok).build(MESSAGES, turns)
    end = tok("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(end):] == end and roles[-len(end):] == [CONTEXT] * len(end)


def test_llama3_conversation_ids_and_roles_are_exact(llama_tokenizer):
    tok = llama_tokenizer
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = _turns(tok)
    ids, roles = ChatTokenizer(tok).build(MESSAGES, turns)
    system = enc("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou're a helpful assistant.<|eot_id|>")
    user1 = enc("<|start_header_id|>user<|end_header_id|>\n\nTurn 1: go<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n<think>")
    user2 = enc("<|start_header_id|>user<|end_header_id|>\n\nReward:\n-0.1<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n<think>")
    assert ids == system + user1 + turns[0].ids + user2 + turns[1].ids
    assert roles.count(SYSTEM) == len(system) and roles.count(SAMPLED) == len(turns[0].ids) + len(turns[1].ids)


@pytest.mark.parametrize("which", ["chatml", "llama3", "qwen3"])
def test_generation_prompt_is_a_prefix_of_the_finished_conversation(which, tiny_tokenizer, llama_tokenizer,
                                                                    qwen3_tokenizer):
    tok = {"chatml": tiny_tokenizer, "llama3": llama_tokenizer, "qwen3": qwen3_tokenizer}[which]
    chat, turns = ChatTokenizer(tok), _turns(tok)
    full, _ = chat.build(MESSAGES, turns)
    prompt1, _ = chat.build(MESSAGES[:2], [], generation_prefix="<think>")
    prompt2, _ = chat.build(MESSAGES[:4], turns[:1], generation_prefix="<think>")
    assert full[: len(prompt1)] == prompt1 and full[len(prompt1): len(prompt1) + len(turns[0].ids)] == turns[0].ids
    assert full[: len(prompt2)] == prompt2 and full[len(prompt2): len(prompt2) + len(turns[1].ids)] == turns[1].ids
