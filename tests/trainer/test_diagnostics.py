"""RL-health diagnostics (issue 18): token spans, span entropies, distinct ratios, input dependence, the plot."""

from __future__ import annotations

import json
import math

import pytest
import torch

from SPA_agent.evaluation.plots import plot_diagnostics
from SPA_agent.generators.base import FINISH_STOP, Generation, Prompt
from SPA_agent.rollout.agent_proxy import LLMAgentProxy
from SPA_agent.rollout.chat_tokens import ChatTokenizer
from SPA_agent.rollout.turns import EnvRecord, Observation, Turn, as_entry, turns
from SPA_agent.trainer import input_dependence as dep
from SPA_agent.trainer.diagnostics import (
    Diagnostics,
    distinct_ratios,
    rollout_diagnostics,
    span_entropy_metrics,
    span_kl_metrics,
)
from SPA_agent.trainer.local_backend.backend import LocalBackend
from SPA_agent.trainer.token_spans import (
    ANSWER,
    OTHER,
    REASONING,
    SPANS,
    STATE,
    SpanLabeler,
    char_labels,
    token_decoder,
    turn_runs,
)

#: a world-model turn after the forced "<think>", as segments with the span each segment's tokens belong to
HAND_BUILT_TURN = [
    ("<observation>", OTHER), ("#P_\nX O", STATE), ("</observation>", OTHER), (" Push the box left.", REASONING),
    ("<prediction>", OTHER), ("#_P\nXO", STATE), ("</prediction>", OTHER), ("</think>", OTHER),
    ("<answer>", OTHER), ("Left || Up", ANSWER), ("</answer>", OTHER),
]


@pytest.mark.parametrize("tokenizer_name", ["tiny_tokenizer", "llama_tokenizer", "qwen3_tokenizer"])
def test_hand_built_turn_gets_exact_token_spans(request, tokenizer_name):
    """Each segment tokenized on its own, so the expected label of every token is known; end of turn is other.
    With the Qwen3-style tokenizer `</think>` is a single reserved token."""
    tokenizer = request.getfixturevalue(tokenizer_name)
    chat = ChatTokenizer(tokenizer)
    ids, expected = [], []
    for text, label in HAND_BUILT_TURN:
        piece = chat.encode(text)
        ids += piece
        expected += [label] * len(piece)
    ids.append(chat.stop_ids[0])
    expected.append(OTHER)
    labeler = SpanLabeler(token_decoder(tokenizer), "<think>", chat.stop_ids)
    assert labeler.turn(ids) == expected


def test_without_thinking_the_forced_answer_prefix_opens_the_answer(tiny_tokenizer):
    chat = ChatTokenizer(tiny_tokenizer)
    answer, closing, trailing = chat.encode("Left || Up"), chat.encode("</answer>"), chat.encode(" ok")
    labeler = SpanLabeler(token_decoder(tiny_tokenizer), "<answer>", chat.stop_ids)
    labels = labeler.turn(answer + closing + trailing + chat.stop_ids[:1])
    assert labels == [ANSWER] * len(answer) + [OTHER] * (len(closing) + len(trailing) + 1)


def test_char_labels_take_the_innermost_block_and_run_unclosed_blocks_to_the_end():
    text = "<think>12<observation>3</observation></answer>4<answer>5"
    labels = char_labels(text)
    by_char = {i: labels[text.index(ch)] for i, ch in enumerate("12345")}
    assert by_char == {0: REASONING, 1: REASONING, 2: STATE, 3: REASONING, 4: ANSWER}  # stray </answer> ignored
    assert labels[text.index("</answer>")] == OTHER and len(labels) == len(text)


def test_token_with_a_tag_and_spaces_glued_is_other_but_spaces_alone_follow_their_block():
    labeler = SpanLabeler(lambda i: {1: " <", 2: "answer", 3: ">", 4: "Up</", 5: " ", 6: "answer>"}[i], "<think>x</think>", [])
    assert labeler.turn([1, 2, 3, 5, 4, 6]) == [OTHER, OTHER, OTHER, ANSWER, ANSWER, OTHER]


