"""Shared helpers of the replay and GRPO tests: rollouts on the real engine, log-prob comparisons."""

from __future__ import annotations

import torch
from tree_helpers import one_thread  # noqa: F401  (re-exported for the replay tests)

from compaction_gym.engine import CompactionConfig, Engine, SamplingParams

#: The replay contract's tolerance (float32).
TOL = 1e-4
#: One pass vs segments: the same operations in another order (float32). The 2.0e-5 hypothesis once
#: found (seed 772, attention_matching+beta, keys probes, ratio 0.5; the bound was 4e-5 for it) and
#: test_replay_property.py's 2.2e-4 (seed 10000) were the value maps' float32 ``XᵀP``; since, those
#: sessions differ by 2.9e-6 and 3.8e-6, and 372 sessions of benchmarks/diag_onepass_rounding.py by
#: ≤ 5.3e-6 (docs/grpo.md, "Numerics"): 4× that.
SAME = 2e-5
#: Every compaction mode the engine has, as the replay tests drive them.
MODES = {
    "attention_matching+beta": {"mode": "attention_matching", "compute_beta": True},
    "attention_matching": {"mode": "attention_matching"},
    "markovian": {"mode": "markovian"},
    "h2o": {"mode": "h2o"},
    "snapkv": {"mode": "snapkv"},
    "streaming": {"mode": "streaming"},
    "random": {"mode": "random"},
    "tova": {"mode": "tova"},
    "knorm": {"mode": "knorm"},
}
#: Both fire several times in a 16-token prompt + 4 × (10 input + 20 sampled) session.
TRIGGERS = {"kv_budget": {"max_kv_len": 64, "compact_window": 32}, "turn": {"n_protect_turns": 1}}


def even_tokens(completions, trajectory, **kwargs) -> list[float]:
    """A GRPO reward that differs inside a group (a random model's env reward is ~always 0)."""
    out = []
    for t in trajectory:
        sampled = [tok for tok, m in zip(t.token_ids, t.completion_mask) if m]
        out.append(sum(tok % 2 == 0 for tok in sampled) / max(1, len(sampled)))
    return out


#: Temperature 1, full vocabulary: the sampling log-probs are the plain log-softmax, far from degenerate.
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)


def token_ids(n: int, seed: int, lo: int = 3, hi: int = 500) -> list[int]:
    """Seeded random ids in ``[lo, hi)`` (no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g).tolist()


def plain_session(
    engine: Engine,
    config: CompactionConfig,
    *,
    seed: int = 0,
    turns: int = 3,
    prompt: int = 16,
    inputs: int = 10,
    sampling: SamplingParams = SAMPLING,
    inputs_ids: list[list[int]] | None = None,
):
    """Create a session (which generates), step it ``turns`` times, close it; return its ``SessionView``."""
    r = engine.create_session(token_ids(prompt, seed), config, sampling.replace(seed=seed))
    for t in range(turns):
        ids = inputs_ids[t] if inputs_ids is not None else token_ids(inputs, 1000 * seed + t)
        engine.step(r.session_id, ids, sampling.replace(seed=None))
    view = engine.session(r.session_id)
    engine.close(r.session_id)
    return view


def max_sampled_diff(replayed: torch.Tensor, trajectory) -> float:
    """``max |replay − rollout|`` over the sampled tokens (``completion_mask == 1``)."""
    mask = torch.tensor(trajectory.completion_mask, dtype=torch.bool)
    assert mask.any()
    rollout = torch.tensor(trajectory.logprobs, dtype=torch.float64)[mask]
    return (replayed.detach().double().cpu()[mask] - rollout).abs().max().item()
