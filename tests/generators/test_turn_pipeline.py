"""Pipelined turns (turn_pipeline.py): each row's next turn starts while the other rows decode, with the samples of
the turn-by-turn loop."""

from __future__ import annotations

import pytest
import torch

from SPA_agent.generators.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from SPA_agent.generators.hf import cut_at_stop, end_of_turn_ids, left_pad, pad_token_id
from SPA_agent.generators.static_decode import StaticDecoder
from SPA_agent.generators.turn_pipeline import PipelinedDecoder

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
TURNS = [3, 1, 4, 2, 3, 1]  # turns each row's "env" lasts


class ToyEnvs:
    """Row r lasts TURNS[r] turns; its next prompt is its last prompt, the turn's sampled ids up to the end of
    turn, and an observation naming the row and turn (so histories grow and differ, as a rollout's do)."""

    def __init__(self, tokenizer, stop_ids: list[int]):
        self.tokenizer, self.stop_ids = tokenizer, set(stop_ids)
        self.prompts = [tokenizer.encode(f"Row {r}: the room is " + "#_P" * (3 * r + 1)) for r in range(len(TURNS))]
        self.turns: list[list[tuple[list[int], str]]] = [[] for _ in TURNS]

    def respond(self, row: int, sampled: list[int]) -> list[int] | None:
        ids, reason = cut_at_stop(sampled, self.stop_ids)
        self.turns[row].append((ids, reason))
        if len(self.turns[row]) == TURNS[row]:
            return None
        self.prompts[row] = self.prompts[row] + ids + self.tokenizer.encode(f" obs {row}.{len(self.turns[row])}:")
        return self.prompts[row]


def turn_by_turn(model, tokenizer, params: SamplingParams) -> tuple[ToyEnvs, int]:
    """The reference: one StaticDecoder.generate call a turn over the rows still running (LLMAgentProxy's loop);
    and its decode steps."""
    stop_ids = end_of_turn_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, stop_ids)
    decoder, envs = StaticDecoder(model, stop_ids, pad_id), ToyEnvs(tokenizer, stop_ids)
    running = list(range(len(TURNS)))
    generator = torch.Generator().manual_seed(0)
    while running:
        input_ids, mask = left_pad([envs.prompts[r] for r in running], pad_id, decoder.device)
        sampled = decoder.generate(input_ids, mask, params, generator).tolist()
        running = [r for r, ids in zip(running, sampled) if envs.respond(r, ids) is not None]
    return envs, decoder.stats.decode_steps


def pipelined(model, tokenizer, params: SamplingParams, seed: int = 0) -> tuple[ToyEnvs, PipelinedDecoder]:
    stop_ids = end_of_turn_ids(model, tokenizer)
    decoder, envs = PipelinedDecoder(model, stop_ids, pad_token_id(tokenizer, stop_ids)), ToyEnvs(tokenizer, stop_ids)
    decoder.serve(list(envs.prompts), params, torch.Generator().manual_seed(seed), envs.respond)
    return envs, decoder


def test_greedy_pipelined_turns_equal_the_turn_by_turn_loop(varied_model, tiny_tokenizer):
    """Every row's every turn has the turn-by-turn loop's tokens and finish reason, though rows start their turns
    at different steps: turns that stop early and turns cut at the cap, rows of 1-4 turns, a buffer that grows.
    And the point of it: a row's turns follow each other, so the loop runs fewer decode steps than the
    turn-by-turn loop's, which decodes each turn until its longest sample ends."""
    with torch.inference_mode():
        reference, reference_steps = turn_by_turn(varied_model, tiny_tokenizer, GREEDY)
        envs, decoder = pipelined(varied_model, tiny_tokenizer, GREEDY)
    assert envs.turns == reference.turns
    assert [len(turns) for turns in envs.turns] == TURNS
    reasons = {reason for turns in envs.turns for _, reason in turns}
    assert reasons == {FINISH_STOP, FINISH_LENGTH}  # both ways a turn ends are covered
    assert decoder.stats.states_built >= 2  # later prompts outgrew the first buffer: its contents moved over
    assert decoder.stats.decode_steps < reference_steps


