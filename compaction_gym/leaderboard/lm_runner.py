"""``leaderboard run`` for language-modelling suites (``kind = "lm"``): one record per cell.

The model reads the suite's text through :func:`compaction_gym.lmeval.score_cells` (one compacted
session per (compaction config, seed), cells stepped together); a cell with the mixer rescores
its model pass with a fresh mixer in one score-first pass. Per cell ``OUTPUT/SUITE/METHOD/BUDGET/``:
``scores.jsonl`` (one line per seed), ``run.log``, and ``submission.json`` (atomic). A cell whose
record stands (same config, same scores file) is not re-run (docs/leaderboard.md,
"Language-modelling suites").
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compaction_gym.compaction.revisions import COMPACTION_REVISION
from compaction_gym.evaluation.summary import finite
from compaction_gym.leaderboard.lm_record import (
    LM_RECORD_SCHEMA,
    SCORES_FILE,
    lm_comparison,
    lm_results,
    lm_schema_errors,
)
from compaction_gym.leaderboard.lm_suite import LmCell, LmSuite
from compaction_gym.leaderboard.record import LOG_FILE, RECORD_FILE, seal
from compaction_gym.leaderboard.runner import (
    attach_paired,
    cell_dir,
    log_line,
    model_block,
    now_iso,
    record_head,
    run_provenance,
    selected_cells,
)
from compaction_gym.leaderboard.staleness import refuse_stale_cell
from compaction_gym.leaderboard.store import append_jsonl, read_episodes, sha256_file, write_json_atomic
from compaction_gym.leaderboard.suite import DEFAULT_OUTPUT
from compaction_gym.lmeval.mixer import MIXERS, mix_stream
from compaction_gym.lmeval.scoring import Cell as ScoreCell
from compaction_gym.lmeval.scoring import CellResult, piece_bytes, score_cells
from compaction_gym.provenance import code_identity

#: an lm cell's folder (:func:`.runner.cell_dir`, the same layout for both kinds)
lm_cell_dir = cell_dir


def _nums(xs: Sequence[float]) -> list[float | None]:
    return [None if math.isnan(x) else float(x) for x in xs]


def score_line(
    cell: LmCell, seed: int, ids: list[int], nbytes: list[int], res: CellResult, vocab: int
) -> dict[str, Any]:
    """One seed's line of ``scores.jsonl``: the model pass, mixed when the cell has a mixer."""
    logprobs = [None if math.isnan(x) else -x for x in res.nll]
    entropies = _nums(res.entropy)
    nll: list[float | None] = _nums(res.nll)
    if cell.mixer is not None:
        mixer = MIXERS[str(cell.mixer_name)](cell.mixer, vocab)
        nll = _nums(mix_stream(mixer, ids, logprobs, entropies, cell.chunk)[0])
    return {
        "seed": seed,
        "token_ids": ids,
        "bytes": nbytes,
        "logprobs": logprobs,
        "entropies": entropies,
        "kv_seen": res.kv_seen,
        "nll": nll,
        "events": res.events,
        "seconds": res.seconds,
        "compaction_revision": COMPACTION_REVISION,
    }


