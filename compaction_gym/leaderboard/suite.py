"""Leaderboard suites: TOML files naming an env, tasks, seeds, model, sampling and methods × budgets.

A suite resolves to :class:`Cell` s, one per (method, budget); each cell's :meth:`Cell.config` is
what its record's ``config_sha256`` hashes (``docs/leaderboard.md``, "Suites").
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard.rsa_cells import AGENT as RSA_AGENT
from compaction_gym.leaderboard.rsa_cells import RSA_KEYS, rsa_settings

#: where ``leaderboard run NAME`` looks for ``NAME.toml`` (besides a path given as is).
SUITES_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "leaderboard" / "suites"
#: Where ``leaderboard run`` writes records and ``show``/``check`` read them.
DEFAULT_OUTPUT = Path(__file__).resolve().parents[2] / "benchmarks" / "leaderboard" / "records"
SUITE_KEYS = {
    "name", "description", "env", "tasks", "episodes", "seeds", "model", "tokenizer", "prompt", "batch",
    "env_kwargs", "reference_kv_len", "capacity", "sampling", "compaction", "budgets", "methods", "policy",
}  # fmt: skip
METHOD_KEYS = {"name", "budgets", "description"}
#: keys of an ``agent = "sb3_ppo"`` method (the classic-RL reference row, :mod:`.sb3`).
AGENT_METHOD_KEYS = {"name", "description", "agent", "total_timesteps", "n_envs", "ppo"}
BUDGET_KEYS = {"max_kv_len", "kv_ratio", "compact_window", "window_fraction"}


@dataclass(frozen=True)
class Budget:
    """A KV budget: ``max_kv_len`` rows, given absolutely or as ``kv_ratio`` × the suite's
    ``reference_kv_len`` (the full-KV peak); ``None`` is the unbounded (full-KV) budget."""

    label: str
    max_kv_len: int | None
    kv_ratio: float | None
    compact_window: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "max_kv_len": self.max_kv_len,
            "kv_ratio": self.kv_ratio,
            "compact_window": self.compact_window,
        }


FULL = Budget("full", None, None, None)


C = TypeVar("C", bound="CellBase")


class CellBase:
    """What every kind of cell derives from its fields: its ``METHOD/BUDGET`` key and the sha256 of
    its :meth:`config` (a record's ``config_sha256``); its folder is ``OUTPUT/SUITE/METHOD/BUDGET``."""

    suite: str
    method: str
    budget: Budget

    def config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must define config()")

    @property
    def key(self) -> str:
        return f"{self.method}/{self.budget.label}"

    def config_sha256(self) -> str:
        return sha256_json(self.config())


@dataclass(frozen=True)
class Cell(CellBase):
    """One (method, budget) of a suite: everything a record of it was run with."""

    suite: str
    method: str
    budget: Budget
    env: str
    tasks: list[str | None]
    episodes: int
    seeds: list[int]
    model: str
    prompt: str | None
    batch: int
    policy: str
    env_kwargs: dict[str, Any]
    compaction: CompactionConfig
    sampling: SamplingParams
    capacity: int | None = None
    #: an agent trained outside the engine (``{"agent": "sb3_ppo", ...}``); ``None``: the LLM
    trainer: dict[str, Any] | None = None
    #: RSA or plain sampling per question (``{"agent": "rsa", ...}``, :mod:`.rsa_cells`); ``None``: an episode
    rsa: dict[str, Any] | None = None

    def env_seeds(self, seed: int) -> list[int]:
        """The env seeds run seed ``seed`` plays: ``seed, …, seed + episodes − 1`` in every task."""
        return [seed + i for i in range(self.episodes)]

    def run_seed(self, env_seed: int) -> int:
        """The run seed whose episodes include ``env_seed`` (seed ranges never overlap)."""
        for s in self.seeds:
            if s <= env_seed < s + self.episodes:
                return s
        raise InvalidArgumentError(f"env seed {env_seed} belongs to none of the seeds {self.seeds}")

    def episode_keys(self) -> list[tuple[str, int, int]]:
        """Every ``(task label, run seed, env seed)`` the cell plays."""
        return [(str(t), s, e) for t in self.tasks for s in self.seeds for e in self.env_seeds(s)]

    def config(self) -> dict[str, Any]:
        """The JSON-safe configuration its ``config_sha256`` hashes (batch excluded: it does not
        change results; ``trainer`` only for an agent trained outside the engine, ``rsa`` only for
        an RSA method)."""
        extra = {} if self.trainer is None else {"trainer": self.trainer}
        if self.rsa is not None:
            extra["rsa"] = self.rsa
        return {
            **extra,
            "suite": self.suite,
            "method": self.method,
            "budget": self.budget.to_dict(),
            "env": self.env,
            "tasks": self.tasks,
            "episodes": self.episodes,
            "seeds": self.seeds,
            "model": self.model,
            "prompt": self.prompt,
            "policy": self.policy,
            "env_kwargs": self.env_kwargs,
            "capacity": self.capacity,
            "compaction": hashed_compaction(self.compaction),
            "sampling": {**self.sampling.to_dict(), "stop_token_ids": list(self.sampling.stop_token_ids)},
        }


@dataclass
class SuiteFile(Generic[C]):
    """A parsed suite file of either kind: its name, path, TOML data and cells."""

    name: str
    path: Path
    data: dict[str, Any]
    cells: list[C] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def cell(self, method: str, budget: str) -> C:
        for c in self.cells:
            if c.method == method and c.budget.label == budget:
                return c
        raise InvalidArgumentError(f"suite {self.name!r} has no cell {method}/{budget}")

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(c.method for c in self.cells))


