"""`model.attn_implementation=flash_attention_2` for SFT: a one-line error without flash-attn or a GPU, and on
a GPU with flash-attn the packed (padding-free) loss equals sdpa's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from sft.spa_sft_trainer import check_attention

REPO = Path(__file__).resolve().parents[2]
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def _cfg(attn: str):
    return OmegaConf.create({"model": {"attn_implementation": attn}})


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="flash-attn is installed")
def test_flash_attention_without_the_package_is_a_clear_error(tmp_path, call_entry):
    with pytest.raises(ValueError, match="needs the flash-attn package"):
        check_attention(_cfg("flash_attention_2"), use_cuda=True)
    # the entry point in this process (tests/sft/test_sft_trainer.py's torchrun tests start it as processes)
    from sft import spa_sft_trainer

    code, err = call_entry(spa_sft_trainer, ["data.train_files=x.parquet", "model.attn_implementation=flash_attention_2",
                                             "trainer.preflight_nproc=1"])
    assert code == 2 and "needs the flash-attn package" in err and err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn is not installed")
def test_flash_attention_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        check_attention(_cfg("flash_attention_2"), use_cuda=False)


def test_other_kernels_pass_the_check():
    for attn in ("auto", "sdpa", "eager", "flex_attention"):
        check_attention(_cfg(attn), use_cuda=False)


@pytest.mark.skipif(not (HAS_FLASH_ATTN and torch.cuda.is_available()), reason="needs flash-attn and a CUDA GPU")
def test_packed_loss_with_flash_attention_equals_sdpa(tiny_dir):
    from transformers import AutoModelForCausalLM

    from sft.packing import collate_packed, token_loss_sum
    from sft.spa_sft_dataset import SftSample

    g = torch.Generator().manual_seed(0)
    samples = [SftSample(torch.randint(3, 800, (n,), generator=g), torch.ones(n, dtype=torch.long))
               for n in (37, 90, 11)]
    batch = {k: v.cuda() for k, v in collate_packed(samples, pad_id=0).items()}
    losses = {}
    for attn in ("sdpa", "flash_attention_2"):
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16, attn_implementation=attn).cuda()
        with torch.no_grad():
            losses[attn] = token_loss_sum(model, batch).item()
    assert losses["flash_attention_2"] == pytest.approx(losses["sdpa"], rel=2e-2)
