"""generator.keep_decode_graphs (static_decode.py, `keep_graphs`): one KV buffer, and one decode state (on GPU a CUDA
graph) per batch bucket of BATCH_BUCKET rows, kept across calls; the rows past a call's batch are padding.

On CPU: the samples are those of the decoder that builds a state per call; padding rows never reach the real rows;
flash attention's variable-length contract (emulated) is read at the buffer's row stride; and the greedy check that
the float16 GPU test relies on rejects decodes that read wrong keys. On a GPU: float32 decodes give generate's
tokens; float16 decodes pass the greedy check and give exactly the tokens of the decoder without kept graphs where
the two run the same shapes."""

from __future__ import annotations

import copy

import pytest
import torch
from test_static_decode import REPEATS, hf, ids, varlen_attention  # shared helpers

from SPA_agent.generators import SamplingParams

#: consecutive calls of generator.keep_decode_graphs' tests: 20, 4, 3, 20 and 3 prompts (batch buckets 32, 16, 16,
#: 32, 16); the first has the most rows and the longest prompt, so its KV buffer holds every later call
KEPT_CALLS = [[*range(1, 20), 60], REPEATS, [60, 5, 30], list(range(1, 21)), [40, 2, 9]]
#: 32 and 16 prompts, each with KEPT_CALLS' longest (60 repeats): the kept states for them have exactly the shape
#: (rows, cache length) that the decoder without kept graphs builds for the same prompts
FULL_BUCKETS = [[*range(1, 32), 60], [*range(45, 60), 60]]
#: the float16 GPU test's tolerance is twice the float16 error it measures (`float16_error`); it refuses errors of
#: this size or more, so its tolerance stays under 2 × this, far below what wrong reads cost (5.8 to 11.7 logits in
#: test_greedy_check_rejects_decodes_that_read_wrong_keys). On CPU, float16 over KEPT_CALLS: an error of 0.07, the
#: decoders' largest deficit 0.012
MAX_FLOAT16_ERROR = 0.25


def fresh_weights(model, seed: int):
    """Another random initialisation of `model`'s architecture (what `lm.copy_weights` brings a rollout model)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(model.config).to(next(model.parameters()).dtype)


def copy_weights(target, source) -> None:
    with torch.no_grad():
        for to, values in zip(target.parameters(), source.parameters()):
            to.copy_(values)


def finished(generations) -> list[tuple[list[int], str]]:
    return [(g.token_ids, g.finish_reason) for g in generations]


def teacher_forced_logits(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """(T, V) float32 logits that predict each of the T emitted tokens: one forward of the prompt followed by the
    emitted tokens but the last (no cache, no padding)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids[:-1]], device=device)).logits[0]
    return logits[len(prompt_ids) - 1 :].float()


def greedy_deficit(reference, prompts, generations) -> float:
    """How far below the argmax of `reference`'s logits an emitted token's logit lies, at worst over every emitted
    token, teacher-forced over the emitted sequences: 0.0 where every token is `reference`'s greedy token."""
    deficit = 0.0
    for prompt, generation in zip(prompts, generations):
        logits = teacher_forced_logits(reference, prompt.prompt_ids, generation.token_ids)
        emitted = torch.tensor(generation.token_ids, device=logits.device)
        deficit = max(deficit, float((logits.max(dim=1).values - logits.gather(1, emitted[:, None])[:, 0]).max()))
    return deficit


def float16_error(model, reference, prompts, generations) -> float:
    """The largest |`model` − `reference`| logit of one teacher-forced forward over the emitted sequences, at the
    two tokens `greedy_deficit` compares (`reference`'s argmax and the emitted token): with `model` in float16 and
    `reference` its float32 copy, the float16 rounding error of a forward on this device.

    A float16 decoder whose logits l16 differ from `reference`'s l32 by at most e emits c instead of `reference`'s
    argmax a only where l16(c) ≥ l16(a), so l32(a) − l32(c) ≤ 2e. The greedy check takes transformers' own float16
    forward's error for the decoder's and 2e as its tolerance."""
    error = 0.0
    for prompt, generation in zip(prompts, generations):
        exact = teacher_forced_logits(reference, prompt.prompt_ids, generation.token_ids)
        rounded = teacher_forced_logits(model, prompt.prompt_ids, generation.token_ids)
        emitted = torch.tensor(generation.token_ids, device=exact.device)
        compared = torch.stack([exact.argmax(dim=1), emitted], dim=1)  # (T, 2)
        error = max(error, float((rounded - exact).gather(1, compared).abs().max()))
    return error


