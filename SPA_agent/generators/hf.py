"""Local generation with transformers (spec §7.2 sampling, on any device).

Prompts arrive as token ids (`Prompt.prompt_ids`, forced response prefix included), are sorted by length,
split into decode batches of at most `batch_size` sequences (None: no limit; `auto`: no limit on GPU, where a
decode step costs about the same for any batch, 64 on CPU, where a finished sequence still costs its share of
every step) and `max_batch_tokens` cache tokens (sequences × (padded prompt width + max_new_tokens); `auto`:
what the GPU's free memory holds, no limit on CPU), left padded with the tokenizer's pad id and continued until each sequence emits an end-of-turn token
(the ids listed as eos in the model's generation config and the tokenizer) or reaches `max_new_tokens`. One
call with all of a turn's prompts in one decode batch takes the fewest decode steps. Two decoders implement the same sampling (temperature → top-k → top-p → multinomial;
greedy at temperature 0):

- `generate`: transformers' `model.generate` (the CPU default);
- `static`: our decode loop over the model's forward with a static KV cache, captured in CUDA graphs on GPU
  (`SPA_agent/generators/static_decode.py`; the GPU default, see docs/generators.md for the speed-up).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from SPA_agent.generators.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    Prompt,
    SamplingParams,
    call_seed,
    stop_token_ids,
)
from SPA_agent.runs.progress import Heartbeat, progress_bar

DECODERS = ("auto", "generate", "static")
#: with max_batch_tokens=auto on GPU: the share of free GPU memory the KV cache of one decode batch may take (the
#: rest is for prefill activations, logits and sampling)
KV_MEMORY_SHARE = 0.5
#: batch_size=auto on CPU
CPU_BATCH_SIZE = 64


def end_of_turn_ids(model, tokenizer) -> list[int]:
    """Ids that end an assistant turn for a loaded model (see `base.stop_token_ids`)."""
    return stop_token_ids(tokenizer, getattr(model, "generation_config", None), model.config)


def pad_token_id(tokenizer, stop_ids: list[int]) -> int:
    """The tokenizer's pad id, or the first end-of-turn id for tokenizers without one (Llama-3)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]


def left_pad(batch: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, P) with P the longest prompt; padding on the left, mask 0
    there."""
    if any(len(ids) == 0 for ids in batch):
        raise ValueError("a prompt has no token ids: Prompt.prompt_ids must hold the rendered chat")
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token occupies in the cache of every layer (the model's dtype)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = next(model.parameters()).element_size()
    return config.num_hidden_layers * 2 * kv_heads * head_dim * element


def auto_batch_tokens(model) -> int | None:
    """Cache tokens of one decode batch that KV_MEMORY_SHARE of the free GPU memory holds (memory the caching
    allocator keeps in reserve counts as free); None (no limit) on CPU."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(1, int(KV_MEMORY_SHARE * free / kv_bytes_per_token(model)))


def decode_batches(lengths: list[int], max_new_tokens: int, batch_size: int | None,
                   max_batch_tokens: int | None, bucket: int = 1) -> list[list[int]]:
    """Prompt indices of each decode batch: sorted by length, consecutive, each batch holding at most
    `batch_size` prompts and `max_batch_tokens` cache tokens (prompts × (longest prompt rounded up to a multiple
    of `bucket`, + max_new_tokens)); a prompt alone over the token limit still gets its own batch."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for index in order:
        width = -(-lengths[index] // bucket) * bucket + max_new_tokens  # this prompt is the batch's longest
        current = batches[-1] if batches else None
        fits = current is not None and (batch_size is None or len(current) < batch_size) and (
            max_batch_tokens is None or (len(current) + 1) * width <= max_batch_tokens)
        if fits:
            current.append(index)
        else:
            batches.append([index])
    return batches


class HeartbeatCriterion(StoppingCriteria):
    """Stops nothing: in a redirected log, a plain line every HEARTBEAT_S seconds of a long decode (a turn of a
    real model on CPU takes minutes)."""

    def __init__(self, prompt_width: int):
        self.prompt_width, self.heartbeat = prompt_width, Heartbeat()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.heartbeat.beat(lambda: f"generate: {input_ids.shape[1] - self.prompt_width} new tokens of "
                                    f"{input_ids.shape[0]} sequences")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def cut_at_stop(ids: list[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """Sampled ids up to and including the first end-of-turn id, and the finish reason."""
    for position, token in enumerate(ids):
        if token in stop_ids:
            return ids[: position + 1], FINISH_STOP
    return ids, FINISH_LENGTH


def load_model(model_path: str, dtype: str = "bfloat16", device: str = "auto"):
    """AutoModelForCausalLM in eval mode: `dtype` on GPU, float32 on CPU (`model_path=tiny` is the embedded
    model)."""
    from transformers import AutoModelForCausalLM

    from SPA_agent.model_presets import resolve_model_path

    target = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    torch_dtype = getattr(torch, dtype) if target.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(model_path), dtype=torch_dtype)
    return model.to(target).eval()


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """Eval mode and no autograd for the duration (the PPO actor goes back to training mode afterwards)."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


