"""RSA as a leaderboard method: Recursive Self-Aggregation, or plain sampling at its compute, per question.

A suite method ``{name = ..., agent = "rsa", population = N, subset = K, rounds = T, variant = ...,
score = ..., sampling = {...}}`` plus any ``CompactionConfig`` field (every member's compaction,
with the method's budgets) plays each ``(task, env seed)`` of the suite as one question
(docs/rsa.md, docs/leaderboard.md "RSA methods"):

* ``variant = "rsa"``: RSA with ``N``, ``K``, ``T`` (:class:`~compaction_gym.agents.rsa.RSA`);
* ``"plain"``: plain sampling of ``N·(T + 1)`` solutions (as many generations as RSA);
* ``"plain_tokens"``: plain sampling until as many sampled tokens as RSA's on that question (RSA
  is run first for its count: this cell costs both).

The episode's score is the env's score of the final population's majority-vote answer
(``score = "vote"``) or the mean member score (``"mean"``); its tokens are every token fed and
sampled (shared prefixes once). RSA seed and sampling seeds are the env seed, so a cell is a pure
function of its config. Each episode is one ``kind = "rsa"`` line in ``trajectories.jsonl``: one
"turn" per member generation and every member's compaction events (tagged with their session),
which ``leaderboard check`` reads as it reads an episode's turns and events.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from compaction_gym.agents.rsa import RSA, RSAConfig, RSARun, score_population
from compaction_gym.engine.config import SamplingParams
from compaction_gym.errors import InvalidArgumentError

AGENT = "rsa"
KIND = "rsa"
VARIANTS = ("rsa", "plain", "plain_tokens")
SCORES = ("vote", "mean")
#: method keys that configure RSA (everything else of the method is a ``CompactionConfig`` field)
RSA_KEYS = ("agent", "population", "subset", "rounds", "variant", "score", "sampling")


def rsa_settings(
    where: str, method: Mapping[str, Any], suite_sampling: SamplingParams
) -> tuple[dict[str, Any], SamplingParams]:
    """Validate an ``agent = "rsa"`` method's RSA keys into the cell's ``rsa`` block, and its members'
    sampling (the suite's ``[sampling]`` with the method's ``sampling`` table over it).

    Raises:
        InvalidArgumentError: a bad ``population`` / ``subset`` / ``rounds`` / ``variant`` /
            ``score`` / ``sampling`` (named), or greedy sampling (every member would be the same).
    """
    cfg = {k: method.get(k, getattr(RSAConfig, k)) for k in ("population", "subset", "rounds")}
    try:
        RSAConfig(**cfg)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from exc
    variant, score = method.get("variant", "rsa"), method.get("score", "vote")
    if variant not in VARIANTS:
        raise InvalidArgumentError(f"{where}: variant must be one of {VARIANTS}, got {variant!r}")
    if score not in SCORES:
        raise InvalidArgumentError(f"{where}: score must be one of {SCORES}, got {score!r}")
    table = method.get("sampling", {})
    if not isinstance(table, Mapping) or "seed" in table:
        raise InvalidArgumentError(f"{where}: sampling must be a table of SamplingParams fields without seed")
    try:
        sampling = SamplingParams.from_dict({**suite_sampling.to_dict(), **table})
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}: sampling: {exc}") from exc
    if sampling.temperature == 0:
        raise InvalidArgumentError(
            f"{where}: sampling.temperature must be > 0 for RSA (greedy members are all alike)"
        )
    return {"agent": AGENT, **cfg, "variant": variant, "score": score}, sampling


def run_question(engine: Any, settings: Mapping[str, Any], question: str, seed: int, cell: Any) -> RSARun:
    """The final population of one question under the cell's variant (seed ``seed``)."""
    from compaction_gym.evaluation.rsa import plain_at_tokens, plain_config

    cfg = RSAConfig(settings["population"], settings["subset"], settings["rounds"], seed)
    kw = {"compaction": cell.compaction, "sampling": cell.sampling}
    if settings["variant"] == "plain":
        return RSA(engine, plain_config(cfg), **kw).run(question)
    run = RSA(engine, cfg, **kw).run(question)
    if settings["variant"] == "rsa":
        return run
    return plain_at_tokens(engine, question, cfg, run.compute.generated, **kw)


