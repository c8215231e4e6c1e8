"""Language-model scoring of a text under compacted KV caches (docs/eval-lm.md).

A *cell* is one compaction method (a :class:`~compaction_gym.engine.CompactionConfig`). Each cell
gets a session that is fed the text ``chunk`` tokens per step with ``score_input=True`` and
``max_new_tokens=0`` (teacher forcing), so every token is scored under the cache as it stands —
compacted by the KV-budget trigger between steps, exactly as decoding would see it
(docs/engine.md, "Scoring fed tokens"). Cells run side by side in one ``step_batch``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from compaction_gym.backends import Backend
from compaction_gym.engine.config import COMPACTION_MODES, CompactionConfig, SamplingParams
from compaction_gym.engine.types import CreateRequest, StepRequest
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.lmeval.mixer import BackoffNgramMixer, MixerConfig, mix_stream

#: the suffix of a cell mixed with the n-gram mixer (``attention_matching@512+ngram``)
MIXER_SUFFIX = "+ngram"
#: the suffix of a ``--modes`` entry that turns on β (``attention_matching+beta``)
BETA_SUFFIX = "+beta"


@dataclass(frozen=True)
class Cell:
    """One method to score: a display name and the session config."""

    name: str
    config: CompactionConfig


@dataclass
class CellResult:
    """Scores of one cell over the scored positions ``[score_after, n_tokens)``.

    Attributes:
        mean_nll: mean negative log-likelihood (nats per token).
        bits_per_byte: total NLL in bits / UTF-8 bytes of the scored tokens (float64 sums).
        mean_kv: mean cache rows each scored token attended to (itself included).
        mean_context: mean tokens before and including each scored token (what a full cache holds).
        compression: ``mean_context / mean_kv``.
        events: compaction events that fired.
        seconds: wall time of the cell's group (cells of one group share it).
        nll: per position, ``-input_logprob`` (NaN where not scored: the first token); with the
            mixer, the mixed NLL.
        entropy: per position, the model distribution's entropy (nats; NaN where not scored).
        kv_seen: per position, the cache rows its token attended to (itself included).
        mixer: the :class:`MixerConfig` fields when the n-gram mixer was applied, else ``None``.
    """

    name: str
    mode: str
    max_kv_len: int | None
    compact_window: int | None
    compute_beta: bool
    n_scored: int
    n_bytes: int
    mean_nll: float
    bits_per_byte: float
    mean_kv: float
    mean_context: float
    compression: float
    events: int
    seconds: float
    nll: list[float] = field(repr=False, default_factory=list)
    entropy: list[float] = field(repr=False, default_factory=list)
    kv_seen: list[int] = field(repr=False, default_factory=list)
    mixer: dict[str, Any] | None = None

    def to_dict(self, with_nll: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d.pop("entropy")
        d.pop("kv_seen")
        if not with_nll:
            d.pop("nll")
        else:
            d["nll"] = [None if math.isnan(x) else x for x in self.nll]
        return d


def make_cells(
    modes: Sequence[str],
    budgets: Sequence[int | None],
    base: dict[str, Any] | None = None,
    *,
    reference: bool = True,
) -> list[Cell]:
    """One cell per (mode, budget), ``none`` once (first) when ``reference`` or asked for.

    ``base``: other :class:`CompactionConfig` fields for every compacting cell (``compact_window``
    unset: each budget's default ``budget // 2``). A mode may carry flags (:func:`parse_mode`:
    ``attention_matching+beta+keep+repeat``).

    Raises:
        InvalidArgumentError: an unknown mode, a compacting mode without a budget, or a field
            combination :class:`CompactionConfig` refuses.
    """
    base = dict(base or {})
    for name in ("mode", "max_kv_len", "compute_beta"):
        base.pop(name, None)
    if base.get("n_protect_turns", -1) >= 0 or base.get("inject_budget_message") or base.get("inject_budget_every"):
        raise InvalidArgumentError(
            "eval-lm compacts by KV budget only: drop n_protect_turns, inject_budget_message and inject_budget_every"
        )
    names = list(modes)
    cells = [Cell("none", CompactionConfig())] if reference or "none" in names else []
    for mode in names:
        if mode == "none":
            continue
        plain, fields = parse_mode(mode)
        for budget in budgets:
            if budget is None:
                raise InvalidArgumentError(f"modes: {mode!r} needs a KV budget (--max-kv-len or --budgets)")
            config = CompactionConfig(**{**base, **fields, "mode": plain, "max_kv_len": int(budget)})
            cells.append(Cell(f"{mode}@{budget}", config))
    return cells


#: ``--modes`` flags after ``+`` and the :class:`CompactionConfig` fields they set; probe-source flags
#: combine (``+suffix+repeat``: ``queries="suffix+repeat"``).
MODE_FLAGS = {"beta": ("compute_beta", True), "keep": ("refit_values", False)}
_SOURCE_FLAGS = ("suffix", "keys", "random", "repeat")


def parse_mode(name: str) -> tuple[str, dict[str, Any]]:
    """``attention_matching+beta+keep+repeat`` → ``("attention_matching", {compute_beta: True, ...})``.

    Flags: ``beta`` (fit β), ``keep`` (keep the original values: ``refit_values=False``) and the
    probe sources ``suffix``, ``keys``, ``random``, ``repeat`` (two join with ``+``, as
    ``PROBE_SOURCES`` spells them). Without ``beta`` a cell has ``compute_beta=False``.

    Raises:
        InvalidArgumentError: an unknown mode or flag.
    """
    plain, *flags = name.split("+")
    if plain not in COMPACTION_MODES or plain == "none":
        choices = [m for m in COMPACTION_MODES if m != "none"] + [f"attention_matching{BETA_SUFFIX}"]
        raise InvalidArgumentError(f"modes: unknown mode {name!r}; choose from none, {', '.join(choices)}")
    fields: dict[str, Any] = {"compute_beta": False}
    sources = []
    for flag in flags:
        if flag in MODE_FLAGS:
            key, value = MODE_FLAGS[flag]
            fields[key] = value
        elif flag in _SOURCE_FLAGS:
            sources.append(flag)
        else:
            raise InvalidArgumentError(
                f"modes: unknown flag {flag!r} in {name!r}; flags: {', '.join([*MODE_FLAGS, *_SOURCE_FLAGS])}"
            )
    if sources:
        fields["queries"] = "+".join(sorted(sources, key=_SOURCE_FLAGS.index))
    return plain, fields


def piece_bytes(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """UTF-8 bytes of each token's decoded piece (``tokenizer.decode([id])``).

    Exact for text whose characters each lie within one token (ASCII prose); a token holding part
    of a multi-byte character counts the bytes of its decoded piece (U+FFFD: 3).
    """
    return [len(tokenizer.decode([int(t)], clean_up_tokenization_spaces=False).encode("utf-8")) for t in ids]


def bits_per_byte(nll: Sequence[float], n_bytes: Sequence[int]) -> float:
    """``sum(nll) / ln 2 / sum(n_bytes)`` in float64 (``nll`` in nats)."""
    total = math.fsum(float(x) for x in n_bytes)
    if total <= 0:
        raise InvalidArgumentError("bits per byte needs at least one byte of scored text")
    return math.fsum(float(x) for x in nll) / math.log(2) / total


def default_score_after(cells: Sequence[Cell]) -> int:
    """The largest KV budget among ``cells`` (0 without one): every method is scored on the same
    positions, all past the point where the largest budget first fills."""
    return max((c.config.max_kv_len or 0 for c in cells), default=0)


def score_cells(
    backend: Backend,
    token_ids: Sequence[int],
    cells: Sequence[Cell],
    byte_counts: Sequence[int],
    *,
    chunk: int = 64,
    score_after: int | None = None,
    max_batch: int = 8,
    progress: Callable[[int], None] | None = None,
    seed: int = 0,
) -> list[CellResult]:
    """Feed ``token_ids`` to one session per cell, ``chunk`` tokens per step, and score them.

    Args:
        backend: a :class:`~compaction_gym.backends.Backend` (``LocalBackend`` over an engine whose
            slots hold ``len(token_ids)`` rows for the ``none`` cell).
        cells: the methods (see :func:`make_cells`).
        byte_counts: UTF-8 bytes per token (:func:`piece_bytes`).
        chunk: tokens fed per step (compaction fires between steps, never inside one).
        score_after: first scored position (default :func:`default_score_after`; at least 1).
        max_batch: sessions stepped together.
        progress: called with the number of tokens fed after each step (summed over cells).
        seed: the sessions' RNG seed (``random`` selection and ``random`` probes draw from it).

    Returns:
        One :class:`CellResult` per cell, in order.
    """
    n = len(token_ids)
    if chunk < 1:
        raise InvalidArgumentError(f"chunk must be >= 1, got {chunk}")
    if max_batch < 1:
        raise InvalidArgumentError(f"max_batch must be >= 1, got {max_batch}")
    if len(byte_counts) != n:
        raise InvalidArgumentError(f"byte_counts has {len(byte_counts)} entries for {n} tokens")
    first = max(1, default_score_after(cells) if score_after is None else int(score_after))
    if first >= n:
        raise InvalidArgumentError(
            f"score_after ({first}) leaves nothing to score in {n} tokens; raise max_tokens or lower score_after"
        )
    ids = [int(t) for t in token_ids]
    results: list[CellResult] = []
    for g in range(0, len(cells), max_batch):
        results += _score_group(
            backend, ids, cells[g : g + max_batch], byte_counts, chunk, first, progress, seed
        )
    return results


def _score_group(
    backend: Backend,
    ids: list[int],
    cells: Sequence[Cell],
    byte_counts: Sequence[int],
    chunk: int,
    first: int,
    progress: Callable[[int], None] | None,
    seed: int = 0,
) -> list[CellResult]:
    n = len(ids)
    force = SamplingParams(max_new_tokens=0, seed=seed)
    t0 = time.perf_counter()
    logprobs = [[math.nan] * n for _ in cells]
    entropies = [[math.nan] * n for _ in cells]
    kv_seen = [[0] * n for _ in cells]
    events = [0] * len(cells)
    session_ids: list[str] = []
    try:
        for start in range(0, n, chunk):
            piece = ids[start : start + chunk]
            if start == 0:
                requests: list[Any] = [CreateRequest(piece, c.config, force, score_input=True) for c in cells]
            else:
                requests = [StepRequest(sid, piece, force, score_input=True) for sid in session_ids]
            out = backend.step_batch(requests)
            if start == 0:
                session_ids = [r.session_id for r in out]
            for i, r in enumerate(out):
                kv_before = r.kv_len - len(piece)  # rows after this step's compaction, before the feed
                events[i] += len(r.events)
                ents = r.input_entropies or [None] * len(r.input_logprobs or [])
                for j, (lp, h) in enumerate(zip(r.input_logprobs or [], ents)):
                    logprobs[i][start + j] = math.nan if lp is None else lp
                    entropies[i][start + j] = math.nan if h is None else h
                    kv_seen[i][start + j] = kv_before + j + 1
            if progress is not None:
                progress(len(piece) * len(cells))
    finally:
        for sid in session_ids:
            backend.close(sid)
    seconds = time.perf_counter() - t0
    scored = range(first, n)
    n_bytes = [int(byte_counts[p]) for p in scored]
    results = []
    for i, cell in enumerate(cells):
        nll = [-x for x in logprobs[i]]
        scored_nll = [nll[p] for p in scored]
        if any(math.isnan(x) for x in scored_nll):
            raise RuntimeError(
                f"cell {cell.name}: the backend returned no input log-probs for some positions"
            )
        mean_kv = math.fsum(kv_seen[i][p] for p in scored) / len(scored)
        mean_context = math.fsum(p + 1 for p in scored) / len(scored)
        cfg = cell.config
        results.append(
            CellResult(
                name=cell.name,
                mode=cfg.mode,
                max_kv_len=cfg.max_kv_len,
                compact_window=cfg.compact_window,
                compute_beta=cfg.compute_beta,
                n_scored=len(scored),
                n_bytes=sum(n_bytes),
                mean_nll=math.fsum(scored_nll) / len(scored),
                bits_per_byte=bits_per_byte(scored_nll, n_bytes),
                mean_kv=mean_kv,
                mean_context=mean_context,
                compression=mean_context / mean_kv,
                events=events[i],
                seconds=seconds,
                nll=nll,
                entropy=entropies[i],
                kv_seen=kv_seen[i],
            )
        )
    return results


def mix_result(
    result: CellResult,
    token_ids: Sequence[int],
    byte_counts: Sequence[int],
    config: MixerConfig,
    vocab_size: int,
    chunk: int,
) -> CellResult:
    """``result`` rescored with a fresh :class:`BackoffNgramMixer` in one score-first pass over
    the text, chunk by chunk as it was fed (docs/eval-lm.md, "N-gram mixer"): the cell
    ``NAME+ngram``, on the same scored positions.

    Raises:
        InvalidArgumentError: the backend returned no entropies (the mixer's weight needs them).
    """
    n = len(token_ids)
    first = n - result.n_scored
    if not result.entropy or any(math.isnan(result.entropy[p]) for p in range(first, n)):
        raise InvalidArgumentError(
            f"cell {result.name}: the backend returned no input entropies; the n-gram mixer needs them"
        )
    lp = [None if math.isnan(x) else -x for x in result.nll]
    ent = [None if math.isnan(x) else x for x in result.entropy]
    nll, _ = mix_stream(BackoffNgramMixer(config, vocab_size), token_ids, lp, ent, chunk)
    scored = nll[first:]
    return CellResult(
        **{
            **{k: getattr(result, k) for k in ("mode", "max_kv_len", "compact_window", "compute_beta")},
            **{k: getattr(result, k) for k in ("n_scored", "n_bytes", "mean_kv", "mean_context")},
            **{k: getattr(result, k) for k in ("compression", "events", "seconds")},
        },
        name=result.name + MIXER_SUFFIX,
        mean_nll=math.fsum(scored) / len(scored),
        bits_per_byte=bits_per_byte(scored, [int(byte_counts[p]) for p in range(first, n)]),
        nll=nll,
        entropy=result.entropy,
        kv_seen=result.kv_seen,
        mixer=config.to_dict(),
    )


def summary(results: Sequence[CellResult], **run: Any) -> dict[str, Any]:
    """The JSON summary: the run's settings, and per cell its scores and gaps to ``none``."""
    ref = next((r for r in results if r.mode == "none" and r.mixer is None), None)
    cells = []
    for r in results:
        d = r.to_dict()
        if ref is not None:
            d["nll_gap"] = r.mean_nll - ref.mean_nll
            d["bpb_gap"] = r.bits_per_byte - ref.bits_per_byte
        cells.append(d)
    return {**run, "cells": cells}
