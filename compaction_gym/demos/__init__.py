"""``compaction-gym demos``: expert-bot BabyAI demonstrations recorded through compacted sessions.

Each episode is played by minigrid's BabyAI bot, teacher-forced into a persistent
:class:`~compaction_gym.agents.CompactionAgent` session (``run_episodes(..., teacher=...)``, one
batched engine call per turn), so the trajectories carry the session's real token stream and its
compaction events. The assistant text of every turn is the ``reasoning`` prompt format's answer: a
one-line templated reasoning (the current sub-goal and where its object is, read off the
observation), then the action::

    <think>Next: pick up the green key. It is 1 step right and 2 steps forward.</think><action>go forward</action>

With ``noise > 0`` (DART-style) some turns play a random movement instead of the bot's action; the
bot replans from the new state, and those turns are masked out of the SFT targets, so the model
learns to recover from states the bot alone never visits. With ``max_turns`` every episode is cut
after that many turns and kept as a partial demonstration: many cheap examples of the opening
decisions (which visible object the mission means), where a whole episode gives only one.

Outputs in ``--output-dir``: ``trajectories.jsonl`` (every episode, :class:`Trajectory` records),
``trees.jsonl`` (tree rows for ``compaction-gym train sft``: successful episodes, targets on the
non-noise outputs) and ``manifest.json`` (seeds, configs, counts, the trees file's sha256).
Train seeds start at ``--seed`` (one disjoint block per task) and must not fall below
``--eval-seed-limit``: ``compaction-gym eval --seed 0`` episodes use seeds below it.

Example::

    compaction-gym demos --config benchmarks/recipes/babyai_tiny_demos.toml
    compaction-gym demos --model runs/base --episodes-per-task 20 --output-dir runs/demos
"""
