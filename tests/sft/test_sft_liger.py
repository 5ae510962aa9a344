"""`model.use_liger=true` (sft/liger.py): one-line errors where it cannot run, and on a CUDA GPU with liger-kernel
installed the fused path gives the plain path's summed token loss and gradients (bf16, tiny models), in a single
forward and through the whole FSDP2 trainer."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from sft_fixtures import synthetic_rows, write_rows

from sft.in_process import compose
from sft.liger import check_liger, resolve_liger
from sft.packing import IGNORE_INDEX, collate_packed, collate_padded, token_loss_sum
from sft.spa_sft_dataset import SftSample
from sft.spa_sft_trainer import SftTrainer

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
GPU_AND_LIGER = pytest.mark.skipif(not (HAS_LIGER and torch.cuda.is_available()),
                                   reason="needs a CUDA GPU and liger-kernel")


def test_unsupported_model_type_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^model.use_liger=true supports qwen2 and llama models, not 'gpt2'; "
                                         r"set model.use_liger=false$"):
        check_liger("gpt2", use_cuda=True)


def test_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"runs on CUDA GPUs only \(Triton kernels\)"):
        check_liger("qwen2", use_cuda=False)


@pytest.mark.skipif(HAS_LIGER, reason="liger-kernel is installed")
def test_missing_package_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs the liger-kernel package \(pip install -e '\.\[liger\]'\)"):
        check_liger("llama", use_cuda=True)


@pytest.mark.parametrize("setting, model_type, use_cuda, deterministic, expected", [
    ("auto", "llama", False, False, False),  # CPU: plain modules, no error
    ("auto", "gpt2", True, False, False),  # an unsupported model: plain modules, no error
    ("auto", "llama", True, True, False),  # trainer.deterministic: PyTorch's kernels only
    ("auto", "qwen2", True, False, HAS_LIGER),  # where they run
    (False, "llama", True, False, False),
])
def test_auto_uses_liger_where_it_runs_and_never_raises(setting, model_type, use_cuda, deterministic, expected):
    assert resolve_liger(setting, model_type, use_cuda, deterministic) is expected


def test_true_still_raises_where_liger_cannot_run():
    with pytest.raises(ValueError, match="runs on CUDA GPUs only"):
        resolve_liger(True, "llama", use_cuda=False, deterministic=False)


def test_auto_preflights_on_cpu_and_other_values_are_refused(tmp_path):
    from sft.config_checks import check_sft_config

    cfg = compose(["data.train_files=x", "model.partial_pretrain=tiny", "model.use_liger=auto", "trainer.device=cpu"])
    check_sft_config(cfg)
    with pytest.raises(ValueError, match=r"^model.use_liger must be true, false or auto, got 'yes'$"):
        check_sft_config(compose(["data.train_files=x", "model.use_liger=yes"]))


def test_smollm2_scripts_ask_for_liger_where_it_runs():
    from SPA_agent.model_presets import script_models

    assert "model.use_liger=auto" in script_models()["smollm2-135m"].sft_defaults.split()


def test_preflight_checks_the_switch_before_reading_data(tmp_path):
    """The trainer reads the model type from the model's config and refuses before touching data or output."""
    cfg = compose(["data.train_files=missing.parquet", "model.partial_pretrain=tiny", "model.use_liger=true",
                   "trainer.device=cpu", f"trainer.default_local_dir={tmp_path / 'out'}"])
    with pytest.raises(ValueError, match="runs on CUDA GPUs only"):
        SftTrainer(cfg).preflight()
    assert not (tmp_path / "out").exists()
    assert compose([]).model.use_liger is False  # off by default


def test_a_run_may_resume_with_the_switch_flipped():
    """Same loss, other kernels: model.use_liger is not part of the run identity (attn_implementation is)."""
    from omegaconf import OmegaConf

    from sft.spa_sft_trainer import RUN_DIR
    from SPA_agent.runs.run_identity import build_identity

    identity = lambda *o: build_identity(OmegaConf.to_container(compose(["data.train_files=x", *o])), {},
                                         RUN_DIR.ignored).config
    assert identity("model.use_liger=true") == identity("model.use_liger=false")
    assert identity("model.attn_implementation=sdpa") != identity("model.attn_implementation=eager")