class HandBuiltGenerator:
    """Answers every prompt with HAND_BUILT_TURN (the random generator leaves the state blocks empty)."""

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        return [Generation("".join(text for text, _ in HAND_BUILT_TURN), None, FINISH_STOP) for _ in prompts]


@pytest.fixture
def worldmodel_rollout(ppo_config, tiny_tokenizer):
    """A real two-turn Sokoban rollout of world-model turns and a local backend on the tiny model."""
    cfg = ppo_config("_2_sokoban", "ctx_manager.mode=add_worldmodel", "trainer.diagnostics.mi_samples=2")
    proxy = LLMAgentProxy(cfg, HandBuiltGenerator(), tiny_tokenizer)
    return cfg, proxy, proxy.rollout(val=False), LocalBackend(cfg, tiny_tokenizer)


def test_span_entropies_weighted_by_their_share_sum_to_the_whole_on_a_real_batch(worldmodel_rollout):
    cfg, proxy, rollout, backend = worldmodel_rollout
    batch = rollout.batch
    batch = batch.union(backend.compute_log_prob(batch))
    t = batch.batch
    diagnostics = Diagnostics.for_proxy(cfg, backend, proxy)
    labels = diagnostics.labeler.batch(t["input_ids"], t["response_mask"])
    # every assistant turn of every row is labelled on its own, behind its own forced prefix
    for row, state in enumerate(rollout.states):
        taken = turns(state.history)
        runs = turn_runs(t["response_mask"][row])
        assert len(runs) == len(taken) == 2
        for (start, end), turn in zip(runs, taken):
            assert labels[row, start:end].tolist() == diagnostics.labeler.turn(turn.response_ids)
    assert (labels[t["response_mask"] == 0] == OTHER).all()
    assert set(labels[t["response_mask"].bool()].tolist()) == {STATE, REASONING, ANSWER, OTHER}
    metrics = span_entropy_metrics(t["entropys"], t["response_mask"], labels)
    assert math.fsum(metrics[f"diag/token_share/{s}"] for s in SPANS) == pytest.approx(1.0, abs=1e-12)
    whole = math.fsum(metrics[f"diag/token_share/{s}"] * metrics[f"diag/entropy/{s}"] for s in SPANS)
    assert whole == pytest.approx(metrics["diag/entropy/all"], rel=1e-9)
    expected_all = t["entropys"][t["response_mask"].bool()].double().mean().item()
    assert metrics["diag/entropy/all"] == pytest.approx(expected_all, rel=1e-9)
    shifted = t["old_log_probs"] - 0.1 * labels.float()  # a reference that differs by span
    kl = span_kl_metrics(t["old_log_probs"], shifted, t["response_mask"], labels)
    assert kl["diag/kl_ref/state"] == 0.0 < kl["diag/kl_ref/reasoning"] < kl["diag/kl_ref/answer"] < kl["diag/kl_ref/other"]
    whole = math.fsum(metrics[f"diag/token_share/{s}"] * kl[f"diag/kl_ref/{s}"] for s in SPANS)
    assert whole == pytest.approx(kl["diag/kl_ref"], rel=1e-5)


def test_distinct_ratios_on_known_vectors():
    responses = ["a", "a", "b", "c", "a", "a", "a", "a"]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    assert distinct_ratios(responses, groups) == {"diag/distinct_in_group": (3 / 4 + 1 / 4) / 2,
                                                  "diag/distinct_batch": 3 / 8}


def test_rollout_diagnostics_count_format_valid_turns_and_distinct_trajectories():
    def state(group, *played):
        return EnvRecord(env_id=0, group_id=group, tag="SimpleSokoban", seed=0, penalty=0.0, metrics={}, history=[
            as_entry(Turn("#P", 10, ["Up"], 0.0, {}, "x", "x", {"format_ok": ok}, ids)) for ids, ok in played
        ] + [as_entry(Observation("#P", 8))])

    states = [state(0, ([1, 2], True), ([3], False)), state(0, ([1, 2], True), ([3], True)),
              state(1, ([1, 2], True), ([3], False))]
    metrics = rollout_diagnostics(states)
    assert metrics == {"diag/format_valid": 4 / 6, "diag/distinct_in_group": (1 / 2 + 1) / 2, "diag/distinct_batch": 1 / 3}


