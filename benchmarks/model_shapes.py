"""Model shapes the benchmarks build with random weights (no download): Qwen2.5-0.5B, Qwen2.5-1.5B, SmolLM2-135M's
layout (a Llama model, built as Qwen2: the same matrices but for q/k/v biases, which cost nothing) and the embedded
models' shapes (SPA_agent/tiny.py): `small` (~25M) and `tiny` for CI-size runs."""

from SPA_agent.tiny import MODEL_SHAPE, SMALL_SHAPE, VOCAB_SIZE

QWEN_VOCAB_SIZE = 151936
_LAYOUT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")

#: Qwen2Config keyword arguments by shape name.
SHAPES = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": QWEN_VOCAB_SIZE, "tie_word_embeddings": True},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": QWEN_VOCAB_SIZE, "tie_word_embeddings": True},
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "tie_word_embeddings": True},
    "tiny": {**{k: MODEL_SHAPE[k] for k in _LAYOUT_KEYS}, "vocab_size": VOCAB_SIZE, "tie_word_embeddings": True},
    "small": {**{k: SMALL_SHAPE[k] for k in _LAYOUT_KEYS}, "vocab_size": VOCAB_SIZE, "tie_word_embeddings": True},
}
