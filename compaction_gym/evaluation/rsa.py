"""RSA as an evaluation mode of the math envs: accuracy vs compute against plain sampling (docs/rsa.md).

Each question (env seed ``s``) runs RSA with ``N``, ``K``, ``T`` (seed ``s``) and two baselines:
plain sampling of ``N·(T + 1)`` solutions (as many generations as RSA makes) and plain sampling
until as many sampled tokens as RSA's. All are scored by the env on their final population:
``mean`` (the average per-member score, the paper's metric) and ``vote`` (the majority-vote
answer's score), with their token counts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import gymnasium as gym

from compaction_gym.agents.evaluate import task_env_kwargs
from compaction_gym.agents.rsa import RSA, RSACompute, RSAConfig, RSARun, derive, score_population
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.envs.math import extract_answer
from compaction_gym.errors import InvalidArgumentError

#: the methods one question reports
METHODS = ("rsa", "plain", "plain_tokens")
#: most batches :func:`plain_at_tokens` draws
MAX_PLAIN_BATCHES = 64
#: how a response's answer is found: the env's own rule (the last ``<answer>`` tag), or, for small
#: models that ignore the tag instruction, the last number of a response without a tag
ANSWER_FORMATS = ("tag", "last_number")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def normalise(text: str, answer_format: str) -> str:
    """The response the env scores: ``text`` itself (``tag``), or with ``last_number`` and no
    ``<answer>`` tag, its last number wrapped in one (unchanged when it has none)."""
    if answer_format not in ANSWER_FORMATS:
        raise InvalidArgumentError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    if answer_format == "tag" or extract_answer(text) is not None:
        return text
    numbers = _NUMBER.findall(text)
    return f"<answer>{numbers[-1]}</answer>" if numbers else text


def plain_config(cfg: RSAConfig) -> RSAConfig:
    """Plain sampling with as many generations as ``cfg`` makes: ``N·(T + 1)`` solutions, no rounds."""
    return RSAConfig(population=cfg.population * (cfg.rounds + 1), subset=1, rounds=0, seed=cfg.seed)


def plain_at_tokens(
    engine: Any,
    question: str,
    cfg: RSAConfig,
    target: int,
    *,
    compaction: CompactionConfig | None = None,
    sampling: SamplingParams | None = None,
) -> RSARun:
    """Plain sampling at RSA's token budget: batches of ``N·(T + 1)`` independent solutions (batch
    ``b`` seeded ``derive(cfg.seed, 1_000_000 + b)``) until their sampled tokens reach ``target``
    (RSA's ``generated``), at most :data:`MAX_PLAIN_BATCHES`. Returns one population of them all."""
    texts: list[str] = []
    total = RSARun([texts], [], RSACompute())
    base = plain_config(cfg)
    for b in range(MAX_PLAIN_BATCHES):
        run = RSA(engine, replace(base, seed=derive(cfg.seed, 1_000_000 + b)), compaction=compaction, sampling=sampling).run(question)
        total.members.extend(replace(m, index=len(texts) + m.index) for m in run.members)
        texts.extend(run.populations[0])
        total.compute.add(run.compute)
        if total.compute.generated >= target:
            break
    return total


def env_scorer(env: gym.Env, info: dict[str, Any], answer_format: str = "tag") -> Callable[[str], float]:
    """Scores a response to the question ``info`` describes by the env's own verifier (a fresh
    one-step episode on the same item per response; the response passed through :func:`normalise` first)."""

    def score(text: str) -> float:
        env.reset(options={"dataset": info["dataset"], "index": info["index"]})
        return float(env.step(normalise(text, answer_format))[1])

    return score


def answer_extractor(env: gym.Env, answer_format: str = "tag") -> Callable[[str], str | None]:
    """The answer the env scores in the text after :func:`normalise`: the env's own reading
    (``MathEnv.extract``: the last ``<answer>`` tag, else its ``answer_fallback`` when the tag is
    not required)."""
    read = env.unwrapped.extract

    def extract(text: str) -> str | None:
        return read(normalise(text, answer_format))

    return extract


def question_row(run: RSARun, score: Callable[[str], float], extract: Callable[[str], str | None] = extract_answer) -> dict[str, Any]:
    """A method's row for one question: scores of the final population and the compute."""
    return {
        **score_population(score, run.populations[-1], extract),
        **{f"tokens_{k}": v for k, v in asdict(run.compute).items()},
        "final_answers": [extract(t) for t in run.populations[-1]],
    }


def evaluate_rsa(
    engine: Any,
    env_id: str,
    cfg: RSAConfig,
    *,
    tasks: Sequence[str | None] = (None,),
    episodes: int = 4,
    seed: int = 0,
    compaction: CompactionConfig | None = None,
    sampling: SamplingParams | None = None,
    env_kwargs: dict[str, Any] | None = None,
    baseline: bool = True,
    output: str | Path | None = None,
    answer_format: str = "tag",
    on_question: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """RSA and its baselines on ``episodes`` questions per task: ``plain`` (as many generations
    as RSA) and ``plain_tokens`` (plain sampling until as many sampled tokens as RSA's,
    :func:`plain_at_tokens`).

    ``answer_format`` (:data:`ANSWER_FORMATS`) says how a response's answer is found before the
    env scores it (:func:`normalise`).

    Returns:
        ``{"questions": [...], "summary": {method: {"mean", "vote", "any", "tokens_generated",
        "tokens_prefilled", ...}}}``; with ``output``, also written as ``OUTPUT/rsa.jsonl`` (one
        question per line) and ``OUTPUT/rsa_summary.json``.
    """
    rows: list[dict[str, Any]] = []
    out = Path(output) if output is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "rsa.jsonl").write_text("")
    for task in tasks:
        env = gym.make(env_id, **task_env_kwargs(env_id, task), **(env_kwargs or {}))
        try:
            for i in range(episodes):
                s = seed + i
                question, info = env.reset(seed=s)
                score = env_scorer(env, info, answer_format)
                row: dict[str, Any] = {"task": info.get("dataset", task), "seed": s, "index": info["index"], "answer": str(info["answer"])}
                runs = {"rsa": replace(cfg, seed=s)}
                if baseline:
                    runs["plain"] = plain_config(runs["rsa"])
                extract = answer_extractor(env, answer_format)
                for name, rcfg in runs.items():
                    run = RSA(engine, rcfg, compaction=compaction, sampling=sampling).run(question)
                    row[name] = question_row(run, score, extract)
                    if name == "rsa" and baseline:
                        target = run.compute.generated
                        eq = plain_at_tokens(engine, question, rcfg, target, compaction=compaction, sampling=sampling)
                        row["plain_tokens"] = question_row(eq, score, extract) | {"samples": len(eq.populations[0])}
                rows.append(row)
                if out is not None:  # one line per question as it ends
                    with (out / "rsa.jsonl").open("a") as fh:
                        fh.write(json.dumps(row) + "\n")
                if on_question is not None:
                    on_question(row)
        finally:
            env.close()
    summary = summarise(rows)
    if out is not None:
        meta = {"config": asdict(cfg), "answer_format": answer_format, "summary": summary}
        (out / "rsa_summary.json").write_text(json.dumps(meta, indent=2))
    return {"questions": rows, "summary": summary}


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per method: the mean over questions of every numeric field of its rows."""
    out: dict[str, dict[str, float]] = {}
    for name in METHODS:
        got = [r[name] for r in rows if name in r]
        if got:
            keys = [k for k, v in got[0].items() if isinstance(v, int | float)]
            out[name] = {k: sum(g[k] for g in got) / len(got) for k in keys} | {"questions": len(got)}
    return out


def markdown_table(summary: dict[str, dict[str, float]], cfg: RSAConfig) -> str:
    """The summary as a Markdown table (accuracy in %, tokens per question)."""
    lines = [
        "| method | questions | mean acc % | vote acc % | pass@N % | generated tok/q | prefilled tok/q | prefilled unshared tok/q |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "rsa": f"RSA N={cfg.population} K={cfg.subset} T={cfg.rounds}",
        "plain": f"plain sampling, {cfg.population * (cfg.rounds + 1)} samples (equal generations)",
        "plain_tokens": "plain sampling at RSA's sampled tokens ({:.1f} samples/q)",
    }
    for name, s in summary.items():
        label = names[name].format(s.get("samples", 0))
        lines.append(
            f"| {label} | {int(s['questions'])} | {100 * s['mean']:.1f} | {100 * s['vote']:.1f} | "
            f"{100 * s['any']:.1f} | {s['tokens_generated']:.0f} | {s['tokens_prefilled']:.0f} | "
            f"{s['tokens_prefilled_unshared']:.0f} |"
        )
    return "\n".join(lines)
