"""Figures of trajectories and leaderboard records, and the ``compaction-gym plot`` command (docs/plots.md)."""

from compaction_gym.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "kv_timeline": "compaction_gym.plots.episode",
    "event_points": "compaction_gym.plots.episode",
    "mass_series": "compaction_gym.plots.episode",
    "plot_episode": "compaction_gym.plots.episode",
    "plot_mass": "compaction_gym.plots.episode",
    "read_trajectory": "compaction_gym.plots.episode",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