def emulated_flash_forward(query, key, value, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                           *, scale=None, seqused_k=None, **unused):
    """torch.ops.aten._flash_attention_forward as `flash_decode` calls it, on CPU, by flash attention's
    variable-length contract (`varlen_attention`: the queries [cu_q[b], cu_q[b+1]) read the flat keys
    [cu_k[b], cu_k[b] + seqused_k[b])); its first result, the output. Refuses reads past the flat buffer, which the
    kernel would not notice."""
    assert dropout_p == 0.0 and not is_causal and seqused_k is not None
    assert bool((cu_k[:-1] + seqused_k <= key.shape[0]).all()) and int(seqused_k.max()) <= max_k
    return (varlen_attention(query, key, value, cu_q, cu_k, seqused_k, scale),)


def emulate_flash(monkeypatch) -> list[int]:
    """The static decoder on CPU through its flash attention path (`flash_decode`), the kernel emulated by
    `emulated_flash_forward`; returns the row stride, cu_seqlens_k[1], of every call, as it is appended."""
    from SPA_agent.generators import static_decode

    strides = []

    def forward(query, key, value, cu_q, cu_k, *args, **kwargs):
        strides.append(int(cu_k[1]))
        return emulated_flash_forward(query, key, value, cu_q, cu_k, *args, **kwargs)

    monkeypatch.setattr(static_decode, "uses_flash_decode", lambda query: True)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", forward)
    return strides


def test_kept_decode_states_sample_what_the_current_decoder_samples(varied_model, tiny_tokenizer,
                                                                     prompts_of_lengths):
    """generator.keep_decode_graphs: consecutive calls of new batch sizes and prompt lengths sample the tokens of
    the decoder that builds a state per call (padding rows never shift the random draws); one state per batch
    bucket over one KV buffer, until a longer call grows the buffer (keys at least doubled) and drops them."""
    from SPA_agent.generators.static_decode import BATCH_BUCKET, CAPACITY_GROWTH

    sampling = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=16, seed=3)
    current = hf(varied_model, tiny_tokenizer, sampling, "static", batch_size=None)
    kept = hf(varied_model, tiny_tokenizer, sampling, "static", batch_size=None, keep_decode_graphs=True)
    for lengths in KEPT_CALLS:
        prompts = prompts_of_lengths(lengths)
        assert ids(kept.generate(prompts)) == ids(current.generate(prompts))
    decoder = kept._static
    assert current._static.stats.states_built == len(KEPT_CALLS)  # a state (on GPU a graph) per call
    assert decoder.stats.states_built == 2 and sorted(decoder._states) == [BATCH_BUCKET, 2 * BATCH_BUCKET]
    storage = decoder._storage
    assert storage.rows == 2 * BATCH_BUCKET and all(state.cache.storage is storage for state in decoder._states.values())
    prompts = prompts_of_lengths([150, 3])
    assert ids(kept.generate(prompts)) == ids(current.generate(prompts))
    assert decoder._storage.max_len >= CAPACITY_GROWTH * storage.max_len and decoder._storage.rows == storage.rows
    assert decoder.stats.states_built == 3 and list(decoder._states) == [BATCH_BUCKET]


def test_kept_decode_states_follow_weights_updated_in_place(varied_model, tiny_tokenizer, prompts_of_lengths):
    """Weights copied in place (a PPO step's `copy_weights`) keep the states, whose CUDA graphs read them where they
    are; a weight replaced by a new tensor drops them. Either way the samples are the current decoder's."""
    model = copy.deepcopy(varied_model)
    sampling = SamplingParams(max_new_tokens=12, seed=5)
    kept = hf(model, tiny_tokenizer, sampling, "static", batch_size=None, keep_decode_graphs=True)
    current = hf(model, tiny_tokenizer, sampling, "static", batch_size=None)
    prompts = prompts_of_lengths([1, 12, 3])
    before = ids(kept.generate(prompts))
    assert before == ids(current.generate(prompts))
    copy_weights(model, fresh_weights(model, seed=1))
    after = ids(kept.generate(prompts))
    assert after != before and after == ids(current.generate(prompts))
    assert kept._static.stats.states_built == 1
    projection = model.model.layers[0].mlp.down_proj
    projection.weight = torch.nn.Parameter(projection.weight.detach().clone())
    assert ids(kept.generate(prompts)) == ids(current.generate(prompts))
    assert kept._static.stats.states_built == 2


