"""Where the model presets (`tiny` and `small` in tiny.py, `smollm2-135m` in smollm2.py) are cached, and the file
that marks a cached model complete. Both read it; model_presets.py's `resolve_model_path` dispatches to them."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

MARKER_FILE = "spa_tiny.json"  # written last into every embedded model's directory: {"name", "version"}
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "spa_agent"


def save_model_dir(tokenizer, model, output_dir: Path, marker: dict) -> Path:
    """Write `tokenizer` and `model` (safetensors) into `output_dir` atomically: a staging folder with MARKER_FILE
    (`marker` as JSON) written last, then a rename. If another process finished first, its directory is kept."""
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}-", dir=output_dir.parent))
    try:
        tokenizer.save_pretrained(staging)
        model.save_pretrained(staging, safe_serialization=True)
        (staging / MARKER_FILE).write_text(json.dumps(marker))
        try:
            staging.rename(output_dir)
        except OSError:  # another process finished first: keep theirs
            if not (output_dir / MARKER_FILE).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir
