"""Sokoban room generation: ours (SPA_agent.envs.sokoban_room) against the plain reference generator.

The reference is `tests/envs/sokoban_reference.py`, a slow transcription of spec §3.2 as written (RAGEN's
generator: numpy grids copied at every reverse move, a recursive search, `marshal` keys), the same one
the test fixtures come from. Both run on the same seeds (global `random` and `numpy.random` seeded per
room, as the env does), stages 1-3 only (no player walk), and the rooms must be identical; the script
stops with an error otherwise.

    python benchmarks/env_reset.py [--seeds 20] [--repeats 3] [--gym-sokoban-dir DIR]

If gym-sokoban is installed (`pip install --no-deps gym-sokoban`; only this file is loaded, its package
needs the old `gym`) or `--gym-sokoban-dir` names its package folder, its `generate_room` is timed too.
It is a different algorithm: gym-sokoban 0.0.6 passes the old `last_pull` down the search, so it counts
every pull as a box swap, and its rooms differ from spec §3.2 for some seeds (the output lists them).
Its search visits the same states, so its time is still comparable. `gym_sokoban_4` is its module with
the action table cut to the 4 pulls of spec §3.2; `gym_sokoban_8` is unmodified (4 pulls + 4 moves that
never pull). Prints one JSON line per measurement.
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

# This checkout's generator and reference, whatever `SPA_agent` the environment has installed.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "envs")]
from sokoban_reference import generate_room_core as reference_generate_room  # noqa: E402

from SPA_agent.envs.sokoban_room import generate_room  # noqa: E402

CASES = {"SimpleSokoban": ((6, 6), 1), "HarderSokoban": ((10, 10), 2)}  # tag -> (dim, num_boxes)


def load_room_utils(directory: str | None) -> ModuleType | None:
    """gym-sokoban's `envs/room_utils.py` as a standalone module (importing the package needs `gym`);
    None when no `directory` is given and gym-sokoban is not installed."""
    if directory is None:
        spec = importlib.util.find_spec("gym_sokoban")
        if spec is None or not spec.submodule_search_locations:
            return None
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


def implementations(dim, num_boxes, gym_dir: str | None) -> dict[str, Callable[[], object]]:
    """name -> room generator of stages 1-3 for `dim`, `num_boxes` and search depth 300."""
    num_steps = int(1.7 * sum(dim))
    impls = {
        "ours": partial(generate_room, dim, num_steps, num_boxes, 300, player_walk=False),
        "reference": partial(reference_generate_room, dim, num_steps, num_boxes, 300),
    }
    room_utils_8, room_utils_4 = load_room_utils(gym_dir), load_room_utils(gym_dir)
    if room_utils_8 is not None:
        room_utils_4.ACTION_LOOKUP = {k: v for k, v in room_utils_8.ACTION_LOOKUP.items() if k < 4}
        for name, module in (("gym_sokoban_4", room_utils_4), ("gym_sokoban_8", room_utils_8)):
            impls[name] = partial(module.generate_room, dim, num_steps=num_steps, num_boxes=num_boxes)
    return impls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=20, help="rooms per pass (seeds 10000, 10001, ...)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per implementation")
    parser.add_argument(
        "--gym-sokoban-dir", default=None, help="gym_sokoban package folder (default: installed, if any)"
    )
    args = parser.parse_args()
    if args.seeds < 1 or args.repeats < 1:
        parser.error("--seeds and --repeats must be at least 1")
    seeds = list(range(10000, 10000 + args.seeds))
    for tag, (dim, num_boxes) in CASES.items():
        try:
            impls = implementations(dim, num_boxes, args.gym_sokoban_dir)
        except FileNotFoundError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        totals, rooms = {}, {}
        for name, generate in impls.items():
            run_seeds(generate, seeds[:2])  # warm-up
            passes = [run_seeds(generate, seeds) for _ in range(args.repeats)]
            totals[name] = [seconds for seconds, _ in passes]
            rooms[name] = [as_pair(room) for room in passes[0][1]]
            print(json.dumps(timing_line(tag, name, totals[name], len(seeds))), flush=True)
        if rooms["ours"] != rooms["reference"]:
            bad = [s for s, a, b in zip(seeds, rooms["ours"], rooms["reference"]) if a != b]
            raise SystemExit(f"{tag}: rooms differ from the spec §3.2 reference for seeds {bad}")
        for other in list(impls)[1:]:  # every implementation after "ours"
            differing = [s for s, a, b in zip(seeds, rooms["ours"], rooms[other]) if a != b]
            line = {
                "metric": "room_generation_speedup",
                "env": tag,
                "reference": other,
                "ratio": statistics.median(totals[other]) / statistics.median(totals["ours"]),
                "identical_rooms": not differing,
                "differing_seeds": differing,
            }
            print(json.dumps(line), flush=True)


def timing_line(tag: str, name: str, seconds: list[float], rooms: int) -> dict:
    """The JSON record of one implementation's timed passes, in ms per room."""
    return {
        "metric": "room_generation_ms_per_room",
        "env": tag,
        "impl": name,
        "rooms": rooms,
        "median": 1000 * statistics.median(seconds) / rooms,
        "min": 1000 * min(seconds) / rooms,
        "max": 1000 * max(seconds) / rooms,
        "unit": "ms",
    }


if __name__ == "__main__":
    main()
