"""Stage 1: self-play SFT data (spec §8). The command line; the stage itself is SPA_agent/selfplay/generate.py.

    python -m SPA_agent.generate_sft_data --config-name _2_sokoban model=tiny generator=random \
        data_gen.num_batches=2 data_gen.output_dir=/tmp/sft
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from SPA_agent.config import CONFIG_DIR
from SPA_agent.entry import apply_system_env, exit_on_interrupt, exit_on_user_error, hydra_entry
from SPA_agent.runs.progress import quiet_library_progress
from SPA_agent.selfplay.data_card import PARTIAL_DIR, render_data_card
from SPA_agent.selfplay.generate import generate, prepare_data_gen_config


@hydra_entry(CONFIG_DIR)
def main(cfg: DictConfig) -> None:
    quiet_library_progress()
    with exit_on_user_error():
        cfg = prepare_data_gen_config(cfg)
    resume_hint = (f"finished batches are kept in {Path(cfg.data_gen.output_dir) / PARTIAL_DIR}; the same command "
                   "continues after them (data_gen.resume=true; RESUME=1 in the scripts)")
    with exit_on_user_error(), exit_on_interrupt(resume_hint):
        apply_system_env(cfg)
        card = generate(cfg)
    print(render_data_card(card))
    print(f"data written to {cfg.data_gen.output_dir}")


if __name__ == "__main__":
    main()