def test_kl_to_reference_is_zero_for_the_same_policy_and_positive_otherwise():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    labels = torch.tensor([[ANSWER, ANSWER, OTHER]])
    assert span_kl_metrics(old, old, mask, labels)["diag/kl_ref"] == 0.0
    assert span_kl_metrics(old, old - 0.5, mask, labels)["diag/kl_ref"] > 0.0


def test_span_kl_on_known_vectors_sums_to_the_whole_by_token_share():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.4], [0.3, 0.6, 0.8, 0.1]]))
    ref = torch.log(torch.tensor([[0.4, 0.2, 0.1, 0.5], [0.3, 0.9, 0.7, 0.2]]))
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    labels = torch.tensor([[STATE, ANSWER, ANSWER, STATE], [REASONING, ANSWER, STATE, OTHER]])
    ratio = ref.double() - old.double()  # k3 = exp(ref - old) - (ref - old) - 1 per position (float32 inside)
    k3 = ratio.exp() - ratio - 1
    metrics = span_kl_metrics(old, ref, mask, labels)
    assert metrics["diag/kl_ref/state"] == pytest.approx((k3[0, 0] + k3[0, 3] + k3[1, 2]).item() / 3, rel=1e-5)
    assert metrics["diag/kl_ref/answer"] == pytest.approx((k3[0, 1] + k3[1, 1]).item() / 2, rel=1e-5)
    assert metrics["diag/kl_ref/reasoning"] == pytest.approx(k3[1, 0].item(), rel=1e-5)
    assert "diag/kl_ref/other" not in metrics  # its only position is masked out
    trained = [k3[0, 0], k3[0, 1], k3[0, 3], k3[1, 0], k3[1, 1], k3[1, 2]]
    assert metrics["diag/kl_ref"] == pytest.approx(sum(trained).item() / 6, rel=1e-5)
    share = {"state": 3 / 6, "answer": 2 / 6, "reasoning": 1 / 6}
    whole = math.fsum(share[s] * metrics[f"diag/kl_ref/{s}"] for s in share)
    assert whole == pytest.approx(metrics["diag/kl_ref"], rel=1e-6)


def test_identification_metrics_on_constructed_score_matrices():
    uniform = torch.full((4, 4), -7.0)  # r_i scored the same under every prompt: input-independent
    assert dep.identification_metrics(uniform) == {"diag/mi/accuracy": 0.25, "diag/mi/chance": 0.25,
                                                   "diag/mi/estimate": 0.0}
    sharp = torch.full((4, 4), -1000.0).fill_diagonal_(-3.0)  # r_i possible only under its own prompt
    metrics = dep.identification_metrics(sharp)
    assert metrics["diag/mi/accuracy"] == 1.0 and metrics["diag/mi/estimate"] == pytest.approx(math.log(4))
    swapped = sharp[[1, 0, 2, 3]]  # rows 0, 1 identify the other's prompt
    assert dep.identification_metrics(swapped)["diag/mi/accuracy"] == 0.5


def test_sample_rows_takes_one_trajectory_per_group_without_touching_the_global_rng():
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    state = torch.random.get_rng_state()
    rows = dep.sample_rows(groups, 2, seed=5)
    assert len(rows) == 2 and set(rows) <= {0, 2, 4, 6} and rows == dep.sample_rows(groups, 2, seed=5)
    assert dep.sample_rows(groups, 8, seed=0) == [0, 2, 4, 6]
    assert torch.equal(torch.random.get_rng_state(), state)


