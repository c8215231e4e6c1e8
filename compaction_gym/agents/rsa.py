"""Recursive Self-Aggregation (Venkatraman et al., arXiv 2509.26626) on the session API (docs/rsa.md).

A population of ``N`` solutions is sampled; each of ``T`` rounds builds ``N`` aggregation prompts,
each showing the question and ``K`` solutions drawn (without replacement) from the current
population, and the model writes an improved solution to each: the new population. The shared
prompt prefix is prefilled once per question into a base session, which every member *forks*;
members of a round run as one ``step_batch`` and keep the base session's compaction config, so
every member can be compacted.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from compaction_gym.agents.chat import ChatFormat
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import StepRequest, StepResult
from compaction_gym.errors import InvalidArgumentError

#: What follows the question in every aggregation prompt (``{k}``: solutions shown).
AGGREGATION_HEADER = (
    "\n\nBelow are {k} candidate solutions to the problem above. Some of them may be wrong. "
    "Check them, then write one improved, complete solution."
)
#: After the shown solutions.
AGGREGATION_FOOTER = "\n\nNow write your improved solution. Give your final answer between <answer> and </answer> tags."


@dataclass(frozen=True)
class RSAConfig:
    """Population size, aggregation set size and rounds of RSA (docs/rsa.md).

    Args:
        population: ``N``, solutions per population.
        subset: ``K``, solutions shown in each aggregation prompt (``1 <= K <= N``).
        rounds: ``T``, aggregation rounds after the initial population (``0``: plain sampling of ``N``).
        seed: seeds the subsets and every member's sampling stream.
    """

    population: int = field(default=4, metadata={"help": "N: solutions per population", "ge": 1})
    subset: int = field(default=2, metadata={"help": "K: solutions shown in each aggregation prompt", "ge": 1})
    rounds: int = field(default=1, metadata={"help": "T: aggregation rounds after the initial population", "ge": 0})
    seed: int = field(default=0, metadata={"help": "seeds the subsets and the members' sampling", "ge": 0})

    def __post_init__(self) -> None:
        for name in ("population", "subset", "rounds", "seed"):
            value, low = getattr(self, name), self.__dataclass_fields__[name].metadata["ge"]
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"RSAConfig.{name} must be an int >= {low}, got {value!r}")
        if self.subset > self.population:
            raise InvalidArgumentError(
                f"RSAConfig.subset (K={self.subset}) must not exceed population (N={self.population})"
            )


def derive(seed: int, *parts: int) -> int:
    """A 62-bit seed from ``seed`` and ``parts`` (SHA-256; independent of Python's hash seed)."""
    digest = hashlib.sha256(":".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def choose_subsets(cfg: RSAConfig, round_: int) -> list[list[int]]:
    """The ``N`` aggregation subsets of round ``round_`` (``>= 1``): ``K`` distinct population
    indices each, drawn uniformly from the seed (a seeded Fisher–Yates draw per member)."""
    out = []
    for i in range(cfg.population):
        pool = list(range(cfg.population))
        state = derive(cfg.seed, round_, i, 1)
        for j in range(cfg.subset):
            state = derive(state, j)
            r = j + state % (cfg.population - j)
            pool[j], pool[r] = pool[r], pool[j]
        out.append(pool[: cfg.subset])
    return out


@dataclass
class RSACompute:
    """Token counts of one RSA run (compute)."""

    generated: int = 0  #: sampled tokens, every member of every round
    prefilled: int = 0  #: tokens fed (prompts and aggregation inputs), the shared prefixes once
    prefilled_unshared: int = 0  #: tokens fed had every member prefilled its whole prompt
    events: int = 0  #: compaction events over all members
    peak_kv: int = 0  #: largest cache of any member after its response

    def add(self, other: RSACompute) -> None:
        self.generated += other.generated
        self.prefilled += other.prefilled
        self.prefilled_unshared += other.prefilled_unshared
        self.events += other.events
        self.peak_kv = max(self.peak_kv, other.peak_kv)


@dataclass
class MemberResult:
    """One member's generation: its session's shared prefix (the protected prompt), its own input,
    what it sampled, its cache after the response and at its largest, and its compaction events."""

    round: int
    index: int
    prompt_len: int  #: the shared prefix it forked from
    input_len: int  #: its own part, fed after the fork
    generated: int
    kv_len: int
    peak_kv_len: int  #: the largest cache during the call (before any compaction)
    events: list[Any] = field(default_factory=list)


@dataclass
class RSARun:
    """One question's RSA: every population (``populations[0]`` is the initial one) and the
    subsets each round showed (``subsets[r - 1][i]``: population ``r - 1`` indices behind member
    ``i`` of population ``r``); ``members`` lists every member's generation, round by round."""

    populations: list[list[str]]
    subsets: list[list[list[int]]]
    compute: RSACompute
    members: list[MemberResult] = field(default_factory=list)


def aggregation_prompt(question: str, solutions: Sequence[str]) -> tuple[str, str]:
    """The aggregation user message as ``(shared prefix, member part)``."""
    shown = "".join(f"\n\nSolution {j + 1}:\n{s.strip()}" for j, s in enumerate(solutions))
    return question + AGGREGATION_HEADER.format(k=len(solutions)), shown + AGGREGATION_FOOTER


class RSA:
    """Runs RSA for one question at a time on an :class:`~compaction_gym.engine.Engine`.

    Args:
        engine: the engine (forks need the in-process engine).
        cfg: ``N``, ``K``, ``T`` and the seed.
        compaction: every member's compaction config (default none).
        sampling: every member's sampling (its ``seed`` is replaced per member).
        chat: how prompts are rendered (default: the tokenizer's chat template).
        batched: members of a round run as ``step_batch`` calls; ``False`` steps them one by one
            (the same results, docs/engine.md).
    """

    def __init__(
        self,
        engine: Any,
        cfg: RSAConfig,
        *,
        compaction: CompactionConfig | None = None,
        sampling: SamplingParams | None = None,
        chat: ChatFormat | None = None,
        batched: bool = True,
    ) -> None:
        self.engine, self.cfg, self.batched = engine, cfg, batched
        self.compaction = compaction or CompactionConfig()
        self.sampling = sampling or SamplingParams(temperature=1.0, max_new_tokens=256)
        self.chat = chat or ChatFormat(engine.tokenizer)

    def encode_prompt(self, prefix: str, rest: str) -> tuple[list[int], list[int]]:
        """Token ids of the rendered user message ``prefix + rest`` (with the generation prompt),
        split where ``prefix`` ends: the shared part and the member's part."""
        text = self.chat.render([{"role": "user", "content": prefix + rest}], add_generation_prompt=True)
        cut = text.find(prefix + rest)
        if cut < 0:
            raise InvalidArgumentError("the chat template does not place the user message verbatim")
        cut += len(prefix)
        return self.chat.encode(text[:cut]), self.chat.encode(text[cut:])

    def run(self, question: str) -> RSARun:
        """The initial population and ``T`` aggregation rounds for ``question``."""
        compute = RSACompute()
        shared, rest = self.encode_prompt(question, "")
        members: list[MemberResult] = []
        population = self._generate(shared, [rest] * self.cfg.population, 0, compute, members)
        populations, subsets = [population], []
        for r in range(1, self.cfg.rounds + 1):
            chosen = choose_subsets(self.cfg, r)
            parts = [aggregation_prompt(question, [population[j] for j in c]) for c in chosen]
            encoded = [self.encode_prompt(p, m) for p, m in parts]
            shared = encoded[0][0]
            assert all(e[0] == shared for e in encoded), "the aggregation prefix must be shared"
            population = self._generate(shared, [e[1] for e in encoded], r, compute, members)
            populations.append(population)
            subsets.append(chosen)
        return RSARun(populations, subsets, compute, members)

    def _generate(
        self,
        shared: list[int],
        parts: list[list[int]],
        round_: int,
        compute: RSACompute,
        members: list[MemberResult],
    ) -> list[str]:
        """One population: prefill ``shared`` once, fork it per member, feed each member's part
        and sample (each member its own seed); members run in groups that fit the free slots."""
        eng = self.engine
        base = eng.create_session(shared, self.compaction, self.sampling.replace(max_new_tokens=0, seed=0))
        compute.prefilled += len(shared)
        texts: list[str] = []
        try:
            group = max(1, eng.num_free_slots)
            for lo in range(0, len(parts), group):
                ids = [eng.fork(base.session_id) for _ in parts[lo : lo + group]]
                try:
                    reqs = [
                        StepRequest(sid, p, self.sampling.replace(seed=derive(self.cfg.seed, round_, lo + i, 0)))
                        for i, (sid, p) in enumerate(zip(ids, parts[lo : lo + group]))
                    ]
                    results = eng.step_batch(reqs) if self.batched else [eng.step(q.session_id, q.new_ids, q.sampling) for q in reqs]
                finally:
                    for sid in ids:
                        eng.close(sid)
                for i, (p, res) in enumerate(zip(parts[lo : lo + group], results)):
                    peak = max([res.kv_len, *(e.kv_len_before for e in res.events)])
                    members.append(
                        MemberResult(
                            round_, lo + i, len(shared), len(p), sum(res.completion_mask), res.kv_len, peak,
                            list(res.events),
                        )
                    )  # fmt: skip
                    texts.append(self._text(res))
                    compute.generated += sum(res.completion_mask)
                    compute.prefilled += len(p)
                    compute.prefilled_unshared += len(shared) + len(p)
                    compute.events += len(res.events)
                    compute.peak_kv = max(compute.peak_kv, res.kv_len)
        finally:
            eng.close(base.session_id)
        return texts

    def _text(self, result: StepResult) -> str:
        sampled = [t for t, m in zip(result.token_ids, result.completion_mask) if m]
        return self.engine.tokenizer.decode(sampled, skip_special_tokens=True)


def majority(answers: Sequence[str | None]) -> int | None:
    """Index of the first member whose answer is the most common non-``None`` answer (ties: the
    answer seen first), or ``None`` when no member answered."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    best = next(a for a in answers if a is not None and counts[a] == top)
    return answers.index(best)


def score_population(score: Callable[[str], float], texts: Sequence[str], extract: Callable[[str], str | None]) -> dict[str, float]:
    """Per-member scores (``mean``: the expected score of one member of the final population, the
    paper's metric) and the majority-vote answer's score (``vote``; 0 when nobody answered)."""
    scores = [score(t) for t in texts]
    best = majority([extract(t) for t in texts])
    return {
        "mean": sum(scores) / len(scores),
        "vote": scores[best] if best is not None else 0.0,
        "any": float(max(scores) > 0),
    }
