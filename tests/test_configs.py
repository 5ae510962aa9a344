"""The Hydra configs: every entry config composes with every model preset and generator, resolves, and (on the
tiny preset) passes the PPO checks; the SFT config composes; and every key is documented by a comment line
directly above it (as verl checks for its ppo_trainer.yaml)."""

from __future__ import annotations

import pytest
import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from SPA_agent.config import CONFIG_DIR, ENTRY_CONFIGS, compose
from SPA_agent.trainer.config_checks import check_config

REPO = CONFIG_DIR.parent
SFT_CONFIG_DIR = REPO / "sft" / "config"
MODEL_PRESETS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
GENERATORS = sorted(p.stem for p in (CONFIG_DIR / "generator").glob("*.yaml"))
ENVS_FILE = CONFIG_DIR / "envs.yaml"
#: files where every key needs its own comment: all of config/ but envs.yaml, and the SFT config
DOCUMENTED_FILES = sorted(
    [p for p in CONFIG_DIR.rglob("*.yaml") if p != ENVS_FILE] + list(SFT_CONFIG_DIR.glob("*.yaml"))
)


def test_the_documented_presets_and_generators_exist():
    assert {"tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "llama3.2-1b", "qwen3-1.7b"} <= set(MODEL_PRESETS)
    assert {"hf", "vllm", "api", "random"} <= set(GENERATORS)


# --------------------------------------------------------------------------------------------------------
# Composition
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("model", MODEL_PRESETS)
@pytest.mark.parametrize("config_name", ENTRY_CONFIGS)
def test_entry_config_composes_and_resolves(config_name, model, generator):
    cfg = compose(config_name, [f"model={model}", f"generator={generator}"])
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    preset = OmegaConf.load(CONFIG_DIR / "model" / f"{model}.yaml")
    assert resolved["model_path"] == preset.model_path
    assert resolved["actor_rollout_ref"]["model"]["path"] == resolved["critic"]["model"]["path"] == preset.model_path
    assert resolved["generator"]["name"] == generator
    rollout = resolved["actor_rollout_ref"]["rollout"]
    assert resolved["generator"].get("max_new_tokens", rollout["response_length"]) == rollout["response_length"]
    for split in ("train", "val"):
        for tag in resolved["es_manager"][split]["env_configs"]["tags"]:
            assert resolved["custom_envs"][tag]["env_config"]["render_mode"] == resolved["render_mode"]


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("config_name", ENTRY_CONFIGS)
def test_tiny_entry_config_passes_the_ppo_checks(config_name, generator):
    check_config(compose(config_name, ["model=tiny", f"generator={generator}"]))


def _compose_sft(overrides: list[str]):
    with initialize_config_dir(config_dir=str(SFT_CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="sft_trainer", overrides=overrides)


def test_sft_config_composes_and_only_the_training_files_are_required():
    assert OmegaConf.missing_keys(_compose_sft([])) == {"data.train_files"}
    cfg = _compose_sft(["data.train_files=wm_train.parquet", "model.partial_pretrain=tiny"])
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert resolved["data"]["train_files"] == "wm_train.parquet"
    assert resolved["model"]["partial_pretrain"] == "tiny"


# --------------------------------------------------------------------------------------------------------
# Documentation: a comment line directly above every key
# --------------------------------------------------------------------------------------------------------


def key_lines(text: str) -> list[tuple[tuple[str, ...], int]]:
    """(key path, 0-based line) of every key of a block-style mapping in a YAML document, in file order.

    Keys inside flow mappings (`{a: 1}`) and text inside block scalars are not keys of the file's layout and
    are skipped; keys of mappings inside sequences (Hydra's `- model: tiny`) are included.
    """
    found: list[tuple[tuple[str, ...], int]] = []

    def walk(node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode) and not node.flow_style:
            for key, value in node.value:
                found.append(((*path, str(key.value)), key.start_mark.line))
                walk(value, (*path, str(key.value)))
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                walk(item, path)

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, ())
    return sorted(found, key=lambda item: item[1])


def _has_comment_above(lines: list[str], line: int) -> bool:
    return line > 0 and lines[line - 1].lstrip().startswith("#")


def undocumented_keys(text: str) -> list[str]:
    """Dotted paths of the keys whose line is not directly below a comment line."""
    lines = text.splitlines()
    return [".".join(path) for path, line in key_lines(text) if not _has_comment_above(lines, line)]


def undocumented_env_keys(text: str) -> list[str]:
    """envs.yaml rule: `custom_envs` and every tag need a comment above them; a key inside the tags (env_type,
    env_config.dim_x, …) needs one above at least one of its occurrences, so repeated blocks stay compact."""
    lines = text.splitlines()
    missing, documented_kinds, first_seen = [], set(), {}
    for path, line in key_lines(text):
        if len(path) <= 2:
            if not _has_comment_above(lines, line):
                missing.append(".".join(path))
            continue
        kind = ".".join(path[2:])
        first_seen.setdefault(kind, ".".join(path))
        if _has_comment_above(lines, line):
            documented_kinds.add(kind)
    return missing + [first_seen[kind] for kind in first_seen if kind not in documented_kinds]


@pytest.mark.parametrize("path", DOCUMENTED_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_key_has_a_comment_above_it(path):
    missing = undocumented_keys(path.read_text(encoding="utf-8"))
    assert not missing, f"{path.relative_to(REPO)}: add a comment line directly above {missing}"


def test_every_env_tag_and_env_key_kind_is_documented():
    missing = undocumented_env_keys(ENVS_FILE.read_text(encoding="utf-8"))
    assert not missing, f"config/envs.yaml: add a comment line directly above {missing}"


def test_the_documentation_check_finds_keys_without_a_comment():
    text = (
        "# section\n"
        "a:\n"
        "  # documented\n"
        "  b: 1\n"
        "  c: {x: 1}\n"
        "  # a prompt\n"
        "  d: |-\n"
        "    text: that looks like a key\n"
        "\n"
        "  # a blank line separates this comment from e\n"
        "\n"
        "  e: 2\n"
        "# list\n"
        "defaults:\n"
        "  - model: tiny\n"
    )
    assert undocumented_keys(text) == ["a.c", "a.e", "defaults.model"]


def test_the_envs_check_needs_each_tag_and_each_key_kind_once():
    text = (
        "# tags\n"
        "custom_envs:\n"
        "  # first\n"
        "  A:\n"
        "    # kind\n"
        "    env_type: x\n"
        "    env_config:\n"
        "      # size\n"
        "      size: 4\n"
        "  B:\n"
        "    env_type: y\n"
        "    env_config:\n"
        "      size: 6\n"
    )
    assert undocumented_env_keys(text) == ["custom_envs.B", "custom_envs.A.env_config"]