@dataclass
class Suite(SuiteFile[Cell]):
    """A parsed (env) suite file."""

    @property
    def baseline(self) -> Cell | None:
        """The full-KV cell every other record pairs against: the first LLM method with mode ``none``."""
        return next(
            (
                c
                for c in self.cells
                if c.compaction.mode == "none"
                and c.trainer is None
                and c.rsa is None
                and not c.compaction.injects_budget
            ),
            None,
        )


#: ``CompactionConfig`` fields added after records were first written, each with the value that
#: reproduces the behaviour from before it existed. At that value a field is left out of a cell's
#: config (and so of its hash): adding a behaviour-preserving field orphans no record, while any
#: other value (or a changed default) changes the hash as it must (docs/leaderboard.md).
NEUTRAL_LATER_FIELDS: dict[str, Any] = {
    "refit_values": True,
    "inject_budget_every": None,
    "kv_budget_from": "prompt",
}

#: Later fields that only act through the KV-budget trigger: a cell without it (``none``, turn-based)
#: leaves them out at any value, so a suite-wide ``[compaction]`` setting keeps its ``none`` records.
KV_BUDGET_ONLY_FIELDS = ("kv_budget_from",)


def hashed_compaction(compaction: Any) -> dict[str, Any]:
    """A cell's ``compaction`` block as records hash it: ``to_dict()`` without the
    :data:`NEUTRAL_LATER_FIELDS` at their neutral values (nor :data:`KV_BUDGET_ONLY_FIELDS` in a
    cell without the KV-budget trigger)."""
    return {
        k: v
        for k, v in compaction.to_dict().items()
        if not (k in NEUTRAL_LATER_FIELDS and v == NEUTRAL_LATER_FIELDS[k])
        and not (k in KV_BUDGET_ONLY_FIELDS and not compaction.kv_budget)
    }


