"""Build trees from what we train on: token sequences, chat conversations, agent trajectories and
GRPO groups; score and select them for branching.

Every builder works the same way, which is what makes tree training *exactly* per-sample training:

1. write down the per-sample sequences a flat SFT pipeline would train on (token ids + loss mask);
2. fold a sample into the next one when it is a token prefix of it (the next turn extends the
   previous full sample: one sequence trains both turns, as multi-turn SFT does);
3. merge the remaining samples into a prefix tree (:func:`tree_from_sequences`).

So a chat template that strips past reasoning gives "each turn's reasoning is a side leaf, the visible
reply continues the trunk", and a template that keeps it gives a single chain, without either
case being special-cased.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.tree_sft.tree import Tree, TreeNode

if TYPE_CHECKING:
    from datasets import Dataset

    from compaction_gym.agents.trajectory import Trajectory

Sample = tuple[Sequence[int], Sequence[int]]

THINK_RE = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


# -- sequences → prefix tree ------------------------------------------------------------------------
def tree_from_sequences(samples: Sequence[Sample]) -> Tree:
    """Merge sequences into a prefix tree whose root→leaf branches are exactly ``samples``.

    Tokens are shared only where both the token id and the loss-mask bit agree. Each sample's last
    token sits in a leaf of its own, so duplicates and samples that are prefixes of others stay
    separate branches (K = ``len(samples)``) and the tree still equals per-sample training.
    The first token's mask bit is set to 0 (it has no predecessor, so it is never a target).

    Args:
        samples: ``(token_ids, loss_mask)`` pairs of at least 2 tokens (``loss_mask`` may be ``None``).

    Returns:
        A :class:`Tree` whose :meth:`Tree.branches` are the samples, in sorted-trie order.

    Raises:
        InvalidArgumentError: no samples, an empty sample, or mismatched lengths. All samples must
            share their first token (one root); prepend a common BOS/system prefix otherwise.
    """
    if not samples:
        raise InvalidArgumentError("tree_from_sequences needs at least one sequence")
    # trie over (token, mask); node 0 is a virtual root above the real one
    child_maps: list[dict[tuple, int]] = [{}]
    keys: list[tuple] = [()]
    parent: list[int] = [-1]
    for s, (ids, mask) in enumerate(samples):
        ids = list(ids)
        mask = [1] * len(ids) if mask is None else list(mask)
        if len(ids) < 2:
            raise InvalidArgumentError(f"sequence {s} has {len(ids)} token(s): nothing to predict, drop it")
        if len(mask) != len(ids):
            raise InvalidArgumentError(f"sequence {s}: {len(mask)} mask entries for {len(ids)} tokens")
        mask[0] = 0  # the first token is never a target; a common mask bit keeps a single root
        node = 0
        for j, (t, m) in enumerate(zip(ids, mask)):
            # a sample's last token is keyed by the sample: it always ends a leaf of its own
            key = (int(t), int(m)) if j < len(ids) - 1 else (int(t), int(m), "end", s)
            nxt = child_maps[node].get(key)
            if nxt is None:
                nxt = len(keys)
                child_maps[node][key] = nxt
                child_maps.append({})
                keys.append(key)
                parent.append(node)
            node = nxt
    roots = list(child_maps[0].values())
    if len(roots) != 1:
        raise InvalidArgumentError(
            f"the sequences start with {len(roots)} different (token, mask) pairs; a tree has one root. "
            "Give them a common first token (e.g. BOS or the shared system prompt)"
        )
    # compress single-child chains into nodes, emitting parents before children (DFS pre-order)
    nodes: list[TreeNode] = []
    stack: list[tuple[int, int]] = [(roots[0], -1)]
    while stack:
        start, tree_parent = stack.pop()
        ids, mask = [], []
        cur = start
        while True:
            ids.append(keys[cur][0])
            mask.append(keys[cur][1])
            kids = list(child_maps[cur].values())
            if len(kids) != 1:  # a branch point, or a leaf (a sample's last token)
                break
            cur = kids[0]
        index = len(nodes)
        nodes.append(TreeNode(tree_parent, ids, mask))
        for kid in reversed(kids):
            stack.append((kid, index))
    return Tree(nodes)


def fold_extensions(samples: Sequence[Sample]) -> list[tuple[list[int], list[int]]]:
    """Fold each sample into the next when its tokens are a prefix of the next one's (the loss masks
    are OR-ed), as multi-turn SFT trains several turns in one sequence. Samples without a target
    token are dropped."""
    out: list[tuple[list[int], list[int]]] = []
    for ids, mask in samples:
        ids, mask = list(ids), list(mask)
        if out:
            prev_ids, prev_mask = out[-1]
            if len(prev_ids) <= len(ids) and ids[: len(prev_ids)] == prev_ids:
                for j, m in enumerate(prev_mask):
                    mask[j] = mask[j] or m
                out[-1] = (ids, mask)
                continue
        out.append((ids, mask))
    return [(ids, mask) for ids, mask in out if any(mask[1:])]


# -- GRPO groups ------------------------------------------------------------------------------------
def tree_from_group(
    prompt_ids: Sequence[int],
    completions: Sequence[Sequence[int]],
    *,
    completion_masks: Sequence[Sequence[int]] | None = None,
    merge_prefixes: bool = True,
) -> Tree:
    """One prompt with G completions: the prompt is the root (loss 0), each completion a branch.

    Args:
        prompt_ids: the shared prompt tokens.
        completions: G completion token lists (non-empty).
        completion_masks: per-completion loss masks (default all ones; e.g. 0 on env tokens).
        merge_prefixes: also share common completion prefixes (the tree stays per-sample exact).

    Returns:
        A tree with G leaves.
    """
    if not prompt_ids:
        raise InvalidArgumentError("the prompt of a group must not be empty")
    if not completions:
        raise InvalidArgumentError("a group needs at least one completion")
    masks = completion_masks or [None] * len(completions)
    if len(masks) != len(completions):
        raise InvalidArgumentError(f"{len(masks)} completion masks for {len(completions)} completions")
    for g, c in enumerate(completions):
        if not c:
            raise InvalidArgumentError(f"completion {g} is empty; drop it before building the tree")
    if merge_prefixes:
        samples = [
            (list(prompt_ids) + list(c), [0] * len(prompt_ids) + (list(m) if m is not None else [1] * len(c)))
            for c, m in zip(completions, masks)
        ]
        return tree_from_sequences(samples)
    nodes = [TreeNode(-1, prompt_ids, [0] * len(prompt_ids))]
    nodes += [TreeNode(0, c, m) for c, m in zip(completions, masks)]
    return Tree(nodes)


# -- chat conversations -----------------------------------------------------------------------------
def split_reasoning(message: Mapping[str, Any], reasoning_key: str = "reasoning_content") -> tuple[str, str]:
    """``(reasoning, visible content)`` of an assistant message: from ``reasoning_key`` or a leading
    ``<think>…</think>`` block in the content (``""`` when there is none)."""
    content = message.get("content") or ""
    reasoning = message.get(reasoning_key) or ""
    match = THINK_RE.match(content)
    if match:
        return (reasoning or match.group(1)), content[match.end() :]
    return reasoning, content


def _render(tokenizer, messages, *, add_generation_prompt=False, chat_template=None, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **kwargs,
    )


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_samples(
    messages: Sequence[Mapping[str, Any]],
    tokenizer,
    *,
    chat_template: str | None = None,
    reasoning_key: str = "reasoning_content",
    reasoning_format: str = "<think>{reasoning}</think>{content}",
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """The per-turn SFT samples of a conversation (before folding and merging).

    Sample i is the history rendered *without* past reasoning (the visible replies, as a stripping
    template would show them), then assistant turn i *with* its reasoning; the loss mask is 1 on
    turn i's tokens only. Reasoning is rendered by the template when it shows ``reasoning_key``
    (e.g. Qwen3), else inlined with ``reasoning_format``.
    """
    kwargs = dict(template_kwargs or {})
    visible = []
    turns: list[tuple[int, dict[str, Any]]] = []
    for j, msg in enumerate(messages):
        if msg.get("role") == "assistant":
            reasoning, content = split_reasoning(msg, reasoning_key)
            visible.append({"role": "assistant", "content": content})
            full: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                full[reasoning_key] = reasoning
            turns.append((j, full))
        else:
            visible.append(dict(msg))
    samples = []
    for j, full in turns:
        prompt = _render(
            tokenizer, visible[:j], add_generation_prompt=True, chat_template=chat_template, **kwargs
        )
        text = _render(tokenizer, [*visible[:j], full], chat_template=chat_template, **kwargs)
        reasoning = full.get(reasoning_key)
        if reasoning and reasoning not in text[len(prompt) :]:
            inline = {
                "role": "assistant",
                "content": reasoning_format.format(reasoning=reasoning, content=full["content"]),
            }
            text = _render(tokenizer, [*visible[:j], inline], chat_template=chat_template, **kwargs)
        if not text.startswith(prompt):
            raise InvalidArgumentError(
                f"the chat template is not append-only at message {j}: the conversation up to the generation "
                "prompt is not a prefix of the conversation with the reply; pass chat_template=..."
            )
        p_ids, c_ids = _encode(tokenizer, prompt), _encode(tokenizer, text[len(prompt) :])
        samples.append((p_ids + c_ids, [0] * len(p_ids) + [1] * len(c_ids)))
    return samples


def tree_from_chat(
    messages: Sequence[Mapping[str, Any]],
    tokenizer,
    *,
    chat_template: str | None = None,
    reasoning_key: str = "reasoning_content",
    reasoning_format: str = "<think>{reasoning}</think>{content}",
    template_kwargs: Mapping[str, Any] | None = None,
) -> Tree:
    """A multi-turn conversation as a tree: each assistant turn's reasoning is a side leaf, the visible
    reply continues the trunk; turns without reasoning extend the trunk and are trained in place.

    Args:
        messages: chat messages; assistant reasoning in ``reasoning_key`` or a leading
            ``<think>…</think>`` in ``content``.
        tokenizer: a tokenizer with a chat template.
        chat_template, template_kwargs: passed to ``apply_chat_template``.
        reasoning_format: how to inline reasoning when the template does not render ``reasoning_key``.

    Returns:
        The tree; its branches are the per-turn samples of :func:`chat_samples` after folding.

    Raises:
        InvalidArgumentError: no assistant turn, or a template that is not append-only.

    Example:
        >>> tree = tree_from_chat(conversation, tokenizer)  # doctest: +SKIP
        >>> tree.num_leaves  # turns with reasoning + 1 (the trunk's last turn)  # doctest: +SKIP
    """
    samples = fold_extensions(
        chat_samples(
            messages,
            tokenizer,
            chat_template=chat_template,
            reasoning_key=reasoning_key,
            reasoning_format=reasoning_format,
            template_kwargs=template_kwargs,
        )
    )
    if not samples:
        raise InvalidArgumentError("the conversation has no assistant turn with tokens to train on")
    return tree_from_sequences(samples)


# -- agent trajectories -----------------------------------------------------------------------------
def trajectory_samples(
    trajectory: Trajectory,
    *,
    targets: str = "outputs",
    tokenizer=None,
    strip_reasoning: bool = False,
) -> list[tuple[list[int], list[int]]]:
    """Per-turn samples of a :class:`~compaction_gym.agents.trajectory.Trajectory`.

    Args:
        trajectory: the episode (its ``token_ids`` are the session's logical tokens).
        targets: ``"outputs"`` trains every turn's ``output_range`` (sampled *and* teacher-forced
            actions, as for expert demonstrations); ``"sampled"`` only tokens with
            ``completion_mask`` 1.
        tokenizer: needed with ``strip_reasoning``.
        strip_reasoning: show later turns each earlier output without its ``<think>…</think>`` block
            (re-tokenised), so reasoning becomes side leaves. Off: one chain, exactly the session.
    """
    if targets not in ("outputs", "sampled"):
        raise InvalidArgumentError(f"targets must be 'outputs' or 'sampled', got {targets!r}")
    if strip_reasoning and tokenizer is None:
        raise InvalidArgumentError("strip_reasoning=True needs the tokenizer to re-tokenise visible outputs")
    ids = list(trajectory.token_ids)
    cmask = list(trajectory.completion_mask)
    history: list[int] = list(ids[: trajectory.prompt_len])
    pos = trajectory.prompt_len
    samples = []
    for turn in trajectory.turns:
        c, d = turn.output_range
        history += ids[pos:c]  # the turn's input (template closing, observation, generation prompt)
        out = ids[c:d]
        out_mask = [1] * len(out) if targets == "outputs" else cmask[c:d]
        samples.append((history + out, [0] * len(history) + out_mask))
        visible = out
        if strip_reasoning:
            text = tokenizer.decode(out, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            match = THINK_RE.match(text)
            if match:
                visible = _encode(tokenizer, text[match.end() :])
        history = history + visible
        pos = d
    return samples


def tree_from_trajectory(
    trajectory: Trajectory, *, targets: str = "outputs", tokenizer=None, strip_reasoning: bool = False
) -> Tree:
    """One trajectory as a tree (a chain unless ``strip_reasoning`` makes reasoning side leaves).
    See :func:`trajectory_samples` for the arguments."""
    return tree_from_trajectories(
        [trajectory], targets=targets, tokenizer=tokenizer, strip_reasoning=strip_reasoning
    )


def tree_from_trajectories(
    trajectories: Iterable[Trajectory],
    *,
    targets: str = "outputs",
    tokenizer=None,
    strip_reasoning: bool = False,
) -> Tree:
    """Several trajectories merged into one tree on their shared prefix (system prompt, instruction,
    identical early turns). Equal to training on each trajectory's samples separately."""
    samples: list[tuple[list[int], list[int]]] = []
    for traj in trajectories:
        samples += fold_extensions(
            trajectory_samples(traj, targets=targets, tokenizer=tokenizer, strip_reasoning=strip_reasoning)
        )
    if not samples:
        raise InvalidArgumentError("the trajectories have no target tokens (targets=" + repr(targets) + ")")
    return tree_from_sequences(samples)


