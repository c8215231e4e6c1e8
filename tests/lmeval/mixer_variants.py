"""Deliberately broken mixers the compliance checks must flag (docs/eval-lm.md, "Compliance of a mixer")."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from compaction_gym.lmeval.mixer import BackoffNgramMixer, MixerConfig, context_bucket, mixing_weight


class TargetKeyedMixer:
    """The rejected parameter-golf mixer: flat context and (context, target) count tables, and a
    cascade that picks, **per target**, the highest order whose (context, target) key has a count —
    the target is in the hash key, so the probabilities over the vocabulary do not sum to one."""

    def __init__(self, config: MixerConfig, vocab_size: int) -> None:
        self.config, self.vocab_size = config, vocab_size
        self.context_len = config.max_order - 1
        self.ctx: dict[int, int] = defaultdict(int)
        self.full: dict[int, int] = defaultdict(int)
        self.updated_to = 0

    def target_probs(
        self, context: Sequence[int], targets: np.ndarray, model_logprobs: np.ndarray, entropy: float
    ) -> np.ndarray:
        alpha = mixing_weight(self.config, entropy)
        out = np.exp(np.asarray(model_logprobs, dtype=np.float64))
        for i, v in enumerate(np.asarray(targets).tolist()):
            for order in range(self.config.max_order, 1, -1):
                if len(context) < order - 1:
                    continue
                c = list(context[len(context) - order + 1 :])
                n_ctx = self.ctx.get(context_bucket(order, c, self.config.buckets), 0)
                n_full = self.full.get(context_bucket(order, [*c, v], self.config.buckets), 0)
                if n_ctx >= self.config.min_count and n_full > 0:
                    out[i] = (1 - alpha) * out[i] + alpha * min(n_full, n_ctx) / n_ctx
                    break
        return out

    def update(self, token_ids: Sequence[int], start: int, end: int) -> None:
        for t in range(start, end):
            for order in range(2, self.config.max_order + 1):
                if t < order - 1:
                    break
                c = list(token_ids[t - order + 1 : t])
                self.ctx[context_bucket(order, c, self.config.buckets)] += 1
                self.full[context_bucket(order, [*c, int(token_ids[t])], self.config.buckets)] += 1
        self.updated_to = end


class LookAheadMixer(BackoffNgramMixer):
    """A correct-looking mixer with an off-by-a-chunk bug: each update also counts the *next*
    chunk (``peek`` tokens past ``end``) into a side table that scoring adds in."""

    def __init__(self, config: MixerConfig, vocab_size: int, peek: int) -> None:
        super().__init__(config, vocab_size)
        self.peek = peek
        self.ahead = BackoffNgramMixer(config, vocab_size)

    def update(self, token_ids: Sequence[int], start: int, end: int) -> None:
        super().update(token_ids, start, end)
        stop = min(len(token_ids), end + self.peek)
        self.ahead = BackoffNgramMixer(self.config, self.vocab_size)
        self.ahead.updated_to = end
        self.ahead.update(token_ids, end, stop)

    def lookup(self, context: Sequence[int]) -> tuple[int, dict[int, int], int] | None:
        own, ahead = super().lookup(context), self.ahead.lookup(context)
        if ahead is None:
            return own
        if own is None or own[0] < ahead[0]:
            return ahead
        if own[0] > ahead[0]:
            return own
        merged = dict(own[1])
        for v, c in ahead[1].items():
            merged[v] = merged.get(v, 0) + c
        return own[0], merged, own[2] + ahead[2]
