"""The package's dependency rule (docs/architecture.md), read from the source with ``ast``.

Every import counts: module level, inside functions and under ``TYPE_CHECKING`` (a reader follows
them all). Three rules: a package imports only from packages of a lower layer (or itself); no import
cycle between modules; no private name (``_x``) imported from another module.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "compaction_gym"

#: top-level module or package -> layer; imports go to strictly lower layers (or within a package)
LAYERS: dict[str, int] = {
    "errors": 0,
    "provenance": 1,
    "lazy": 1,
    "atomic": 1,
    "cli_args": 1,
    "compaction": 2,
    "envs": 2,
    "models": 3,
    "engine": 4,
    "backends": 5,
    "agents": 6,
    "servers": 6,
    "lmeval": 6,
    "wrappers": 7,
    "trainers": 8,
    "evaluation": 8,
    "leaderboard": 9,
    "demos": 9,
    "cli": 10,
    "bench": 10,
    "plots": 10,
}
#: the package root only registers the env ids
ROOT_MAY_IMPORT = {"envs", "errors"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module imported from, names, line)`` for every import of ours in ``path``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "compaction_gym":
                out.append((target, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "compaction_gym"]
    return out


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(target: str, names: list[str]) -> list[str]:
    """The modules an import reads: ``from pkg import submodule`` counts the submodule."""
    found = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
    return found or ([target] if target in MODULES else [])


def test_every_package_has_a_layer():
    tops = {_top(m) for m in MODULES} - {""}
    assert tops <= set(LAYERS), f"add {sorted(tops - set(LAYERS))} to LAYERS and docs/architecture.md"


def test_imports_flow_down_the_layers():
    bad = []
    for module, path in MODULES.items():
        src = _top(module)
        for target, _, line in _imports(path):
            dst = _top(target)
            if not dst or dst == src:
                continue
            ok = dst in ROOT_MAY_IMPORT if src == "" else LAYERS.get(dst, 99) < LAYERS[src]
            if not ok:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {src} -> {dst} ({target})")
    assert not bad, "imports against the layer rule (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_cycles():
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for target, names, _ in _imports(path):
            for dep in _resolve(target, names):
                if dep != module and not module.startswith(dep + "."):  # a package's own __init__
                    graph[module].add(dep)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in list(MODULES):
        if v not in index:
            visit(v)
    # a package __init__ that re-exports its submodules is not a cycle of logic
    cycles = [c for c in cycles if not all(m in MODULES and MODULES[m].name == "__init__.py" or
                                           any(o.startswith(m + ".") for o in c) for m in c)]
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_across_modules():
    bad = []
    for module, path in MODULES.items():
        for target, names, line in _imports(path):
            for n in names:
                if not n.startswith("_") or n.startswith("__"):
                    continue
                if f"{target}.{n}" in MODULES and target.rsplit(".", 1)[0] == module.rsplit(".", 1)[0]:
                    continue  # a package-private module of its own package (e.g. compaction._checks)
                if f"{target}.{n}" in MODULES and target == module.rsplit(".", 1)[0]:
                    continue
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {n} from {target}")
    assert not bad, "private names imported from other modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("rule", ["layers", "cycles", "private"])
def test_the_checks_catch_violations(tmp_path, rule):
    """The checks fail on a planted violation (so a passing run means something)."""
    pkg = tmp_path / "compaction_gym"
    for d in ("engine", "agents"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    if rule == "layers":
        (pkg / "engine" / "x.py").write_text("from compaction_gym.agents import y\n")
        (pkg / "agents" / "y.py").write_text("")
    elif rule == "cycles":
        (pkg / "agents" / "a.py").write_text("def f():\n    from compaction_gym.agents import b\n")
        (pkg / "agents" / "b.py").write_text("from compaction_gym.agents.a import f\n")
    else:
        (pkg / "agents" / "a.py").write_text("def _hidden(): ...\n")
        (pkg / "engine" / "b.py").write_text("from compaction_gym.agents.a import _hidden\n")
    global ROOT, MODULES
    saved = ROOT, MODULES
    ROOT = pkg
    MODULES = {_module_name(p): p for p in sorted(pkg.rglob("*.py"))}
    try:
        check = {"layers": test_imports_flow_down_the_layers, "cycles": test_no_import_cycles,
                 "private": test_no_private_names_across_modules}[rule]
        with pytest.raises(AssertionError):
            check()
    finally:
        ROOT, MODULES = saved


def test_lazy_exports_do_not_shadow_submodules():
    """A lazily exported name must not be a submodule's name too: once the submodule is imported,
    Python binds the package attribute to the module, and ``from package import name`` returns the
    module instead of the function (seen with ``compaction.compact`` and ``evaluation.evaluate``)."""
    import importlib
    import pkgutil

    clashes = {}
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        package = importlib.import_module(name)
        exports = getattr(package, "_EXPORTS", None) or getattr(package, "_LAZY", None) or {}
        submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
        if set(exports) & submodules:
            clashes[name] = sorted(set(exports) & submodules)
    assert not clashes, clashes
