"""Runs batched forward passes of the HF model over slot rows (the nano-vllm model runner).

A runner's contract (this generic runner and the fast one,
:class:`~compaction_gym.engine.fast.FastModelRunner`):

* :meth:`ModelRunner.forward` feeds every row its own number of tokens (prefill, decode and
  injected messages alike) and returns each row's last logits. Here rows are left-padded to a
  common width ``N`` so that the last column holds each row's last token (``logits_to_keep=1``),
  and the attention context masks the padding, the causality inside the new tokens and each
  slot's length.
* :meth:`ModelRunner.decode_chunk` runs up to ``steps`` decode steps of many rows (feed a token,
  sample the next, feed it back), each row stopping at its own limit or stop token; the fast
  runner does it on the device with one host synchronisation per chunk, this one step by step.
* Input scoring (docs/engine.md, "Scoring fed tokens"): a :class:`RowFeed` with ``score=True``
  also gets ``scores``, the float32 log-softmax log-probabilities of its in-chunk targets
  (``token_ids[1:]`` under the logits of ``token_ids[:-1]``); other rows keep the
  last-token-only forward.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import torch

from compaction_gym.engine.attention import EngineForward, SlotCache
from compaction_gym.engine.config import SamplingParams
from compaction_gym.engine.context import ForwardContext, forward_context
from compaction_gym.engine.sampler import SampleStream, sample
from compaction_gym.engine.slot_cache import SlotKVCache
from compaction_gym.errors import InvalidArgumentError


class QueryRecorder(Protocol):
    capacity: int

    def push(self, queries: torch.Tensor, first_position: int) -> None: ...


@dataclass
class RowFeed:
    """Tokens fed to one slot in one forward pass; ``start`` is the first token's logical position.

    With ``score=True`` the runner sets ``scores`` to float32 ``[len(token_ids) - 1]``:
    ``scores[j] = log_softmax(logits at token_ids[j])[token_ids[j + 1]]`` (the plain model
    distribution, no temperature), and ``entropies[j]`` to that distribution's entropy in nats.
    """

    slot: int
    token_ids: list[int]
    start: int
    recorder: QueryRecorder | None = None
    score: bool = False
    scores: torch.Tensor | None = None
    entropies: torch.Tensor | None = None


@dataclass
class DecodeRow:
    """One row of :meth:`ModelRunner.decode_chunk`.

    The row feeds ``token`` (sampled earlier, not yet in the cache) at logical position ``start``
    into ``slot``, samples the next token, feeds it, and so on; it stops after ``max_steps``
    steps or after sampling one of ``stop_ids`` (returned, not fed). Sampling rows draw from
    ``stream`` and advance it by one per token.
    """

    slot: int
    token: int
    start: int
    max_steps: int
    params: SamplingParams
    stream: SampleStream | None = None
    stop_ids: Collection[int] = ()
    recorder: QueryRecorder | None = None


def cut_at_stop(tokens: list[int], limit: int, stop_ids: Collection[int]) -> int:
    """How many of ``tokens`` a row keeps: its first ``limit``, up to and including the first stop id."""
    return next((i + 1 for i, t in enumerate(tokens[:limit]) if t in stop_ids), min(limit, len(tokens)))


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, rows_per_pass: int = 256) -> torch.Tensor:
    """float32 ``log_softmax(logits[j])[targets[j]]`` for logits ``[n, V]`` (any dtype) and targets ``[n]``.

    Computed ``rows_per_pass`` rows at a time, so the float32 copy stays small for long chunks and
    large vocabularies.
    """
    return target_scores(logits, targets, rows_per_pass)[0]


def target_scores(
    logits: torch.Tensor, targets: torch.Tensor, rows_per_pass: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 target log-probs (:func:`target_logprobs`) and the entropy ``-Σ_v p_v log p_v``
    (nats) of each row's distribution, ``rows_per_pass`` rows at a time."""
    out = torch.empty(len(targets), dtype=torch.float32, device=logits.device)
    ent = torch.empty(len(targets), dtype=torch.float32, device=logits.device)
    for a in range(0, len(targets), rows_per_pass):
        part = torch.log_softmax(logits[a : a + rows_per_pass].float(), dim=-1)
        out[a : a + rows_per_pass] = part.gather(-1, targets[a : a + rows_per_pass, None]).squeeze(-1)
        ent[a : a + rows_per_pass] = -(part.exp() * part).sum(-1)
    return out, ent


