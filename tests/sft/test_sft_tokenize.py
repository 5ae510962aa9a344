"""SpaSftDataset's batched tokenization (sft/batch_encode.py) against a row-by-row reference: the same token ids, loss
masks and truncation report, on stage 1's own data and on hand-written rows, for every loss target and truncation,
under ChatML (the tiny tokenizer), a Llama-3-style template and SmolLM2's tokenizer (when converted on this machine);
and the segment-wise encoding against whole texts for tokenizers whose added tokens or pre-tokenizer need care."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from sft_fixtures import PROMPT, RESPONSE, llama3_tokenizer, synthetic_rows, write_rows
from smollm2_template import SMOLLM2_TEMPLATE

from sft.batch_encode import encode_texts, encode_with_offsets, rust_tokenizer, segment_pattern, segments
from sft.loss_targets import LossTarget, build_text, end_of_turn_token, placeholder_ids, prepare_tokenizer
from sft.spa_sft_dataset import SpaSftDataset, TruncationReport, read_rows


def reference(path, tokenizer, loss_target: LossTarget, max_length: int, truncation: str):
    """The straightforward tokenization: one tokenizer call per text, the loss mask token by token in Python
    (the data set's code before issue 42's batching)."""
    eot = end_of_turn_token(tokenizer)
    placeholders = placeholder_ids(tokenizer) if loss_target is LossTarget.RELEASED else set()
    rows, cuts, trained_cut, longest = [], [], 0, 0
    for messages, response in zip(*read_rows(str(path))):
        text = build_text(tokenizer, messages, response, loss_target, eot)
        prompt = tokenizer(text.prompt_text, add_special_tokens=False)["input_ids"]
        target = tokenizer(text.target_text, add_special_tokens=False, return_offsets_mapping=True)
        ids = prompt + target["input_ids"]
        mask = [0] * len(prompt) + [int(any(s < end and e > start for start, end in text.loss_spans))
                                    for s, e in target["offset_mapping"]]
        mask = [0 if i > 0 and ids[i - 1] in placeholders else m for i, m in enumerate(mask)]
        full_length, full_trained = len(ids), sum(mask)
        if len(ids) > max_length:
            cut = slice(-max_length, None) if truncation == "left" else slice(0, max_length)
            ids, mask = ids[cut], mask[cut]
        mask[0] = 0
        longest = max(longest, full_length)
        if len(ids) < full_length:
            cuts.append(full_length - len(ids))
            trained_cut += full_trained - sum(mask)
        rows.append((ids, mask))
    return rows, TruncationReport(len(rows), longest, max_length, truncation, tuple(cuts), trained_cut)


def assert_same_as_reference(path, tokenizer, loss_target: LossTarget) -> None:
    """Whole rows, then rows cut on the left and on the right at the median row length."""
    whole, _ = reference(path, tokenizer, loss_target, 10**6, "left")
    median = sorted(len(ids) for ids, _ in whole)[len(whole) // 2]
    for max_length, truncation in ((10**6, "left"), (median, "left"), (median, "right")):
        data = SpaSftDataset(str(path), tokenizer, max_length, truncation, loss_target.value)
        rows, report = reference(path, tokenizer, loss_target, max_length, truncation)
        assert [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in data.samples] == rows
        assert all(s.input_ids.dtype == s.loss_mask.dtype == torch.long for s in data.samples)
        assert data.truncation_report == report
    assert any(mask[1:] != [0] * (len(mask) - 1) for _, mask in rows)  # something trains


def tokenizer_for(name: str, tiny_tokenizer, loss_target: LossTarget):
    """The named tokenizer; a copy with the placeholder tokens for `released`."""
    tokenizer = {"chatml": lambda: tiny_tokenizer, "llama3": lambda: llama3_tokenizer(tiny_tokenizer),
                 "smollm2_template": lambda: smollm2_template_tokenizer(tiny_tokenizer),
                 "smollm2": smollm2_tokenizer}[name]()
    if loss_target is LossTarget.RELEASED:
        tokenizer = copy.deepcopy(tokenizer)
        prepare_tokenizer(tokenizer, loss_target)
    return tokenizer


def smollm2_template_tokenizer(tokenizer):
    """A copy of `tokenizer` under SmolLM2's chat template (its default system message): SmolLM2's row layout on
    every machine, where its own vocabulary is not converted."""
    smol = copy.deepcopy(tokenizer)
    smol.chat_template = SMOLLM2_TEMPLATE
    return smol


@functools.cache
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer where SPA_agent/smollm2.py has converted it on this machine (else skip:
    converting needs the GGUF file, docs/smollm2.md; `smollm2_template` covers its template everywhere)."""
    from transformers import AutoTokenizer

    from SPA_agent import smollm2
    from SPA_agent.model_cache import DEFAULT_CACHE_DIR, MARKER_FILE

    directory = DEFAULT_CACHE_DIR / f"{smollm2.NAME}-{smollm2.VERSION}"
    if not (directory / MARKER_FILE).is_file():
        pytest.skip(f"SmolLM2 is not converted on this machine ({directory})")
    return AutoTokenizer.from_pretrained(directory)


