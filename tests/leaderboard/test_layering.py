"""The package layers (docs/design-notes.md): lower packages never import the evaluation or the leaderboard."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import compaction_gym

ROOT = Path(compaction_gym.__file__).parent
#: package -> packages it must not import
FORBIDDEN = {
    "compaction": (
        "engine",
        "backends",
        "agents",
        "servers",
        "wrappers",
        "evaluation",
        "leaderboard",
        "trainers",
    ),
    "engine": ("backends", "agents", "servers", "wrappers", "evaluation", "leaderboard", "trainers"),
    "backends": ("agents", "servers", "wrappers", "evaluation", "leaderboard", "trainers"),
    "envs": ("engine", "backends", "agents", "servers", "wrappers", "evaluation", "leaderboard", "trainers"),
    "models": (
        "engine",
        "backends",
        "agents",
        "servers",
        "wrappers",
        "evaluation",
        "leaderboard",
        "trainers",
    ),
    "agents": ("servers", "wrappers", "evaluation", "leaderboard", "trainers", "demos"),
    "evaluation": ("leaderboard", "trainers", "demos"),
    "leaderboard": ("trainers", "demos"),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_its_layer(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "compaction_gym" and len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, bad
