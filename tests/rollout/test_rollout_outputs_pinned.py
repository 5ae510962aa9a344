"""The rollout's outputs pinned bit for bit (issue 42: the host work was made faster without changing any output).

Two consecutive rollouts of the tiny model's 4 x 2 Sokoban envs with the random generator (seeded), in both prompt
modes and with three chat templates (the tiny model's ChatML, a Llama-3-style one, the Qwen3-style one that
rewrites history): every prompt the generator is given (token ids, messages, prefix, action space), the batch
tensors (dtype, shape, bytes), the non-tensors, the metrics and every env's history are hashed. The reference
digests were computed at the parent commit of the speed-up (cb711ce), by the straightforward path.
"""

import hashlib
import json

import numpy as np
import pytest

from SPA_agent.generators import build_generator
from SPA_agent.rollout.agent_proxy import LLMAgentProxy

REFERENCE = {
    ("tiny", "base"): "9b411af2019ea2fbb84b51712d8356b6915379d4e79ce1a14595083248214050",
    ("llama", "base"): "b3189676ee260daafb25080b4cbae90bdc403343fd508d79cbf2540ff265e873",
    ("qwen3", "base"): "f3ac69786ee0d2e9fa9a2249ba841c7ae60defa247d43d5b63a0ddff7e73c6ee",
    ("tiny", "add_worldmodel"): "a3c6807e5a6b85c17a03433dd2306787d3cad150ade5484e15698fc63749fe34",
    ("llama", "add_worldmodel"): "68f370a5c22fa04f12088fef6cc4672b2ae7b853770a02f4d107071640ea6c76",
    ("qwen3", "add_worldmodel"): "129c5f419e0182c823cbd85d97318a10c5240631882216c34386474a86626ce6",
}


class Recording:
    """The random generator, recording every prompt it is given."""

    def __init__(self, generator, digest):
        self.generator, self.digest = generator, digest

    def generate(self, prompts):
        for p in prompts:
            self.digest.update(json.dumps([p.prompt_ids, p.messages, p.response_prefix, p.action_space,
                                           p.worldmodel]).encode())
        return self.generator.generate(prompts)


def rollout_digest(cfg, tokenizer, model_dir, rollouts: int = 2) -> str:
    digest = hashlib.sha256()
    proxy = LLMAgentProxy(cfg, Recording(build_generator(cfg.generator, str(model_dir), tokenizer), digest), tokenizer)
    for _ in range(rollouts):
        rollout = proxy.rollout(val=False)
        for key in sorted(rollout.batch.batch.keys()):
            tensor = rollout.batch.batch[key]
            digest.update(f"{key} {tensor.dtype} {tuple(tensor.shape)}".encode())
            digest.update(tensor.contiguous().numpy().tobytes())
        for key in sorted(rollout.batch.non_tensor_batch):
            array = rollout.batch.non_tensor_batch[key]
            assert isinstance(array, np.ndarray)
            digest.update(f"{key} {array.dtype} {array.shape} {array.tolist()!r}".encode())
        digest.update(repr(sorted(rollout.metrics.items())).encode())
        for state in rollout.states:
            digest.update(repr((state.env_id, state.group_id, state.tag, state.seed, state.penalty,
                                sorted(state.metrics.items()), state.history)).encode())
    return digest.hexdigest()


@pytest.mark.parametrize("template", ["tiny", "llama", "qwen3"])
@pytest.mark.parametrize("mode", ["base", "add_worldmodel"])
def test_rollout_outputs_equal_the_reference(template, mode, tiny_config, tiny_dir, request):
    tokenizer = request.getfixturevalue(f"{template}_tokenizer")
    cfg = tiny_config("_2_sokoban", "generator=random", f"ctx_manager.mode={mode}")
    assert rollout_digest(cfg, tokenizer, tiny_dir) == REFERENCE[(template, mode)]


@pytest.mark.parametrize("kept", [3, 16384])
def test_build_many_equals_build_one_by_one(kept, tiny_config, tiny_tokenizer, tiny_dir, monkeypatch):
    """The batch-encoded prompts and training rows equal `build` of each conversation alone, with a fresh
    ChatTokenizer (nothing remembered) and with the remembered texts emptied on the way (`kept=3`)."""
    from SPA_agent.rollout import chat_tokens

    monkeypatch.setattr(chat_tokens, "ENCODED_TEXTS_KEPT", kept)
    cfg = tiny_config("_2_sokoban", "generator=random", "ctx_manager.mode=add_worldmodel")
    proxy = LLMAgentProxy(cfg, build_generator(cfg.generator, str(tiny_dir), tiny_tokenizer), tiny_tokenizer)
    ctx = proxy.ctx
    records = proxy.rollout(val=False).states
    conversations = [(ctx.messages(r, normalized=False, for_update=True), ctx._assistant_turns(r), None)
                     for r in records]
    conversations += [(ctx.messages(r, normalized=False)[:2], [], ctx.prefix) for r in records]
    many = chat_tokens.ChatTokenizer(tiny_tokenizer).build_many(conversations)
    alone = [chat_tokens.ChatTokenizer(tiny_tokenizer).build(*c) for c in conversations]
    assert many == alone