@dataclass(frozen=True)
class ModelLayout:
    """Attention geometry of a decoder-only model, read from its config and modules."""

    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    vocab_size: int
    scale: float

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelLayout:
        cfg = model.config.get_text_config()
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise InvalidArgumentError(
                f"the engine supports full-attention layers only; this model has layer types "
                f"{sorted(set(layer_types))} (sliding-window or linear attention)"
            )
        attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
        if len(attn) != cfg.num_hidden_layers:
            raise InvalidArgumentError(
                f"expected one attention module with layer_idx and scaling per layer ({cfg.num_hidden_layers}), "
                f"found {len(attn)}: {type(model).__name__} does not use the standard HF attention layout"
            )
        scales = {float(m.scaling) for m in attn}
        if len(scales) != 1:
            raise InvalidArgumentError(f"layers use different attention scalings {sorted(scales)}")
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            n_layers=cfg.num_hidden_layers,
            n_q_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
            vocab_size=model.get_input_embeddings().num_embeddings,
            scale=scales.pop(),
        )


class ModelRunner:
    """Owns the model and the slot cache; turns :class:`RowFeed` batches into next-token logits."""

    #: most decode steps the scheduler asks of one :meth:`decode_chunk`
    chunk_steps = 32

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, layout: ModelLayout) -> None:
        self.model = model
        self.cache = cache
        self.layout = layout
        self.device = cache.k.device
        self.dtype = cache.k.dtype
        self._hf_cache = SlotCache(cache)
        self._switch = EngineForward(model)  # the engine's attention and eval mode, per forward only

    @torch.no_grad()
    def forward(self, rows: list[RowFeed]) -> torch.Tensor:
        """Feed each row's tokens into its slot; return float32 logits ``[B, V]`` of each row's last token.

        Advances each slot's length and pushes recorded queries to the rows' recorders. Rows
        with ``score`` get their in-chunk target log-probs in ``scores`` (then every column's
        logits are computed; otherwise only the last column's).
        """
        assert rows and all(r.token_ids for r in rows)
        cache, dev = self.cache, self.device
        lens = [cache.length(r.slot) for r in rows]
        sizes = [len(r.token_ids) for r in rows]
        assert all(n0 + n <= cache.capacity for n0, n in zip(lens, sizes)), "runner asked to overflow a slot"
        width = max(sizes)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        pos = torch.zeros(len(rows), width, dtype=torch.long)
        write_slot, write_row, write_b, write_col = [], [], [], []
        for b, (r, n0, n) in enumerate(zip(rows, lens, sizes)):
            pad = width - n
            ids[b, pad:] = torch.tensor(r.token_ids)
            pos[b, pad:] = torch.arange(r.start, r.start + n)
            pos[b, :pad] = r.start
            write_slot += [r.slot] * n
            write_row += range(n0, n0 + n)
            write_b += [b] * n
            write_col += range(pad, width)
        kv_len = max(n0 + n for n0, n in zip(lens, sizes))
        slots = [r.slot for r in rows]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        uniform = width == 1 and len(set(lens)) == 1
        ctx = ForwardContext(
            slots=torch.tensor(slots, device=dev),
            slot_range=(slots[0], slots[-1] + 1) if consecutive else None,
            write_slot=torch.tensor(write_slot, device=dev),
            write_row=torch.tensor(write_row, device=dev),
            write_b=torch.tensor(write_b, device=dev),
            write_col=torch.tensor(write_col, device=dev),
            uniform_row=lens[0] if uniform else None,
            kv_len=kv_len,
            mask=None if uniform else self._mask(lens, sizes, width, kv_len),
            cache=cache,
            use_beta=any(cache.has_beta[s] for s in slots),
        )
        recording = [b for b, r in enumerate(rows) if r.recorder is not None]
        if recording:
            ctx.record_rows = torch.tensor(recording, device=dev)
            ctx.record_cols = max(min(sizes[b], rows[b].recorder.capacity) for b in recording)
        scoring = any(r.score for r in rows)
        with forward_context(ctx), self._switch:
            out = self.model(
                input_ids=ids.to(dev),
                position_ids=pos.to(dev),
                past_key_values=self._hf_cache,
                use_cache=True,
                logits_to_keep=0 if scoring else 1,
            )
        for r, n in zip(rows, sizes):
            cache.advance(r.slot, n)
        if recording:
            self._push_queries(rows, sizes, recording, ctx)
        if scoring:
            for b, (r, n) in enumerate(zip(rows, sizes)):
                if r.score:
                    r.scores, r.entropies = target_scores(
                        out.logits[b, width - n : width - 1], ids[b, width - n + 1 :].to(dev)
                    )
        return out.logits[:, -1].float()

    @torch.no_grad()
    def decode_chunk(self, rows: list[DecodeRow], steps: int) -> list[tuple[list[int], list[float]]]:
        """Up to ``steps`` decode steps of every row (see :class:`DecodeRow`), one forward per step.

        Returns each row's sampled tokens and log-probabilities (``m ≥ 1`` of them: its limit,
        ``steps``, or up to its stop token). Its slot grows by the ``m`` tokens fed (its
        ``token`` and all sampled tokens but the last, which stays pending).
        """
        assert rows and steps >= 1 and all(r.max_steps >= 1 for r in rows)
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in rows]
        live = list(range(len(rows)))
        for j in range(steps):
            feeds = [RowFeed(rows[b].slot, [out[b][0][-1] if j else rows[b].token], rows[b].start + j, rows[b].recorder) for b in live]
            tokens, logprobs = sample(
                self.forward(feeds), [rows[b].params for b in live], [rows[b].stream for b in live]
            )
            for b, tok, lp in zip(live, tokens, logprobs):
                out[b][0].append(tok)
                out[b][1].append(lp)
            live = [b for b in live if j + 1 < rows[b].max_steps and out[b][0][-1] not in rows[b].stop_ids]
            if not live:
                break
        return out

    def _mask(self, lens: list[int], sizes: list[int], width: int, kv_len: int) -> torch.Tensor:
        """Additive mask ``[B, 1, G * N, kv_len]``: column ``c`` of row ``b`` sees rows ``<= len_b + i``.

        ``i = c - (N - n_b)`` is the token's index among the row's new tokens; padding columns
        (``i < 0``) see the row's first new token so that their softmax stays finite.
        """
        lens_t = torch.tensor(lens)[:, None]
        first = width - torch.tensor(sizes)[:, None]
        col = torch.arange(width)[None, :]
        limit = lens_t + (col - first).clamp(min=0)  # [B, N]
        allowed = torch.arange(kv_len)[None, None, :] <= limit[:, :, None]  # [B, N, L]
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, float("-inf"))
        group = self.layout.n_q_heads // self.layout.n_kv_heads
        return mask[:, None].repeat(1, 1, group, 1).to(self.device)

    def _push_queries(
        self, rows: list[RowFeed], sizes: list[int], recording: list[int], ctx: ForwardContext
    ) -> None:
        queries = torch.stack(ctx.recorded)  # [L, R, H_q, K, d]
        cols = ctx.record_cols
        for i, b in enumerate(recording):
            r = rows[b]
            m = min(sizes[b], r.recorder.capacity)
            r.recorder.push(queries[:, i, :, cols - m :], r.start + sizes[b] - m)
