"""Language-modelling suites (``kind = "lm"``): a text read left to right through compacted sessions,
scored in bits per byte, lower is better (docs/leaderboard.md, "Language-modelling suites").

No env and no episodes: a cell is one (method, budget), run once per seed when something in it is
random (``random`` selection, ``random`` probes) and once otherwise; an optional eval-time n-gram
mixer (``mixer = true`` on a method) rescores the same model pass.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compaction_gym.compaction.modes import QUERY_MODES
from compaction_gym.engine.config import CompactionConfig
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard.suite import (
    FULL,
    Budget,
    CellBase,
    SuiteFile,
    check_keys,
    check_max_kv_len,
    find_suite,
    hashed_compaction,
    method_compaction,
    named_methods,
    read_suite_toml,
)
from compaction_gym.lmeval.mixer import MIXERS, MixerConfig

LM_KIND = "lm"
LM_SUITE_KEYS = {
    "kind", "name", "description", "model", "text", "text_sha256", "max_tokens", "chunk", "score_after",
    "seeds", "budgets", "compaction", "mixer", "methods", "batch",
}  # fmt: skip
LM_METHOD_KEYS = {"name", "budgets", "description", "mixer"}
LM_BUDGET_KEYS = {"max_kv_len", "compact_window"}


def suite_kind(spec: str | Path) -> str:
    """The ``kind`` of a suite file (``"env"`` when it names none)."""
    with find_suite(spec).open("rb") as fh:
        return str(tomllib.load(fh).get("kind", "env"))


def is_random(compaction: CompactionConfig) -> bool:
    """Whether a session's compaction draws from its seed (random selection or random probes)."""
    return compaction.mode == "random" or (compaction.mode in QUERY_MODES and compaction.queries == "random")


@dataclass(frozen=True)
class LmCell(CellBase):
    """One (method, budget) of an lm suite: everything its record was run with."""

    suite: str
    method: str
    budget: Budget
    model: str
    text_file: Path
    text_sha256: str
    max_tokens: int
    chunk: int
    score_after: int
    seeds: list[int]
    compaction: CompactionConfig
    mixer: MixerConfig | None
    mixer_name: str | None = None
    batch: int = 8

    def config(self) -> dict[str, Any]:
        """What ``config_sha256`` hashes (the text by its sha256, not its path)."""
        return {
            "kind": LM_KIND,
            "model": self.model,
            "text_sha256": self.text_sha256,
            "max_tokens": self.max_tokens,
            "chunk": self.chunk,
            "score_after": self.score_after,
            "seeds": self.seeds,
            "compaction": hashed_compaction(self.compaction),
            "mixer": None if self.mixer is None else {"name": self.mixer_name, **self.mixer.to_dict()},
        }


@dataclass
class LmSuite(SuiteFile[LmCell]):
    """A parsed lm suite file."""

    @property
    def seeds(self) -> list[int]:
        return [int(s) for s in self.data["seeds"]]

    @property
    def baseline(self) -> LmCell | None:
        """The full-cache cell without a mixer (the first method with mode ``none``): every other
        record pairs against it."""
        return next((c for c in self.cells if c.compaction.mode == "none" and c.mixer is None), None)


