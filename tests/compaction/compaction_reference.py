"""Independent float64 reference for the compaction tests: plain loops and einsum only.

Nothing here imports ``compaction_gym``; the tests compare the library against these functions.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def make_cache(seed: int, batch: int, length: int, d: int, n: int, *, dtype=F64, query_shift: float = 0.0):
    """Random keys, values ``[B, T, d]`` and probe queries ``[B, n, d]`` from one seed."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, length, d, generator=g, dtype=F64)
    values = torch.randn(batch, length, d, generator=g, dtype=F64)
    queries = torch.randn(batch, n, d, generator=g, dtype=F64) + query_shift * torch.randn(
        batch, 1, d, generator=g, dtype=F64
    )
    return keys.to(dtype), values.to(dtype), queries.to(dtype)


def logits(keys, queries, scale=None, key_bias=None):
    """``S[b, i, j] = scale · q_bi · k_bj + bias_bj`` in float64."""
    d = keys.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = torch.einsum("bid,bjd->bij", queries.to(F64), keys.to(F64)) * scale
    if key_bias is not None:
        s = s + key_bias.to(F64)[:, None, :]
    return s


def importance(keys, queries, span, scale=None, key_bias=None):
    """``I_j = sqrt(mean_i A_ij²)`` for every span key, by explicit loops over rows and keys."""
    s_all = logits(keys, queries, scale, key_bias)
    start, end = span
    batch, n, _ = s_all.shape
    out = torch.zeros(batch, end - start, dtype=F64)
    for b in range(batch):
        for i in range(n):
            row = s_all[b, i]
            probs = torch.exp(row - row.max())
            probs = probs / probs.sum()
            for j in range(start, end):
                out[b, j - start] += probs[j] ** 2
    return (out / n).sqrt()


def brute_top(scores, target: int, start: int):
    """Indices of the ``target`` largest scores per row, ascending, found by a full sort."""
    rows = []
    for row in scores:
        order = sorted(range(len(row)), key=lambda j: -float(row[j]))
        rows.append(sorted(j + start for j in order[:target]))
    return torch.tensor(rows, dtype=torch.long)


def gather_rows(x, indices):
    """``x[b, indices[b]]`` by a loop over the batch."""
    return torch.stack([x[b, indices[b]] for b in range(x.shape[0])])


def span_mass(keys, queries, span, scale=None, key_bias=None):
    """``Σ_{j∈W} exp(S_ij)`` ``[B, n]``."""
    start, end = span
    return torch.exp(logits(keys, queries, scale, key_bias)[:, :, start:end]).sum(-1)


def kept_mass(keys, queries, indices, beta, scale=None):
    """``Σ_{j∈sel} exp(scale·q·k_j + β_j)`` ``[B, n]`` with absolute β."""
    kept = gather_rows(keys.to(F64), indices)
    return torch.exp(logits(kept, queries, scale) + beta.to(F64)[:, None, :]).sum(-1)


def attend(queries, keys, values, scale=None, bias=None):
    """Softmax attention output ``[B, n, d]`` of ``queries`` over ``keys``/``values`` (+ per-key bias)."""
    s = logits(keys, queries, scale, bias)
    return torch.einsum("bij,bjd->bid", torch.softmax(s, dim=-1), values.to(F64))


def block_output(keys, values, queries, span, scale=None, key_bias=None):
    """Attention of the probes restricted to the span (softmax over the span only)."""
    start, end = span
    bias = None if key_bias is None else key_bias[:, start:end]
    return attend(queries, keys[:, start:end], values[:, start:end], scale, bias)


def splice(keys, values, span, new_keys, new_values, key_bias=None, new_bias=None):
    """``[prefix | new block | suffix]`` keys, values and per-key bias (float64)."""
    start, end = span
    batch, length = keys.shape[:2]
    bias = torch.zeros(batch, length, dtype=F64) if key_bias is None else key_bias.to(F64)
    t = new_keys.shape[1]
    block_bias = torch.zeros(batch, t, dtype=F64) if new_bias is None else new_bias.to(F64)
    cat = lambda a, b, c: torch.cat([a, b, c], dim=1)  # noqa: E731
    return (
        cat(keys[:, :start].to(F64), new_keys.to(F64), keys[:, end:].to(F64)),
        cat(values[:, :start].to(F64), new_values.to(F64), values[:, end:].to(F64)),
        cat(bias[:, :start], block_bias, bias[:, end:]),
    )


def rel(a, b) -> float:
    """Relative Frobenius error of ``a`` against reference ``b``."""
    return float((a.to(F64) - b.to(F64)).norm() / b.to(F64).norm())


def ridge_toward(x, y, prior, ridge: float, n_probes=None):
    """``argmin_c ‖x c − y‖² + λ‖c − prior‖²`` per problem by least squares on the stacked system
    ``[x; √λ I] c = [y; √λ prior]`` (float64, no normal equations). ``λ = ρ · trace(xᵀx) / t`` with
    ``ρ = ridge`` from two probes per kept key up, ``100 · ridge`` at one and below, linear between
    (``n_probes`` ``[B]``: real probes per problem, default all ``n`` rows of ``x``)."""
    out = []
    for b, (xb, yb, pb) in enumerate(zip(x.to(F64), y.to(F64), prior.to(F64))):
        n, t = xb.shape
        n = n if n_probes is None else int(n_probes[b])
        rho = ridge * (1 + 99 * min(1.0, max(0.0, 2 - n / t)))
        root = math.sqrt(rho * float((xb * xb).sum()) / t)
        a = torch.cat([xb, root * torch.eye(t, dtype=F64)])
        out.append(torch.linalg.lstsq(a, torch.cat([yb, root * pb]), driver="gelsd").solution)
    return torch.stack(out)
