"""Shared helpers of the tree tests: random trees and brute-force references."""

from __future__ import annotations

import contextlib
import random

import torch

from compaction_gym.trainers.tree_sft import Tree, TreeNode


def random_tree(rng: random.Random, vocab: int, *, max_nodes: int = 9, max_len: int = 7) -> Tree:
    """A random tree: node count, branching (parent choice biased to recent nodes or to the root),
    node lengths and loss masks all drawn at random."""
    n = rng.randint(1, max_nodes)
    style = rng.choice(["bushy", "deep", "uniform"])
    nodes = []
    for i in range(n):
        if i == 0:
            parent = -1
        elif style == "bushy":
            parent = rng.choice([0, rng.randrange(i)])
        elif style == "deep":
            parent = max(0, i - rng.randint(1, 2))
        else:
            parent = rng.randrange(i)
        length = rng.randint(1, max_len)
        ids = [rng.randrange(vocab) for _ in range(length)]
        mask = [int(rng.random() < 0.7) for _ in range(length)]
        nodes.append(TreeNode(parent, ids, mask))
    return Tree(nodes)


def preorder(tree: Tree) -> list[int]:
    """Recursive DFS pre-order (children by index), independent of the packer's stack."""
    kids = {i: [j for j in range(len(tree)) if tree.nodes[j].parent == i] for i in range(len(tree))}
    out: list[int] = []

    def visit(i: int) -> None:
        out.append(i)
        for j in kids[i]:
            visit(j)

    visit(0)
    return out


def ancestors_or_self(tree: Tree, node: int) -> set[int]:
    out = {node}
    while tree.nodes[node].parent != -1:
        node = tree.nodes[node].parent
        out.add(node)
    return out


@contextlib.contextmanager
def one_thread():
    """Run torch on one thread: the tiny-model matmuls are far faster without OpenMP contention on a
    shared 2-core machine (10× and more), and results stay deterministic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