# -- scoring and selection --------------------------------------------------------------------------
def branching_score(tree: Tree) -> float:
    """Branch tokens per packed token (≥ 1; 1 for a chain): the factor of tokens that tree packing
    saves over per-branch training, a good proxy for its speed-up."""
    return tree.branch_tokens / tree.num_tokens


def tree_stats(tree: Tree) -> dict[str, float | int]:
    """``num_leaves``, ``packed_tokens``, ``seq_len``, ``branch_tokens``, ``branching_score``."""
    return {
        "num_leaves": tree.num_leaves,
        "packed_tokens": tree.num_tokens,
        "seq_len": tree.seq_len,
        "branch_tokens": tree.branch_tokens,
        "branching_score": branching_score(tree),
    }


def _stats_row(row: Mapping[str, Any]) -> dict[str, float | int]:
    return tree_stats(Tree.from_dict(row))


def trees_to_dataset(trees: Iterable[Tree]) -> Dataset:
    """A ``datasets.Dataset`` with one tree per row (columns ``parents``, ``token_ids``, ``loss_mask``)."""
    from datasets import Dataset

    rows = [t.to_dict() for t in trees]
    return Dataset.from_dict({k: [r[k] for r in rows] for k in ("parents", "token_ids", "loss_mask")})


def add_tree_stats(dataset: Dataset, *, num_proc: int | None = None) -> Dataset:
    """Add the :func:`tree_stats` columns to a dataset of tree rows (``datasets.map(num_proc=...)``)."""
    return dataset.map(_stats_row, num_proc=num_proc, desc="tree stats")


