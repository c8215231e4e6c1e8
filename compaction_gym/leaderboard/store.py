"""Crash-safe files of a leaderboard run: atomic JSON records, fsync'd JSONL appends, file hashes.

A record is written to a temporary file in its directory, fsync'd and renamed over the old one, so a
reader never sees half a record. Trajectories are appended one line per episode and fsync'd; on
resume :func:`read_episodes` keeps every complete line once and drops a torn last line
(``docs/leaderboard.md``, "Resuming").
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from compaction_gym.atomic import write_atomic


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: str | Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=2, allow_nan=False) + "\n")


def append_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append one JSON line per row and fsync before returning."""
    with Path(path).open("a") as fh:
        for row in rows:
            fh.write(json.dumps(row, allow_nan=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_episodes(path: str | Path, key: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path``, the first of each ``key`` kept, in file order.

    A torn last line (a crash mid-write) or duplicate keys are dropped, and the file is rewritten
    atomically with exactly the lines kept, so later appends extend a clean file.
    """
    path = Path(path)
    if not path.exists():
        return []
    kept: list[dict[str, Any]] = []
    seen: set[Any] = set()
    raw = path.read_text()
    changed = bool(raw) and not raw.endswith("\n")
    for line in raw.splitlines():
        if not line.strip():
            changed = True
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            changed = True
            continue
        k = key(row)
        if k in seen:
            changed = True
            continue
        seen.add(k)
        kept.append(row)
    if changed:
        write_atomic(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
    return kept


#: files hashed as a model's weights and as its tokenizer.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def hash_files(directory: str | Path, patterns: Iterable[str]) -> dict[str, str] | None:
    """``{file name: sha256}`` of the files of ``directory`` matching ``patterns`` (``None`` if
    ``directory`` is not a local directory, e.g. a hub id)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    files = sorted({p for pat in patterns for p in directory.glob(pat) if p.is_file()})
    return {p.name: sha256_file(p) for p in files}


def combined_hash(hashes: dict[str, str] | None) -> str | None:
    """One sha256 over a ``{name: sha256}`` map (``None`` stays ``None``)."""
    if hashes is None:
        return None
    return hashlib.sha256("".join(f"{k}:{v}\n" for k, v in sorted(hashes.items())).encode()).hexdigest()
