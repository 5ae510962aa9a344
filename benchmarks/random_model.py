"""Save a random-weight Qwen2 model of a benchmark shape over the embedded tiny tokenizer, as a Hugging Face dir.

GPU runs of the whole trainer need a model directory with a tokenizer and a chat template, and no model can be
downloaded on the GPU hosts: this writes one (a Qwen2.5-0.5B or 1.5B layout, bf16), loadable by every stage like any
checkpoint (e.g. `train_ppo_sfted.sh _2_sokoban <dir> <name>`). Its vocabulary is the tiny tokenizer's (860 ids:
no large LM head), or with --full-vocab the shape's own (151,936 for the Qwen shapes: the LM head, logits and
sampling cost what they cost in the real model), the tokenizer then padded with placeholder tokens `<x0>`, `<x1>`,
… so that every id the model samples decodes and encodes back to itself.

    python benchmarks/random_model.py --shape 0.5b --out /tmp/qwen0.5b-random [--full-vocab]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from model_shapes import SHAPES
from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from SPA_agent.tiny import tiny_model_dir


def pad_tokenizer(tokenizer, size: int):
    """`tokenizer` with placeholder tokens added until it has `size` ids (unchanged if it has as many)."""
    tokenizer.add_tokens([f"<x{i}>" for i in range(size - len(tokenizer))])
    return tokenizer


def save_random_model(shape: str, out: Path, seed: int = 0, full_vocab: bool = False) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    if full_vocab:
        pad_tokenizer(tokenizer, SHAPES[shape]["vocab_size"])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = Qwen2Config(**{**SHAPES[shape], "vocab_size": len(tokenizer)}, max_position_embeddings=32768,
                         bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full-vocab", action="store_true", help="the shape's own vocabulary, not the tokenizer's")
    args = parser.parse_args()
    print(save_random_model(args.shape, args.out, args.seed, args.full_vocab))


if __name__ == "__main__":
    main()
