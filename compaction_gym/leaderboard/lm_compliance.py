"""``leaderboard check`` for language-modelling records (docs/leaderboard.md, "Language-modelling suites").

An lm record passes when: it matches its schema and content hash; ``scores.jsonl`` is the file it
names and every number in ``results`` re-derives from it; its config hash matches the suite file
and the text's sha256 the suite's text; its seeds are the cell's; each seed's line covers the text
(the suite's ``max_tokens``, the same tokens in every line); no position attended to more than
``max_kv_len + chunk`` rows (the engine's headroom); without a mixer the scored NLL is the model's
``−log p``. With a mixer, the mixer the record names is checked on the record's own text:
Σ_v p(v) = 1 within 1e-6 at sampled positions, causality (a position's distribution does not move
when the text from it on changes), and a single pass (the recorded NLLs re-derive from one
left-to-right, score-then-count pass over the recorded model log-probs).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from compaction_gym.errors import CompactionGymError
from compaction_gym.evaluation.summary import finite
from compaction_gym.leaderboard.lm_record import lm_comparison, lm_results, lm_schema_errors
from compaction_gym.leaderboard.lm_suite import LmCell, load_lm_suite
from compaction_gym.leaderboard.record_checks import json_close, paired_failures, sealed_ok, suite_and_cell
from compaction_gym.leaderboard.store import sha256_file
from compaction_gym.lmeval.mixer import MIXERS, MixerConfig
from compaction_gym.lmeval.mixer_checks import mixer_failures, single_pass_failures

#: positions sampled per record for the normalisation and causality checks
CHECK_POSITIONS = 6
#: absolute tolerance of recomputed results (:func:`.compliance.json_close`; relative 1e-9)
LM_ABS_TOL = 1e-12


def mixer_check_failures(
    cell_mixer: dict[str, Any], lines: list[dict[str, Any]], chunk: int, vocab: int
) -> list[str]:
    """The mixer named by a record's ``config.mixer``, checked on the record's text and scores."""
    fields = {k: v for k, v in cell_mixer.items() if k != "name"}
    name = str(cell_mixer.get("name"))
    if name not in MIXERS:
        return [f"mixer: unknown mixer {name!r} (known: {sorted(MIXERS)})"]
    try:
        config = MixerConfig.from_dict(fields)
    except CompactionGymError as exc:
        return [f"mixer: {exc}"]

    def make() -> Any:
        return MIXERS[name](config, vocab)

    ids = [int(t) for t in lines[0]["token_ids"]]
    out = mixer_failures(make, ids, chunk, n_positions=CHECK_POSITIONS, seed=0, first=chunk)
    for d in lines:
        out += single_pass_failures(make, ids, d["logprobs"], d["entropies"], chunk, d["nll"])
    return out


def vocab_size(record: dict[str, Any], lines: list[dict[str, Any]]) -> int:
    """The vocabulary the mixer's distribution covers: the model's config when readable, else one
    past the largest token id of the text."""
    resolved = Path(str(record["model"].get("resolved", "")))
    cfg = resolved / "config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text())
        size = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
        if size:
            return int(size)
    return max(int(t) for t in lines[0]["token_ids"]) + 1


def token_failures(record: dict[str, Any], cell: LmCell, line: dict[str, Any]) -> list[str]:
    """The scored tokens and bytes must be the suite's text as the model's tokenizer reads it
    (checked when the model directory is on this machine; skipped otherwise)."""
    resolved = Path(str(record["model"].get("resolved", "")))
    if not (resolved / "tokenizer.json").is_file() and not (resolved / "tokenizer_config.json").is_file():
        return []
    from transformers import AutoTokenizer

    from compaction_gym.lmeval.scoring import piece_bytes

    tokenizer = AutoTokenizer.from_pretrained(resolved)
    text = cell.text_file.read_text(encoding="utf-8")
    ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"][: cell.max_tokens]]
    if ids != [int(t) for t in line["token_ids"]]:
        return ["tokens: the scored token ids are not the suite's text under the model's tokenizer"]
    if piece_bytes(tokenizer, ids) != [int(b) for b in line["bytes"]]:
        return ["tokens: the bytes per token are not the tokenizer's decoded pieces"]
    return []


def check_lm_record(path: Path, failures: list[str], suite_file: str | Path | None = None) -> None:
    """Append every broken rule of the lm record at ``path`` to ``failures``."""
    fail = failures
    record = json.loads(path.read_text())
    if not sealed_ok(record, lm_schema_errors(record), fail):
        return
    scores = path.parent / record["files"]["scores"]["path"]
    if not scores.exists():
        fail.append(f"missing {scores.name}")
        return
    if sha256_file(scores) != record["files"]["scores"]["sha256"]:
        fail.append(f"{scores.name} differs from the one the record was computed from")
    lines = [json.loads(x) for x in scores.read_text().splitlines() if x.strip()]
    suite, cell = suite_and_cell(
        record, suite_file, load_lm_suite, fail, "the suite, its text or the record changed"
    )
    if suite is None or cell is None:
        return
    if record["seeds"] != cell.seeds or sorted(int(d["seed"]) for d in lines) != cell.seeds:
        fail.append(f"seeds {sorted(int(d['seed']) for d in lines)} are not the cell's {cell.seeds}")
    if not lines:
        return
    n = len(lines[0]["token_ids"])
    for d in lines:
        if d["token_ids"] != lines[0]["token_ids"] or any(
            len(d[k]) != n for k in ("bytes", "logprobs", "entropies", "kv_seen", "nll")
        ):
            fail.append(f"seed {d['seed']}: its line does not cover the same {n} tokens")
            return
    if n != cell.max_tokens:
        fail.append(f"{n} tokens scored, the suite reads {cell.max_tokens}")
    fail.extend(token_failures(record, cell, lines[0]))
    try:
        recomputed = finite(lm_results(cell, lines))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        fail.append(f"scores unreadable: {exc}")
        return
    for key in recomputed:
        if not json_close(recomputed[key], record["results"][key], abs_tol=LM_ABS_TOL):
            fail.append(f"results.{key} does not match {scores.name}")
    budget = record["budget"]["max_kv_len"]
    if budget is not None:
        worst = max(max(int(k) for k in d["kv_seen"]) for d in lines)
        if worst > budget + cell.chunk:
            fail.append(
                f"budget overrun: a token attended to {worst} rows > max_kv_len {budget} + chunk {cell.chunk}"
            )
    if record["config"]["mixer"] is None:
        for d in lines:
            bad = [
                p
                for p in range(1, n)
                if d["logprobs"][p] is None
                or d["nll"][p] is None
                or not math.isclose(-d["logprobs"][p], d["nll"][p], rel_tol=1e-12, abs_tol=1e-12)
            ]
            if bad:
                fail.append(
                    f"seed {d['seed']}: the NLL at {len(bad)} positions is not the model's -log p (first {bad[:5]})"
                )
    else:
        fail.extend(
            mixer_check_failures(record["config"]["mixer"], lines, cell.chunk, vocab_size(record, lines))
        )

    def recompute(baseline: dict[str, Any], base_dir: Path) -> dict[str, Any] | None:
        scores_file = base_dir / baseline["files"]["scores"]["path"]
        base_lines = [json.loads(x) for x in scores_file.read_text().splitlines() if x.strip()]
        return lm_comparison(lines, base_lines, cell.score_after)

    fail.extend(
        paired_failures(path, record, suite.baseline, recompute, "scores", "re-run `leaderboard run`")
    )
