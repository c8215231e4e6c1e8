"""The record of one compaction event: enough to replay it exactly (docs/compaction.md, "Events").

Serialisation: :meth:`CompactionEvent.to_dict` is JSON-safe and carries ``"version"``
(:data:`EVENT_FORMAT_VERSION`; dicts without it are version 1 and still load). The kept indices, an
int tensor ``[L, H_kv, t]``, travel as ``{"shape": [L, H, t], "dtype": "int32", "data": <base64 of
the little-endian C-order bytes>}`` — compact and lossless, never nested lists (cache indices always
fit in int32; larger values are refused rather than truncated). The recorded β (version 2) travels
the same way with ``"dtype": "float32"``.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from compaction_gym.errors import InvalidArgumentError

Trigger = Literal["kv_budget", "turn", "manual"]


_INT32 = torch.iinfo(torch.int32)

#: Version written by :meth:`CompactionEvent.to_dict`: 2 added ``probe_rows`` and ``beta``; 3 added
#: ``probe_tokens`` (``repeat`` probes) and ``refit_values``.
EVENT_FORMAT_VERSION = 3


def encode_int_tensor(t: torch.Tensor) -> dict[str, Any]:
    """Encode an integer tensor as a JSON-safe dict (base64 of int32 little-endian bytes).

    Raises:
        InvalidArgumentError: ``t`` is not an integer tensor or holds values outside int32.
    """
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InvalidArgumentError(
            f"indices must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}"
        )
    t = t.detach().to("cpu")
    if t.numel() and (int(t.min()) < _INT32.min or int(t.max()) > _INT32.max):
        raise InvalidArgumentError("indices must fit in int32 to be serialised")
    arr = t.to(torch.int32).contiguous().numpy().astype("<i4", copy=False)
    return _encoded(arr, "int32")


def decode_int_tensor(d: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`encode_int_tensor`; returns an int64 tensor.

    Raises:
        InvalidArgumentError: not an encoded tensor, an unknown dtype, or data that does not fill ``shape``.
    """
    return torch.from_numpy(_decode(d, "indices", "int32", "<i4").astype(np.int64))


