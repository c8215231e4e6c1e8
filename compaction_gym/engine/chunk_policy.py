"""Where a decode chunk ends: at its longest row's limit, or at a step where rows pause.

A row *pauses* when it needs host work before its next token — a KV-budget event, or the periodic
budget message — and goes on afterwards. Run to its longest row's limit, a chunk leaves the paused
rows behind: they take their remaining steps after it, in a *tail* of steps the other rows do not
share (lock-step turns: 177 decode steps instead of 152 in ``bench_sessions.py``'s workload).
Ending the chunk at a pause shortens that tail, but every cut costs one more round: a chunk
restart and an event call for fewer rows. :class:`ChunkCosts` prices both in decode steps and cuts
where the steps saved are worth more than the rounds added (docs/engine.md, "Decode chunks end at
pauses"). The prices are constants, not timings, so a run's chunks (and which events share a
stacked call) depend on its inputs alone.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkCosts:
    """What one more round costs, in decode steps of the batch.

    The defaults are the H100 measurements at the Qwen3-4B shape with 64 sessions (a step
    6.0–6.5 ms, a 1-step chunk 8.4–8.8 ms, an event call of a few events 2.7–4.8 ms beyond its
    events; docs/benchmarks.md, "Session 28"). Smaller models pay relatively more per round (0.6B:
    a step 3.2 ms, a restart ~2 ms); raise them there.
    """

    #: fixed cost of one round of host work for a few events (an event call), in steps
    event_steps: float = 1.0
    #: cost of one more chunk beyond its steps (launch, the wait for its tokens), in steps
    restart_steps: float = 0.5

    def chunk_steps(self, pauses: list[int], longest: int) -> int:
        """The chunk's length for rows pausing after ``pauses`` steps (each such row's limit) when
        its longest row may run ``longest``: the first cut of the cheapest plan (:func:`plan`),
        ``longest`` for none. The next chunk plans again."""
        points = sorted({p for p in pauses if 0 < p < longest})
        if not points:
            return longest
        cuts = plan(points, longest, self.event_steps, self.restart_steps)[1]
        return cuts[0] if cuts else longest


def plan(
    points: list[int], longest: int, event_steps: float, restart_steps: float
) -> tuple[float, list[int]]:
    """The cheapest cuts for rows pausing at ``points`` (sorted, distinct, below ``longest``):
    ``(cost in decode steps, cuts)``.

    A row pausing at ``p`` is served (its host work done) at the first cut ``c ≥ p``, or after the
    chunk, at ``longest``; it then takes its remaining steps, so it finishes ``c − p`` steps after
    the rows that never paused. A plan costs the largest such delay (the tail, which only late rows
    run), ``event_steps`` per round of host work (one per point where rows are served) and
    ``restart_steps`` per chunk (one per cut, the one to ``longest``, and the tail's).
    For each candidate delay the fewest rounds that keep every row within it come from covering
    the points greedily, each round at the last point (or ``longest``) within the delay of the
    first row still waiting; fewer rounds also mean fewer cuts.
    """
    delays = sorted({c - p for p in points for c in [*points, longest] if c >= p})
    best: tuple[float, list[int]] = (float("inf"), [])
    for delay in delays:
        cuts, rounds, i = [], 0, 0
        while i < len(points):
            rounds += 1
            if points[i] + delay >= longest:
                break  # everyone still waiting is served after the chunk
            i = bisect_right(points, points[i] + delay)  # the rows this round serves
            cuts.append(points[i - 1])
        chunks = len(cuts) + 1 + (delay > 0)
        cost = delay + event_steps * rounds + restart_steps * chunks
        if cost < best[0]:
            best = (cost, cuts)
    return best


__all__ = ["ChunkCosts", "plan"]
