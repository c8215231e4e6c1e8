"""Episodes: one agent on one env (:func:`run_episode`), or many on one backend (:func:`run_episodes`).

:func:`run_episodes`: ``W`` workers (env + agent pairs sharing one backend) play a queue of seeds,
and a worker whose episode ends starts the next seed at once. Two schedules (docs/agents.md,
"Batching"):

* **continuous** (on a :class:`~compaction_gym.backends.ContinuousBackend`, the default there):
  each worker's turn is submitted as soon as its env has stepped, and the backend advances
  everything in flight one decode round at a time, so an episode never waits for the others'
  replies;
* **lock-step** (any backend): every turn all active agents act through one ``step_batch``, which
  lasts as long as the longest reply.

Each session has its own RNG stream seeded from the episode seed, and a backend's results do not
depend on what ran beside them, so both schedules give the trajectories of running the same seeds
one by one with :func:`run_episode`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym

from compaction_gym.agents.agent import CompactionAgent, act_batch
from compaction_gym.agents.trajectory import Trajectory
from compaction_gym.backends import ContinuousBackend
from compaction_gym.engine.types import StepRequest
from compaction_gym.errors import CapacityError, InvalidArgumentError

#: ``teacher(env) -> action``: forces the action of each turn (e.g. the BabyAI expert bot).
Teacher = Callable[[gym.Env], str]


def env_id_of(env: gym.Env) -> str:
    """The registered id of ``env`` (``""`` if it was not made by ``gym.make``)."""
    spec = getattr(env, "spec", None)
    return spec.id if spec is not None else ""


def run_episode(
    env: gym.Env,
    agent: CompactionAgent,
    *,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    teacher: Teacher | None = None,
    close_session: bool = True,
) -> Trajectory:
    """Play one episode: reset, act until terminated or truncated, attach rewards and info.

    Args:
        env: a text env; ``info["instruction"]`` after ``reset``, when present, becomes the
            session's protected first message (else the first observation is the prompt).
        agent: the agent (its previous session is closed on reset).
        seed: the env's reset seed, also the episode seed of the agent's sampling stream.
        options: passed to ``env.reset``.
        teacher: if given, every action is ``teacher(env)``, teacher-forced into the session.
        close_session: close the backend session when the episode ends (frees the slot);
            ``False`` keeps it for inspection until the agent's next ``reset``/``close``.

    Returns:
        The finished :class:`Trajectory`. If the backend refuses a step (``CapacityError``: the
        session outgrew its cache) the episode stops there with ``info["aborted"]`` set.
    """
    obs, info = env.reset(seed=seed, options=options)
    agent.reset(info.get("instruction"), seed=seed, env_id=env_id_of(env))
    terminated = truncated = False
    while not (terminated or truncated):
        try:
            text = agent.act(obs) if teacher is None else agent.force(obs, teacher(env))
        except CapacityError as exc:
            agent.abort(f"CapacityError: {exc}")
            break
        obs, reward, terminated, truncated, info = env.step(text)
        agent.observe(reward, info)
    traj = agent.finish({**info, "terminated": bool(terminated), "truncated": bool(truncated)})
    if close_session:
        agent.close()
    return traj


def run_episodes(
    envs: Sequence[gym.Env],
    agents: Sequence[CompactionAgent],
    seeds: Sequence[int | None],
    *,
    options: dict[str, Any] | None = None,
    teacher: Teacher | None = None,
    on_episode: Callable[[int, Trajectory], None] | None = None,
    continuous: bool | None = None,
    round_steps: int = 1,
    merge_prefill: bool = False,
) -> list[Trajectory]:
    """Play ``len(seeds)`` episodes on ``len(envs)`` workers that share one backend.

    Args:
        envs: one env per worker.
        agents: one agent per worker, all on the same backend (which needs a free slot each).
        seeds: episode seeds, played in order as workers free up.
        options: passed to every ``env.reset``.
        teacher: force every action with ``teacher(env)`` (see :func:`run_episode`).
        on_episode: called as ``on_episode(index, trajectory)`` when episode ``index`` ends.
        continuous: ``None`` (default): each episode advances on its own where the backend is a
            :class:`~compaction_gym.backends.ContinuousBackend`, else lock-step; ``True``: require
            it; ``False``: lock-step (one ``step_batch`` per turn across the workers).
        round_steps: continuous mode only: decode steps per ``advance`` round, i.e. how long a
            finished reply may wait before its env steps (1: none; more: fewer host round trips).
        merge_prefill: continuous mode only: submit turns with ``prefill=False``, so their inputs
            are fed in the next round's forward beside the other episodes' decode step (fewer
            forwards: for launch-bound GPUs; on CPU the padded batch costs more than it saves,
            docs/benchmarks.md).

    Returns:
        The trajectories in the order of ``seeds`` (equal in both schedules: the backend's
        results do not depend on what ran beside them). With agents of different configurations
        and more seeds than workers, which agent plays which seed depends on when workers free
        up, which differs between the schedules.

    Raises:
        InvalidArgumentError: mismatched ``envs``/``agents``, agents on different backends, a bad
            ``continuous``, ``round_steps`` or ``merge_prefill``, or ``continuous=True`` on a
            backend without ``submit``/``advance``.

    Example:
        >>> envs = [gym.make("AttnMatch-BabyAI-GoTo-v0") for _ in range(4)]  # doctest: +SKIP
        >>> agents = [CompactionAgent(backend) for _ in range(4)]  # doctest: +SKIP
        >>> trajs = run_episodes(envs, agents, seeds=range(16))  # doctest: +SKIP
    """
    if len(envs) != len(agents) or not envs:
        raise InvalidArgumentError(
            f"run_episodes needs as many agents as envs (>= 1), got {len(envs)} and {len(agents)}"
        )
    backend = agents[0].backend
    if any(a.backend is not backend for a in agents):
        raise InvalidArgumentError("run_episodes needs agents that share one backend object")
    if continuous is not None and not isinstance(continuous, bool):
        raise InvalidArgumentError(f"continuous must be True, False or None, got {continuous!r}")
    if isinstance(round_steps, bool) or not isinstance(round_steps, int) or round_steps < 1:
        raise InvalidArgumentError(f"round_steps must be a positive int, got {round_steps!r}")
    if not isinstance(merge_prefill, bool):
        raise InvalidArgumentError(f"merge_prefill must be a bool, got {merge_prefill!r}")
    supported = isinstance(backend, ContinuousBackend)
    if continuous and not supported:
        raise InvalidArgumentError(
            f"continuous=True needs a backend with submit/advance (a ContinuousBackend, e.g. LocalBackend); "
            f"{type(backend).__name__} has none: pass continuous=False or None (lock-step)"
        )
    workers = _Workers(envs, agents, seeds, options, on_episode)
    if supported and continuous is not False:
        _play_continuous(workers, backend, teacher, round_steps, not merge_prefill)
    else:
        _play_lockstep(workers, teacher)
    return workers.results  # type: ignore[return-value]


class _Workers:
    """The seed queue, each worker's current episode, and the results (both schedules share it)."""

    def __init__(
        self,
        envs: Sequence[gym.Env],
        agents: Sequence[CompactionAgent],
        seeds: Sequence[int | None],
        options: dict[str, Any] | None,
        on_episode: Callable[[int, Trajectory], None] | None,
    ) -> None:
        self.envs, self.agents = list(envs), list(agents)
        self.options, self.on_episode = options, on_episode
        self.queue = deque(enumerate(seeds))
        self.results: list[Trajectory | None] = [None] * len(self.queue)
        # per worker: [episode index, current observation, last info], or None when idle
        self.state: list[list[Any] | None] = [None] * len(envs)
        for w in range(len(envs)):
            self.start(w)

    def active(self) -> list[int]:
        return [w for w, s in enumerate(self.state) if s is not None]

    def start(self, w: int) -> bool:
        """Start the next queued seed on worker ``w``; whether there was one."""
        self.state[w] = None
        if not self.queue:
            return False
        index, seed = self.queue.popleft()
        env = self.envs[w]
        obs, info = env.reset(seed=seed, options=self.options)
        self.agents[w].reset(info.get("instruction"), seed=seed, env_id=env_id_of(env))
        self.state[w] = [index, obs, info]
        return True

    def request(self, w: int, teacher: Teacher | None) -> StepRequest:
        """Worker ``w``'s next turn, for the backend."""
        forced = teacher(self.envs[w]) if teacher is not None else None
        return self.agents[w].request(self.state[w][1], forced)

    def take(self, w: int, text: str) -> bool:
        """Step ``w``'s env with the agent's ``text``; whether ``w`` has a next turn (this or a new episode)."""
        obs, reward, terminated, truncated, info = self.envs[w].step(text)
        self.agents[w].observe(reward, info)
        self.state[w][1:] = [obs, info]
        if terminated or truncated:
            return self.end(w, {**info, "terminated": bool(terminated), "truncated": bool(truncated)})
        return True

    def abort(self, w: int, exc: CapacityError) -> bool:
        """Stop ``w``'s episode where the backend refused it; whether ``w`` starts another."""
        self.agents[w].abort(f"CapacityError: {exc}")
        return self.end(w, {**self.state[w][2], "terminated": False, "truncated": False})

    def end(self, w: int, info: dict[str, Any]) -> bool:
        index = self.state[w][0]
        traj = self.agents[w].finish(info)
        self.agents[w].close()
        self.results[index] = traj
        if self.on_episode is not None:
            self.on_episode(index, traj)
        return self.start(w)


