"""Token-exact loss masks for every loss target, on ChatML and a Llama-3-style template; schema and errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from sft_fixtures import PROMPT, RESPONSE, llama3_tokenizer, write_rows

from sft.loss_targets import LossTarget, prepare_tokenizer
from sft.spa_sft_dataset import SpaSftDataset

# Hand-checked: trained tokens of the RESPONSE row, grouped into contiguous runs, as token strings.
EOT = "<EOT>"
BODY = [" <", "observation", ">", "#", "_", "P", "<", "/", "observation", ">", " push", " <", "prediction", ">",
        "#__", "<", "/", "prediction", ">", "<", "/", "think", ">", "<", "answer", ">", "Le", "ft", " |", "|",
        " Up", "<", "/", "answer", ">", EOT]
EXPECTED_RUNS = {
    # the whole response after the forced "<think>", plus the end-of-turn token
    LossTarget.PAPER: [BODY],
    # contents of <observation> and <prediction> only
    LossTarget.STATES_ONLY: [["#", "_", "P"], ["#__"]],
    # <answer>…</answer> and the end-of-turn token
    LossTarget.ANSWER_ONLY: [["<", "answer", ">", "Le", "ft", " |", "|", " Up", "<", "/", "answer", ">", EOT]],
    # the whole response and the end-of-turn token but the contents of <prediction>
    LossTarget.WITHOUT_PREDICTION: [BODY[:14], BODY[15:]],
    # the whole response and the end-of-turn token but the contents of <observation> and <prediction>
    LossTarget.WITHOUT_STATES: [BODY[:3], BODY[6:14], BODY[15:]],
    # "</think>" + placeholder response + eot, minus the token after each placeholder (" push" and "<")
    LossTarget.RELEASED: [["<", "/", "think", ">", "<", "think", ">", " ", "<obs_content>"],
                          [" ", "<pred_content>"],
                          ["/", "think", ">", "<", "answer", ">", "Le", "ft", " |", "|", " Up", "<", "/",
                           "answer", ">", EOT]],
}


def _runs(tokenizer, sample) -> list[list[str]]:
    runs, current = [], []
    for token_id, trained in zip(sample.input_ids.tolist(), sample.loss_mask.tolist()):
        if trained:
            current.append(tokenizer.decode([token_id]))
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.fixture(scope="module")
def row_file(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("rows") / "wm_train.parquet", [PROMPT], [RESPONSE])


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def template(request, tiny_tokenizer):
    if request.param == "chatml":
        return tiny_tokenizer, "<|im_end|>"
    return llama3_tokenizer(tiny_tokenizer), "<|eot_id|>"


@pytest.mark.parametrize("loss_target", list(LossTarget))
def test_loss_mask_is_token_exact(template, row_file, loss_target):
    base, eot = template
    tokenizer = copy.deepcopy(base)
    prepare_tokenizer(tokenizer, loss_target)
    sample = SpaSftDataset(str(row_file), tokenizer, loss_target=loss_target.value)[0]
    expected = [[eot if t == EOT else t for t in run] for run in EXPECTED_RUNS[loss_target]]
    assert _runs(tokenizer, sample) == expected
    assert sample.input_ids[-1].item() == tokenizer.convert_tokens_to_ids(eot)


@pytest.mark.parametrize("loss_target", [LossTarget.PAPER, LossTarget.STATES_ONLY, LossTarget.ANSWER_ONLY,
                                         LossTarget.WITHOUT_PREDICTION, LossTarget.WITHOUT_STATES])
def test_prompt_is_template_plus_forced_think_and_never_trained(template, row_file, loss_target):
    tokenizer, _ = template
    sample = SpaSftDataset(str(row_file), tokenizer, loss_target=loss_target.value)[0]
    prompt = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) + "<think>"
    prompt_len = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(sample.input_ids[:prompt_len]) == prompt
    assert sample.loss_mask[:prompt_len].sum() == 0


def test_released_prompt_uses_placeholders_and_think_prefix(tiny_tokenizer, row_file):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    prepare_tokenizer(tokenizer, LossTarget.RELEASED)
    text = tokenizer.decode(SpaSftDataset(str(row_file), tokenizer, loss_target="released")[0].input_ids)
    assert "<observation>" not in text and "<prediction>" not in text
    assert "<|im_start|>assistant\n<think></think><think> <obs_content> go <pred_content></think>" in text
    assert text.endswith("<|im_start|>assistant\n<think></think><think> <obs_content> push <pred_content>"
                         "</think><answer>Left || Up</answer><|im_end|>")


def test_response_without_think_is_trained_whole(tiny_tokenizer, tmp_path):
    path = write_rows(tmp_path / "x.parquet", [PROMPT], ["<answer>Up</answer>"])
    sample = SpaSftDataset(str(path), tiny_tokenizer)[0]
    trained = tiny_tokenizer.decode(sample.input_ids[sample.loss_mask.bool()])
    assert trained == "<answer>Up</answer><|im_end|>"
    assert tiny_tokenizer.decode(sample.input_ids).endswith(
        "<|im_start|>assistant\n<answer>Up</answer><|im_end|>")


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_keeps_mask_aligned_with_ids(tiny_tokenizer, row_file, side):
    full = SpaSftDataset(str(row_file), tiny_tokenizer)[0]
    cut = SpaSftDataset(str(row_file), tiny_tokenizer, max_length=30, truncation=side)[0]
    assert len(cut) == 30
    window = slice(-30, None) if side == "left" else slice(0, 30)
    assert cut.input_ids.tolist() == full.input_ids[window].tolist()
    expected = full.loss_mask[window].clone()
    expected[0] = 0
    assert cut.loss_mask.tolist() == expected.tolist()


def test_default_truncation_is_left_as_in_the_original(tiny_tokenizer, row_file):
    from omegaconf import OmegaConf

    full = SpaSftDataset(str(row_file), tiny_tokenizer)[0]
    cut = SpaSftDataset(str(row_file), tiny_tokenizer, max_length=30)[0]
    assert cut.input_ids.tolist() == full.input_ids[-30:].tolist()
    config = OmegaConf.load(Path(__file__).resolve().parents[2] / "sft" / "config" / "sft_trainer.yaml")
    assert config.data.truncation == "left"  # spec §4.6


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_report_counts_rows_and_tokens_cut(tiny_tokenizer, tmp_path, side):
    prompts, responses = [PROMPT, PROMPT[:2], PROMPT], [RESPONSE, RESPONSE, "<answer>Up</answer>"]
    path = write_rows(tmp_path / "rows.parquet", prompts, responses)
    full = SpaSftDataset(str(path), tiny_tokenizer, max_length=10_000)
    assert full.truncation_report.as_dict()["rows_truncated"] == 0
    lengths = full.lengths
    max_length = sorted(lengths)[1]  # the longest row is cut, the other two fit
    data = SpaSftDataset(str(path), tiny_tokenizer, max_length=max_length, truncation=side)
    longest = max(range(3), key=lengths.__getitem__)
    dropped = slice(0, lengths[longest] - max_length) if side == "left" else slice(max_length, None)
    report = data.truncation_report.as_dict()
    assert report == {
        "rows": 3, "longest_row_tokens": lengths[longest], "max_length": max_length, "truncation": side,
        "rows_truncated": 1, "tokens_cut_max": lengths[longest] - max_length,
        "tokens_cut_mean": float(lengths[longest] - max_length),
        "trained_tokens_cut": int(full[longest].loss_mask[dropped].sum()),
    }
    # left keeps the whole response of a row whose response fits; right drops the response's end
    assert (report["trained_tokens_cut"] == 0) == (side == "left")
    assert f"1 truncated ({side}), tokens cut max {lengths[longest] - max_length}" in data.truncation_report.describe()


def test_truncation_error_names_the_row_and_the_fix(tiny_tokenizer, row_file):
    with pytest.raises(ValueError, match=r"row 0 has \d+ tokens > data.max_length=30"):
        SpaSftDataset(str(row_file), tiny_tokenizer, max_length=30, truncation="error")


def test_released_data_schema_with_extra_columns_loads(tiny_tokenizer, tmp_path):
    prompt_type = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
    table = pa.table({
        "data_source": ["sokoban", "sokoban"],
        "prompt": pa.array([PROMPT[:2], PROMPT], type=prompt_type),
        "response": [RESPONSE, "<think> x</think><answer>Up</answer>"],
        "ability": ["bfs", "bfs"],
        "reward_model": ["{'ground_truth': {'numbers': array([0, 0]), 'target': 0}, 'style': 'rule'}"] * 2,
        "extra_info": ["{'index': 100016, 'split': 'train'}", "{'index': 7, 'split': 'train'}"],
        "__index_level_0__": [3, 9],
    })
    pq.write_table(table, tmp_path / "wm_train.parquet")
    data = SpaSftDataset(str(tmp_path / "wm_train.parquet"), tiny_tokenizer)
    assert len(data) == 2 and all(s.loss_mask.sum() > 0 for s in data.samples)


def test_missing_file_empty_file_and_wrong_columns_raise_clear_errors(tiny_tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SpaSftDataset(str(tmp_path / "nope.parquet"), tiny_tokenizer)
    empty = write_rows(tmp_path / "empty.parquet", [], [])
    with pytest.raises(ValueError, match="has no rows"):
        SpaSftDataset(str(empty), tiny_tokenizer)
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), tmp_path / "gsm.parquet")
    with pytest.raises(ValueError, match=r"has columns \['question', 'answer'\]; expected"):
        SpaSftDataset(str(tmp_path / "gsm.parquet"), tiny_tokenizer)
    pq.write_table(pa.table({"prompt": ["text"], "response": ["a"]}), tmp_path / "flat.parquet")
    with pytest.raises(ValueError, match="prompt: string"):
        SpaSftDataset(str(tmp_path / "flat.parquet"), tiny_tokenizer)


def test_bad_config_values_raise(tiny_tokenizer, row_file):
    with pytest.raises(ValueError, match="data.loss_target='all'"):
        SpaSftDataset(str(row_file), tiny_tokenizer, loss_target="all")
    with pytest.raises(ValueError, match="data.truncation='middle'"):
        SpaSftDataset(str(row_file), tiny_tokenizer, truncation="middle")
    with pytest.raises(ValueError, match="call sft.loss_targets.prepare_tokenizer"):
        SpaSftDataset(str(row_file), tiny_tokenizer, loss_target="released")


def test_tokenized_rows_are_handed_to_the_next_process_of_the_run(tiny_tokenizer, tmp_path, monkeypatch):
    """sft/finetune_ft.sh's preflight tokenizes the data once into $SPA_SFT_TOKENIZED; its ranks read the same
    samples and truncation report back without tokenizing; other files or settings tokenize anew."""
    from sft import spa_sft_dataset
    from sft.spa_sft_dataset import TOKENIZED_DIR_ENV, tokenized_dataset

    prompts, responses = [PROMPT, PROMPT[:2], PROMPT], [RESPONSE, RESPONSE, "<answer>Up</answer>"]
    path = write_rows(tmp_path / "rows.parquet", prompts, responses)
    max_length = sorted(SpaSftDataset(str(path), tiny_tokenizer, max_length=10_000).lengths)[1]  # one row is cut
    monkeypatch.setenv(TOKENIZED_DIR_ENV, str(tmp_path / "shared"))
    (tmp_path / "shared").mkdir()
    written = tokenized_dataset("train", str(path), tiny_tokenizer, max_length=max_length)
    assert [p.name for p in (tmp_path / "shared").iterdir()] == ["train.pt"]

    tokenizations = []
    tokenize = SpaSftDataset._tokenize
    monkeypatch.setattr(SpaSftDataset, "_tokenize", lambda *a: tokenizations.append(1) or tokenize(*a))
    read = tokenized_dataset("train", str(path), tiny_tokenizer, max_length=max_length)
    assert tokenizations == []
    assert read.truncation_report == written.truncation_report and read.truncation_report.cuts
    assert len(read) == len(written) == 3
    for a, b in zip(read.samples, written.samples):
        assert a.input_ids.dtype == b.input_ids.dtype == torch.long and torch.equal(a.input_ids, b.input_ids)
        assert a.loss_mask.dtype == torch.long and torch.equal(a.loss_mask, b.loss_mask)
    assert (read.max_length, read.truncation, read.loss_target) == (written.max_length, written.truncation,
                                                                    written.loss_target)

    other = tokenized_dataset("train", str(path), tiny_tokenizer, max_length=max_length + 1)
    assert tokenizations == [1]  # another setting: tokenized again
    assert other.truncation_report.cuts == (written.truncation_report.cuts[0] - 1,)
    write_rows(path, prompts[:2], responses[:2])  # the file changed
    assert len(tokenized_dataset("train", str(path), tiny_tokenizer, max_length=max_length)) == 2
    monkeypatch.delenv(TOKENIZED_DIR_ENV)
    assert len(tokenized_dataset("train", str(path), tiny_tokenizer)) == 2 and len(tokenizations) == 3
    assert spa_sft_dataset.TOKENIZED_DIR_ENV == "SPA_SFT_TOKENIZED"  # the name sft/finetune_ft.sh exports
