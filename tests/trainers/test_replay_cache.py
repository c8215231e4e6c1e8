"""``ReplayPlanCache``: one-pass plans kept across replay passes give the results of fresh plans.

A GRPO step replays the same trajectories several times, chunked and ordered differently, with and
without gradients. Passes drawn by hypothesis (permutations, chunk sizes, gradient on/off, through /
detached) over sessions of several modes, probe sources and triggers at temperature 1-2 with β on
must return exactly the log-probs and parameter gradients of a plan built afresh for that call.
"""

from __future__ import annotations

import dataclasses
import types

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from replay_helpers import MODES, SAMPLING, TRIGGERS, plain_session

from compaction_gym.engine import CompactionConfig
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.replay import replay_logprobs_batch
from compaction_gym.trainers.replay_cache import ReplayPlanCache
from compaction_gym.trainers.replay_plan import simulate

#: (mode, trigger, probe source, seed, turns): several events each, chains of re-compacted blocks.
SESSIONS = (
    ("attention_matching+beta", "kv_budget", "suffix", 3, 4),
    ("attention_matching", "turn", "keys", 4, 3),
    ("attention_matching+beta", "kv_budget", "random", 5, 3),
    ("h2o", "kv_budget", "suffix", 6, 2),
)


@pytest.fixture(scope="module")
def views(engine):
    out = []
    for temperature, (mode, trigger, probes, seed, turns) in zip((1.0, 1.5, 2.0, 1.3), SESSIONS):
        config = CompactionConfig(**MODES[mode], **TRIGGERS[trigger], n_probe_queries=16, queries=probes)
        view = plain_session(
            engine, config, seed=seed, turns=turns, sampling=SAMPLING.replace(temperature=temperature)
        )
        assert len(view.events) >= 2
        out.append(view)
    return out


