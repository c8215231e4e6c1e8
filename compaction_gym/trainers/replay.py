"""Compaction replay: a trajectory's per-token log-probs exactly as its compacted rollout saw them.

A session compacted during the rollout never saw its full history again: after each event the
model attended to ``[prefix | C1/C2/β block | suffix]``. A trainer that scores the trajectory with a
plain forward scores a different distribution (the original research code's replay never matched). This module
rebuilds the rollout's cache with the trainer's own model, segment by segment:

1. tokens are fed in logical order, at their logical positions (``position_ids`` = index in
   ``token_ids``; kept keys keep their rotation, nothing is re-rotated);
2. an event fires once exactly ``event.logical_len`` tokens are fed — the engine's own clock, so
   "the last sampled token is not in the cache until the next call" and budget messages need no
   special case: they are tokens, fed (and masked) like any other;
3. the event is applied to the replayed K/V by :func:`~compaction_gym.compaction.apply_event`, the
   engine's own call, with the *recorded* kept indices and the *recorded* β (a constant: refitting
   β by NNLS would amplify the tiny K/V differences between rollout and replay), the *same*
   probes (:func:`~compaction_gym.compaction.event_probes`; ``suffix``: the post-RoPE queries this
   replay's own forward produced at ``probe_logical_range``; ``keys``: the recorded ``probe_rows``;
   ``random``: ``random_probes(probe_seed, index, ...)``; ``repeat``: the queries of the recorded
   ``probe_tokens`` fed over this replay's cache by a scratch forward), the β already on the cache as
   ``key_bias``, the session's ``ridge``; the cache length before and after and the logical span
   are checked against the record (records without β or ``probe_rows`` — format version 1 —
   refit β and locate the key probes from their logical range);
4. token ``p`` is scored from the logits of token ``p − 1``, computed in the cache state it was
   fed in.

With ``grad=True`` the whole replay is differentiable: C1 is a gather of the replayed keys and C2
the ridge solve of :func:`~compaction_gym.compaction.fit_values` (differentiable in keys, values
and probes); β is the recorded constant, like the kept indices.
``grad_through_compaction=False`` detaches the compacted blocks instead (the original research code's choice, kept
as an ablation).

Any Hugging Face causal LM with the standard attention layout works (Llama, Qwen2, Qwen3, ...,
also wrapped by PEFT): the model is switched to the replay attention for the duration of the call
(see :mod:`compaction_gym.trainers.replay_attention`) — for good when ``grad=True`` and gradient
checkpointing is on, since layers are recomputed during ``backward``; plain forwards then run SDPA.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from compaction_gym.compaction import RowMap, apply_event, event_probes
from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.compaction.modes import REPEAT_SOURCES, SUFFIX_SOURCES, replay_needs_probes
from compaction_gym.engine.host_copy import upload
from compaction_gym.engine.model_runner import ModelLayout
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.replay_attention import (
    ReplayRound,
    install_replay_attention,
    register_replay_attention,
    round_mask,
    unwrap,
    use_attention,
)
from compaction_gym.trainers.replay_cache import ReplayPlanCache
from compaction_gym.trainers.replay_onepass import (
    OnePassReplay,
    fused_scores,
    padded_inputs,
    score_hidden,
    shifted_labels,
)
from compaction_gym.trainers.replay_plan import (
    TrajectorySim,
    build_plan,
    checked_events,
    key_probe_rows,
    one_pass_supported,
)

__all__ = ["REPLAY_METHODS", "ReplayOutput", "replay_logprobs", "replay_logprobs_batch"]

#: How :func:`replay_logprobs_batch` rebuilds the caches (its ``method``).
REPLAY_METHODS: tuple[str, ...] = ("auto", "one_pass", "segments")

logger = logging.getLogger(__name__)


class Replayable(Protocol):
    """What replay reads: a :class:`~compaction_gym.agents.Trajectory` or an engine ``SessionView``.

    The session's ``n_probe_queries`` and ``ridge`` come from ``compaction`` (a
    ``CompactionConfig.to_dict()``, trajectories) or ``config`` (a ``CompactionConfig``, views).
    """

    token_ids: Sequence[int]
    completion_mask: Sequence[int]
    events: Sequence[CompactionEvent]


@dataclass
class ReplayOutput:
    """Results of :func:`replay_logprobs_batch`, one entry per trajectory.

    Attributes:
        logprobs: float32 (float64 for float64 models) ``[len(token_ids)]``:
            ``logprobs[p] = log softmax(logits_{p-1} / T)[token_p]``
            at the scored positions, ``0.0`` elsewhere (the convention of ``Trajectory.logprobs``).
        entropies: same layout, the entropy of each scored position's distribution (if asked).
        logits: ``[n_scored, V]`` temperature-scaled logits of the scored positions in ascending
            order (if asked; not with ``fused_lm_head``).
        num_events: events applied per trajectory.
    """

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None = None
    logits: list[torch.Tensor] | None = None
    num_events: list[int] | None = None


def replay_logprobs(
    model: torch.nn.Module,
    trajectory: Replayable,
    *,
    grad: bool = False,
    grad_through_compaction: bool = True,
    temperature: float | None = None,
    positions: Sequence[int] | None = None,
    method: str = "auto",
) -> torch.Tensor:
    """Per-token log-probs of ``trajectory`` under ``model``, replaying its compaction events.

    Args:
        model: a Hugging Face causal LM of the architecture that produced the trajectory (any
            weights: the policy being trained, a reference model, a PEFT model).
        trajectory: a :class:`~compaction_gym.agents.Trajectory` (or engine ``SessionView``).
        grad: build the autograd graph (otherwise runs under ``torch.no_grad``).
        grad_through_compaction: with ``grad``, let gradients flow through the compacted blocks
            (C1 = kept keys, C2 = refitted values); ``False`` detaches them.
        temperature: logits are divided by it (the sampler's temperature; with ``top_k=0`` and
            ``top_p=1`` the result equals the engine's sampling log-probs). ``None`` (default): each
            trajectory's own sampling temperature (``trajectory.sampling``; 1 for greedy ones, whose
            recorded log-probs are the plain log-softmax).
        positions: logical positions to score (``>= 1``); default: the sampled tokens
            (``completion_mask == 1``).
        method: how the caches are rebuilt, as :func:`replay_logprobs_batch` takes it.

    Returns:
        float32 (float64 for float64 models) ``[len(token_ids)]`` aligned to ``token_ids``: ``out[p]`` is the log-prob of
        ``token_ids[p]`` given ``token_ids[:p]`` as the compacted session held them, ``0.0`` at
        positions not scored (``out[0]`` always).

    Raises:
        InvalidArgumentError: the trajectory's events do not match what replay rebuilds (cache
            lengths, logical spans, probe ranges), or a bad position.

    Example:
        >>> traj = run_episode(env, agent, seed=0)  # doctest: +SKIP
        >>> lp = replay_logprobs(model, traj)  # doctest: +SKIP
        >>> mask = torch.tensor(traj.completion_mask, dtype=torch.bool)  # doctest: +SKIP
        >>> (lp[mask].cpu() - torch.tensor(traj.logprobs)[mask]).abs().max()  # ~1e-6 in fp32  # doctest: +SKIP
    """
    out = replay_logprobs_batch(
        model,
        [trajectory],
        grad=grad,
        grad_through_compaction=grad_through_compaction,
        temperature=temperature,
        positions=None if positions is None else [positions],
        method=method,
    )
    return out.logprobs[0]


def replay_logprobs_batch(
    model: torch.nn.Module,
    trajectories: Sequence[Replayable],
    *,
    grad: bool = False,
    grad_through_compaction: bool = True,
    temperature: float | None = None,
    positions: Sequence[Sequence[int] | None] | None = None,
    compute_entropy: bool = False,
    return_logits: bool = False,
    fused_lm_head: bool = False,
    max_tokens_per_forward: int = 2048,
    batch_events: bool = True,
    method: str = "auto",
    plan_cache: ReplayPlanCache | None = None,
    prefetch: Sequence[Replayable] | None = None,
) -> ReplayOutput:
    """:func:`replay_logprobs` for several trajectories, batched.

    Round ``r`` runs one forward for all trajectories: each feeds its next segment (the tokens up
    to its next event, at most ``max_tokens_per_forward``), right-padded; then every trajectory
    applies the events that are due. Results equal replaying one by one (up to batching noise).

    Args:
        model, grad, grad_through_compaction, temperature: as :func:`replay_logprobs`.
        trajectories: the trajectories (each continues its own cache).
        positions: per trajectory, positions to score (``None`` entries: its sampled tokens).
        compute_entropy: also return each scored position's entropy.
        return_logits: also return the scored positions' logits (``[n, V]``, divided by
            ``temperature``), e.g. for distillation losses.
        fused_lm_head: the model carries TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``):
            score with it (``shift_labels``) instead of materialising logits; its own temperature
            applies and ``temperature`` is ignored.
        max_tokens_per_forward: longest run of tokens one trajectory feeds in one forward.
        batch_events: apply the events due in a round with one :func:`apply_event` call per group
            of alike events (same mode, span length, target, probe count, β flags) across
            trajectories, on the spans' rows only; ``False``: one call per event on the whole
            cache (the reference path; both agree to float rounding, docs/grpo.md "Replay cost").
            Segment replay only.
        method: ``"one_pass"``: one forward over the whole trajectories, each layer rebuilding
            its compacted caches (:mod:`compaction_gym.trainers.replay_onepass`; docs/grpo.md
            "Replay in one pass"); ``"segments"``: one forward per stretch between events (the
            reference; ``max_tokens_per_forward`` and ``batch_events`` apply to it);
            ``"auto"`` (default): one pass on an accelerator unless an event needs the segments
            (``repeat`` probes, version-1 records whose β is refitted); segments on a CPU.
        plan_cache: a :class:`~compaction_gym.trainers.replay_cache.ReplayPlanCache` that keeps the
            one-pass plans for later calls over the same trajectories (any chunking or order); the
            results are those of a fresh plan. One pass only.
        prefetch: the trajectories of the next call over ``plan_cache`` (scored at their sampled
            tokens, with this call's ``temperature`` and gradient settings): their one-pass plan is
            built into the cache once this call's forward is launched, before this call waits for
            the device, so the plan's host work overlaps this call's device work and the next call
            finds its plan kept (docs/grpo.md, "Building the next chunk's plan during this one").
            Needs ``plan_cache``. A record of theirs that does not replay is left for the next call
            to report. Nothing is built when this call replays by segments.

    Returns:
        :class:`ReplayOutput`.
    """
    if temperature is not None and not temperature > 0:
        raise InvalidArgumentError(
            f"temperature must be > 0 (or None: each trajectory's own), got {temperature}"
        )
    if max_tokens_per_forward < 1:
        raise InvalidArgumentError(f"max_tokens_per_forward must be >= 1, got {max_tokens_per_forward}")
    if return_logits and fused_lm_head:
        raise InvalidArgumentError("return_logits needs the model's logits: use fused_lm_head=False")
    if positions is not None and len(positions) != len(trajectories):
        raise InvalidArgumentError(
            f"positions must give one entry per trajectory ({len(trajectories)}), got {len(positions)}"
        )
    if method not in REPLAY_METHODS:
        raise InvalidArgumentError(f"method must be one of {REPLAY_METHODS}, got {method!r}")
    if prefetch is not None and plan_cache is None:
        raise InvalidArgumentError(
            "prefetch builds the next call's plan into plan_cache: pass a plan_cache too"
        )
    base = unwrap(model)
    layout = ModelLayout.from_model(base)
    param = next(base.parameters())
    one_pass = all(one_pass_supported(list(t.events)) for t in trajectories)
    if method == "one_pass" and not one_pass:
        raise InvalidArgumentError(
            "method='one_pass' cannot replay repeat probes or version-1 records whose beta is refitted: "
            "use method='segments' (or 'auto')"
        )
    # on a CPU replay is compute-bound, and the one-pass value maps (t × span instead of t × head
    # dim) cost more than the segments' extra forwards save (docs/grpo.md, "Replay in one pass")
    if method == "one_pass" or (method == "auto" and one_pass and param.device.type != "cpu"):
        out = _replay_one_pass(
            # without gradients both layouts give the same values: the one without detached copies
            # (and shared with the gradient pass's plan when it lets gradients through)
            model, base, layout, param, trajectories, grad=grad, through=grad_through_compaction or not grad,
            temperature=temperature, positions=positions, compute_entropy=compute_entropy,
            return_logits=return_logits, fused_lm_head=fused_lm_head, plan_cache=plan_cache, prefetch=prefetch,
        )  # fmt: skip
        if out is not None:
            return out
    rows = [
        _Row(t, None if positions is None else positions[i], layout, param.device, i, temperature)
        for i, t in enumerate(trajectories)
    ]
    switch = _replay_attention_switch(model, base, grad)
    with torch.enable_grad() if grad else torch.no_grad(), switch:
        for row in rows:  # the scratch forward of repeat probes
            row.harvest = lambda r, ids, start: _harvest(model, r, layout, ids, start)
        active = [r for r in rows if r.fed < r.end]
        while active:
            _forward(model, active, layout, fused_lm_head, compute_entropy, return_logits,
                     max_tokens_per_forward)  # fmt: skip
            _apply_due_events(active, grad and grad_through_compaction, batch_events)
            active = [r for r in rows if r.fed < r.end]
    return ReplayOutput(
        logprobs=[r.collect(r.scored_lp) for r in rows],
        entropies=[r.collect(r.scored_ent) for r in rows] if compute_entropy else None,
        logits=[
            torch.cat(r.scored_logits) if r.scored_logits else param.new_zeros(0, layout.vocab_size)
            for r in rows
        ]
        if return_logits
        else None,  # fmt: skip
        num_events=[r.next_event for r in rows],
    )


def _replay_one_pass(
    model: torch.nn.Module,
    base: torch.nn.Module,
    layout: ModelLayout,
    param: torch.Tensor,
    trajectories: Sequence[Replayable],
    *,
    grad: bool,
    through: bool,
    temperature: float | None,
    positions: Sequence[Sequence[int] | None] | None,
    compute_entropy: bool,
    return_logits: bool,
    fused_lm_head: bool,
    plan_cache: ReplayPlanCache | None,
    prefetch: Sequence[Replayable] | None = None,
) -> ReplayOutput | None:
    """:func:`replay_logprobs_batch` by one forward (docs/grpo.md, "Replay in one pass"); ``None``
    when a value map's solve failed (the caller replays by segments)."""
    replay, order = _one_pass_plan(
        list(trajectories), *_plan_inputs(trajectories, positions, temperature), layout, param, through=through,
        cache=plan_cache,
    )  # fmt: skip
    plan, device = replay.plan, param.device
    ids, pos = upload(list(padded_inputs(plan)), device)  # asynchronous: the host runs ahead of the device
    kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": pos, "use_cache": False, "replay_plan": replay}  # fmt: skip
    switch = _replay_attention_switch(model, base, grad)
    entropies = logits = None
    with torch.enable_grad() if grad else torch.no_grad(), switch:
        if fused_lm_head:
            (labels,) = upload([shifted_labels(plan)], device)
            out = model(**kwargs, shift_labels=labels, fused_lm_head=True)
            logps, entropies = fused_scores(out, plan, compute_entropy)
        else:
            hf = base.get_base_model() if hasattr(base, "get_base_model") else base
            hidden = hf.get_decoder()(**kwargs).last_hidden_state
            softcap = getattr(hf.config.get_text_config(), "final_logit_softcapping", None)
            logps, entropies, logits = score_hidden(
                hf.get_output_embeddings(), hidden, plan, softcap=softcap,
                compute_entropy=compute_entropy, return_logits=return_logits,
            )  # fmt: skip
    # on the device (no wait), and before a prefetch that may hand this very plan out again (reset)
    failed = torch.cat([f.reshape(-1) for f in replay.failed]).any() if replay.failed else None
    if prefetch is not None and plan_cache is not None:
        _prefetch_plan(prefetch, temperature, layout, param, through, plan_cache)
    if failed is not None and bool(failed):
        # a value map whose normal equations did not factor: the segment replay has the
        # pseudo-inverse fallback of ridge_solve (one host synchronisation, here at the end)
        logger.warning("one-pass replay: a C2 solve did not factor; replaying by segments instead")
        return None
    num_events = [r.num_events for r in plan.rows]
    if order is not None:  # a kept plan of the same trajectories in another order: back to the caller's
        logps, entropies, logits, num_events = (
            None if x is None else [x[j] for j in order] for x in (logps, entropies, logits, num_events)
        )
    return ReplayOutput(logprobs=logps, entropies=entropies, logits=logits, num_events=num_events)


def _plan_inputs(
    trajectories: Sequence[Replayable],
    positions: Sequence[Sequence[int] | None] | None,
    temperature: float | None,
) -> tuple[list[list[int]], list[float], list[tuple[int, float]]]:
    """Per trajectory: the positions to score, the temperature and the session's ``(n_probe_queries, ridge)``."""
    targets = [
        scored_positions(t, None if positions is None else positions[i], i)
        for i, t in enumerate(trajectories)
    ]
    temperatures = [temperature if temperature is not None else sampling_temperature(t) for t in trajectories]
    configs = []
    for t in trajectories:
        cfg = _session_config(t)
        configs.append((int(cfg.get("n_probe_queries", 256)), float(cfg.get("ridge", 1e-4))))
    return targets, temperatures, configs


def _prefetch_plan(trajectories: Sequence[Replayable], temperature: float | None, layout: ModelLayout,
                   param: torch.Tensor, through: bool, cache: ReplayPlanCache) -> None:  # fmt: skip
    """Build the one-pass plan of a later call over ``trajectories`` into ``cache`` (``prefetch``).

    A trajectory that cannot replay in one pass, or whose records do not replay, is the later call's
    to handle: that call builds (or refuses) its plan itself and words the error."""
    if not all(one_pass_supported(list(t.events)) for t in trajectories):
        return
    try:
        _one_pass_plan(
            list(trajectories), *_plan_inputs(trajectories, None, temperature), layout, param, through=through,
            cache=cache, reset=False,
        )  # fmt: skip
    except InvalidArgumentError as e:
        logger.debug("prefetch: the next call's plan was not built (%s)", e)


def _one_pass_plan(
    trajectories: list[Replayable],
    targets: list[list[int]],
    temperatures: list[float],
    configs: list[tuple[int, float]],
    layout: ModelLayout,
    param: torch.Tensor,
    *,
    through: bool,
    cache: ReplayPlanCache | None,
    reset: bool = True,
) -> tuple[OnePassReplay, list[int] | None]:
    """The batch's device plan, built or (with a ``cache``) assembled from kept simulations or kept
    whole; ``order[i]``: the plan's row of trajectory ``i`` (``None``: in order). ``reset=False``
    leaves a kept plan's last pass state alone (a prefetch, which does not run it)."""
    n_layers, n_kv_heads = layout.n_layers, layout.n_kv_heads

    def build(sims: list[TrajectorySim] | None = None) -> OnePassReplay:
        plan = build_plan(
            trajectories, targets=targets, temperatures=temperatures, configs=configs, n_layers=n_layers,
            n_kv_heads=n_kv_heads, sims=sims,
        )  # fmt: skip
        return OnePassReplay(
            plan, param.device, through=through, head_dim=layout.head_dim, q_heads=layout.n_q_heads,
            probe_dtype=param.dtype, scale=layout.scale,
        )  # fmt: skip

    if cache is None:
        return build(), None
    sims = [
        cache.simulation(t, i, tg[-1] if tg else 0, n_probe, ridge, n_layers, n_kv_heads)
        for i, (t, tg, (n_probe, ridge)) in enumerate(zip(trajectories, targets, configs))
    ]
    settings = (n_layers, n_kv_heads, layout.head_dim, layout.n_q_heads, layout.scale, through, param.dtype,
                param.device)  # fmt: skip
    items = [(tuple(tg), temp) for tg, temp in zip(targets, temperatures)]
    replay, order = cache.device_plan(sims, items, settings, lambda: build(sims))
    if reset:
        replay.reset()
    return replay, order


def _replay_attention_switch(
    model: torch.nn.Module, base: torch.nn.Module, grad: bool
) -> contextlib.AbstractContextManager:
    """The context that runs ``model`` on the replay attention (either method)."""
    name = register_replay_attention()
    if base.config._attn_implementation == name:
        return contextlib.nullcontext()
    if grad and getattr(base, "is_gradient_checkpointing", False):
        # the layers re-run during backward, after a temporary switch would be undone
        logger.info(
            "gradient checkpointing is on: %s is left on the replay attention (SDPA otherwise)",
            type(base).__name__,
        )
        install_replay_attention(base)
        return contextlib.nullcontext()
    return use_attention(model, name)


def scored_positions(traj: Replayable, positions: Sequence[int] | None, i: int) -> list[int]:
    """The sorted positions of trajectory ``i`` to score (default: its sampled tokens), checked."""
    n = len(traj.token_ids)
    if positions is None:
        positions = [p for p, m in enumerate(traj.completion_mask) if m]
    targets = sorted({int(p) for p in positions})
    if targets and not 1 <= targets[0] <= targets[-1] < n:
        raise InvalidArgumentError(
            f"trajectory {i}: positions to score must lie in [1, {n}), got {targets[0]}..{targets[-1]}"
        )
    return targets


# --------------------------------------------------------------------------------------- rows
def sampling_temperature(traj: Any) -> float:
    """The temperature ``traj``'s tokens were sampled at: ``traj.sampling`` (a dict for
    trajectories, ``SamplingParams`` for engine views); 1.0 when greedy or unknown."""
    sampling = getattr(traj, "sampling", None)
    value = (
        sampling.get("temperature")
        if isinstance(sampling, Mapping)
        else getattr(sampling, "temperature", None)
    )
    return float(value) if value else 1.0


def _session_config(traj: Any) -> Mapping[str, Any]:
    cfg = getattr(traj, "compaction", None)
    if isinstance(cfg, Mapping):
        return cfg
    cfg = getattr(traj, "config", None)
    return cfg.to_dict() if hasattr(cfg, "to_dict") else {}


class _Row:
    """One trajectory's replay state: its cache (K/V/β, row map), clock, probes and scores."""

    def __init__(
        self,
        traj: Replayable,
        positions: Sequence[int] | None,
        layout: ModelLayout,
        device: torch.device,
        i: int,
        temperature: float | None = None,
    ) -> None:
        self.tokens = [int(t) for t in traj.token_ids]
        self.temperature = temperature if temperature is not None else sampling_temperature(traj)
        self.targets = scored_positions(traj, positions, i)
        self.end = self.targets[-1] if self.targets else 0  # tokens [0, end) must be fed
        cfg = _session_config(traj)
        self.n_probe = int(cfg.get("n_probe_queries", 256))
        self.ridge = float(cfg.get("ridge", 1e-4))
        self.events = checked_events(traj, i, self.end)  # later ones change no score
        self.index, self.layout, self.device = i, layout, device
        self.next_event = 0
        self.k: torch.Tensor | None = None  # [L, H_kv, T, d]
        self.v: torch.Tensor | None = None
        self.beta = torch.zeros(layout.n_layers, layout.n_kv_heads, 0, device=device)  # float32, no grad
        self.has_beta = False
        self.row_map = RowMap()
        self.fed = 0
        self.probe_chunks: list[tuple[int, torch.Tensor]] = []  # (first position, [L, H_q, n, d])
        self.harvest: Any = None  # set per call: the scratch forward of repeat probes
        self.scored_pos: list[torch.Tensor] = []
        self.scored_lp: list[torch.Tensor] = []
        self.scored_ent: list[torch.Tensor] = []
        self.scored_logits: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def segment(self, cap: int) -> int:
        """Tokens to feed in the next round: up to the next event, the end, or ``cap``."""
        stop = self.events[self.next_event].logical_len if self.next_event < len(self.events) else self.end
        return min(stop, self.fed + cap) - self.fed

    def probe_floor(self) -> int | None:
        """Smallest logical position whose query a remaining ``suffix`` event reads, or ``None``."""
        floors = [
            e.probe_logical_range[0]
            for e in self.events[self.next_event :]
            if replay_needs_probes(e.mode, e.refit_values)
            and e.probe_source in SUFFIX_SOURCES
            and e.probe_logical_range
        ]
        return min(floors) if floors else None

    def labels(self, n: int) -> list[tuple[int, int]]:
        """``(column, target token)`` for the new columns whose next token is scored."""
        lo = bisect.bisect_left(self.targets, self.fed + 1)
        hi = bisect.bisect_right(self.targets, self.fed + n)
        return [(p - 1 - self.fed, self.tokens[p]) for p in self.targets[lo:hi]]

    def append(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None) -> None:
        """Add ``n`` fed tokens' K/V ``[L, H_kv, n, d]`` (and queries ``[L, H_q, n, d]``)."""
        n = keys.shape[2]
        self.k = keys if self.k is None else torch.cat([self.k, keys], dim=2)
        self.v = values if self.v is None else torch.cat([self.v, values], dim=2)
        self.beta = F.pad(self.beta, (0, n))
        self.row_map.append(self.fed, n)
        floor = self.probe_floor()
        if queries is not None and floor is not None:
            skip = max(0, floor - self.fed)
            if skip < n:
                self.probe_chunks.append((self.fed + skip, queries[:, :, skip:]))
        self.fed += n

    def collect(self, values: list[torch.Tensor]) -> torch.Tensor:
        """Scores aligned to the tokens: float32 (float64 for a float64 model), 0 where not scored."""
        if not values:
            return torch.zeros(len(self.tokens), device=self.device)
        flat = torch.cat(values)
        flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
        return flat.new_zeros(len(self.tokens)).index_put((torch.cat(self.scored_pos),), flat)

    # ---------------------------------------------------------------- events
    def due(self) -> bool:
        """Whether the next event fires now (``event.logical_len`` tokens fed)."""
        return self.next_event < len(self.events) and self.events[self.next_event].logical_len == self.fed

    def prune_probes(self) -> None:
        """Drop recorded queries that no remaining event reads."""
        floor = self.probe_floor()
        self.probe_chunks = [] if floor is None else [
            (a, q) for a, q in self.probe_chunks if a + q.shape[2] > floor
        ]  # fmt: skip

    def prepare(self) -> _Job:
        """The next (due) event's inputs to :func:`apply_event`, checked against the record."""
        ev = self.events[self.next_event]
        lay = self.layout
        lh = lay.n_layers * lay.n_kv_heads
        if self.length != ev.kv_len_before:
            raise InvalidArgumentError(
                f"trajectory {self.index}, event {ev.index}: the replayed cache holds {self.length} rows "
                f"after {self.fed} tokens but the rollout held {ev.kv_len_before}; the trajectory's events do "
                "not belong to its tokens (or it was produced by a different engine configuration)"
            )
        start, end = ev.span
        if self.row_map.logical_span(start, end) != ev.logical_span:
            raise InvalidArgumentError(
                f"trajectory {self.index}, event {ev.index}: rows {ev.span} stand for logical tokens "
                f"{self.row_map.logical_span(start, end)} in the replay but {ev.logical_span} in the record"
            )
        keys = self.k.reshape(lh, self.length, -1)
        recorded = ev.recorded_beta()
        return _Job(
            row=self,
            event=ev,
            keys=keys,
            values=self.v.reshape(lh, self.length, -1),
            probes=self._probes(ev, keys) if replay_needs_probes(ev.mode, ev.refit_values) else None,
            key_bias=self.beta.reshape(lh, self.length) if self.has_beta else None,
            indices=ev.forced_indices(),
            beta=recorded,
        )

    def splice(self, job: _Job, block_k: torch.Tensor, block_v: torch.Tensor, block_beta: torch.Tensor | None,
               through: bool) -> None:  # fmt: skip
        """Replace the event's span by its block ``[L·H_kv, t, d]`` (and β) and advance to the next event."""
        ev, lay = job.event, self.layout
        start, end = ev.span
        t = ev.target
        if not through:
            block_k, block_v = block_k.detach(), block_v.detach()
        shape = (lay.n_layers, lay.n_kv_heads, t)
        block_k = block_k.reshape(*shape, self.k.shape[-1])
        block_v = block_v.reshape(*shape, self.v.shape[-1])
        self.k = torch.cat([self.k[:, :, :start], block_k, self.k[:, :, end:]], dim=2)
        self.v = torch.cat([self.v[:, :, :start], block_v, self.v[:, :, end:]], dim=2)
        beta = (
            self.beta.new_zeros(shape) if block_beta is None else block_beta.detach().reshape(shape).float()
        )
        self.beta = torch.cat([self.beta[:, :, :start], beta, self.beta[:, :, end:]], dim=2)
        if block_beta is not None and t and not self.has_beta:
            # a recorded β is read on the host (no device sync); a refitted one (old records) on the device
            src = job.beta if job.beta is not None else block_beta
            self.has_beta = bool(src.abs().max() > 0)
        self.row_map.replace(start, end, t, ev.logical_span)
        if self.length != ev.kv_len_after:
            raise InvalidArgumentError(
                f"trajectory {self.index}, event {ev.index}: {self.length} rows after replaying the event, "
                f"the rollout had {ev.kv_len_after}"
            )
        self.next_event += 1

    def _probes(self, ev: CompactionEvent, keys: torch.Tensor) -> torch.Tensor:
        """The event's probe queries ``[L·H_kv, n, d]``, regenerated from the replay."""
        lay = self.layout
        where = f"trajectory {self.index}, event {ev.index}"
        rows = queries = repeat_q = None
        if ev.probe_source in ("keys", "suffix") and ev.probe_logical_range is None:
            raise InvalidArgumentError(f"{where}: {ev.probe_source} probes without a probe_logical_range")
        if ev.probe_source == "keys":
            rows = key_probe_rows(ev, self.row_map, self.length, self.n_probe, where)
        elif ev.probe_source in SUFFIX_SOURCES and ev.probe_logical_range is not None:
            a, b = ev.probe_logical_range
            parts = []
            for first, q in self.probe_chunks:
                lo, hi = max(a, first), min(b, first + q.shape[2])
                if lo < hi:
                    parts.append(q[:, :, lo - first : hi - first])
            got = sum(p.shape[2] for p in parts)
            if got != b - a:
                raise InvalidArgumentError(
                    f"{where}: suffix probes need the queries of logical "
                    f"positions [{a}, {b}) but only {got} of them were fed before the event"
                )
            queries = torch.cat(parts, dim=2)
        if ev.probe_source in REPEAT_SOURCES:
            if not ev.probe_tokens:
                raise InvalidArgumentError(f"{where}: {ev.probe_source} probes without probe_tokens")
            repeat_q = self.harvest(self, ev.probe_tokens, self.fed)
        try:
            return event_probes(
                ev.probe_source, keys, n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads, n_probe=self.n_probe,
                event_index=ev.index, seed=ev.probe_seed, rows=rows, queries=queries, repeat_queries=repeat_q,
            )  # fmt: skip
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"trajectory {self.index}: {exc}") from None


