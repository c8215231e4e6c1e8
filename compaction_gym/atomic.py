"""Writing a file so that a reader (or a resumed run) never sees half of it: a temporary file in
the same folder, fsynced, then renamed over the target."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, text: str | bytes) -> None:
    """Write ``text`` (or raw bytes) to ``path`` via a temporary file in the same directory and a
    rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o644)
    try:
        mode, encoding = ("wb", None) if isinstance(text, bytes) else ("w", "utf-8")
        with os.fdopen(fd, mode, encoding=encoding) as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
