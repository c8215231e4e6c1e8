"""The slot KV cache: preallocated K/V/β for ``max_slots`` sessions (DESIGN §5).

Layout ``[slot, layer, kv_head, row, head_dim]`` so that one slot's rows of all layers are a
single strided block: compaction reads them as ``[L * H_kv, T, d]`` without copying and writes
``[prefix | block | suffix]`` back for every layer in one op. β (float32) has the same layout
without the head dim. Rows past a slot's length are garbage for K/V and zero for β.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from compaction_gym.engine.context import ForwardContext
from compaction_gym.engine.host_copy import upload
from compaction_gym.errors import CapacityError


class SlotKVCache:
    """Fixed-shape K/V/β storage plus per-slot length; slots are allocated to sessions.

    The cache is the only writer of slot lengths: runners :meth:`advance` a slot after feeding
    it, :meth:`replace_span` / :meth:`replace_spans` set the length after compaction, :meth:`allocate` / :meth:`release`
    reset it and :meth:`copy_slot` copies it. Everyone else reads it with :meth:`length`.

    Args:
        n_layers, n_kv_heads, head_dim: model attention layout (``v_head_dim`` defaults to ``head_dim``).
        max_slots: sessions that can be active at once.
        capacity: rows per slot.
        dtype, device: K/V storage (β is always float32).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_slots: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        v_head_dim: int | None = None,
    ) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.max_slots, self.capacity = max_slots, capacity
        shape = (max_slots, n_layers, n_kv_heads, capacity)
        self.k = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(*shape, v_head_dim or head_dim, dtype=dtype, device=device)
        self.beta = torch.zeros(*shape, dtype=torch.float32, device=device)
        self._lengths = [0] * max_slots
        self.has_beta = [False] * max_slots
        self._free = set(range(max_slots))

    # --------------------------------------------------------------- lengths
    def length(self, slot: int) -> int:
        """Rows in use in ``slot``."""
        return self._lengths[slot]

    @property
    def lengths(self) -> tuple[int, ...]:
        """Every slot's length, as a tuple: writing into it raises instead of changing nothing
        (set lengths with :meth:`restore_lengths`)."""
        return tuple(self._lengths)

    def advance(self, slot: int, n: int) -> int:
        """Record ``n`` rows appended to ``slot`` (written by a forward); returns the new length."""
        new = self._lengths[slot] + n
        assert 0 <= new <= self.capacity, f"slot {slot}: length {new} outside [0, {self.capacity}]"
        self._lengths[slot] = new
        return new

    def restore_lengths(self, lengths: list[int]) -> None:
        """Set every slot's length from a saved :attr:`lengths` (tests and benchmarks that restore
        K/V they saved; a session's rows are otherwise only changed by the methods above)."""
        assert len(lengths) == self.max_slots and all(0 <= n <= self.capacity for n in lengths), lengths
        self._lengths[:] = [int(n) for n in lengths]

    # ----------------------------------------------------------------- slots
    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        """Take the lowest free slot (keeps batches contiguous); its length starts at 0."""
        if not self._free:
            raise CapacityError(
                f"all {self.max_slots} slots are in use; close a session or create the engine with a larger max_slots"
            )
        slot = min(self._free)
        self._free.remove(slot)
        self._lengths[slot] = 0
        self.has_beta[slot] = False
        self.beta[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} released twice"
        self._lengths[slot] = 0
        self._free.add(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """Make ``dst`` an exact copy of ``src`` (fork)."""
        n = self._lengths[src]
        self.k[dst, :, :, :n] = self.k[src, :, :, :n]
        self.v[dst, :, :, :n] = self.v[src, :, :, :n]
        self.beta[dst].zero_()
        self.beta[dst, :, :, :n] = self.beta[src, :, :, :n]
        self._lengths[dst] = n
        self.has_beta[dst] = self.has_beta[src]

    # ----------------------------------------------------------- forward I/O
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, ctx: ForwardContext) -> None:
        """Scatter the real new tokens of ``key``/``value`` ``[B, H_kv, N, d]`` into their rows."""
        k_layer, v_layer = self.k[:, layer], self.v[:, layer]
        # Under a trainer's autocast (bf16 mixed precision on a float32 model) the projections come out
        # in bfloat16: store them in the cache's dtype (exact for a wider cache), as replay keeps them.
        key, value = key.to(k_layer.dtype), value.to(v_layer.dtype)
        if ctx.slot_range is not None and ctx.uniform_row is not None:  # decode, equal lengths: slices
            a, b = ctx.slot_range
            k_layer[a:b, :, ctx.uniform_row] = key[:, :, -1]
            v_layer[a:b, :, ctx.uniform_row] = value[:, :, -1]
            return
        k_layer[ctx.write_slot, :, ctx.write_row] = key[ctx.write_b, :, ctx.write_col]
        v_layer[ctx.write_slot, :, ctx.write_row] = value[ctx.write_b, :, ctx.write_col]

    def read(self, layer: int, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V rows ``[B, H_kv, kv_len, d]`` of the batch's slots (views when slots are consecutive)."""
        n = ctx.kv_len
        if ctx.slot_range is not None:
            a, b = ctx.slot_range
            return self.k[a:b, layer, :, :n], self.v[a:b, layer, :, :n]
        return self.k[ctx.slots, layer, :, :n], self.v[ctx.slots, layer, :, :n]

    def read_beta(self, layer: int, ctx: ForwardContext) -> torch.Tensor:
        """β rows ``[B, H_kv, kv_len]`` (float32) of the batch's slots."""
        n = ctx.kv_len
        if ctx.slot_range is not None:
            a, b = ctx.slot_range
            return self.beta[a:b, layer, :, :n]
        return self.beta[ctx.slots, layer, :, :n]

    # ------------------------------------------------------------ compaction
    def rows(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One slot's live rows as ``[L * H_kv, T, d]`` K, V and ``[L * H_kv, T]`` β (views)."""
        n, lh = self._lengths[slot], self.n_layers * self.n_kv_heads
        k = self.k[slot, :, :, :n].reshape(lh, n, self.head_dim)
        v = self.v[slot, :, :, :n].reshape(lh, n, self.v.shape[-1])
        return k, v, self.beta[slot, :, :, :n].reshape(lh, n)

    def replace_span(
        self,
        slot: int,
        span: tuple[int, int],
        keys: torch.Tensor,
        values: torch.Tensor,
        beta: torch.Tensor | None,
        *,
        nonzero: bool | None = None,
    ) -> int:
        """Replace rows ``span`` of every layer/head by a block of ``t`` rows, shifting the suffix.

        Args:
            keys, values: the block ``[L * H_kv, t, d]`` (``t`` may be 0: the span is deleted).
            beta: absolute β of the block ``[L * H_kv, t]``, or ``None`` for zero β.
            nonzero: whether the slot holds a nonzero β afterwards, when the caller knows it (a
                host copy of ``beta``): spares the device synchronisation that finds out.

        Returns:
            The slot's new length.
        """
        start, end = span
        old = self._lengths[slot]
        assert 0 <= start <= end <= old, (span, old)
        lay = (self.n_layers, self.n_kv_heads)
        t = keys.shape[1]
        tail = old - end
        new = start + t + tail
        if tail and t != end - start:
            # overlapping rows go through a copy; disjoint ones (a suffix no longer than what the span
            # gave up) are copied directly: one pass over the suffix instead of two
            disjoint = new <= end or old <= start + t
            for buf in (self.k, self.v, self.beta):
                moved = buf[slot, :, :, end:old]
                buf[slot, :, :, start + t : new] = moved if disjoint else moved.clone()
        if t:
            self.k[slot, :, :, start : start + t] = keys.reshape(*lay, t, -1).to(self.k.dtype)
            self.v[slot, :, :, start : start + t] = values.reshape(*lay, t, -1).to(self.v.dtype)
            if beta is None:
                self.beta[slot, :, :, start : start + t] = 0.0
            else:
                self.beta[slot, :, :, start : start + t] = beta.reshape(*lay, t).to(torch.float32)
                found = nonzero if nonzero is not None else bool(beta.abs().max() > 0)
                self.has_beta[slot] = self.has_beta[slot] or found
        self.beta[slot, :, :, new:old] = 0.0
        self._lengths[slot] = new
        return new

    def replace_spans(
        self,
        slots: Sequence[int],
        spans: Sequence[tuple[int, int]],
        keys: torch.Tensor,
        values: torch.Tensor,
        beta: torch.Tensor | None,
        *,
        nonzero: Sequence[bool] | None = None,
    ) -> list[int]:
        """:meth:`replace_span` for several distinct slots at once, each block ``t`` rows.

        The same writes as one :meth:`replace_span` per slot, as a few indexed copies over all slots
        (docs/engine.md, "Batched events"): every slot's suffix is gathered and put back ``end - start
        - t`` rows earlier, every block is put at its span start, and the β rows freed at the end are
        zeroed, each one operation for all slots, whatever their number. The indices are built on the
        host and copied to the device without a synchronisation (:func:`upload`).

        Args:
            keys, values: the blocks ``[S, L * H_kv, t, d]``, slot ``slots[i]`` gets ``keys[i]``.
            beta: absolute β of the blocks ``[S, L * H_kv, t]``, or ``None`` for zero β.
            nonzero: per slot, whether its block's β is nonzero, when the caller knows it (host copies):
                spares the device synchronisation that finds out.

        Returns:
            The slots' new lengths.
        """
        n = len(slots)
        assert len(set(slots)) == n == len(spans) == keys.shape[0], (slots, spans, tuple(keys.shape))
        if n == 1:  # slices: no index to build
            b = None if beta is None else beta[0]
            return [
                self.replace_span(slots[0], spans[0], keys[0], values[0], b, nonzero=nonzero and nonzero[0])
            ]
        t = keys.shape[2]
        # the indices are built with numpy: a few microseconds where torch's CPU ops on these small
        # arrays cost ~50 µs each (docs/engine.md, "Batched events")
        start = np.array([a for a, _ in spans], np.int64)
        end = np.array([b for _, b in spans], np.int64)
        old = np.array([self._lengths[s] for s in slots], np.int64)
        assert ((start >= 0) & (start <= end) & (end <= old)).all(), (spans, old)
        new = start + t + old - end
        tail = np.where(start + t == end, 0, old - end)  # a block as long as its span moves nothing
        slot_ids = np.array(slots, np.int64)
        t_slot, src, dst = _segments(slot_ids, end, start + t, tail)
        z_slot, z_row, _ = _segments(slot_ids, new, new, old - new)  # β rows freed at the end
        rows = start[:, None] + np.arange(t)
        t_slot, src, dst, z_slot, z_row, slot, rows = upload(
            [t_slot, src, dst, z_slot, z_row, slot_ids, rows], self.k.device
        )
        lh = self.n_layers * self.n_kv_heads
        # a device scalar: a Python number on the right of an indexed write is first copied from
        # pageable host memory, which waits for the device (docs/engine.md, "Batched events")
        zero = self.beta.new_zeros(())
        # [slot, row, L * H_kv, ...] views: an indexed row carries every layer and head
        bufs = [
            buf.view(self.max_slots, lh, self.capacity, -1).transpose(1, 2)
            for buf in (self.k, self.v, self.beta)
        ]
        if src.numel():
            words = [as_words(buf) for buf in bufs]
            for buf, moved in [(w, w[t_slot, src]) for w in words]:  # gathered before any write
                buf[t_slot, dst] = moved
        if t:
            bk, bv, bb = bufs
            _put(bk, (slot[:, None], rows), keys.to(self.k.dtype).transpose(1, 2))
            _put(bv, (slot[:, None], rows), values.to(self.v.dtype).transpose(1, 2))
            if beta is None:
                bb[slot[:, None], rows] = zero
            else:
                bb[slot[:, None], rows] = beta.transpose(1, 2)[..., None].to(torch.float32)
                found = nonzero if nonzero is not None else (beta.flatten(1).abs().amax(1) > 0).tolist()
                for s, f in zip(slots, found):
                    self.has_beta[s] = self.has_beta[s] or bool(f)
        if z_row.numel():
            bufs[2][z_slot, z_row] = zero
        lengths = new.tolist()
        for s, m in zip(slots, lengths):
            self._lengths[s] = m
        return lengths


def as_words(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last dim's bytes seen as int64 words when they divide (the same bytes, a view).

    PyTorch's indexed copies move one element per thread; moving a bfloat16 row of keys as 8-byte
    words moves 4 elements per thread (K/V rows are whole head dims: 256 bytes for ``d = 128``).
    """
    if x.element_size() < 8 and x.stride(-1) == 1 and x.shape[-1] * x.element_size() % 8 == 0:
        return x.view(torch.int64)
    return x


def _put(buf: torch.Tensor, index: tuple[torch.Tensor, ...], value: torch.Tensor) -> None:
    """``buf[index] = value``, as words where both are seen as words (:func:`as_words`)."""
    words, value_words = as_words(buf), as_words(value)
    if words.dtype == value_words.dtype:
        buf, value = words, value_words
    buf[index] = value


def _segments(
    slot: np.ndarray, src_start: np.ndarray, dst_start: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row ranges of several slots flattened: ``(slot, src, dst)`` of every row ``j < length[i]``,
    ``src = src_start[i] + j``, ``dst = dst_start[i] + j`` (int64 host arrays)."""
    seg = np.repeat(np.arange(len(slot)), length)
    offset = np.cumsum(length) - length
    j = np.arange(len(seg)) - offset[seg]
    return slot[seg], src_start[seg] + j, dst_start[seg] + j
