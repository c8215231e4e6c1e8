"""Which cache rows stand for which logical tokens: :class:`RowMap` (see ``docs/compaction.md``).

*Logical* position ``p`` indexes every token ever fed to a session; *cache rows* address its KV
cache. Compaction replaces a span of rows by a shorter block, so the two drift apart. The engine's
sessions and compaction replay keep one map each, updated by the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Segment:
    """Cache rows ``[row, row_end)`` standing for logical tokens ``[log, log_end)``.

    A raw segment maps row ``row + i`` to logical ``log + i``; a compacted block's rows together
    stand for the whole logical range.
    """

    row: int
    row_end: int
    log: int
    log_end: int
    compacted: bool


class RowMap:
    """Ordered segments covering a slot's rows ``[0, kv_len)``."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    @property
    def rows(self) -> int:
        return self.segments[-1].row_end if self.segments else 0

    def append(self, log: int, n: int) -> None:
        """Record ``n`` raw rows for logical tokens ``[log, log + n)`` appended at the end."""
        last = self.segments[-1] if self.segments else None
        if last is not None and not last.compacted and last.log_end == log:
            last.row_end += n
            last.log_end += n
        else:
            row = self.rows
            self.segments.append(Segment(row, row + n, log, log + n, False))

    def _split(self, row: int) -> None:
        for i, s in enumerate(self.segments):
            if s.row < row < s.row_end:
                head = row - s.row
                if s.compacted:
                    tail = Segment(row, s.row_end, s.log, s.log_end, True)
                else:
                    tail = Segment(row, s.row_end, s.log + head, s.log_end, False)
                    s.log_end = s.log + head
                s.row_end = row
                self.segments.insert(i + 1, tail)
                return

    def logical_span(self, start: int, end: int) -> tuple[int, int]:
        """Logical range covered by rows ``[start, end)`` (a block counts whole)."""
        assert 0 <= start < end <= self.rows, (start, end, self.rows)
        first = next(s for s in self.segments if s.row <= start < s.row_end)
        last = next(s for s in self.segments if s.row < end <= s.row_end)
        lo = first.log if first.compacted else first.log + (start - first.row)
        hi = last.log_end if last.compacted else last.log + (end - last.row)
        return lo, hi

    def row_of(self, log: int) -> int | None:
        """Cache row of raw logical token ``log``; ``None`` if it was compacted away or not fed."""
        for s in self.segments:
            if not s.compacted and s.log <= log < s.log_end:
                return s.row + (log - s.log)
        return None

    def replace(self, start: int, end: int, size: int, log_span: tuple[int, int]) -> None:
        """Rows ``[start, end)`` become a compacted block of ``size`` rows (deleted if 0)."""
        self._split(start)
        self._split(end)
        before = [s for s in self.segments if s.row_end <= start]
        after = [s for s in self.segments if s.row >= end]
        block = [Segment(start, start + size, log_span[0], log_span[1], True)] if size else []
        shift = end - start - size
        for s in after:
            s.row -= shift
            s.row_end -= shift
        self.segments = before + block + after

    def last_block_end(self) -> int | None:
        """End row of the last compacted block, if any."""
        ends = [s.row_end for s in self.segments if s.compacted]
        return max(ends) if ends else None

    def blocks(self) -> list[tuple[int, int]]:
        """Row ranges ``[row, row_end)`` of the compacted blocks, in row order."""
        return [(s.row, s.row_end) for s in self.segments if s.compacted]


def replace_blocks(blocks: list[tuple[int, int]], start: int, end: int, size: int) -> list[tuple[int, int]]:
    """The compacted blocks' row ranges after :meth:`RowMap.replace` ``(start, end, size)``.

    Pure arithmetic on the ranges (planning several events ahead without touching the map): a block
    cut by the span keeps its parts outside it, later rows shift up by ``end - start - size``.
    """
    shift = end - start - size
    out = [(a, min(b, start)) for a, b in blocks if a < start]
    if size:
        out.append((start, start + size))
    out += [(max(a, end) - shift, b - shift) for a, b in blocks if b > end]
    return out
