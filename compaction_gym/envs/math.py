"""Single-step text math: one reasoning-gym problem per episode, scored by its own verifier.

reasoning-gym generates every item locally from ``(dataset seed, index)``: no dataset hub is used.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
from gymnasium.error import ResetNeeded

from compaction_gym.envs.spaces import text_space
from compaction_gym.errors import InvalidArgumentError, require

#: Appended to every question.
ANSWER_INSTRUCTION = "\n\nGive your final answer between <answer> and </answer> tags."
#: Appended instead with ``instruction="step_by_step"``: asks for the working first, so that a small
#: model writes long answers (the math-kv-budget suite, docs/leaderboard.md).
STEP_BY_STEP_INSTRUCTION = (
    "\n\nThink step by step, then give your final answer between <answer> and </answer> tags."
)
#: ``instruction=`` presets: the text appended to every question.
INSTRUCTIONS = {"tag": ANSWER_INSTRUCTION, "step_by_step": STEP_BY_STEP_INSTRUCTION}
#: How a response without an ``<answer>`` tag is read when ``require_answer_tag=False``: the whole
#: stripped text, or its last number (for small models that ignore the tag instruction).
ANSWER_FALLBACKS = ("text", "last_number")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

#: The original research code's RG mix: dataset name → reasoning-gym config (field names of its config dataclasses).
RGMIX_CONFIGS: dict[str, dict[str, Any]] = {
    "arc_1d": {},
    "sokoban": {
        "min_w": 10,
        "max_w": 12,
        "min_h": 10,
        "max_h": 12,
        "min_boxes": 6,
        "max_boxes": 10,
        "max_depth": 120,
    },
    "countdown": {"min_numbers": 7, "max_numbers": 7},
    "zebra_puzzles": {"num_people": 7, "num_characteristics": 5},
    "cryptarithm": {},
}


def extract_answer(text: str) -> str | None:
    """The stripped content of the last ``<answer>…</answer>`` tag of ``text``, or ``None``."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def last_number(text: str) -> str | None:
    """The last number (``-?digits[.digits]``) written in ``text``, or ``None``."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def make_dataset(name: str, config: Mapping[str, Any] | None, seed: int, size: int) -> Any:
    """``reasoning_gym.create_dataset`` with errors that name the bad argument."""
    rg = require("reasoning_gym")
    if name not in rg.factory.DATASETS:
        close = difflib.get_close_matches(name, list(rg.factory.DATASETS), n=3)
        hint = f" Did you mean {close}?" if close else ""
        raise InvalidArgumentError(f"dataset {name!r} is not a reasoning-gym dataset.{hint}")
    config = dict(config or {})
    for key, arg in (("seed", "dataset_seed"), ("size", "size")):
        if key in config:
            raise InvalidArgumentError(f"config must not set {key!r}; pass the env argument {arg}= instead")
    try:
        return rg.create_dataset(name, seed=seed, size=size, **config)
    except (TypeError, AssertionError, ValueError) as exc:
        raise InvalidArgumentError(f"config {config} is not valid for dataset {name!r}: {exc}") from exc


class MathEnv(gym.Env[str, str]):
    """One reasoning-gym problem per episode.

    ## Description
    ``reset`` draws an item of a reasoning-gym dataset (by name and config); the episode is a
    single answer.

    ## Action Space
    ``Text``: the model's full response; the last ``<answer>…</answer>`` holds the answer.

    ## Observation Space
    ``Text``: the question followed by :data:`ANSWER_INSTRUCTION` after ``reset``; ``""`` after
    the step. ``info`` holds ``dataset``, ``index``, ``question``, ``answer`` (the reference
    answer), ``metadata``; after the step also ``extracted`` (the parsed answer or ``None``),
    ``score`` and ``error`` (why the score is 0 without being wrong, or ``None``).

    ## Rewards
    The dataset's ``score_answer`` (1.0 correct, 0.0 wrong, partial credit where it gives any); 0.0
    when no answer tag is found or the scorer raises.

    ## Episode End
    Terminated after the one step.

    ## Arguments
    * ``dataset``: reasoning-gym dataset name (default ``"basic_arithmetic"``).
    * ``config``: that dataset's config fields (e.g. ``{"min_terms": 3}``).
    * ``configs``: dataset name → config; the entry of ``dataset``, if any, is its config (one
      ``env_kwargs`` for a suite whose tasks are datasets with different config fields).
    * ``dataset_seed``: reasoning-gym seed; items are a pure function of (seed, index).
    * ``size``: indices drawn from ``[0, size)``; ``reset(options={"index": i})`` picks one.
    * ``require_answer_tag``: if ``False``, a response with no tag is read by ``answer_fallback``.
    * ``answer_fallback``: ``"text"`` (the whole stripped response) or ``"last_number"`` (its last
      number; no number: no answer), for a response without a tag when the tag is not required.
    * ``instruction``: what follows the question, a key of :data:`INSTRUCTIONS` (``"tag"``: only
      the answer-tag request; ``"step_by_step"``: think step by step first).
    * ``max_text_length``: ``max_length`` of the two ``Text`` spaces.

    ## Version History
    * v0: initial release; ``configs``, ``answer_fallback`` and ``instruction`` added later (their
      defaults keep the original behaviour).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        config: Mapping[str, Any] | None = None,
        *,
        configs: Mapping[str, Mapping[str, Any]] | None = None,
        dataset_seed: int = 0,
        size: int = 100_000,
        require_answer_tag: bool = True,
        answer_fallback: str = "text",
        instruction: str = "tag",
        max_text_length: int = 32_768,
    ) -> None:
        self._check_common(dataset_seed, size)
        self._set_answering(require_answer_tag, answer_fallback, instruction)
        if configs is not None and not isinstance(configs, Mapping):
            raise InvalidArgumentError(f"configs must map dataset names to configs, got {configs!r}")
        if configs and dataset in configs:
            if config is not None:
                raise InvalidArgumentError(f"give dataset {dataset!r} a config in config= or configs=, not both")
            config = configs[dataset]
        self.datasets = {dataset: make_dataset(dataset, config, dataset_seed, size)}
        self.size = size
        self.observation_space = text_space(max_text_length)
        self.action_space = text_space(max_text_length)
        self._item: dict[str, Any] | None = None
        self._name = dataset

    def _set_answering(self, require_answer_tag: bool, answer_fallback: str, instruction: str) -> None:
        if answer_fallback not in ANSWER_FALLBACKS:
            raise InvalidArgumentError(
                f"answer_fallback must be one of {ANSWER_FALLBACKS}, got {answer_fallback!r}"
            )
        if instruction not in INSTRUCTIONS:
            raise InvalidArgumentError(
                f"instruction must be one of {list(INSTRUCTIONS)}, got {instruction!r}"
            )
        self.require_answer_tag = bool(require_answer_tag)
        self.answer_fallback = answer_fallback
        self.instruction = INSTRUCTIONS[instruction]

    def extract(self, response: str) -> str | None:
        """The answer the env scores in ``response``: the last ``<answer>`` tag; without one, ``None``
        if the tag is required, else the stripped text or its last number (``answer_fallback``)."""
        found = extract_answer(response)
        if found is not None or self.require_answer_tag:
            return found
        return response.strip() if self.answer_fallback == "text" else last_number(response)

    @staticmethod
    def _check_common(dataset_seed: int, size: int) -> None:
        if not isinstance(dataset_seed, int):
            raise InvalidArgumentError(f"dataset_seed must be an int, got {dataset_seed!r}")
        if not isinstance(size, int) or size < 1:
            raise InvalidArgumentError(f"size must be an int >= 1, got {size!r}")

    def _choose_dataset(self) -> str:
        return self._name

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        name = options.get("dataset", None) or self._choose_dataset()
        if name not in self.datasets:
            raise InvalidArgumentError(
                f"options['dataset'] must be one of {list(self.datasets)}, got {name!r}"
            )
        if "index" in options:
            index = options["index"]
            if not isinstance(index, int) or not 0 <= index < self.size:
                raise InvalidArgumentError(
                    f"options['index'] must be an int in [0, {self.size}), got {index!r}"
                )
        else:
            index = int(self.np_random.integers(self.size))
        item = self.datasets[name][index]
        self._item = {"dataset": name, "index": index, "entry": item}
        return item["question"] + self.instruction, self._info()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._item is None:
            raise ResetNeeded("call reset() before step(); the episode is one step long")
        if not isinstance(action, str):
            raise InvalidArgumentError(
                f"action must be a str (the model's response), got {type(action).__name__}"
            )
        extracted = self.extract(action)
        score, error = 0.0, None
        if extracted is None:
            error = (
                "no <answer>...</answer> tag in the response"
                if self.require_answer_tag or self.answer_fallback == "text"
                else "no <answer>...</answer> tag and no number in the response"
            )
        else:
            try:
                score = float(
                    self.datasets[self._item["dataset"]].score_answer(extracted, self._item["entry"])
                )
            except Exception as exc:  # a scorer must never crash the episode
                error = f"score_answer raised {type(exc).__name__}: {exc}"
            if not math.isfinite(score):
                score, error = 0.0, f"score_answer returned {score}"
        info = {**self._info(), "extracted": extracted, "score": score, "error": error}
        self._item = None
        return "", score, True, False, info

    def _info(self) -> dict[str, Any]:
        assert self._item is not None
        entry = self._item["entry"]
        return {  # copies: callers may mutate what they get
            "dataset": self._item["dataset"],
            "index": self._item["index"],
            "question": entry["question"],
            "answer": copy.deepcopy(entry["answer"]),
            "metadata": copy.deepcopy(entry.get("metadata", {})),
        }