def run_lm_suite(
    suite: LmSuite,
    *,
    methods: Sequence[str] | None = None,
    budgets: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    output: str | Path = DEFAULT_OUTPUT,
    engine_kwargs: dict[str, Any] | None = None,
    model_and_tokenizer: tuple[Any, Any] | None = None,
) -> list[Path]:
    """Score every selected cell of ``suite`` that has no standing record; returns the record paths.

    Args:
        methods, budgets, seeds: a selection (default all; ``full`` always runs).
        engine_kwargs: ``device``, ``dtype``, ``capacity`` for the engine.
        model_and_tokenizer: a loaded ``(model, tokenizer)`` to reuse (tests).
    """
    import torch

    from compaction_gym.backends import LocalBackend
    from compaction_gym.engine import Engine
    from compaction_gym.models.registry import load_model

    cells = selected_cells(suite, methods, budgets, seeds, suite.seeds)
    started_at = now_iso()
    code_identity()  # the code this process loaded (docs/leaderboard.md, "Provenance")
    engine_kwargs = dict(engine_kwargs or {})
    model_info = model_block(cells[0].model)
    # what each cell still needs: (cell, seed) pairs whose line is not on disk
    todo: dict[tuple[str, int], list[LmCell]] = {}
    for cell in cells:
        directory = lm_cell_dir(output, cell)
        directory.mkdir(parents=True, exist_ok=True)
        lines = read_episodes(directory / SCORES_FILE, lambda d: int(d["seed"]))
        if lines:  # a line without its revision is from before the field: revision 1
            played_at = min(int(d.get("compaction_revision", 1)) for d in lines)
            refuse_stale_cell(directory, cell.config()["compaction"], played_at)
        have = {int(d["seed"]) for d in lines}
        for seed in cell.seeds if not seeds else [s for s in cell.seeds if s in seeds]:
            if seed not in have:
                todo.setdefault((json.dumps(cell.compaction.to_dict(), sort_keys=True), seed), []).append(
                    cell
                )
    backend = None
    if todo:
        if model_and_tokenizer is None:
            device = torch.device(
                engine_kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
            )
            model_and_tokenizer = load_model(
                model_info["resolved"], dtype=engine_kwargs.get("dtype"), device=device
            )
        model, tokenizer = model_and_tokenizer
        text = cells[0].text_file.read_text(encoding="utf-8")
        ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"][: cells[0].max_tokens]]
        nbytes = piece_bytes(tokenizer, ids)
        vocab = int(model.get_output_embeddings().weight.shape[0])
        budget_rows = max((c.compaction.max_kv_len or 0) + c.chunk for c in cells)
        capacity = int(engine_kwargs.get("capacity") or max(len(ids), budget_rows))
        max_batch = max(c.batch for c in cells)
        engine = Engine(model, tokenizer, max_slots=max_batch, capacity=capacity)
        backend = LocalBackend(engine, name=cells[0].model)
    by_seed: dict[int, list[str]] = {}
    for comp, seed in todo:
        by_seed.setdefault(seed, []).append(comp)
    for seed, comps in sorted(by_seed.items()):
        assert backend is not None
        score = [ScoreCell(todo[(c, seed)][0].key, todo[(c, seed)][0].compaction) for c in comps]
        print(f"{suite.name}: seed {seed}, {len(score)} model passes over {len(ids)} tokens", file=sys.stderr)
        t0 = time.perf_counter()
        results = score_cells(
            backend, ids, score, nbytes, chunk=cells[0].chunk, score_after=cells[0].score_after,
            max_batch=max_batch, seed=seed,
        )  # fmt: skip
        for comp, res in zip(comps, results):
            for cell in todo[(comp, seed)]:
                directory = lm_cell_dir(output, cell)
                line = score_line(cell, seed, ids, nbytes, res, vocab)
                append_jsonl(directory / SCORES_FILE, [line])
                log_line(directory / LOG_FILE, f"seed {seed} scored in {time.perf_counter() - t0:.1f}s")
    run = {"started_at": started_at, "model": model_info, "backend": backend}
    written = [write_lm_record(suite, cell, output, run) for cell in cells]
    attach_lm_comparisons(suite, output)
    return [p for p in written if p is not None]


def write_lm_record(suite: LmSuite, cell: LmCell, output: str | Path, run: dict[str, Any]) -> Path | None:
    """Seal and write a cell's record from its ``scores.jsonl`` (``None`` while seeds are missing).

    ``run``: ``started_at``, ``model`` (:func:`model_block`) and ``backend`` of this invocation."""
    directory = lm_cell_dir(output, cell)
    path = directory / SCORES_FILE
    lines = [d for d in read_episodes(path, lambda d: int(d["seed"])) if int(d["seed"]) in cell.seeds]
    if {int(d["seed"]) for d in lines} != set(cell.seeds):
        return None
    old = json.loads((directory / RECORD_FILE).read_text()) if (directory / RECORD_FILE).exists() else None
    if (
        old
        and old["config_sha256"] == cell.config_sha256()
        and old["files"]["scores"]["sha256"] == sha256_file(path)
    ):
        return directory / RECORD_FILE
    record = seal(
        {
            "schema": LM_RECORD_SCHEMA,
            **record_head(suite, cell),
            "seeds": sorted(int(d["seed"]) for d in lines),
            "results": lm_results(cell, lines),
            "comparison_vs_none": None,
            "model": run["model"],
            "provenance": run_provenance(
                run["started_at"], math.fsum(float(d["seconds"]) for d in lines), run["backend"]
            ),
            "files": {
                "scores": {"path": SCORES_FILE, "sha256": sha256_file(path), "lines": len(lines)},
                "log": LOG_FILE,
            },
        }
    )
    errors = lm_schema_errors(record)
    if errors:
        raise AssertionError(f"record of {cell.key} fails its schema: {errors[:3]}")
    write_json_atomic(directory / RECORD_FILE, record)
    log_line(directory / LOG_FILE, f"record {cell.key} bits_per_byte={record['results']['score']['mean']}")
    return directory / RECORD_FILE


def lm_baseline(suite: LmSuite) -> LmCell | None:
    """The full-cache cell without a mixer (:attr:`LmSuite.baseline`)."""
    return suite.baseline


def read_lines(directory: Path) -> list[dict[str, Any]]:
    path = directory / SCORES_FILE
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def attach_lm_comparisons(suite: LmSuite, output: str | Path) -> None:
    """Give every other record of ``suite`` its paired comparison with the baseline record."""
    base = lm_baseline(suite)
    base_lines: list[list[dict[str, Any]]] = []  # read once, when the first comparison needs it

    def compare(cell: LmCell, record: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any] | None:
        if not base_lines and base is not None:
            base_lines.append(read_lines(cell_dir(output, base)))
        lines = [d for d in read_lines(cell_dir(output, cell)) if int(d["seed"]) in cell.seeds]
        comp = lm_comparison(lines, base_lines[0], cell.score_after)
        return None if comp is None else finite(comp)

    attach_paired(suite, output, base, compare)
