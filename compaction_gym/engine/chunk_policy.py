"""Where a decode chunk ends: at its longest row's limit, or at a step where rows pause.

A row *pauses* when it needs host work before its next token — a KV-budget event, or the periodic
budget message — and goes on afterwards. Run to its longest row's limit, a chunk leaves the paused
rows behind: they take their remaining steps after it, in a *tail* of steps the other rows do not
share (lock-step turns: 177 decode steps instead of 152 in ``bench_sessions.py``'s workload).
Ending the chunk at a pause shortens that tail, but every cut costs one more round: a chunk
restart and an event call for fewer rows. :class:`ChunkCosts` times both online and cuts where the
steps saved are worth more than the rounds added (docs/engine.md, "Decode chunks end at pauses").
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from dataclasses import dataclass, field

#: samples each estimate keeps (medians of recent ones: a compile or a stall fades out)
_WINDOW = 16
#: a chunk this long amortises its restart: its seconds per step are the step's cost
_LONG_CHUNK = 4
#: an event round this small costs about its fixed part
_SMALL_ROUND = 3


@dataclass
class ChunkCosts:
    """Recent decode chunks and event rounds, timed, and the cut decision they imply."""

    chunks: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    rounds: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=_WINDOW))

    def add_chunk(self, steps: int, seconds: float) -> None:
        """A decode chunk of ``steps`` steps took ``seconds`` (launch to tokens on the host)."""
        if steps > 0:
            self.chunks.append((steps, seconds))

    def add_round(self, events: int, seconds: float) -> None:
        """The host work after a chunk (``events`` compaction events among it) took ``seconds``."""
        if events > 0:
            self.rounds.append((events, seconds))

    def step_s(self) -> float | None:
        """Seconds per decode step: the median over long chunks (any chunk if none is long)."""
        long = [s / n for n, s in self.chunks if n >= _LONG_CHUNK]
        per_step = long or [s / n for n, s in self.chunks]
        return statistics.median(per_step) if per_step else None

    def restart_s(self) -> float:
        """Seconds a chunk costs beyond its steps (launch, the wait for its tokens): the median over
        short chunks; 0 while unmeasured, so the first pauses are cut and measure it."""
        step = self.step_s()
        short = [max(0.0, s - n * step) for n, s in self.chunks if n < _LONG_CHUNK] if step else []
        return statistics.median(short) if short else 0.0

    def event_s(self) -> float:
        """Seconds a round of host work costs beyond its events' own: the intercept of the rounds'
        seconds against their events (Theil–Sen: the median of pairwise slopes, robust to a stall;
        the events' share is paid with or without a cut). With one round size seen, the median of
        small rounds; 0 while unmeasured."""
        rounds = list(self.rounds)
        slopes = [
            (sj - si) / (nj - ni) for (ni, si), (nj, sj) in itertools.combinations(rounds, 2) if nj != ni
        ]
        if slopes:
            slope = max(0.0, statistics.median(slopes))
            return max(0.0, statistics.median(s - slope * n for n, s in rounds))
        small = [s for n, s in rounds if n <= _SMALL_ROUND]
        return statistics.median(small) if small else 0.0

    def chunk_steps(self, pauses: list[int], longest: int) -> int:
        """The chunk's length for rows pausing after ``pauses`` steps (each such row's limit) when
        its longest row may run ``longest``: the first cut of the cheapest plan (:func:`plan`) with
        the measured costs, ``longest`` for none. The next chunk plans again."""
        points = sorted({p for p in pauses if 0 < p < longest})
        if not points:
            return longest
        step = self.step_s()
        if step is None:
            return points[0]
        cuts = plan(points, longest, step, self.event_s(), self.restart_s())[1]
        return cuts[0] if cuts else longest


def plan(
    points: list[int], longest: int, step_s: float, event_s: float, restart_s: float
) -> tuple[float, list[int]]:
    """The cheapest cuts for rows pausing at ``points`` (sorted, distinct, below ``longest``):
    ``(cost, cuts)``.

    A row pausing at ``p`` is served (its host work done) at the first cut ``c ≥ p``, or after the
    chunk, at ``longest``; it then takes its remaining steps, so it finishes ``c − p`` steps after
    the rows that never paused. A plan costs ``step_s`` per step of the largest such delay (the
    tail, which only late rows run), ``event_s`` per round of host work (one per point where rows
    are served) and ``restart_s`` per chunk (one per cut, the one to ``longest``, and the tail's).
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
            c = max(q for q in points if q <= points[i] + delay)
            cuts.append(c)
            while i < len(points) and points[i] <= c:
                i += 1
        chunks = len(cuts) + 1 + (delay > 0)
        cost = step_s * delay + event_s * rounds + restart_s * chunks
        if cost < best[0]:
            best = (cost, cuts)
    return best


__all__ = ["ChunkCosts", "plan"]
