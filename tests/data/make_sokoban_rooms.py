"""Writes tests/data/sokoban_reference_rooms.json: rooms of the plain reference generator
(tests/envs/sokoban_reference.py, a transcription of spec §3.2) for fixed seeds, so the fast generator
can be checked against many seeds without rerunning the slow one.

Run from the repository root: `python tests/data/make_sokoban_rooms.py`.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))
from sokoban_reference import generate_room

CASES = [  # (name, dim, num_boxes, search_depth, seeds)
    ("6x6_1box", (6, 6), 1, 300, range(60)),
    ("6x6_2box_depth30", (6, 6), 2, 30, range(30)),
    ("10x10_2box", (10, 10), 2, 300, range(30)),
]


def main() -> None:
    out = {}
    for name, dim, num_boxes, depth, seeds in CASES:
        rooms = {}
        for seed in seeds:
            room = generate_room(seed, dim, num_boxes, depth)
            rooms[str(seed)] = None if room is None else [room[0].tolist(), room[1].tolist()]
        out[name] = {"dim": list(dim), "num_boxes": num_boxes, "search_depth": depth, "rooms": rooms}
    path = Path(__file__).with_name("sokoban_reference_rooms.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, separators=(",", ":")))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
