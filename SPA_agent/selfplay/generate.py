"""Stage 1: self-play SFT data (spec §8).

The base model plays the TRAIN env groups in add_worldmodel mode for `data_gen.num_batches` rollouts. In every
assistant turn the imagined `<observation>` becomes the true state shown before the turn and the imagined
`<prediction>` the true state after the turn's executed actions (FrozenLake: the realized slip); later prompts
carry the corrected earlier turns. One row per assistant turn (docs/interfaces.md, "SFT data"), split into
wm_train/wm_val by trajectory, with a data card that records the model's own ("self-belief") accuracy.
The command line is `python -m SPA_agent.generate_sft_data` (SPA_agent/generate_sft_data.py).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from omegaconf import DictConfig, OmegaConf

from SPA_agent.entry import check_choice, check_number, load_tokenizer, model_load_errors, prepare_config
from SPA_agent.rollout.parsing import MODES as PROMPT_MODES
from SPA_agent.rollout.turns import EnvRecord, rendered_states, turns
from SPA_agent.runs import atomic_io, run_identity
from SPA_agent.runs.dir_lock import DirLock, check_unlocked, check_writable
from SPA_agent.runs.progress import progress_bar
from SPA_agent.selfplay.data_card import (
    CARD_FILE,
    PARTIAL_DIR,
    BatchStats,
    describe_files,
    render_data_card,
    trajectory_stats,
)
from SPA_agent.selfplay.data_variants import STATE_TARGETS, state_targets
from SPA_agent.selfplay.worldmodel import has_worldmodel_format, substitute_states
from SPA_agent.stages import DATA_FILES
from SPA_agent.stages import SPLITS as DATA_SPLITS

# Unfinished runs keep batch shards in PARTIAL_DIR; the new dataset is staged in PARTIAL_DIR/final.
OUTPUT_FILES = (*DATA_FILES, *(f"{split}.csv" for split in DATA_SPLITS), "raw_trajectories.jsonl", "config.yaml",
                "data_card.md", run_identity.IDENTITY_FILE, CARD_FILE)
MESSAGE_TYPE = pa.struct([("content", pa.string()), ("role", pa.string())])
SFT_SCHEMA = pa.schema([
    ("prompt", pa.list_(MESSAGE_TYPE)),
    ("response", pa.string()),
    ("data_source", pa.string()),
    ("ability", pa.string()),
    ("reward_model", pa.string()),
    ("extra_info", pa.string()),
    ("trajectory_id", pa.int64()),
    ("turn", pa.int64()),
    ("seed", pa.int64()),
    ("env_tag", pa.string()),
])


# --- ground-truth substitution ------------------------------------------------------------------------
def substitute_trajectory(messages: list[dict], true_states: list[str]) -> tuple[list[dict], list[bool]]:
    """Copy of `messages` with assistant turn t's observations set to `true_states[t]` and predictions to
    `true_states[t + 1]`; also returns, per assistant turn, whether it had any state block."""
    out, tagged, turn = [], [], 0
    for message in messages:
        if message["role"] == "assistant":
            sub = substitute_states(message["content"], true_states[turn], true_states[turn + 1])
            message = {"role": "assistant", "content": sub.text}
            tagged.append(sub.has_states)
            turn += 1
        out.append({"content": message["content"], "role": message["role"]})
    return out, tagged


def trajectory_rows(messages: list[dict], record: EnvRecord, trajectory_id: int, data_source: str) -> list[dict]:
    """One row per assistant message: the chat before it (substituted) and the message itself."""
    rows, turn = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        rows.append({
            "prompt": [dict(m) for m in messages[:i]], "response": message["content"],
            "data_source": data_source, "trajectory_id": trajectory_id, "turn": turn,
            "seed": int(record.seed), "env_tag": record.tag,
        })
        turn += 1
    return rows


def rollout_records(proxy, states: list[EnvRecord], first_id: int, env_types: Mapping[str, str],
                    targets: str = "ground_truth", seed: int = 0) -> tuple[list, list]:
    """Rows and raw trajectory records of one rollout; trajectory ids start at `first_id`. `targets` picks the
    states written into the model's blocks (data_variants.STATE_TARGETS; random draws seeded per trajectory)."""
    rows, trajectories = [], []
    for offset, record in enumerate(states):
        true_states, taken = rendered_states(record.history), turns(record.history)
        raw_messages = proxy.messages(record, normalized=True)
        written = state_targets(true_states, targets, np.random.default_rng([seed, first_id + offset]))
        messages = raw_messages if written is None else substitute_trajectory(raw_messages, written)[0]
        rows += trajectory_rows(messages, record, first_id + offset, env_types[record.tag])
        trajectories.append({
            "trajectory_id": first_id + offset, "tag": record.tag, "seed": int(record.seed),
            "messages": raw_messages, "true_states": true_states,
            "actions": [turn.actions for turn in taken],
            "rewards": [turn.reward for turn in taken],
            "success": record.metrics[f"{record.tag}/success"],
        })
    return rows, trajectories


