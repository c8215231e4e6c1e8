"""``CompactionAgent``: an LLM agent whose whole episode lives in one compacted KV session.

Per episode: :meth:`CompactionAgent.reset` opens a session whose protected prompt is the env's
instruction (the first user message); every :meth:`~CompactionAgent.act` appends the next user
message through the chat template (see :mod:`compaction_gym.agents.chat`), lets the backend
generate, and returns the model's text. :meth:`~CompactionAgent.force` appends a given action
instead (teacher forcing) with ``max_new_tokens=0`` and ``response_complete=True``, so
compaction triggers (KV-budget and turn-based) still fire.
Everything is recorded in :attr:`~CompactionAgent.trajectory`.

:func:`act_batch` steps many agents that share one backend with a single ``step_batch`` call.
A caller that schedules turns itself (the continuous rollouts of
:func:`~compaction_gym.agents.run_episodes`) splits a turn in two: :meth:`~CompactionAgent.request`
builds it, :meth:`~CompactionAgent.record` consumes the backend's result; ``act_batch`` is the same
two calls around one ``step_batch``.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from compaction_gym.agents.chat import ChatFormat
from compaction_gym.agents.prompts import PromptFormat, get_prompt_format
from compaction_gym.agents.trajectory import Trajectory, Turn, jsonable
from compaction_gym.backends import Backend
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import StepRequest, StepResult
from compaction_gym.errors import InvalidArgumentError, UnknownSessionError

#: ``info`` keys read, in order, for the action the env executed (BabyAI, math).
ACTION_INFO_KEYS = ("action", "extracted")


@dataclass
class _Plan:
    """One agent's next backend call, before it is made."""

    observation: str
    message: str
    input_ids: list[int]
    forced_ids: list[int] | None = None
    forced_text: str = ""
    prompt_is_input: bool = False  # single-step envs: the creation prompt is this turn's input

    @property
    def new_ids(self) -> list[int]:
        return self.input_ids + (self.forced_ids or [])


