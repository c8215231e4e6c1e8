"""The tree data model, DFS packing and masks, checked against brute-force constructions."""

from __future__ import annotations

import random

import pytest
import torch
from tree_helpers import ancestors_or_self, preorder, random_tree

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.tree_sft import (
    InvalidTreeError,
    Tree,
    TreeNode,
    TreeTooLongError,
    pack_tree,
    tree_block_mask,
    tree_fits,
)

TREES = [random_tree(random.Random(seed), vocab=50) for seed in range(30)]


# -- data model ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nodes", "match"),
    [
        ([], "at least one node"),
        ([TreeNode(0, [1])], "node 0 must be the root"),
        ([TreeNode(-1, [1]), TreeNode(-1, [2])], "second root"),
        ([TreeNode(-1, [1]), TreeNode(2, [2]), TreeNode(0, [3])], "parents must come before"),
        ([TreeNode(-1, [1]), TreeNode(1, [2])], "parents must come before"),
        ([TreeNode(-1, [1]), TreeNode(0, [])], "node 1 is empty"),
        ([TreeNode(-1, [1, 2], [1])], "loss_mask has 1 entries for 2 tokens"),
        ([TreeNode(-1, [1, 2], [1, 2])], "must be 0 or 1"),
        ([TreeNode(-1, [1, -2])], "non-negative"),
        ([TreeNode(-1, [1]), (0, [2])], "expected TreeNode"),
    ],
)
def test_invalid_trees_raise(nodes, match):
    with pytest.raises(InvalidTreeError, match=match):
        Tree(nodes)


def test_invalid_tree_is_an_invalid_argument_error():
    with pytest.raises(InvalidArgumentError):
        Tree([])
    with pytest.raises(InvalidTreeError, match="needs 'parents' and 'token_ids'"):
        Tree.from_dict({"token_ids": [[1]]})
    with pytest.raises(InvalidTreeError, match="columns disagree"):
        Tree.from_dict({"parents": [-1, 0], "token_ids": [[1]]})


def test_tree_helpers():
    tree = Tree([TreeNode(-1, [1, 2], [0, 0]), TreeNode(0, [3]), TreeNode(0, [4, 5]), TreeNode(2, [6])])
    assert tree.leaves == (1, 3)
    assert tree.children == ((1, 2), (), (3,), ())
    assert tree.depth_start == (0, 2, 2, 4)
    assert tree.leaf_counts() == (2, 1, 1, 1)
    assert tree.root_path(3) == [0, 2, 3]
    assert tree.branches() == [([1, 2, 3], [0, 0, 1]), ([1, 2, 4, 5, 6], [0, 0, 1, 1, 1])]
    assert (tree.num_tokens, tree.seq_len, tree.branch_tokens, tree.num_leaves) == (6, 5, 8, 2)
    assert Tree.from_dict(tree.to_dict()) == tree
    assert Tree.chain([1, 2, 3]).branches() == [([1, 2, 3], [1, 1, 1])]
    with pytest.raises(IndexError):
        tree.root_path(7)