def test_sampled_pipelined_turns_are_seeded(varied_model, tiny_tokenizer):
    """Sampling draws from the generator passed in: the same seed gives the same rollout, another seed another."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    with torch.inference_mode():
        first, second, other = (pipelined(varied_model, tiny_tokenizer, params, seed)[0].turns for seed in (0, 0, 1))
    assert first == second and first != other
    assert [len(turns) for turns in first] == TURNS


def test_an_empty_prompt_is_refused(varied_model, tiny_tokenizer):
    stop_ids = end_of_turn_ids(varied_model, tiny_tokenizer)
    decoder = PipelinedDecoder(varied_model, stop_ids, pad_token_id(tiny_tokenizer, stop_ids))
    with pytest.raises(ValueError, match="no token ids"):
        decoder.serve([[1, 2], []], GREEDY, torch.Generator(), lambda row, ids: None)


@pytest.mark.slow
def test_a_pipelined_rollout_is_the_turn_by_turn_rollout(varied_model, tiny_tokenizer, tiny_config):
    """LLMAgentProxy with agent_proxy.pipeline_turns: greedy, the same Sokoban rollout (SPA's add_worldmodel
    prompts) as turn by turn: every turn's response, every env step, the training batch's tensors and the
    metrics; among the turns, some that stopped and some cut at the cap."""
    from SPA_agent.generators.hf import HFGenerator
    from SPA_agent.rollout.agent_proxy import LLMAgentProxy

    rollouts = []
    for pipeline in (False, True):
        cfg = tiny_config("_2_sokoban", "ctx_manager.mode=add_worldmodel", "agent_proxy.max_turn=2",
                          f"agent_proxy.pipeline_turns={pipeline}")
        generator = HFGenerator(varied_model, tiny_tokenizer, GREEDY, batch_size=None, decoder="static",
                                progress=False, decode_attention="flash")
        proxy = LLMAgentProxy(cfg, generator, tiny_tokenizer)
        assert proxy.pipeline_turns == pipeline
        with torch.inference_mode():
            rollouts.append(proxy.rollout(val=False))
    turn_by_turn_rollout, pipelined_rollout = rollouts
    assert [s.history for s in pipelined_rollout.states] == [s.history for s in turn_by_turn_rollout.states]
    assert pipelined_rollout.batch.batch.keys() == turn_by_turn_rollout.batch.batch.keys()
    for key, tensor in turn_by_turn_rollout.batch.batch.items():
        assert torch.equal(pipelined_rollout.batch.batch[key], tensor), key
    assert pipelined_rollout.metrics == turn_by_turn_rollout.metrics
    stop_ids = set(end_of_turn_ids(varied_model, tiny_tokenizer))
    stopped = [entry["response_ids"][-1] in stop_ids for s in pipelined_rollout.states for entry in s.history
               if "response_ids" in entry]
    assert len(stopped) == 2 * len(pipelined_rollout.states) and any(stopped) and not all(stopped)


def test_pipelining_falls_back_to_turn_by_turn_where_the_generator_cannot(tiny_config, tiny_tokenizer, tiny_dir):
    """agent_proxy.pipeline_turns with a generator without `serve` (random; hf with transformers' generate) runs
    turn by turn; a value other than true/false is refused."""
    from SPA_agent.generators import build_generator
    from SPA_agent.rollout.agent_proxy import LLMAgentProxy

    cfg = tiny_config("_2_sokoban", "generator=random", "agent_proxy.pipeline_turns=true")
    assert not LLMAgentProxy(cfg, build_generator(cfg.generator, str(tiny_dir), tiny_tokenizer),
                             tiny_tokenizer).pipeline_turns
    cfg = tiny_config("_2_sokoban", "agent_proxy.pipeline_turns=yes")
    with pytest.raises(ValueError, match="pipeline_turns must be true or false"):
        LLMAgentProxy(cfg, build_generator(cfg.generator, str(tiny_dir), tiny_tokenizer), tiny_tokenizer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_pipelined_turns_on_a_gpu(varied_model, tiny_tokenizer):
    """On a GPU, every decode step a replay of one captured CUDA graph (captured again when the buffer grows):
    in float32 (masked SDPA decode) the turn-by-turn loop's greedy tokens exactly; in float16 with the split-KV and
    flash kernels every row's turns run to their end (float16 near-ties make exact equality with another batch
    composition unreliable)."""
    import copy

    model = copy.deepcopy(varied_model).to("cuda", torch.float32)
    with torch.inference_mode():
        reference, reference_steps = turn_by_turn(model, tiny_tokenizer, GREEDY)
        envs, decoder = pipelined(model, tiny_tokenizer, GREEDY)
    assert envs.turns == reference.turns and decoder.stats.decode_steps < reference_steps
    assert decoder.stats.states_built >= 2 and decoder.stats.capture_s > 0
    half = copy.deepcopy(varied_model).to("cuda", torch.float16)
    stop_ids = end_of_turn_ids(half, tiny_tokenizer)
    for attention in ("split_kv", "flash"):
        envs = ToyEnvs(tiny_tokenizer, stop_ids)
        decoder = PipelinedDecoder(half, stop_ids, pad_token_id(tiny_tokenizer, stop_ids), attention=attention)
        with torch.inference_mode():
            decoder.serve(list(envs.prompts), GREEDY, torch.Generator("cuda").manual_seed(0), envs.respond)
        assert [len(turns) for turns in envs.turns] == TURNS
        assert all(0 < len(ids) <= GREEDY.max_new_tokens for turns in envs.turns for ids, _ in turns)