def test_keep_decode_graphs_setting_is_read_and_checked(varied_model, tiny_tokenizer):
    from SPA_agent.config import compose
    from SPA_agent.generators.hf import HFGenerator
    from SPA_agent.trainer.config_checks import check_config

    cfg = {"decoder": "static", "progress": False, "keep_decode_graphs": True}
    assert HFGenerator.from_config(cfg, "tiny", tiny_tokenizer, model=varied_model).keep_decode_graphs
    assert not hf(varied_model, tiny_tokenizer, SamplingParams(), "static").keep_decode_graphs  # off by default
    check_config(compose("_2_sokoban", ["model=tiny", "generator.keep_decode_graphs=true"]))
    with pytest.raises(ValueError, match=r"generator.keep_decode_graphs must be one of \(True, False\), got 'yes'"):
        check_config(compose("_2_sokoban", ["model=tiny", "generator.keep_decode_graphs=yes"]))


@pytest.mark.parametrize("model, kept", [("smollm2-135m", True), ("tiny", False), ("qwen2.5-0.5b", False)])
def test_the_generator_keeps_decode_graphs_where_the_model_preset_says(model, kept):
    """The setting follows actor_rollout_ref.rollout.keep_decode_graphs, which SmolLM2's preset alone turns on; a
    command-line value of either key wins."""
    from SPA_agent.config import compose

    assert compose("_2_sokoban", [f"model={model}"]).generator.keep_decode_graphs is kept
    assert compose("_2_sokoban", [f"model={model}", f"actor_rollout_ref.rollout.keep_decode_graphs={not kept}"]
                   ).generator.keep_decode_graphs is (not kept)
    assert compose("_2_sokoban", [f"model={model}", f"generator.keep_decode_graphs={not kept}"]
                   ).generator.keep_decode_graphs is (not kept)


#: consecutive calls of the CPU tests of reads: the second is shorter than the buffer the first allocated and has
#: padding rows
READ_CALLS = [[40, 3, 12, 1], [5, 2, 9, 1, 20]]


@pytest.mark.parametrize("attention", ["masked", "flash_contract"])
def test_kept_padding_rows_never_reach_the_real_rows(varied_model, tiny_tokenizer, prompts_of_lengths, monkeypatch,
                                                     attention):
    """Whatever a kept state's padding rows hold (here NaN keys and values in every layer, and another fed token),
    the real rows decode the greedy tokens of the decoder without kept graphs: with the masked decode and with flash
    attention's variable-length contract at the buffer's row stride."""
    from SPA_agent.generators.static_decode import BATCH_BUCKET

    if attention == "flash_contract":
        emulate_flash(monkeypatch)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    kept = hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None, keep_decode_graphs=True)
    current = hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None)
    kept.generate(prompts_of_lengths(READ_CALLS[0]))  # the buffer and the state of BATCH_BUCKET rows
    decoder, prompts = kept._static, prompts_of_lengths(READ_CALLS[1])
    with torch.inference_mode():  # (the generator made them in inference mode)
        for keys, values in zip(decoder._storage.keys, decoder._storage.values):
            keys[len(prompts) :], values[len(prompts) :] = float("nan"), float("nan")
        decoder._states[BATCH_BUCKET].input_ids[len(prompts) :] = prompts[0].prompt_ids[-1]
    assert ids(kept.generate(prompts)) == ids(current.generate(prompts))


