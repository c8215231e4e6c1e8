"""Where a result came from: git revision, dirty flag, the source tree that ran, package
versions, platform.

Used by every command that writes a record (``eval``'s ``summary.json``, ``demos``'s manifest,
trainers' model metadata), so they all describe a run the same way. ``source_tree`` is computed
from the files on disk, so it names the code that ran even where ``.git`` lags the working tree
(a copied checkout, docs/leaderboard.md, "Provenance").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import subprocess
from collections.abc import Iterable
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


#: the package folder ``source_tree`` hashes, and the checkout it sits in.
PACKAGE_DIR = Path(__file__).resolve().parent
ROOT = PACKAGE_DIR.parent
#: what git ignores inside the package (``.gitignore``): bytecode caches.
IGNORED_DIRS = frozenset({"__pycache__"})
IGNORED_SUFFIXES = (".pyc", ".pyo")


def git(*args: str) -> str | None:
    """Output of a read-only git command in the package's checkout (``None`` outside one)."""
    root = ROOT
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


def source_files(package: Path = PACKAGE_DIR) -> list[Path]:
    """Every file under ``package`` that git would track: all but ``__pycache__`` folders and
    bytecode (``tests/test_provenance.py`` checks this against ``git ls-files``)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(package):
        dirnames[:] = [d for d in dirnames if d not in IGNORED_DIRS]
        out += [Path(dirpath, f) for f in filenames if not f.endswith(IGNORED_SUFFIXES)]
    return out


def _git_object(kind: str, body: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body, usedforsecurity=False).digest()


def _blob(path: Path) -> tuple[bytes, bytes]:
    """A file's git mode and blob id (symlink: its target; executable by the owner: 100755)."""
    if path.is_symlink():
        return b"120000", _git_object("blob", os.fsencode(os.readlink(path)))
    mode = b"100755" if path.stat().st_mode & 0o100 else b"100644"
    return mode, _git_object("blob", path.read_bytes())


def git_tree_hash(root: Path, files: Iterable[Path]) -> str:
    """The git tree id of ``files`` (paths under ``root``) as ``git write-tree`` would store them:
    blob ids of the contents, one tree per folder, entries in git's order (a folder sorts as
    ``name/``). Independent of the order of ``files``; equal to ``git rev-parse HEAD:<root>`` when
    ``files`` are a clean checkout's tracked files under ``root``."""
    tree: dict[str, object] = {}
    for path in files:
        node = tree
        *dirs, name = path.relative_to(root).parts
        for d in dirs:
            node = node.setdefault(d, {})  # type: ignore[assignment]
        node[name] = _blob(path)
    return _tree_id(tree).hex()


def _tree_id(tree: dict[str, object]) -> bytes:
    entries = []
    for name, child in tree.items():
        mode, oid = (b"40000", _tree_id(child)) if isinstance(child, dict) else child  # type: ignore[misc]
        key = os.fsencode(name) + (b"/" if isinstance(child, dict) else b"")
        entries.append((key, mode + b" " + os.fsencode(name) + b"\0" + oid))
    return _git_object("tree", b"".join(e for _, e in sorted(entries)))


def source_tree() -> str:
    """The git tree id of the package's source as it is on disk (:func:`git_tree_hash`)."""
    return git_tree_hash(PACKAGE_DIR, source_files())


def git_source_tree() -> str | None:
    """The tree ``HEAD`` records for the package folder (``None`` outside a git checkout): equal
    to :func:`source_tree` exactly when the package's files are ``HEAD``'s."""
    return git("rev-parse", f"HEAD:{PACKAGE_DIR.name}") or None


def package_versions(packages: tuple[str, ...] = TRACKED_PACKAGES) -> dict[str, str]:
    """Python's version and the installed versions of ``packages`` (missing ones are left out)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in packages:
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


@functools.cache
def code_identity() -> dict[str, Any]:
    """Git revision, dirty flag and the package's source tree (on disk and at ``HEAD``), taken
    once per process: a run calls it before it starts, so its records name the code the process
    loaded even when files change on disk while it runs."""
    return {
        "git_revision": git_revision(),
        "git_dirty": git_dirty(),
        "source_tree": source_tree(),
        "git_source_tree": git_source_tree(),
    }


def provenance() -> dict[str, Any]:
    """:func:`code_identity`, package versions and platform, as one JSON-safe dict."""
    return {
        **code_identity(),
        "versions": package_versions(),
        "platform": platform.platform(),
    }