@pytest.mark.skipif(not HAS_LIGER, reason="needs liger-kernel")
def test_apply_liger_patches_the_instance(tiny_model_copy):
    """The patch calls of the installed liger-kernel (runs on CPU: only the kernels need a GPU)."""
    from sft.liger import apply_liger

    model = tiny_model_copy
    apply_liger(model)
    layer = model.model.layers[0]
    assert layer.mlp._get_name() == "LigerSwiGLUMLP"
    assert layer.input_layernorm._get_name() == model.model.norm._get_name() == "LigerRMSNorm"
    assert model.forward.__func__.__module__ == "liger_kernel.transformers.model.qwen2"


@pytest.mark.skipif(not HAS_LIGER, reason="needs liger-kernel")
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_fused_loss_wiring_on_cpu(layout, tiny_dir, monkeypatch, restore_transformers_modules):
    """Liger's own forward and loss plumbing on CPU, only its Triton kernel replaced by what it computes
    (cross-entropy of x @ W^T): our positions, shifted labels, "sum" reduction and chunking reach it, and loss and
    gradients equal the plain path's exactly. The kernel itself is compared on the GPU below."""
    import liger_kernel.transformers.functional as liger_functional
    from transformers import AutoModelForCausalLM

    from sft.liger import CHUNK_MEM_CONST, fused_token_loss_sum

    calls = []

    def kernel_definition(input, weight, target, ignore_index=-100, reduction="mean", chunk_mem_const=1,
                          softcap=None, **flags):  # flags: accumulation dtype, accuracy outputs (all off)
        assert softcap is None and not any(flags.values())
        calls.append((input.shape[0], reduction, chunk_mem_const))
        return torch.nn.functional.cross_entropy((input @ weight.t()).float(), target, ignore_index=ignore_index,
                                                 reduction=reduction)

    monkeypatch.setattr(liger_functional, "liger_fused_linear_cross_entropy", kernel_definition)
    samples = _samples()
    batch = collate_packed(samples, pad_id=0) if layout == "packed" else collate_padded(samples, pad_id=0)
    plain, fused = (AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32) for _ in range(2))
    import liger_kernel.transformers as liger

    liger.apply_liger_kernel_to_qwen2(rope=False, rms_norm=False, swiglu=False, model=fused)  # only the loss path
    loss, grads = _loss_and_grads(plain, token_loss_sum, batch)
    fused_loss, fused_grads = _loss_and_grads(fused, fused_token_loss_sum, batch)
    trained = sum(int(s.loss_mask[1:].sum()) for s in samples)
    kept_rows = trained if layout == "packed" else len(samples) * int(batch["labels"].ne(IGNORE_INDEX).any(0).sum())
    assert calls == [(kept_rows, "sum", CHUNK_MEM_CONST)]
    assert fused_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    torch.testing.assert_close(fused_grads, grads, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- GPU: liger path == plain path


@pytest.fixture
def tiny_model_copy(tiny_dir, restore_transformers_modules):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


@pytest.fixture
def restore_transformers_modules(monkeypatch):
    """Liger replaces module-level functions and classes of transformers' qwen2/llama modules: undo after a test."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    for module, prefix in ((modeling_qwen2, "Qwen2"), (modeling_llama, "Llama")):
        for name in ("apply_rotary_pos_emb", f"{prefix}RMSNorm", f"{prefix}MLP"):
            monkeypatch.setattr(module, name, getattr(module, name))
        causal_lm = getattr(module, f"{prefix}ForCausalLM")
        monkeypatch.setattr(causal_lm, "forward", causal_lm.forward)


def _llama_dir(tmp_path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=900, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    return str(tmp_path / "llama")


def _samples() -> list[SftSample]:
    """Three rows with a trained response at the end and one trained span in the middle (loss mask 0 elsewhere)."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for length, spans in ((57, [(40, 57)]), (130, [(20, 31), (100, 130)]), (23, [(15, 23)])):
        mask = torch.zeros(length, dtype=torch.long)
        for start, end in spans:
            mask[start:end] = 1
        samples.append(SftSample(torch.randint(3, 800, (length,), generator=g), mask))
    return samples


def _loss_and_grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach().float(), torch.cat([p.grad.float().flatten() for p in model.parameters()])


@GPU_AND_LIGER
@pytest.mark.parametrize("model_name", ["qwen2", "llama"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_fused_loss_and_grads_equal_the_plain_path(model_name, layout, tiny_dir, tmp_path,
                                                   restore_transformers_modules):
    from transformers import AutoModelForCausalLM

    from sft.liger import apply_liger, fused_token_loss_sum

    path = tiny_dir if model_name == "qwen2" else _llama_dir(tmp_path)
    samples = _samples()
    batch = collate_packed(samples, pad_id=0) if layout == "packed" else collate_padded(samples, pad_id=0)
    batch = {k: v.cuda() for k, v in batch.items()}
    n_trained = int((batch["labels"] != IGNORE_INDEX).sum())
    assert n_trained == sum(int(s.loss_mask[1:].sum()) for s in samples)  # mask → labels, nothing crosses rows
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    plain = load()  # before apply_liger, which also swaps RoPE for later models of this type
    loss, grads = _loss_and_grads(plain, token_loss_sum, batch)
    fused = load()
    apply_liger(fused)
    fused_loss, fused_grads = _loss_and_grads(fused, fused_token_loss_sum, batch)
    assert fused_loss.item() == pytest.approx(loss.item(), rel=1e-2)  # a sum over n_trained tokens, bf16
    assert (fused_grads - grads).norm() / grads.norm() < 3e-2
    assert torch.nn.functional.cosine_similarity(fused_grads, grads, dim=0) > 0.999


@GPU_AND_LIGER
def test_an_empty_micro_batch_gives_zero_loss_and_gradients(tiny_model_copy):
    """Ranks with fewer micro-batches get empty ones (one untrained pad token) and still run forward/backward."""
    from sft.liger import apply_liger, fused_token_loss_sum

    model = tiny_model_copy.to(torch.bfloat16).cuda()
    apply_liger(model)
    loss = fused_token_loss_sum(model, {k: v.cuda() for k, v in collate_packed([], pad_id=0).items()})
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


@GPU_AND_LIGER
def test_fused_loss_with_lora_equals_the_plain_path(tiny_dir, restore_transformers_modules):
    """Liger patches the base model, PEFT wraps it (the trainer's order): the adapters get the same gradients."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from sft.liger import apply_liger, fused_token_loss_sum
    from SPA_agent.runs.lora import add_lora

    batch = {k: v.cuda() for k, v in collate_packed(_samples(), pad_id=0).items()}
    lora = OmegaConf.create({"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    results = []
    for liger in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
        if liger:
            apply_liger(model)
        torch.manual_seed(0)  # same adapter initialisation
        model = add_lora(model, lora, "model").cuda()
        with torch.no_grad():  # B starts at zero: make the adapters matter
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02, generator=torch.Generator(param.device).manual_seed(len(name)))
        loss = (fused_token_loss_sum if liger else token_loss_sum)(model, batch)
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
        results.append((loss.item(), grads))
    (loss, grads), (fused_loss, fused_grads) = results
    assert fused_loss == pytest.approx(loss, rel=1e-2)
    assert (fused_grads - grads).norm() / grads.norm() < 3e-2


@GPU_AND_LIGER
def test_trainer_with_liger_follows_the_plain_run(tmp_path, restore_transformers_modules):
    """Three FSDP2 steps (bf16 mixed precision) on the tiny model: same losses and grad norms within bf16 noise."""
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "wm_train.parquet", *synthetic_rows(12, seed=0))
    (data / "data_card.json").write_text("{}")
    runs = {}
    for use_liger in ("false", "true"):  # plain first: Liger's RoPE swap is process-wide
        out = tmp_path / f"liger_{use_liger}"
        cfg = compose([f"data.train_files={data}/wm_train.parquet", "model.partial_pretrain=tiny",
                       f"trainer.default_local_dir={out}", "data.max_length=96", "data.train_batch_size=4",
                       "data.max_tokens_per_micro_batch=192", "optim.lr=3e-3", "trainer.total_epochs=1",
                       "model.attn_implementation=sdpa", f"model.use_liger={use_liger}", "trainer.device=cuda"])
        from sft.in_process import run

        run(cfg)
        runs[use_liger] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["true"]) == len(runs["false"]) == 3
    for plain, fused in zip(runs["false"], runs["true"]):
        assert fused["train/loss"] == pytest.approx(plain["train/loss"], rel=2e-2)
        assert fused["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=5e-2)
        assert fused["train/loss_tokens"] == plain["train/loss_tokens"]
