"""Where models built or converted on first use live: ``$COMPACTION_GYM_CACHE`` or ``~/.cache/compaction_gym``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where built models live: ``$COMPACTION_GYM_CACHE`` or ``~/.cache/compaction_gym``."""
    return Path(os.environ.get("COMPACTION_GYM_CACHE", Path.home() / ".cache" / "compaction_gym"))