def format_filtered(rows: list[dict]) -> list[dict]:
    """The rows whose response is in the world-model format (sft/filter_sft_by_tag.py's check, no de-duplication:
    the released FrozenLake and Sudoku data were filtered this way, spec §2.1, §8)."""
    return [row for row in rows if has_worldmodel_format(row["response"])]


# --- split and tables ---------------------------------------------------------------------------------
SPLITS = ("trajectory", "row")

def split_rows(rows: list[dict], by: str, val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, val). `trajectory`: a seeded permutation of trajectory ids, the first ⌈f·N⌉ to val, rows kept in
    order. `row`: sklearn's `train_test_split(test_size=f, random_state=seed)` order, reproduced with numpy."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"data_gen.val_fraction must be in [0, 1), got {val_fraction}")
    if by == "row":
        perm = np.random.RandomState(seed).permutation(len(rows))
        n_val = math.ceil(val_fraction * len(rows))
        return [rows[i] for i in perm[n_val:]], [rows[i] for i in perm[:n_val]]
    if by != "trajectory":
        raise ValueError(f"data_gen.split_by must be one of {SPLITS}, got {by!r}")
    ids = sorted({row["trajectory_id"] for row in rows})
    perm = np.random.RandomState(seed).permutation(len(ids))
    val_ids = {ids[i] for i in perm[: math.ceil(val_fraction * len(ids))]}
    return [r for r in rows if r["trajectory_id"] not in val_ids], [r for r in rows if r["trajectory_id"] in val_ids]


def rows_table(rows: list[dict], split: str, cfg: Mapping) -> pa.Table:
    """The rows as a table with `SFT_SCHEMA`; `extra_info` records the row index and split as the original."""
    columns: dict[str, list[Any]] = {name: [] for name in SFT_SCHEMA.names}
    for index, row in enumerate(rows):
        full = {**row, "ability": cfg["ability"], "reward_model": cfg["reward_model"],
                "extra_info": str({"index": index, "split": split})}
        for name in SFT_SCHEMA.names:
            columns[name].append(full[name])
    return pa.table(columns, schema=SFT_SCHEMA)


# --- identity and resumable batches ------------------------------------------------------------------
#: config keys that determine the dataset (the rest of the entry config belongs to other stages)
IDENTITY_KEYS = ("config_name", "render_mode", "seed", "custom_envs", "es_manager.train", "es_manager.format_penalty",
                 "agent_proxy", "ctx_manager", "actor_rollout_ref.rollout", "generator", "data_gen", "enable_response_mask")
#: keys under IDENTITY_KEYS that do not change the data (the model enters by checksum, not by path)
IGNORED_KEYS = ("data_gen.resume", "data_gen.output_dir")
FRESH_HINT = "pass data_gen.resume=false (the current dataset stays until the new one is complete)"


def data_identity(cfg: DictConfig) -> run_identity.RunIdentity:
    return run_identity.build_identity(OmegaConf.to_container(cfg, resolve=True),
                                       {"model": run_identity.model_checksum(cfg.model_path)},
                                       ignore=IGNORED_KEYS, include=IDENTITY_KEYS)


def dataset_state(out_dir: Path, identity: run_identity.RunIdentity, resume: bool) -> str:
    """`continue` (shards of this identity in .partial/), `complete` (the dataset of this identity is there) or
    `fresh`. With `resume`, a dataset or shards of another identity raise RunMismatchError."""
    if not resume:
        return "fresh"
    partial = out_dir / PARTIAL_DIR
    if partial.is_dir() and run_identity.check(partial, identity, FRESH_HINT):
        return "continue"
    if (out_dir / CARD_FILE).is_file():
        if run_identity.check(out_dir, identity, FRESH_HINT):
            return "complete"
        raise run_identity.RunMismatchError(f"{out_dir} holds a dataset without {run_identity.IDENTITY_FILE} (made "
                                            f"by an older version); to replace it {FRESH_HINT}")
    return "fresh"


