"""An eval-time n-gram mixer whose distribution is a distribution (docs/eval-lm.md, "N-gram mixer").

:class:`BackoffNgramMixer` keeps hashed count tables for orders ``2..N`` (a context of ``k − 1``
tokens hashes to one of ``buckets`` buckets per order; each bucket counts the tokens that followed
it). For a position it backs off from the highest order to the first whose context bucket has
seen at least ``min_count`` tokens and takes that bucket's counts, normalised over the **whole
vocabulary** (``p_ngram(v) = count(v) / total``), so ``Σ_v p_ngram(v) = 1`` whatever the hash
collisions. The weight depends on the context only, through the model's entropy ``H`` (nats):
``α = a + b · σ(c · (H − h0))``, and ``p = (1 − α) · p_model + α · p_ngram``. No order
qualifying: ``α = 0``. Counts are updated only after a chunk is scored (:func:`mix_stream`).

The rejected parameter-golf mixer (docs/eval-lm.md) chose the order per *target* (hashing the
target into the lookup key), so its probabilities did not sum to one; the compliance checks of
:mod:`compaction_gym.lmeval.mixer_checks` catch that.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

import numpy as np

from compaction_gym.errors import InvalidArgumentError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class MixerConfig:
    """Parameters of :class:`BackoffNgramMixer`.

    Attributes:
        max_order: the highest n-gram order ``N`` (orders ``2..N``: contexts of 1..N−1 tokens).
        buckets: hash buckets per order.
        min_count: a context bucket is used once it has counted this many tokens.
        alpha_base, alpha_scale, alpha_slope, entropy_center: ``α = a + b · σ(c · (H − h0))``.
    """

    max_order: int = 6
    buckets: int = 1 << 22
    min_count: int = 2
    alpha_base: float = 0.05
    alpha_scale: float = 0.55
    alpha_slope: float = 2.0
    entropy_center: float = 3.0

    def __post_init__(self) -> None:
        if self.max_order < 2:
            raise InvalidArgumentError(f"mixer.max_order must be >= 2, got {self.max_order}")
        if self.buckets < 1:
            raise InvalidArgumentError(f"mixer.buckets must be >= 1, got {self.buckets}")
        if self.min_count < 1:
            raise InvalidArgumentError(f"mixer.min_count must be >= 1, got {self.min_count}")
        if not (self.alpha_base >= 0 and self.alpha_scale >= 0 and self.alpha_base + self.alpha_scale <= 1):
            raise InvalidArgumentError(
                "mixer.alpha_base and mixer.alpha_scale must be >= 0 with alpha_base + alpha_scale <= 1, "
                f"got {self.alpha_base} and {self.alpha_scale}"
            )
        for name in ("alpha_slope", "entropy_center"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidArgumentError(f"mixer.{name} must be finite")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> MixerConfig:
        """From a dict of fields (unknown keys refused, naming them)."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidArgumentError(f"mixer: unknown keys {unknown}; valid keys: {sorted(known)}")
        return cls(**d)


class StreamMixer(Protocol):
    """What :func:`mix_stream` drives: probabilities of candidate targets given the text so far, and
    count updates over a contiguous range of the text once it has been scored."""

    vocab_size: int
    context_len: int

    def target_probs(
        self, context: Sequence[int], targets: np.ndarray, model_logprobs: np.ndarray, entropy: float
    ) -> np.ndarray: ...

    def update(self, token_ids: Sequence[int], start: int, end: int) -> None: ...


def context_bucket(order: int, context: Sequence[int], buckets: int) -> int:
    """The bucket of a ``order − 1``-token context (FNV-1a-style 64-bit mix, deterministic)."""
    h = (0xCBF29CE484222325 ^ order) & _MASK64
    for t in context:
        h = ((h ^ (int(t) + 1)) * 0x100000001B3) & _MASK64
    return h % buckets


def mixing_weight(config: MixerConfig, entropy: float) -> float:
    """``α = a + b · σ(c · (H − h0))`` (numerically stable sigmoid)."""
    z = config.alpha_slope * (float(entropy) - config.entropy_center)
    sig = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
    return config.alpha_base + config.alpha_scale * sig


