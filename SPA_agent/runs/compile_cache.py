"""A persistent torch.compile cache, so that compiled kernels (flex attention's first compile takes minutes) are
built once per machine rather than once per run.

torch keeps Inductor's compiled graphs (FX graph cache), AOTAutograd's forward/backward graphs (autograd cache)
and the Triton kernels they build under `TORCHINDUCTOR_CACHE_DIR`, whose default is a folder under the system's
temporary directory (often cleared at reboot). `use_persistent_compile_cache` points it at the user's cache
directory instead (when that can be created) and turns both caches on, unless the user set these variables.
Dynamo's Python tracing still runs in every process; the cache skips the code generation, Triton compilation and
autotuning behind it. docs/sft.md says how to move or clear it.
"""

from __future__ import annotations

import os
from pathlib import Path

#: environment variables set when absent (torch reads the two switches when its Inductor config is imported)
DEFAULT_SWITCHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/spa_agent/inductor` (XDG_CACHE_HOME defaults to ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "spa_agent" / "inductor"


def use_persistent_compile_cache() -> Path | None:
    """Set the cache variables the user has not set (call before the first torch.compile); returns the cache
    folder, or None where the default folder cannot be created (torch's own default is kept then)."""
    for name, value in DEFAULT_SWITCHES.items():
        os.environ.setdefault(name, value)
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        folder = default_cache_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:  # e.g. a read-only home directory
            return None
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