def load_shards(partial: Path, num_batches: int) -> list[dict]:
    """Consecutive completed batch shards."""
    shards = []
    for b in range(num_batches):
        path = partial / f"batch_{b:05d}.json"
        if not path.is_file():
            break
        shards.append(atomic_io.read_json(path, "delete it to play that batch again, or pass data_gen.resume=false "
                                                "to start over"))
    return shards


def run_batches(cfg: DictConfig, proxy, partial: Path, resume: bool) -> list[dict]:
    """Play `num_batches` rollouts (continuing after the shards in `partial` when `resume`); one shard dict
    per batch, each also written to `partial`."""
    dg = cfg.data_gen
    shards = load_shards(partial, dg.num_batches) if resume else []
    if shards:
        proxy.load_state_dict(shards[-1]["proxy_state"])
        print(f"resuming after {len(shards)} completed batch(es) from {partial}")
    env_types = {tag: cfg.custom_envs[tag].env_type for tag in cfg.es_manager.train.env_configs.tags}
    for b in progress_bar(range(len(shards), dg.num_batches), desc="data batches", initial=len(shards),
                          total=dg.num_batches):
        rollout = proxy.rollout(val=False)
        first_id = b * len(rollout.states)
        rows, trajectories = rollout_records(proxy, rollout.states, first_id, env_types, dg.state_targets,
                                             dg.split_seed)
        shard = {"batch": b, "rows": rows, "trajectories": trajectories,
                 "stats": trajectory_stats(rollout.states).as_dict(), "proxy_state": proxy.state_dict()}
        if hasattr(proxy.generator, "card_stats"):  # the solver's planned/fallback turn counts
            shard["generator_stats"] = proxy.generator.card_stats()
        atomic_io.write_json(partial / f"batch_{b:05d}.json", shard)
        shards.append(shard)
    return shards


# --- outputs ------------------------------------------------------------------------------------------
def write_outputs(cfg: DictConfig, out_dir: Path, shards: list[dict]) -> dict:
    """wm_train/wm_val parquet (+csv), raw trajectories, config.yaml, then the data card, into `out_dir`."""
    dg = cfg.data_gen
    rows = [row for shard in shards for row in shard["rows"]]
    train, val = split_rows(rows, dg.split_by, dg.val_fraction, dg.split_seed)
    num_rows_before_filter = len(train) + len(val)
    if dg.format_filter:
        train, val = format_filtered(train), format_filtered(val)
        if not train:
            raise ValueError(f"the format filter kept no training row of {num_rows_before_filter}: the model "
                             "never answered in the world-model format; pass data_gen.format_filter=false")
    tables = dict(zip(DATA_SPLITS, (rows_table(train, "train", dg), rows_table(val, "test", dg)), strict=True))
    for name, table in tables.items():
        atomic_io.write_parquet(out_dir / f"{name}.parquet", table)
        if dg.write_csv:
            atomic_io.write_atomic(out_dir / f"{name}.csv",
                                   lambda tmp, t=table: t.to_pandas().to_csv(tmp, index=False))
    if dg.write_trajectories:
        atomic_io.write_jsonl(out_dir / "raw_trajectories.jsonl",
                              [t for shard in shards for t in shard["trajectories"]])
    atomic_io.write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    stats = BatchStats.merge(BatchStats.from_dict(shard["stats"]) for shard in shards)
    card = stats.card(cfg, generator_stats=merged_generator_stats(shards),
                      num_rows_before_format_filter=num_rows_before_filter, num_train=len(train),
                      num_val=len(val),
                      num_train_trajectories=len({r["trajectory_id"] for r in train}),
                      num_val_trajectories=len({r["trajectory_id"] for r in val}))
    card["files"] = describe_files(out_dir, DATA_FILES)
    atomic_io.write_text(out_dir / "data_card.md", render_data_card(card))
    atomic_io.write_json(out_dir / CARD_FILE, card)
    return card


def merged_generator_stats(shards: list[dict]) -> dict[str, int] | None:
    """The generator's counts summed over the batches, or None for generators that keep none."""
    parts = [shard["generator_stats"] for shard in shards if "generator_stats" in shard]
    if not parts:
        return None
    return {key: sum(part.get(key, 0) for part in parts) for key in sorted({k for part in parts for k in part})}


