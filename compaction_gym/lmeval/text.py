"""Texts to score: any UTF-8 file, or the built-in ``pydoc`` prose (docs/eval-lm.md)."""

from __future__ import annotations

from pathlib import Path

from compaction_gym.errors import InvalidArgumentError

#: built-in texts: name -> one-line description
BUILTIN_TEXTS = {"pydoc": "the English prose of Python's own pydoc_data.topics (offline everywhere)"}


def pydoc_text() -> str:
    """Python's ``pydoc_data.topics`` help topics, in sorted topic order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def load_text(spec: str) -> str:
    """The text named by ``spec``: a built-in name (``pydoc``) or the path of a UTF-8 text file.

    Raises:
        InvalidArgumentError: not a built-in name and not a readable file, or an empty text.
    """
    if spec == "pydoc":
        return pydoc_text()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise InvalidArgumentError(
            f"--text {spec!r}: no such file (built-in texts: {', '.join(BUILTIN_TEXTS)})"
        )
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise InvalidArgumentError(f"--text {spec!r}: the file is empty")
    return text
