"""BackoffNgramMixer: counts against a brute-force reference, normalisation over the vocabulary
(hypothesis), score-first updates, and the compliance checks against deliberately broken mixers."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mixer_variants import LookAheadMixer, TargetKeyedMixer

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.lmeval.mixer import (
    BackoffNgramMixer,
    MixerConfig,
    entropy_of,
    full_distribution,
    mix_stream,
    mixing_weight,
)
from compaction_gym.lmeval.mixer_checks import (
    causality_failures,
    mixer_failures,
    normalisation_failures,
    sample_positions,
    single_pass_failures,
    synthetic_logprobs,
)

BIG = 1 << 40  # buckets: no collisions in these short texts


def text(n: int, vocab: int, seed: int) -> list[int]:
    """A repetitive token stream (a small Markov chain) so that n-grams recur."""
    rng = np.random.default_rng(seed)
    out = [0]
    for _ in range(n - 1):
        out.append(int((out[-1] * 3 + rng.integers(0, 3)) % vocab))
    return out


def brute_ngram(ids: list[int], t: int, seen: int, cfg: MixerConfig) -> tuple[float, dict[int, float]]:
    """Reference p_ngram at ``t`` from the n-grams ending before ``seen`` (no hashing): the highest
    order whose context occurred at least ``min_count`` times, its next-token frequencies."""
    for order in range(cfg.max_order, 1, -1):
        if t < order - 1:
            continue
        ctx = tuple(ids[t - order + 1 : t])
        nxt = Counter(ids[s] for s in range(order - 1, seen) if tuple(ids[s - order + 1 : s]) == ctx)
        total = sum(nxt.values())
        if total >= cfg.min_count:
            return 1.0, {v: c / total for v, c in nxt.items()}
    return 0.0, {}


def test_alpha_formula_by_hand():
    cfg = MixerConfig(alpha_base=0.1, alpha_scale=0.5, alpha_slope=2.0, entropy_center=3.0)
    assert mixing_weight(cfg, 3.0) == pytest.approx(0.1 + 0.5 * 0.5)
    assert mixing_weight(cfg, 4.0) == pytest.approx(0.1 + 0.5 / (1 + math.exp(-2.0)))
    assert mixing_weight(cfg, -1e6) == pytest.approx(0.1) and mixing_weight(cfg, 1e6) == pytest.approx(0.6)


def test_mixed_nll_equals_brute_force_score_first():
    cfg = MixerConfig(max_order=4, buckets=BIG, min_count=2)
    vocab, chunk = 7, 5
    ids = text(60, vocab, 0)
    lps = [synthetic_logprobs(vocab, t, 3) for t in range(len(ids))]
    lp = [None] + [float(lps[t][ids[t]]) for t in range(1, len(ids))]
    ent = [None] + [entropy_of(lps[t]) for t in range(1, len(ids))]
    nll, _ = mix_stream(BackoffNgramMixer(cfg, vocab), ids, lp, ent, chunk)
    used = 0
    for t in range(1, len(ids)):
        seen = (t // chunk) * chunk  # counts of whole chunks before t's chunk only
        avail, p_ng = brute_ngram(ids, t, seen, cfg)
        used += avail > 0
        alpha = mixing_weight(cfg, ent[t]) * avail
        ref = -math.log((1 - alpha) * math.exp(lp[t]) + alpha * p_ng.get(ids[t], 0.0))
        assert nll[t] == pytest.approx(ref, rel=1e-12, abs=1e-12), t
    assert math.isnan(nll[0]) and used > 20  # the n-gram side was exercised


@settings(max_examples=40, deadline=None)
@given(
    vocab=st.integers(2, 40),
    n=st.integers(2, 80),
    seed=st.integers(0, 10_000),
    max_order=st.integers(2, 6),
    buckets=st.sampled_from([1, 3, 17, BIG]),
    min_count=st.integers(1, 4),
    a=st.floats(0, 0.5),
    b=st.floats(0, 0.5),
    c=st.floats(-5, 5),
    h0=st.floats(0, 6),
    chunk=st.integers(1, 16),
)
def test_distribution_sums_to_one(vocab, n, seed, max_order, buckets, min_count, a, b, c, h0, chunk):
    """Any counts (random text, hash collisions included), any context and model distribution:
    the mixed distribution is non-negative, sums to one, and scoring asks it for the target's mass."""
    cfg = MixerConfig(max_order, buckets, min_count, a, b, c, h0)
    ids = np.random.default_rng(seed).integers(0, vocab, size=n).tolist()
    positions = list(range(1, n))
    probes = {t: synthetic_logprobs(vocab, t, seed) for t in positions}
    lp = [None] + [float(probes[t][ids[t]]) for t in positions]
    ent = [None] + [entropy_of(probes[t]) for t in positions]
    nll, dists = mix_stream(BackoffNgramMixer(cfg, vocab), ids, lp, ent, chunk, probes=probes)
    for t in positions:
        d = dists[t]
        assert (d >= 0).all() and abs(math.fsum(d.tolist()) - 1) < 1e-12
        assert nll[t] == pytest.approx(-math.log(d[ids[t]]), rel=1e-12)


