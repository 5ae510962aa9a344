"""A Qwen3-style chat template (tests/conftest.py QWEN3_TEMPLATE: reasoning of earlier assistant turns stripped,
a `<think>` block on the final one, an enable_thinking switch, `<think>`/`</think>` single tokens): exact ids and
roles, and token in, token out through the context manager, as for ChatML and Llama-3."""

import pytest

from SPA_agent.rollout.chat_tokens import CONTEXT, SAMPLED, SYSTEM, AssistantTurn, ChatTokenizer
from SPA_agent.rollout.ctx_manager import ContextManager
from SPA_agent.rollout.turns import EnvCache, EnvRecord

MESSAGES = [
    {"role": "system", "content": "You're a helpful assistant. "},
    {"role": "user", "content": "Turn 1: go"},
    {"role": "assistant", "content": "<think>a</think><answer>Up</answer>"},
    {"role": "user", "content": "Reward:\n-0.1\n"},
    {"role": "assistant", "content": "<think>b</think><answer>Down</answer>"},
]


def _enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _turns(tok) -> list[AssistantTurn]:
    first = _enc(tok, "a</think><answer>Up</answer>") + [tok.eos_token_id]
    second = _enc(tok, "b</think><answer>Down</answer>") + [tok.eos_token_id]
    return [AssistantTurn("<think>", first), AssistantTurn("<think>", second)]


def test_the_template_strips_earlier_reasoning_and_has_a_thinking_switch(qwen3_tokenizer):
    """What makes the template Qwen3-like (so the tests below test something)."""
    tok = qwen3_tokenizer
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert "<|im_start|>assistant\n<answer>Up</answer><|im_end|>" in text  # turn 1's reasoning is gone
    assert text.endswith("<|im_start|>assistant\n<think>\nb\n</think>\n\n<answer>Down</answer><|im_end|>\n")
    final_no_reasoning = tok.apply_chat_template([*MESSAGES[:4], {"role": "assistant", "content": "x"}], tokenize=False)
    assert final_no_reasoning.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nx<|im_end|>\n")
    off = tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert len(_enc(tok, "<think>")) == len(_enc(tok, "</think>")) == 1


def test_qwen3_conversation_ids_and_roles_are_exact(qwen3_tokenizer):
    """Each sampled turn follows exactly the prompt it was generated from: no reasoning stripped from turn 1, no
    `<think>\\n\\n</think>\\n\\n` block before the final turn (the template's rendering of a final message)."""
    tok = qwen3_tokenizer
    turns = _turns(tok)
    ids, roles = ChatTokenizer(tok).build(MESSAGES, turns)
    system = _enc(tok, "<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n")
    user1 = _enc(tok, "<|im_start|>user\nTurn 1: go<|im_end|>\n<|im_start|>assistant\n<think>")
    user2 = _enc(tok, "\n<|im_start|>user\nReward:\n-0.1\n<|im_end|>\n<|im_start|>assistant\n<think>")
    tail = _enc(tok, "\n")
    assert ids == system + user1 + turns[0].ids + user2 + turns[1].ids + tail
    assert roles == ([SYSTEM] * len(system) + [CONTEXT] * len(user1) + [SAMPLED] * len(turns[0].ids)
                     + [CONTEXT] * len(user2) + [SAMPLED] * len(turns[1].ids) + [CONTEXT] * len(tail))
    think = tok.convert_tokens_to_ids("<think>")
    assert [i for i, r in zip(ids, roles) if r == CONTEXT].count(think) == 2  # the two forced prefixes only


def _cache(tok) -> EnvRecord:
    """A finished two-turn Sokoban trajectory (the last history entry holds the final state)."""
    history = []
    for k, body in enumerate(["a</think><answer>Up</answer>", "b</think><answer>Left</answer>"]):
        raw = "<think>" + body
        history.append({"state": f"#P{k}", "actions_left": 10 - k, "llm_response": raw, "llm_raw_response": raw,
                        "reward": -0.1, "response_ids": _enc(tok, body) + [tok.eos_token_id],
                        "actions": ["Up"], "info": {}, "parsed": {"format_ok": True}})
    history.append({"state": "#P2", "actions_left": 8})
    return EnvRecord(env_id=0, group_id=0, tag="SimpleSokoban", seed=1, penalty=0.0, metrics={}, history=history)


@pytest.mark.parametrize("enable_think", [True, False])
def test_training_ids_extend_every_generation_prompt_with_its_sampled_ids(enable_think, tiny_config,
                                                                          qwen3_tokenizer):
    tok = qwen3_tokenizer
    ctx = ContextManager(tiny_config("_2_sokoban", f"agent_proxy.enable_think={enable_think}"), tok)
    final = _cache(tok)
    if not enable_think:  # the forced prefix is <answer>: the sampled ids continue from it
        for entry in final.history[:2]:
            entry["response_ids"] = _enc(tok, "Up</answer>") + [tok.eos_token_id]
    row = ctx.get_masks_and_scores([final])
    input_ids = row["input_ids"][0].tolist()
    sampled = row["response_mask"][0].bool().tolist()
    for k in range(2):
        shown = {"state": final.history[k]["state"], "actions_left": final.history[k]["actions_left"]}
        partial = EnvCache(final.env_id, final.group_id, final.tag, final.seed, final.penalty,
                           history=[*final.history[:k], shown])
        _, prompt = ctx.get_lm_inputs([partial])[0]
        turn = final.history[k]["response_ids"]
        assert prompt[-1] == _enc(tok, ctx.prefix)[-1]
        assert input_ids[: len(prompt) + len(turn)] == prompt + turn, f"turn {k + 1} was sampled from another context"
        assert sampled[len(prompt) - 1 : len(prompt) - 1 + len(turn)] == [True] * len(turn)
    assert sum(sampled) == sum(len(e["response_ids"]) for e in final.history[:2])
