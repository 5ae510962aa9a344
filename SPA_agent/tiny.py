"""The embedded models: Qwen2-architecture causal LMs over one ChatML tokenizer, built offline.

`model_path=tiny` (~0.8M parameters, for CI and smoke runs) and `model_path=small` (~25M parameters, a
from-scratch model for small-scale learning experiments) resolve (through `model_presets.resolve_model_path`) to Hugging
Face directories that this module builds deterministically on first use and caches, so every stage runs with
no download. The tokenizer is a byte-level BPE trained on a fixed corpus of the prompts' vocabulary (grid
symbols such as `√`, digits, tags, action names), so any text round-trips through it; the models have random
weights from a fixed seed. Build twice, get byte-identical files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from SPA_agent.model_cache import DEFAULT_CACHE_DIR, MARKER_FILE, save_model_dir

TINY_NAME = "tiny"
TINY_VERSION = "v1"  # bump when the recipe changes: the cache is keyed on it
SMALL_NAME = "small"
SMALL_VERSION = "v1"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_OR_PAD, IM_START, IM_END = SPECIAL_TOKENS

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

VOCAB_SIZE = 2048
MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
#: ~24.6M parameters: 8 layers × ~3.0M (attention 0.66M with 2 KV heads, MLP 2.36M) + 1.0M tied embeddings
SMALL_SHAPE = dict(
    MODEL_SHAPE,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
)
SEED = 0


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded model: its `model_path` name, cache version and Qwen2Config shape."""

    name: str
    version: str
    shape: dict


EMBEDDED_MODELS = {
    model.name: model
    for model in (
        EmbeddedModel(TINY_NAME, TINY_VERSION, MODEL_SHAPE),
        EmbeddedModel(SMALL_NAME, SMALL_VERSION, SMALL_SHAPE),
    )
}


def _corpus() -> list[str]:
    """Text the BPE merges are learned from: the words, symbols and formats our prompts contain."""
    symbols = "# _ O √ X P S G . | ( ) , ; : [ ] = - + * / \\ ' \" ! ? < > { }"
    tags = [
        "<think>", "</think>", "<answer>", "</answer>", "<observation>", "</observation>",
        "<prediction>", "</prediction>",
    ]
    words = (
        "You're a helpful assistant. You are solving the Sokoban puzzle FrozenLake Sudoku game. "
        "Turn State Reward You have actions left. Always output with no extra text. Strictly follow this "
        "format. Max response length words tokens. The meaning of each symbol in the state is wall empty "
        "target box on player hole goal in Your available actions are Up Down Left Right You can make up to "
        "separated by the action separator Player (P) is at box (X) target (O) hole goal (G) Empty positions "
        "to be filled are at position No empty positions found board might be complete current state next "
        "state Your thoughts your answer I will push the box to the row col place value grid coordinates "
        "range from top left bottom right zero indexed each row column and 2x2 subgrid must contain digits"
    )
    grids = ["######\n#O####\n#XP###\n#__###\n######", "____\n_OOP\nGO__\nO___", "| 3 2 4 1 | . 4 . . "]
    digits = " ".join(str(i) for i in range(200)) + " -0.1 -0.30000000000000004 10.8 0.0 1.0 (3,2) (0,1)"
    return [symbols, " ".join(tags), words, words.lower(), *grids, digits] * 4


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(), trainer=trainer)
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=BOS_OR_PAD,
        bos_token=None,
        unk_token=None,
        padding_side="left",
        model_max_length=8192,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _build_model(tokenizer, shape: dict):
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_OR_PAD),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(BOS_OR_PAD),
        **shape,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, config.pad_token_id],
        pad_token_id=config.pad_token_id,
        do_sample=True,
        temperature=1.0,
    )
    return model


def build_embedded_model(name: str, output_dir: str | Path) -> Path:
    """Build embedded model `name` + tokenizer into `output_dir` (written atomically: a temp dir, then a rename)."""
    spec = EMBEDDED_MODELS[name]
    tokenizer = _build_tokenizer()
    return save_model_dir(tokenizer, _build_model(tokenizer, spec.shape), Path(output_dir),
                          {"name": spec.name, "version": spec.version})


def build_tiny_model(output_dir: str | Path) -> Path:
    """Build the tiny model + tokenizer into `output_dir`."""
    return build_embedded_model(TINY_NAME, output_dir)


def embedded_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Directory of the cached embedded model `name` (`tiny`, `small`), building it first if needed."""
    spec = EMBEDDED_MODELS[name]
    target = Path(cache_dir or DEFAULT_CACHE_DIR) / f"{spec.name}-{spec.version}"
    if not (target / MARKER_FILE).exists():
        build_embedded_model(name, target)
    return target


def tiny_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Directory of the cached tiny model, building it first if needed."""
    return embedded_model_dir(TINY_NAME, cache_dir)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m SPA_agent.tiny", description="Build (once) and print the "
                                     "directory of an embedded model.")
    parser.add_argument("name", nargs="?", default=TINY_NAME, choices=sorted(EMBEDDED_MODELS))
    print(embedded_model_dir(parser.parse_args().name))