def replay(model, views, cache, *, grad: bool, through: bool, prefetch=None):
    """Log-probs and (with ``grad``) the parameter gradients of their sum."""
    model.zero_grad(set_to_none=True)
    out = replay_logprobs_batch(
        model, views, grad=grad, grad_through_compaction=through, method="one_pass", plan_cache=cache,
        prefetch=prefetch,
    )  # fmt: skip
    grads = None
    if grad:
        torch.stack([lp.sum() for lp in out.logprobs]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [lp.detach() for lp in out.logprobs], out.num_events, grads


@st.composite
def passes(draw, n: int):
    """A few passes, each a permutation of the trajectories cut into chunks (or the previous pass's
    chunks, each reordered: the device plans' reuse), with its gradient flags."""
    out = []
    for _ in range(draw(st.integers(2, 4))):
        if out and draw(st.booleans()):
            chunks = [draw(st.permutations(c)) for c in out[-1][0]]
        else:
            order = draw(st.permutations(range(n)))
            cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)))
            chunks = [order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
        out.append((chunks, draw(st.booleans()), draw(st.booleans()), draw(st.booleans())))
    return out


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_kept_plans_give_the_results_of_fresh_ones(model, views, data):
    """Every chunk of every pass, replayed through one cache, equals its replay with a fresh plan:
    exactly where its plan was assembled from kept simulations (the same tensors), to float rounding
    of a batch position where a kept device plan serves it (possibly with its rows in another order).
    In a pass that prefetches, each chunk's call builds the next chunk's plan."""
    cache = ReplayPlanCache()
    drawn = data.draw(passes(len(views)))
    prefetched = 0
    for chunks, grad, through, ahead in drawn:
        for k, chunk in enumerate(chunks):
            batch = [views[i] for i in chunk]
            nxt = [views[i] for i in chunks[k + 1]] if ahead and k + 1 < len(chunks) else None
            prefetched += len(nxt or [])
            before = cache.stats.device_plans_reused
            lp, events, grads = replay(model, batch, cache, grad=grad, through=through, prefetch=nxt)
            ref_lp, ref_events, ref_grads = replay(model, batch, None, grad=grad, through=through)
            assert events == ref_events
            for x, y in zip(lp, ref_lp):
                assert x.shape == y.shape
                assert (x - y).abs().max().item() <= 1e-6
            if grad:
                assert grads.keys() == ref_grads.keys() and grads
                for name in grads:
                    scale = ref_grads[name].abs().max().clamp_min(1e-12)
                    assert ((grads[name] - ref_grads[name]).abs().max() / scale).item() <= 1e-5, name
            if cache.stats.device_plans_reused == before:  # built from kept simulations: the same plan
                assert all(torch.equal(x, y) for x, y in zip(lp, ref_lp))
    stats = cache.stats
    assert stats.simulations_built == len(views)  # each trajectory simulated once, whatever the chunking
    assert stats.simulations_built + stats.simulations_reused == len(drawn) * len(views) + prefetched


def test_a_prefetched_plan_is_the_next_calls(model, views):
    """``prefetch`` builds the next chunk's plan during this call: this call's results are unchanged,
    the next call finds its plan kept and returns what a fresh plan gives."""
    first, second = views[:2], views[2:]
    cache = ReplayPlanCache()
    lp, _, _ = replay(model, first, cache, grad=False, through=True, prefetch=second)
    assert (cache.stats.simulations_built, cache.stats.device_plans_built) == (len(views), 2)
    alone, _, _ = replay(model, first, None, grad=False, through=True)
    assert all(torch.equal(x, y) for x, y in zip(lp, alone))
    lp, _, _ = replay(model, second, cache, grad=False, through=True)
    assert cache.stats.device_plans_reused == 1 and cache.stats.device_plans_built == 2
    fresh, _, _ = replay(model, second, None, grad=False, through=True)
    assert all(torch.equal(x, y) for x, y in zip(lp, fresh))


def test_prefetching_this_calls_own_batch(model, views):
    """A prefetch of the call's own trajectories hands its plan out again mid-call: the call's
    log-probs and gradients stay those of a call without prefetch."""
    cache = ReplayPlanCache()
    lp, _, grads = replay(model, views, cache, grad=True, through=True, prefetch=views[::-1])
    ref_lp, _, ref_grads = replay(model, views, None, grad=True, through=True)
    assert all(torch.equal(x, y) for x, y in zip(lp, ref_lp))
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    assert cache.stats.device_plans_built == 1 and cache.stats.device_plans_reused == 1


def test_a_prefetch_leaves_errors_to_the_call_they_belong_to(model, views):
    """A next chunk whose record does not replay does not fail this call; the next call reports it
    with the message a call without prefetch gives. A prefetch needs a cache."""
    view = views[0]
    event = view.events[-1]
    broken = types.SimpleNamespace(
        token_ids=view.token_ids, completion_mask=view.completion_mask, sampling=view.sampling, config=view.config,
        events=[*view.events[:-1], dataclasses.replace(event, kv_len_before=event.kv_len_before + 1)],
    )  # fmt: skip
    cache = ReplayPlanCache()
    lp, _, _ = replay(model, views[1:], cache, grad=False, through=True, prefetch=[broken])
    assert len(lp) == len(views) - 1
    with pytest.raises(InvalidArgumentError) as without:
        replay(model, [broken], None, grad=False, through=True)
    with pytest.raises(InvalidArgumentError) as after:
        replay(model, [broken], cache, grad=False, through=True)
    assert str(after.value) == str(without.value)
    with pytest.raises(InvalidArgumentError, match="prefetch .*plan_cache"):
        replay(model, views[:1], None, grad=False, through=True, prefetch=views[1:])


def test_what_is_reused(model, views):
    """The same batch (in any order) reuses its device plan; another chunking reuses the simulations;
    a pass with gradients through the blocks shares the plan of the passes without gradient."""
    cache = ReplayPlanCache()
    replay(model, views, cache, grad=False, through=True)
    assert (cache.stats.simulations_built, cache.stats.device_plans_built) == (len(views), 1)
    lp, _, _ = replay(model, views[::-1], cache, grad=True, through=True)
    assert cache.stats.device_plans_reused == 1
    fresh, _, _ = replay(model, views[::-1], None, grad=True, through=True)
    assert all((x - y).abs().max().item() <= 1e-6 for x, y in zip(lp, fresh))
    replay(model, views[:2], cache, grad=False, through=True)
    assert (cache.stats.simulations_built, cache.stats.device_plans_built) == (len(views), 2)
    replay(model, views, cache, grad=True, through=False)  # detached blocks: another device layout
    assert cache.stats.device_plans_built == 3 and cache.stats.simulations_built == len(views)
    cache.clear()
    assert len(cache) == 0 and cache.stats.simulations_built == 0


def test_changed_trajectories_are_simulated_again(views):
    """A trajectory whose events were replaced, or whose tokens grew, is not served a stale plan."""
    view = views[0]
    traj = types.SimpleNamespace(token_ids=list(view.token_ids), events=list(view.events))
    cache = ReplayPlanCache()
    end = len(traj.token_ids) - 1
    first = cache.simulation(traj, 0, end, 16, 1e-4, 2, 2)
    assert cache.simulation(traj, 0, end, 16, 1e-4, 2, 2) is first
    traj.events = traj.events[:-1]  # the last event dropped: its cache states differ
    again = cache.simulation(traj, 0, end, 16, 1e-4, 2, 2)
    assert again is not first and cache.stats.simulations_built == 2
    fresh = simulate(traj, 0, end, 16, 1e-4, 2, 2)
    assert again.num_events == fresh.num_events == len(view.events) - 1
    assert [s.length for s in again.snapshots] == [s.length for s in fresh.snapshots]
    traj.token_ids.append(3)
    assert cache.simulation(traj, 0, end, 16, 1e-4, 2, 2) is not again


def test_bounds(model, views):
    cache = ReplayPlanCache(max_trajectories=2, max_device_plans=0)
    for _ in range(2):
        replay(model, views[:3], cache, grad=False, through=True)
    assert len(cache) == 2
    assert cache.stats.device_plans_reused == 0 and cache.stats.device_plans_built == 2
    with pytest.raises(InvalidArgumentError, match="max_device_plans must be >= 0"):
        ReplayPlanCache(max_device_plans=-1)
