"""Reference numbers reported by the SPA paper (arXiv 2510.15047, Table 2 / Table 7): Pass@1 and Pass@8 in
percent, per model, method and environment. These are the paper's claims, shown beside our results by
`SPA_agent.report`; they are never written into a results file as if measured here."""

from __future__ import annotations

SOURCE = "SPA paper (arXiv 2510.15047), Table 2/7 — reported, not measured here"
ENVS = ("Sokoban", "FrozenLake", "Sudoku")
# Our env tags → the paper's environment names.
TAG_TO_ENV = {"SimpleSokoban": "Sokoban", "HarderSokoban": "Sokoban", "FrozenLake": "FrozenLake",
              "FrozenLake6x6": "FrozenLake", "Sudoku": "Sudoku"}


def _row(*values: float) -> dict[str, tuple[float, float]]:
    """Six numbers (Sokoban P@1, P@8, FrozenLake P@1, P@8, Sudoku P@1, P@8) → {env: (pass@1, pass@8)}."""
    return {env: (values[2 * i], values[2 * i + 1]) for i, env in enumerate(ENVS)}


# {model: {method: {env: (pass@1 %, pass@8 %)}}}
MAIN_RESULTS: dict[str, dict[str, dict[str, tuple[float, float]]]] = {
    "Qwen2.5-0.5B-Instruct": {
        "base": _row(5.5, 25.8, 8.1, 32.8, 0.0, 0.0),
        "Vanilla RL (PPO)": _row(16.9, 35.9, 22.8, 30.1, 0.0, 0.0),
        "State Estimation (step 0)": _row(5.2, 25.4, 6.7, 28.5, 0.1, 0.8),
        "State Estimation RL": _row(20.4, 38.7, 24.2, 26.6, 4.5, 14.1),
        "SPA SFT (step 0)": _row(1.8, 11.7, 3.1, 15.6, 0.1, 0.8),
        "VAGEN": _row(33.3, 44.9, 25.8, 40.6, 0.1, 0.8),
        "SPA": _row(36.7, 45.3, 46.9, 65.6, 18.2, 43.8),
    },
    "Qwen2.5-1.5B-Instruct": {
        "base": _row(16.3, 47.3, 17.2, 49.2, 1.6, 11.3),
        "Vanilla RL (PPO)": _row(25.6, 34.0, 22.1, 30.7, 0.0, 0.0),
        "State Estimation (step 0)": _row(15.7, 43.8, 18.6, 51.2, 0.3, 2.3),
        "State Estimation RL": _row(52.7, 53.9, 27.6, 34.8, 39.1, 72.3),
        "SPA SFT (step 0)": _row(8.3, 36.7, 9.8, 43.8, 3.5, 24.2),
        "VAGEN": _row(44.5, 50.0, 37.7, 43.0, 0.0, 0.0),
        "SPA": _row(59.8, 69.5, 70.9, 75.0, 59.6, 94.9),
    },
    "Qwen2.5-3B (FrozenLake 6x6)": {
        "base": _row(12.5, 35.9, 6.9, 26.9, 0.0, 0.0),
        "Vanilla RL (PPO)": _row(31.4, 35.5, 7.6, 16.0, 0.0, 0.0),
        "State Estimation (step 0)": _row(9.9, 39.3, 6.9, 26.6, 0.1, 0.8),
        "State Estimation RL": _row(26.2, 27.7, 24.7, 35.5, 24.1, 26.2),
        "SPA SFT (step 0)": _row(6.0, 29.7, 1.6, 10.5, 0.3, 2.7),
        "VAGEN": _row(31.9, 43.0, 30.7, 34.0, 0.0, 0.0),
        "SPA": _row(49.7, 58.2, 41.3, 46.1, 69.9, 89.8),
    },
    "LLaMA3.2-1B-Instruct": {
        "base": _row(8.3, 33.2, 10.2, 41.0, 0.0, 0.0),
        "Vanilla RL (PPO)": _row(21.2, 39.8, 10.8, 24.6, 0.1, 1.2),
        "State Estimation RL": _row(31.6, 44.1, 19.3, 29.7, 45.0, 71.1),
        "VAGEN": _row(47.4, 50.8, 24.5, 29.3, 0.1, 0.8),
        "SPA": _row(53.0, 68.0, 64.8, 71.1, 81.3, 100.0),
    },
    "GPT-OSS-20B (prompted)": {
        "base": _row(45.8, 84.4, 68.8, 100.0, 61.8, 100.0),
        "State Estimation": _row(55.1, 89.1, 73.3, 100.0, 68.1, 100.0),
    },
}