def select_trees(
    dataset: Dataset,
    *,
    seq_len: int | None = None,
    max_packed_tokens: int | None = None,
    metric: str = "branching_score",
    max_examples: int | None = None,
    min_score: float | None = None,
    num_proc: int | None = None,
) -> Dataset:
    """Keep the trees that fit both limits and rank them by ``metric`` (highest first, ties by index).

    Args:
        dataset: tree rows; stats are computed with ``num_proc`` workers if missing.
        seq_len, max_packed_tokens: the branch-context and packed-size limits.
        metric: a :func:`tree_stats` column (``branching_score``, ``num_leaves``, ...).
        max_examples: keep at most this many.
        min_score: drop rows whose ``metric`` is below it.
    """
    if "branching_score" not in dataset.column_names:
        dataset = add_tree_stats(dataset, num_proc=num_proc)
    if metric not in dataset.column_names:
        raise InvalidArgumentError(f"unknown selection metric {metric!r}; use one of the tree_stats columns")

    def keep(row) -> bool:
        return (
            (seq_len is None or row["seq_len"] <= seq_len)
            and (max_packed_tokens is None or row["packed_tokens"] <= max_packed_tokens)
            and (min_score is None or row[metric] >= min_score)
        )

    dataset = dataset.filter(keep, num_proc=num_proc, desc="tree limits")
    order = "_tree_order"
    dataset = dataset.add_column(order, list(range(len(dataset))))
    dataset = dataset.sort([metric, order], reverse=[True, False]).remove_columns(order)
    if max_examples is not None:
        dataset = dataset.select(range(min(max_examples, len(dataset))))
    return dataset


def map_trees(fn: Callable[[Tree], Tree], dataset: Dataset, *, num_proc: int | None = None) -> Dataset:
    """Apply a tree → tree function to every row (e.g. a pruning rule)."""
    return dataset.map(lambda row: fn(Tree.from_dict(row)).to_dict(), num_proc=num_proc)