TOKENIZERS = ["chatml", "llama3", "smollm2_template", "smollm2"]


@pytest.fixture(scope="module")
def written_rows(tmp_path_factory):
    """Hand-written multi-turn rows and short synthetic ones, with and without the forced <think>."""
    prompts, responses = synthetic_rows(6)
    prompts += [PROMPT, PROMPT[:2], PROMPT, PROMPT[:2]]
    responses += [RESPONSE, RESPONSE, "<answer>Up</answer>", "<think></think><answer>Up</answer>"]
    return write_rows(tmp_path_factory.mktemp("rows") / "wm_train.parquet", prompts, responses)


@pytest.mark.parametrize("loss_target", list(LossTarget))
@pytest.mark.parametrize("name", TOKENIZERS)
def test_written_rows_tokenize_as_row_by_row(written_rows, tiny_tokenizer, name, loss_target):
    assert_same_as_reference(written_rows, tokenizer_for(name, tiny_tokenizer, loss_target), loss_target)


@pytest.fixture(scope="module")
def stage1_rows(tmp_path_factory):
    """Stage 1's training rows: one batch of the random generator on Sokoban (multi-turn, states in every turn)."""
    from omegaconf import OmegaConf

    from SPA_agent.config import compose
    from SPA_agent.selfplay.generate import generate, prepare_data_gen_config

    out = tmp_path_factory.mktemp("stage1")
    cfg = prepare_data_gen_config(compose("_2_sokoban", ["model=tiny", "generator=random"]), "_2_sokoban")
    OmegaConf.update(cfg, "data_gen.num_batches", 1)
    OmegaConf.update(cfg, "data_gen.output_dir", str(out))
    generate(cfg)
    return out / "wm_train.parquet"


@pytest.mark.slow
@pytest.mark.parametrize("loss_target", list(LossTarget))
@pytest.mark.parametrize("name", TOKENIZERS)
def test_stage1_rows_tokenize_as_row_by_row(stage1_rows, tiny_tokenizer, name, loss_target):
    assert_same_as_reference(stage1_rows, tokenizer_for(name, tiny_tokenizer, loss_target), loss_target)


def test_truncation_error_names_the_first_row_too_long(written_rows, tiny_tokenizer):
    whole, _ = reference(written_rows, tiny_tokenizer, LossTarget.PAPER, 10**6, "left")
    longest = max(len(ids) for ids, _ in whole)
    first = next(row for row, (ids, _) in enumerate(whole) if len(ids) == longest)
    with pytest.raises(ValueError, match=f"row {first} has {longest} tokens > data.max_length={longest - 1}"):
        SpaSftDataset(str(written_rows), tiny_tokenizer, max_length=longest - 1, truncation="error")


