"""gqa_probes and random_probes."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from compaction_gym.compaction import RowMap, event_probes, gqa_probes, key_probe_rows, random_probes
from compaction_gym.compaction.probes import key_probe_rows_of_range
from compaction_gym.errors import InvalidArgumentError


@pytest.mark.parametrize(("h_q", "h_kv"), [(8, 2), (4, 4), (6, 1), (16, 8)])
def test_gqa_probes_matches_loop(h_q, h_kv):
    layers, n, d = 3, 5, 8
    q = torch.randn(layers, h_q, n, d)
    got = gqa_probes(q, h_kv)
    group = h_q // h_kv
    assert got.shape == (layers * h_kv, group * n, d)
    for layer in range(layers):
        for kv in range(h_kv):
            # HF repeat_kv: query head h reads KV head h // group
            heads = [h for h in range(h_q) if h // group == kv]
            want = torch.cat([q[layer, h] for h in heads], dim=0)
            assert torch.equal(got[layer * h_kv + kv], want)


def test_gqa_probes_accepts_non_contiguous_input():
    q = torch.randn(2, 5, 8, 4).transpose(1, 2)  # [L=2, H_q=8, n=5, d=4], non-contiguous
    assert torch.equal(gqa_probes(q, 2), gqa_probes(q.contiguous(), 2))


def test_random_probes_reproducible_and_distinct():
    a = random_probes(7, 3, 4, 2, 16, 8, dtype=torch.float32, device="cpu")
    assert a.shape == (8, 16, 8) and a.dtype == torch.float32
    assert torch.equal(a, random_probes(7, 3, 4, 2, 16, 8, dtype=torch.float32, device="cpu"))
    assert not torch.equal(a, random_probes(7, 4, 4, 2, 16, 8, dtype=torch.float32, device="cpu"))
    assert not torch.equal(a, random_probes(8, 3, 4, 2, 16, 8, dtype=torch.float32, device="cpu"))
    layers = a.reshape(4, 2, 16, 8)
    assert not torch.equal(layers[0], layers[1])  # each layer has its own stream
    # a layer's probes do not depend on how many layers are drawn
    assert torch.equal(random_probes(7, 3, 2, 2, 16, 8, dtype=torch.float32, device="cpu"), a[:4])


def test_random_probes_standard_normal_and_dtype_cast():
    p = random_probes(0, 0, 2, 4, 512, 64, dtype=torch.float32, device="cpu")
    assert abs(float(p.mean())) < 0.02 and abs(float(p.std()) - 1) < 0.02
    p64 = random_probes(0, 0, 2, 4, 512, 64, dtype=torch.float64, device="cpu")
    bf = random_probes(0, 0, 2, 4, 512, 64, dtype=torch.bfloat16, device="cpu")
    assert p64.dtype == torch.float64 and torch.equal(p64, p.double())  # drawn in float32, then cast
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, p.bfloat16())


# ------------------------------------------------------------------ key probe rows and event_probes
@st.composite
def _histories(draw):
    """A row map built by appends and compactions, mirrored by a plain list: row -> logical or None."""
    rm, rows, fed = RowMap(), [], 0
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, 12))
        rm.append(fed, n)
        rows.extend(range(fed, fed + n))
        fed += n
        if draw(st.booleans()) and len(rows) >= 2:
            start = draw(st.integers(0, len(rows) - 2))
            end = draw(st.integers(start + 1, len(rows)))
            size = draw(st.integers(0, end - start))
            rm.replace(start, end, size, rm.logical_span(start, end))
            rows[start:end] = [None] * size
    n = draw(st.integers(1, 6))  # the newest tokens are raw (an event never sees an empty cache)
    rm.append(fed, n)
    rows.extend(range(fed, fed + n))
    fed += n
    a = draw(st.integers(0, fed - 1))
    b = draw(st.integers(a + 1, fed))
    response = draw(st.sampled_from([None, (a, b)]))
    return rm, rows, response, draw(st.integers(1, 10))


@settings(max_examples=200, deadline=None)
@given(_histories())
def test_key_probe_rows_matches_brute_force(history):
    rm, rows, response, n = history
    assert rm.rows == len(rows)
    want = None
    if response is not None:
        a, b = response
        run: list[int] = []
        for p in range(b - 1, max(a, b - n) - 1, -1):  # newest first
            row = rows.index(p) if p in rows else None
            if row is None or (run and row != run[-1] - 1):
                if run:
                    break
                continue
            run.append(row)
        if run:
            want = (run[-1], run[0] + 1)
    if want is None:
        want = (max(0, len(rows) - n), len(rows))
    got = key_probe_rows(rm, len(rows), n, response)
    assert got == want
    # a version-1 record keeps only the logical range: the rows are recovered from it
    assert key_probe_rows_of_range(rm, len(rows), n, rm.logical_span(*got)) == got


def test_event_probes_per_source():
    keys = torch.randn(6, 20, 8)
    kw = dict(n_layers=2, n_kv_heads=3, n_probe=5, event_index=4)
    assert torch.equal(event_probes("keys", keys, rows=(3, 9), **kw), keys[:, 3:9])
    assert torch.equal(event_probes("random", keys, seed=7, **kw), random_probes(7, 4, 2, 3, 5, 8))
    q = torch.randn(2, 6, 4, 8)
    assert torch.equal(event_probes("suffix", keys, queries=q, **kw), gqa_probes(q, 3))
    assert event_probes("suffix", keys, **kw) is None
    with pytest.raises(InvalidArgumentError, match="probe_seed"):
        event_probes("random", keys, **kw)
    with pytest.raises(InvalidArgumentError, match="rows"):
        event_probes("keys", keys, **kw)
    with pytest.raises(InvalidArgumentError, match="probe_rows"):
        event_probes("keys", keys, rows=(10, 30), **kw)
    with pytest.raises(InvalidArgumentError, match="probe_source"):
        event_probes("recent", keys, **kw)
