"""``leaderboard run``: play a suite's cells, resumably, and write one record per cell.

Per cell ``OUTPUT/SUITE/METHOD/BUDGET/``: ``cell.json`` (its config and hash, written first),
``trajectories.jsonl`` (one trajectory per finished episode, appended and fsync'd),
``run.log``, and ``submission.json`` once every episode is in (atomic). Re-running continues
where a run stopped: finished episodes are read back (deduplicated) and only the missing
``(task, env seed)`` pairs are played (``docs/leaderboard.md``, "Resuming").
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from compaction_gym.agents.evaluate import load_backend, play
from compaction_gym.agents.trajectory import Trajectory, jsonable
from compaction_gym.compaction.revisions import COMPACTION_REVISION
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.evaluation.summary import finite
from compaction_gym.leaderboard.audit import AUDIT_FILE, audit_entries, write_audit
from compaction_gym.leaderboard.plan import CELL_FILE
from compaction_gym.leaderboard.record import (
    LOG_FILE,
    RECORD_FILE,
    RECORD_SCHEMA,
    TRAJECTORIES_FILE,
    comparison,
    episode_rows,
    results,
    schema_errors,
    seal,
)
from compaction_gym.leaderboard.record_checks import json_close
from compaction_gym.leaderboard.staleness import made_at, refuse_stale_cell
from compaction_gym.leaderboard.store import (
    TOKENIZER_PATTERNS,
    WEIGHT_PATTERNS,
    append_jsonl,
    hash_files,
    read_episodes,
    sha256_file,
    write_json_atomic,
)
from compaction_gym.leaderboard.suite import DEFAULT_OUTPUT, C, Cell, CellBase, Suite, SuiteFile
from compaction_gym.models.registry import resolve_model
from compaction_gym.provenance import code_identity, provenance


def cell_dir(output: str | Path, cell: CellBase) -> Path:
    """A cell's folder of either suite kind: ``OUTPUT/SUITE/METHOD/BUDGET``."""
    return Path(output) / cell.suite / cell.method / cell.budget.label


def episode_key(d: dict[str, Any]) -> tuple[str, int]:
    """A trajectory line's identity: (requested task, env seed)."""
    return str(d["info"].get("eval_task_requested")), int(d["seed"])


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def log_line(path: Path, message: str) -> None:
    """Append a timestamped line to a cell's ``run.log``."""
    with path.open("a") as fh:
        fh.write(f"{now_iso()} {message}\n")