def encode_float_tensor(t: torch.Tensor, name: str = "beta") -> dict[str, Any]:
    """Encode a floating tensor as a JSON-safe dict (base64 of float32 little-endian bytes).

    Raises:
        InvalidArgumentError: ``t`` is not a floating tensor.
    """
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise InvalidArgumentError(f"{name} must be a floating tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    arr = t.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return _encoded(arr, "float32")


def decode_float_tensor(d: dict[str, Any], name: str = "beta") -> torch.Tensor:
    """Inverse of :func:`encode_float_tensor`; returns a float32 tensor.

    Raises:
        InvalidArgumentError: not an encoded tensor, an unknown dtype, or data that does not fill ``shape``.
    """
    return torch.from_numpy(_decode(d, name, "float32", "<f4").astype(np.float32))


def _encoded(arr: np.ndarray, dtype: str) -> dict[str, Any]:
    return {"shape": list(arr.shape), "dtype": dtype, "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def _decode(d: Any, name: str, dtype: str, np_dtype: str) -> np.ndarray:
    """The array of an encoded tensor ``{shape, dtype, data}`` whose ``dtype`` must be ``dtype``."""
    if not isinstance(d, dict) or not {"shape", "dtype", "data"} <= d.keys():
        raise InvalidArgumentError(f"{name} must be an encoded tensor {{shape, dtype, data}}, got {d!r:.80}")
    if d["dtype"] != dtype:
        raise InvalidArgumentError(f"{name}: unsupported encoded dtype {d['dtype']!r}; expected {dtype!r}")
    try:
        raw = base64.b64decode(d["data"], validate=True)
        shape = [int(n) for n in d["shape"]]
        return np.frombuffer(raw, dtype=np_dtype).reshape(shape)
    except (binascii.Error, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{name}: corrupt encoded tensor (shape {d['shape']!r}): {exc}") from exc


@dataclass
class CompactionEvent:
    """One compaction of one session's cache, for all layers and KV heads at once.

    Coordinates: *cache* indices address the slot's KV rows at the time of the event; *logical*
    positions count every token ever fed to the session (prompt, inputs, generated, injected).

    Attributes:
        index: 0-based event number within the session.
        trigger: ``kv_budget``, ``turn`` or ``manual``.
        mode: compaction mode (``attention_matching``, ``markovian``, ``h2o``, ...).
        span: ``(start, end)`` cache rows replaced by the compacted block.
        logical_span: logical positions ``(start, end)`` covered by those rows' tokens — for rows
            that were already compacted by an earlier event, the range they stand for.
        indices: kept cache indices, int64 ``[L, H_kv, t]`` (``t = 0`` for markovian), absolute
            cache indices inside ``span``, ascending per head.
        target: ``t``, kept rows per head.
        probe_source: ``suffix``, ``keys`` or ``random``.
        probe_logical_range: logical positions whose queries (suffix) or keys (keys) were the
            probes; ``None`` for random probes.
        probe_seed: seed of random probes (``None`` otherwise).
        compute_beta: whether β was fitted.
        kv_len_before / kv_len_after: cache rows before and after.
        logical_len: logical tokens in the session when the event fired.
        position_offset: ``logical_len - kv_len_after``: how far logical positions run ahead of
            cache rows after the event (new tokens keep logical positions; nothing is re-rotated).
        timings: seconds spent, by phase.
        probe_rows: cache rows ``(lo, hi)`` whose keys were the probes (``keys`` probes only);
            ``None`` otherwise and in version-1 records.
        beta: the fitted β of the kept rows, float32 ``[L, H_kv, t]``, exactly as the cache
            received it; ``None`` when no β was fitted (and in version-1 records). Replay uses it
            as the constant β instead of refitting (see ``docs/compaction.md``).
        mass_kept: the probes' attention mass the block keeps, relative to the span's
            (:func:`~compaction_gym.compaction.mass.attention_mass_kept`); a diagnostic, ``None``
            when not measured (no probes, older records). Written only when set.
        probe_tokens: the token ids fed in the scratch forward whose queries were the ``repeat``
            probes (at logical positions ``logical_len ..``, over the cache as it stood before the
            event, then discarded); ``None`` for other sources.
        refit_values: ``attention_matching`` refitted C2 (``True``, and every record before version
            3) or kept the selected rows' original values.
    """

    index: int
    trigger: Trigger
    mode: str
    span: tuple[int, int]
    logical_span: tuple[int, int]
    indices: torch.Tensor
    target: int
    probe_source: str
    probe_logical_range: tuple[int, int] | None
    probe_seed: int | None
    compute_beta: bool
    kv_len_before: int
    kv_len_after: int
    logical_len: int
    position_offset: int
    timings: dict[str, float] = field(default_factory=dict)
    probe_rows: tuple[int, int] | None = None
    beta: torch.Tensor | None = None
    mass_kept: float | None = None
    probe_tokens: tuple[int, ...] | None = None
    refit_values: bool = True

    def __getstate__(self) -> dict[str, Any]:
        """The state ``pickle`` and ``torch.save`` write: ``indices`` and ``beta`` that view a larger
        tensor (the events of one stacked call share that call's ``[E, ...]`` buffers, docs/engine.md
        "The copy back lands in place") as copies of their own bytes, so one session's saved events
        do not carry every other session's; the record itself is not changed."""
        state = dict(self.__dict__)
        for name in ("indices", "beta"):
            t = state[name]
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() != t.nbytes:
                state[name] = t.clone(memory_format=torch.contiguous_format)
        return state

    def __post_init__(self) -> None:
        if not isinstance(self.indices, torch.Tensor) or self.indices.dim() != 3:
            shape = (
                tuple(self.indices.shape)
                if isinstance(self.indices, torch.Tensor)
                else type(self.indices).__name__
            )
            raise InvalidArgumentError(f"indices must be an int tensor [L, H_kv, t], got {shape}")
        if self.indices.is_floating_point() or self.indices.dtype == torch.bool:
            raise InvalidArgumentError(f"indices must be an integer tensor, got {self.indices.dtype}")
        if self.indices.shape[-1] != self.target:
            raise InvalidArgumentError(
                f"target ({self.target}) must equal indices' last dim {self.indices.shape[-1]}"
            )
        self.span = (int(self.span[0]), int(self.span[1]))
        self.logical_span = (int(self.logical_span[0]), int(self.logical_span[1]))
        if self.probe_logical_range is not None:
            self.probe_logical_range = (int(self.probe_logical_range[0]), int(self.probe_logical_range[1]))
        if self.probe_rows is not None:
            self.probe_rows = (int(self.probe_rows[0]), int(self.probe_rows[1]))
        if self.probe_tokens is not None:
            self.probe_tokens = tuple(int(t) for t in self.probe_tokens)
        if not isinstance(self.refit_values, bool):
            raise InvalidArgumentError(f"refit_values must be a bool, got {self.refit_values!r}")
        if self.beta is not None:
            if not isinstance(self.beta, torch.Tensor) or not self.beta.is_floating_point():
                raise InvalidArgumentError(
                    f"beta must be a float tensor [L, H_kv, t], got {getattr(self.beta, 'dtype', type(self.beta).__name__)}"
                )
            if tuple(self.beta.shape) != tuple(self.indices.shape):
                raise InvalidArgumentError(
                    f"beta must match indices' shape {tuple(self.indices.shape)}, got {tuple(self.beta.shape)}"
                )
            self.beta = self.beta.detach().to("cpu", torch.float32)
        if self.mass_kept is not None:
            self.mass_kept = float(self.mass_kept)

    def forced_indices(self) -> torch.Tensor:
        """The kept indices as ``compact(forced_indices=...)`` takes them: int64 ``[L * H_kv, t]``."""
        n_layers, n_kv_heads, target = self.indices.shape
        return self.indices.reshape(n_layers * n_kv_heads, target).long()

    def recorded_beta(self) -> torch.Tensor | None:
        """The recorded β as ``compact`` returns it: float32 ``[L * H_kv, t]``, or ``None``."""
        if self.beta is None:
            return None
        n_layers, n_kv_heads, target = self.beta.shape
        return self.beta.reshape(n_layers * n_kv_heads, target)

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> CompactionEvent:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict; ``indices`` and ``beta`` base64-encoded (see the module docstring).

        ``mass_kept`` (optional in every version) is written only when measured."""
        out = {
            "version": EVENT_FORMAT_VERSION,
            "index": self.index,
            "trigger": self.trigger,
            "mode": self.mode,
            "span": list(self.span),
            "logical_span": list(self.logical_span),
            "indices": encode_int_tensor(self.indices),
            "target": self.target,
            "probe_source": self.probe_source,
            "probe_logical_range": None
            if self.probe_logical_range is None
            else list(self.probe_logical_range),
            "probe_seed": self.probe_seed,
            "compute_beta": self.compute_beta,
            "kv_len_before": self.kv_len_before,
            "kv_len_after": self.kv_len_after,
            "logical_len": self.logical_len,
            "position_offset": self.position_offset,
            "timings": dict(self.timings),
            "probe_rows": None if self.probe_rows is None else list(self.probe_rows),
            "beta": None if self.beta is None else encode_float_tensor(self.beta),
            "probe_tokens": None if self.probe_tokens is None else list(self.probe_tokens),
            "refit_values": self.refit_values,
        }
        if self.mass_kept is not None:
            out["mass_kept"] = self.mass_kept
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompactionEvent:
        """Inverse of :meth:`to_dict`.

        Reads every version up to :data:`EVENT_FORMAT_VERSION`; fields a version lacks keep their defaults.

        Raises:
            InvalidArgumentError: a missing field, an unknown version, or a corrupt ``indices``/``beta`` encoding.
        """
        try:
            return cls._from_dict(d)
        except KeyError as exc:
            raise InvalidArgumentError(f"CompactionEvent dict is missing field {exc.args[0]!r}") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> CompactionEvent:
        version = d.get("version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= EVENT_FORMAT_VERSION:
            raise InvalidArgumentError(
                f"version must be an int in [1, {EVENT_FORMAT_VERSION}], got {version!r}"
            )
        range_ = d.get("probe_logical_range")
        seed = d.get("probe_seed")
        rows = d.get("probe_rows")
        beta = d.get("beta")
        tokens = d.get("probe_tokens")
        return cls(
            index=int(d["index"]),
            trigger=d["trigger"],
            mode=d["mode"],
            span=(int(d["span"][0]), int(d["span"][1])),
            logical_span=(int(d["logical_span"][0]), int(d["logical_span"][1])),
            indices=decode_int_tensor(d["indices"]),
            target=int(d["target"]),
            probe_source=d["probe_source"],
            probe_logical_range=None if range_ is None else (int(range_[0]), int(range_[1])),
            probe_seed=None if seed is None else int(seed),
            compute_beta=bool(d["compute_beta"]),
            kv_len_before=int(d["kv_len_before"]),
            kv_len_after=int(d["kv_len_after"]),
            logical_len=int(d["logical_len"]),
            position_offset=int(d["position_offset"]),
            timings={k: float(v) for k, v in d.get("timings", {}).items()},
            probe_rows=None if rows is None else (int(rows[0]), int(rows[1])),
            beta=None if beta is None else decode_float_tensor(beta),
            mass_kept=None if d.get("mass_kept") is None else float(d["mass_kept"]),
            probe_tokens=None if tokens is None else tuple(int(t) for t in tokens),
            refit_values=bool(d.get("refit_values", True)),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompactionEvent):
            return NotImplemented
        a, b = self.to_dict(), other.to_dict()
        return a == b
