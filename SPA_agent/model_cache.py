"""Where the model presets (`tiny` and `small` in tiny.py, `smollm2-135m` in smollm2.py) are cached, and the file
that marks a cached model complete. Both preset modules read it; tiny.py's `resolve_model_path` dispatches to them."""

from __future__ import annotations

from pathlib import Path

MARKER_FILE = "spa_tiny.json"  # written last into every embedded model's directory: {"name", "version"}
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "spa_agent"
