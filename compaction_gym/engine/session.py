"""Session state: the logical token stream, the cache-row map, turns and recorded probe queries.

Coordinates. *Logical* position ``p`` is the index of a token in ``Session.token_ids`` (every token
fed, generated or injected, in order); it is also the RoPE position the token is fed at. A token
is *fed* once its K/V are in the cache; the last sampled token of a response stays pending until
the next call feeds it. *Cache rows* address the slot: compaction replaces a span of rows by a
shorter block, so rows and logical positions drift apart; :class:`RowMap` tracks the mapping.
"""

from __future__ import annotations

import bisect
import copy
import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.compaction.rowmap import RowMap
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.host_copy import upload
from compaction_gym.engine.sampler import SampleStream


class ProbeRing:
    """The most recent ``capacity`` post-RoPE queries of every layer, with their logical positions."""

    def __init__(self, n_layers: int, n_q_heads: int, head_dim: int, capacity: int, dtype, device) -> None:
        self.capacity = capacity
        self.queries = torch.zeros(n_layers, n_q_heads, capacity, head_dim, dtype=dtype, device=device)
        # host bookkeeping in numpy: a torch CPU op per push costs several times more (docs/engine.md,
        # "Batched events")
        self.positions = np.full(capacity, -1, np.int64)
        self.count = 0

    def push(self, queries: torch.Tensor, first_position: int) -> None:
        """Append ``queries`` ``[L, H_q, m, d]`` of logical positions ``first_position ..``."""
        m = queries.shape[2]
        assert m <= self.capacity
        queries = queries.to(self.queries.dtype)
        # one or two ranges of the ring, written by slices: an index tensor would have to be copied
        # to the device, and a plain copy waits for the device (docs/engine.md, "Batched events")
        a = self.count % self.capacity
        k = min(m, self.capacity - a)
        self.queries[:, :, a : a + k] = queries[:, :, :k]
        self.positions[a : a + k] = np.arange(first_position, first_position + k)
        if k < m:
            self.queries[:, :, : m - k] = queries[:, :, k:]
            self.positions[: m - k] = np.arange(first_position + k, first_position + m)
        self.count += m

    def select(self, min_position: int) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """Recorded queries at logical positions ``>= min_position`` (all if none qualify), in order.

        Returns:
            ``([L, H_q, n, d], (first, last + 1))`` or ``None`` when nothing was recorded.
        """
        picked = self.select_parts(min_position)
        if picked is None:
            return None
        parts, span = picked
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)), span

    def select_parts(self, min_position: int) -> tuple[tuple[torch.Tensor, ...], tuple[int, int]] | None:
        """:meth:`select` as one or two views of the ring ``[L, H_q, m, d]``, to be read in order.

        The positions are pushed in increasing order (tokens are fed in order), so the selection is
        the newest entries, one or two ranges of the ring: no copy, and no host → device copy of an
        index (which would wait for the device). Rings whose positions are not in push order are
        gathered (one part).
        """
        n_valid = min(self.count, self.capacity)
        if n_valid == 0:
            return None
        oldest = self.count % self.capacity if self.count > self.capacity else 0
        pos = self.positions.tolist()
        chrono = pos[oldest:n_valid] + pos[:oldest]  # positions from the oldest entry on
        if chrono[0] < 0 or not all(map(operator.lt, chrono, chrono[1:])):
            picked = self._gather(min_position)
            return None if picked is None else ((picked[0],), picked[1])
        k = n_valid - bisect.bisect_left(chrono, min_position) or n_valid
        a = (oldest + n_valid - k) % self.capacity
        if a + k <= self.capacity:
            parts = (self.queries[:, :, a : a + k],)
        else:
            parts = (self.queries[:, :, a:], self.queries[:, :, : a + k - self.capacity])
        return parts, (chrono[n_valid - k], chrono[-1] + 1)

    def _gather(self, min_position: int) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """:meth:`select` for any order of positions: an indexed gather (the index copied to the
        device without a synchronisation)."""
        valid = self.positions >= 0
        if not valid.any():
            return None
        keep = valid & (self.positions >= min_position)
        if not keep.any():
            keep = valid
        slots = np.flatnonzero(keep)
        slots = slots[np.argsort(self.positions[slots], kind="stable")]
        pos = self.positions[slots]
        (index,) = upload([slots], self.queries.device)
        return self.queries[:, :, index], (int(pos[0]), int(pos[-1]) + 1)

    def clone(self) -> ProbeRing:
        new = copy.copy(self)
        new.queries = self.queries.clone()
        new.positions = self.positions.copy()
        return new


