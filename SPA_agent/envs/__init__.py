"""Text environments (spec §3): Sokoban, FrozenLake and Sudoku, the two-armed bandit of the learning test, the
`env_type` registry and `make_env`.

Importing this package also registers the gymnasium ids `SPA/Sokoban-v0`, `SPA/FrozenLake-v0`,
`SPA/Sudoku-v0` and `SPA/Bandit-v0`.
"""

from SPA_agent.envs.bandit import BanditEnv, BanditEnvConfig
from SPA_agent.envs.base import REGISTRY, BaseEnv, make_env, register
from SPA_agent.envs.frozen_lake import FrozenLakeEnv, FrozenLakeEnvConfig
from SPA_agent.envs.gym_adapter import GYM_IDS, register_gym_envs
from SPA_agent.envs.sokoban import SokobanEnv, SokobanEnvConfig
from SPA_agent.envs.sudoku import SudokuEnv, SudokuEnvConfig

register(SokobanEnv, SokobanEnvConfig)
register(FrozenLakeEnv, FrozenLakeEnvConfig)
register(SudokuEnv, SudokuEnvConfig)
register(BanditEnv, BanditEnvConfig)
register_gym_envs()

__all__ = [
    "GYM_IDS",
    "BanditEnv",
    "BanditEnvConfig",
    "REGISTRY",
    "BaseEnv",
    "FrozenLakeEnv",
    "FrozenLakeEnvConfig",
    "SokobanEnv",
    "SokobanEnvConfig",
    "SudokuEnv",
    "SudokuEnvConfig",
    "make_env",
]