def publish(staging: Path, out_dir: Path) -> None:
    """Move the finished files from `staging` into `out_dir`: the old card goes first and the new one comes
    last, so a dataset never looks complete with a mix of old and new files; outputs of the old run that the
    new one does not write (a csv, the trajectories) are removed."""
    (out_dir / CARD_FILE).unlink(missing_ok=True)
    for name in OUTPUT_FILES:
        if name != CARD_FILE and not (staging / name).exists():
            (out_dir / name).unlink(missing_ok=True)
    for path in sorted(staging.iterdir()):
        if path.name != CARD_FILE:
            os.replace(path, out_dir / path.name)
    os.replace(staging / CARD_FILE, out_dir / CARD_FILE)


def generate(cfg: DictConfig) -> dict:
    """The whole stage for a prepared config (see `prepare_data_gen_config`); returns the data card.

    Model, generator and envs are checked before anything is written; batches go to `<output_dir>/.partial/`
    and the dataset replaces the old one only once complete (`publish`). One process at a time per directory.
    """
    from SPA_agent.generators import build_generator
    from SPA_agent.rollout.agent_proxy import LLMAgentProxy

    out_dir = Path(cfg.data_gen.output_dir)
    check_writable(out_dir)
    check_unlocked(out_dir)
    tokenizer = load_tokenizer(cfg.model_path)
    with model_load_errors(cfg.model_path):
        generator = build_generator(cfg.generator, cfg.model_path, tokenizer)
    proxy = LLMAgentProxy(cfg, generator, tokenizer, progress=True)
    identity = data_identity(cfg)
    with DirLock(out_dir):
        state = dataset_state(out_dir, identity, cfg.data_gen.resume)
        if state == "complete":
            print(f"{out_dir} already holds this dataset (same settings and model); data_gen.resume=false "
                  "generates it again")
            return atomic_io.read_json(out_dir / CARD_FILE, f"generate it again: {FRESH_HINT}")
        partial = out_dir / PARTIAL_DIR
        if state == "fresh":
            shutil.rmtree(partial, ignore_errors=True)
        run_identity.record(partial, identity)
        shards = run_batches(cfg, proxy, partial, resume=state == "continue")
        staging = partial / "final"
        shutil.rmtree(staging, ignore_errors=True)
        run_identity.record(staging, identity)
        card = write_outputs(cfg, staging, shards)
        publish(staging, out_dir)
        shutil.rmtree(partial)
    return card


def prepare_data_gen_config(cfg: DictConfig, config_name: str | None = None) -> DictConfig:
    """Entry config + the `data_gen` block (config/data_gen.yaml under any overrides), prompt mode forced."""
    cfg = prepare_config(cfg, "data_gen", config_name)
    check_choice(cfg, "data_gen.prompt_mode", PROMPT_MODES)
    cfg.ctx_manager.mode = cfg.data_gen.prompt_mode  # the one road: the context manager reads ctx_manager.mode
    check_data_gen_settings(cfg)
    return cfg


def check_data_gen_settings(cfg: DictConfig) -> None:
    """Every `data_gen` value the stage reads after its batches, checked before the first one: a typo found at
    the end would cost the whole generation and leave `.partial/` under settings the fixed rerun cannot use. Also
    that the generator can play the training envs (`generator=solver`: Sokoban only)."""
    from SPA_agent.generators import check_env_types

    dg = cfg.data_gen
    check_env_types(cfg.generator, {cfg.custom_envs[tag].env_type for tag in cfg.es_manager.train.env_configs.tags})
    check_number(cfg, "data_gen.num_batches", 1, integer=True)
    check_number(cfg, "data_gen.val_fraction", 0, 1, high_open=True)
    check_number(cfg, "data_gen.split_seed", 0, integer=True)
    if dg.split_by not in SPLITS:
        raise ValueError(f"data_gen.split_by must be one of {SPLITS}, got {dg.split_by!r}")
    if dg.state_targets not in STATE_TARGETS:
        raise ValueError(f"data_gen.state_targets must be one of {STATE_TARGETS}, got {dg.state_targets!r}")
    for key in ("format_filter", "write_csv", "write_trajectories", "resume"):
        if not isinstance(dg[key], bool):
            raise ValueError(f"data_gen.{key} must be true or false, got {dg[key]!r}")
