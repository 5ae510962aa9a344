"""Shared fixtures: the embedded tiny model and tokenizer, and composed configs."""

from __future__ import annotations

import pytest
import torch

from SPA_agent.config import compose
from SPA_agent.tiny import tiny_model_dir

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_dir():
    """Directory of the embedded tiny model (built once per machine, then cached)."""
    return tiny_model_dir()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir)


LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def llama_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with Llama-3's header/end-of-turn special tokens and a Llama-3-style chat template."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.fixture
def tiny_config():
    """Factory: compose an entry config on the tiny model, e.g. tiny_config("_2_sokoban", "generator=random")."""

    def make(config_name: str = "_2_sokoban", *overrides: str):
        return compose(config_name, ["model=tiny", *overrides])

    return make
