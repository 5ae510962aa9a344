"""Sokoban room generation: ours (SPA_agent.envs.sokoban_room) against gym-sokoban's `generate_room`.

Both run on the same seeds (global `random` and `numpy.random` seeded per room, as the env does) and the
rooms must be identical; the script stops with an error otherwise. gym-sokoban is only needed here:

    pip install --no-deps gym-sokoban      # its package __init__ needs the old `gym`; we load one file
    python benchmarks/env_reset.py [--seeds 20] [--repeats 3] [--gym-sokoban-dir DIR]

gym-sokoban 0.0.6 searches with 8 reverse actions (4 pulls, then 4 moves that never pull); spec §3.2 and
our generator use the 4 pulls only. The equality check and the `ratio` lines therefore use gym-sokoban's
module with its action table restricted to the 4 pulls (`gym_sokoban_4`); the unmodified module
(`gym_sokoban_8`) is timed too, for reference. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import numpy as np

from SPA_agent.envs.sokoban_room import generate_room

CASES = {"SimpleSokoban": ((6, 6), 1), "HarderSokoban": ((10, 10), 2)}  # tag -> (dim, num_boxes)


def load_room_utils(directory: str | None) -> ModuleType:
    """gym-sokoban's `envs/room_utils.py` as a standalone module (importing the package needs `gym`)."""
    if directory is None:
        spec = importlib.util.find_spec("gym_sokoban")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "gym-sokoban not found: `pip install --no-deps gym-sokoban` or pass --gym-sokoban-dir"
            )
        directory = spec.submodule_search_locations[0]
    path = Path(directory) / "envs" / "room_utils.py"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist; --gym-sokoban-dir must be the gym_sokoban package folder"
        )
    module_spec = importlib.util.spec_from_file_location("gym_sokoban_room_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def run_seeds(generate: Callable[[], object], seeds: list[int]) -> tuple[float, list]:
    """Seconds for one pass over `seeds`, and each seed's (structure, state) or None if it has no room."""
    rooms = []
    start = time.perf_counter()
    for seed in seeds:
        random.seed(seed)
        np.random.seed(seed)
        try:
            rooms.append(generate())
        except (RuntimeError, RuntimeWarning):
            rooms.append(None)
    return time.perf_counter() - start, rooms


def as_pair(room) -> tuple[list, list] | None:
    if room is None:
        return None
    if isinstance(room, tuple):
        return np.asarray(room[0]).tolist(), np.asarray(room[1]).tolist()
    return room.structure.tolist(), room.state.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=20, help="rooms per pass (seeds 10000, 10001, ...)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per implementation")
    parser.add_argument(
        "--gym-sokoban-dir", default=None, help="gym_sokoban package folder (default: installed)"
    )
    args = parser.parse_args()
    try:
        room_utils_8 = load_room_utils(args.gym_sokoban_dir)
        room_utils_4 = load_room_utils(args.gym_sokoban_dir)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    room_utils_4.ACTION_LOOKUP = {k: v for k, v in room_utils_8.ACTION_LOOKUP.items() if k < 4}
    seeds = list(range(10000, 10000 + args.seeds))
    for tag, (dim, num_boxes) in CASES.items():
        num_steps = int(1.7 * sum(dim))
        impls = {
            "ours": partial(generate_room, dim, num_steps, num_boxes, 300, player_walk=False),
            "gym_sokoban_4": partial(
                room_utils_4.generate_room, dim, num_steps=num_steps, num_boxes=num_boxes
            ),
            "gym_sokoban_8": partial(
                room_utils_8.generate_room, dim, num_steps=num_steps, num_boxes=num_boxes
            ),
        }
        totals, rooms = {}, {}
        for name, generate in impls.items():
            run_seeds(generate, seeds[:2])  # warm-up
            passes = [run_seeds(generate, seeds) for _ in range(args.repeats)]
            totals[name] = [seconds for seconds, _ in passes]
            rooms[name] = [as_pair(room) for room in passes[0][1]]
            print(
                json.dumps(
                    {
                        "metric": "room_generation_ms_per_room",
                        "env": tag,
                        "impl": name,
                        "rooms": len(seeds),
                        "median": 1000 * statistics.median(totals[name]) / len(seeds),
                        "min": 1000 * min(totals[name]) / len(seeds),
                        "max": 1000 * max(totals[name]) / len(seeds),
                        "unit": "ms",
                    }
                ),
                flush=True,
            )
        if rooms["ours"] != rooms["gym_sokoban_4"]:
            bad = [s for s, a, b in zip(seeds, rooms["ours"], rooms["gym_sokoban_4"]) if a != b]
            raise SystemExit(f"{tag}: rooms differ from gym-sokoban (4 pull actions) for seeds {bad}")
        for reference in ("gym_sokoban_4", "gym_sokoban_8"):
            print(
                json.dumps(
                    {
                        "metric": "room_generation_speedup",
                        "env": tag,
                        "reference": reference,
                        "ratio": statistics.median(totals[reference]) / statistics.median(totals["ours"]),
                        "identical_rooms": reference == "gym_sokoban_4" or rooms["ours"] == rooms[reference],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
