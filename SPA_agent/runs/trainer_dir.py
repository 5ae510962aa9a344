"""A trainer's output directory (`trainer.default_local_dir` of SFT and PPO): what every trainer writes there, the
config keys that never change what it writes, and each trainer's additions, declared once as a `TrainerDir`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from SPA_agent.runs import run_identity
from SPA_agent.runs.checkpoints import STAGING_GLOB, STEP_GLOB
from SPA_agent.runs.metrics_logger import METRICS_FILE

#: what every trainer writes into its output directory: checkpoints (complete and staged), the metric log, wandb's
#: folder and the run identity
TRAINER_OUTPUTS = (STEP_GLOB, STAGING_GLOB, METRICS_FILE, "wandb", run_identity.IDENTITY_FILE)
#: config keys no trainer's content depends on: where it writes, how the run is named and logged, how often it saves
TRAINER_KEYS_IGNORED = ("trainer.default_local_dir", "trainer.project_name", "trainer.experiment_name",
                        "trainer.logger", "trainer.save_freq")


@dataclass(frozen=True)
class TrainerDir:
    """`owned`: glob patterns of what the trainer writes (a fresh run removes these, and nothing else);
    `ignored`: config keys left out of the run identity; `fresh_hint`: the override that starts a run fresh."""

    owned: tuple[str, ...]
    ignored: tuple[str, ...]
    fresh_hint: str

    @classmethod
    def declare(cls, owned: Iterable[str], ignored: Iterable[str], fresh_hint: str) -> TrainerDir:
        """A trainer's directory: every trainer's outputs and ignored keys plus its own."""
        return cls((*TRAINER_OUTPUTS, *owned), (*TRAINER_KEYS_IGNORED, *ignored), fresh_hint)

    def resumable(self, directory: Path, identity: run_identity.RunIdentity, resume: bool) -> bool:
        """Whether the run in `directory` may be continued (`run_identity.check_run_dir`; read-only)."""
        return run_identity.check_run_dir(directory, identity, resume, self.owned, self.fresh_hint)

    def reset(self, directory: Path, identity: run_identity.RunIdentity) -> None:
        """Start a fresh run: remove the trainer's outputs and record `identity` (`run_identity.reset_run_dir`)."""
        run_identity.reset_run_dir(directory, identity, self.owned)
