"""The model-size table (SPA_agent/model_presets.py): one row per script MODEL, read by the bash scripts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from SPA_agent.config import compose
from SPA_agent.model_presets import NAMED_MODELS, SCRIPT_MODELS, main, script_model, script_models


def test_every_row_names_a_preset_whose_model_size_is_the_script_name():
    models = script_models()
    assert list(models) == ["0.5B", "1.5B", "3B", "llama1B", "tiny", "small", "smollm2-135m"]
    for name, row in models.items():
        cfg = compose("_2_sokoban", [f"model={row.preset}"])
        assert cfg.model_size == name and cfg.model_path == row.sft_model()
    assert len({row.preset for row in SCRIPT_MODELS}) == len(SCRIPT_MODELS)
    assert set(NAMED_MODELS) == {"tiny", "small", "smollm2-135m"}


def test_shell_assignments_and_lookup(capsys):
    assert main(["lookup", "tiny", "sft_max_length"]) == 0 and capsys.readouterr().out == "4096\n"
    assert main(["shell", "llama1B"]) == 0
    out = capsys.readouterr().out
    assert "MODEL_PRESET=llama3.2-1b\n" in out and "MODEL_SFT_MODEL=meta-llama/Llama-3.2-1B-Instruct\n" in out
    assert "MODEL_IN_PAPER=1\n" in out and script_model("tiny").in_paper is False


def test_an_unknown_name_is_one_line():
    result = subprocess.run([sys.executable, "-m", "SPA_agent.model_presets", "shell", "7B"], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 2 and not result.stdout
    assert result.stderr == ("error: unknown MODEL '7B'; choose one of 0.5B, 1.5B, 3B, llama1B, tiny, small, "
                             "smollm2-135m\n")
    with pytest.raises(ValueError, match="unknown model size 'x'"):
        script_model("x", "model size")