@dataclass
class _Job:
    """One due event's :func:`apply_event` inputs on its row's whole cache (``[L·H_kv, T, ·]``)."""

    row: _Row
    event: CompactionEvent
    keys: torch.Tensor
    values: torch.Tensor
    probes: torch.Tensor | None
    key_bias: torch.Tensor | None
    indices: torch.Tensor  # [L·H_kv, t], host
    beta: torch.Tensor | None  # recorded β [L·H_kv, t], host

    def group(self) -> tuple | None:
        """Jobs with equal keys are computed by one call; ``None``: on its own (a record without
        β whose β is refitted, which this path leaves to the reference code)."""
        ev = self.event
        if ev.compute_beta and self.beta is None:
            return None
        start, end = ev.span
        return (
            ev.mode, ev.compute_beta, ev.refit_values, end - start, ev.target, self.row.ridge,
            None if self.probes is None else self.probes.shape[2],
            self.key_bias is not None, self.beta is not None,
            self.keys.dtype, self.values.dtype, None if self.probes is None else self.probes.dtype,
        )  # fmt: skip

    def run(self) -> Any:
        """:func:`apply_event` on the whole cache (the reference path)."""
        ev, row = self.event, self.row
        return apply_event(
            self.keys, self.values, self.probes, mode=ev.mode, span=ev.span, target=ev.target,
            compute_beta=ev.compute_beta, scale=row.layout.scale, key_bias=self.key_bias, ridge=row.ridge,
            indices=self.indices.to(row.device), beta=None if self.beta is None else self.beta.to(row.device),
            differentiable=torch.is_grad_enabled(), refit_values=ev.refit_values,
        )  # fmt: skip


