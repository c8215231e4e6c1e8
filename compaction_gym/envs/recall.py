"""Multi-turn recall: facts early, filler turns that push them past a KV budget, then questions.

The long-context memory probe of the leaderboard's ``recall`` suite (``docs/envs.md``): whether a
compacted session still answers questions about facts it read many turns (and many KV rows) ago.
Everything is generated from the reset seed; scoring is exact match after normalisation.
"""

from __future__ import annotations

import re
from typing import Any

import gymnasium as gym
from gymnasium.error import ResetNeeded

from compaction_gym.envs.spaces import text_space
from compaction_gym.errors import InvalidArgumentError

#: (subject template, question template, value pool): one fact kind each.
FACT_KINDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "The code of locker {k} is {v}.",
        "What is the code of locker {k}?",
        tuple(str(n) for n in range(1000, 10000, 37)),
    ),
    (
        "{k}'s favourite colour is {v}.",
        "What is {k}'s favourite colour?",
        (
            "teal",
            "crimson",
            "amber",
            "violet",
            "olive",
            "navy",
            "coral",
            "ivory",
            "indigo",
            "maroon",
            "scarlet",
            "beige",
        ),
    ),
    (
        "{k} lives in the city of {v}.",
        "In which city does {k} live?",
        (
            "Lisbon",
            "Oslo",
            "Nairobi",
            "Lima",
            "Hanoi",
            "Quito",
            "Dakar",
            "Tbilisi",
            "Perth",
            "Bergen",
            "Cusco",
            "Porto",
        ),
    ),
    (
        "The password of the {k} account is {v}.",
        "What is the password of the {k} account?",
        (
            "falcon",
            "granite",
            "willow",
            "harbor",
            "ember",
            "lantern",
            "quartz",
            "meadow",
            "cobalt",
            "thistle",
        ),
    ),
)
#: keys: locker numbers for the first kind, names for people, service names for accounts.
NAMES = (
    "Alice",
    "Bruno",
    "Chiara",
    "Dmitri",
    "Esme",
    "Farid",
    "Greta",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemal",
    "Lena",
)
SERVICES = ("billing", "archive", "backup", "mail", "storage", "payroll", "research", "travel")
_FILLER_TEXT = (
    "the river ran slowly past old mills while farmers counted sheep and clouds drifted over distant "
    "hills a baker opened the shop at dawn children walked to school along narrow streets and the "
    "market filled with voices prices of apples rose in autumn the train was late again because of "
    "leaves on the line the library held maps of forgotten roads a cat slept on the warm stones"
)
FILLER_WORDS: tuple[str, ...] = tuple(_FILLER_TEXT.split())
#: named settings, the env's tasks (``compaction-gym eval --env AttnMatch-Recall-v0 --task short``).
PRESETS: dict[str, dict[str, int]] = {
    "short": {"n_facts": 3, "n_filler": 2, "filler_sentences": 4},
    "standard": {"n_facts": 4, "n_filler": 6, "filler_sentences": 8},
    "long": {"n_facts": 6, "n_filler": 12, "filler_sentences": 12},
}
INSTRUCTION = (
    "You are a helpful assistant with a good memory. The user will tell you some facts, then talk "
    "about other things, then ask about the facts. When asked a question, reply with the answer "
    "only: a single word or number, no sentence."
)
ACK = "Reply with OK."
#: How an answer is scored: ``exact`` (its first line, normalised, is the value) or ``first_value``
#: (the first of the episode's fact values that the reply names, as a whole word, is the asked one).
MATCH_MODES: tuple[str, ...] = ("exact", "first_value")


def first_value(reply: str, values: list[str]) -> str | None:
    """The value among ``values`` that ``reply`` names first (case-insensitive, whole words), or
    ``None``: a reply that recites every fact is credited only for the fact it names first."""
    best: tuple[int, str] | None = None
    low = reply.lower()
    for value in dict.fromkeys(values):
        m = re.search(r"(?<!\w)" + re.escape(value.lower()) + r"(?!\w)", low)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), value)
    return None if best is None else best[1]


def normalize(text: str) -> str:
    """Lower-case, first line only, outer whitespace / quotes / punctuation and ``<answer>`` tags
    stripped, inner whitespace collapsed: what exact match compares."""
    text = re.sub(r"</?answer>", "", text.strip())
    first = text.split("\n", 1)[0] if text else ""
    return " ".join(first.strip().strip("\"'`*.!?,;:()[] ").lower().split())


