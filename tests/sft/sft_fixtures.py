"""Builders shared by the SFT tests: hand-written rows, parquet files in the §8 schema, a Llama-3-style template."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SYSTEM = {"role": "system", "content": "You're a helpful assistant. "}
TURN_1 = {"role": "user", "content": "Turn 1:\nState:\n#P#\n"}
ANSWER_1 = {"role": "assistant",
            "content": "<think> <observation>#P#</observation> go <prediction>#_P</prediction></think>"
                       "<answer>Right</answer>"}
TURN_2 = {"role": "user", "content": "Reward:\n-0.1\n\nTurn 2:\nState:\n#_P\n"}
PROMPT = [SYSTEM, TURN_1, ANSWER_1, TURN_2]
RESPONSE = ("<think> <observation>#_P</observation> push <prediction>#__</prediction></think>"
            "<answer>Left || Up</answer>")

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

PROMPT_TYPE = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))


def llama3_tokenizer(tokenizer):
    """A copy of `tokenizer` with Llama-3 header tokens and a Llama-3-style chat template."""
    llama = copy.deepcopy(tokenizer)
    llama.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS}, replace_extra_special_tokens=False)
    llama.chat_template = LLAMA3_TEMPLATE
    return llama


def write_rows(path: Path, prompts: list[list[dict]], responses: list[str], released_extras: bool = True) -> Path:
    """Write rows in the §8 schema (with the released data's extra string columns when asked)."""
    columns = {"prompt": pa.array(prompts, type=PROMPT_TYPE), "response": pa.array(responses, type=pa.string())}
    if released_extras:
        n = len(responses)
        columns |= {"data_source": pa.array(["sokoban"] * n), "ability": pa.array(["bfs"] * n),
                    "reward_model": pa.array(["{'style': 'rule'}"] * n),
                    "extra_info": pa.array([f"{{'index': {i}, 'split': 'train'}}" for i in range(n)])}
    pq.write_table(pa.table(columns), path)
    return path


def synthetic_rows(n: int, seed: int = 0) -> tuple[list[list[dict]], list[str]]:
    """Small Sokoban-like rows whose response is a deterministic function of the state (learnable)."""
    rng = random.Random(seed)
    moves = {"P_": "Right", "_P": "Left"}
    prompts, responses = [], []
    for _ in range(n):
        state = rng.choice(list(moves))
        nxt = state[::-1]
        prompts.append([SYSTEM, {"role": "user", "content": f"Turn 1:\nState:\n#{state}#\n"}])
        responses.append(f"<think> <observation>#{state}#</observation> <prediction>#{nxt}#</prediction>"
                         f"</think><answer>{moves[state]}</answer>")
    return prompts, responses