def test_kept_flash_decode_reads_each_row_at_the_buffers_row_stride(varied_model, tiny_tokenizer, prompts_of_lengths,
                                                                    monkeypatch):
    """flash_decode over a kept buffer (float32, the kernel emulated by its contract): every call, the second one
    shorter than the buffer, reads row b from b·L, L the buffer's keys a row, and gives generate's greedy tokens,
    each the argmax of a teacher-forced forward."""
    strides = emulate_flash(monkeypatch)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    kept = hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None, keep_decode_graphs=True)
    plain = hf(varied_model, tiny_tokenizer, greedy, "generate", batch_size=None)
    for lengths in READ_CALLS:
        prompts = prompts_of_lengths(lengths)
        generations = kept.generate(prompts)
        assert set(strides) == {kept._static._storage.max_len}
        strides.clear()
        assert finished(generations) == finished(plain.generate(prompts))
        assert greedy_deficit(varied_model, prompts, generations) == 0.0


def _read_another_rows_keys(monkeypatch):
    from SPA_agent.generators import static_decode

    real = static_decode.masked_decode
    monkeypatch.setattr(static_decode, "masked_decode", lambda query, key, value, kv_lengths, scaling=None: real(
        query, key.roll(1, 0), value.roll(1, 0), kv_lengths, scaling))


def _miss_the_newest_key(monkeypatch):
    from SPA_agent.generators import static_decode

    real = static_decode.masked_decode
    monkeypatch.setattr(static_decode, "masked_decode", lambda query, key, value, kv_lengths, scaling=None: real(
        query, key, value, (kv_lengths - 1).clamp(min=1), scaling))


def _row_stride_of_the_call(monkeypatch):
    """Flash attention's path with cu_seqlens_k at the call's own cache length instead of the buffer's (what a kept
    state must not do)."""
    from SPA_agent.generators import static_decode

    emulate_flash(monkeypatch)
    real = static_decode.StaticDecoder._state_for

    def state_for(self, batch, max_len):
        state = real(self, batch, max_len)
        lengths, cu_q, _, kernel = state.decode
        state.decode = (lengths, cu_q, torch.arange(state.shape[0] + 1, dtype=torch.int32) * max_len, kernel)
        return state

    monkeypatch.setattr(static_decode.StaticDecoder, "_state_for", state_for)


WRONG_READS = {"another_rows_keys": _read_another_rows_keys, "newest_key_missed": _miss_the_newest_key,
               "row_stride_of_the_call": _row_stride_of_the_call}


@pytest.mark.parametrize("wrong_read", list(WRONG_READS))
def test_greedy_check_rejects_decodes_that_read_wrong_keys(varied_model, tiny_tokenizer, prompts_of_lengths,
                                                           monkeypatch, wrong_read):
    """The float16 GPU test's greedy check cannot pass vacuously: a kept decoder (float32) reading another row's
    keys, missing each row's newest key, or reading rows at the call's cache length instead of the buffer's emits
    tokens further below the float32 argmax than any tolerance that test admits (2 × MAX_FLOAT16_ERROR)."""
    WRONG_READS[wrong_read](monkeypatch)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    kept = hf(varied_model, tiny_tokenizer, greedy, "static", batch_size=None, keep_decode_graphs=True)
    deficit = 0.0
    for lengths in READ_CALLS:
        prompts = prompts_of_lengths(lengths)
        deficit = max(deficit, greedy_deficit(varied_model, prompts, kept.generate(prompts)))
    assert deficit > 2 * MAX_FLOAT16_ERROR


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("attention", ["flash", "split_kv"], ids=["masked", "split_kv"])
def test_kept_cuda_graphs_decode_as_generate_in_float32_on_gpu(varied_model, tiny_tokenizer, prompts_of_lengths,
                                                               attention):
    """generator.keep_decode_graphs on a GPU in float32: consecutive calls of new batch sizes and lengths, then one
    after the weights were copied in place, replay CUDA graphs kept from the first calls (one per batch bucket, over
    one KV buffer) and give generate's greedy tokens, with the masked SDPA decode (float32's `flash` setting) or the
    Triton split-KV kernel (IEEE float32 products) reading each row at the buffer's row stride. The smallest gap
    between the top two float32 logits along KEPT_CALLS' greedy sequences is 0.003 (CPU), far above float32
    rounding."""
    from SPA_agent.generators import split_kv_decode

    if attention == "split_kv" and not split_kv_decode.available():
        pytest.skip("the split-KV kernel needs triton")
    model = copy.deepcopy(varied_model).to("cuda")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    kept = hf(model, tiny_tokenizer, greedy, "static", batch_size=None, keep_decode_graphs=True,
              decode_attention=attention)
    plain = hf(model, tiny_tokenizer, greedy, "generate", batch_size=None)
    for lengths in KEPT_CALLS:
        prompts = prompts_of_lengths(lengths)
        assert finished(kept.generate(prompts)) == finished(plain.generate(prompts))
    copy_weights(model, fresh_weights(varied_model, seed=1).to("cuda"))
    prompts = prompts_of_lengths(KEPT_CALLS[1])
    assert finished(kept.generate(prompts)) == finished(plain.generate(prompts))
    decoder = kept._static
    assert decoder.stats.states_built == 2 and all(state.graph is not None for state in decoder._states.values())
    assert decoder.last_capture_s == 0.0  # the last call replayed a kept graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("attention", ["flash", "split_kv"])