def _budget(where: str, spec: dict[str, Any]) -> Budget:
    check_keys(where, spec, LM_BUDGET_KEYS)
    if "max_kv_len" not in spec:
        raise InvalidArgumentError(f"{where}: missing key 'max_kv_len'")
    max_kv = int(spec["max_kv_len"])
    check_max_kv_len(where, max_kv)
    window = int(spec.get("compact_window", max(1, max_kv // 2)))
    return Budget(f"kv{max_kv}", max_kv, None, window)


def text_path(suite_path: Path, text: str) -> Path:
    """A suite's ``text``: a path relative to the suite file (or absolute)."""
    path = Path(text)
    return path if path.is_absolute() else (suite_path.parent / path).resolve()


def load_lm_suite(spec: str | Path) -> LmSuite:
    """Parse and validate an lm suite file (by path or name).

    Raises:
        InvalidArgumentError: unknown or missing keys (named), a text whose sha256 differs from
            ``text_sha256``, a bad budget, mixer or compaction config.
    """
    path, data = read_suite_toml(spec, LM_SUITE_KEYS)
    if data.get("kind") != LM_KIND:
        raise InvalidArgumentError(f"{path}: kind must be {LM_KIND!r} for an lm suite")
    for key in ("name", "model", "text", "text_sha256", "max_tokens", "seeds", "methods"):
        if key not in data:
            raise InvalidArgumentError(f"{path}: missing key {key!r}")
    text = text_path(path, str(data["text"]))
    if not text.is_file():
        raise InvalidArgumentError(f"{path}: text: no such file {text}")
    sha = hashlib.sha256(text.read_bytes()).hexdigest()
    if sha != data["text_sha256"]:
        raise InvalidArgumentError(
            f"{path}: text_sha256: {text.name} has sha256 {sha}, not {data['text_sha256']}"
        )
    seeds = [int(s) for s in data["seeds"]]
    if not seeds or len(set(seeds)) != len(seeds):
        raise InvalidArgumentError(f"{path}: seeds must be non-empty and distinct, got {seeds}")
    max_tokens, chunk = int(data["max_tokens"]), int(data.get("chunk", 64))
    if max_tokens < 2 or chunk < 1:
        raise InvalidArgumentError(f"{path}: max_tokens must be >= 2 and chunk >= 1")
    default_budgets = [_budget(f"{path}: budgets[{j}]", b) for j, b in enumerate(data.get("budgets", []))]
    score_after = int(data.get("score_after", max((b.max_kv_len or 0 for b in default_budgets), default=0)))
    if not 0 <= score_after < max_tokens - 1:
        raise InvalidArgumentError(f"{path}: score_after must be in [0, max_tokens - 1), got {score_after}")
    mixer_table = dict(data.get("mixer", {}))
    mixer_name = str(mixer_table.pop("name", "backoff"))
    if mixer_name not in MIXERS:
        raise InvalidArgumentError(f"{path}: mixer.name {mixer_name!r} is not one of {sorted(MIXERS)}")
    mixer_cfg = MixerConfig.from_dict(mixer_table)
    suite = LmSuite(name=str(data["name"]), path=path, data=data)
    for where, method in named_methods(path, data["methods"]):
        comp_fields = {k: v for k, v in method.items() if k not in LM_METHOD_KEYS}
        mode = comp_fields.get("mode", "none")
        if mode == "none":
            budgets = [FULL]
        else:
            given = method.get("budgets")
            budgets = default_budgets if given is None else [
                _budget(f"{where} budgets[{j}]", b) for j, b in enumerate(given)
            ]  # fmt: skip
        if not budgets:
            raise InvalidArgumentError(f"{where}: a compaction method needs budgets")
        mixer = method.get("mixer", False)
        if not isinstance(mixer, bool):
            raise InvalidArgumentError(f"{where}: mixer must be true or false (parameters go in [mixer])")
        for budget in budgets:
            comp = {"protect_prompt": False, **data.get("compaction", {}), **comp_fields}
            compaction = method_compaction(where, str(method["name"]), budget, comp)
            suite.cells.append(
                LmCell(
                    suite=suite.name,
                    method=str(method["name"]),
                    budget=budget,
                    model=str(data["model"]),
                    text_file=text,
                    text_sha256=sha,
                    max_tokens=max_tokens,
                    chunk=chunk,
                    score_after=score_after,
                    seeds=seeds if is_random(compaction) else seeds[:1],
                    compaction=compaction,
                    mixer=mixer_cfg if mixer else None,
                    mixer_name=mixer_name if mixer else None,
                    batch=int(data.get("batch", 8)),
                )
            )
    return suite
