"""Tree builders: prefix-tree merging, GRPO groups, chat conversations, trajectories, selection."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from compaction_gym.agents.trajectory import Trajectory, Turn
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.tree_sft import (
    Tree,
    TreeNode,
    add_tree_stats,
    branching_score,
    chat_samples,
    fold_extensions,
    select_trees,
    tree_from_chat,
    tree_from_group,
    tree_from_sequences,
    tree_from_trajectory,
    trees_to_dataset,
)


def _as_multiset(samples):
    """Samples as a multiset, the first token's (never used) mask bit cleared."""
    return Counter((tuple(ids), (0, *mask[1:])) for ids, mask in samples)


def test_tree_from_sequences_is_exactly_the_samples():
    rng = random.Random(0)
    for _ in range(20):
        stem = [7] + [rng.randrange(5) for _ in range(rng.randint(0, 4))]
        samples = []
        for _ in range(rng.randint(1, 6)):
            ids = stem + [rng.randrange(3) for _ in range(rng.randint(1, 5))]
            samples.append((ids, [int(rng.random() < 0.6) for _ in ids]))
        samples.append(samples[0])  # a duplicate
        if len(samples[1][0]) > 2:
            samples.append((samples[1][0][:-1], samples[1][1][:-1]))  # a prefix of another
        tree = tree_from_sequences(samples)
        assert tree.num_leaves == len(samples)
        assert _as_multiset(tree.branches()) == _as_multiset(samples)
        assert tree.num_tokens <= sum(len(s[0]) for s in samples)


def test_tree_from_sequences_shares_prefixes_and_splits_on_mask():
    tree = tree_from_sequences(
        [([1, 2, 3, 4], [0, 0, 1, 1]), ([1, 2, 3, 5], [0, 0, 1, 1]), ([1, 2, 3], [0, 1, 1])]
    )
    assert tree.num_tokens == 4 + 1 + 3 - 1  # [1] shared; [2,3] with mask 0,1 vs 1,1 split
    assert tree.nodes[0].token_ids == (1,)
    with pytest.raises(InvalidArgumentError, match="one root"):
        tree_from_sequences([([1, 2], None), ([2, 2], None)])
    with pytest.raises(InvalidArgumentError, match="has 1 token"):
        tree_from_sequences([([1], [1])])


def test_fold_extensions_merges_a_turn_into_the_next_when_it_is_a_prefix():
    samples = [([1, 2, 3], [0, 0, 1]), ([1, 2, 3, 4, 5], [0, 0, 0, 0, 1]), ([1, 2, 9, 5], [0, 0, 0, 1])]
    assert fold_extensions(samples) == [([1, 2, 3, 4, 5], [0, 0, 1, 0, 1]), ([1, 2, 9, 5], [0, 0, 0, 1])]
    assert fold_extensions([([1, 2], [1, 0])]) == []  # position 0 is never a target


@pytest.mark.parametrize("merge", [True, False])
def test_tree_from_group(merge):
    prompt = [5, 6, 7]
    completions = [[1, 2, 3], [1, 2, 4], [9], [1, 2, 3]]
    tree = tree_from_group(prompt, completions, merge_prefixes=merge)
    assert tree.num_leaves == 4
    assert _as_multiset(tree.branches()) == _as_multiset(
        [(prompt + c, [0, 0, 0] + [1] * len(c)) for c in completions]
    )
    assert tree.num_tokens == (3 + 2 + 1 + 1 + 1 + 1 if merge else 3 + 3 + 3 + 1 + 3)
    with pytest.raises(InvalidArgumentError, match="completion 1 is empty"):
        tree_from_group(prompt, [[1], []])


CONVERSATION = [
    {"role": "user", "content": "go to the red ball"},
    {"role": "assistant", "content": "<think>the ball is left</think>turn left"},
    {"role": "user", "content": "a red ball 1 step forward"},
    {"role": "assistant", "content": "go forward", "reasoning_content": "it is in front"},
    {"role": "user", "content": "done?"},
    {"role": "assistant", "content": "toggle"},
]


def _decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_tree_from_chat_makes_reasoning_side_leaves(tiny_tokenizer):
    tree = tree_from_chat(CONVERSATION, tiny_tokenizer)
    # turn 1 and 2 reasoning are side leaves; turn 3 (no reasoning) ends the trunk
    assert tree.num_leaves == 3
    texts = []
    for ids, mask in tree.branches():
        trained = _decode(tiny_tokenizer, [t for t, m in zip(ids, mask) if m])
        texts.append((_decode(tiny_tokenizer, ids), trained))
    by_trained = {trained: full for full, trained in texts}
    assert set(by_trained) == {
        "<think>the ball is left</think>turn left<|im_end|>\n",
        "<think>it is in front</think>go forward<|im_end|>\n",
        "toggle<|im_end|>\n",
    }
    last = by_trained["toggle<|im_end|>\n"]
    assert "<think>" not in last and "turn left<|im_end|>" in last and "go forward<|im_end|>" in last
    # the tree's branches are the per-turn samples after folding
    samples = fold_extensions(chat_samples(CONVERSATION, tiny_tokenizer))
    assert _as_multiset(tree.branches()) == _as_multiset(samples)


