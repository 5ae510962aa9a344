"""Shared fixtures: the embedded tiny model and tokenizer, and composed configs."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from SPA_agent.config import compose
from SPA_agent.tiny import tiny_model_dir

torch.set_num_threads(2)


@pytest.fixture
def one_torch_thread():
    """One intra-op thread: on a shared 2-core machine, spinning OpenMP threads made tiny runs 10–20× slower
    (autouse in tests/trainer and tests/runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def call_entry(monkeypatch, capsys):
    """call_entry(module, argv) -> (exit status, stderr): the command line `python -m <module> <argv>` that must
    stop on a user error, run as `module.main()` in this process (no interpreter to start, which costs seconds
    here); the environment variables it sets are undone afterwards. A test using it names the test that starts the
    same entry point as a process."""
    environ = dict(os.environ)

    def call(module, argv: list[str]) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
        with pytest.raises(SystemExit) as exit_info:
            module.main()
        return exit_info.value.code, capsys.readouterr().err

    yield call
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture
def advantage_batches(monkeypatch):
    """The PPO batches of this test's runs, each recorded once its advantages and returns are computed."""
    from SPA_agent.trainer.ppo_trainer import PPOTrainer

    batches = []
    real_compute_advantage = PPOTrainer.compute_advantage

    def compute_advantage(self, batch):
        metrics = real_compute_advantage(self, batch)
        batches.append(batch)
        return metrics

    monkeypatch.setattr(PPOTrainer, "compute_advantage", compute_advantage)
    return batches


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


#: A Qwen3-style template written for the tests (not Qwen's text): ChatML turns; an assistant message's
#: `<think>…</think>` reasoning is dropped unless the message comes after the last user message, where it is
#: rendered as a `<think>\n…\n</think>\n\n` block (an empty one when it has none, if it is the final message);
#: `enable_thinking=False` opens the generation prompt with an empty think block.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="session")
def qwen3_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with `<think>`/`</think>` as single added tokens (reserved, as in Qwen3's vocabulary)
    and the Qwen3-style chat template above."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_TEMPLATE
    return tok


@pytest.fixture
def tiny_config():
    """Factory: compose an entry config on the tiny model, e.g. tiny_config("_2_sokoban", "generator=random")."""

    def make(config_name: str = "_2_sokoban", *overrides: str):
        return compose(config_name, ["model=tiny", *overrides])

    return make