def test_updates_only_after_a_chunk_is_scored_and_in_one_pass():
    cfg = MixerConfig(max_order=2, buckets=BIG, min_count=1)
    m = BackoffNgramMixer(cfg, 5)
    ids = [1, 2, 1, 2, 1, 2]
    lp = np.log(np.full(5, 0.2))
    assert full_distribution(m, [1], lp, 1.0).tolist() == pytest.approx([0.2] * 5)  # nothing counted
    m.update(ids, 0, 2)  # the n-gram (1 -> 2) ending at position 1
    d = full_distribution(m, [1], lp, 1.0)
    alpha = mixing_weight(cfg, 1.0)
    assert d[2] == pytest.approx((1 - alpha) * 0.2 + alpha) and d[1] == pytest.approx((1 - alpha) * 0.2)
    with pytest.raises(InvalidArgumentError, match="continue from 2"):
        m.update(ids, 3, 5)  # skipping ahead
    with pytest.raises(InvalidArgumentError, match="continue from 2"):
        m.update(ids, 0, 2)  # counting twice


def test_config_errors_name_the_field():
    for bad, field in (
        ({"max_order": 1}, "max_order"),
        ({"buckets": 0}, "buckets"),
        ({"min_count": 0}, "min_count"),
        ({"alpha_base": 0.6, "alpha_scale": 0.6}, "alpha_base"),
        ({"nope": 1}, "nope"),
    ):
        with pytest.raises(InvalidArgumentError, match=field):
            MixerConfig.from_dict(bad)


CFG = MixerConfig(max_order=4, buckets=1 << 12, min_count=2)
VOCAB, CHUNK = 50, 16


def test_compliance_passes_the_correct_mixer():
    ids = text(300, VOCAB, 1)
    assert mixer_failures(lambda: BackoffNgramMixer(CFG, VOCAB), ids, CHUNK, n_positions=10) == []


def test_normalisation_flags_the_target_keyed_mixer():
    ids = text(300, VOCAB, 1)
    fails = normalisation_failures(
        lambda: TargetKeyedMixer(CFG, VOCAB), ids, CHUNK, sample_positions(300, 10)
    )
    assert fails and all("sum to" in f for f in fails)
    assert mixer_failures(lambda: TargetKeyedMixer(CFG, VOCAB), ids, CHUNK, n_positions=10)


def test_causality_catches_a_look_ahead():
    ids = text(300, VOCAB, 2)
    positions = sample_positions(300, 10, first=CHUNK)
    make = lambda: LookAheadMixer(CFG, VOCAB, peek=CHUNK)  # noqa: E731
    assert normalisation_failures(make, ids, CHUNK, positions) == []  # it is normalised ...
    fails = causality_failures(make, ids, CHUNK, positions)
    assert fails and all("looked ahead" in f for f in fails)  # ... but it peeks at the next chunk
    assert causality_failures(lambda: BackoffNgramMixer(CFG, VOCAB), ids, CHUNK, positions) == []


def test_single_pass_flags_counts_taken_before_scoring():
    """NLLs from a two-pass eval (all counts first, then scoring) do not re-derive."""
    ids = text(200, VOCAB, 3)
    lps = {t: synthetic_logprobs(VOCAB, t) for t in range(200)}
    lp = [None] + [float(lps[t][ids[t]]) for t in range(1, 200)]
    ent = [None] + [entropy_of(lps[t]) for t in range(1, 200)]
    honest, _ = mix_stream(BackoffNgramMixer(CFG, VOCAB), ids, lp, ent, CHUNK)
    rec = [None if math.isnan(x) else x for x in honest]
    make = lambda: BackoffNgramMixer(CFG, VOCAB)  # noqa: E731
    assert single_pass_failures(make, ids, lp, ent, CHUNK, rec) == []
    primed = BackoffNgramMixer(CFG, VOCAB)
    primed.update(ids, 0, len(ids))
    primed.updated_to = 0
    two_pass = []
    for t in range(len(ids)):
        if lp[t] is None:
            two_pass.append(None)
            continue
        p = primed.target_probs(ids[max(0, t - 3) : t], np.array([ids[t]]), np.array([lp[t]]), ent[t])[0]
        two_pass.append(-math.log(p))
    assert sum(two_pass[1:]) < sum(rec[1:])  # peeking helps, which is why it is not allowed
    fails = single_pass_failures(make, ids, lp, ent, CHUNK, two_pass)
    assert fails and "one left-to-right pass" in fails[0]