class CompactionAgent:
    """An LLM agent holding one persistent, compacted session per episode.

    Args:
        backend: any :class:`~compaction_gym.backends.Backend` (e.g. :class:`~compaction_gym.backends.LocalBackend`).
        tokenizer: the model's tokenizer (default: ``backend.tokenizer``).
        compaction: the session's :class:`CompactionConfig` (default: no compaction). With
            ``inject_budget_message`` or ``inject_budget_every`` and no ``budget_message_frame``, the frame is set from the
            chat template (:meth:`ChatFormat.message_frame`), so the engine's budget messages
            follow this agent's template.
        sampling: per-turn :class:`SamplingParams` (default: greedy, the prompt format's
            ``max_new_tokens``). Its ``seed`` and the episode seed seed the session's RNG stream.
        prompt: ``"balrog"`` (BALROG's plain agent), ``"reasoning"`` (``<think>`` then
            ``<action>``), ``"raw"`` (observation verbatim) or a :class:`PromptFormat`.
        system_prompt: optional system message before the instruction.
        chat_template, chat_template_kwargs: override the tokenizer's template / pass template
            variables (e.g. ``{"enable_thinking": False}``).
        model_name: recorded in trajectories (default: ``backend.name``).

    Example:
        >>> backend = LocalBackend.from_pretrained("path/to/model")  # doctest: +SKIP
        >>> agent = CompactionAgent(backend, compaction=CompactionConfig(mode="attention_matching",
        ...                         max_kv_len=2048), prompt="balrog")  # doctest: +SKIP
        >>> obs, info = env.reset(seed=0)  # doctest: +SKIP
        >>> agent.reset(info["instruction"], seed=0)  # doctest: +SKIP
        >>> obs, reward, terminated, truncated, info = env.step(agent.act(obs))  # doctest: +SKIP
    """

    def __init__(
        self,
        backend: Backend,
        tokenizer: Any = None,
        *,
        compaction: CompactionConfig | None = None,
        sampling: SamplingParams | None = None,
        prompt: str | PromptFormat = "balrog",
        system_prompt: str | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        model_name: str | None = None,
    ) -> None:
        self.backend = backend
        self.prompt_format = get_prompt_format(prompt)
        self.compaction = compaction if compaction is not None else CompactionConfig()
        self.sampling = (
            sampling
            if sampling is not None
            else SamplingParams(temperature=0.0, max_new_tokens=self.prompt_format.max_new_tokens)
        )
        if not isinstance(self.compaction, CompactionConfig) or not isinstance(self.sampling, SamplingParams):
            raise InvalidArgumentError("compaction must be a CompactionConfig and sampling a SamplingParams")
        tok = tokenizer if tokenizer is not None else backend.tokenizer
        self.chat = ChatFormat(
            tok,
            system_prompt=system_prompt,
            chat_template=chat_template,
            template_kwargs=chat_template_kwargs,
        )
        if self.compaction.injects_budget and self.compaction.budget_message_frame is None:
            with warnings.catch_warnings():  # the config already warned when it was made
                warnings.simplefilter("ignore")
                # budget messages framed as a user turn of this agent's template (docs/agents.md)
                self.compaction = self.compaction.replace(budget_message_frame=self.chat.message_frame())
        self.tokenizer = tok
        self.model_name = model_name if model_name is not None else str(backend.name)
        self.eos_token_ids = _eos_ids(backend, tok)
        self._closing = self.chat.next_user_text("probe")  # what follows an assistant message's content
        self.session_id: str | None = None
        self._traj: Trajectory | None = None
        self._session_seed: int | None = None
        self._tail = ""  # text of the stop token that ended the last output (part of the template's closing)
        self._asked: _Plan | None = None  # the turn built by request(), awaiting its result
        self._episodes = 0
        self._t0 = 0.0

    # ------------------------------------------------------------------ episode
    @property
    def trajectory(self) -> Trajectory:
        """The current (or last finished) episode's record."""
        if self._traj is None:
            raise InvalidArgumentError("no episode yet: call reset(instruction) first")
        return self._traj

    def reset(self, instruction: str | None = None, *, seed: int | None = None, env_id: str = "") -> None:
        """Start an episode: close the previous session and open one on ``instruction``.

        Args:
            instruction: the first user message (BabyAI: ``info["instruction"]``), prefilled as
                the protected prompt. ``None`` (single-step envs such as math): the session is
                created at the first :meth:`act` with the framed observation as its prompt.
            seed: the episode seed; with ``sampling.seed`` it seeds the session's RNG stream.
            env_id: recorded in the trajectory.
        """
        self.close()
        if seed is None and self.sampling.seed is None:
            self._session_seed = None  # nondeterministic, as asked
        else:  # without an episode seed, a fixed sampling seed still varies across episodes
            self._session_seed = _derive_seed(
                self.sampling.seed, seed if seed is not None else -1 - self._episodes
            )
        self._episodes += 1
        self._tail = ""
        self._asked = None
        self._t0 = time.perf_counter()
        self._traj = Trajectory(
            compaction=self.compaction.to_dict(),
            sampling=jsonable(self.sampling.replace(seed=self._session_seed).to_dict()),
            model=self.model_name,
            instruction=instruction or "",
            prompt_format=self.prompt_format.name,
            env_id=env_id,
            seed=seed,
        )
        if instruction is not None:
            if not isinstance(instruction, str) or not instruction:
                raise InvalidArgumentError(
                    f"instruction must be a non-empty str or None, got {instruction!r}"
                )
            ids = self.chat.encode(self.chat.prompt_text(instruction))
            result = self.backend.create_session(ids, self.compaction, self._creation_sampling(0))
            self.session_id = result.session_id
            self._extend(ids, result)
            self._traj.prompt_len = len(ids)

    def act(self, observation: str) -> str:
        """Append ``observation`` as the next user message, generate, and return the model's text."""
        return act_batch([self], [observation])[0]

    def force(self, observation: str, action: str) -> str:
        """Append ``observation`` and then ``action`` as the assistant's reply, without sampling.

        The action's tokens get ``completion_mask`` 0 and the turn ``forced=True`` (SFT trainers may
        use them as targets; RL trainers must not). The step is sent with ``response_complete=True``,
        so turn-based compaction runs after the forced reply as after a sampled one. Returns the assistant text as fed (the prompt
        format's ``format_action(action)``), which is also what the env should receive.
        """
        return act_batch([self], [observation], [action])[0]

    def request(self, observation: str, action: str | None = None) -> StepRequest:
        """The backend request of the next turn, for callers that submit turns themselves.

        :meth:`act` (``action=None``) or :meth:`force` split in two: send the returned request to
        the backend (``step_batch``, or ``submit`` then ``advance``), then pass its result to
        :meth:`record`. A request the backend refused may be built again. For single-step envs
        (no instruction) this opens the session first.
        """
        plan, req = self._request(observation, action)
        self._asked = plan
        return req

    def record(self, result: StepResult) -> str:
        """Take the backend's result of the last :meth:`request` into the trajectory; returns the
        action text (what :meth:`act` / :meth:`force` return)."""
        if self._asked is None:
            raise InvalidArgumentError("record() takes the result of a request(): call request() first")
        if result.session_id != self.session_id:
            raise InvalidArgumentError(
                f"record() got the result of session {result.session_id!r}, this agent's is {self.session_id!r}"
            )
        plan, self._asked = self._asked, None
        return self._record(plan, result)

    def observe(self, reward: float, info: dict[str, Any] | None = None) -> None:
        """Attach the env's reward (and the executed action, from ``info``) to the last turn."""
        traj = self.trajectory
        if not traj.turns or len(traj.rewards) >= len(traj.turns):
            raise InvalidArgumentError("observe() must follow act() or force(), once per turn")
        turn = traj.turns[-1]
        turn.reward = float(reward)
        turn.invalid_action = bool((info or {}).get("invalid_action", False))
        traj.rewards.append(float(reward))
        for key in ACTION_INFO_KEYS:
            value = (info or {}).get(key)
            if isinstance(value, str):
                turn.action = value
                break

    def finish(self, info: dict[str, Any] | None = None, *, success: bool | None = None) -> Trajectory:
        """Close the books on the episode: totals, success, JSON-safe ``info``, metrics.

        ``success`` defaults to ``info["success"]``, else ``info["progression"] > 0``, else
        ``info["score"] >= 1``, else ``total_reward > 0``. The session stays open until the next
        :meth:`reset` or :meth:`close`.
        """
        traj = self.trajectory
        info = dict(info or {})
        if info.get("instruction") == traj.instruction:  # already the trajectory's own field
            info.pop("instruction")
        traj.info.update(jsonable(info))
        traj.total_reward = float(sum(traj.rewards))
        traj.success = bool(success) if success is not None else _success(info, traj.total_reward)
        traj.metrics.update(
            {
                "wall_time_s": time.perf_counter() - self._t0,
                "num_turns": len(traj.turns),
                "num_tokens": traj.num_tokens,
                "generated_tokens": traj.num_generated,
                "forced_turns": sum(t.forced for t in traj.turns),
                "peak_kv_len": traj.peak_kv_len,
                "final_kv_len": traj.turns[-1].kv_len if traj.turns else traj.prompt_len,
                "compaction_events": len(traj.events),
            }
        )
        return traj

    def abort(self, reason: str) -> None:
        """Record why the episode stopped early (e.g. the backend refused a step)."""
        self.trajectory.info["aborted"] = reason

    def close(self) -> None:
        """Close the session (idempotent)."""
        if self.session_id is not None:
            sid, self.session_id = self.session_id, None
            with contextlib.suppress(UnknownSessionError):  # expired or closed elsewhere: nothing to free
                self.backend.close(sid)

    def __enter__(self) -> CompactionAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _creation_sampling(self, max_new_tokens: int | None = None) -> SamplingParams:
        params = self.sampling.replace(seed=self._session_seed)
        return params if max_new_tokens is None else params.replace(max_new_tokens=max_new_tokens)

    def _open_deferred(self, observation: str) -> None:
        """Without an instruction, the first observation's message is the creation prompt."""
        traj = self.trajectory
        if self.session_id is not None or traj.instruction or traj.turns:
            return
        message = self.prompt_format.user_message(observation)
        ids = self.chat.encode(
            self.chat.render([{"role": "user", "content": message}], add_generation_prompt=True)
        )
        result = self.backend.create_session(ids, self.compaction, self._creation_sampling(0))
        self.session_id = result.session_id
        self._extend(ids, result)
        traj.prompt_len = len(ids)

    def _plan(self, observation: str, action: str | None) -> _Plan:
        traj = self.trajectory
        if len(traj.rewards) < len(traj.turns):
            raise InvalidArgumentError("call observe(reward) after each act()/force() before the next one")
        if self.session_id is None:
            raise InvalidArgumentError("the session is closed: call reset() to start a new episode")
        message = self.prompt_format.user_message(observation)
        if not traj.turns and not traj.instruction:  # prompt already fed by _open_deferred
            plan = _Plan(observation, message, [], prompt_is_input=True)
        else:
            if not traj.turns:
                text = self.chat.first_user_text(traj.instruction, message)
            else:
                text = self.chat.after_output(message, self._tail)
            plan = _Plan(observation, message, self.chat.encode(text))
        if action is not None:
            if not isinstance(action, str):
                raise InvalidArgumentError(f"a forced action must be a str, got {type(action).__name__}")
            plan.forced_text = self.prompt_format.format_action(action)
            eos = self._closing_eos()
            plan.forced_ids = self.chat.encode(plan.forced_text) + ([eos] if eos is not None else [])
        return plan

    def _closing_eos(self) -> int | None:
        """The EOS id whose text starts the assistant's closing (ChatML: ``<|im_end|>``), if any."""
        for eos in self.eos_token_ids:
            text = self.chat.decode([eos])
            if text and self._closing.startswith(text):
                return eos
        return None

    def _request(self, observation: str, action: str | None) -> tuple[_Plan, StepRequest]:
        """This agent's next backend call (the session is opened first for single-step envs)."""
        if not isinstance(observation, str):
            raise InvalidArgumentError(f"observation must be a str, got {type(observation).__name__}")
        self.trajectory  # noqa: B018  (raises before reset)
        self._open_deferred(observation)
        plan = self._plan(observation, action)
        sampling = self.sampling.replace(seed=None)  # the session's own stream continues
        forced = plan.forced_ids is not None
        if forced:  # the input ends with the whole reply: turn-based triggers fire after it
            sampling = sampling.replace(max_new_tokens=0)
        return plan, StepRequest(self.session_id, plan.new_ids, sampling, response_complete=forced)

    def _extend(self, fed: list[int], result: StepResult) -> None:
        traj = self.trajectory
        traj.token_ids += fed
        traj.completion_mask += [0] * len(fed)
        traj.logprobs += [0.0] * len(fed)
        traj.token_ids += result.token_ids
        traj.completion_mask += [int(m) for m in result.completion_mask]
        traj.logprobs += [float(lp) if m else 0.0 for lp, m in zip(result.logprobs, result.completion_mask)]
        traj.events += result.events

    def _record(self, plan: _Plan, result: StepResult) -> str:
        traj = self.trajectory
        n = len(traj.token_ids)
        in_range = (0, traj.prompt_len) if plan.prompt_is_input else (n, n + len(plan.input_ids))
        self._extend(plan.new_ids, result)
        out_range = (in_range[1], len(traj.token_ids))
        if plan.forced_ids is not None:
            text, finish = plan.forced_text, "forced"
            eos_fed = bool(plan.forced_ids) and plan.forced_ids[-1] in self.eos_token_ids
            self._tail = self.chat.decode(plan.forced_ids[-1:]) if eos_fed else ""
        else:
            sampled = [t for t, m in zip(result.token_ids, result.completion_mask) if m]
            self._tail = ""
            if result.finish_reason == "stop" and sampled and result.completion_mask[-1]:
                last = self.chat.decode(sampled[-1:])
                if last and self._closing.startswith(last):  # the template's end-of-message token
                    self._tail, sampled = last, sampled[:-1]
            text, finish = self.chat.decode(sampled), result.finish_reason
        peak = max([result.kv_len, *(e.kv_len_before for e in result.events)])
        traj.turns.append(
            Turn(
                input_range=in_range,
                output_range=out_range,
                observation=plan.observation,
                action_text=text,
                forced=plan.forced_ids is not None,
                message=plan.message,
                finish_reason=finish,
                kv_len=result.kv_len,
                peak_kv_len=peak,
            )
        )
        return text


