"""Packed-tree forward, loss and gradients equal per-branch training (float64, tiny Qwen3).

The reference runs every root→leaf branch through the model on its own with the default causal
mask and positions 0..n-1; nothing of the tree code is used for it.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F
from tree_helpers import random_tree

from compaction_gym.trainers.tree_sft import (
    Tree,
    TreeNode,
    branch_loss,
    pack_tree,
    tree_forward,
    tree_loss,
    tree_nll_loss,
)

N_TREES = 24


@pytest.fixture(scope="module")
def model64(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    assert model.config._attn_implementation == "sdpa"
    return model.eval()


@pytest.fixture(scope="module")
def trees(model64):
    vocab = model64.config.vocab_size
    return [random_tree(random.Random(100 + i), vocab) for i in range(N_TREES)]


def branch_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def reference_losses(model, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-mean over all branch targets, mean over branches of each branch's token mean)."""
    total, count, branch_means = 0.0, 0, []
    for ids, mask in tree.branches():
        logits = branch_logits(model, ids)
        targets = [j for j in range(1, len(ids)) if mask[j]]
        if not targets:
            continue
        ce = F.cross_entropy(
            logits[[j - 1 for j in targets]], torch.tensor([ids[j] for j in targets]), reduction="none"
        )
        total = total + ce.sum()
        count += len(targets)
        branch_means.append(ce.mean())
    return total / count, torch.stack(branch_means).mean()


def has_targets(tree: Tree) -> bool:
    return bool(pack_tree(tree).trainable.any())


def test_packed_logits_equal_per_branch_logits(model64, trees):
    for tree in trees:
        packed = pack_tree(tree)
        with torch.no_grad():
            logits = tree_forward(model64, packed)
            for leaf in tree.leaves:
                ids, _ = tree.branch(leaf)
                rows = torch.cat(
                    [
                        torch.arange(len(tree.nodes[v])) + int(packed.node_start[v])
                        for v in tree.root_path(leaf)
                    ]
                )
                ref = branch_logits(model64, ids)
                assert (logits[rows] - ref).abs().max().item() <= 1e-10, tree


def test_gathered_logits_equal_full_logits(model64, trees):
    packed = pack_tree(trees[3])
    with torch.no_grad():
        full = tree_forward(model64, packed)
        gathered = tree_forward(model64, packed, logits_to_keep=packed.source_index)
    torch.testing.assert_close(gathered, full[packed.source_index], rtol=0, atol=1e-12)
    a = tree_nll_loss(full, packed)
    b = tree_nll_loss(gathered, packed, gathered=True)
    assert abs(a.item() - b.item()) <= 1e-12
    with torch.no_grad():
        hidden = model64.model(**packed.model_inputs(dtype=torch.float64)).last_hidden_state[0]
        c = tree_nll_loss(hidden, packed, lm_head=model64.lm_head)
    assert abs(a.item() - c.item()) <= 1e-12


@pytest.mark.parametrize("normalizer", ["token", "sequence"])
def test_tree_loss_equals_per_branch_loss(model64, trees, normalizer):
    checked = 0
    for tree in trees:
        if not has_targets(tree):
            assert tree_loss(model64, tree).item() == 0.0
            continue
        with torch.no_grad():
            token_ref, seq_ref = reference_losses(model64, tree)
            ref = token_ref if normalizer == "token" else seq_ref
            loss = tree_loss(model64, tree, normalizer=normalizer)
            baseline = branch_loss(model64, tree, normalizer=normalizer)
        assert abs(loss.item() - ref.item()) <= 1e-10 * abs(ref.item())
        assert abs(baseline.item() - ref.item()) <= 1e-10 * abs(ref.item())
        checked += 1
    assert checked >= 20


def test_gradients_equal_per_branch_gradients(model64, trees):
    params = [p for p in model64.parameters() if p.requires_grad]
    checked = 0
    for tree in trees:
        if not has_targets(tree):
            continue
        model64.zero_grad()
        tree_loss(model64, tree).backward()
        tree_grads = [p.grad.clone() for p in params]
        model64.zero_grad()
        reference_losses(model64, tree)[0].backward()
        for (name, p), g in zip(model64.named_parameters(), tree_grads):
            scale = p.grad.abs().max().item()
            # RMSNorm runs in float32 even in a float64 model: agreement is ~1e-7, not 1e-15
            assert (g - p.grad).abs().max().item() <= 1e-6 * max(scale, 1e-30), name
        checked += 1
    model64.zero_grad()
    assert checked >= 20


def test_sum_reduction_and_zero_target_tree(model64):
    tree = Tree([TreeNode(-1, [3, 4], [0, 0]), TreeNode(0, [5, 6]), TreeNode(0, [7])])
    packed = pack_tree(tree)
    with torch.no_grad():
        logits = tree_forward(model64, packed)
    total = tree_nll_loss(logits, packed, reduction="sum")
    mean = tree_nll_loss(logits, packed)
    assert abs(total.item() / packed.loss_weights.sum().item() - mean.item()) < 1e-12
    empty = Tree([TreeNode(-1, [3, 4], [1, 0])])  # the root's first token is never a target
    assert tree_loss(model64, empty).item() == 0.0
    with pytest.raises(ValueError, match="gathered logits have"):
        tree_nll_loss(logits, packed, gathered=True)


def test_tree_loss_restores_the_attention_backend(model64, trees):
    with torch.no_grad():
        eager = tree_loss(model64, trees[1], attn_implementation="eager")
        sdpa = tree_loss(model64, trees[1])
    assert model64.config._attn_implementation == "sdpa"
    # eager softmax runs in float32 in transformers: agreement ~1e-7
    assert abs(eager.item() - sdpa.item()) <= 1e-6 * abs(sdpa.item())


def test_flex_attention_on_cpu_runs_sdpa_for_every_tree_shape(tiny_model_path, caplog):
    """On CPU, ``flex_attention`` tree forwards run SDPA with the dense ancestor mask (logged once):
    Inductor's CPU FlexAttention kernel failed to compile on the second tree shape of a process."""
    from transformers import AutoModelForCausalLM

    import compaction_gym.trainers.tree_sft.loss as tree_loss_module

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tree_loss_module._warned_cpu_flex = False
    with caplog.at_level(logging.WARNING), torch.no_grad():
        for seed in (7, 8, 9):  # seed 8 was the shape that failed to compile
            packed = pack_tree(random_tree(random.Random(seed), model.config.vocab_size, max_nodes=9, max_len=40))
            flex = tree_forward(model, packed, attn_implementation="flex_attention")
            sdpa = tree_forward(model, packed)
            assert torch.equal(flex, sdpa)
            assert model.config._attn_implementation == "sdpa"
    assert caplog.text.count("flex_attention on CPU") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_matches_sdpa_on_gpu(tiny_model_path, dtype):
    """On CUDA: tree+FlexAttention equals tree+SDPA (loss ≤ 1e-4 relative in float32, gradients close)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=dtype).cuda()
    rng = random.Random(3)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for _ in range(4):
        tree = random_tree(rng, model.config.vocab_size, max_nodes=24, max_len=120)
        if not has_targets(tree):
            continue
        losses, grads = [], []
        for impl in ("flex_attention", "sdpa"):
            model.zero_grad()
            loss = tree_loss(model, tree, attn_implementation=impl)
            loss.backward()
            losses.append(loss.item())
            grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
        assert abs(losses[0] - losses[1]) <= tol * abs(losses[1])
        assert ((grads[0] - grads[1]).norm() / grads[1].norm()).item() <= 10 * tol
