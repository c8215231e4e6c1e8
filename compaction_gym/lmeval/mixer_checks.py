"""Compliance checks for an eval-time mixer (docs/eval-lm.md, "Compliance of a mixer").

Each check drives the mixer under test through :func:`~compaction_gym.lmeval.mixer.mix_stream`
(the one scoring loop eval-lm and the leaderboard use) and returns its failures as sentences
(empty: compliant):

* :func:`normalisation_failures` — at sampled positions the mixer's probability of **every**
  vocabulary token, asked the way scoring asks for the target's, is ≥ 0 and sums to 1 within
  ``tol`` (1e-6), under a synthetic model distribution (the property must hold for any model);
* :func:`causality_failures` — a position's full distribution does not change when the text from
  that position on is replaced;
* :func:`single_pass_failures` — the recorded mixed NLLs re-derive from one left-to-right pass
  over the recorded model log-probs (each chunk scored with the counts of earlier chunks only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from compaction_gym.lmeval.mixer import StreamMixer, entropy_of, mix_stream

#: a fresh mixer for one pass (the checks run several)
MixerFactory = Callable[[], StreamMixer]


def synthetic_logprobs(vocab_size: int, position: int, seed: int = 0) -> np.ndarray:
    """A model-like log-distribution for ``position``: log-softmax of scaled Gaussian logits
    (float64), a function of the position and seed only — never of the text."""
    rng = np.random.default_rng([seed, position])
    z = rng.standard_normal(vocab_size) * rng.uniform(0.5, 4.0)
    z -= z.max()
    return z - math.log(np.exp(z).sum())


def sample_positions(n: int, k: int, seed: int = 0, first: int = 1) -> list[int]:
    """``k`` distinct positions in ``[first, n)`` (all of them when fewer), sorted; seeded."""
    pool = np.arange(max(1, first), n)
    if len(pool) <= k:
        return pool.tolist()
    return sorted(np.random.default_rng(seed).choice(pool, size=k, replace=False).tolist())


def _uniform_model(n: int, vocab_size: int) -> tuple[list[float], list[float]]:
    """Log-probs and entropies of a uniform model: scoring inputs that cost nothing to make."""
    lp = -math.log(vocab_size)
    return [lp] * n, [math.log(vocab_size)] * n


def _probed(
    make_mixer: MixerFactory, token_ids: Sequence[int], chunk: int, positions: Sequence[int], seed: int
) -> dict[int, np.ndarray]:
    mixer = make_mixer()
    lp, ent = _uniform_model(len(token_ids), mixer.vocab_size)
    probes = {t: synthetic_logprobs(mixer.vocab_size, t, seed) for t in positions}
    _, dists = mix_stream(mixer, token_ids, lp, ent, chunk, probes=probes)
    return dists


def normalisation_failures(
    make_mixer: MixerFactory,
    token_ids: Sequence[int],
    chunk: int,
    positions: Sequence[int],
    *,
    tol: float = 1e-6,
    seed: int = 0,
) -> list[str]:
    """Positions whose full distribution has a negative or non-finite entry or does not sum to one."""
    out = []
    dists = _probed(make_mixer, token_ids, chunk, positions, seed)
    for t in positions:
        d = dists.get(t)
        if d is None:
            out.append(f"normalisation: position {t} was never scored")
            continue
        if not np.all(np.isfinite(d)) or (d < 0).any():
            out.append(f"normalisation: position {t} has negative or non-finite probabilities")
            continue
        total = math.fsum(d.tolist())
        if abs(total - 1.0) > tol:
            out.append(
                f"normalisation: at position {t} the probabilities sum to {total:.9f}, not 1 (±{tol:g})"
            )
    return out


def causality_failures(
    make_mixer: MixerFactory,
    token_ids: Sequence[int],
    chunk: int,
    positions: Sequence[int],
    *,
    seed: int = 0,
    tol: float = 1e-12,
) -> list[str]:
    """Positions whose distribution changes when every token from that position on is replaced
    (by a different token, seeded): the mixer looked ahead."""
    ids = [int(t) for t in token_ids]
    base = _probed(make_mixer, ids, chunk, positions, seed)
    vocab = make_mixer().vocab_size
    rng = np.random.default_rng([seed, 1])
    out = []
    for t in positions:
        shift = rng.integers(1, vocab, size=len(ids) - t)
        altered = ids[:t] + [int((x + s) % vocab) for x, s in zip(ids[t:], shift)]
        d = _probed(make_mixer, altered, chunk, [t], seed).get(t)
        b = base.get(t)
        if d is None or b is None:
            out.append(f"causality: position {t} was never scored")
        elif np.max(np.abs(d - b)) > tol:
            out.append(
                f"causality: the distribution at position {t} changed by {np.max(np.abs(d - b)):.3g} "
                "when the text from it on changed (the mixer looked ahead)"
            )
    return out


def single_pass_failures(
    make_mixer: MixerFactory,
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    entropies: Sequence[float | None],
    chunk: int,
    recorded_nll: Sequence[float | None],
    *,
    rel_tol: float = 1e-9,
) -> list[str]:
    """Recorded mixed NLLs that one left-to-right, score-then-count pass does not reproduce."""
    nll, _ = mix_stream(make_mixer(), token_ids, logprobs, entropies, chunk)
    if len(recorded_nll) != len(nll):
        return [f"single pass: {len(recorded_nll)} recorded NLLs for {len(nll)} tokens"]
    bad = [
        t
        for t, (a, b) in enumerate(zip(nll, recorded_nll))
        if not (math.isnan(a) and b is None)
        and (b is None or not math.isclose(a, float(b), rel_tol=rel_tol, abs_tol=1e-12))
    ]
    if bad:
        return [
            f"single pass: the mixed NLL at {len(bad)} positions (first {bad[:5]}) does not re-derive from "
            "one left-to-right pass that scores each chunk before counting it"
        ]
    return []


def mixer_failures(
    make_mixer: MixerFactory,
    token_ids: Sequence[int],
    chunk: int,
    *,
    n_positions: int = 8,
    seed: int = 0,
    first: int = 1,
) -> list[str]:
    """Normalisation and causality at ``n_positions`` sampled positions (the text's own tokens)."""
    positions = sample_positions(len(token_ids), n_positions, seed, first)
    return normalisation_failures(make_mixer, token_ids, chunk, positions, seed=seed) + causality_failures(
        make_mixer, token_ids, chunk, positions, seed=seed
    )


__all__ = [
    "MixerFactory",
    "causality_failures",
    "entropy_of",
    "mixer_failures",
    "normalisation_failures",
    "sample_positions",
    "single_pass_failures",
    "synthetic_logprobs",
]
