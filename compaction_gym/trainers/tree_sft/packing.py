"""DFS packing of a :class:`~.tree.Tree` into one sequence with depth positions and an ancestor mask.

For packed token t (DFS pre-order over nodes, children in index order):

* ``position_ids[t]`` = depth of t on its root→leaf path (a node starts at its parent's end depth), so
  every branch sees exactly the rotary positions it would see alone;
* ``prev_map[t]`` = the packed index whose logits predict t: ``t-1`` inside a node, the parent's
  last token for a node's first token, ``-1`` for the root's first token (never a target);
* ``subtree_end[t]`` = one past the last packed token of the subtree of t's node. Because of pre-order,
  key k is visible to query q iff ``k <= q < subtree_end[k]`` — exactly "k's node is an ancestor of (or
  is) q's node, and k precedes q". The dense SDPA mask and the FlexAttention ``mask_mod`` both use it;
* ``loss_weights[t]`` = g_t/K · trainable_t, g_t = leaves below t's node, K = leaves, trainable_t = the
  loss mask except at the root's first token. Σ_t w_t·CE_t / Σ_t w_t is then the token-mean loss of
  the K branches trained separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.tree_sft.tree import Tree, TreeTooLongError

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

Normalizer = Literal["token", "sequence"]
NORMALIZERS: tuple[str, ...] = ("token", "sequence")
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "flex_attention", "eager")


@dataclass(eq=False)
class PackedTree:
    """A tree packed into one sequence; all tensors live on the CPU until moved by the caller.

    Attributes:
        tree: the source tree.
        input_ids, position_ids, prev_map, node_of_token, loss_mask, subtree_end: ``[N]`` long.
        loss_weights: ``[N]`` float64, g_t/K · trainable_t (token normaliser).
        ancestors: ``[M, M]`` bool over node indices, ``ancestors[a, b]`` = a is b or an ancestor of b.
        node_order: ``[M]`` node indices in packing (DFS pre-order) order.
        node_start: ``[M]`` packed offset of each node's first token.
        num_leaves, seq_len, branch_tokens: see :class:`~.tree.Tree`.
    """

    tree: Tree
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    prev_map: torch.Tensor
    node_of_token: torch.Tensor
    loss_mask: torch.Tensor
    loss_weights: torch.Tensor
    subtree_end: torch.Tensor
    ancestors: torch.Tensor
    node_order: torch.Tensor
    node_start: torch.Tensor
    num_leaves: int
    seq_len: int
    branch_tokens: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def trainable(self) -> torch.Tensor:
        """``[N]`` bool: tokens with a loss (mask 1 and a predecessor)."""
        return (self.loss_mask > 0) & (self.prev_map >= 0)

    @property
    def target_index(self) -> torch.Tensor:
        """Packed indices of the trainable tokens, ascending."""
        return self.trainable.nonzero().flatten()

    @property
    def source_index(self) -> torch.Tensor:
        """``prev_map[target_index]``: where the logits predicting each target are read."""
        return self.prev_map[self.target_index]

    def sequence_loss_weights(self) -> torch.Tensor:
        """``[N]`` float64 weights whose weighted sum is the mean over branches of each branch's
        token-mean loss: w_t = (1/K') Σ_{leaves l below t, n_l > 0} 1/n_l, with n_l the trainable
        tokens on the path to l and K' the number of leaves with n_l > 0. They sum to 1 (or 0)."""
        tree = self.tree
        trainable = self.trainable
        # trainable tokens per node, then per root→leaf path
        per_node = torch.zeros(len(tree), dtype=torch.float64).index_add_(
            0, self.node_of_token, trainable.to(torch.float64)
        )
        path_count = per_node.clone()
        for i in range(1, len(tree)):
            path_count[i] += path_count[tree.nodes[i].parent]
        leaves = [leaf for leaf in tree.leaves if path_count[leaf] > 0]
        node_w = torch.zeros(len(tree), dtype=torch.float64)
        if not leaves:
            return torch.zeros_like(self.loss_weights)
        for leaf in leaves:
            node_w[leaf] += 1.0 / float(path_count[leaf])
        for i in range(len(tree) - 1, 0, -1):  # children after parents: accumulate bottom-up
            node_w[tree.nodes[i].parent] += node_w[i]
        return node_w[self.node_of_token] * trainable.to(torch.float64) / len(leaves)

    def weights(self, normalizer: Normalizer = "token") -> torch.Tensor:
        """Per-token loss weights for ``normalizer`` (``"token"`` or ``"sequence"``)."""
        check_normalizer(normalizer)
        return self.loss_weights if normalizer == "token" else self.sequence_loss_weights()

    def dense_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[N, N]`` bool ancestor-only mask, ``mask[q, k]`` = query q may attend key k."""
        from compaction_gym.trainers.tree_sft.masks import dense_tree_mask

        return dense_tree_mask(self.subtree_end.to(device))

    def block_mask(self, device: torch.device | str | None = None) -> BlockMask:
        """FlexAttention ``BlockMask`` of the same mask (cached per tree shape and device)."""
        from compaction_gym.trainers.tree_sft.masks import tree_block_mask

        return tree_block_mask(self, device=device)

    def attention_mask(
        self,
        attn_implementation: str = "sdpa",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor | BlockMask:
        """The mask in the form a Hugging Face model with ``attn_implementation`` uses as-is:
        ``[1, 1, N, N]`` bool for ``sdpa``, additive ``dtype`` for ``eager``, a ``BlockMask`` for
        ``flex_attention`` (transformers returns any 4-D mask unchanged)."""
        check_attn_implementation(attn_implementation)
        if attn_implementation == "flex_attention":
            return self.block_mask(device)
        mask = self.dense_mask(device)[None, None]
        if attn_implementation == "eager":
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                ~mask, torch.finfo(dtype).min
            )
        return mask

    def model_inputs(
        self,
        attn_implementation: str = "sdpa",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> dict[str, torch.Tensor | BlockMask]:
        """``input_ids``, ``position_ids`` (``[1, N]``) and ``attention_mask`` for ``model(**inputs)``."""
        return {
            "input_ids": self.input_ids[None].to(device),
            "position_ids": self.position_ids[None].to(device),
            "attention_mask": self.attention_mask(attn_implementation, device=device, dtype=dtype),
        }


def check_normalizer(normalizer: str) -> None:
    if normalizer not in NORMALIZERS:
        raise InvalidArgumentError(f"normalizer must be one of {NORMALIZERS}, got {normalizer!r}")


def check_attn_implementation(attn_implementation: str) -> None:
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise InvalidArgumentError(
            f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}"
        )


def check_tree_limits(
    tree: Tree, *, seq_len: int | None = None, max_packed_tokens: int | None = None
) -> None:
    """Raise :class:`TreeTooLongError` if ``tree`` exceeds either limit (``None`` = no limit)."""
    if seq_len is not None and tree.seq_len > seq_len:
        raise TreeTooLongError(
            f"the tree's longest root→leaf path has {tree.seq_len} tokens > seq_len={seq_len}; raise seq_len "
            "(the context one branch needs) or drop/split the tree"
        )
    if max_packed_tokens is not None and tree.num_tokens > max_packed_tokens:
        raise TreeTooLongError(
            f"the packed tree has {tree.num_tokens} tokens > max_packed_tokens={max_packed_tokens}; raise "
            "max_packed_tokens (a memory bound, independent of seq_len) or drop/split the tree"
        )


def tree_fits(tree: Tree, *, seq_len: int | None = None, max_packed_tokens: int | None = None) -> bool:
    """Whether ``tree`` satisfies both limits."""
    return (seq_len is None or tree.seq_len <= seq_len) and (
        max_packed_tokens is None or tree.num_tokens <= max_packed_tokens
    )


def pack_tree(tree: Tree, *, seq_len: int | None = None, max_packed_tokens: int | None = None) -> PackedTree:
    """Pack ``tree`` in DFS pre-order.

    Args:
        tree: the tree.
        seq_len: cap on the longest root→leaf path (the model context one branch needs).
        max_packed_tokens: cap on the whole packed tree (memory and step time).

    Returns:
        A :class:`PackedTree` (CPU tensors).

    Raises:
        TreeTooLongError: a limit is exceeded.

    Example:
        >>> from compaction_gym.trainers.tree_sft import Tree, TreeNode
        >>> p = pack_tree(Tree([TreeNode(-1, [5, 6]), TreeNode(0, [7]), TreeNode(0, [8, 9])]))
        >>> p.position_ids.tolist(), p.prev_map.tolist()
        ([0, 1, 2, 2, 3], [-1, 0, 1, 1, 3])
    """
    check_tree_limits(tree, seq_len=seq_len, max_packed_tokens=max_packed_tokens)
    nodes, children = tree.nodes, tree.children
    m = len(nodes)

    order: list[int] = []
    stack = [0]
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(reversed(children[i]))

    lengths = [len(n) for n in nodes]
    subtree_tokens = list(lengths)
    for i in range(m - 1, 0, -1):
        subtree_tokens[nodes[i].parent] += subtree_tokens[i]
    start = [0] * m
    offset = 0
    for i in order:
        start[i] = offset
        offset += lengths[i]
    n_tokens = offset

    counts = tree.leaf_counts()
    k = tree.num_leaves
    depth = tree.depth_start
    ids, pos, prev, node_of, mask, sub_end, g = [], [], [], [], [], [], []
    for i in order:
        n = lengths[i]
        ids.extend(nodes[i].token_ids)
        mask.extend(nodes[i].loss_mask)
        pos.extend(range(depth[i], depth[i] + n))
        parent = nodes[i].parent
        first_prev = -1 if parent == -1 else start[parent] + lengths[parent] - 1
        prev.append(first_prev)
        prev.extend(range(start[i], start[i] + n - 1))
        node_of.extend([i] * n)
        sub_end.extend([start[i] + subtree_tokens[i]] * n)
        g.extend([counts[i]] * n)

    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    prev_t = as_long(prev)
    mask_t = as_long(mask)
    trainable = (mask_t > 0) & (prev_t >= 0)
    weights = torch.tensor(g, dtype=torch.float64) / k * trainable.to(torch.float64)

    ancestors = torch.zeros(m, m, dtype=torch.bool)
    for i in range(m):  # parents come first, so their rows are complete
        if nodes[i].parent >= 0:
            ancestors[:, i] = ancestors[:, nodes[i].parent]
        ancestors[i, i] = True

    assert len(ids) == n_tokens
    return PackedTree(
        tree=tree,
        input_ids=as_long(ids),
        position_ids=as_long(pos),
        prev_map=prev_t,
        node_of_token=as_long(node_of),
        loss_mask=mask_t,
        loss_weights=weights,
        subtree_end=as_long(sub_end),
        ancestors=ancestors,
        node_order=as_long(order),
        node_start=as_long(start),
        num_leaves=k,
        seq_len=tree.seq_len,
        branch_tokens=tree.branch_tokens,
    )
