"""Prompts for generator tests, rendered with the tiny tokenizer's chat template (fixtures `make_prompt`,
`prompts_of_lengths`)."""

from __future__ import annotations

import pytest

from SPA_agent.generators import Prompt

SOKOBAN_ACTIONS = ["Up", "Down", "Left", "Right"]


def make_prompt(
    tokenizer,
    user_text: str,
    prefix: str = "<think>",
    history: list[dict] | None = None,
    worldmodel: bool = False,
) -> Prompt:
    """A chat [system, *history, user] opened for the assistant with `prefix` forced."""
    messages = [
        {"role": "system", "content": "You're a helpful assistant. "},
        *(history or []),
        {"role": "user", "content": user_text},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + prefix
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Prompt(
        messages=messages,
        prompt_ids=ids,
        response_prefix=prefix,
        action_space=list(SOKOBAN_ACTIONS),
        worldmodel=worldmodel,
    )


def prompts_of_lengths(tokenizer, repeats: list[int]) -> list[Prompt]:
    """Prompts whose user text repeats a Sokoban grid `r` times: very different lengths."""
    grid = "######\n#O####\n#XP###\n#__###\n######\n"
    return [make_prompt(tokenizer, f"Turn {r}:\nState:\n" + grid * r) for r in repeats]


def plain_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> tuple[list[int], str]:
    """(token ids, finish reason) of greedy decoding by the plainest loop: the whole sequence through the model at
    every step, no cache, no padding, no batch; it stops after the first of `stop_ids` ("stop") or at
    `max_new_tokens` ("length"). What a decoder's stop handling is checked against."""
    import torch

    ids: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([prompt_ids + ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
            if ids[-1] in stop_ids:
                return ids, "stop"
    return ids, "length"


@pytest.fixture
def greedy_reference():
    """plain_greedy(model, prompt_ids, max_new_tokens, stop_ids)."""
    return plain_greedy


@pytest.fixture(name="make_prompt")
def make_prompt_fixture(tiny_tokenizer):
    """make_prompt(user_text, prefix="<think>", history=None, worldmodel=False) on the tiny tokenizer."""
    return lambda *args, **kwargs: make_prompt(tiny_tokenizer, *args, **kwargs)


@pytest.fixture(name="prompts_of_lengths")
def prompts_of_lengths_fixture(tiny_tokenizer):
    return lambda repeats: prompts_of_lengths(tiny_tokenizer, repeats)


@pytest.fixture(scope="session")
def varied_model(tiny_model):
    """The tiny architecture with larger random weights (init std 0.2, seed 0): greedy decoding gives varied
    tokens (the embedded model, std 0.02, repeats one token), and some turns end early (`greedy_reference`)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(tiny_model.config)
    config.initializer_range = 0.2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = copy.deepcopy(tiny_model.generation_config)
    return model.eval()