# -- packing vs brute force ---------------------------------------------------------------------
@pytest.mark.parametrize("tree", TREES, ids=[f"tree{i}" for i in range(len(TREES))])
def test_packing_matches_brute_force(tree):
    packed = pack_tree(tree)
    order = preorder(tree)
    assert packed.node_order.tolist() == order

    # token layout: nodes in pre-order, each node's tokens contiguous
    owner, offset_in_node = [], []
    for v in order:
        owner += [v] * len(tree.nodes[v])
        offset_in_node += list(range(len(tree.nodes[v])))
    n = len(owner)
    assert packed.num_tokens == n == tree.num_tokens
    assert packed.node_of_token.tolist() == owner
    assert packed.input_ids.tolist() == [tree.nodes[v].token_ids[j] for v, j in zip(owner, offset_in_node)]
    start = {v: owner.index(v) for v in order}

    def depth(v: int) -> int:
        p = tree.nodes[v].parent
        return 0 if p == -1 else depth(p) + len(tree.nodes[p])

    assert packed.position_ids.tolist() == [depth(v) + j for v, j in zip(owner, offset_in_node)]
    expected_prev = []
    for v, j in zip(owner, offset_in_node):
        p = tree.nodes[v].parent
        if j > 0:
            expected_prev.append(start[v] + j - 1)
        elif p == -1:
            expected_prev.append(-1)
        else:
            expected_prev.append(start[p] + len(tree.nodes[p]) - 1)
    assert packed.prev_map.tolist() == expected_prev

    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        anc = ancestors_or_self(tree, owner[q])
        for k in range(q + 1):
            mask[q, k] = owner[k] in anc
    assert torch.equal(packed.dense_mask(), mask)
    assert torch.equal(packed.attention_mask("sdpa")[0, 0], mask)
    eager = packed.attention_mask("eager", dtype=torch.float64)[0, 0]
    assert torch.equal(eager == 0, mask) and bool((eager[~mask] == torch.finfo(torch.float64).min).all())

    anc_table = torch.zeros(len(tree), len(tree), dtype=torch.bool)
    for b in range(len(tree)):
        for a in ancestors_or_self(tree, b):
            anc_table[a, b] = True
    assert torch.equal(packed.ancestors, anc_table)

    # weights: g_t / K over trainable tokens; g_t = branches containing the token
    k = tree.num_leaves
    leaves_through = [sum(v in ancestors_or_self(tree, leaf) for leaf in tree.leaves) for v in owner]
    trainable = [m == 1 and p >= 0 for m, p in zip(packed.loss_mask.tolist(), expected_prev)]
    expected_w = torch.tensor(
        [g / k if t else 0.0 for g, t in zip(leaves_through, trainable)], dtype=torch.float64
    )
    torch.testing.assert_close(packed.loss_weights, expected_w, rtol=0, atol=1e-15)
    assert packed.target_index.tolist() == [t for t in range(n) if trainable[t]]

    # sequence weights: mean over branches (with targets) of 1/n_b per target
    counts = {
        leaf: sum(1 for t in range(n) if trainable[t] and owner[t] in ancestors_or_self(tree, leaf))
        for leaf in tree.leaves
    }
    used = [leaf for leaf in tree.leaves if counts[leaf]]
    expected_seq = torch.zeros(n, dtype=torch.float64)
    for leaf in used:
        for t in range(n):
            if trainable[t] and owner[t] in ancestors_or_self(tree, leaf):
                expected_seq[t] += 1.0 / counts[leaf] / len(used)
    torch.testing.assert_close(packed.sequence_loss_weights(), expected_seq, rtol=0, atol=1e-15)
    if used:
        assert abs(float(packed.sequence_loss_weights().sum()) - 1.0) < 1e-12


@pytest.mark.parametrize("tree", TREES[:10], ids=[f"tree{i}" for i in range(10)])
def test_block_mask_matches_dense_mask(tree):
    packed = pack_tree(tree)
    dense = packed.dense_mask()
    block_size = 8  # small blocks so that every tree spans several, incl. a partial last block
    block_mask = tree_block_mask(packed, block_size=block_size)
    n = packed.num_tokens
    # the mask_mod evaluated everywhere equals the dense mask
    q = torch.arange(n)[:, None].expand(n, n)
    k = torch.arange(n)[None, :].expand(n, n)
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(block_mask.mask_mod(zero, zero, q, k), dense)
    # block level: a block is listed iff it has a visible pair (to_dense gives the block map)
    nb = -(-n // block_size)
    padded = torch.zeros(nb * block_size, nb * block_size, dtype=torch.bool)
    padded[:n, :n] = dense
    expected_blocks = padded.view(nb, block_size, nb, block_size).any(3).any(1)
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), expected_blocks)
    # cached per tree shape
    assert tree_block_mask(pack_tree(Tree(list(tree.nodes))), block_size=block_size) is block_mask


def test_limits_distinguish_seq_len_from_packed_tokens():
    # 4 branches of 10 tokens sharing a 4-token root: path 10, packed 4 + 4*6 = 28
    tree = Tree([TreeNode(-1, [1] * 4)] + [TreeNode(0, [2] * 6) for _ in range(4)])
    assert (tree.seq_len, tree.num_tokens) == (10, 28)
    pack_tree(tree, seq_len=10, max_packed_tokens=28)
    assert tree_fits(tree, seq_len=10) and not tree_fits(tree, max_packed_tokens=27)
    with pytest.raises(TreeTooLongError, match="longest root→leaf path has 10 tokens > seq_len=9"):
        pack_tree(tree, seq_len=9)
    with pytest.raises(TreeTooLongError, match="packed tree has 28 tokens > max_packed_tokens=27"):
        pack_tree(tree, seq_len=10, max_packed_tokens=27)


def test_argument_errors_list_valid_values():
    packed = pack_tree(TREES[0])
    with pytest.raises(InvalidArgumentError, match=r"one of \('sdpa', 'flex_attention', 'eager'\)"):
        packed.attention_mask("flash")
    with pytest.raises(InvalidArgumentError, match=r"one of \('token', 'sequence'\)"):
        packed.weights("branch")