# Model presets (`model_size`) → the paper's model row.
MODEL_SIZE_TO_PAPER = {
    "0.5B": "Qwen2.5-0.5B-Instruct", "1.5B": "Qwen2.5-1.5B-Instruct", "3B": "Qwen2.5-3B (FrozenLake 6x6)",
    "llama1B": "LLaMA3.2-1B-Instruct",
}

# Paper rows of the named experiments (`experiment_info.paper` in config/experiment/*.yaml).
# A main-table row: the method's numbers per model and env come from MAIN_RESULTS.
MAIN_ROWS = {
    "Table 2/7: Vanilla RL (PPO)": "Vanilla RL (PPO)",
    "Table 2/7: State Estimation RL": "State Estimation RL",
    "Table 2/7: SPA": "SPA",
    "Table 7: SPA, Qwen2.5-3B on FrozenLake 6x6": "SPA",
}
# An ablation reported for one model and env: (paper model or None where the table does not name it, paper env,
# pass@1 %, pass@k %, k).
ABLATION_ROWS: dict[str, tuple[str | None, str, float, float, int | str]] = {
    "Table 3: SPA with self-belief SFT": ("Qwen2.5-1.5B-Instruct", "Sokoban", 39.2, 44.2, 8),
    "Table 4: SPA w/o State Estimation": ("Qwen2.5-1.5B-Instruct", "Sokoban", 36.3, 40.6, 8),
    "Table 5: SPA, 1-epoch SFT": ("Qwen2.5-1.5B-Instruct", "Sokoban", 29.2, 52.7, 8),
    "Table 5: SPA, 1-epoch SFT on random-action data": ("Qwen2.5-1.5B-Instruct", "Sokoban", 0.14, 0.39, 8),
    "Table 5: SPA, 5-epoch SFT on random-action data": ("Qwen2.5-1.5B-Instruct", "Sokoban", 20.2, 50.0, 8),
    "Table 6: Sokoban simple -> complex": (None, "Sokoban", 0.9, 3.1, "k"),
    "Table 6: Sokoban -> FrozenLake": (None, "FrozenLake", 15.9, 49.2, "k"),
    "Fig. 9: Easy2Hard SPA (FrozenLake 4x4 -> 6x6)": ("Qwen2.5-3B (FrozenLake 6x6)", "FrozenLake", 32.6, 35.9, 8),
}
# Rows the paper shows only in a figure, and our additions: no numbers to compare with.
NO_NUMBERS = (
    "§4.1 Fig. 4: states masked in SFT",
    "§4.2 Fig. 5: random coordinates",
    "§4.3 Fig. 8: SFT without format filtering",
    "Beyond the paper: SPA with GRPO advantages",
    "Beyond the paper: SPA with bi-level GAE",
    "Beyond the paper: SPA on shortest-path solver data",
)
PAPER_ROWS = (*MAIN_ROWS, *ABLATION_ROWS, *NO_NUMBERS)


def paper_numbers(row: str, model: str | None, env: str) -> str:
    """The paper's numbers of `row` for a run of `model` (a MAIN_RESULTS key, None = unknown) on `env`, as text:
    "P@1 59.8 / P@8 69.5", "figure only", or "—" where the paper reports that row for another model or env."""
    if row in MAIN_ROWS:
        values = MAIN_RESULTS.get(model or "", {}).get(MAIN_ROWS[row], {}).get(env)
        return f"P@1 {values[0]:.1f} / P@8 {values[1]:.1f}" if values else "—"
    if row in ABLATION_ROWS:
        paper_model, paper_env, pass1, passk, k = ABLATION_ROWS[row]
        if env != paper_env or (paper_model is not None and model != paper_model):
            return "—"
        return f"P@1 {pass1:g} / P@{k} {passk:g}"
    return "figure only" if row in NO_NUMBERS[:3] else "not in the paper"
