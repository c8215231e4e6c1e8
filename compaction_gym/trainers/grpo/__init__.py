"""GRPO on env episodes with exact compaction replay: ``grpo_config`` (:class:`CompactionGRPOConfig`),
``grpo_trainer`` (:class:`CompactionGRPOTrainer`), ``cli`` (``compaction-gym train grpo``).
Import the classes from :mod:`compaction_gym.trainers` (lazily, so the CLI stays light)."""
