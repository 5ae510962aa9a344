"""The verl config translation on 4 and 8 GPUs (issue 46), on this CPU machine: the paper's batch (_2_sokoban: 64
trajectories a step) with the Qwen2.5 0.5B, 1.5B and 3B shapes on 80 GB GPUs. No Ray cluster, no weights: each
shape is a config.json beside the tiny tokenizer (the `auto` settings count its parameters on the meta device) and the driver's GPU is
patched in (`verl_config._gpu_bytes`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from transformers import Qwen2Config

from SPA_agent.trainer.verl_backend import config as vc

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
QWEN_VOCAB = 151936
#: Qwen2Config keyword arguments of the Qwen2.5 instruct models (their config.json files)
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2),
}
PRESETS = {"0.5b": "qwen2.5-0.5b", "1.5b": "qwen2.5-1.5b", "3b": "qwen2.5-3b"}


@pytest.fixture(scope="module")
def shape_dirs(tmp_path_factory):
    from transformers import AutoTokenizer

    from SPA_agent.tiny import tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())  # verl's model config loads one (as the benchmark)
    dirs = {}
    for name, shape in SHAPES.items():
        dirs[name] = tmp_path_factory.mktemp(f"qwen{name}")
        Qwen2Config(**shape, vocab_size=QWEN_VOCAB, tie_word_embeddings=True,
                    architectures=["Qwen2ForCausalLM"]).save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    return dirs


def translate(monkeypatch, shape_dirs, shape: str, gpus: int, nodes: int = 1, *overrides: str):
    """(our config, verl's) of the paper's Sokoban run of `shape` on `nodes` × `gpus` 80 GiB GPUs."""
    from SPA_agent.config import compose

    monkeypatch.setattr(vc, "_gpu_bytes", lambda: 80 * GIB)
    cfg = compose("_2_sokoban", [f"model={PRESETS[shape]}", f"model_path={shape_dirs[shape]}", "trainer.backend=verl",
                                 f"trainer.n_gpus_per_node={gpus}", f"trainer.nnodes={nodes}", *overrides])
    return cfg, vc.build_verl_config(cfg)


def rollout_engines(verl_cfg) -> int:
    """verl's count of rollout replicas in hybrid mode (LLMServerManager: worker-group world size over the GPUs of
    one replica)."""
    rollout = verl_cfg.actor_rollout_ref.rollout
    world = verl_cfg.trainer.n_gpus_per_node * verl_cfg.trainer.nnodes
    return world // (rollout.tensor_model_parallel_size * rollout.data_parallel_size
                     * rollout.pipeline_model_parallel_size)


# shape, GPUs per node, nodes → engines, rollout TP, engine kept resident while training (free_cache_engine False)
@pytest.mark.parametrize("shape, gpus, nodes, engines, resident", [
    ("0.5b", 4, 1, 4, True), ("0.5b", 8, 1, 8, True),
    ("1.5b", 4, 1, 4, True), ("1.5b", 8, 1, 8, True), ("1.5b", 4, 2, 8, True),
    # 3B: actor + critic with Adam (16 bytes a parameter each) + bf16 reference = 105 GB, 26 GB a GPU on four:
    # more than half of the 32 GiB the engine leaves, so the engine sleeps while training; 13 GB on eight
    ("3b", 4, 1, 4, False), ("3b", 8, 1, 8, True),
])
def test_one_engine_per_gpu_and_fsdp_over_all_of_them(monkeypatch, shape_dirs, shape, gpus, nodes, engines, resident):
    cfg, verl_cfg = translate(monkeypatch, shape_dirs, shape, gpus, nodes)
    world = gpus * nodes
    rollout = verl_cfg.actor_rollout_ref.rollout
    # every shape's bf16 weights (1 to 6 GB) fit half of a 0.6 share of 80 GiB: TP 1, data-parallel engines
    assert rollout.tensor_model_parallel_size == 1 and rollout.data_parallel_size == 1
    assert rollout_engines(verl_cfg) == engines == world
    assert rollout.free_cache_engine is not resident
    assert (verl_cfg.trainer.n_gpus_per_node, verl_cfg.trainer.nnodes) == (gpus, nodes)
    # actor, reference and critic: one FSDP group over every GPU (fsdp_size -1), no sequence parallelism, so each
    # model's data-parallel size is the GPU count
    for fsdp, sp in ((verl_cfg.actor_rollout_ref.actor.fsdp_config, verl_cfg.actor_rollout_ref.actor),
                     (verl_cfg.actor_rollout_ref.ref.fsdp_config, verl_cfg.actor_rollout_ref.ref),
                     (verl_cfg.critic.fsdp, verl_cfg.critic)):  # the critic's engine config
        assert fsdp.fsdp_size == -1 and sp.ulysses_sequence_parallel_size == 1
    vc.check_verl_config(cfg, verl_cfg)


@pytest.mark.parametrize("gpus, nodes, per_gpu", [(1, 1, 64), (2, 1, 32), (4, 1, 16), (8, 1, 8), (4, 2, 8)])
def test_the_paper_batch_splits_evenly_over_the_gpus(monkeypatch, shape_dirs, gpus, nodes, per_gpu):
    """64 trajectories (32 groups × 8, a quarter of the groups kept), one mini-batch a step: verl's
    train_mini_batch gives each rank mini_batch_size // data-parallel size of them; the micro-batches inside are cut
    by the per-GPU token budgets, whatever the GPU count."""
    cfg, verl_cfg = translate(monkeypatch, shape_dirs, "1.5b", gpus, nodes)
    assert verl_cfg.data.train_batch_size == vc.filtered_batch_size(cfg) == 64
    actor, critic = verl_cfg.actor_rollout_ref.actor, verl_cfg.critic
    for role in (actor, critic):
        assert role.ppo_mini_batch_size == 64 and role.ppo_mini_batch_size // (gpus * nodes) == per_gpu
        assert role.use_dynamic_bsz is True
    budgets = (actor.ppo_max_token_len_per_gpu, verl_cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu,
               verl_cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu, critic.ppo_max_token_len_per_gpu,
               critic.ppo_infer_max_token_len_per_gpu)
    assert budgets == (16384, 32768, 32768, 16384, 32768)
    # a whole trajectory (at most max_model_len = 3600 tokens) fits every budget
    assert min(budgets) >= verl_cfg.actor_rollout_ref.rollout.max_model_len
    vc.check_verl_config(cfg, verl_cfg)


@pytest.mark.parametrize("gpus, nodes", [(3, 1), (6, 1), (3, 2), (5, 1)])
def test_a_gpu_count_the_batch_cannot_divide_is_one_line_naming_the_keys(monkeypatch, shape_dirs, gpus, nodes):
    from SPA_agent.trainer.config_checks import check_config

    cfg, verl_cfg = translate(monkeypatch, shape_dirs, "1.5b", gpus, nodes)
    world = gpus * nodes
    with pytest.raises(ValueError) as before_start:  # what the entry point checks before loading anything
        check_config(cfg)
    message = str(before_start.value)
    assert "\n" not in message
    assert message.startswith(f"actor_rollout_ref.actor.ppo_mini_batch_size (64) must be a multiple of the {world} GPUs")
    assert "trainer.n_gpus_per_node" in message and "trainer.nnodes" in message
    with pytest.raises(ValueError, match=f"ppo_mini_batch_size \\(64\\) must be a multiple of the {world} GPUs"):
        vc.check_verl_config(cfg, verl_cfg)


def test_a_batch_of_the_gpu_count_passes_with_six_gpus(monkeypatch, shape_dirs):
    # 48 = 6 × 8 trajectories: 6 groups kept of 24
    from SPA_agent.trainer.config_checks import check_config

    cfg, verl_cfg = translate(monkeypatch, shape_dirs, "1.5b", 6, 1, "es_manager.train.env_groups=24",
                              "es_manager.train.env_configs.n_groups=[24]", "ppo_mini_batch_size=48")
    check_config(cfg)
    vc.check_verl_config(cfg, verl_cfg)
    assert verl_cfg.data.train_batch_size == 48 and rollout_engines(verl_cfg) == 6


def test_manual_tensor_parallel_on_eight_gpus_gives_fewer_engines(monkeypatch, shape_dirs):
    cfg, verl_cfg = translate(monkeypatch, shape_dirs, "1.5b", 8, 1,
                              "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert verl_cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2 and rollout_engines(verl_cfg) == 4
    vc.check_verl_config(cfg, verl_cfg)


def test_sticky_routing_spreads_the_groups_evenly_over_four_and_eight_engines():
    """verl's load balancer (sticky by routing key, least-loaded for a new key) with our key, one per group: the 8
    trajectories of a group share an engine (and its prefix cache), and the 32 groups of a step spread evenly."""
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    from SPA_agent.trainer.verl_backend.backend import conversation_key

    class Prompt:
        def __init__(self, group: int):
            self.messages = [{"role": "system", "content": "play"}, {"role": "user", "content": f"state {group}"}]

    for engines in (4, 8):
        balancer = GlobalRequestLoadBalancer({f"server{i}": object() for i in range(engines)})
        placed: dict[int, set[str]] = {}
        for group in range(32):
            for _ in range(8):
                server, _ = balancer.acquire_server(conversation_key(Prompt(group)))
                placed.setdefault(group, set()).add(server)
        assert all(len(servers) == 1 for servers in placed.values())
        per_engine = [sum(servers == {f"server{i}"} for servers in placed.values()) for i in range(engines)]
        assert per_engine == [32 // engines] * engines


@pytest.mark.parametrize("env, message", [
    ({"VERL_GPUS": "0"}, "VERL_GPUS takes a number of GPUs ≥ 1"),
    ({"VERL_GPUS": "four"}, "VERL_GPUS takes a number of GPUs ≥ 1"),
])
def test_backend_speed_checks_verl_gpus_and_shape_in_one_line(env, message):
    args = ("/nonexistent/out", "4", "1.5b")
    result = subprocess.run(["bash", str(REPO / "benchmarks/backend_speed.sh"), *args], capture_output=True,
                            text=True, check=False, env={"PATH": "/usr/bin:/bin", **env}, timeout=30)
    assert result.returncode == 2 and result.stderr == f"error: {message}" + result.stderr.split(message)[1]
    assert len(result.stderr.splitlines()) == 1 and not result.stdout


def test_backend_speed_refuses_an_unknown_shape_in_one_line():
    result = subprocess.run(["bash", str(REPO / "benchmarks/backend_speed.sh"), "/nonexistent/out", "4", "7b"],
                            capture_output=True, text=True, check=False, timeout=30)
    assert result.returncode == 2 and result.stderr == "error: SHAPE takes 0.5b or 1.5b, got '7b'\n"


def test_ppo_refuses_three_gpus_in_one_line_before_loading_models(monkeypatch, capsys, tmp_path):
    import sys

    from SPA_agent.trainer import main_ppo

    def must_not_run(*args, **kwargs):
        raise AssertionError("the models were loaded despite the GPU count")

    monkeypatch.setattr(main_ppo, "load_backend", must_not_run)
    monkeypatch.setattr(sys, "argv", ["main_ppo", "--config-name", "_2_sokoban", "model=tiny", "trainer.backend=verl",
                                      "trainer.n_gpus_per_node=3", f"trainer.default_local_dir={tmp_path / 'ppo'}"])
    with pytest.raises(SystemExit) as exit_info:
        main_ppo.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: actor_rollout_ref.actor.ppo_mini_batch_size (4) must be a multiple of the 3 GPUs")