def _apply_due_events(rows: list[_Row], through: bool, batched: bool) -> None:
    """Apply every event due after this round's forward (a row may have several in a row)."""
    while due := [r for r in rows if r.due()]:
        jobs = [r.prepare() for r in due]
        if batched:
            _run_grouped(jobs, through)
        else:
            for job in jobs:
                res = job.run()
                job.row.splice(job, res.keys, res.values, res.beta, through)
    for r in rows:
        r.prune_probes()


def _run_grouped(jobs: list[_Job], through: bool) -> None:
    """One :func:`apply_event` per group of alike jobs, on the rows of each job's span.

    A recorded event's block reads only its span (scores, softmaxes and the C2 target are over the
    span's columns; kept indices lie inside it), so the spans of several trajectories are stacked on
    the batch axis with indices shifted to the span: the same math as per event, in one call.
    """
    groups: dict[tuple, list[_Job]] = {}
    for job in jobs:
        key = job.group()
        if key is None:
            res = job.run()
            job.row.splice(job, res.keys, res.values, res.beta, through)
        else:
            groups.setdefault(key, []).append(job)
    for members in groups.values():
        first = members[0]
        ev, row = first.event, first.row
        width = ev.span[1] - ev.span[0]
        probes = mask = None
        if first.probes is not None:
            probes, mask = _pad_probes([j.probes for j in members])
        res = apply_event(
            _cat([_span_rows(j.keys, j) for j in members]),
            _cat([_span_rows(j.values, j) for j in members]),
            probes,
            mode=ev.mode, span=(0, width), target=ev.target, compute_beta=ev.compute_beta,
            scale=row.layout.scale, ridge=row.ridge,
            key_bias=_cat([_span_rows(j.key_bias, j) for j in members]) if first.key_bias is not None else None,
            indices=_cat([j.indices - j.event.span[0] for j in members]).to(row.device),
            beta=_cat([j.beta for j in members]).to(row.device) if first.beta is not None else None,
            differentiable=torch.is_grad_enabled(), refit_values=ev.refit_values, query_mask=mask,
        )  # fmt: skip
        sizes = [j.keys.shape[0] for j in members]
        parts = zip(
            res.keys.split(sizes),
            res.values.split(sizes),
            res.beta.split(sizes) if res.beta is not None else [None] * len(members),
        )
        for job, (k, v, b) in zip(members, parts):
            job.row.splice(job, k, v, b, through)