# --- segment-wise encoding against whole texts ------------------------------------------------------------------------
SPECIALS = ["<|im_start|>", "<|im_end|>"]
TEXTS = ["", "no added token at all", "<|im_start|>", "<|im_start|>system\nYou are here.<|im_end|>\n<|im_start|>user\n"
         " Go  left!<|im_end|><|im_end|>\n<|im_start|>assistant\n<think>", " starts with text<|im_end|> then text ",
         "<|im_end|><|im_start|> x", "<|im_start|>user\n Go  left!<|im_end|>"]


def trained_tokenizer(pre_tokenizer, extra_tokens=()):
    """A small BPE trained on TEXTS with `pre_tokenizer`, SPECIALS as special tokens and `extra_tokens` added."""
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizer
    rust.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=rust)
    tokenizer.add_tokens(list(extra_tokens))
    return tokenizer


def whole_texts(tokenizer, texts):
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


def test_segments_start_at_added_tokens(tiny_tokenizer):
    pattern = segment_pattern(rust_tokenizer(tiny_tokenizer))
    assert segments(TEXTS[3], pattern) == ["<|im_start|>system\nYou are here.", "<|im_end|>\n",
                                           "<|im_start|>user\n Go  left!", "<|im_end|>", "<|im_end|>\n",
                                           "<|im_start|>assistant\n<think>"]
    assert segments(TEXTS[4], pattern) == [" starts with text", "<|im_end|> then text "]
    assert segments("", pattern) == [] and segments("x", None) == ["x"]


def test_a_segment_is_encoded_after_its_added_token_as_in_the_whole_text():
    """Metaspace's prepend_scheme="first" marks a text's first piece only: a segment cut without its added token
    would be encoded as a first piece, with a "▁" of its own."""
    from tokenizers import pre_tokenizers

    tokenizer = trained_tokenizer(pre_tokenizers.Metaspace(prepend_scheme="first"))
    assert segment_pattern(rust_tokenizer(tokenizer)) is not None
    text = "<|im_start|>user\n Go  left!"
    inside = whole_texts(tokenizer, [text])[0][1:]
    assert whole_texts(tokenizer, [text[len("<|im_start|>"):]])[0] != inside  # cut naively: other ids
    assert [ids.tolist() for ids in encode_texts(tokenizer, TEXTS)] == whole_texts(tokenizer, TEXTS)


@pytest.mark.parametrize("lstrip", [False, True])
def test_added_tokens_that_strip_whitespace_leave_texts_whole(lstrip):
    """An added token with lstrip takes the whitespace before it: there the texts are encoded whole. A normalized
    added token (matched after normalization, inside a segment) needs nothing."""
    from tokenizers import AddedToken, pre_tokenizers

    tokenizer = trained_tokenizer(pre_tokenizers.ByteLevel(), [AddedToken("left", normalized=True)])
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(" then", lstrip=lstrip)]},
                                 replace_extra_special_tokens=False)
    assert (segment_pattern(rust_tokenizer(tokenizer)) is None) == lstrip
    assert [ids.tolist() for ids in encode_texts(tokenizer, TEXTS)] == whole_texts(tokenizer, TEXTS)


def test_split_special_tokens_encodes_them_as_text(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.split_special_tokens = True
    assert segment_pattern(rust_tokenizer(tokenizer)) is None
    assert [ids.tolist() for ids in encode_texts(tokenizer, TEXTS)] == whole_texts(tokenizer, TEXTS)


def test_offsets_are_the_offset_mapping(tiny_tokenizer):
    expected = tiny_tokenizer(TEXTS, add_special_tokens=False, return_offsets_mapping=True)
    for (ids, offsets), want_ids, want_offsets in zip(encode_with_offsets(tiny_tokenizer, TEXTS),
                                                      expected["input_ids"], expected["offset_mapping"]):
        assert ids.tolist() == want_ids and offsets.shape == (len(want_ids), 2)
        assert [tuple(pair) for pair in offsets.tolist()] == [tuple(pair) for pair in want_offsets]