def act_batch(
    agents: Sequence[CompactionAgent],
    observations: Sequence[str],
    actions: Sequence[str | None] | None = None,
) -> list[str]:
    """Step several agents that share one backend with a single ``backend.step_batch`` call.

    Args:
        agents: agents mid-episode (each after ``reset``), all on the same backend object.
        observations: one observation per agent.
        actions: optional forced action per agent (``None`` entries let that agent generate).

    Returns:
        Each agent's action text, as :meth:`CompactionAgent.act` / :meth:`~CompactionAgent.force`.
    """
    agents = list(agents)
    if len(observations) != len(agents) or (actions is not None and len(actions) != len(agents)):
        raise InvalidArgumentError(
            f"act_batch needs one observation (and action) per agent: {len(agents)} agents, "
            f"{len(observations)} observations, {None if actions is None else len(actions)} actions"
        )
    if not agents:
        return []
    if any(a.backend is not agents[0].backend for a in agents):
        raise InvalidArgumentError("act_batch needs agents that share one backend object")
    if len({id(a) for a in agents}) != len(agents):
        raise InvalidArgumentError("act_batch got the same agent twice")
    actions = list(actions) if actions is not None else [None] * len(agents)
    requests = [agent.request(obs, action) for agent, obs, action in zip(agents, observations, actions)]
    backend = agents[0].backend
    if len(requests) == 1:
        req = requests[0]
        results = [
            backend.step(req.session_id, req.new_ids, req.sampling, response_complete=req.response_complete)
        ]
    else:
        results = backend.step_batch(requests)
    return [agent.record(result) for agent, result in zip(agents, results)]


def _eos_ids(backend: Backend, tokenizer: Any) -> tuple[int, ...]:
    """The backend's EOS ids; the tokenizer's EOS when the backend reports none."""
    ids = backend.eos_token_ids
    if ids:
        return tuple(int(i) for i in ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)


def _derive_seed(*parts: int | None) -> int | None:
    """A 62-bit seed mixing the given parts (``None`` parts skipped; all ``None`` → ``None``)."""
    given = [int(p) for p in parts if p is not None]  # negative parts map to distinct 64-bit words
    if not given:
        return None
    state = np.random.SeedSequence([p % (1 << 64) for p in given]).generate_state(2, np.uint32)
    return int((int(state[0]) << 30) ^ int(state[1]))


def _success(info: dict[str, Any], total_reward: float) -> bool:
    if "success" in info:
        return bool(info["success"])
    if "progression" in info:
        return float(info["progression"]) > 0
    if "score" in info:
        return float(info["score"]) >= 1.0
    return total_reward > 0
