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


@pytest.fixture
def tiny_config():
    """Factory: compose an entry config on the tiny model, e.g. tiny_config("_2_sokoban", "generator=random")."""

    def make(config_name: str = "_2_sokoban", *overrides: str):
        return compose(config_name, ["model=tiny", *overrides])

    return make
