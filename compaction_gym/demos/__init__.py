"""Expert-bot demonstrations recorded through compacted sessions (``compaction-gym demos``)."""