class RecallEnv(gym.Env[str, str]):
    """Facts, filler, questions: a multi-turn chat scored by exact match.

    ## Description
    ``reset`` draws ``n_facts`` facts (distinct keys; kinds: locker codes, favourite colours,
    home cities, account passwords) and shows them in the first observation. The next
    ``n_filler`` turns are paragraphs of ``filler_sentences`` generated sentences each (the
    agent replies ``OK``); then one question per turn, about each fact in a seeded order.

    ## Action Space
    ``Text``: the agent's reply. Replies to facts and filler are not scored.

    ## Observation Space
    ``Text``: the next user message (``""`` after the last answer). ``info["instruction"]`` (at
    reset) is the session's first message; ``info["phase"]`` is ``facts``, ``filler`` or
    ``question``.

    ## Rewards
    ``1 / n_questions`` for each correct answer: with ``match="exact"`` its :func:`normalize`
    equals the fact's value; with ``match="first_value"`` the first fact value it names is the
    asked one (a small chat model answers in sentences: "The code of locker 95 is 9029.").
    ``info["score"]`` (at the end) is the fraction correct; ``info["answers"]`` lists
    ``{question, expected, given, correct}``.

    ## Episode End
    Terminated after the last question is answered.

    ## Arguments
    * ``preset``: one of :data:`PRESETS` (overrides the three sizes below).
    * ``n_facts`` (1–12), ``n_filler`` (>= 0), ``filler_sentences`` (>= 1).
    * ``match``: ``exact`` (default) or ``first_value`` (:data:`MATCH_MODES`, :func:`first_value`).
    * ``max_text_length``: ``max_length`` of the two ``Text`` spaces.

    ## Version History
    * v0: initial release.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        preset: str | None = None,
        *,
        n_facts: int = 4,
        n_filler: int = 6,
        filler_sentences: int = 8,
        match: str = "exact",
        max_text_length: int = 32_768,
    ) -> None:
        if match not in MATCH_MODES:
            raise InvalidArgumentError(f"match must be one of {list(MATCH_MODES)}, got {match!r}")
        self.match = match
        if preset is not None:
            if preset not in PRESETS:
                raise InvalidArgumentError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
            n_facts, n_filler, filler_sentences = (
                PRESETS[preset][k] for k in ("n_facts", "n_filler", "filler_sentences")
            )
        for name, value, lo in (
            ("n_facts", n_facts, 1),
            ("n_filler", n_filler, 0),
            ("filler_sentences", filler_sentences, 1),
        ):
            if not isinstance(value, int) or value < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {value!r}")
        if n_facts > len(NAMES):
            raise InvalidArgumentError(f"n_facts must be <= {len(NAMES)}, got {n_facts}")
        self.preset = preset
        self.n_facts, self.n_filler, self.filler_sentences = n_facts, n_filler, filler_sentences
        self.observation_space = text_space(max_text_length)
        self.action_space = text_space(max_text_length)
        self._facts: list[dict[str, str]] = []
        self._turn = -1
        self._answers: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ generation
    def _draw_facts(self) -> list[dict[str, str]]:
        rng = self.np_random
        names = [str(n) for n in rng.permutation(NAMES)]
        services = [str(s) for s in rng.permutation(SERVICES)]
        lockers = [str(n) for n in rng.choice(range(10, 100), size=len(NAMES), replace=False)]
        facts = []
        for i in range(self.n_facts):
            kind = int(rng.integers(len(FACT_KINDS)))
            fact_t, question_t, pool = FACT_KINDS[kind]
            key = (lockers, names, names, services)[kind][i]
            value = str(pool[int(rng.integers(len(pool)))])
            facts.append(
                {"fact": fact_t.format(k=key, v=value), "question": question_t.format(k=key), "value": value}
            )
        return facts

    def _filler(self) -> str:
        rng = self.np_random
        sentences = []
        for _ in range(self.filler_sentences):
            words = [
                FILLER_WORDS[int(i)] for i in rng.integers(len(FILLER_WORDS), size=int(rng.integers(8, 15)))
            ]
            sentences.append(" ".join(words).capitalize() + ".")
        return "Here is a passage to read:\n" + " ".join(sentences) + "\n" + ACK

    def _observation(self) -> tuple[str, str]:
        """The message of the current turn and its phase."""
        if self._turn == 0:
            lines = "\n".join(f"- {f['fact']}" for f in self._facts)
            return f"Please remember these facts:\n{lines}\n{ACK}", "facts"
        if self._turn <= self.n_filler:
            return self._filler(), "filler"
        q = self._order[self._turn - self.n_filler - 1]
        return self._facts[q]["question"] + " Answer with the value only.", "question"

    # ------------------------------------------------------------------ gym API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._facts = self._draw_facts()
        self._order = [int(i) for i in self.np_random.permutation(self.n_facts)]
        self._turn, self._answers = 0, []
        obs, phase = self._observation()
        return obs, {"instruction": INSTRUCTION, "phase": phase, "facts": [f["fact"] for f in self._facts]}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._turn < 0:
            raise ResetNeeded("call reset() before step()")
        if not isinstance(action, str):
            raise InvalidArgumentError(
                f"action must be a str (the model's reply), got {type(action).__name__}"
            )
        reward = 0.0
        if self._turn > self.n_filler:
            fact = self._facts[self._order[self._turn - self.n_filler - 1]]
            if self.match == "exact":
                correct = normalize(action) == normalize(fact["value"])
            else:
                correct = first_value(action, [f["value"] for f in self._facts]) == fact["value"]
            self._answers.append(
                {"question": fact["question"], "expected": fact["value"], "given": action, "correct": correct}
            )
            reward = float(correct) / self.n_facts
        self._turn += 1
        info: dict[str, Any] = {"answers": list(self._answers)}
        if self._turn > self.n_filler + self.n_facts:
            self._turn = -1
            info["score"] = sum(a["correct"] for a in self._answers) / self.n_facts
            info["phase"] = "done"
            if self.preset is not None:
                info["task"] = self.preset
            return "", reward, True, False, info
        obs, info["phase"] = self._observation()
        return obs, reward, False, False, info
