"""Masks and scores of a hand-built two-turn trajectory, for both enable_response_mask settings and the
ChatML, a Llama-3-style and a Qwen3-style template: column j of the (B, T-1) tensors scores token j+1."""

import pytest
import torch

from SPA_agent.rollout.ctx_manager import ContextManager
from SPA_agent.rollout.turns import EnvRecord


def _trajectory(tok):
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    turn1, turn2 = enc("a</think><answer>Up</answer>") + [tok.eos_token_id], enc("b</think><answer>Left")
    return EnvRecord(
        env_id=0, group_id=0, tag="SimpleSokoban", seed=123, penalty=-0.1, metrics={},
        history=[
            {"state": "#P#", "actions_left": 10, "llm_response": "<think>a</think><answer>Up</answer>",
             "llm_raw_response": "<think>a</think><answer>Up</answer>", "reward": -0.1, "response_ids": turn1,
             "actions": ["Up"], "info": {}, "parsed": {"format_ok": True}},
            {"state": "#_P", "actions_left": 9, "llm_response": "<think>b</think><answer>Left",
             "llm_raw_response": "<think>b</think><answer>Left", "reward": 10.9, "response_ids": turn2,
             "actions": ["Left"], "info": {}, "parsed": {"format_ok": False}},
            {"state": "#P_", "actions_left": 8},
        ],
    )


def _positions(ids: list[int], part: list[int], start: int = 0) -> list[int]:
    """Positions of the first occurrence of `part` as a contiguous run in `ids` at or after `start`."""
    for i in range(start, len(ids) - len(part) + 1):
        if ids[i : i + len(part)] == part:
            return list(range(i, i + len(part)))
    raise AssertionError(f"{part} not in the sequence after position {start}")


@pytest.mark.parametrize("template", ["chatml", "llama3", "qwen3"])
@pytest.mark.parametrize("response_only", [True, False])
def test_masks_and_score_follow_the_token_roles(template, response_only, tiny_config, tiny_tokenizer,
                                                 llama_tokenizer, qwen3_tokenizer):
    """Expected masks written from the trajectory and the template alone (not from ChatTokenizer's roles): the
    sampled ids of both turns are the response mask; with enable_response_mask=False every token after the
    system message trains."""
    tok = {"chatml": tiny_tokenizer, "llama3": llama_tokenizer, "qwen3": qwen3_tokenizer}[template]
    cfg = tiny_config("_2_sokoban", f"enable_response_mask={response_only}")
    ctx = ContextManager(cfg, tok)
    cache = _trajectory(tok)
    out = ctx.get_masks_and_scores([cache])
    ids = out["input_ids"][0].tolist()
    turn1 = _positions(ids, cache.history[0]["response_ids"])
    turn2 = _positions(ids, cache.history[1]["response_ids"], start=turn1[-1] + 1)
    sampled = torch.zeros(len(ids) - 1)
    sampled[[p - 1 for p in turn1 + turn2]] = 1  # column j scores token j + 1
    torch.testing.assert_close(out["response_mask"][0], sampled)
    system = ctx.messages(cache, normalized=False, for_update=True)[0]
    assert system["role"] == "system"
    system_ids = tok(tok.apply_chat_template([system], tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids[: len(system_ids)] == system_ids
    after_system = torch.zeros(len(ids) - 1)
    after_system[len(system_ids) - 1 :] = 1
    expected_loss = sampled if response_only else after_system
    torch.testing.assert_close(out["loss_mask"][0], expected_loss)
    # the truncated second turn is closed by the template's end of turn, which is context, not sampled
    assert turn2[-1] < len(ids) - 1
    last = int(expected_loss.nonzero().max())
    assert last == (turn2[-1] - 1 if response_only else len(ids) - 2)
    assert out["rm_scores"][0, last].item() == pytest.approx(-0.1 + 10.9 - 0.1)
    assert out["rm_scores"][0].count_nonzero().item() == 1


def test_turn_scores_sit_on_each_turns_last_sampled_token(tiny_config, tiny_tokenizer):
    cfg = tiny_config("_2_sokoban", "agent_proxy.use_turn_scores=True")
    ctx = ContextManager(cfg, tiny_tokenizer)
    out = ctx.get_masks_and_scores([_trajectory(tiny_tokenizer)])
    mask = out["response_mask"][0]
    ends = [j for j in range(len(mask)) if mask[j] == 1 and (j + 1 == len(mask) or mask[j + 1] == 0)]
    assert len(ends) == 2
    assert out["rm_scores"][0, ends[0]].item() == pytest.approx(-0.1)
    assert out["rm_scores"][0, ends[1]].item() == pytest.approx(10.9 - 0.1)  # the penalty on the last turn
