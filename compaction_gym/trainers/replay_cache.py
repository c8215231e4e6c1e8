"""Reuse of one-pass replay plans across the passes that replay the same trajectories.

A GRPO step replays its generation batch several times: the old and reference log-probs without
gradients, then the policy's with gradients (more with ``num_iterations > 1``), chunked differently
(``replay_inference_batch_size`` vs the micro-batches, which TRL shuffles). The plan of a pass is
host work before the GPU starts (:func:`~compaction_gym.trainers.replay_plan.build_plan`, then
:class:`~compaction_gym.trainers.replay_onepass.OnePassReplay`'s layout and uploads), the same for
every pass over the same trajectories. :class:`ReplayPlanCache` keeps

* per trajectory, its simulation (:class:`~compaction_gym.trainers.replay_plan.TrajectorySim`,
  host arrays): any chunking assembles its plan from them;
* per batch, its device plan: a later pass over the same trajectories (in any order) reuses it.

docs/grpo.md, "Replay in one pass".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.replay_onepass import OnePassReplay
from compaction_gym.trainers.replay_plan import TrajectorySim, simulate


@dataclass
class _Entry:
    trajectory: Any  # held: its id() cannot be reused while the entry lives
    events: tuple  # the events simulated (the same objects, in order)
    n_tokens: int
    sim: TrajectorySim


@dataclass
class CacheStats:
    """Hits and misses of a :class:`ReplayPlanCache` since it was made (or :meth:`~ReplayPlanCache.clear`)."""

    simulations_reused: int = 0
    simulations_built: int = 0
    device_plans_reused: int = 0
    device_plans_built: int = 0


class ReplayPlanCache:
    """One-pass replay plans kept for later passes over the same trajectories.

    Pass it to :func:`~compaction_gym.trainers.replay.replay_logprobs_batch` (``plan_cache=``);
    :class:`~compaction_gym.trainers.grpo.CompactionGRPOTrainer` keeps one per generation batch.
    Results are identical to building the plans afresh.

    Trajectories are recognised by identity, never by ``id()`` alone: an entry holds its trajectory,
    so the id cannot be reused while it lives, and the event objects it simulated, so a trajectory
    whose ``events`` were replaced, or whose ``token_ids`` changed length, is simulated again.
    Events are records and are not compared field by field: a trajectory edited in place (one of
    its events' fields) must be dropped with :meth:`clear`. The cache never writes to a trajectory.

    Args:
        max_trajectories: simulations kept (least recently used dropped first); host memory only,
            about 2 MB for a trajectory of 3.6k tokens and 23 events at 28 layers × 8 KV heads.
        max_device_plans: device plans kept (their index tensors live on the model's device, tens of
            MB for a batch of 8 × 3.6k tokens at 28 layers × 8 KV heads); 0 keeps none.

    Example:
        >>> cache = ReplayPlanCache()
        >>> old = replay_logprobs_batch(model, trajectories, plan_cache=cache)  # doctest: +SKIP
        >>> new = replay_logprobs_batch(model, trajectories[::-1], grad=True, plan_cache=cache)  # doctest: +SKIP
    """

    def __init__(self, max_trajectories: int = 4096, max_device_plans: int = 8) -> None:
        if max_trajectories < 0 or max_device_plans < 0:
            raise InvalidArgumentError(
                f"max_trajectories and max_device_plans must be >= 0, got {max_trajectories}, {max_device_plans}"
            )
        self.max_trajectories, self.max_device_plans = max_trajectories, max_device_plans
        self._sims: OrderedDict[tuple, _Entry] = OrderedDict()
        # batch key -> (the simulations it holds, each row's item, the device plan)
        self._plans: OrderedDict[tuple, tuple[tuple[TrajectorySim, ...], list[Hashable], OnePassReplay]] = (
            OrderedDict()
        )
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._sims)

    def clear(self) -> None:
        """Drop every plan (e.g. when a new generation batch replaces the trajectories)."""
        self._sims.clear()
        self._plans.clear()
        self.stats = CacheStats()

    def simulation(self, traj: Any, index: int, end: int, n_probe: int, ridge: float, n_layers: int,
                   n_kv_heads: int) -> TrajectorySim:  # fmt: skip
        """:func:`~compaction_gym.trainers.replay_plan.simulate`, memoised per trajectory and settings."""
        key = (id(traj), end, n_probe, ridge, n_layers, n_kv_heads)
        entry = self._sims.get(key)
        if (
            entry is not None
            and entry.trajectory is traj
            and entry.n_tokens == len(traj.token_ids)
            and len(entry.events) == len(traj.events)
            and all(a is b for a, b in zip(entry.events, traj.events))
        ):
            self._sims.move_to_end(key)
            self.stats.simulations_reused += 1
            return entry.sim
        sim = simulate(traj, index, end, n_probe, ridge, n_layers, n_kv_heads)
        self.stats.simulations_built += 1
        if self.max_trajectories:
            self._sims[key] = _Entry(traj, tuple(traj.events), len(traj.token_ids), sim)
            self._sims.move_to_end(key)
            while len(self._sims) > self.max_trajectories:
                self._sims.popitem(last=False)
        return sim

    def device_plan(self, sims: Sequence[TrajectorySim], items: Sequence[Hashable], settings: Hashable,
                    build: Callable[[], OnePassReplay]) -> tuple[OnePassReplay, list[int] | None]:  # fmt: skip
        """The device plan of a batch: ``build()`` or a kept one over the same rows in another order.

        Args:
            sims: per row, its simulation.
            items: per row, what else its plan depends on (targets, temperature), hashable.
            settings: what the device plan depends on besides the rows (layout, dtype, device, ...).
            build: makes the plan for the rows in the given order.

        Returns:
            ``(plan, order)``: ``order[i]`` is the plan's row holding this batch's row ``i``
            (``None``: the given order).
        """
        rows = [(id(s), it) for s, it in zip(sims, items)]
        key = (settings, tuple(sorted(rows, key=_sort_key)))
        kept = self._plans.get(key)
        if kept is not None:  # its simulations are alive (held), so equal ids are the same objects
            self._plans.move_to_end(key)
            self.stats.device_plans_reused += 1
            return kept[2], _order(rows, kept[1])
        plan = build()
        self.stats.device_plans_built += 1
        if self.max_device_plans:
            self._plans[key] = (tuple(sims), rows, plan)
            while len(self._plans) > self.max_device_plans:
                self._plans.popitem(last=False)
        return plan, None


def _sort_key(row: tuple[int, Hashable]) -> tuple[int, int]:
    return row[0], hash(row[1])


def _order(rows: list, kept: list) -> list[int] | None:
    """Where each of ``rows`` sits in ``kept`` (the same multiset); ``None`` when in place."""
    if rows == kept:
        return None
    free: dict[Any, list[int]] = {}
    for j, r in enumerate(kept):
        free.setdefault(r, []).append(j)
    return [free[r].pop(0) for r in rows]


__all__ = ["CacheStats", "ReplayPlanCache"]
