"""``leaderboard run --jobs N``: a suite's cells in N worker processes on one device.

Each worker loads the model once (one torch thread, its own CUDA context when on a GPU) and takes
cells from a shared queue, ``none`` first, then the largest ones; a cell is one directory, so
workers never share a file and resuming works exactly as for a serial run. The parent shows one
progress bar over every episode to play and pairs every record with ``none`` at the end
(``docs/leaderboard.md``, "Running in parallel").
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compaction_gym.errors import CompactionGymError, InvalidArgumentError
from compaction_gym.leaderboard.plan import cell_plan
from compaction_gym.leaderboard.runner import (
    attach_comparisons,
    load_suite_backend,
    model_block,
    prepare_cell,
    run_cell,
    select_cells,
)
from compaction_gym.leaderboard.suite import DEFAULT_OUTPUT, Suite, load_suite

#: environment a worker starts with: one thread per torch/BLAS pool (N workers share the cores).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class RunIncomplete(CompactionGymError):
    """The run stopped at its time limit (or on SIGTERM) with cells unfinished; re-run to resume."""


def _exit_with_parent(parent: int) -> None:
    """Worker watchdog: end this process when the parent is gone (never two writers on a cell)."""
    while True:
        time.sleep(2.0)
        if os.getppid() != parent:
            os._exit(1)


def _worker(
    suite_path: str,
    keys: list[str],
    options: dict[str, Any],
    tasks: Any,
    events: Any,
) -> None:
    """Worker process: load the model, then run cells named by ``tasks`` until a ``None``."""
    import torch

    threading.Thread(target=_exit_with_parent, args=(options["parent"],), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it terminates us
    torch.set_num_threads(1)
    try:
        suite = load_suite(suite_path)
        llm = [c for c in (suite.cell(*k.split("/", 1)) for k in keys) if c.trainer is None]
        model = model_block(llm[0].model) if llm else {}
        backend = load_suite_backend(llm, model["resolved"], options["engine_kwargs"]) if llm else None
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the run
        events.put(("fatal", "", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        key = tasks.get()
        if key is None:
            return
        cell = suite.cell(*key.split("/", 1))
        events.put(("start", key, os.getpid()))
        try:
            path = run_cell(
                suite,
                cell,
                run_seeds=options["run_seeds"],
                output=options["output"],
                backend=backend,
                model=model,
                progress=False,
                on_episode=lambda c, _episode: events.put(("episode", c.key, None)),
                limit_episodes=options["limit_episodes"],
                tensorboard=options["tensorboard"],
                run_info={"jobs": options["jobs"]},
            )
        except BaseException as exc:  # noqa: BLE001 - one failing cell must not stop the others
            events.put(("error", key, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        else:
            events.put(("done", key, str(path)))


def schedule(suite: Suite, cells: Sequence[Any], plans: dict[str, int]) -> list[str]:
    """Cell keys in the order workers take them: ``none`` first, then agents trained outside the
    engine (``sb3_ppo``: their training is not checkpointed, so it starts at the beginning of a
    time-limited call), then by episodes to play and smaller budgets first (they take more turns);
    cells with nothing to play last."""
    base = suite.baseline

    def order(cell: Any) -> tuple[bool, bool, int, int]:
        return (
            base is None or cell.key != base.key,
            cell.trainer is None,
            -plans[cell.key],
            cell.budget.max_kv_len or 0,
        )

    return [c.key for c in sorted(cells, key=order)]


def run_suite_parallel(
    suite: Suite,
    *,
    jobs: int,
    methods: Sequence[str] | None = None,
    budgets: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    output: str | Path = DEFAULT_OUTPUT,
    engine_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
    limit_episodes: int | None = None,
    tensorboard: bool = True,
    time_limit: float | None = None,
) -> list[Path]:
    """Run the selected cells of ``suite`` in ``jobs`` worker processes; returns the record paths.

    Same selection, files and resume rules as :func:`~compaction_gym.leaderboard.runner.run_suite`.
    With ``time_limit`` (seconds), or on SIGTERM, the workers are stopped (the episodes in flight
    are lost, every finished one is on disk), the finished records are paired with ``none``, and
    :class:`RunIncomplete` says what is left.

    Raises:
        RunIncomplete: the time limit or SIGTERM came first.
        InvalidArgumentError: ``jobs`` < 1, a bad selection, or a cell directory of another config
            or with stale episodes (checked for every cell before any worker starts).
        CompactionGymError: a worker failed to load the model, or some cells failed (the others'
            records are written and paired first).
    """
    from tqdm.auto import tqdm

    if jobs < 1:
        raise InvalidArgumentError(f"--jobs must be >= 1, got {jobs}")
    cells, run_seeds = select_cells(suite, methods, budgets, seeds)
    for cell in cells:
        prepare_cell(output, cell)
    llm = [c for c in cells if c.trainer is None]
    if llm:
        model_block(llm[0].model)  # a model converted on first use is converted once, here
    plans = {p.cell.key: p.to_play for p in cell_plan(cells, run_seeds, output, limit_episodes)}
    order = schedule(suite, cells, plans)
    total = sum(plans.values())
    options = {
        "run_seeds": run_seeds,
        "output": str(output),
        "engine_kwargs": dict(engine_kwargs or {}),
        "limit_episodes": limit_episodes,
        "tensorboard": tensorboard,
        "jobs": jobs,
        "parent": os.getpid(),
    }
    n_workers = min(jobs, len(order))
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    tasks, events = ctx.Queue(), ctx.Queue()
    for key in order:
        tasks.put(key)
    for _ in range(n_workers):
        tasks.put(None)
    saved = {k: os.environ.get(k) for k in WORKER_ENV}
    os.environ.update(WORKER_ENV)
    try:
        workers = [
            ctx.Process(
                target=_worker,
                args=(str(suite.path), [c.key for c in cells], options, tasks, events),
                daemon=True,
            )
            for _ in range(n_workers)
        ]
        for w in workers:
            w.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print(
        f"{suite.name}: {len(order)} cells, {total} episodes to play, {n_workers} workers",
        file=sys.stderr,
    )
    bar = tqdm(total=total, desc=suite.name, unit="ep", disable=not progress, file=sys.stderr)
    written: dict[str, Path] = {}
    errors: dict[str, str] = {}
    running: dict[str, Any] = {}
    finished = False
    stopped: list[str] = []
    deadline = None if time_limit is None else time.monotonic() + time_limit

    def on_term(signum: int, _frame: Any) -> None:
        stopped.append(signal.Signals(signum).name)

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if in_main else None
    try:
        while len(written) + len(errors) < len(order):
            if deadline is not None and time.monotonic() > deadline:
                stopped.append(f"time limit {time_limit:g} s")
            if stopped:
                break
            try:
                kind, key, payload = events.get(timeout=1.0)
            except queue.Empty:
                if not any(w.is_alive() for w in workers):
                    lost = [k for k in order if k not in written and k not in errors]
                    errors.update({k: "worker exited before finishing this cell" for k in lost})
                continue
            if kind == "fatal":
                raise CompactionGymError(f"a worker could not start: {payload}")
            if kind == "start":
                running[key] = payload
            elif kind == "episode":
                bar.update(1)
            elif kind == "done":
                running.pop(key, None)
                written[key] = Path(payload)
                bar.write(f"done {key} ({len(written)}/{len(order)} cells)", file=sys.stderr)
            elif kind == "error":
                running.pop(key, None)
                errors[key] = payload
                bar.write(f"FAILED {key}: {payload.splitlines()[0]}", file=sys.stderr)
            bar.set_postfix(cells=f"{len(written)}/{len(order)}", running=len(running))
        finished = not stopped
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        bar.close()
        for w in workers:
            if not finished and w.is_alive():
                w.terminate()  # what finished is on disk: a re-run resumes
            w.join(timeout=60)
    attach_comparisons(suite, output)
    if stopped:
        left = [k for k in order if k not in written and k not in errors]
        raise RunIncomplete(
            f"stopped ({stopped[0]}): {len(written)} of {len(order)} cells done, "
            f"{len(left)} unfinished, {len(errors)} failed; re-run the same command to resume"
        )
    if errors:
        detail = "\n".join(f"{k}: {v}" for k, v in errors.items())
        raise CompactionGymError(f"{len(errors)} of {len(order)} cells failed (re-run to resume):\n{detail}")
    return [written[k] for k in order]
