"""A rollout survives what a model may write (issue 12): the response goes through the real loop (prompt,
parse, EnvStateManager.step, batch), only the generator is a fixed script."""

from SPA_agent.generators.base import FINISH_STOP, Generation
from SPA_agent.rollout.agent_proxy import LLMAgentProxy
from SPA_agent.rollout.turns import rendered_states, turns


class FixedResponse:
    """A generator that answers every prompt with the same text (after the forced `<think>` prefix)."""

    def __init__(self, text: str):
        self.text = text

    def generate(self, prompts):
        return [Generation(self.text, None, FINISH_STOP) for _ in prompts]


def test_sudoku_rollout_with_a_non_ascii_digit_move_does_not_raise(tiny_config, tiny_tokenizer):
    cfg = tiny_config("_10_sudoku")
    proxy = LLMAgentProxy(
        cfg, FixedResponse("I write a square.</think><answer>²,1,1</answer>"), tiny_tokenizer
    )
    rollout = proxy.rollout(val=False)
    for state in rollout.states:
        taken = turns(state.history)
        assert len(taken) == cfg.agent_proxy.max_turn
        assert all(turn.actions == ["²,1,1"] for turn in taken)
        assert all(turn.info["action_is_valid"] is False for turn in taken)
        assert len(set(rendered_states(state.history))) == 1
    assert rollout.metrics["Sudoku/action_is_valid"] == 0.0
    assert rollout.metrics["Sudoku/success"] == 0.0