def test_score_matrix_on_the_tiny_model(worldmodel_rollout):
    """Diagonal = the old-log-prob pass's log p(first reasoning | first prompt); identical prompts → chance, MI 0."""
    cfg, proxy, rollout, backend = worldmodel_rollout
    batch = rollout.batch.union(backend.compute_log_prob(rollout.batch))
    t = batch.batch
    diagnostics = Diagnostics.for_proxy(cfg, backend, proxy)
    labels = diagnostics.labeler.batch(t["input_ids"], t["response_mask"])
    rows = dep.sample_rows(rollout.batch.non_tensor_batch["group_ids"], 2, seed=0)
    prompts, reasonings, expected = [], [], []
    for row in rows:
        prompt, reasoning = dep.first_turn(t["input_ids"][row], t["attention_mask"][row], t["response_mask"][row],
                                           labels[row])
        start = turn_runs(t["response_mask"][row])[0][0]
        assert t["input_ids"][row, start + 1:start + 1 + len(reasoning)].tolist() == reasoning
        assert labels[row, start + len(reasoning) - 1] in (STATE, REASONING)  # cut at the end of the reasoning
        prompts.append(prompt)
        reasonings.append(reasoning)
        expected.append(t["old_log_probs"][row, start:start + len(reasoning)].sum())
    scores = dep.score_matrix(backend, prompts, reasonings, diagnostics.pad_id)
    torch.testing.assert_close(scores.diagonal(), torch.stack(expected), rtol=1e-4, atol=1e-4)
    same = dep.identification_metrics(dep.score_matrix(backend, [prompts[0]] * 2, reasonings, diagnostics.pad_id))
    assert same["diag/mi/accuracy"] == 0.5 and same["diag/mi/estimate"] == pytest.approx(0.0, abs=1e-4)
    assert set(diagnostics.input_dependence(rollout.batch, step=1)) == {
        "diag/mi/accuracy", "diag/mi/chance", "diag/mi/estimate"}


def test_diagnostics_plot_is_written(tmp_path):
    records = [{"step": s, "diag/entropy/all": 1.0 / s, "diag/entropy/state": 0.5, "diag/mi/accuracy": 0.5,
                "train/diag/distinct_in_group": 1.0, "val-env/diag/format_valid": "nan"} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    png = plot_diagnostics(tmp_path)
    assert png == tmp_path / "diagnostics.png" and png.read_bytes()[:4] == b"\x89PNG"


class TruthfulWorldModelGenerator:
    """Answers Left, with an observation and a prediction that are the env's true states before and after it (the
    proxy hands it a copy of the env, as it does the solver)."""

    needs_env = True

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        generations = []
        for prompt in prompts:
            before = prompt.env.render()
            after, *_ = prompt.env.step("Left")
            text = (f"<observation>{before}</observation> Push left.<prediction>{after}</prediction></think>"
                    "<answer>Left</answer>")
            generations.append(Generation(text, None, FINISH_STOP))
        return generations


@pytest.mark.parametrize("mode", ["add_worldmodel", "base"])
def test_validation_logs_the_world_models_accuracy_in_add_worldmodel_prompts(ppo_config, tiny_tokenizer, mode):
    """PPO's validation scores the model's states against the true ones in add_worldmodel prompts (a run cut short
    keeps them at its last validation): a generator that writes the true states scores 1 on every turn, averaged
    over both validation repeats; in base prompts there are no states to score."""
    from SPA_agent.trainer.ppo_trainer import PPOTrainer

    cfg = ppo_config("_2_sokoban", f"ctx_manager.mode={mode}", "trainer.validation_steps=2")
    proxy = LLMAgentProxy(cfg, TruthfulWorldModelGenerator(), tiny_tokenizer)
    metrics = PPOTrainer(cfg, backend=None, proxy=proxy, logger=None).validate()
    worldmodel = {k: v for k, v in metrics.items() if "/worldmodel/" in k}
    if mode == "base":
        assert not worldmodel and "val-env/SimpleSokoban/success" in metrics
        return
    prefix = "val-env/SimpleSokoban/worldmodel/"
    assert worldmodel == {prefix + key: 1.0 for key in (
        "format_rate", "observation_exact", "observation_cell", "observation_coords", "prediction_exact",
        "prediction_cell", "prediction_coords")}
