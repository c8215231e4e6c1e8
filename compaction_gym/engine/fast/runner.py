"""The fast model runner: batched prefill, CUDA-graph decode, device sampling (GPU, Llama family).

:class:`FastModelRunner` is a drop-in for :class:`~compaction_gym.engine.model_runner.ModelRunner`
(same :meth:`forward` contract over :class:`RowFeed` rows, same slot cache, same recorded
queries), so the scheduler, compactor and sessions are shared with the generic path:

* rows that feed one token each (decode) replay a CUDA graph captured for the smallest
  batch-size bucket that holds them (padding rows write nothing and read nothing);
* other batches (prefill, injected messages) run as one flat "varlen" batch of all rows' tokens
  (:func:`~compaction_gym.engine.fast.attention.prefill_attention`), in groups of at most
  ``max_prefill_tokens`` tokens.

:meth:`generate` is the device-resident decode loop: each graph replay runs the model, samples
on the device (:mod:`~compaction_gym.engine.fast.sampler`), stores the token and advances
positions and lengths in device buffers, so ``check_every`` steps run back to back with no host
synchronisation; stop tokens are checked once per ``check_every`` steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compaction_gym.engine.config import SamplingParams
from compaction_gym.engine.fast.attention import decode_attention, num_splits_for, prefill_attention
from compaction_gym.engine.fast.model import FastDecoder
from compaction_gym.engine.fast.sampler import DeviceSampling, sample_device
from compaction_gym.engine.model_runner import ModelLayout, RowFeed
from compaction_gym.engine.slot_cache import SlotKVCache

_IDS, _POS, _SLOT, _ROW, _LEN = range(5)


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
        check_every: decode steps per host check in :meth:`generate`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: SlotKVCache,
        layout: ModelLayout,
        *,
        cuda_graphs: bool | None = None,
        max_prefill_tokens: int = 16384,
        check_every: int = 32,
    ) -> None:
        self.model, self.cache, self.layout = model, cache, layout
        self.device, self.dtype = cache.k.device, cache.k.dtype
        self.decoder = FastDecoder(model)
        dec = self.decoder
        assert (dec.n_layers, dec.n_kv, dec.head_dim) == (cache.n_layers, cache.n_kv_heads, cache.head_dim)
        self.use_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self.max_prefill_tokens = max_prefill_tokens
        self.check_every = check_every
        self.max_batch = cache.max_slots
        self.buckets = graph_buckets(self.max_batch)
        self.sm_count = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        )
        dev, nb = self.device, self.max_batch
        self._inputs = torch.zeros(5, nb, dtype=torch.long, device=dev)
        self._host = torch.zeros(5, nb, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._host_free = torch.cuda.Event() if dev.type == "cuda" else None
        self._q_rec = torch.zeros(dec.n_layers, nb, dec.n_q, dec.head_dim, dtype=self.dtype, device=dev)
        self._out_tok = torch.zeros(nb, check_every, dtype=torch.long, device=dev)
        self._out_lp = torch.zeros(nb, check_every, dtype=torch.float32, device=dev)
        self._step = torch.zeros(1, dtype=torch.long, device=dev)
        self.sampling = DeviceSampling(nb, dev)
        self._graphs: dict[tuple[int, str], _Graph] = {}
        self._pool = None

    # ------------------------------------------------------------ contract
    @torch.no_grad()
    def forward(self, rows: list[RowFeed]) -> torch.Tensor:
        """Feed each row's tokens into its slot; return float32 logits ``[B, V]`` of each row's last token.

        Advances each slot's length and pushes recorded queries to the rows' recorders (the
        generic runner's contract).
        """
        assert rows and all(r.token_ids for r in rows)
        cache = self.cache
        lens = [cache.lengths[r.slot] for r in rows]
        sizes = [len(r.token_ids) for r in rows]
        for n0, n in zip(lens, sizes):
            assert n0 + n <= cache.capacity, "runner asked to overflow a slot"
        self._ensure_positions(max(r.start + n for r, n in zip(rows, sizes)))
        if self.use_graphs and max(sizes) == 1 and len(rows) <= self.max_batch:
            logits = self._forward_decode(rows, lens)
        else:
            logits = torch.cat([self._forward_flat(g, [lens[i] for i in idx]) for idx, g in self._groups(rows)])
        for r, n in zip(rows, sizes):
            cache.lengths[r.slot] += n
        return logits

    # --------------------------------------------------------------- decode
    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _load_inputs(self, columns: list[list[int]], bucket: int) -> None:
        """Copy ids/positions/slots/rows/lengths (padded to ``bucket``) into the static inputs."""
        n = len(columns[0])
        pad = bucket - n
        if self._host_free is not None:
            self._host_free.synchronize()  # the previous copy out of the pinned buffer is done
        padding = (0, 0, -1, 0, 0)
        self._host[:, :bucket] = torch.tensor([col + [p] * pad for col, p in zip(columns, padding)])
        self._inputs[:, :bucket].copy_(self._host[:, :bucket], non_blocking=True)
        if self._host_free is not None:
            self._host_free.record()

    def _forward_decode(self, rows: list[RowFeed], lens: list[int]) -> torch.Tensor:
        batch = len(rows)
        bucket = self._bucket(batch)
        self._load_inputs(
            [[r.token_ids[0] for r in rows], [r.start for r in rows], [r.slot for r in rows], lens, [n + 1 for n in lens]],
            bucket,
        )
        g = self._graph(bucket, "logits")
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

    def _decode_body(self, batch: int, kind: str) -> _Graph:
        """One decode step on the static inputs' first ``batch`` rows (captured as a graph)."""
        c, dec = self.cache, self.decoder
        ids, pos, slots, rows, lens = (self._inputs[i, :batch] for i in range(5))
        splits = num_splits_for(batch, c.n_kv_heads, c.capacity, self.sm_count)
        fused = dec.fuse_attention if dec.fuse_attention is not None else splits == 1

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            kv = c.k[:, i], c.v[:, i], c.beta[:, i]
            return decode_attention(q, *kv, slots, lens, dec.scale, splits, fused_merge=fused)

        if self._q_rec.dtype == dec.dtype:  # the RoPE kernel writes the queries into the recording buffer
            logits = dec.run(ids, pos, slots, rows, c.k, c.v, attend, q_out=self._q_rec[:, :batch])
        else:

            def record(i: int, q: torch.Tensor) -> None:
                self._q_rec[i, :batch].copy_(q)

            logits = dec.run(ids, pos, slots, rows, c.k, c.v, attend, record=record)
        if kind == "logits":
            return _Graph(None, logits)
        tokens, logprobs = sample_device(logits, self.sampling, greedy_only=kind == "greedy", filtered=kind == "filtered")
        self._out_tok[:batch].index_copy_(1, self._step, tokens[:, None])
        self._out_lp[:batch].index_copy_(1, self._step, logprobs[:, None])
        self._step += 1
        live = lens > 0
        ids.copy_(tokens)
        pos.add_(live.long())
        rows.add_(live.long())
        lens.add_(live.long())
        return _Graph(None, logits, tokens)

    def _graph(self, bucket: int, kind: str) -> _Graph:
        """The decode graph for ``bucket`` rows and output ``kind`` (captured on first use)."""
        key = (bucket, kind)
        if key in self._graphs:
            return self._graphs[key]
        saved = self._inputs.clone()
        self._inputs[_SLOT].fill_(-1)  # warm-up and capture must not touch the cache
        self._inputs[_LEN].zero_()
        step, counters = self._step.clone(), self.sampling.counter.clone()
        self._step.zero_()  # the warm-up steps store their tokens at columns 0 and 1
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self.decoder.graph_mode = True  # projections pick cuBLAS or the GEMV (timed in the warm-up)
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the Triton kernels and settles cuBLAS workspaces
                    self._decode_body(bucket, kind)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._decode_body(bucket, kind)
        finally:
            self.decoder.graph_mode = False
        self._pool = graph.pool()
        torch.cuda.synchronize(self.device)
        self._inputs.copy_(saved)
        self._step.copy_(step)
        self.sampling.counter.copy_(counters)
        out.graph = graph
        self._graphs[key] = out
        return out

    def recapture(self) -> None:
        """Drop the captured decode graphs: the next decode step of each bucket captures again (after
        changing the decoder's settings, e.g. its fusions or GEMV use)."""
        self._graphs.clear()
        self._pool = None

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
            rec_idx = torch.tensor(
                [i for b, m in recording for i in range(tok0[b] + sizes[b] - m, tok0[b] + sizes[b])], device=dev
            )

            def record(i: int, q: torch.Tensor) -> None:
                recorded.append(q[rec_idx])

        logits = dec.run(ids, pos, slot_t, row_t, c.k, c.v, attend, last=last_b, record=record)
        if recording:
            queries = torch.stack(recorded)  # [L, R, H_q, d]
            off = 0
            for b, m in recording:
                r = rows[b]
                r.recorder.push(queries[:, off : off + m].transpose(1, 2), r.start + sizes[b] - m)
                off += m
        return logits.to(torch.float32, copy=True)

    # ------------------------------------------------------------- generate
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
        counters: Sequence[int] | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Decode up to ``max_new_tokens`` per row on the device, syncing once per ``check_every`` steps.

        Row ``b`` feeds ``tokens[b]`` (sampled earlier, not yet in the cache) at logical
        position ``positions[b]`` into slot ``slots[b]``, then feeds back what it samples. A row
        stops after a token of ``stop_token_ids`` (included in its output, not fed: it stays
        pending, as in the scheduler); slot lengths advance by the tokens really fed. Suffix
        queries are not recorded here (use :meth:`forward` for sessions that need them).

        Returns:
            ``(tokens, logprobs)`` per row.
        """
        batch = len(slots)
        assert 0 < batch <= self.max_batch and len(tokens) == len(positions) == len(params) == batch
        c = self.cache
        lens = [c.lengths[s] for s in slots]
        steps = max_new_tokens
        assert max(lens) + steps <= c.capacity, "generate would overflow a slot"
        self._ensure_positions(max(positions) + steps + 1)
        bucket = self._bucket(batch)
        self.sampling.set(
            list(params) + [SamplingParams(temperature=0.0)] * (bucket - batch),
            list(seeds or [0] * batch) + [0] * (bucket - batch),
            list(counters or [0] * batch) + [0] * (bucket - batch),
        )
        kind = "greedy" if self.sampling.greedy else ("filtered" if self.sampling.filtered else "sample")
        self._load_inputs([list(tokens), list(positions), list(slots), lens, [n + 1 for n in lens]], bucket)
        g = self._graph(bucket, kind) if self.use_graphs else None
        stop = torch.tensor(sorted(set(stop_token_ids)) or [-1], device=self.device)
        out_tok, out_lp, done = [], [], 0
        while done < steps:
            n = min(self.check_every, steps - done)
            self._step.zero_()
            for _ in range(n):
                if g is not None:
                    g.graph.replay()
                else:
                    self._decode_body(bucket, kind)
            chunk = self._out_tok[:batch, :n].clone()
            out_tok.append(chunk)
            out_lp.append(self._out_lp[:batch, :n].clone())
            done += n
            if stop_token_ids and bool(torch.isin(torch.cat(out_tok, 1), stop).any(1).all()):
                break  # the one host sync per chunk
        toks = torch.cat(out_tok, 1).tolist()
        lps = torch.cat(out_lp, 1).tolist()
        stops = set(stop_token_ids)
        for b in range(batch):
            cut = next((i + 1 for i, t in enumerate(toks[b]) if t in stops), len(toks[b]))
            toks[b], lps[b] = toks[b][:cut], lps[b][:cut]
            c.lengths[slots[b]] += cut  # fed: the input token and every output token but the last
        return toks, lps
