"""Sampling on the device, capturable in a CUDA graph.

Per-row parameters live in device tensors (:class:`DeviceSampling`), so one captured graph
serves any mix of greedy and sampled rows. Randomness is the generic sampler's counter-based
stream (:func:`~compaction_gym.engine.sampler.counter_uniform`): row ``b``'s ``k``-th draw is a
hash of ``(seed_b, k)``, so a row's tokens never depend on the other rows of the batch or on how
many steps run per graph replay, and no generator state is captured.

The distribution is the generic sampler's (:mod:`compaction_gym.engine.sampler`): logits over
the temperature, top-k, then top-p, renormalised; one uniform per token inverts its CDF; greedy
rows take the argmax and report the plain log-softmax. Same stream, same distribution: the two
samplers pick the same tokens up to floating-point differences.
"""

from __future__ import annotations

import torch

from compaction_gym.engine.config import SamplingParams
from compaction_gym.engine.fast.kernels import argmax_logprob
from compaction_gym.engine.sampler import counter_uniform


class DeviceSampling:
    """Per-row sampling parameters and stream counters in device tensors ``[max_batch]``.

    They are views of one int64 tensor (temperature and top-p as float32 in the low half of
    their rows), so :meth:`set` loads them with one asynchronous copy from pinned memory.
    """

    def __init__(self, max_batch: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._state = torch.zeros(5, max_batch, dtype=torch.long, device=device)
        self._host = torch.zeros(5, max_batch, dtype=torch.long, pin_memory=cuda)
        self._host_free = torch.cuda.Event() if cuda else None
        self.top_k, self.seed, self.counter = self._state[0], self._state[1], self._state[2]
        self.temperature = self._state[3].view(torch.float32)[:max_batch]
        self.top_p = self._state[4].view(torch.float32)[:max_batch]
        self.top_p.fill_(1.0)
        self.filtered = False  # whether any row uses top-k / top-p (picks the graph variant)
        self.greedy = True  # whether every row is greedy

    def set(self, params: list[SamplingParams], seeds: list[int], counters: list[int]) -> None:
        """Load rows ``[0, len(params))``, one per entry (later rows may change: callers use the rows they set)."""
        n = len(params)
        vals = [(p.temperature, p.top_k if not p.greedy else 0, 1.0 if p.greedy else p.top_p) for p in params]
        if self._host_free is not None:
            self._host_free.synchronize()  # the previous copy out of the pinned buffer is done
        host = self._host
        host[0, :n] = torch.tensor([v[1] for v in vals], dtype=torch.long)
        host[1, :n] = torch.tensor([s % (1 << 62) for s in seeds], dtype=torch.long)
        host[2, :n] = torch.tensor(counters, dtype=torch.long)
        host[3].view(torch.float32)[:n] = torch.tensor([v[0] for v in vals], dtype=torch.float32)
        host[4].view(torch.float32)[:n] = torch.tensor([v[2] for v in vals], dtype=torch.float32)
        self._state[:, :n].copy_(host[:, :n], non_blocking=True)
        if self._host_free is not None:
            self._host_free.record()
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
