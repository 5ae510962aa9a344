"""vLLM's offline engine (spec §7.2), for fast generation on GPUs. Needs `pip install 'spa-agent[gpu]'`.

Prompts go in as token ids (`vllm.inputs.TokensPrompt`), so the forced response prefix and the chat template
are exactly those the context manager rendered (the original decoded its padded ids back to text first).
Written against the vLLM 0.24 API (`LLM.generate`, `SamplingParams`, `LLM.collective_rpc`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from SPA_agent.generators.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    MissingExtraError,
    Prompt,
    SamplingParams,
    stop_token_ids,
)

INSTALL_HINT = "the vllm generator needs vLLM: pip install 'spa-agent[gpu]' (or choose generator=hf)"
ENGINE_KEYS = (
    "dtype",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "max_num_batched_tokens",
    "enforce_eager",
    "enable_prefix_caching",
    "enable_sleep_mode",
    "seed",
)


def import_vllm():
    """The vllm module, or an ImportError naming the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise MissingExtraError(INSTALL_HINT) from err
    return vllm


def model_stop_ids(model_path: str, tokenizer) -> list[int]:
    """End-of-turn ids from the checkpoint's generation config and config, and the tokenizer."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # checkpoints without generation_config.json
        generation_config = None
    return stop_token_ids(tokenizer, generation_config, AutoConfig.from_pretrained(model_path))


class VLLMGenerator:
    """Generation with a `vllm.LLM` engine; returns sampled ids, text and finish reason."""

    def __init__(self, llm, sampling: SamplingParams, stop_ids: list[int], progress: bool = True):
        self.llm, self.sampling, self.stop_ids, self.progress = llm, sampling, stop_ids, progress
        self._vllm = import_vllm()

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], model_path: str, tokenizer) -> VLLMGenerator:
        """Start the engine on `model_path` with the engine keys of the `generator` config (spec §7.2)."""
        from SPA_agent.model_presets import resolve_model_path

        vllm = import_vllm()
        path = resolve_model_path(model_path)
        engine_args = {key: cfg[key] for key in ENGINE_KEYS if cfg.get(key) is not None}
        llm = vllm.LLM(model=path, tokenizer=path, disable_log_stats=True, **engine_args)
        return cls(
            llm,
            SamplingParams.from_config(cfg),
            model_stop_ids(path, tokenizer),
            progress=bool(cfg.get("progress", True)),
        )

    def sampling_params(self):
        """vLLM SamplingParams equivalent to ours; the engine's seed (config `seed`) makes runs
        reproducible."""
        params = self.sampling
        return self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=self.stop_ids,
            skip_special_tokens=True,
        )

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        inputs = [TokensPrompt(prompt_token_ids=list(p.prompt_ids)) for p in prompts]
        outputs = self.llm.generate(inputs, self.sampling_params(), use_tqdm=self.progress)
        return [self._to_generation(output.outputs[0]) for output in outputs]

    def _to_generation(self, completion) -> Generation:
        token_ids = list(completion.token_ids)
        stopped = bool(token_ids) and token_ids[-1] in self.stop_ids
        return Generation(
            text=completion.text, token_ids=token_ids, finish_reason=FINISH_STOP if stopped else FINISH_LENGTH
        )

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (e.g. the PPO actor's `named_parameters()`) into every engine worker, then drop
        the prefix cache, whose keys and values were computed with the old weights.

        Best effort: the (name, tensor) pairs go to each worker's `reload_weights` through
        `LLM.collective_rpc`, copied to CPU first so they can cross process boundaries. Names must be the
        Hugging Face checkpoint names (vLLM maps them onto its fused layers). For large models prefer verl's
        rollout workers, which share weights without this copy.
        """
        weights = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in named_params]
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()
