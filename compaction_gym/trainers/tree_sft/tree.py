"""The tree data model: nodes of token ids with a parent and a loss mask.

A tree stands for the K root→leaf *branches* it contains: training on the packed tree is
equivalent to training on those K sequences one by one (see :mod:`.packing` and :mod:`.loss`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from compaction_gym.errors import InvalidArgumentError


class InvalidTreeError(InvalidArgumentError):
    """A tree violates the data model (several roots, parent after child, empty node, bad mask)."""


class TreeTooLongError(InvalidArgumentError):
    """A tree exceeds ``seq_len`` (longest root→leaf path) or ``max_packed_tokens`` (whole tree)."""


@dataclass(frozen=True)
class TreeNode:
    """One node: a run of tokens that follows its parent's last token.

    Args:
        parent: index of the parent node in :attr:`Tree.nodes`, ``-1`` for the root.
        token_ids: the node's tokens (non-empty).
        loss_mask: 1 where the token is a training target, 0 elsewhere; ``None`` means all ones.
    """

    parent: int
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...] = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        mask = (1,) * len(self.token_ids) if self.loss_mask is None else tuple(int(m) for m in self.loss_mask)
        object.__setattr__(self, "loss_mask", mask)
        object.__setattr__(self, "parent", int(self.parent))

    def __len__(self) -> int:
        return len(self.token_ids)


class Tree:
    """A validated, topologically ordered tree of :class:`TreeNode`.

    Rules (checked at construction): at least one node; node 0 is the only root (``parent == -1``);
    every other node's parent comes before it; no node is empty; ``loss_mask`` has one 0/1 entry per
    token; token ids are non-negative.

    Args:
        nodes: the nodes, parents before children. Children of a node are visited in index order.

    Raises:
        InvalidTreeError: naming the first offending node.

    Example:
        >>> t = Tree([TreeNode(-1, [1, 2], [0, 0]), TreeNode(0, [3]), TreeNode(0, [4, 5])])
        >>> t.num_leaves, t.seq_len, t.num_tokens, t.branch_tokens
        (2, 4, 5, 7)
    """

    __slots__ = ("nodes", "children", "_depth_start")

    def __init__(self, nodes: Sequence[TreeNode]):
        nodes = tuple(nodes)
        if not nodes:
            raise InvalidTreeError("a tree needs at least one node (the root)")
        children: list[list[int]] = [[] for _ in nodes]
        for i, node in enumerate(nodes):
            if not isinstance(node, TreeNode):
                raise InvalidTreeError(f"node {i} is a {type(node).__name__}, expected TreeNode")
            if i == 0:
                if node.parent != -1:
                    raise InvalidTreeError(f"node 0 must be the root (parent -1), got parent {node.parent}")
            elif node.parent == -1:
                raise InvalidTreeError(
                    f"node {i} is a second root: a tree has exactly one node with parent -1"
                )
            elif not 0 <= node.parent < i:
                raise InvalidTreeError(
                    f"node {i} has parent {node.parent}: parents must come before their children "
                    f"(0 <= parent < {i}); reorder the nodes topologically"
                )
            if len(node.token_ids) == 0:
                raise InvalidTreeError(f"node {i} is empty: every node needs at least one token")
            if len(node.loss_mask) != len(node.token_ids):
                raise InvalidTreeError(
                    f"node {i}: loss_mask has {len(node.loss_mask)} entries for {len(node.token_ids)} tokens"
                )
            if any(m not in (0, 1) for m in node.loss_mask):
                raise InvalidTreeError(f"node {i}: loss_mask entries must be 0 or 1")
            if min(node.token_ids) < 0:
                raise InvalidTreeError(f"node {i}: token ids must be non-negative")
            if i:
                children[node.parent].append(i)
        self.nodes: tuple[TreeNode, ...] = nodes
        self.children: tuple[tuple[int, ...], ...] = tuple(tuple(c) for c in children)
        depth = [0] * len(nodes)
        for i in range(1, len(nodes)):
            p = nodes[i].parent
            depth[i] = depth[p] + len(nodes[p])
        self._depth_start = tuple(depth)

    # -- structure -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self.nodes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and self.nodes == other.nodes

    def __hash__(self) -> int:
        return hash(self.nodes)

    def __repr__(self) -> str:
        return (
            f"Tree(nodes={len(self.nodes)}, leaves={self.num_leaves}, tokens={self.num_tokens}, "
            f"seq_len={self.seq_len})"
        )

    @property
    def parents(self) -> tuple[int, ...]:
        return tuple(n.parent for n in self.nodes)

    @property
    def leaves(self) -> tuple[int, ...]:
        """Indices of the nodes without children, in index order (the order of :meth:`branches`)."""
        return tuple(i for i, c in enumerate(self.children) if not c)

    @property
    def num_leaves(self) -> int:
        return len(self.leaves)

    @property
    def depth_start(self) -> tuple[int, ...]:
        """Per node, the position (depth in tokens) of its first token: its parent's end depth."""
        return self._depth_start

    def depth_end(self, node: int) -> int:
        return self._depth_start[node] + len(self.nodes[node])

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed tree (each node once)."""
        return sum(len(n) for n in self.nodes)

    @property
    def seq_len(self) -> int:
        """Length of the longest root→leaf path: the context a branch needs."""
        return max(self.depth_end(i) for i in self.leaves)

    @property
    def branch_tokens(self) -> int:
        """Tokens of all K branches unrolled (what per-branch training processes)."""
        return sum(self.depth_end(i) for i in self.leaves)

    def leaf_counts(self) -> tuple[int, ...]:
        """Per node, the number of leaves in its subtree (g in the loss weight g/K)."""
        counts = [0 if c else 1 for c in self.children]
        for i in range(len(self.nodes) - 1, 0, -1):
            counts[self.nodes[i].parent] += counts[i]
        return tuple(counts)

    def root_path(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` (inclusive)."""
        if not 0 <= node < len(self.nodes):
            raise IndexError(f"node {node} out of range for a tree of {len(self.nodes)} nodes")
        path = [node]
        while self.nodes[path[-1]].parent != -1:
            path.append(self.nodes[path[-1]].parent)
        return path[::-1]

    def branch(self, leaf: int) -> tuple[list[int], list[int]]:
        """Token ids and loss mask of the root→``leaf`` sequence."""
        ids: list[int] = []
        mask: list[int] = []
        for i in self.root_path(leaf):
            ids.extend(self.nodes[i].token_ids)
            mask.extend(self.nodes[i].loss_mask)
        return ids, mask

    def branches(self) -> list[tuple[list[int], list[int]]]:
        """Every root→leaf sequence as ``(token_ids, loss_mask)``, in :attr:`leaves` order."""
        return [self.branch(leaf) for leaf in self.leaves]

    def shape_key(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(parents, node lengths)``: everything the attention mask depends on."""
        return self.parents, tuple(len(n) for n in self.nodes)

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, list]:
        """Columnar form used as a dataset row: ``parents``, ``token_ids``, ``loss_mask``."""
        return {
            "parents": [n.parent for n in self.nodes],
            "token_ids": [list(n.token_ids) for n in self.nodes],
            "loss_mask": [list(n.loss_mask) for n in self.nodes],
        }

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> Tree:
        """Inverse of :meth:`to_dict` (extra keys are ignored; ``loss_mask`` may be missing)."""
        try:
            parents, token_ids = row["parents"], row["token_ids"]
        except KeyError as exc:
            raise InvalidTreeError(
                f"a tree row needs 'parents' and 'token_ids' columns, missing {exc}"
            ) from None
        masks = row.get("loss_mask") or [None] * len(parents)
        if not len(parents) == len(token_ids) == len(masks):
            raise InvalidTreeError(
                f"tree row columns disagree: {len(parents)} parents, {len(token_ids)} token lists, "
                f"{len(masks)} masks"
            )
        return cls([TreeNode(p, t, m) for p, t, m in zip(parents, token_ids, masks)])

    @classmethod
    def chain(cls, token_ids: Sequence[int], loss_mask: Sequence[int] | None = None) -> Tree:
        """A one-node tree (a single branch): plain SFT as a degenerate tree."""
        return cls([TreeNode(-1, tuple(token_ids), None if loss_mask is None else tuple(loss_mask))])