def _play_lockstep(workers: _Workers, teacher: Teacher | None) -> None:
    """Every turn, all active workers act through one ``step_batch``."""
    while active := workers.active():
        forced = [teacher(workers.envs[w]) for w in active] if teacher is not None else None
        texts = _act_all([workers.agents[w] for w in active], [workers.state[w][1] for w in active], forced)
        for w, text in zip(active, texts):
            if isinstance(text, CapacityError):
                workers.abort(w, text)
            else:
                workers.take(w, text)


def _play_continuous(
    workers: _Workers, backend: ContinuousBackend, teacher: Teacher | None, round_steps: int, prefill: bool
) -> None:
    """Each worker's turn is submitted as soon as its env has stepped; one decode round per ``advance``."""
    in_flight: dict[str, int] = {}  # session id -> worker
    ready = workers.active()
    while ready or in_flight:
        if ready:  # workers whose episode was refused and who started another are submitted again
            ready = _submit(workers, backend, ready, teacher, in_flight, prefill)
            continue
        for result in backend.advance(round_steps):
            w = in_flight.pop(result.session_id)
            if workers.take(w, workers.agents[w].record(result)):
                ready.append(w)


def _submit(
    workers: _Workers,
    backend: ContinuousBackend,
    ready: list[int],
    teacher: Teacher | None,
    in_flight: dict[str, int],
    prefill: bool,
) -> list[int]:
    """Submit the turns of ``ready`` in one call; a turn refused for capacity aborts its episode.

    Returns the workers that started a new episode after such an abort (their first turn is not
    submitted yet).
    """
    todo: list[tuple[int, StepRequest]] = []
    restarted: list[int] = []
    for w in ready:
        try:  # a single-step env's session is created here: no free slot is a refusal too
            todo.append((w, workers.request(w, teacher)))
        except CapacityError as exc:
            if workers.abort(w, exc):
                restarted.append(w)
    while todo:
        try:
            ids = backend.submit([req for _, req in todo], prefill=prefill)
        except CapacityError as exc:  # atomic: nothing was submitted; drop the request it names
            i = getattr(exc, "request_index", None)
            if i is None and len(todo) > 1:  # not told which: one at a time
                for w, req in todo:
                    restarted += _submit_one(workers, backend, w, req, in_flight, prefill)
                return restarted
            w, _ = todo.pop(i or 0)
            if workers.abort(w, exc):
                restarted.append(w)
            continue
        in_flight.update(zip(ids, (w for w, _ in todo)))
        break
    return restarted


def _submit_one(
    workers: _Workers,
    backend: ContinuousBackend,
    w: int,
    req: StepRequest,
    in_flight: dict[str, int],
    prefill: bool,
) -> list[int]:
    try:
        in_flight[backend.submit([req], prefill=prefill)[0]] = w
    except CapacityError as exc:
        return [w] if workers.abort(w, exc) else []
    return []


def _act_all(
    agents: list[CompactionAgent], observations: list[str], forced: list[str] | None
) -> list[str | CapacityError]:
    """``act_batch``; if the batch is refused for capacity, retry one by one to find who does not fit."""
    try:
        return list(act_batch(agents, observations, forced))
    except CapacityError:
        pass
    out: list[str | CapacityError] = []
    for i, (agent, obs) in enumerate(zip(agents, observations)):
        try:
            out.append(agent.act(obs) if forced is None else agent.force(obs, forced[i]))
        except CapacityError as exc:
            out.append(exc)
    return out
