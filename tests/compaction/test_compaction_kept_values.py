"""Attention Matching with kept values (``refit_values=False``): β only where it helps (docs/compaction.md).

References: a float64 brute-force attention output per probe, and a cache whose span holds every
key twice, where ``β = log 2`` on one copy of each reproduces attention exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from compaction_gym.compaction import compact


def brute_error(k, v, q, span, idx, bias, key_bias=None) -> float:
    """Mean over probes of ``|o_compacted - o_full|²`` for one row, written plainly (float64)."""
    s, e = span
    kb = torch.zeros(k.shape[0], dtype=torch.float64) if key_bias is None else key_bias.double()
    total = 0.0
    scale = k.shape[1] ** -0.5
    for qi in q.double():
        full = torch.softmax(scale * (k.double() @ qi) + kb, 0) @ v.double()
        rows = list(range(s)) + [None] * len(idx) + list(range(e, k.shape[0]))
        logits, vals = [], []
        for j, r in enumerate(rows):
            if r is None:
                kept = int(idx[j - s])
                logits.append(scale * float(k[kept].double() @ qi) + float(bias[j - s]))
                vals.append(v[kept].double())
            else:
                logits.append(scale * float(k[r].double() @ qi) + float(kb[r]))
                vals.append(v[r].double())
        out = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0) @ torch.stack(vals)
        total += float(((out - full) ** 2).sum())
    return total / q.shape[0]


@pytest.mark.parametrize("seed", range(4))
def test_beta_is_kept_only_where_it_lowers_the_error(seed):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 6, 40, 8, generator=g, dtype=torch.float64)
    k[3:, 10:30] *= 3  # some rows peaked, where β tends to help
    q = torch.randn(6, 24, 8, generator=g, dtype=torch.float64)
    key_bias = torch.zeros(6, 40, dtype=torch.float64)
    key_bias[::2, 10:20] = torch.randn(3, 10, generator=g, dtype=torch.float64)
    span, t = (10, 30), 5
    kept = compact(k, v, q, span, t, compute_beta=True, refit_values=False, key_bias=key_bias)
    fitted = compact(k, v, q, span, t, compute_beta=True, key_bias=key_bias)  # same selection and β fit
    assert torch.equal(kept.indices, fitted.indices)
    for b in range(6):
        old = key_bias[b, kept.indices[b]]
        with_beta = brute_error(k[b], v[b], q[b], span, kept.indices[b], fitted.beta[b], key_bias[b])
        without = brute_error(k[b], v[b], q[b], span, kept.indices[b], old, key_bias[b])
        expected = fitted.beta[b] if with_beta < without else old
        torch.testing.assert_close(kept.beta[b], expected)
        got = brute_error(k[b], v[b], q[b], span, kept.indices[b], kept.beta[b], key_bias[b])
        assert got <= without + 1e-12  # never worse than no β on the probes


def test_beta_is_kept_where_it_is_exact():
    """Every span key twice (same value): keeping one copy with β = log 2 reproduces attention."""
    g = torch.Generator().manual_seed(0)
    base_k, base_v = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    prefix_k, prefix_v = torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64)
    k = torch.cat([prefix_k, base_k.repeat_interleave(2, dim=1)], dim=1)  # span rows 6..13: pairs
    v = torch.cat([prefix_v, base_v.repeat_interleave(2, dim=1)], dim=1)
    q = torch.randn(3, 32, 8, generator=g, dtype=torch.float64)
    idx = torch.arange(6, 14, 2).expand(3, -1)
    r = compact(k, v, q, (6, 14), 4, compute_beta=True, refit_values=False, forced_indices=idx)
    # log 2 up to the fit's ridge toward w = 1 (docs/compaction.md, "β bounds and fallback")
    torch.testing.assert_close(r.beta, torch.full((3, 4), math.log(2), dtype=torch.float64), atol=1e-3, rtol=0)
    for b in range(3):
        without = brute_error(k[b], v[b], q[b], (6, 14), idx[b], torch.zeros(4))
        assert brute_error(k[b], v[b], q[b], (6, 14), idx[b], r.beta[b]) < 1e-6 * without
