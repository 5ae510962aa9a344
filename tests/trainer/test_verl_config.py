"""Our Hydra config → verl's worker config: values land where verl's typed configs read them."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass

from SPA_agent.model_presets import resolve_model_path
from SPA_agent.trainer.packing import PACKED_ATTENTION
from SPA_agent.trainer.verl_backend import config as vc

OVERRIDES = (
    "trainer.backend=verl", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.35", "actor_rollout_ref.actor.optim.lr=3e-6",
    "critic.optim.lr=2e-5", "actor_rollout_ref.actor.grad_clip=0.7", "verl_backend.rollout_name=sglang",
)


@pytest.fixture(scope="module")
def configs():
    from SPA_agent.config import compose

    cfg = compose("_2_sokoban", ["model=tiny", *OVERRIDES])
    return cfg, vc.build_verl_config(cfg)


def test_every_copied_key_lands_at_its_verl_path(configs):
    cfg, verl_cfg = configs
    for ours, theirs in vc.COPIED:
        assert OmegaConf.select(verl_cfg, theirs) == OmegaConf.select(cfg, ours), (ours, theirs)


def test_typed_actor_config_reads_our_values(configs):
    cfg, verl_cfg = configs
    actor = omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.actor)
    ours = cfg.actor_rollout_ref.actor
    assert type(actor).__name__ == "FSDPActorConfig"
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.28, 3.0)
    assert actor.loss_agg_mode == ours.loss_agg_mode and actor.entropy_coeff == ours.entropy_coeff
    assert actor.ppo_mini_batch_size == ours.ppo_mini_batch_size == 4
    assert actor.optim.lr == 3e-6 and actor.optim.clip_grad == 0.7 and list(actor.optim.betas) == [0.9, 0.999]
    assert actor.optim.total_training_steps == cfg.trainer.total_training_steps
    assert "hf_model" in actor.checkpoint.save_contents


def test_typed_critic_and_rollout_configs_read_our_values(configs):
    cfg, verl_cfg = configs
    critic = omega_conf_to_dataclass(verl_cfg.critic)
    assert critic.optim.lr == 2e-5 and critic.cliprange_value == cfg.critic.cliprange_value
    assert critic.ppo_micro_batch_size_per_gpu == cfg.critic.ppo_micro_batch_size_per_gpu
    rollout = omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.rollout)
    assert rollout.name == "sglang" and rollout.tensor_model_parallel_size == 2
    assert rollout.gpu_memory_utilization == 0.35
    assert rollout.response_length == cfg.actor_rollout_ref.rollout.response_length == 256
    assert rollout.max_model_len == rollout.prompt_length == cfg.actor_rollout_ref.rollout.max_model_len
    assert not rollout.calculate_log_probs and rollout.n == 1


def test_model_paths_resolve_and_verl_loads_the_model_config(configs):
    _, verl_cfg = configs
    path = resolve_model_path("tiny")
    assert verl_cfg.actor_rollout_ref.model.path == verl_cfg.critic.model.path == path
    model = omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.model)  # what each worker does in init_model
    assert model.hf_config.model_type == "qwen2" and model.tokenizer.eos_token == "<|im_end|>"


def test_lora_settings_reach_verls_actor_and_critic_model_configs():
    """The same keys drive both backends; a LoRA actor syncs merged weights to the engine."""
    from SPA_agent.config import compose

    lora = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
            "actor_rollout_ref.model.target_modules=[q_proj,v_proj]", "critic.model.lora_rank=4")
    verl_cfg = vc.build_verl_config(compose("_2_sokoban", ["model=tiny", *OVERRIDES, *lora]))
    actor = omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.model)
    assert (actor.lora_rank, actor.lora_alpha, list(actor.target_modules)) == (8, 32, ["q_proj", "v_proj"])
    assert verl_cfg.actor_rollout_ref.model.lora.merge is True
    critic = omega_conf_to_dataclass(verl_cfg.critic)
    assert (critic.model.lora_rank, critic.model.lora_alpha, critic.model.target_modules) == (4, 16, "all-linear")


def test_workers_see_the_filtered_batch(configs):
    cfg, verl_cfg = configs
    # model=tiny: 4 groups × 2, filter ratio 0.5 -> 2 groups -> 4 trajectories
    assert verl_cfg.data.train_batch_size == vc.filtered_batch_size(cfg) == 4
    vc.check_verl_config(cfg, verl_cfg)


def test_token_budgets_reach_every_verl_pass(configs):
    # issue 28: the local backend's micro-batching by token budget (base.yaml: on) now drives verl's workers too
    cfg, verl_cfg = configs
    ours = cfg.actor_rollout_ref
    assert ours.actor.use_dynamic_bsz is True
    actor = omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.actor)
    assert actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu == ours.actor.ppo_max_token_len_per_gpu
    rollout, ref = verl_cfg.actor_rollout_ref.rollout, verl_cfg.actor_rollout_ref.ref
    for verl_pass, our_pass in ((rollout, ours.rollout), (ref, ours.ref)):  # old and reference log-probs
        assert verl_pass.log_prob_use_dynamic_bsz is True
        assert verl_pass.log_prob_max_token_len_per_gpu == our_pass.log_prob_max_token_len_per_gpu
    critic = omega_conf_to_dataclass(verl_cfg.critic)
    assert critic.use_dynamic_bsz and critic.ppo_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu
    assert critic.ppo_infer_max_token_len_per_gpu == cfg.critic.forward_max_token_len_per_gpu


@pytest.mark.parametrize("dynamic", [True, False])
def test_critic_engine_follows_the_critic_micro_batching(dynamic):
    # verl's own trainer leaves the value model's engine at its default (token budgets) whatever the critic asks
    from SPA_agent.config import compose
    from SPA_agent.trainer.verl_backend.backend import _critic_worker_config

    cfg = compose("_2_sokoban", ["model=tiny", *OVERRIDES, f"use_dynamic_bsz={dynamic}", "micro_batch_size_per_gpu=2",
                                 "ppo_max_token_len_per_gpu=4096", "log_prob_max_token_len_per_gpu=8192"])
    engine = _critic_worker_config(omega_conf_to_dataclass(vc.build_verl_config(cfg).critic)).engine_config
    assert engine.use_dynamic_bsz is dynamic
    assert (engine.max_token_len_per_gpu, engine.infer_max_token_len_per_gpu) == (4096, 8192)
    assert engine.micro_batch_size_per_gpu == engine.infer_micro_batch_size_per_gpu == 2


GIB = 1 << 30


@pytest.mark.parametrize("weights_gib, gpus, heads, tp", [
    (1, 2, 14, 1),      # 0.5B in bf16: one engine per GPU (data-parallel replicas)
    (1, 8, 14, 1),
    (30, 4, 28, 2),     # 15B: 30 GiB > 20 GiB (half of 0.5 × 80 GiB), 15 GiB per GPU on two
    (145, 8, 64, 8),    # 72B: 18 GiB per GPU on eight
    (145, 4, 64, 4),    # too large for every split: the widest one, vLLM then reports the memory
    (30, 4, 14, 2),     # 14 heads: 4 GPUs do not split them, 2 do
])
def test_auto_rollout_tensor_parallel_by_model_size(weights_gib, gpus, heads, tp):
    assert vc.rollout_tensor_parallel("auto", weight_bytes=weights_gib * GIB, gpu_bytes=80 * GIB, memory_share=0.5,
                                      gpus=gpus, attention_heads=heads) == tp


def test_rollout_tensor_parallel_keeps_a_number_and_needs_a_gpu_for_auto():
    sizes = dict(weight_bytes=145 * GIB, memory_share=0.5, gpus=8, attention_heads=64)
    assert vc.rollout_tensor_parallel(4, gpu_bytes=80 * GIB, **sizes) == 4
    assert vc.rollout_tensor_parallel("auto", gpu_bytes=None, **sizes) == 1


@pytest.mark.parametrize("billions, gpus, gpu_gib, has_ref, free", [
    # a 0.5 share of 80 GiB leaves 40 GiB, half of it (21.5 GB) for the trained models' states
    (0.5, 2, 80, True, False),   # 0.5B: (16 + 16 + 2) bytes × 0.5e9 / 2 GPUs = 8.5 GB
    (1.5, 2, 80, True, True),    # 25.5 GB
    (1.5, 4, 80, True, False),   # 12.75 GB per GPU on four
    (1.5, 2, 141, True, False),  # 25.5 GB against 37.8 GB on H200s
    (7.6, 8, 80, True, True),    # 7B: 32.3 GB per GPU on eight
    (1.3, 2, 80, False, False),  # 20.8 GB without a reference
    (1.3, 2, 80, True, True),    # 22.1 GB with its bfloat16 copy
])
def test_auto_free_cache_engine_keeps_the_engine_when_training_fits_beside_it(billions, gpus, gpu_gib, has_ref, free):
    assert vc.free_cache_engine("auto", parameters=int(billions * 1e9), gpu_bytes=gpu_gib * GIB, memory_share=0.5,
                                gpus=gpus, has_ref=has_ref) is free


def test_free_cache_engine_keeps_a_boolean_releases_without_a_gpu_and_rejects_the_rest():
    sizes = dict(parameters=int(0.5e9), memory_share=0.5, gpus=2, has_ref=True)
    assert vc.free_cache_engine(True, gpu_bytes=80 * GIB, **sizes) is True
    assert vc.free_cache_engine(False, gpu_bytes=None, **sizes) is False
    assert vc.free_cache_engine("auto", gpu_bytes=None, **sizes) is True
    with pytest.raises(ValueError, match="free_cache_engine must be auto, true or false"):
        vc.free_cache_engine("sometimes", gpu_bytes=80 * GIB, **sizes)


@pytest.mark.parametrize("setting, free", [("auto", True), (False, False), (True, True)])
def test_free_cache_engine_lands_in_verls_rollout_config(setting, free):
    from SPA_agent.config import compose

    cfg = compose("_2_sokoban", ["model=tiny", *OVERRIDES, f"verl_backend.free_cache_engine={setting}"])
    rollout = omega_conf_to_dataclass(vc.build_verl_config(cfg).actor_rollout_ref.rollout)
    assert rollout.free_cache_engine is free  # auto: no GPU on this machine, so released


def test_model_weight_bytes_counts_the_loaded_parameters(tiny_dir):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tiny_dir)
    weights, heads = vc.model_weight_bytes(str(tiny_dir), "bfloat16")
    assert weights == 2 * sum(p.numel() for p in loaded.parameters())
    assert heads == loaded.config.num_attention_heads


def test_auto_tensor_parallel_is_the_default_and_lands_in_verls_rollout_config():
    from SPA_agent.config import compose

    cfg = compose("_2_sokoban", ["model=tiny", "trainer.backend=verl", "trainer.n_gpus_per_node=2"])
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == "auto"
    verl_cfg = vc.build_verl_config(cfg)
    assert omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.rollout).tensor_model_parallel_size == 1  # no GPU here
    vc.check_verl_config(cfg, verl_cfg)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=3", "tensor_model_parallel_size"),
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=False", "log_prob_use_dynamic_bsz .* must be equal"),
    ("trainer.n_gpus_per_node=8", "multiple of the 8 GPUs"),
    ("verl_backend.rollout_name=hf", "rollout_name"),
    ("verl_backend.vllm_model_runner=v3", "vllm_model_runner must be one of"),
    ("verl_backend.worker_niceness=20", "worker_niceness must be null or a nice value from 0 to 19"),
    ("verl_backend.worker_niceness=-5", "worker_niceness must be null or a nice value from 0 to 19"),
    ("verl_backend.worker_niceness=true", "worker_niceness must be null or a nice value from 0 to 19"),
    ("verl_backend.worker_cpu_threads=0", "worker_cpu_threads must be null or a number of threads ≥ 1"),
    ("verl_backend.worker_cpu_threads=two", "worker_cpu_threads must be null or a number of threads ≥ 1"),
    ("verl_backend.driver_cpu_threads=0", "driver_cpu_threads must be null or a number of threads ≥ 1"),
])
def test_bad_settings_name_the_key(override, message):
    from SPA_agent.config import compose

    cfg = compose("_2_sokoban", ["model=tiny", *OVERRIDES, override])
    with pytest.raises(ValueError, match=message):
        vc.check_verl_config(cfg, vc.build_verl_config(cfg))


@pytest.mark.parametrize("has_flash_attn, remove_padding, attention, packed", [
    (True, "auto", "flash_attention_2", True), (True, True, "flash_attention_2", True),
    (True, False, "flash_attention_2", False),
    (False, "auto", PACKED_ATTENTION, True), (False, True, PACKED_ATTENTION, True), (False, False, "sdpa", False),
])
def test_attention_follows_flash_attn_and_packing(has_flash_attn, remove_padding, attention, packed):
    settings = vc.attention_settings(has_flash_attn, remove_padding)
    for model in ("actor_rollout_ref.model", "critic.model"):
        assert settings[f"{model}.override_config.attn_implementation"] == attention
        assert settings[f"{model}.use_remove_padding"] is packed


@pytest.mark.parametrize("model_runner, env", [("auto", None), ("v1", "0"), ("v2", "1")])
def test_vllm_model_runner_reaches_every_ray_worker(model_runner, env):
    # the engines are subprocesses of verl's server actors and inherit the Ray job's environment
    from SPA_agent.config import compose
    from SPA_agent.trainer.verl_backend import backend as verl_backend

    cfg = compose("_2_sokoban", ["model=tiny", *OVERRIDES, f"verl_backend.vllm_model_runner={model_runner}"])
    runtime = verl_backend.ray_runtime_env(vc.build_verl_config(cfg), True, True,
                                           model_runner=cfg.verl_backend.vllm_model_runner, cpu_threads=1)
    assert runtime["env_vars"].get("VLLM_USE_V2_MODEL_RUNNER") == env


@pytest.mark.parametrize("override, env", [
    ([], {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "RAY_worker_niceness": "0"}),
    (["verl_backend.worker_niceness=null"], {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}),
    (["verl_backend.worker_niceness=15", "verl_backend.all_gpus_visible=false"], {"RAY_worker_niceness": "15"}),
])
def test_a_cluster_started_here_gets_the_backend_settings(override, env):
    # Ray reads RAY_worker_niceness when its cluster starts; null leaves Ray's own (15)
    from SPA_agent.config import compose
    from SPA_agent.trainer.verl_backend import backend as verl_backend

    cfg = compose("_2_sokoban", ["model=tiny", *OVERRIDES, *override])
    assert verl_backend.local_cluster_env(cfg.verl_backend) == env
    vc.check_verl_config(cfg, vc.build_verl_config(cfg))


@pytest.mark.parametrize("override, threads", [([], "1"), (["verl_backend.worker_cpu_threads=4"], "4"),
                                               (["verl_backend.worker_cpu_threads=null"], None)])
def test_worker_cpu_threads_are_in_every_ray_workers_environment_from_its_start(override, threads):
    from SPA_agent.config import compose
    from SPA_agent.trainer.verl_backend import backend as verl_backend

    cfg = compose("_2_sokoban", ["model=tiny", *OVERRIDES, *override])
    vc.check_verl_config(cfg, vc.build_verl_config(cfg))
    runtime = verl_backend.ray_runtime_env(vc.build_verl_config(cfg), True, True, model_runner="auto",
                                           cpu_threads=cfg.verl_backend.worker_cpu_threads)
    assert runtime["env_vars"].get("OMP_NUM_THREADS") == threads


@pytest.mark.parametrize("override, threads", [([], 1), (["verl_backend.driver_cpu_threads=2"], 2),
                                               (["verl_backend.driver_cpu_threads=null"], None)])
def test_driver_cpu_threads_set_torchs_threads_in_the_driver(override, threads):
    # one by default: the driver's thread per core slowed its CPU phases beside the workers (benchmarks/RESULTS.md)
    from SPA_agent.config import compose
    from SPA_agent.trainer.verl_backend import backend as verl_backend

    cfg = compose("_2_sokoban", ["model=tiny", *OVERRIDES, *override])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        verl_backend.set_driver_cpu_threads(cfg.verl_backend)
        assert torch.get_num_threads() == (threads or 3)
    finally:
        torch.set_num_threads(before)


def test_remove_padding_setting_is_checked():
    with pytest.raises(ValueError, match="remove_padding must be auto, true or false"):
        vc.attention_settings(False, "yes")


def test_without_flash_attn_verl_builds_packed_models(configs):
    # this CPU machine has no flash-attn: verl's typed model configs must not ask for it (they did: issue 16), and
    # `auto` packs micro-batches through the per-sequence attention (issue 28)
    _, verl_cfg = configs
    for model in (verl_cfg.actor_rollout_ref.model, verl_cfg.critic.model):
        typed = omega_conf_to_dataclass(model)
        assert typed.hf_config._attn_implementation == PACKED_ATTENTION and typed.use_remove_padding is True
    # the actor's own flag interpolates the model's (what engine_workers hands the reference and actor engines)
    assert verl_cfg.actor_rollout_ref.actor.use_remove_padding is True


@pytest.mark.parametrize("attention", ["sdpa", PACKED_ATTENTION])
def test_remove_padding_inputs_keep_sequences_apart(tiny_dir, attention):
    """verl's remove-padding forward without flash-attn: the micro-batch as one row (`values()` of the jagged
    input_ids / position_ids, as FSDPEngine.prepare_model_inputs builds it), no attention mask, use_cache=False.
    Each sequence's logits and gradients must equal those of the sequence run alone, with transformers' sdpa (a
    dense block-diagonal mask) and with the per-sequence attention the verl backend uses (issue 28)."""
    import torch
    from transformers import AutoModelForCausalLM

    from SPA_agent.trainer import packing

    packing.register_packed_attention()
    packing._last_segments = (None, None)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation=attention)
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 800, (n,), generator=g) for n in (23, 61, 9)]
    input_ids = torch.nested.nested_tensor(sequences, layout=torch.jagged)
    position_ids = torch.nested.nested_tensor([torch.arange(len(s)) for s in sequences], layout=torch.jagged)
    packed = model(input_ids=input_ids.values().unsqueeze(0), attention_mask=None,
                   position_ids=position_ids.values().unsqueeze(0), use_cache=False).logits[0]
    if attention == PACKED_ATTENTION:  # the row was split by its position ids, with no (L, L) mask
        assert packing._last_segments[1] == (23, 61, 9)
    packed_grads = torch.autograd.grad(packed.logsumexp(-1).sum(), model.model.embed_tokens.weight)[0]
    alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in sequences]
    alone_grads = torch.autograd.grad(sum(a.logsumexp(-1).sum() for a in alone), model.model.embed_tokens.weight)[0]
    for start, end, logits in zip(input_ids.offsets()[:-1], input_ids.offsets()[1:], alone):
        torch.testing.assert_close(packed[start:end], logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(packed_grads, alone_grads, atol=1e-4, rtol=1e-4)


def test_verl_config_keys_are_merged_last():
    from SPA_agent.config import compose

    cfg = compose("_2_sokoban", ["model=tiny", "+verl_backend.verl_config.actor_rollout_ref.actor.fsdp_config.forward_prefetch=true",
                                 "+verl_backend.verl_config.critic.strategy=fsdp2",
                                 # over a key our translation sets: the user's value wins
                                 "+verl_backend.verl_config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12345"])
    verl_cfg = vc.build_verl_config(cfg)
    assert verl_cfg.actor_rollout_ref.actor.fsdp_config.forward_prefetch is True
    assert verl_cfg.critic.strategy == "fsdp2" and verl_cfg.actor_rollout_ref.actor.strategy == "fsdp"
    assert verl_cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 12345
    assert verl_cfg.critic.ppo_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu  # the rest is ours
    assert vc.build_verl_config(compose("_2_sokoban", ["model=tiny"])).actor_rollout_ref.actor.fsdp_config.forward_prefetch is False
