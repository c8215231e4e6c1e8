"""Sampling on the device, capturable in a CUDA graph.

Per-row parameters live in device tensors (:class:`DeviceSampling`), so one captured graph
serves any mix of greedy and sampled rows. Randomness is counter-based: row ``b``'s ``k``-th
draw is a hash of ``(seed_b, k)``, so a row's tokens never depend on the other rows of the batch
or on how many steps run per graph replay, and no generator state is captured.

The distribution is the generic sampler's (:mod:`compaction_gym.engine.sampler`): logits over
the temperature, top-k, then top-p, renormalised; one uniform per token inverts its CDF; greedy
rows take the argmax and report the plain log-softmax. Only the random stream differs.
"""

from __future__ import annotations

import torch

from compaction_gym.engine.config import SamplingParams
from compaction_gym.engine.fast.kernels import argmax_logprob

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


class DeviceSampling:
    """Per-row sampling parameters and stream counters in device tensors ``[max_batch]``."""

    def __init__(self, max_batch: int, device: torch.device) -> None:
        self.temperature = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.top_p = torch.ones(max_batch, dtype=torch.float32, device=device)
        self.seed = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.counter = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.filtered = False  # whether any row uses top-k / top-p (picks the graph variant)
        self.greedy = True  # whether every row is greedy

    def set(self, params: list[SamplingParams], seeds: list[int], counters: list[int]) -> None:
        """Load one row of parameters per entry (rows past ``len(params)`` are left as they are)."""
        n = len(params)
        vals = [(p.temperature, p.top_k if not p.greedy else 0, 1.0 if p.greedy else p.top_p) for p in params]
        self.temperature[:n] = torch.tensor([v[0] for v in vals], dtype=torch.float32)
        self.top_k[:n] = torch.tensor([v[1] for v in vals], dtype=torch.long)
        self.top_p[:n] = torch.tensor([v[2] for v in vals], dtype=torch.float32)
        self.seed[:n] = torch.tensor([s % (1 << 62) for s in seeds], dtype=torch.long)
        self.counter[:n] = torch.tensor(counters, dtype=torch.long)
        self.greedy = all(p.greedy for p in params)
        self.filtered = any(v[1] > 0 or v[2] < 1.0 for v in vals)


def _filter(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p with per-row tensors (``top_k = 0``: off; the best token always stays)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs
    drop = drop | ((before >= top_p[:, None]) & (top_p[:, None] < 1.0))
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def sample_device(
    logits: torch.Tensor, params: DeviceSampling, greedy_only: bool, filtered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[B]`` and their log-probabilities ``[B]`` for ``logits`` ``[B, V]``; no host sync.

    Advances the counters of the ``B`` rows by one.

    Args:
        greedy_only: every row is greedy (argmax only, nothing drawn: :func:`argmax_logprob`,
            straight from the model-dtype logits).
        filtered: some row uses top-k/top-p (adds a sort over the vocabulary).
    """
    if greedy_only:
        return argmax_logprob(logits)
    logits = logits.float()
    batch = logits.shape[0]
    temp = params.temperature[:batch]
    greedy = temp == 0
    scaled = logits / torch.where(greedy, 1.0, temp)[:, None]
    if filtered:
        scaled = _filter(scaled, params.top_k[:batch], params.top_p[:batch])
    logp = torch.log_softmax(scaled, dim=-1)
    u = counter_uniform(params.seed[:batch], params.counter[:batch])
    cdf = logp.exp().cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
    bad = torch.isinf(logp.gather(1, picked[:, None])[:, 0])  # round-off never lands on a dropped token
    tokens = torch.where(greedy | bad, logp.argmax(dim=-1), picked)
    params.counter[:batch] += (~greedy).long()
    return tokens, logp.gather(1, tokens[:, None])[:, 0]