class BackoffNgramMixer:
    """Hashed n-gram counts with cascade backoff, mixed with the model (module docstring)."""

    def __init__(self, config: MixerConfig, vocab_size: int) -> None:
        if vocab_size < 1:
            raise InvalidArgumentError(f"vocab_size must be >= 1, got {vocab_size}")
        self.config = config
        self.vocab_size = int(vocab_size)
        self.context_len = config.max_order - 1
        # per order k (index k - 2): bucket -> {next token: count}, and bucket -> total
        self._counts: list[dict[int, dict[int, int]]] = [
            defaultdict(dict) for _ in range(config.max_order - 1)
        ]
        self._totals: list[dict[int, int]] = [defaultdict(int) for _ in range(config.max_order - 1)]
        self.updated_to = 0

    def lookup(self, context: Sequence[int]) -> tuple[int, dict[int, int], int] | None:
        """``(order, counts, total)`` of the highest order whose context bucket has counted at least
        ``min_count`` tokens, or ``None``. Depends on the context only, never on a target."""
        for order in range(self.config.max_order, 1, -1):
            if len(context) < order - 1:
                continue
            ctx = context[len(context) - (order - 1) :]
            b = context_bucket(order, ctx, self.config.buckets)
            total = self._totals[order - 2].get(b, 0)
            if total >= self.config.min_count:
                return order, self._counts[order - 2][b], total
        return None

    def ngram_probs(self, context: Sequence[int], targets: np.ndarray) -> tuple[float, np.ndarray]:
        """``(weight available, p_ngram(targets))``: weight 0 and zeros when no order qualifies."""
        found = self.lookup(context)
        targets = np.asarray(targets, dtype=np.int64)
        if found is None:
            return 0.0, np.zeros(len(targets))
        _, counts, total = found
        return 1.0, np.array([counts.get(int(t), 0) for t in targets], dtype=np.float64) / total

    def target_probs(
        self, context: Sequence[int], targets: np.ndarray, model_logprobs: np.ndarray, entropy: float
    ) -> np.ndarray:
        """Mixed probabilities ``(1 − α) p_model + α p_ngram`` of ``targets`` (float64), given the
        model's log-probs of those targets and its entropy at this position."""
        available, p_ng = self.ngram_probs(context, targets)
        alpha = mixing_weight(self.config, entropy) * available
        return (1.0 - alpha) * np.exp(np.asarray(model_logprobs, dtype=np.float64)) + alpha * p_ng

    def update(self, token_ids: Sequence[int], start: int, end: int) -> None:
        """Count the n-grams whose last token lies in ``[start, end)`` (contexts from earlier text).

        Raises:
            InvalidArgumentError: ``start`` is not where the previous update ended (one pass, in order).
        """
        if start != self.updated_to or end < start or end > len(token_ids):
            raise InvalidArgumentError(
                f"update: range [{start}, {end}) must continue from {self.updated_to} inside the text"
            )
        for t in range(start, end):
            target = int(token_ids[t])
            for order in range(2, self.config.max_order + 1):
                if t < order - 1:
                    break
                b = context_bucket(order, token_ids[t - order + 1 : t], self.config.buckets)
                row = self._counts[order - 2][b]
                row[target] = row.get(target, 0) + 1
                self._totals[order - 2][b] += 1
        self.updated_to = end


def entropy_of(logprobs: np.ndarray) -> float:
    """``−Σ_v p_v log p_v`` (nats) of a log-probability vector, float64."""
    lp = np.asarray(logprobs, dtype=np.float64)
    p = np.exp(lp)
    return float(-(p * np.where(p > 0, lp, 0.0)).sum())


def full_distribution(
    mixer: StreamMixer, context: Sequence[int], model_logprobs: np.ndarray, entropy: float
) -> np.ndarray:
    """The mixer's probability of every vocabulary token at one position (what must sum to one)."""
    targets = np.arange(mixer.vocab_size)
    return mixer.target_probs(context, targets, model_logprobs, entropy)


def mix_stream(
    mixer: StreamMixer,
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    entropies: Sequence[float | None],
    chunk: int,
    *,
    probes: dict[int, np.ndarray] | None = None,
) -> tuple[list[float], dict[int, np.ndarray]]:
    """One left-to-right pass: score each chunk with the counts of the chunks before it, then count it.

    Args:
        logprobs, entropies: the model's log-prob of each token and its distribution's entropy
            (``None`` where unscored: position 0).
        chunk: tokens per chunk (eval-lm's ``--chunk``: the counts advance as the cache does).
        probes: ``{position: model log-probs over the vocabulary}``; at those positions the
            mixer's full distribution under that model distribution (and its entropy) is also
            returned (the compliance checks use it).

    Returns:
        Per position the mixed NLL (nats; NaN where unscored), and the probed distributions.
    """
    n = len(token_ids)
    if not len(logprobs) == len(entropies) == n:
        raise InvalidArgumentError("logprobs and entropies need one entry per token")
    if chunk < 1:
        raise InvalidArgumentError(f"chunk must be >= 1, got {chunk}")
    nll = [math.nan] * n
    seen: dict[int, np.ndarray] = {}
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        for t in range(start, end):
            lp, h = logprobs[t], entropies[t]
            if lp is None or h is None or (isinstance(lp, float) and math.isnan(lp)):
                continue
            context = token_ids[max(0, t - mixer.context_len) : t]
            p = mixer.target_probs(context, np.array([token_ids[t]]), np.array([lp]), float(h))[0]
            nll[t] = -math.log(p) if p > 0 else math.inf
            if probes is not None and t in probes:
                seen[t] = full_distribution(mixer, context, probes[t], entropy_of(probes[t]))
        mixer.update(token_ids, start, end)
    return nll, seen


#: mixers by the name a suite or record gives (``[mixer] name``); each is built as ``cls(config, vocab_size)``
MIXERS: dict[str, Callable[[MixerConfig, int], StreamMixer]] = {"backoff": BackoffNgramMixer}