def hardware(backend: Any) -> dict[str, Any]:
    """Device, CPU and GPU names, core count, the engine's slots and KV rows per slot."""
    engine = getattr(backend, "engine", None)
    info: dict[str, Any] = {
        "device": str(getattr(engine, "device", "")),
        "engine_capacity": getattr(engine, "capacity", None),
        "engine_slots": getattr(engine, "max_slots", None),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpu": None,
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except Exception:  # hardware description must never fail a run
        pass
    return info


def model_block(spec: str) -> dict[str, Any]:
    """Model spec, resolved path and sha256 of its weight and tokenizer files."""
    resolved = resolve_model(spec)
    return {
        "spec": spec,
        "resolved": resolved,
        "weights_sha256": hash_files(resolved, WEIGHT_PATTERNS),
        "tokenizer_sha256": hash_files(resolved, TOKENIZER_PATTERNS),
    }


def relative_path(path: Path) -> str:
    """``path`` relative to the project root when inside it."""
    root = Path(__file__).resolve().parents[2]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def record_head(suite: SuiteFile[Any], cell: Any) -> dict[str, Any]:
    """The fields every record starts with after its schema: suite file, method, budget and config."""
    return {
        "suite": {"name": suite.name, "file": relative_path(suite.path), "sha256": suite.sha256},
        "method": cell.method,
        "budget": cell.budget.to_dict(),
        "config": cell.config(),
        "config_sha256": cell.config_sha256(),
    }


def run_provenance(started_at: str, wall_time_s: float, backend: Any, **extra: Any) -> dict[str, Any]:
    """A record's ``provenance``: times, code and environment (:func:`provenance`), the compaction
    revision (docs/leaderboard.md, "Stale records"), hardware, argv."""
    return {
        "started_at": started_at,
        "finished_at": now_iso(),
        "wall_time_s": wall_time_s,
        **provenance(),
        "compaction_revision": COMPACTION_REVISION,
        "hardware": hardware(backend),
        "argv": sys.argv,
        **extra,
    }


def selected_cells(
    suite: SuiteFile[C],
    methods: Sequence[str] | None,
    budgets: Sequence[str] | None,
    seeds: Sequence[int] | None,
    known_seeds: Sequence[int],
) -> list[C]:
    """The cells of ``suite`` a selection names (``full`` always; default all), in suite order.

    Raises:
        InvalidArgumentError: an unknown method (``--methods``), seed (``--seeds``, not in
            ``known_seeds``) or budget label (``--budgets``), or a selection with no cell.
    """
    known = suite.methods
    chosen = list(methods) if methods else known
    unknown = [m for m in chosen if m not in known]
    if unknown:
        raise InvalidArgumentError(f"--methods: unknown {unknown}; suite {suite.name!r} has {known}")
    bad = [s for s in (seeds or []) if s not in known_seeds]
    if bad:
        raise InvalidArgumentError(f"--seeds: {bad} are not the suite's seeds {known_seeds}")
    labels = {c.budget.label for c in suite.cells}
    if budgets and set(budgets) - labels:
        raise InvalidArgumentError(
            f"--budgets: unknown {sorted(set(budgets) - labels)}; suite has {sorted(labels)}"
        )
    cells = [
        c
        for c in suite.cells
        if c.method in chosen and (not budgets or c.budget.label in budgets or c.budget.label == "full")
    ]
    if not cells:
        raise InvalidArgumentError(f"nothing to run: no cell of suite {suite.name!r} matches the selection")
    return cells


def build_record(
    suite: Suite,
    cell: Cell,
    directory: Path,
    trajectories: Sequence[dict[str, Any]],
    *,
    model: dict[str, Any],
    prov: dict[str, Any],
) -> dict[str, Any]:
    """The sealed record of a finished cell (its comparison is attached by :func:`attach_comparisons`)."""
    rows = episode_rows(trajectories)
    res = results(cell, rows)
    traj_path = directory / TRAJECTORIES_FILE
    audit_path = directory / AUDIT_FILE
    write_audit(audit_path, audit_entries(trajectories, rows))
    return seal(
        {
            "schema": RECORD_SCHEMA,
            **record_head(suite, cell),
            "seeds": sorted({r["seed"] for r in rows}),
            "results": res,
            "comparison_vs_none": None,
            "model": model,
            "provenance": prov,
            "files": {
                "trajectories": {
                    "path": TRAJECTORIES_FILE,
                    "sha256": sha256_file(traj_path),
                    "lines": len(trajectories),
                },
                "audit": {"path": AUDIT_FILE, "sha256": sha256_file(audit_path), "lines": len(rows)},
                "log": LOG_FILE,
            },
        }
    )


def baseline_cell(suite: Suite) -> Cell | None:
    """The suite's full-KV cell (:attr:`Suite.baseline`)."""
    return suite.baseline


def load_record(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def select_cells(
    suite: Suite,
    methods: Sequence[str] | None = None,
    budgets: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
) -> tuple[list[Cell], list[int]]:
    """The cells a run plays (the ``none`` baseline first) and the run seeds.

    Raises:
        InvalidArgumentError: an unknown method (``--methods``), budget label (``--budgets``) or
            seed (``--seeds``), or a selection with no cell.
    """
    run_seeds = list(seeds) if seeds else list(suite.cells[0].seeds)
    cells = selected_cells(suite, methods, budgets, run_seeds, suite.cells[0].seeds)
    base = suite.baseline
    cells.sort(key=lambda c: base is None or c.key != base.key)  # the baseline first
    return cells, run_seeds


def prepare_cell(output: str | Path, cell: Cell) -> Path:
    """Create the cell's directory and ``cell.json`` (its config hash); returns the directory.

    Raises:
        InvalidArgumentError: the directory holds episodes of another config, or episodes of a
            compaction revision that a later one changed for this cell's method
            (:func:`.staleness.refuse_stale_cell`).
    """
    directory = cell_dir(output, cell)
    directory.mkdir(parents=True, exist_ok=True)
    cell_file = directory / CELL_FILE
    if cell_file.exists():
        previous = json.loads(cell_file.read_text())
        if previous["config_sha256"] != cell.config_sha256():
            raise InvalidArgumentError(
                f"{directory}: its episodes were run with another config (hash "
                f"{previous['config_sha256'][:12]}, suite now {cell.config_sha256()[:12]}); "
                "use another --output or delete that directory"
            )
        if any(
            (directory / f).exists() and (directory / f).stat().st_size
            for f in (TRAJECTORIES_FILE, RECORD_FILE)
        ):
            refuse_stale_cell(directory, cell.config()["compaction"], made_at(previous))
        if previous.get("compaction_revision") != COMPACTION_REVISION:  # its episodes hold now
            write_json_atomic(cell_file, {**previous, "compaction_revision": COMPACTION_REVISION})
    else:
        write_json_atomic(
            cell_file,
            {
                "config": cell.config(),
                "config_sha256": cell.config_sha256(),
                "compaction_revision": COMPACTION_REVISION,
            },
        )
    return directory


def episode_plan(
    cell: Cell, run_seeds: Sequence[int], have: set[tuple[str, int]], limit_episodes: int | None = None
) -> dict[str | None, list[int]]:
    """``{task: env seeds}`` still to play: the run seeds' episodes (the first ``limit_episodes``
    of each) not in ``have``."""
    return {
        t: [e for s in run_seeds for e in cell.env_seeds(s)[:limit_episodes] if (str(t), e) not in have]
        for t in cell.tasks
    }


def run_cell(
    suite: Suite,
    cell: Cell,
    *,
    run_seeds: Sequence[int],
    output: str | Path,
    backend: Any,
    model: dict[str, Any],
    progress: bool = True,
    on_episode: Callable[[Cell, Trajectory], None] | None = None,
    limit_episodes: int | None = None,
    label: str = "",
    run_info: dict[str, Any] | None = None,
    tensorboard: bool = True,
) -> Path:
    """Play the missing episodes of one cell (resuming) and write its record; returns its path.

    ``run_info`` is added to the record's provenance as ``run`` (e.g. ``{"jobs": 4}``). With
    ``tensorboard`` the cell's episodes, events and results are logged under
    ``OUTPUT/tensorboard/SUITE/METHOD/BUDGET`` (:func:`tensorboard_dir`; docs/tensorboard.md).
    """
    directory = prepare_cell(output, cell)
    log = directory / LOG_FILE
    cell_file = directory / CELL_FILE
    traj_path = directory / TRAJECTORIES_FILE
    done = read_episodes(traj_path, episode_key)
    plan = episode_plan(cell, run_seeds, {episode_key(d) for d in done}, limit_episodes)
    missing = sum(len(v) for v in plan.values())
    if progress or label:
        print(
            f"{label}{suite.name} {cell.key}: {len(done)} episodes on disk, {missing} to play",
            file=sys.stderr,
        )
    state = json.loads(cell_file.read_text())
    state.setdefault("started_at", now_iso())
    code_identity()  # the code this process loaded, before any episode (docs/leaderboard.md, "Provenance")
    clock = {"base": float(state.get("wall_time_s", 0.0)), "t0": time.perf_counter()}

    def save_clock() -> None:
        """Wall time of every invocation that played episodes, kept across interruptions."""
        state["wall_time_s"] = clock["base"] + time.perf_counter() - clock["t0"]
        write_json_atomic(cell_file, state)

    episodic = cell.trainer is None and cell.rsa is None  # played as env episodes by the engine
    tb = _cell_logger(output, cell, done) if tensorboard and missing and episodic else None
    if missing:
        log_line(
            log, f"start {cell.key} config={cell.config_sha256()} resume_from={len(done)} to_play={missing}"
        )

        def write(line: dict[str, Any], episode: Any) -> None:
            append_jsonl(traj_path, [line])
            save_clock()
            score = line["info"].get("progression", line["info"].get("score"))
            log_line(log, f"episode task={line['info']['eval_task']} env_seed={line['seed']} score={score}")
            if on_episode is not None:
                on_episode(cell, episode)

        if cell.trainer is not None:
            from compaction_gym.leaderboard import sb3

            sb3.play_cell(cell, plan, directory, lambda d: write(d, d), lambda m: log_line(log, m))
        elif cell.rsa is not None:
            from compaction_gym.leaderboard import rsa_cells

            def write_rsa(line: dict[str, Any]) -> None:
                line = rsa_cells.with_seed(line, cell.run_seed(int(line["seed"])))
                write(line, line)

            rsa_cells.play_cell(cell, plan, backend, write_rsa)
        else:

            def stream(_label: str, traj: Trajectory) -> None:
                traj.info["leaderboard_seed"] = cell.run_seed(int(traj.seed))
                write(jsonable(traj.to_dict()), traj)
                if tb is not None:
                    tb.log_episode(traj)

            try:
                _play_cell(cell, plan, backend, progress, stream)
            except BaseException:
                if tb is not None:
                    tb.close()
                raise
    trajectories = read_episodes(traj_path, episode_key)
    # every episode of the suite's seeds on disk (a --seeds subset never shrinks a record)
    wanted = {(str(t), e) for t in cell.tasks for s in cell.seeds for e in cell.env_seeds(s)}
    trajectories = [d for d in trajectories if episode_key(d) in wanted]
    record_path = directory / RECORD_FILE
    previous_record = load_record(record_path)
    if (
        not missing
        and previous_record is not None
        and previous_record.get("config_sha256") == cell.config_sha256()
        and previous_record["files"]["trajectories"]["sha256"] == sha256_file(traj_path)
        and "audit" in previous_record["files"]
        and (directory / AUDIT_FILE).exists()
    ):
        return record_path  # nothing new: the record stands as it is
    if not trajectories:
        raise InvalidArgumentError(f"{directory}: no episodes to make a record of")
    if cell.trainer is not None:
        from compaction_gym.leaderboard import sb3

        model = sb3.model_block(directory)
    save_clock()
    prov = run_provenance(
        state["started_at"], state["wall_time_s"], backend, run={"jobs": 1, **(run_info or {})}
    )
    record = build_record(suite, cell, directory, trajectories, model=model, prov=prov)
    errors = schema_errors(record)
    if errors:
        raise AssertionError(f"record of {cell.key} fails its schema: {errors[:3]}")
    write_json_atomic(record_path, record)
    if tb is not None:
        tb.log_histograms([Trajectory.from_dict(d) for d in trajectories], step=0)
        tb.log_scalars(record_scalars(record["results"]), step=0, prefix="summary/")
        tb.close()
    log_line(
        log, f"record {cell.key} score={record['results']['score']['mean']} episodes={len(trajectories)}"
    )
    return record_path


def run_suite(
    suite: Suite,
    *,
    methods: Sequence[str] | None = None,
    budgets: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    output: str | Path = DEFAULT_OUTPUT,
    backend: Any = None,
    engine_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
    on_episode: Callable[[Cell, Trajectory], None] | None = None,
    limit_episodes: int | None = None,
    tensorboard: bool = True,
) -> list[Path]:
    """Play every selected cell of ``suite`` (resuming) in this process, write its record, then pair
    every record with ``none``; returns the record paths (:mod:`.parallel` runs cells in workers).

    Args:
        methods: method names to run (default all); the ``none`` baseline runs first when selected.
        budgets: budget labels to run (``kv1024``, ``r0.25``; default all; ``full`` always runs).
        seeds: a subset of the suite's seeds (a record is complete only with all of them).
        output: records root (``OUTPUT/SUITE/METHOD/BUDGET``).
        backend: a loaded backend to reuse (default: the suite's model, with ``batch`` slots).
        on_episode: called as ``on_episode(cell, episode)`` after each episode is on disk (a
            ``Trajectory``; for ``sb3_ppo`` the episode's line); tests use it to interrupt a run.
        limit_episodes: play only the first N episodes per task and seed (a smoke run; its records
            are incomplete and fail ``check`` until a full run resumes them).
        tensorboard: log each cell to TensorBoard (see :func:`run_cell`).
    """
    cells, run_seeds = select_cells(suite, methods, budgets, seeds)
    llm = [c for c in cells if c.trainer is None]
    model = model_block(llm[0].model) if llm else {}
    if backend is None and llm:
        backend = load_suite_backend(llm, model["resolved"], engine_kwargs)
    written = [
        run_cell(
            suite,
            cell,
            run_seeds=run_seeds,
            output=output,
            backend=backend,
            model=model,
            progress=progress,
            on_episode=on_episode,
            limit_episodes=limit_episodes,
            label=f"[{n}/{len(cells)}] ",
            tensorboard=tensorboard,
        )
        for n, cell in enumerate(cells, 1)
    ]
    attach_comparisons(suite, output)
    return written


def load_suite_backend(cells: Sequence[Cell], resolved: str, engine_kwargs: dict[str, Any] | None) -> Any:
    """The backend the (LLM) cells run on: the suite's capacity, as many slots as the largest ``batch``."""
    kwargs = dict(engine_kwargs or {})
    if cells[0].capacity:
        kwargs.setdefault("capacity", cells[0].capacity)
    backend, _ = load_backend(resolved, max(c.batch for c in cells), kwargs)
    return backend


def tensorboard_dir(output: str | Path, cell: Cell) -> Path:
    """A cell's TensorBoard folder: ``OUTPUT/tensorboard/SUITE/METHOD/BUDGET`` (one TensorBoard run per cell)."""
    return Path(output) / "tensorboard" / cell.suite / cell.method / cell.budget.label


def record_scalars(results: dict[str, Any]) -> dict[str, float | None]:
    """A record's headline numbers for TensorBoard (``summary/<key>``)."""
    return {
        "score": results["score"]["mean"],
        "score_se": results["score"]["se"],
        "peak_kv_mean": results["kv"]["peak_mean"],
        "peak_kv_max": results["kv"]["peak_max"],
        "kv_retained_mean": results["kv"]["kv_retained_mean"],
        "tokens_mean": results["tokens"]["mean"],
        "turns_mean": results["turns_mean"],
        "compaction_events_mean": results["compaction_events_mean"],
    }


def _cell_logger(output: str | Path, cell: Cell, done: list[dict[str, Any]]) -> Any:
    """The cell's :class:`TrajectoryLogger`, continuing the step counts of the episodes on disk
    (a cell started afresh clears older event files)."""
    from compaction_gym.agents.tensorboard import TrajectoryLogger

    log_dir = tensorboard_dir(output, cell)
    if not done and log_dir.is_dir():
        shutil.rmtree(log_dir)
    return TrajectoryLogger(
        log_dir, episode_step=len(done), event_step=sum(len(d.get("events", [])) for d in done)
    )


def _play_cell(
    cell: Cell, plan: dict[Any, list[int]], backend: Any, progress: bool, stream: Callable
) -> None:
    """Play a cell's missing episodes through :func:`play`, streaming each to ``stream``."""
    play(
        cell.model,
        cell.env,
        tasks=cell.tasks,
        compaction=cell.compaction,
        sampling=cell.sampling,
        prompt=cell.prompt,
        seeds=plan,
        batch=cell.batch,
        env_kwargs=cell.env_kwargs,
        backend=backend,
        progress=progress,
        policy=cell.policy,
        on_episode=stream,
        desc=cell.key,
    )


def attach_comparisons(suite: Suite, output: str | Path) -> None:
    """Give every record of ``suite`` under ``output`` its paired comparison with the current
    ``none`` record (rewritten atomically only when it changes)."""

    def compare(cell: Cell, record: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any] | None:
        return comparison(record["results"]["episodes"], baseline["results"]["episodes"])

    attach_paired(suite, output, baseline_cell(suite), compare)


def attach_paired(
    suite: SuiteFile[C],
    output: str | Path,
    base: C | None,
    compare: Callable[[C, dict[str, Any], dict[str, Any]], dict[str, Any] | None],
) -> None:
    """Give every record of ``suite`` under ``output`` but ``base``'s the comparison
    ``compare(cell, record, base record)`` with the base record's content hash added (either suite
    kind; a record is rewritten atomically only when its comparison changes)."""
    if base is None:
        return
    baseline = load_record(cell_dir(output, base) / RECORD_FILE)
    if baseline is None:
        return
    for cell in suite.cells:
        if cell.key == base.key:
            continue
        path = cell_dir(output, cell) / RECORD_FILE
        record = load_record(path)
        if record is None:
            continue
        comp = compare(cell, record, baseline)
        if comp is not None:
            comp = {**comp, "baseline_content_sha256": baseline["content_sha256"]}
        stored = record.get("comparison_vs_none")
        # unchanged up to float noise (summation order): leave the sealed record as it is
        same = comp is None and stored is None
        if comp is not None and stored is not None:
            same = comp["baseline_content_sha256"] == stored.get("baseline_content_sha256") and json_close(
                finite(comp), stored
            )
        if not same:
            record["comparison_vs_none"] = comp
            write_json_atomic(path, seal(record))