def test_kept_cuda_graphs_decode_greedily_in_float16_on_gpu(varied_model, tiny_tokenizer, prompts_of_lengths,
                                                            attention):
    """generator.keep_decode_graphs on a GPU in float16, flash attention's kernel or the Triton split-KV kernel
    reading each row at the buffer's row stride. generate's tokens are no yardstick here: float16 near-ties (in
    KEPT_CALLS, prompt of 10 repeats, token 7: 0.004 logits between the top two of the float32 copy) let kernels
    of equal accuracy pick different tokens. Instead:

    - a first call, then calls after others of other sizes, whose kept state has the shape the decoder without
      kept graphs builds (FULL_BUCKETS; the same kernels on the same shapes) give exactly that decoder's tokens,
      also after the weights were copied in place;
    - in KEPT_CALLS (padding rows; calls shorter than the buffer) every emitted token is the greedy token of the
      float32 copy of the float16 model, teacher-forced over the emitted sequence, within twice the float16 error
      of one forward on this GPU (`float16_error`; a wrong read is several logits off, tested on CPU);
    - one graph per batch bucket is captured and then replayed (no capture in the later calls)."""
    from SPA_agent.generators import split_kv_decode, static_decode

    if not static_decode._flash_capable(torch.device("cuda")):
        pytest.skip("flash attention needs an Ampere or newer GPU")
    if attention == "split_kv" and not split_kv_decode.available():
        pytest.skip("the split-KV kernel needs triton")
    model = copy.deepcopy(varied_model).to("cuda", torch.float16)
    reference = copy.deepcopy(model).float()  # the float16 weights, float32 arithmetic
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    kept = hf(model, tiny_tokenizer, greedy, "static", batch_size=None, keep_decode_graphs=True,
              decode_attention=attention)
    current = hf(model, tiny_tokenizer, greedy, "static", batch_size=None, decode_attention=attention)
    full = [prompts_of_lengths(lengths) for lengths in FULL_BUCKETS]
    assert finished(kept.generate(full[0])) == finished(current.generate(full[0]))  # the buffer, 32 rows
    deficit, error = 0.0, 0.0
    for lengths in KEPT_CALLS:
        prompts = prompts_of_lengths(lengths)
        generations = kept.generate(prompts)
        deficit = max(deficit, greedy_deficit(reference, prompts, generations))
        error = max(error, float16_error(model, reference, prompts, generations))
    assert error < MAX_FLOAT16_ERROR, f"float16 error {error:.4f}: a tolerance of twice that is too loose a check"
    assert deficit <= 2 * error, f"a token {deficit:.4f} logits below the float32 argmax (tolerance {2 * error:.4f})"
    for prompts in full:  # the states of 32 and 16 rows, kept from earlier calls
        assert finished(kept.generate(prompts)) == finished(current.generate(prompts))
        assert kept._static.last_capture_s == 0.0
    copy_weights(model, fresh_weights(varied_model, seed=1).to("cuda", torch.float16))
    assert finished(kept.generate(full[1])) == finished(current.generate(full[1]))
    decoder = kept._static
    assert decoder.stats.states_built == 2 and all(state.graph is not None for state in decoder._states.values())
    assert decoder.last_capture_s == 0.0
