"""The ``gymnasium.spaces.Text`` spaces our text environments declare."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.spaces import Text
from gymnasium.vector.utils import read_from_shared_memory

_RANGES = (
    (0x20, 0x7E),  # printable ASCII
    (0xA0, 0x24F),  # Latin-1 supplement, Latin extended A/B
    (0x370, 0x3FF),  # Greek
    (0x2010, 0x205E),  # general punctuation
    (0x2070, 0x209C),  # superscripts and subscripts
    (0x20A0, 0x20C0),  # currency
    (0x2100, 0x22FF),  # letterlike, number forms, arrows, mathematical operators
    (0x2300, 0x23FF),  # miscellaneous technical
    (0x2500, 0x25FF),  # box drawing, block elements, geometric shapes
)

#: Every character our observations may hold, and what free-text actions are sampled from:
#: tab/newline/carriage return, printable ASCII, Latin, Greek, punctuation, arrows, maths and
#: box drawing. Envs accept any ``str`` as an action; this set is what ``sample``/``contains`` use.
TEXT_CHARSET: str = "\t\n\r" + "".join(chr(c) for lo, hi in _RANGES for c in range(lo, hi + 1))


def text_space(max_length: int) -> Text:
    """A ``Text`` space over :data:`TEXT_CHARSET` admitting ``""`` up to ``max_length`` characters
    (an :class:`ObservationText`, so that async vector envs read it back correctly)."""
    return ObservationText(max_length=max_length, min_length=0, charset=TEXT_CHARSET)


class ObservationText(Text):
    """A :class:`~gymnasium.spaces.Text` space that works in ``AsyncVectorEnv``'s shared memory.

    Gymnasium 1.4 decodes a ``Text`` buffer once, when the vector env is built, so every later
    observation reads back as ``max_length`` copies of the charset's first character. Ours decodes
    on access (:class:`LiveTexts`); with ``copy=True`` (the default) ``AsyncVectorEnv`` hands out a
    plain ``tuple[str, ...]`` snapshot of it.
    """


class LiveTexts(Sequence[str]):
    """The strings an ``AsyncVectorEnv`` shared-memory buffer holds now, decoded on access."""

    def __init__(self, space: Text, shared_memory: Any, n: int) -> None:
        self._space, self._memory, self._n = space, shared_memory, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._n)))
        data = np.frombuffer(self._memory.get_obj(), dtype=np.int32).reshape(self._n, self._space.max_length)
        chars, size = self._space.character_list, len(self._space.character_set)
        return "".join(chars[v] for v in data[range(self._n)[index]] if v < size)

    def __deepcopy__(self, memo: dict) -> tuple[str, ...]:
        return tuple(self)

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    def __repr__(self) -> str:
        return repr(tuple(self))


@read_from_shared_memory.register(ObservationText)
def _read_live_texts(space: ObservationText, shared_memory: Any, n: int = 1) -> LiveTexts:
    return LiveTexts(space, shared_memory, n)
