"""Whether a cell's KV budget can hold: the engine's overrun conditions, from the real prompts.

A KV-budget event compacts rows ``[P, P + window)`` after the protected prompt of ``P`` tokens, at
most ``n_compacts`` times per session (docs/engine.md, "Triggers"). A cell's measured KV stays
within ``max_kv_len`` + the turn's input (compliance rule 6, docs/leaderboard.md) when

* ``P + window <= max_kv_len`` for the longest protected prompt the cell plays, so an event can
  always fire once the cache is full, and every event frees rows (``target_size < window``); and
* ``n_compacts`` covers the most events an episode can need: each turn adds at most the slot's
  ``capacity`` rows (a longer turn aborts the episode), each event frees ``window − target_size``
  rows, and an episode has at most the env's ``max_steps`` turns.

:func:`budget_failures` names the broken condition; ``tests/leaderboard/test_suite_budgets.py``
runs it on every budget of every shipped suite with the prompts the agent really sends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from compaction_gym.compaction.modes import target_size
from compaction_gym.leaderboard.suite import Cell


def creation_prompt_ids(chat: Any, fmt: Any, info: dict[str, Any], observation: str) -> list[int]:
    """The ids an agent's session is created with (``CompactionAgent.reset`` / ``_open_deferred``):
    the instruction as the first user message, or without one the framed first observation."""
    instruction = info.get("instruction")
    if instruction:
        return chat.encode(chat.prompt_text(instruction))
    message = fmt.user_message(observation)
    return chat.encode(chat.render([{"role": "user", "content": message}], add_generation_prompt=True))


def prompt_lengths(cell: Cell, tokenizer: Any) -> Iterable[tuple[str, int, int, int | None]]:
    """``(task, env seed, protected prompt tokens, turn limit)`` for every episode of ``cell``, from
    the env's own reset and the agent's chat format; the turn limit is the env's ``max_steps``
    (BabyAI's ``info``) or its ``max_episode_steps``, ``None`` when it reports neither."""
    import gymnasium as gym

    from compaction_gym.agents.chat import ChatFormat
    from compaction_gym.agents.evaluate import is_babyai, task_env_kwargs
    from compaction_gym.agents.prompts import get_prompt_format

    fmt = get_prompt_format(cell.prompt or "balrog")
    chat = ChatFormat(tokenizer)
    base = dict(cell.env_kwargs)
    if is_babyai(cell.env):
        base.setdefault("action_parsing", fmt.action_parsing)
    for task in cell.tasks:
        env = gym.make(cell.env, **{**base, **task_env_kwargs(cell.env, task)})
        try:
            for seed in sorted({e for s in cell.seeds for e in cell.env_seeds(s)}):
                obs, info = env.reset(seed=seed)
                ids = creation_prompt_ids(chat, fmt, info, obs)
                steps = info.get("max_steps") or (env.spec.max_episode_steps if env.spec else None)
                yield str(task), seed, len(ids), None if steps is None else int(steps)
        finally:
            env.close()


def budget_failures(cell: Cell, prompt_len: int, max_steps: int | None, capacity: int) -> list[str]:
    """Why ``cell``'s budget could be overrun by an episode with a ``prompt_len``-token protected
    prompt and at most ``max_steps`` turns on ``capacity``-row slots (empty: it cannot; the
    ``n_compacts`` bound is checked only when ``max_steps`` is known)."""
    comp = cell.compaction
    if not comp.kv_budget:
        return []
    window, max_kv = int(comp.compact_window or 0), int(comp.max_kv_len or 0)
    where = f"{cell.suite} {cell.key}"
    out = []
    protected = prompt_len if comp.protect_prompt else 0
    if protected + window > max_kv:
        out.append(f"{where}: protected prompt {protected} + compact_window {window} > max_kv_len {max_kv}")
    freed = window - target_size(comp.mode, window, comp.compact_target_ratio)
    if freed <= 0:
        out.append(f"{where}: an event of compact_window {window} frees no rows")
    elif max_steps is not None:
        needed = math.ceil(max_steps * capacity / freed)
        if comp.n_compacts < needed:
            out.append(
                f"{where}: n_compacts {comp.n_compacts} < {needed} events an episode can need "
                f"({max_steps} turns of up to {capacity} rows, {freed} rows freed per event)"
            )
    return out
