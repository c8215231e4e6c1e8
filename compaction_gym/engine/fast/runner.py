"""The fast model runner: batched prefill, CUDA-graph decode, device sampling (GPU, Llama family).

:class:`FastModelRunner` is a drop-in for :class:`~compaction_gym.engine.model_runner.ModelRunner`
(same :meth:`forward` contract over :class:`RowFeed` rows, same slot cache, same recorded
queries), so the scheduler, compactor and sessions are shared with the generic path:

* rows that feed one token each (decode) replay a CUDA graph captured for the smallest
  batch-size bucket that holds them (padding rows write nothing and read nothing);
* other batches (prefill, injected messages) run as one flat "varlen" batch of all rows' tokens
  (:func:`~compaction_gym.engine.fast.attention.prefill_attention`), in groups of at most
  ``max_prefill_tokens`` tokens.

:meth:`decode_chunk` is the device-resident decode loop the scheduler drives: each graph replay
runs the model, samples on the device (:mod:`~compaction_gym.engine.fast.sampler`), records the
step's queries for rows that keep suffix probes, and then (:func:`~compaction_gym.engine.fast.kernels.decode_advance`)
stores the token, stops rows that sampled a stop id or used their last step, and feeds the rest
their token back, so up to ``chunk_steps`` steps run back to back with one host synchronisation
at the end of the chunk. :meth:`generate` chains chunks for benchmarks and tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from compaction_gym.engine.config import SamplingParams
from compaction_gym.engine.fast.attention import decode_attention, num_splits_for, prefill_attention
from compaction_gym.engine.fast.kernels import decode_advance
from compaction_gym.engine.fast.model import CAPTURE_ERROR_MODE, FastDecoder
from compaction_gym.engine.fast.sampler import DeviceSampling, sample_device
from compaction_gym.engine.host_copy import upload
from compaction_gym.engine.model_runner import DecodeRow, ModelLayout, RowFeed, cut_at_stop, target_scores
from compaction_gym.engine.sampler import SampleStream
from compaction_gym.engine.slot_cache import SlotKVCache

# rows of the static decode inputs; stop ids follow (see kernels.decode_advance)
_IDS, _POS, _SLOT, _ROW, _LEN, _REM, _STOPS = range(7)
_PADDING = (0, 0, -1, 0, 0, 0)  # padding rows: no slot, length 0 (they write and read nothing)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor
    tokens: torch.Tensor | None = None


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a captured decode graph: 1, 2, 4, 8, then multiples of 16, and ``max_batch``."""
    sizes = {1, 2, 4, 8, *range(16, max_batch + 1, 16), max_batch}
    return sorted(s for s in sizes if s <= max_batch)