def _span_rows(x: torch.Tensor, job: _Job) -> torch.Tensor:
    """``x``'s rows of ``job``'s span (axis 1)."""
    return x[:, job.event.span[0] : job.event.span[1]]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _pad_probes(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probes ``[B_i, n_i, d]`` stacked as ``[ΣB_i, max n_i, d]`` (zero rows appended) and the mask
    of real ones (``None`` when all ``n_i`` are equal): suffix probe counts differ per event."""
    sizes = [p.shape[1] for p in parts]
    width = max(sizes)
    if min(sizes) == width:
        return _cat(parts), None
    padded = torch.cat([F.pad(p, (0, 0, 0, width - p.shape[1])) for p in parts])
    arange = torch.arange(width, device=padded.device)
    mask = torch.cat([(arange < n).expand(p.shape[0], width) for p, n in zip(parts, sizes)])
    return padded, mask


# ------------------------------------------------------------------------------------ forward
def _forward(
    model: torch.nn.Module,
    rows: list[_Row],
    layout: ModelLayout,
    fused: bool,
    compute_entropy: bool,
    return_logits: bool,
    cap: int,
) -> None:
    """One batched round: every row feeds its next segment; scores are stored on the rows."""
    device = rows[0].device
    sizes = [r.segment(cap) for r in rows]
    assert all(n > 0 for n in sizes)
    width, batch = max(sizes), len(rows)
    ids = torch.zeros(batch, width, dtype=torch.long)
    pos = torch.zeros(batch, width, dtype=torch.long)
    for b, (r, n) in enumerate(zip(rows, sizes)):
        ids[b, :n] = torch.tensor(r.tokens[r.fed : r.fed + n])
        pos[b, :n] = torch.arange(r.fed, r.fed + n)
        pos[b, n:] = r.fed + n - 1
    past = [r.length for r in rows]
    groups = layout.n_q_heads // layout.n_kv_heads
    rnd = ReplayRound(
        past_keys=_stack_past([r.k for r in rows], max(past), layout),
        past_values=_stack_past([r.v for r in rows], max(past), layout),
        beta=_stack_beta(rows, max(past) + width) if any(r.has_beta for r in rows) else None,
        mask=round_mask(past, sizes, groups, device),
        record_queries=any(r.probe_floor() is not None for r in rows),
    )
    labels = [r.labels(n) for r, n in zip(rows, sizes)]
    kwargs: dict[str, Any] = {
        "input_ids": ids.to(device),
        "position_ids": pos.to(device),
        "use_cache": False,
        "replay_round": rnd,
    }
    if fused:
        shift = torch.full((batch, width), -100, dtype=torch.long)
        for b, lab in enumerate(labels):
            for c, tok in lab:
                shift[b, c] = tok
        out = model(**kwargs, shift_labels=shift.to(device), fused_lm_head=True)
        for b, (r, lab) in enumerate(zip(rows, labels)):
            if lab:
                cols = torch.tensor([c for c, _ in lab], device=device)
                r.scored_pos.append(cols + r.fed + 1)
                r.scored_lp.append(out.log_probs[b, cols])
                if compute_entropy:
                    r.scored_ent.append(out.entropy[b, cols])
    else:
        cols = sorted({c for lab in labels for c, _ in lab}) or [width - 1]
        where = {c: j for j, c in enumerate(cols)}
        logits = model(**kwargs, logits_to_keep=torch.tensor(cols, device=device)).logits
        for b, (r, lab) in enumerate(zip(rows, labels)):
            if not lab:
                continue
            sel = logits[b, [where[c] for c, _ in lab]]
            sel = sel.to(torch.promote_types(sel.dtype, torch.float32)) / r.temperature
            logp = torch.log_softmax(sel, dim=-1)
            tok = torch.tensor([t for _, t in lab], device=device)
            r.scored_pos.append(torch.tensor([c for c, _ in lab], device=device) + r.fed + 1)
            r.scored_lp.append(logp.gather(-1, tok[:, None])[:, 0])
            if compute_entropy:
                r.scored_ent.append(-(logp.exp() * logp).sum(-1))
            if return_logits:
                r.scored_logits.append(sel)
    # one stack per tensor kind for the whole batch ([B, L, H, N, d]), then a view per row: a
    # constant number of operations per round instead of 3 x (layers + 1) per row
    layers = range(layout.n_layers)
    keys = torch.stack([rnd.keys[layer] for layer in layers], dim=1)
    values = torch.stack([rnd.values[layer] for layer in layers], dim=1)
    queries = torch.stack([rnd.queries[layer] for layer in layers], dim=1) if rnd.record_queries else None
    for b, (r, n) in enumerate(zip(rows, sizes)):
        r.append(keys[b, :, :, :n], values[b, :, :, :n], None if queries is None else queries[b, :, :, :n])


def _harvest(
    model: torch.nn.Module, row: _Row, layout: ModelLayout, token_ids: Sequence[int], start: int
) -> torch.Tensor:
    """Post-RoPE queries ``[L, H_q, n, d]`` of ``token_ids`` fed at logical positions ``start ..``
    over ``row``'s cache as it stands (its β included), without changing the row: the engine's
    scratch forward of ``repeat`` probes (``engine.compactor.harvest_queries``), rebuilt. The
    queries are constants (no gradient), like the recorded β."""
    n, device = len(token_ids), row.device
    groups = layout.n_q_heads // layout.n_kv_heads
    rnd = ReplayRound(
        past_keys=_stack_past([row.k], row.length, layout),
        past_values=_stack_past([row.v], row.length, layout),
        beta=_stack_beta([row], row.length + n) if row.has_beta else None,
        mask=round_mask([row.length], [n], groups, device),
        record_queries=True,
    )
    with torch.no_grad():
        model(
            input_ids=torch.tensor([list(token_ids)], device=device),
            position_ids=torch.arange(start, start + n, device=device)[None],
            use_cache=False,
            replay_round=rnd,
            logits_to_keep=1,
        )
    return torch.stack([rnd.queries[layer][0, :, :n] for layer in range(layout.n_layers)]).detach()


def _stack_past(caches: list[torch.Tensor | None], width: int, layout: ModelLayout) -> list[torch.Tensor]:
    """Per layer ``[B, H_kv, width, d]``: each row's cache right-padded with zeros."""
    template = next((c for c in caches if c is not None), None)
    if template is None:
        return [None] * layout.n_layers  # type: ignore[list-item]  (first round: nothing in any cache)
    padded = []
    for c in caches:
        if c is None:
            c = template.new_zeros(*template.shape[:2], 0, template.shape[-1])
        padded.append(F.pad(c, (0, 0, 0, width - c.shape[2])) if c.shape[2] < width else c)
    stacked = torch.stack(padded)  # [B, L, H_kv, width, d]
    return [stacked[:, layer] for layer in range(layout.n_layers)]


def _stack_beta(rows: list[_Row], width: int) -> list[torch.Tensor]:
    """Per layer ``[B, H_kv, width]`` float32: each row's β, zero on new and padded rows."""
    stacked = torch.stack([F.pad(r.beta, (0, width - r.beta.shape[2])) for r in rows])
    return [stacked[:, layer] for layer in range(stacked.shape[1])]
