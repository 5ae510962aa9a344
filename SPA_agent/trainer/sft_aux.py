"""PPO-ptx (InstructGPT): the SFT cross-entropy on rows of the SFT data, added to the actor's PPO loss.

An opt-in deviation from the paper (`actor_rollout_ref.actor.sft_aux_coef`, 0 = off; docs/ppo.md "Keeping the
world model: the SFT loss during PPO"). The rows are tokenized and masked by the SFT's own dataset
(`sft.spa_sft_dataset.SpaSftDataset`, with the SFT config's data defaults), collated and scored by its own
`sft.packing` functions, so they train exactly the tokens the SFT trained. Which rows an optimizer step draws is
a pure function of (trainer.seed, update, mini-batch), so a resumed run (whose update count comes back with the
actor's LR schedule) draws the same rows without any state of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

import sft.packing
from sft.packing import collate_packed, collate_padded, count_loss_tokens, plan_packed
from sft.spa_sft_dataset import SpaSftDataset

#: the SFT's config, whose data defaults (max_length, truncation, loss_target, keys) tokenize the rows here as there
SFT_CONFIG = Path(sft.packing.__file__).parent / "config" / "sft_trainer.yaml"
SFT_DATA_KEYS = ("max_length", "truncation", "loss_target", "prompt_key", "response_key")


def sft_data_settings() -> dict:
    """SpaSftDataset's keyword arguments as the SFT config's `data` group sets them by default."""
    data = OmegaConf.load(SFT_CONFIG).data
    return {key: data[key] for key in SFT_DATA_KEYS}


def draw_rows(n_rows: int, rows: int, seed: int, update: int, mini_batch: int) -> list[int]:
    """`rows` row indices of a data set of `n_rows`, a pure function of (seed, update, mini_batch): without
    repeats up to `n_rows` (a permutation's head; more rows than that take further permutations)."""
    rng = np.random.default_rng([seed, update, mini_batch])
    order = np.concatenate([rng.permutation(n_rows) for _ in range(-(-rows // n_rows))])
    return order[:rows].tolist()


class SftAuxData:
    """The SFT rows of the auxiliary loss and their micro-batches.

    files: the SFT parquet(s); tokenizer: the actor's; rows: rows per optimizer step; packed: collate as one
    padding-free row per micro-batch (the actor's packed attention) rather than right-padded rows; token_budget:
    the most tokens a micro-batch holds (the actor's ppo_max_token_len_per_gpu; a longer row runs alone)."""

    def __init__(self, files: str | Sequence[str], tokenizer, rows: int, seed: int, packed: bool, token_budget: int):
        self.data = SpaSftDataset(files, tokenizer, **sft_data_settings())
        self.rows, self.seed, self.packed = rows, seed, packed
        self.token_budget = max(token_budget, *self.data.lengths)  # a longer row runs alone
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def indices(self, update: int, mini_batch: int) -> list[int]:
        """The rows drawn for mini-batch `mini_batch` of actor update `update` (0-based)."""
        return draw_rows(len(self.data), self.rows, self.seed, update, mini_batch)

    def micro_batches(self, update: int, mini_batch: int) -> tuple[list[dict[str, torch.Tensor]], int]:
        """The collated micro-batches of those rows (input_ids, position_ids, labels, and attention_mask when
        padded; on the host) and their number of loss tokens."""
        plan = plan_packed(self.indices(update, mini_batch), self.data.lengths, 1, self.token_budget)[0]
        collate = collate_packed if self.packed else collate_padded
        batches = [collate([self.data[i] for i in micro], self.pad_id) for micro in plan]
        return batches, sum(count_loss_tokens(batch) for batch in batches)
