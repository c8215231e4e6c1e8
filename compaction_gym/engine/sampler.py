"""Per-row sampling with per-request random streams.

Each row of a batch has its own :class:`SamplingParams` and its own :class:`SampleStream`, so a
session's tokens do not depend on what else is in the batch (no shared global RNG).

Log-probabilities are those of the *sampling distribution*: logits divided by the temperature,
restricted to the top-k tokens and then to the top-p nucleus, renormalised. Greedy rows
(``temperature == 0``) report the plain ``log_softmax`` of the logits.

A sampling row draws exactly one uniform number per token and inverts the CDF of its
distribution. The uniform is counter-based: draw ``k`` of a stream is a hash of ``(seed, k)``
(:func:`counter_uniform`), so the device sampler of the fast path
(:mod:`compaction_gym.engine.fast.sampler`) draws the very same numbers inside a CUDA graph, and
the generic and fast paths sample the same tokens for a seed (up to floating-point differences
in the logits).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from compaction_gym.engine.config import SamplingParams

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x · m mod 2³²`` for ``x`` in ``[0, 2³²)`` without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * m + (((hi * m) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32: xor-shift, multiply, xor-shift, multiply, xor-shift)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Uniform float32 numbers in ``[0, 1)`` from int64 ``seed`` and ``counter`` tensors (24 bits)."""
    a = _mix32((seed & _M32) ^ _mix32(counter & _M32))
    b = _mix32(a ^ ((seed >> 32) & _M32) ^ _mix32((counter >> 32) ^ 0x9E3779B9))
    return (b >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass
class SampleStream:
    """One random stream: draw ``counter`` of ``seed`` comes next (samplers advance ``counter``)."""

    seed: int
    counter: int = 0

    @classmethod
    def fresh(cls, seed: int | None) -> SampleStream:
        """A stream at its start (``seed=None``: a seed from the OS entropy pool)."""
        return cls(secrets.randbits(62) if seed is None else int(seed) % (1 << 62))

    def clone(self) -> SampleStream:
        """An independent stream at the same position (fork)."""
        return SampleStream(self.seed, self.counter)


def sampling_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Log-probabilities ``[B, V]`` of each row's sampling distribution (``-inf`` outside its support)."""
    logits = logits.float()
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=logits.device)
    scaled = logits / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in params if not p.greedy):
        scaled = _filter_top_k_top_p(scaled, params)
    return torch.log_softmax(scaled, dim=-1)


def _filter_top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    top_k = torch.tensor(
        [p.top_k if (p.top_k > 0 and not p.greedy) else vocab for p in params], device=scaled.device
    )
    drop = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    top_p = torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=scaled.device)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop = drop | ((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0))
    drop[:, 0] = False  # the best token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], streams: list[SampleStream | None]
) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` ``[B, V]``.

    Args:
        streams: one per row; only rows with ``temperature > 0`` draw from theirs (and advance
            it by one); greedy rows may pass ``None``.

    Returns:
        ``(tokens, logprobs)``: the chosen ids and their log-probabilities under the sampling
        distribution (see the module docstring).
    """
    logp = sampling_logprobs(logits, params)
    tokens = logp.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:  # only sampling rows draw, one uniform each, from their own stream
        seeds = torch.tensor([streams[i].seed for i in rows], dtype=torch.long)
        counters = torch.tensor([streams[i].counter for i in rows], dtype=torch.long)
        for i in rows:
            streams[i].counter += 1
        idx = torch.tensor(rows, device=logits.device)
        cdf = logp[idx].exp().cumsum(dim=-1)
        u = counter_uniform(seeds, counters).to(logits.device) * cdf[:, -1]
        picked = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
        # float round-off must never land on a zero-probability token
        bad = torch.isinf(logp[idx].gather(1, picked[:, None]).squeeze(1))
        tokens[idx] = torch.where(bad, tokens[idx], picked)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()
