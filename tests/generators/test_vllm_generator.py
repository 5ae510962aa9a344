"""The vLLM generator without vLLM: choosing it gives one clear error naming the extra to install."""

from __future__ import annotations

import importlib.util

import pytest

from SPA_agent.generators import build_generator
from SPA_agent.generators.base import stop_token_ids
from SPA_agent.generators.vllm import model_stop_ids

needs_no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")


@needs_no_vllm
def test_missing_vllm_names_the_extra(tiny_config, tiny_tokenizer):
    cfg = tiny_config("_2_sokoban", "generator=vllm").generator
    with pytest.raises(ImportError, match=r"pip install 'spa-agent\[gpu\]'"):
        build_generator(cfg, "tiny", tiny_tokenizer)


def test_stop_ids_read_from_the_checkpoint(tiny_dir, tiny_tokenizer, tiny_model):
    expected = sorted(tiny_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    assert model_stop_ids(str(tiny_dir), tiny_tokenizer) == expected
    assert stop_token_ids(tiny_tokenizer, tiny_model.generation_config) == expected