def sha256_json(value: Any) -> str:
    """sha256 of canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def find_suite(spec: str | Path) -> Path:
    """A suite file: ``spec`` as a path, else ``SUITES_DIR/spec.toml``."""
    path = Path(spec)
    if path.is_file():
        return path
    named = SUITES_DIR / f"{spec}.toml"
    if named.is_file():
        return named
    known = sorted(p.stem for p in SUITES_DIR.glob("*.toml"))
    raise InvalidArgumentError(f"suite {str(spec)!r}: no such file or name; known suites: {known}")


def check_keys(where: str, table: dict[str, Any], valid: set[str]) -> None:
    """Raise naming ``table``'s keys that are not in ``valid``."""
    unknown = sorted(set(table) - valid)
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown keys {unknown}; valid keys: {sorted(valid)}")


def read_suite_toml(spec: str | Path, valid: set[str]) -> tuple[Path, dict[str, Any]]:
    """A suite file (by path or name, :func:`find_suite`) and its TOML table, keys checked."""
    path = find_suite(spec)
    with path.open("rb") as fh:
        data = tomllib.load(fh)
    check_keys(str(path), data, valid)
    return path, data


def named_methods(path: Path, methods: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each ``[[methods]]`` table with its ``where`` prefix, checking (as it goes) that each has a
    distinct ``name``."""
    seen: set[str] = set()
    for i, method in enumerate(methods):
        where = f"{path}: methods[{i}]"
        if "name" not in method:
            raise InvalidArgumentError(f"{where}: missing key 'name'")
        if method["name"] in seen:
            raise InvalidArgumentError(f"{where}: duplicate method name {method['name']!r}")
        seen.add(method["name"])
        yield where, method


def check_max_kv_len(where: str, max_kv: int) -> None:
    """Raise unless a budget keeps at least two rows."""
    if max_kv < 2:
        raise InvalidArgumentError(f"{where}: max_kv_len must be >= 2, got {max_kv}")


def method_compaction(where: str, method: str, budget: Budget, comp: dict[str, Any]) -> CompactionConfig:
    """A cell's compaction config: ``comp`` with the budget's rows and window, errors naming the cell."""
    if budget.max_kv_len is not None:
        comp = {**comp, "max_kv_len": budget.max_kv_len, "compact_window": budget.compact_window}
    try:
        return CompactionConfig.from_dict(comp)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where} ({method}/{budget.label}): {exc}") from exc


def _budget(where: str, spec: dict[str, Any], reference: int | None) -> Budget:
    check_keys(where, spec, BUDGET_KEYS)
    if ("max_kv_len" in spec) == ("kv_ratio" in spec):
        raise InvalidArgumentError(f"{where}: give exactly one of max_kv_len and kv_ratio, got {spec}")
    ratio = spec.get("kv_ratio")
    if ratio is not None:
        if not 0 < float(ratio) <= 1:
            raise InvalidArgumentError(f"{where}: kv_ratio must be in (0, 1], got {ratio}")
        if not reference:
            raise InvalidArgumentError(f"{where}: kv_ratio needs the suite's reference_kv_len")
        max_kv = max(2, math.ceil(float(ratio) * reference))
        label = f"r{float(ratio):g}"
    else:
        max_kv = int(spec["max_kv_len"])
        check_max_kv_len(where, max_kv)
        label = f"kv{max_kv}"
    window = spec.get("compact_window")
    if window is None:
        window = max(1, int(max_kv * float(spec.get("window_fraction", 0.5))))
    elif isinstance(window, bool) or not isinstance(window, int) or not 0 < window < max_kv:
        raise InvalidArgumentError(
            f"{where}: compact_window must be an integer in [1, max_kv_len = {max_kv}), got {window!r}"
        )
    return Budget(label, max_kv, float(ratio) if ratio is not None else None, int(window))


def load_suite(spec: str | Path) -> Suite:
    """Parse and validate a suite file (by path or name) into its cells.

    Raises:
        InvalidArgumentError: unknown keys (named), missing fields, overlapping seed ranges, or a
            method whose compaction config does not validate.
    """
    path, data = read_suite_toml(spec, SUITE_KEYS)
    for key in ("name", "env", "episodes", "seeds", "model", "methods"):
        if key not in data:
            raise InvalidArgumentError(f"{path}: missing key {key!r}")
    episodes, seeds = int(data["episodes"]), [int(s) for s in data["seeds"]]
    if episodes < 1 or not seeds:
        raise InvalidArgumentError(f"{path}: episodes must be >= 1 and seeds non-empty")
    ranges = sorted((s, s + episodes) for s in seeds)
    if any(b[0] < a[1] for a, b in zip(ranges, ranges[1:])):
        raise InvalidArgumentError(
            f"{path}: seeds {seeds} overlap with {episodes} episodes each (env seeds S..S+episodes-1)"
        )
    reference = data.get("reference_kv_len")
    base_comp = dict(data.get("compaction", {}))
    sampling = SamplingParams.from_dict({"temperature": 0.0, **data.get("sampling", {})})
    default_budgets = data.get("budgets", [])
    from compaction_gym.agents.evaluate import default_tasks

    tasks = list(data["tasks"]) if data.get("tasks") else default_tasks(data["env"])
    suite = Suite(name=str(data["name"]), path=path, data=data)
    for where, method in named_methods(path, data["methods"]):
        rsa, cell_sampling = None, sampling
        if method.get("agent") == RSA_AGENT:
            rsa, cell_sampling = rsa_settings(where, method, sampling)
            method = {k: v for k, v in method.items() if k not in RSA_KEYS}
        elif "agent" in method:
            suite.cells.append(_agent_cell(where, method, suite.name, data, tasks, episodes, seeds, sampling))
            continue
        comp_fields = {k: v for k, v in method.items() if k not in METHOD_KEYS}
        mode = comp_fields.get("mode", "none")
        budgets = [FULL] if mode == "none" else [
            _budget(f"{where} budgets[{j}]", b, reference) for j, b in enumerate(method.get("budgets", default_budgets))
        ]  # fmt: skip
        if not budgets:
            raise InvalidArgumentError(f"{where}: a compaction method needs budgets")
        for budget in budgets:
            comp = {**base_comp, **comp_fields}
            if budget.max_kv_len is None and mode == "none":
                comp = {k: v for k, v in comp.items() if k not in ("max_kv_len", "compact_window")}
            compaction = method_compaction(where, str(method["name"]), budget, comp)
            suite.cells.append(
                Cell(
                    suite=suite.name,
                    method=str(method["name"]),
                    budget=budget,
                    env=str(data["env"]),
                    tasks=tasks,
                    episodes=episodes,
                    seeds=seeds,
                    model=str(data["model"]),
                    prompt=data.get("prompt"),
                    batch=int(data.get("batch", 1)),
                    policy=str(data.get("policy", "model")),
                    env_kwargs=dict(data.get("env_kwargs", {})),
                    compaction=compaction,
                    sampling=cell_sampling,
                    capacity=int(data["capacity"]) if data.get("capacity") else None,
                    rsa=rsa,
                )
            )
    return suite


def _agent_cell(
    where: str,
    method: dict[str, Any],
    suite: str,
    data: dict[str, Any],
    tasks: list[str | None],
    episodes: int,
    seeds: list[int],
    sampling: SamplingParams,
) -> Cell:
    """The cell of an agent trained outside the engine (``agent = "sb3_ppo"``): full budget, no compaction."""
    check_keys(where, method, AGENT_METHOD_KEYS)
    from compaction_gym.leaderboard.sb3 import AGENT, trainer_settings

    if method["agent"] != AGENT:
        raise InvalidArgumentError(f"{where}: agent must be {AGENT!r}, got {method['agent']!r}")
    return Cell(
        suite=suite,
        method=str(method["name"]),
        budget=FULL,
        env=str(data["env"]),
        tasks=tasks,
        episodes=episodes,
        seeds=seeds,
        model=AGENT,
        prompt=None,
        batch=1,
        policy=AGENT,
        env_kwargs=dict(data.get("env_kwargs", {})),
        compaction=CompactionConfig(),
        sampling=sampling,
        trainer=trainer_settings(where, method, str(data["env"])),
    )
