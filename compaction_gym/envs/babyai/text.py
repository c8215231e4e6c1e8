"""BALROG's text rendering of a MiniGrid agent's egocentric view (BabyAI-Text format).

The rules (see ``docs/envs.md``): the agent sits at view cell ``(view // 2, view - 1)`` facing
"forward"; a carried object is announced first; then one wall line per straight scan (forward,
left, right) when the first cell that is neither unseen nor empty is a wall; then every other
visible object by view column (left to right) and row (far to near).
"""

from __future__ import annotations

from typing import Any

from minigrid.core.grid import Grid
from minigrid.minigrid_env import MiniGridEnv

from compaction_gym.errors import InvalidArgumentError

_TRANSPARENT = ("unseen", "empty")  # a wall scan passes over these kinds
#: The colours and kinds the text names objects by (``a {colour} {kind}``), in minigrid's order.
OBJECT_COLORS: tuple[str, ...] = ("red", "green", "blue", "purple", "yellow", "grey")
OBJECT_KINDS: tuple[str, ...] = ("ball", "box", "key", "door")


def _steps(n: int) -> str:
    return f"{n} step{'s' if n > 1 else ''}"


def _kind(grid: Grid, vis_mask: Any, i: int, j: int) -> str:
    """``"unseen"``, ``"empty"`` or the object type at view cell (i, j)."""
    if not vis_mask[i, j]:
        return "unseen"
    obj = grid.get(i, j)
    return "empty" if obj is None else obj.type


def _door_state(door: Any) -> str:
    if door.is_open:
        return "open"
    return "locked" if door.is_locked else "closed"


def _distance(dx: int, dy: int) -> str:
    side = "right" if dx > 0 else "left"
    if dx == 0:
        return f"{_steps(dy)} forward"
    if dy == 0:
        return f"{_steps(abs(dx))} {side}"
    return f"{_steps(abs(dx))} {side} and {_steps(dy)} forward"


def _minigrid(env: Any) -> MiniGridEnv:
    base = getattr(env, "unwrapped", env)
    if not isinstance(base, MiniGridEnv):
        raise InvalidArgumentError(
            f"env must be a MiniGrid/BabyAI environment (or a wrapper of one), got {type(base).__name__}; "
            "for a BabyAITextEnv pass env.unwrapped.level"
        )
    return base


def describe_lines(env: Any) -> list[str]:
    """The BabyAI-Text description lines of ``env``'s current view (BALROG's ``info["descriptions"]``).

    Args:
        env: a ``MiniGridEnv`` or any wrapper of one, after ``reset``.

    Returns:
        Lines such as ``"You carry a red key"``, ``"You see a wall 2 steps left"`` and
        ``"You see a green key 1 step right and 2 steps forward"``.

    Raises:
        InvalidArgumentError: ``env`` is not a MiniGrid environment.
    """
    env = _minigrid(env)
    grid, vis_mask = env.gen_obs_grid()
    ax, ay = grid.width // 2, grid.height - 1
    lines: list[str] = []
    if env.carrying is not None:
        lines.append(f"You carry a {env.carrying.color} {env.carrying.type}")

    scans = (
        ("forward", [(ax, j) for j in range(ay - 1, -1, -1)]),
        ("left", [(i, ay) for i in range(ax - 1, -1, -1)]),
        ("right", [(i, ay) for i in range(ax + 1, grid.width)]),
    )
    for direction, cells in scans:
        for n, (i, j) in enumerate(cells, start=1):
            kind = _kind(grid, vis_mask, i, j)
            if kind in _TRANSPARENT:
                continue
            if kind == "wall":
                lines.append(f"You see a wall {_steps(n)} {direction}")
            break

    for i in range(grid.width):
        for j in range(grid.height):
            if (i, j) == (ax, ay) or _kind(grid, vis_mask, i, j) in ("unseen", "empty", "wall"):
                continue
            obj = grid.get(i, j)
            if obj.type == "door":
                head = f"You see a {_door_state(obj)} {obj.color} door "  # BALROG: "a open", never "an"
            else:
                head = f"You see a {obj.color} {obj.type} "
            lines.append(head + _distance(i - ax, ay - j))
    return lines


def join_lines(lines: list[str]) -> str:
    """BALROG's prompt from description lines: each without ``"You see "``, joined by ``"\\n"``."""
    return "\n".join(line.replace("You see ", "") for line in lines)


def describe(env: Any) -> str:
    """BALROG's observation text of ``env``'s current view: ``join_lines(describe_lines(env))``.

    Example:
        >>> describe(env)  # doctest: +SKIP
        'a wall 6 steps forward\\na wall 2 steps left\\na green key 1 step right and 2 steps forward'
    """
    return join_lines(describe_lines(env))
