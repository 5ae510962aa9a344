import hashlib

from SPA_agent.model_presets import resolve_model_path
from SPA_agent.tiny import build_tiny_model


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_tiny_build_is_byte_identical(tmp_path):
    assert _digest(build_tiny_model(tmp_path / "a")) == _digest(build_tiny_model(tmp_path / "b"))


def test_tiny_tokenizer_round_trips_prompt_text(tiny_tokenizer):
    text = "######\n#√XP_#\nPlayer (P) is at (3,2); box (X) is at (3,1).\n| 3 . 4 1 | <think></think> 中文 é"
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    assert tiny_tokenizer.decode(ids) == text


def test_tiny_chat_template_is_chatml(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.eos_token == "<|im_end|>" and tiny_tokenizer.pad_token == "<|endoftext|>"


def test_tiny_model_loads_and_has_qwen2_shape(tiny_model, tiny_tokenizer):
    assert tiny_model.config.model_type == "qwen2"
    assert tiny_model.config.vocab_size == len(tiny_tokenizer)
    assert 1e5 < sum(p.numel() for p in tiny_model.parameters()) < 5e6


def test_resolve_model_path_passes_hub_ids_through():
    assert resolve_model_path("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
