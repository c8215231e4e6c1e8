"""Templated BabyAI reasoning: the current sub-goal and where its object is, read off the observation.

This is the assistant text of the ``reasoning`` prompt format's expert demonstrations::

    <think>Next: pick up the green key. It is 1 step right and 2 steps forward.</think><action>go forward</action>
"""

from __future__ import annotations

import re

from compaction_gym.envs.babyai.text import OBJECT_COLORS, OBJECT_KINDS
from compaction_gym.errors import InvalidArgumentError

_OBJ = rf"(?:the|a) (?:({'|'.join(OBJECT_COLORS)}) )?({'|'.join(OBJECT_KINDS)})"
_MISSIONS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("putnext", re.compile(rf"^put {_OBJ} next to {_OBJ}$")),
    ("seq_before", re.compile(rf"^pick up {_OBJ}, then go to {_OBJ}$")),
    ("seq_after", re.compile(rf"^go to {_OBJ} after you pick up {_OBJ}$")),
    ("goto", re.compile(rf"^go to {_OBJ}$")),
    ("pickup", re.compile(rf"^pick up {_OBJ}$")),
    ("open", re.compile(rf"^open {_OBJ}$")),
)
_SEEN = re.compile(r"^a (?:(?:open|closed|locked) )?(\w+) (ball|box|key|door) (\d.*)$")

Goal = tuple[str, str | None, str]  # (verb, color or None, object type)



def mission_goals(mission: str) -> tuple[Goal, Goal]:
    """The sub-goal before and after picking something up, from a ``MixedTrainLocal`` mission.

    ``go to X`` / ``pick up X``: the same goal twice; ``open the D door``: pick up the D key, then
    open the door; ``put X next to Y``: pick up X, then put it next to Y; the sequence task: pick up
    X, then go to Y.

    Raises:
        InvalidArgumentError: a mission outside the five BALROG tasks.
    """
    for kind, pattern in _MISSIONS:
        m = pattern.match(mission)
        if m is None:
            continue
        g = m.groups()
        if kind == "goto":
            return ("go to", g[0], g[1]), ("go to", g[0], g[1])
        if kind == "pickup":
            return ("pick up", g[0], g[1]), ("pick up", g[0], g[1])
        if kind == "open":
            return ("pick up", g[0], "key"), ("open", g[0], "door")
        if kind == "putnext":
            return ("pick up", g[0], g[1]), ("put it next to", g[2], g[3])
        if kind == "seq_before":
            return ("pick up", g[0], g[1]), ("go to", g[2], g[3])
        return ("pick up", g[2], g[3]), ("go to", g[0], g[1])  # "go to Y after you pick up X"
    raise InvalidArgumentError(f"not a BALROG BabyAI mission: {mission!r}")


def _distance(where: str) -> int:
    return sum(int(n) for n in re.findall(r"\d+", where))


def babyai_reasoning(mission: str, observation: str) -> str:
    """The one-line reasoning of a demonstration turn: the current sub-goal and where its object is.

    Example:
        >>> babyai_reasoning("pick up the green key", "a wall 2 steps left\\na green key 1 step right")
        'Next: pick up the green key. It is 1 step right.'
        >>> babyai_reasoning("open the blue door", "You carry a blue key\\na wall 1 step left")
        'Next: open the blue door. It is not in view.'
    """
    lines = observation.split("\n")
    before, after = mission_goals(mission)
    verb, color, kind = after if any(line.startswith("You carry ") for line in lines) else before
    seen = []
    for line in lines:
        m = _SEEN.match(line)
        if m and m.group(2) == kind and (color is None or m.group(1) == color):
            seen.append((_distance(m.group(3)), m.group(1), m.group(3)))
    if seen:
        _, seen_color, where = min(seen)
        return f"Next: {verb} the {seen_color} {kind}. It is {where}."
    name = f"{color} {kind}" if color else kind
    return f"Next: {verb} the {name}. It is not in view."


def demo_text(reasoning: str, action: str) -> str:
    """The assistant text of one turn in the ``reasoning`` format."""
    return f"<think>{reasoning}</think><action>{action}</action>"