def episode_line(
    run: RSARun, scores: dict[str, float], answers: list[str | None], env_seed: int, info: dict[str, Any]
) -> dict[str, Any]:
    """One question's ``trajectories.jsonl`` line: scores, compute, the populations, and per member
    generation a turn (its own input range after the shared prefix, its peak KV) and its events."""
    turns = [
        {
            "round": m.round,
            "member": m.index,
            "input_range": [m.prompt_len, m.prompt_len + m.input_len],
            "logical_len": m.prompt_len + m.input_len + m.generated,
            "generated": m.generated,
            "kv_len": m.kv_len,
            "peak_kv_len": m.peak_kv_len,
        }
        for m in run.members
    ]
    events = [
        {**ev.to_dict(), "session": j, "session_prompt_len": m.prompt_len}
        for j, m in enumerate(run.members)
        for ev in m.events
    ]
    return {
        "kind": KIND,
        "seed": env_seed,
        "prompt_len": min((m.prompt_len for m in run.members), default=0),
        "info": info,
        "scores": scores,
        "compute": asdict(run.compute),
        "final_answers": answers,
        "populations": run.populations,
        "turns": turns,
        "events": events,
    }


def play_cell(
    cell: Any,
    plan: Mapping[str | None, list[int]],
    backend: Any,
    write: Callable[[dict[str, Any]], None],
) -> None:
    """Play the cell's missing questions (``{task: env seeds}``), handing each line to ``write``."""
    import gymnasium as gym

    from compaction_gym.agents.evaluate import task_env_kwargs
    from compaction_gym.evaluation.rsa import answer_extractor, env_scorer

    engine = getattr(backend, "engine", backend)
    settings = cell.rsa
    for task, env_seeds in plan.items():
        if not env_seeds:
            continue
        env = gym.make(cell.env, **task_env_kwargs(cell.env, task), **cell.env_kwargs)
        extract = answer_extractor(env)
        try:
            for env_seed in env_seeds:
                t0 = time.perf_counter()
                question, info = env.reset(seed=env_seed)
                run = run_question(engine, settings, question, env_seed, cell)
                final = run.populations[-1]
                scores = score_population(env_scorer(env, info), final, extract)
                label = str(info.get("dataset", task))
                meta = {
                    "eval_task": label,
                    "eval_task_requested": task,
                    "dataset": info.get("dataset"),
                    "index": info.get("index"),
                    "answer": str(info.get("answer")),
                    "score": scores[settings["score"]],
                    "wall_time_s": time.perf_counter() - t0,
                }
                write(episode_line(run, scores, [extract(t) for t in final], env_seed, meta))
        finally:
            env.close()


def episode_row(d: dict[str, Any]) -> dict[str, Any]:
    """The record row of a ``kind = "rsa"`` line: the chosen score (percent), every token fed and
    sampled, the largest member cache, and the members as turns."""
    info, turns = d["info"], d["turns"]
    score = float(info["score"])
    peak = max([int(d["prompt_len"]), *(int(t["peak_kv_len"]) for t in turns)])
    longest = max([int(d["prompt_len"]), *(int(t["logical_len"]) for t in turns)])
    return {
        "task": str(info["eval_task"]),
        "seed": int(info["leaderboard_seed"]),
        "env_seed": int(d["seed"]),
        "progression": 100.0 * score,
        "success": score >= 1.0,
        "reward": score,
        "turns": len(turns),
        "tokens": int(d["compute"]["prefilled"]) + int(d["compute"]["generated"]),
        "generated_tokens": int(d["compute"]["generated"]),
        "peak_kv": peak,
        "mean_kv": sum(int(t["kv_len"]) for t in turns) / len(turns) if turns else float(d["prompt_len"]),
        "kv_retained": peak / longest if longest else 1.0,
        "compaction_events": len(d["events"]),
        "aborted": False,
        "wall_time_s": float(info.get("wall_time_s", 0.0)),
    }


def with_seed(line: dict[str, Any], leaderboard_seed: int) -> dict[str, Any]:
    """``line`` with its run seed in ``info`` (as the runner tags every episode)."""
    return {**line, "info": {**line["info"], "leaderboard_seed": leaderboard_seed}}
