"""Where a result came from: git revision, dirty flag, package versions, platform.

Used by every command that writes a record (``eval``'s ``summary.json``, ``demos``'s manifest,
trainers' model metadata), so they all describe a run the same way.
"""

from __future__ import annotations

import contextlib
import platform
import subprocess
from pathlib import Path
from typing import Any

#: Packages whose versions a record lists.
TRACKED_PACKAGES: tuple[str, ...] = (
    "compaction-gym",
    "torch",
    "transformers",
    "trl",
    "peft",
    "gymnasium",
    "minigrid",
    "reasoning-gym",
)


def git(*args: str) -> str | None:
    """Output of a read-only git command in the package's checkout (``None`` outside one)."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_revision() -> str | None:
    """The checkout's ``HEAD`` commit, or ``None`` outside a git checkout."""
    return git("rev-parse", "HEAD") or None


def git_dirty() -> bool | None:
    """Whether the checkout has uncommitted changes (``None`` outside a git checkout)."""
    status = git("--no-optional-locks", "status", "--porcelain")
    return None if status is None else bool(status)


def package_versions(packages: tuple[str, ...] = TRACKED_PACKAGES) -> dict[str, str]:
    """Python's version and the installed versions of ``packages`` (missing ones are left out)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in packages:
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


def provenance() -> dict[str, Any]:
    """Git revision, dirty flag, package versions and platform, as one JSON-safe dict."""
    return {
        "git_revision": git_revision(),
        "git_dirty": git_dirty(),
        "versions": package_versions(),
        "platform": platform.platform(),
    }
