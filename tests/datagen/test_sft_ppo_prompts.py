"""An SFT row's prompt and the PPO prompt for the same state are the same token ids (issue 26).

SPA's PPO can run with the SFT's own prompts (`ctx_manager.mode=add_worldmodel`). The SFT trainer tokenizes each
row as text (chat template with its generation prompt, then the forced `<think>`); a PPO rollout builds its prompt
from the messages and the ids earlier turns sampled (chat_tokens.ChatTokenizer). Anything that separates the two
(a system message, a template's own default system message, the forced prefix, tokenization across the
prompt/response boundary) shows here as differing ids, under ChatML and under SmolLM2's template. A first turn's
prompt is the same state in both; later rows differ from the rollout's prompts by design, and only there: their
earlier assistant turns hold the true states where the model wrote its own (SPA's substitution; the random
generator writes empty blocks).
"""

from __future__ import annotations

import copy
import re

import pytest
from smollm2_template import SMOLLM2_TEMPLATE
from test_generate_sft_data import data_gen_config

from sft.loss_targets import LossTarget, build_text, end_of_turn_token
from SPA_agent.generators import build_generator
from SPA_agent.rollout.agent_proxy import LLMAgentProxy
from SPA_agent.selfplay.generate import rollout_records

STATE_BLOCK = re.compile(r"<(observation|prediction)>.*?</\1>", re.DOTALL)


def without_states(messages) -> tuple:
    """The messages with the contents of every <observation>/<prediction> block removed."""
    return tuple((m["role"], STATE_BLOCK.sub(r"<\1></\1>", m["content"])) for m in messages)


class RecordingGenerator:
    """The random generator, keeping each prompt it was given (messages and ids)."""

    def __init__(self, inner):
        self.inner = inner
        self.prompts = []

    def generate(self, prompts):
        self.prompts += prompts
        return self.inner.generate(prompts)


@pytest.mark.parametrize("template", ["chatml", "smollm2"])
def test_sft_rows_and_ppo_prompts_have_the_same_token_ids(tiny_tokenizer, tmp_path, template):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    if template == "smollm2":
        tokenizer.chat_template = SMOLLM2_TEMPLATE
    cfg = data_gen_config("_2_sokoban", tmp_path, "generator=random", "es_manager.train.env_groups=4",
                          "es_manager.train.env_configs.n_groups=[4]", "es_manager.train.group_size=2",
                          num_batches=1)
    generator = RecordingGenerator(build_generator(cfg.generator, cfg.model_path, tokenizer))
    assert cfg.ctx_manager.mode == "add_worldmodel"  # set from data_gen.prompt_mode
    proxy = LLMAgentProxy(cfg, generator, tokenizer)
    rows, _ = rollout_records(proxy, proxy.rollout().states, 0, {"SimpleSokoban": "sokoban"})
    ppo_prompts = {tuple((m["role"], m["content"]) for m in p.messages): p.prompt_ids for p in generator.prompts}
    ppo_without_states = {without_states(p.messages) for p in generator.prompts}
    eot = end_of_turn_token(tokenizer)
    first_turns = [row for row in rows if row["turn"] == 0]
    assert len(first_turns) == 8 and max(row["turn"] for row in rows) >= 2
    for row in first_turns:
        text = build_text(tokenizer, row["prompt"], row["response"], LossTarget.PAPER, eot)
        sft_ids = tokenizer(text.prompt_text, add_special_tokens=False)["input_ids"]
        messages = tuple((m["role"], m["content"]) for m in row["prompt"])
        assert sft_ids == ppo_prompts[messages], f"trajectory {row['trajectory_id']}"
    for row in rows:
        assert without_states(row["prompt"]) in ppo_without_states, f"turn {row['turn']} of {row['trajectory_id']}"