@dataclass
class Session:
    """Mutable state of one session (owned by the scheduler; users see :class:`SessionView`)."""

    session_id: str
    slot: int
    config: CompactionConfig
    sampling: SamplingParams
    stream: SampleStream
    seed: int
    prompt_len: int
    protected_rows: int
    token_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    events: list[CompactionEvent] = field(default_factory=list)
    fed: int = 0
    generated: int = 0
    row_map: RowMap = field(default_factory=RowMap)
    turn_starts: list[int] = field(default_factory=list)
    last_response: tuple[int, int] | None = None
    last_logits: torch.Tensor | None = None
    probes: ProbeRing | None = None
    budget_events: int = 0

    @property
    def pending(self) -> list[int]:
        """Tokens appended but not yet fed (the last sampled token, new input, injected messages)."""
        return self.token_ids[self.fed :]

    def append(self, ids: list[int], *, sampled: bool, logprobs: list[float] | None = None) -> None:
        self.token_ids.extend(ids)
        self.completion_mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        if sampled:
            self.generated += len(ids)

    def clone(self, session_id: str, slot: int) -> Session:
        """An independent copy (fork) under a new id and slot: history, row map, RNG stream
        position, recorded probes and kept logits are copied; the frozen config and sampling
        parameters are shared. The slot's cache rows are copied by the cache, not here."""
        new = copy.copy(self)
        new.session_id, new.slot = session_id, slot
        for name in ("token_ids", "completion_mask", "logprobs", "events", "turn_starts"):
            setattr(new, name, list(getattr(self, name)))
        new.row_map = copy.deepcopy(self.row_map)
        new.stream = self.stream.clone()
        new.probes = self.probes.clone() if self.probes is not None else None
        new.last_logits = self.last_logits.clone() if self.last_logits is not None else None
        return new


@dataclass(frozen=True)
class SessionView:
    """A read-only snapshot of a session.

    Attributes:
        session_id: the id.
        token_ids: every logical token fed, generated or injected, in order (logical position = index).
        completion_mask: 1 for sampled tokens, 0 for prompt, inputs and injected tokens.
        logprobs: sampling log-probability per token (0.0 where the mask is 0).
        events: compaction events so far.
        kv_len: cache rows in use.
        prompt_len: length of the creation prompt.
        config / sampling: the session's compaction config and default sampling parameters.
        generated_tokens: tokens sampled so far (what ``max_total_tokens`` counts).
        position_offset: logical tokens fed minus cache rows (``0`` before any compaction).
        slot: the cache slot the session occupies.
        seed: the session seed (sampling stream and random probes).
    """

    session_id: str
    token_ids: tuple[int, ...]
    completion_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    events: tuple[CompactionEvent, ...]
    kv_len: int
    prompt_len: int
    config: CompactionConfig
    sampling: SamplingParams
    generated_tokens: int
    position_offset: int
    slot: int
    seed: int

    @classmethod
    def of(cls, s: Session, kv_len: int) -> SessionView:
        return cls(
            session_id=s.session_id,
            token_ids=tuple(s.token_ids),
            completion_mask=tuple(s.completion_mask),
            logprobs=tuple(s.logprobs),
            events=tuple(s.events),
            kv_len=kv_len,
            prompt_len=s.prompt_len,
            config=s.config,
            sampling=s.sampling,
            generated_tokens=s.generated,
            position_offset=s.fed - kv_len,
            slot=s.slot,
            seed=s.seed,
        )
