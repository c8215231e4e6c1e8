"""Probe queries of a compaction event, for the engine and replay alike (``docs/compaction.md``).

GQA grouping of recorded queries (``suffix``), the cache rows whose keys are the probes
(``keys``) and reproducible N(0, I) probes (``random``); :func:`event_probes` assembles any of them.
"""

from __future__ import annotations

import numpy as np
import torch

from compaction_gym.compaction import _checks as C
from compaction_gym.compaction.modes import PROBE_SOURCES, REPEAT_SOURCES, SUFFIX_SOURCES
from compaction_gym.compaction.rowmap import RowMap
from compaction_gym.errors import InvalidArgumentError


def gqa_probes(queries: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Group per-query-head probes by the KV head they attend through.

    Query head ``h_q`` reads KV head ``h_q // G`` (``G = H_q / H_kv``, as Hugging Face's
    ``repeat_kv``), so a KV head's probes are its ``G`` query heads' queries concatenated.

    Args:
        queries: ``[L, H_q, n, d]`` (layers, query heads, positions, head dim).
        n_kv_heads: ``H_kv``, dividing ``H_q``.

    Returns:
        ``[L * H_kv, G * n, d]``; row ``l * H_kv + h`` holds query heads ``h*G .. h*G+G-1`` in order.

    Raises:
        InvalidArgumentError: ``queries`` not 4-D or ``n_kv_heads`` not dividing ``H_q``.

    Example:
        >>> gqa_probes(torch.randn(2, 8, 5, 16), 2).shape
        torch.Size([4, 20, 16])
    """
    queries = C.check_tensor(queries, "queries", 4, "[L, H_q, n, d]")
    n_kv_heads = C.as_int(n_kv_heads, "n_kv_heads")
    layers, heads, n, d = queries.shape
    if n_kv_heads <= 0 or heads % n_kv_heads:
        raise InvalidArgumentError(f"n_kv_heads must be a positive divisor of H_q={heads}, got {n_kv_heads}")
    group = heads // n_kv_heads
    return queries.reshape(layers * n_kv_heads, group * n, d)


def layer_seed(seed: int, event_index: int, layer: int) -> int:
    """A well-mixed 63-bit generator seed for one (session seed, event, layer) triple."""
    state = np.random.SeedSequence([seed, event_index, layer]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def random_probes(
    seed: int,
    event_index: int,
    n_layers: int,
    n_kv_heads: int,
    n: int,
    d: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """N(0, I) probe queries that replay can regenerate exactly.

    Layer ``l``'s probes ``[H_kv, n, d]`` come from a CPU ``torch.Generator`` seeded from
    ``(seed, event_index, l)``, drawn in float32 and then cast to ``dtype`` and moved to
    ``device``, so the same call gives the same probes on every device and precision.

    Args:
        seed: session seed, ``≥ 0``.
        event_index: the compaction event's index in the session, ``≥ 0``.
        n_layers, n_kv_heads: cache layout; the result has ``n_layers * n_kv_heads`` rows.
        n: probes per KV head. d: head dim.
        dtype: result dtype (floating). device: result device.

    Returns:
        ``[n_layers * n_kv_heads, n, d]``.

    Raises:
        InvalidArgumentError: a negative seed or event index, a non-positive size, a non-float dtype.

    Example:
        >>> p = random_probes(0, 3, n_layers=2, n_kv_heads=2, n=8, d=16)
        >>> bool((p == random_probes(0, 3, 2, 2, 8, 16)).all()), p.shape
        (True, torch.Size([4, 8, 16]))
    """
    seed, event_index = C.as_int(seed, "seed"), C.as_int(event_index, "event_index")
    for name, value in (("seed", seed), ("event_index", event_index)):
        if value < 0:
            raise InvalidArgumentError(f"{name} must be >= 0, got {value}")
    sizes = {
        name: C.as_int(v, name)
        for name, v in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("n", n), ("d", d))
    }
    for name, value in sizes.items():
        if value <= 0:
            raise InvalidArgumentError(f"{name} must be positive, got {value}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgumentError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    layers = []
    for layer in range(sizes["n_layers"]):
        generator = torch.Generator(device="cpu").manual_seed(layer_seed(seed, event_index, layer))
        layers.append(torch.randn(sizes["n_kv_heads"], sizes["n"], sizes["d"], generator=generator))
    return torch.cat(layers).to(device=device, dtype=dtype)


def key_probe_rows(
    row_map: RowMap, kv_len: int, n_probe: int, last_response: tuple[int, int] | None
) -> tuple[int, int]:
    """Cache rows ``(lo, hi)`` whose keys are an event's ``keys`` probes (the engine's choice).

    The newest contiguous run of the latest response's raw rows (its last ``n_probe`` logical
    tokens at most); without a response, or when none of it is raw, the newest ``n_probe`` rows.
    The event records the result (``CompactionEvent.probe_rows``) so replay never re-derives it.
    """
    if last_response is not None:
        a, b = last_response
        rows = [row_map.row_of(p) for p in range(max(a, b - n_probe), b)]
        run: list[int] = []
        for row in reversed(rows):
            if row is None or (run and row != run[-1] - 1):
                if run:
                    break
                continue
            run.append(row)
        if run:
            return run[-1], run[0] + 1
    return max(0, kv_len - n_probe), kv_len


def key_probe_rows_of_range(
    row_map: RowMap, kv_len: int, n_probe: int, logical_range: tuple[int, int]
) -> tuple[int, int]:
    """The ``keys`` probe rows of a record without ``probe_rows`` (version 1), from its logical range.

    Either the range's tokens are raw and contiguous in the cache, or they were the engine's
    fallback (the newest ``n_probe`` rows).

    Raises:
        InvalidArgumentError: neither reading reproduces ``logical_range``.
    """
    a, b = logical_range
    lo, last = row_map.row_of(a), row_map.row_of(b - 1)
    if lo is not None and last is not None and last - lo == b - 1 - a:
        return lo, last + 1
    lo = max(0, kv_len - n_probe)
    if kv_len <= lo or row_map.logical_span(lo, kv_len) != (a, b):
        raise InvalidArgumentError(f"cannot locate the key probes of logical range [{a}, {b}) in the cache")
    return lo, kv_len


def event_probes(
    source: str,
    keys: torch.Tensor,
    *,
    n_layers: int,
    n_kv_heads: int,
    n_probe: int,
    event_index: int,
    seed: int | None = None,
    rows: tuple[int, int] | None = None,
    queries: torch.Tensor | None = None,
    repeat_queries: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One event's probe queries ``[L * H_kv, n, d]``.

    Args:
        source: ``suffix`` (``queries`` grouped by :func:`gqa_probes`; ``None`` when no queries
            were recorded), ``keys`` (``keys[:, lo:hi]`` for ``rows``) or ``random``
            (:func:`random_probes` of ``seed`` and ``event_index``, in ``keys``' dtype and device).
        keys: the cache keys ``[L * H_kv, T, d]``.
        n_layers, n_kv_heads: cache layout. n_probe: random probes per KV head.
        event_index: the event's index in its session.
        seed: the session seed (``random``).
        rows: cache rows ``(lo, hi)`` of the key probes (``keys``).
        queries: post-RoPE queries ``[L, H_q, n, d]`` (``suffix``, ``suffix+repeat``).
        repeat_queries: post-RoPE queries ``[L, H_q, m, d]`` of the event's ``probe_tokens``
            (``repeat``, ``suffix+repeat``: appended after the suffix probes).

    Raises:
        InvalidArgumentError: an unknown source, or the input that source needs is missing.
    """
    if source == "random":
        if seed is None:
            raise InvalidArgumentError(f"event {event_index}: random probes need probe_seed")
        return random_probes(
            seed, event_index, n_layers, n_kv_heads, n_probe, keys.shape[-1], dtype=keys.dtype, device=keys.device
        )
    if source == "keys":
        if rows is None:
            raise InvalidArgumentError(f"event {event_index}: keys probes need their cache rows")
        lo, hi = rows
        if not 0 <= lo < hi <= keys.shape[1]:
            raise InvalidArgumentError(f"event {event_index}: probe_rows {rows} outside the cache's {keys.shape[1]} rows")
        return keys[:, lo:hi]
    if source not in PROBE_SOURCES:
        raise InvalidArgumentError(f"probe_source must be one of {PROBE_SOURCES}, got {source!r}")
    parts = []
    if source in SUFFIX_SOURCES and queries is not None:
        parts.append(gqa_probes(queries.contiguous(), n_kv_heads))
    if source in REPEAT_SOURCES:
        if repeat_queries is None:
            raise InvalidArgumentError(f"event {event_index}: {source} probes need the queries of their probe_tokens")
        parts.append(gqa_probes(repeat_queries.contiguous().to(keys.dtype), n_kv_heads))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