class RGMixEnv(MathEnv):
    """The original research code's reasoning-gym mix: each reset draws a dataset by weight, then one of its items.

    ## Description
    As :class:`MathEnv`, over :data:`RGMIX_CONFIGS` (arc_1d, sokoban hard, countdown with 7
    numbers, zebra puzzles 7×5, cryptarithm). ``info["dataset"]`` names the one drawn;
    ``reset(options={"dataset": name})`` forces one.

    ## Arguments
    * ``weights``: dataset name → weight (default uniform); names missing get weight 0 when
      ``weights`` is given, so ``{"countdown": 1}`` is countdown only.
    * ``configs``: dataset name → config overriding :data:`RGMIX_CONFIGS` for that dataset.
    * ``dataset_seed``, ``size``, ``require_answer_tag``, ``answer_fallback``, ``instruction``,
      ``max_text_length``: as :class:`MathEnv`.

    ## Version History
    * v0: initial release.
    """

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        configs: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        dataset_seed: int = 0,
        size: int = 100_000,
        require_answer_tag: bool = True,
        answer_fallback: str = "text",
        instruction: str = "tag",
        max_text_length: int = 32_768,
    ) -> None:
        self._check_common(dataset_seed, size)
        self._set_answering(require_answer_tag, answer_fallback, instruction)
        configs = dict(configs or {})
        unknown = sorted(set(weights or {}).union(configs) - set(RGMIX_CONFIGS))
        if unknown:
            raise InvalidArgumentError(
                f"weights/configs name datasets outside the mix {list(RGMIX_CONFIGS)}: {unknown}"
            )
        weights = dict(weights) if weights is not None else dict.fromkeys(RGMIX_CONFIGS, 1.0)
        if any(not isinstance(w, (int, float)) or w < 0 or not math.isfinite(w) for w in weights.values()):
            raise InvalidArgumentError(f"weights must be finite numbers >= 0, got {weights}")
        total = float(sum(weights.values()))
        if total <= 0:
            raise InvalidArgumentError(f"weights must have a positive sum, got {weights}")
        self.weights = {
            name: weights.get(name, 0.0) / total for name in RGMIX_CONFIGS if weights.get(name, 0.0) > 0
        }
        self.datasets = {
            name: make_dataset(name, configs.get(name, RGMIX_CONFIGS[name]), dataset_seed, size)
            for name in self.weights
        }
        self.size = size
        self.observation_space = text_space(max_text_length)
        self.action_space = text_space(max_text_length)
        self._item = None
        self._names = list(self.weights)
        self._name = self._names[0]

    def _choose_dataset(self) -> str:
        probs = list(self.weights.values())
        return self._names[int(self.np_random.choice(len(self._names), p=probs))]