class FastModelRunner:
    """Runs a Qwen3/Qwen2/Llama model over the slot cache with fused kernels and CUDA graphs.

    Args:
        model: the HF model (its projection weights are packed in place, see :class:`FastDecoder`).
        cache: the engine's slot cache.
        layout: attention geometry (as for the generic runner).
        cuda_graphs: capture decode in CUDA graphs (default: on CUDA devices).
        max_prefill_tokens: tokens per flat prefill batch.
        chunk_steps: most decode steps per :meth:`decode_chunk` (one host synchronisation each).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: SlotKVCache,
        layout: ModelLayout,
        *,
        cuda_graphs: bool | None = None,
        max_prefill_tokens: int = 16384,
        chunk_steps: int = 32,
    ) -> None:
        self.model, self.cache, self.layout = model, cache, layout
        self.device, self.dtype = cache.k.device, cache.k.dtype
        self.decoder = FastDecoder(model)
        dec = self.decoder
        assert (dec.n_layers, dec.n_kv, dec.head_dim) == (cache.n_layers, cache.n_kv_heads, cache.head_dim)
        self.use_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self.max_prefill_tokens = max_prefill_tokens
        self._chunk_width = self._chunk_steps = chunk_steps
        self.max_batch = cache.max_slots
        self.buckets = graph_buckets(self.max_batch)
        self.sm_count = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        )
        dev, nb = self.device, self.max_batch
        self._host_free = torch.cuda.Event() if dev.type == "cuda" else None
        self._alloc_inputs(n_stops=4)
        self._q_rec = torch.zeros(dec.n_layers, nb, dec.n_q, dec.head_dim, dtype=self.dtype, device=dev)
        self._q_steps: torch.Tensor | None = None  # [L, B, chunk_steps, H_q, d], made on first use
        self._out_tok = torch.zeros(nb, chunk_steps, dtype=torch.long, device=dev)
        self._out_lp = torch.zeros(nb, chunk_steps, dtype=torch.float32, device=dev)
        pinned = dev.type == "cuda"
        self._out_host = (torch.zeros_like(self._out_tok, device="cpu", pin_memory=pinned),
                          torch.zeros_like(self._out_lp, device="cpu", pin_memory=pinned))  # fmt: skip
        self._out_ready = torch.cuda.Event() if pinned else None
        self._step = torch.zeros(1, dtype=torch.long, device=dev)
        self.sampling = DeviceSampling(nb, dev)
        self._graphs: dict[tuple[int, str, bool], _Graph] = {}
        self._pool = None

    @property
    def chunk_steps(self) -> int:
        """Most decode steps per :meth:`decode_chunk`; may be lowered (e.g. to 1, the token-by-token
        loop) and raised back up to the value given at construction (the output buffers' width)."""
        return self._chunk_steps

    @chunk_steps.setter
    def chunk_steps(self, n: int) -> None:
        if not 1 <= n <= self._chunk_width:
            raise ValueError(f"chunk_steps must be in [1, {self._chunk_width}] (set at construction), got {n}")
        self._chunk_steps = n

    def _alloc_inputs(self, n_stops: int) -> None:
        """Static decode inputs ``[_STOPS + n_stops, max_batch]`` and their pinned staging copy."""
        rows, dev = _STOPS + n_stops, self.device
        self._inputs = torch.zeros(rows, self.max_batch, dtype=torch.long, device=dev)
        self._host = torch.zeros(rows, self.max_batch, dtype=torch.long, pin_memory=dev.type == "cuda")

    # ------------------------------------------------------------ contract
    @torch.no_grad()
    def forward(self, rows: list[RowFeed]) -> torch.Tensor:
        """Feed each row's tokens into its slot; return float32 logits ``[B, V]`` of each row's last token.

        Advances each slot's length and pushes recorded queries to the rows' recorders, and sets
        ``scores`` of rows with ``score`` (the generic runner's contract; scoring batches run
        flat, never in a decode graph).
        """
        assert rows and all(r.token_ids for r in rows)
        cache = self.cache
        lens = [cache.length(r.slot) for r in rows]
        sizes = [len(r.token_ids) for r in rows]
        for n0, n in zip(lens, sizes):
            assert n0 + n <= cache.capacity, "runner asked to overflow a slot"
        self._ensure_positions(max(r.start + n for r, n in zip(rows, sizes)))
        if self.use_graphs and max(sizes) == 1 and len(rows) <= self.max_batch and not any(r.score for r in rows):
            logits = self._forward_decode(rows, lens)
        else:
            logits = torch.cat([self._forward_flat(g, [lens[i] for i in idx]) for idx, g in self._groups(rows)])
        for r, n in zip(rows, sizes):
            cache.advance(r.slot, n)
        return logits

    # --------------------------------------------------------------- decode
    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _load_inputs(self, columns: list[list[int]], bucket: int) -> None:
        """Copy the first input rows (ids, positions, slots, rows, lengths[, steps left, stop ids]),
        padded to ``bucket`` columns, into the static inputs."""
        n, k = len(columns[0]), len(columns)
        pad = bucket - n
        if self._host_free is not None:
            self._host_free.synchronize()  # the previous copy out of the pinned buffer is done
        padding = _PADDING + (-1,) * (k - len(_PADDING))
        self._host[:k, :bucket] = torch.tensor([col + [p] * pad for col, p in zip(columns, padding)])
        self._inputs[:k, :bucket].copy_(self._host[:k, :bucket], non_blocking=True)
        if self._host_free is not None:
            self._host_free.record()

    def _forward_decode(self, rows: list[RowFeed], lens: list[int]) -> torch.Tensor:
        batch = len(rows)
        bucket = self._bucket(batch)
        self._load_inputs(
            [[r.token_ids[0] for r in rows], [r.start for r in rows], [r.slot for r in rows], lens, [n + 1 for n in lens]],
            bucket,
        )
        g = self._graph(bucket, "logits", False, lens[0])
        g.graph.replay()
        logits = g.logits[:batch].to(torch.float32, copy=True)
        self._push_decode_queries(rows)
        return logits

    def _push_decode_queries(self, rows: list[RowFeed]) -> None:
        """Append each recording row's new query ``[L, H_q, d]`` to its ring (one batched copy)."""
        dst, src = [], []
        for b, r in enumerate(rows):
            ring = r.recorder
            if ring is None:
                continue
            if not all(hasattr(ring, a) for a in ("queries", "positions", "count")):
                ring.push(self._q_rec[:, b, :, None], r.start)
                continue
            j = ring.count % ring.capacity
            dst.append(ring.queries[:, :, j])
            src.append(self._q_rec[:, b])
            ring.positions[j] = r.start
            ring.count += 1
        if dst:
            torch._foreach_copy_(dst, src)

    def _decode_body(self, batch: int, kind: str, record: bool, persistent: bool = False) -> _Graph:
        """One decode step on the static inputs' first ``batch`` rows (captured as a graph).

        ``kind``: ``"logits"`` (stop after the logits) or the sampler variant (``"greedy"``,
        ``"sample"``, ``"filtered"``), which samples and advances the rows (:func:`decode_advance`);
        ``record``: also copy the step's queries into column ``step`` of the per-step recording;
        ``persistent``: one row, its layers in one launch (:meth:`FastDecoder.run_persistent`).
        """
        c, dec = self.cache, self.decoder
        state = self._inputs[:, :batch]
        ids, pos, slots, rows, lens = state[:_REM]
        splits = num_splits_for(batch, c.n_kv_heads, c.capacity, self.sm_count)
        fused = dec.fuse_attention if dec.fuse_attention is not None else splits == 1

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            kv = c.k[:, i], c.v[:, i], c.beta[:, i]
            return decode_attention(q, *kv, slots, lens, dec.scale, splits, fused_merge=fused)

        if persistent:
            # the queries are read after the step only when recorded or pushed to recorders ("logits"
            # steps); otherwise the launch skips storing them (~0.5 µs a layer: docs/fast-path.md)
            q_out = self._q_rec[:, :1] if record or kind == "logits" else None
            logits = dec.run_persistent(ids, pos, slots, rows, lens, c.k, c.v, c.beta, q_out=q_out)
        elif self._q_rec.dtype == dec.dtype:  # the RoPE kernel writes the queries into the recording buffer
            logits = dec.run(ids, pos, slots, rows, c.k, c.v, attend, q_out=self._q_rec[:, :batch])
        else:

            def record(i: int, q: torch.Tensor) -> None:
                self._q_rec[i, :batch].copy_(q)

            logits = dec.run(ids, pos, slots, rows, c.k, c.v, attend, record=record)
        if kind == "logits":
            return _Graph(None, logits)
        tokens, logprobs = sample_device(logits, self.sampling, greedy_only=kind == "greedy", filtered=kind == "filtered")
        if record:
            self._q_steps[:, :batch].index_copy_(2, self._step, self._q_rec[:, :batch, None])
        decode_advance(tokens, logprobs, state, self._out_tok[:batch], self._out_lp[:batch], self._step)
        return _Graph(None, logits, tokens)

    def _graph(self, bucket: int, kind: str, record: bool, length: int = 0) -> _Graph:
        """The decode graph for ``bucket`` rows, output ``kind`` and ``record`` (captured on first use);
        a batch-1 graph for a row of ``length`` cached rows runs its layers as one persistent launch
        where :meth:`_persistent_for` says so."""
        persistent = bucket == 1 and self._persistent_for(length)
        if persistent:
            self.decoder.refresh_packed()  # a graph replays the tagged launch's packed weights
        return self._graph_for(bucket, kind, record, persistent)

    def _graph_for(self, bucket: int, kind: str, record: bool, persistent: bool) -> _Graph:
        key = (bucket, kind, record, persistent)
        if key in self._graphs:
            return self._graphs[key]
        self._ensure_recording(record)
        saved = self._inputs.clone()
        self._inputs[_SLOT].fill_(-1)  # warm-up and capture must not touch the cache
        self._inputs[_LEN].zero_()
        step, counters = self._step.clone(), self.sampling.counter.clone()
        try:
            out = self._capture(bucket, kind, record, persistent)
        finally:
            self._inputs.copy_(saved)
            self._step.copy_(step)
            self.sampling.counter.copy_(counters)
        self._graphs[key] = out
        return out

    def _persistent_for(self, length: int) -> bool:
        """Whether a batch-1 step over ``length`` cached rows runs its layers as one persistent launch:
        the decoder's :attr:`~FastDecoder.use_persistent` if set, else whether ``length`` is below the
        crossover this runner measured (:meth:`_time_persistent`, once per decoder)."""
        dec = self.decoder
        if not (dec.persistent_ready() and self._q_rec.dtype == dec.dtype):
            return False
        if dec.use_persistent is not None:
            return dec.use_persistent
        if dec.persistent_max_len is None:
            self._time_persistent()
        return length < dec.persistent_max_len

    def _time_persistent(self) -> None:
        """Time batch-1 steps with the layers as one persistent launch and as the layered kernels.

        Both are timed at a short and at the longest cached length, reading a slot whose last
        row is free (the step's K/V go to that row, which no valid entry uses; nothing else is
        written). Each path's time is taken as linear in the length, and
        :attr:`FastDecoder.persistent_max_len` is set to where the persistent one stops being ≥ 3 %
        faster (0: never; past the capacity: always). Without a free row only the weights' share
        is timed (padding rows). See docs/fast-path.md.
        """
        dec, c = self.decoder, self.cache
        graphs = {use: self._graph_for(1, "logits", False, use) for use in (False, True)}
        free = [s for s in range(c.k.shape[0]) if c.length(s) < c.capacity]
        top = c.capacity - 1
        lengths = sorted({min(1024, top // 2), top}) if free and top >= 2 else [0]
        saved = self._inputs.clone()
        times: dict[tuple[bool, int], float] = {}
        try:
            for n in lengths:
                self._inputs[:_REM, :1] = 0
                if n:
                    self._inputs[_SLOT, 0], self._inputs[_ROW, 0], self._inputs[_LEN, 0] = free[0], top, n
                else:
                    self._inputs[_SLOT, 0] = -1
                for _ in range(3):
                    for use, g in graphs.items():
                        t = self._replay_seconds(g.graph)
                        times[use, n] = min(times.get((use, n), float("inf")), t)
        finally:
            self._inputs.copy_(saved)
        dec.persistent_times = times
        gain = [times[True, n] - 0.97 * times[False, n] for n in lengths]  # < 0: persistent faster
        if all(g < 0 for g in gain):
            dec.persistent_max_len = c.capacity + 1
        elif all(g >= 0 for g in gain) or len(lengths) == 1:
            dec.persistent_max_len = 0
        else:  # faster at the short length only: where the two lines cross
            (n1, n2), (g1, g2) = lengths, gain
            dec.persistent_max_len = int(n1 + (n2 - n1) * g1 / (g1 - g2))

    def _capture(self, bucket: int, kind: str, record: bool, persistent: bool) -> _Graph:
        """Warm up (Triton compiles, projection tuning) and capture one decode body on padding inputs."""
        self._step.zero_()  # the warm-up steps store their tokens at columns 0 and 1
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self.decoder.graph_mode = True  # projections pick cuBLAS or the GEMV (timed in the warm-up)
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the Triton kernels and settles cuBLAS workspaces
                    self._decode_body(bucket, kind, record, persistent)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_ERROR_MODE):
                out = self._decode_body(bucket, kind, record, persistent)
        finally:
            self.decoder.graph_mode = False
        self._pool = graph.pool()
        torch.cuda.synchronize(self.device)
        out.graph = graph
        return out

    @staticmethod
    def _replay_seconds(graph: torch.cuda.CUDAGraph, replays: int = 10) -> float:
        """Seconds per replay of a ``"logits"`` decode graph (it changes no step state)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / replays

    def recapture(self) -> None:
        """Drop the captured decode graphs: the next decode step of each bucket captures again (after
        changing the decoder's settings, e.g. its fusions or GEMV use)."""
        self._graphs.clear()
        self._pool = None

    def _ensure_recording(self, record: bool) -> None:
        if record and self._q_steps is None:
            q = self._q_rec
            self._q_steps = q.new_zeros(q.shape[0], q.shape[1], self._chunk_width, *q.shape[2:])

    def _ensure_stops(self, n: int) -> None:
        """Room for ``n`` stop ids per row in the static inputs (growing them drops the graphs)."""
        have = self._inputs.shape[0] - _STOPS
        if n > have:
            self._alloc_inputs(max(n, 2 * have))
            self.recapture()

    def _ensure_positions(self, n: int) -> None:
        if n > self.decoder.cos.shape[0]:
            self.decoder.ensure_positions(n)
            self._graphs.clear()  # captured graphs point at the old tables
            self._pool = None  # their memory pool went with them: new graphs need a new one

    # -------------------------------------------------------------- prefill
    def _groups(self, rows: list[RowFeed]) -> list[tuple[list[int], list[RowFeed]]]:
        """Consecutive groups of rows with at most ``max_prefill_tokens`` tokens (at least one row each)."""
        groups, idx, count = [], [], 0
        for i, r in enumerate(rows):
            if idx and count + len(r.token_ids) > self.max_prefill_tokens:
                groups.append((idx, [rows[j] for j in idx]))
                idx, count = [], 0
            idx.append(i)
            count += len(r.token_ids)
        groups.append((idx, [rows[j] for j in idx]))
        return groups

    def _forward_flat(self, rows: list[RowFeed], lens: list[int]) -> torch.Tensor:
        """All rows' tokens as one flat batch; logits of each row's last token."""
        c, dec, dev = self.cache, self.decoder, self.device
        sizes = [len(r.token_ids) for r in rows]
        tok0 = [0]
        for n in sizes[:-1]:
            tok0.append(tok0[-1] + n)
        flat = [
            [t for r in rows for t in r.token_ids],
            [p for r in rows for p in range(r.start, r.start + len(r.token_ids))],
            [r.slot for r, n in zip(rows, sizes) for _ in range(n)],
            [row for n0, n in zip(lens, sizes) for row in range(n0, n0 + n)],
        ]
        n_tok = len(flat[0])
        per_row = [[r.slot for r in rows], lens, tok0, sizes, [t + n - 1 for t, n in zip(tok0, sizes)]]
        packed = torch.tensor([x for col in flat + per_row for x in col], dtype=torch.long).to(dev, non_blocking=True)
        ids, pos, slot_t, row_t = packed[: 4 * n_tok].view(4, n_tok)
        slots_b, starts_b, tok0_b, n_b, last_b = packed[4 * n_tok :].view(5, len(rows))
        max_new = max(sizes)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            return prefill_attention(
                q, c.k[:, i], c.v[:, i], c.beta[:, i], slots_b, starts_b, tok0_b, n_b, max_new, dec.scale
            )

        recording = [(b, min(n, r.recorder.capacity)) for b, (r, n) in enumerate(zip(rows, sizes)) if r.recorder]
        recorded: list[torch.Tensor] = []
        record = None
        if recording:
            # upload: a pageable host → device copy would wait for the device before the prefill's launches
            rec = [i for b, m in recording for i in range(tok0[b] + sizes[b] - m, tok0[b] + sizes[b])]
            (rec_idx,) = upload([torch.tensor(rec)], dev)

            def record(i: int, q: torch.Tensor) -> None:
                recorded.append(q[rec_idx])

        scoring = [b for b, r in enumerate(rows) if r.score]
        if scoring:  # every token of a scoring row, the last one of the others
            keep = [
                i for b, n in enumerate(sizes) for i in (range(tok0[b], tok0[b] + n) if rows[b].score else [tok0[b] + n - 1])
            ]
            (keep_t,) = upload([torch.tensor(keep)], dev)
            all_logits = dec.run(ids, pos, slot_t, row_t, c.k, c.v, attend, last=keep_t, record=record)
            ends = torch.tensor([0] + [n if r.score else 1 for r, n in zip(rows, sizes)]).cumsum(0)
            logits = all_logits[ends[1:].to(dev) - 1]
            for b in scoring:
                lo, hi = int(ends[b]), int(ends[b + 1])
                rows[b].scores, rows[b].entropies = target_scores(
                    all_logits[lo : hi - 1], ids[tok0[b] + 1 : tok0[b] + sizes[b]]
                )
        else:
            logits = dec.run(ids, pos, slot_t, row_t, c.k, c.v, attend, last=last_b, record=record)
        if recording:
            queries = torch.stack(recorded)  # [L, R, H_q, d]
            off = 0
            for b, m in recording:
                r = rows[b]
                r.recorder.push(queries[:, off : off + m].transpose(1, 2), r.start + sizes[b] - m)
                off += m
        return logits.to(torch.float32, copy=True)

    # --------------------------------------------------------------- chunks
    @torch.no_grad()
    def decode_chunk(self, rows: list[DecodeRow], steps: int) -> list[tuple[list[int], list[float]]]:
        """Up to ``steps`` decode steps of every row on the device, one host synchronisation at the end.

        The contract of :meth:`ModelRunner.decode_chunk
        <compaction_gym.engine.model_runner.ModelRunner.decode_chunk>`: row ``b`` feeds its
        token, samples, feeds that back, ... and stops (on the device) after ``max_steps`` steps
        or a stop id; it returns ``m ≥ 1`` tokens and its slot grows by ``m``. Rows with a
        recorder get the queries of the ``m`` tokens they fed; sampling rows' streams advance by ``m``.
        """
        batch = len(rows)
        assert 0 < batch <= self.max_batch and steps >= 1
        c = self.cache
        lens = [c.length(r.slot) for r in rows]
        limits = [min(r.max_steps, steps, self.chunk_steps) for r in rows]
        assert min(limits) >= 1, "every row runs at least one step"
        assert all(n + k <= c.capacity for n, k in zip(lens, limits)), "decode_chunk would overflow a slot"
        steps = max(limits)
        self._ensure_positions(max(r.start + k for r, k in zip(rows, limits)) + 1)
        self._ensure_stops(max(len(r.stop_ids) for r in rows))
        n_stops = self._inputs.shape[0] - _STOPS  # every stop row is loaded: none keeps a past chunk's ids
        bucket = self._bucket(batch)
        streams = [r.stream or SampleStream(0) for r in rows]
        pad = bucket - batch
        self.sampling.set(
            [r.params for r in rows] + [SamplingParams(temperature=0.0)] * pad,
            [st.seed for st in streams] + [0] * pad,
            [st.counter for st in streams] + [0] * pad,
        )
        kind = "greedy" if self.sampling.greedy else ("filtered" if self.sampling.filtered else "sample")
        record = any(r.recorder is not None for r in rows)
        stops = [sorted(r.stop_ids) + [-1] * (n_stops - len(r.stop_ids)) for r in rows]
        columns = [[r.token for r in rows], [r.start for r in rows], [r.slot for r in rows], lens, [n + 1 for n in lens], limits]
        self._load_inputs(columns + [list(col) for col in zip(*stops)], bucket)
        self._step.zero_()
        g = self._graph(bucket, kind, record, max(lens)) if self.use_graphs else None
        if g is None:
            self._ensure_recording(record)
        for _ in range(steps):
            if g is not None:
                g.graph.replay()
            else:
                self._decode_body(bucket, kind, record)
        tokens, logprobs = self._fetch_outputs(batch, steps)
        self.decoder.check_handoffs()  # after the chunk's wait: one word more
        out = []
        for b, r in enumerate(rows):
            m = cut_at_stop(tokens[b], limits[b], r.stop_ids)
            c.advance(r.slot, m)
            if r.stream is not None and not r.params.greedy:
                r.stream.counter += m
            if r.recorder is not None:
                k = min(m, r.recorder.capacity)
                r.recorder.push(self._q_steps[:, b, m - k : m].transpose(1, 2), r.start + m - k)
            out.append((tokens[b][:m], logprobs[b][:m]))
        return out

    def _fetch_outputs(self, batch: int, steps: int) -> tuple[list[list[int]], list[list[float]]]:
        """The chunk's tokens and log-probabilities on the host: one wait for the device."""
        host_tok, host_lp = self._out_host
        host_tok[:batch, :steps].copy_(self._out_tok[:batch, :steps], non_blocking=True)
        host_lp[:batch, :steps].copy_(self._out_lp[:batch, :steps], non_blocking=True)
        if self._out_ready is not None:
            self._out_ready.record()
            self._out_ready.synchronize()
        return host_tok[:batch, :steps].tolist(), host_lp[:batch, :steps].tolist()

    @torch.no_grad()
    def generate(
        self,
        slots: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        params: Sequence[SamplingParams],
        max_new_tokens: int,
        *,
        seeds: Sequence[int] | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Decode up to ``max_new_tokens`` per row in chunks of :meth:`decode_chunk` (benchmarks, tests).

        Row ``b`` feeds ``tokens[b]`` (sampled earlier, not yet in the cache) at logical
        position ``positions[b]`` into slot ``slots[b]``, then feeds back what it samples, until
        a token of ``stop_token_ids`` (included in its output, not fed) or ``max_new_tokens``.

        Returns:
            ``(tokens, logprobs)`` per row.
        """
        batch = len(slots)
        assert len(tokens) == len(positions) == len(params) == batch
        stops = frozenset(stop_token_ids)
        rows = [
            DecodeRow(slot, tok, pos, max_new_tokens, p, SampleStream((seeds or [0] * batch)[b]), stops)
            for b, (slot, tok, pos, p) in enumerate(zip(slots, tokens, positions, params))
        ]
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in rows]
        todo = list(range(batch))
        while todo:
            chunk = self.decode_chunk([rows[b] for b in todo], self.chunk_steps)
            going_on = []
            for b, (toks, lps) in zip(todo, chunk):
                out[b][0].extend(toks)
                out[b][1].extend(lps)
                r = rows[b]
                if toks[-1] not in stops and len(toks) < r.max_steps:
                    rows[b] = replace(r, token=toks[-1], start=r.start + len(toks), max_steps=r.max_steps - len(toks))
                    going_on.append(b)
            todo = going_on
        return [t for t, _ in out], [lp for _, lp in out]
