"""The "no world model" variant of a stage-1 dataset on disk: every row of a world-model dataset as the base prompt
mode shows the same turn (`data_variants.without_worldmodel_row`: base instruction and format sentence, no
`<observation>`/`<prediction>` blocks), the same trajectories and turns. The control of issue 13 (spa_arms' arm b)
and the format-only row of issue 43 train on it.

    python -m SPA_agent.selfplay.without_worldmodel --config-name _2_sokoban SOURCE TARGET [overrides...]

SOURCE is a complete stage-1 dataset (its data card); TARGET gets wm_train.parquet, wm_val.parquet and a data card
naming SOURCE's, written last, so SFT refuses TARGET while it is incomplete. An existing TARGET is replaced. The
overrides (e.g. `model=smollm2-135m`) compose the config whose env instructions the rows were written with.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from SPA_agent import stages
from SPA_agent.runs import atomic_io
from SPA_agent.selfplay.data_card import check_dataset_complete, describe_files
from SPA_agent.selfplay.data_variants import without_worldmodel_row


def write_without_worldmodel(source: Path, target: Path, envs: Mapping) -> dict[str, int]:
    """TARGET's splits: SOURCE's rows in the base format, for `envs` (the config's `custom_envs`: each row's env tag
    gives its two instructions). The data card comes last; returns the rows written per split."""
    for name in stages.DATA_FILES:
        check_dataset_complete(source / name)
    target.mkdir(parents=True, exist_ok=True)
    (target / stages.CARD_FILE).unlink(missing_ok=True)  # an older TARGET is incomplete until the new card is there
    counts = {}
    for split in stages.SPLITS:
        table = pq.read_table(source / f"{split}.parquet")
        rows = table.to_pylist()
        for row in rows:
            if row["env_tag"] not in envs:
                raise ValueError(f"{source} has rows of env tag {row['env_tag']!r}, which the config does not define")
            env = envs[row["env_tag"]]
            row["prompt"], row["response"] = without_worldmodel_row(
                row["prompt"], row["response"], env.env_instruction_add_worldmodel, env.env_instruction)
        atomic_io.write_parquet(target / f"{split}.parquet", pa.Table.from_pylist(rows, schema=table.schema))
        counts[split] = len(rows)
    atomic_io.write_json(target / stages.CARD_FILE, {
        "stage": "world-model rows without world model (SPA_agent.selfplay.data_variants.without_worldmodel_row)",
        "source": source.name, "rows": counts, "files": describe_files(target, list(stages.DATA_FILES)),
        "source_card": json.loads((source / stages.CARD_FILE).read_text(encoding="utf-8"))})
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", required=True, help="entry config of the data, e.g. _2_sokoban")
    parser.add_argument("source", type=Path, help="a complete stage-1 dataset (world-model rows)")
    parser.add_argument("target", type=Path, help="where the rows without world model go (replaced)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=smollm2-135m")
    args = parser.parse_args(argv)
    from SPA_agent.config import compose
    from SPA_agent.entry import EXIT_USAGE, USER_ERRORS

    try:
        if args.source.resolve() == args.target.resolve():
            raise ValueError(f"the target {args.target} is the source: choose another directory")
        envs = compose(args.config_name, args.overrides).custom_envs
        counts = write_without_worldmodel(args.source, args.target, envs)
    except USER_ERRORS as err:
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return EXIT_USAGE
    print(f"data without world model written to {args.target} ({counts})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