class HFGenerator:
    """Batched generation with a transformers causal LM (a preloaded model such as the PPO actor, or
    loaded)."""

    def __init__(
        self,
        model,
        tokenizer,
        sampling: SamplingParams,
        batch_size: int | str | None = 64,
        decoder: str = "auto",
        cuda_graphs: bool = True,
        progress: bool = True,
        max_batch_tokens: int | str | None = None,
        compile_decode_step: bool = False,
        liger_kernels: bool | str = False,
        fused_projections: bool | str = False,
        decode_attention: str = "auto",
        keep_decode_graphs: bool = False,
        reuse_prefix_cache: bool = False,
        prefill_chunk_tokens: int | None = None,
        compact_decode_rows: int = 0,
    ):
        if batch_size is not None and batch_size != "auto" and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"generator.batch_size must be a positive integer, auto or null, got {batch_size!r}")
        if max_batch_tokens is not None and max_batch_tokens != "auto" and (
                not isinstance(max_batch_tokens, int) or max_batch_tokens < 1):
            raise ValueError(f"generator.max_batch_tokens must be a positive integer, auto or null, "
                             f"got {max_batch_tokens!r}")
        if decoder not in DECODERS:
            raise ValueError(f"generator.decoder must be one of {DECODERS}, got {decoder!r}")
        if prefill_chunk_tokens is not None and (isinstance(prefill_chunk_tokens, bool)
                                                 or not isinstance(prefill_chunk_tokens, int) or prefill_chunk_tokens < 1):
            raise ValueError(f"generator.prefill_chunk_tokens must be a positive integer, got {prefill_chunk_tokens!r}")
        if isinstance(compact_decode_rows, bool) or not isinstance(compact_decode_rows, int) or compact_decode_rows < 0:
            raise ValueError(f"generator.compact_decode_rows must be an integer of at least 0, got {compact_decode_rows!r}")
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.max_batch_tokens, self.progress = max_batch_tokens, progress
        self.stop_ids = end_of_turn_ids(model, tokenizer)
        self.pad_id = pad_token_id(tokenizer, self.stop_ids)
        on_gpu = next(model.parameters()).device.type == "cuda"
        self.batch_size = (None if on_gpu else CPU_BATCH_SIZE) if batch_size == "auto" else batch_size
        self.decoder = ("static" if on_gpu else "generate") if decoder == "auto" else decoder
        self.cuda_graphs = cuda_graphs and on_gpu
        self.compile_decode_step = compile_decode_step
        # Liger's fused kernels on a GPU (liger_decode.py); CPU decoding keeps transformers' float32 modules
        from SPA_agent.generators import liger_decode

        self.liger_kernels = liger_decode.resolve(liger_kernels, model)
        if self.liger_kernels:
            liger_decode.patch_model(model)
        # one GEMM for q/k/v and one for gate/up, on a GPU, after Liger (its MLP forward is replaced)
        from SPA_agent.generators import fused_projections as fusion

        self.fused_projections = fusion.resolve(fused_projections, model)
        if self.fused_projections:
            fusion.fuse_projections(model)
        # the static decoder's attention kernel (split_kv_decode.py)
        from SPA_agent.generators import split_kv_decode

        self.decode_attention = split_kv_decode.resolve(str(decode_attention), next(model.parameters()).device)
        # the static decoder keeps its KV buffer and CUDA graphs between calls (static_decode.py, keep_graphs)
        self.keep_decode_graphs = keep_decode_graphs
        # each turn prefilled past what its chat's row of the KV cache holds already (prefix_cache.py)
        self.reuse_prefix_cache = reuse_prefix_cache
        # prompt tokens a prefill forward of the static decoder (None: static_decode.PREFILL_TOKENS)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # a turn's last running rows decoded apart once at most this many remain (static_decode.py; 0: off)
        self.compact_decode_rows = compact_decode_rows
        self._static = None
        self._calls = 0

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], model_path: str, tokenizer, model=None) -> HFGenerator:
        if model is None:
            model = load_model(model_path, str(cfg.get("dtype", "bfloat16")), str(cfg.get("device", "auto")))
        return cls(
            model,
            tokenizer,
            SamplingParams.from_config(cfg),
            batch_size=cfg.get("batch_size", 64),
            max_batch_tokens=cfg.get("max_batch_tokens"),
            decoder=str(cfg.get("decoder", "auto")),
            cuda_graphs=bool(cfg.get("cuda_graphs", True)),
            progress=bool(cfg.get("progress", True)),
            compile_decode_step=bool(cfg.get("compile_decode_step", False)),
            liger_kernels=cfg.get("liger_kernels", False),
            fused_projections=cfg.get("fused_projections", False),
            decode_attention=str(cfg.get("decode_attention", "auto")),
            keep_decode_graphs=bool(cfg.get("keep_decode_graphs", False)),
            reuse_prefix_cache=bool(cfg.get("reuse_prefix_cache", False)),
            prefill_chunk_tokens=cfg.get("prefill_chunk_tokens"),
            compact_decode_rows=cfg.get("compact_decode_rows", 0),
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def state_dict(self) -> dict:
        """The sampling position: call k samples from seed `call_seed(seed, k)`, so a resumed run that restores
        this draws the same samples as an uninterrupted one."""
        return {"calls": self._calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._calls = int(state["calls"])

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        """Continue every prompt; prompts of similar length share a padded decode batch (`decode_batches`)."""
        from SPA_agent.generators.static_decode import PROMPT_BUCKET

        budget = auto_batch_tokens(self.model) if self.max_batch_tokens == "auto" else self.max_batch_tokens
        bucket = PROMPT_BUCKET if self.decoder == "static" and self.cuda_graphs else 1
        chunks = decode_batches([len(p.prompt_ids) for p in prompts], self.sampling.max_new_tokens,
                                self.batch_size, budget, bucket)
        generator = torch.Generator(self.device).manual_seed(call_seed(self.sampling.seed, self._calls))
        self._calls += 1
        results: list[Generation | None] = [None] * len(prompts)
        # one batch of prompts that each name their chat: with the reused prefix cache (turn by turn: it lives in the
        # kept KV buffer), a turn prefills past what the buffer holds of each chat (prefix_cache.py)
        continues = (self.reuse_prefix_cache and self.keep_decode_graphs and self.decoder == "static"
                     and len(chunks) == 1 and all(prompt.conversation is not None for prompt in prompts))
        with eval_mode(self.model), self._kernels():
            for chunk in progress_bar(
                chunks, desc="generate", leave=False, disable=not self.progress or len(chunks) < 2
            ):
                conversations = [prompts[i].conversation for i in chunk] if continues else None
                sampled = self._generate_chunk([prompts[i].prompt_ids for i in chunk], generator, conversations)
                for index, ids in zip(chunk, sampled):
                    results[index] = self._to_generation(ids)
        if self._static is not None and not self.keep_decode_graphs:
            self._static.release()  # give the KV buffers back (the PPO actor trains on the same device)
        return results

    @property
    def can_serve(self) -> bool:
        """Whether `serve` runs (pipelined turns need the static decoder)."""
        return self.decoder == "static"

    def serve(self, prompts: list[Prompt], respond: Callable[[int, Generation], Prompt | None]) -> None:
        """Pipelined turns (turn_pipeline.py): decode each prompt's turn in one batch, hand each ended turn to
        `respond(row, generation)` at once and continue that row with the prompt it returns (None: the row is
        done), while the other rows decode. Sampling as `generate` (one seed per call: per rollout here)."""
        if not self.can_serve:
            raise ValueError(f"pipelined turns need generator.decoder=static, got {self.decoder!r}")
        generator = torch.Generator(self.device).manual_seed(call_seed(self.sampling.seed, self._calls))
        self._calls += 1

        def respond_ids(row: int, sampled: list[int]) -> list[int] | None:
            prompt = respond(row, self._to_generation(sampled))
            return None if prompt is None else prompt.prompt_ids

        decoder = self._static_decoder()
        with eval_mode(self.model), self._kernels():
            decoder.serve([p.prompt_ids for p in prompts], self.sampling, generator, respond_ids)
        if not self.keep_decode_graphs:
            decoder.release()

    def _static_decoder(self):
        """The static decoder of this generator (built on first use), which also serves pipelined turns."""
        if self._static is None:
            from SPA_agent.generators.turn_pipeline import PipelinedDecoder

            self._static = PipelinedDecoder(self.model, self.stop_ids, self.pad_id, use_cuda_graphs=self.cuda_graphs,
                                            compile_step=self.compile_decode_step, attention=self.decode_attention,
                                            keep_graphs=self.keep_decode_graphs,
                                            reuse_prefix_cache=self.reuse_prefix_cache,
                                            prefill_chunk_tokens=self.prefill_chunk_tokens,
                                            compact_rows=self.compact_decode_rows)
        return self._static

    def _kernels(self) -> contextlib.AbstractContextManager:
        """Liger's rotary embedding while this generator decodes (its norms and MLPs are patched for good)."""
        if not self.liger_kernels:
            return contextlib.nullcontext()
        from SPA_agent.generators.liger_decode import fused_rope

        return fused_rope(self.model)

    def _generate_chunk(self, batch: list[list[int]], generator: torch.Generator,
                        conversations: list | None = None) -> list[list[int]]:
        """Sampled ids per prompt (B lists; may run past the end of turn, cut later). With the chats they continue
        (`conversations`), the static decoder prefills them past what its cache holds (prefix_cache.py)."""
        if conversations is not None:
            return self._static_decoder().generate_turn(batch, conversations, self.sampling, generator)
        input_ids, attention_mask = left_pad(batch, self.pad_id, self.device)
        if self.decoder == "generate":
            return self._with_generate(input_ids, attention_mask, generator)
        return self._static_decoder().generate(input_ids, attention_mask, self.sampling, generator, batch).tolist()

    def _with_generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator
    ) -> list[list[int]]:
        """transformers' generate; its sampling draws from the global RNG, seeded here from `generator`."""
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=self._generation_config(),
                stopping_criteria=StoppingCriteriaList([HeartbeatCriterion(input_ids.shape[1])] if self.progress else []),
            )
        return output[:, input_ids.shape[1] :].tolist()

    def _generation_config(self):
        """Only our sampling parameters: every processor a checkpoint's generation config could switch on
        (repetition penalty, top-k 50, ...) is set to its neutral value."""
        from transformers import GenerationConfig

        params = self.sampling
        sampling = (
            {}
            if params.greedy
            else dict(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
        )
        return GenerationConfig(
            do_sample=not params.greedy,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            num_beams=1,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            min_length=0,
            **sampling,
        )

    def _to_generation(self, ids: list[int]) -> Generation:
        token_ids, finish_reason = cut_at_stop(ids, set(self.stop_ids))
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return Generation(text=text, token_ids=token_ids, finish_reason=finish_reason)