def test_tree_from_chat_without_reasoning_is_one_chain(tiny_tokenizer):
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in CONVERSATION]
    plain[1] = {"role": "assistant", "content": "turn left"}
    tree = tree_from_chat(plain, tiny_tokenizer)
    assert tree.num_leaves == 1 and len(tree) == 1
    ((ids, mask),) = tree.branches()
    trained = _decode(tiny_tokenizer, [t for t, m in zip(ids, mask) if m])
    assert trained == "turn left<|im_end|>\ngo forward<|im_end|>\ntoggle<|im_end|>\n"
    assert _decode(tiny_tokenizer, ids) == tiny_tokenizer.apply_chat_template(plain, tokenize=False)


#: Qwen3-style: past reasoning is dropped, the last assistant turn shows ``reasoning_content``.
STRIPPING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' and loop.last and m.get('reasoning_content') %}"
    "{{ '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_tree_from_chat_uses_a_template_that_renders_reasoning(tiny_tokenizer):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "turn left", "reasoning_content": "left it is"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "turn right", "reasoning_content": "now right"},
    ]
    tree = tree_from_chat(msgs, tiny_tokenizer, chat_template=STRIPPING_TEMPLATE)
    assert tree.num_leaves == 2
    full = [_decode(tiny_tokenizer, ids) for ids, _ in tree.branches()]
    assert any(
        t.endswith("<think>\nnow right\n</think>\n\nturn right<|im_end|>\n") and "left it is" not in t
        for t in full
    )


def test_tree_from_chat_errors(tiny_tokenizer):
    with pytest.raises(InvalidArgumentError, match="no assistant turn"):
        tree_from_chat([{"role": "user", "content": "hi"}], tiny_tokenizer)


def _trajectory(tokenizer) -> Trajectory:
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = enc("<|im_start|>user\nPLAY!<|im_end|>\n")
    ids, cmask, turns = list(prompt), [0] * len(prompt), []
    outputs = [
        "<think>wall ahead</think>turn left<|im_end|>",
        "go forward<|im_end|>",
        "<think>ok</think>toggle<|im_end|>",
    ]
    for i, out in enumerate(outputs):
        inp = enc(f"\n<|im_start|>user\nobs {i}<|im_end|>\n<|im_start|>assistant\n")
        a = len(ids)
        ids += inp
        cmask += [0] * len(inp)
        o = enc(out)
        c = len(ids)
        ids += o
        cmask += [1] * len(o) if i != 1 else [0] * len(o)  # turn 1 is teacher-forced
        turns.append(Turn((a, c), (c, len(ids)), f"obs {i}", out, forced=(i == 1)))
    return Trajectory(
        token_ids=ids, completion_mask=cmask, logprobs=[0.0] * len(ids), prompt_len=len(prompt), turns=turns
    )


def test_tree_from_trajectory(tiny_tokenizer):
    traj = _trajectory(tiny_tokenizer)
    chain = tree_from_trajectory(traj)
    assert chain.num_leaves == 1
    ((ids, mask),) = chain.branches()
    assert ids == traj.token_ids
    assert [i for i, m in enumerate(mask) if m] == [i for t in traj.turns for i in range(*t.output_range)]
    sampled = tree_from_trajectory(traj, targets="sampled")
    assert sampled.branches()[0][1] == traj.completion_mask

    tree = tree_from_trajectory(traj, tokenizer=tiny_tokenizer, strip_reasoning=True)
    assert tree.num_leaves == 2  # turn 0's reasoning is a side leaf; turns 1-2 extend the trunk
    texts = sorted(_decode(tiny_tokenizer, ids) for ids, _ in tree.branches())
    assert texts[0].endswith("<think>wall ahead</think>turn left<|im_end|>")
    assert "turn left<|im_end|>\n<|im_start|>user\nobs 1" in texts[1] and "wall ahead" not in texts[1]
    assert texts[1].endswith("<think>ok</think>toggle<|im_end|>")
    with pytest.raises(InvalidArgumentError, match="needs the tokenizer"):
        tree_from_trajectory(traj, strip_reasoning=True)
    with pytest.raises(InvalidArgumentError, match="targets must be"):
        tree_from_trajectory(traj, targets="all")


def test_branching_score_and_selection():
    chain = Tree.chain([1, 2, 3, 4])
    bushy = Tree([TreeNode(-1, [1] * 10)] + [TreeNode(0, [2, 3]) for _ in range(5)])
    long_path = Tree([TreeNode(-1, [1] * 30), TreeNode(0, [2]), TreeNode(0, [3])])
    assert branching_score(chain) == 1.0
    assert branching_score(bushy) == pytest.approx(60 / 20)
    ds = add_tree_stats(trees_to_dataset([chain, bushy, long_path, bushy]), num_proc=2)
    assert ds["num_leaves"] == [1, 5, 2, 5] and ds["seq_len"] == [4, 12, 31, 12]
    picked = select_trees(ds, seq_len=20, max_examples=2, num_proc=2)
    assert picked["num_leaves"] == [5, 5] and picked["branching_score"] == [3.0, 3.0]
    by_leaves = select_trees(ds, metric="num_leaves", max_packed_tokens=25)
    assert by_leaves["num_leaves"] == [5, 5, 1]
    with pytest.raises(InvalidArgumentError, match="unknown selection metric"):
        select_trees(ds, metric="nope")
