"""Top-K generalized Jensen–Shannon (GJS) self-distillation: the loss (and, later, the trainer).

Example:
    >>> import torch
    >>> from compaction_gym.trainers.gjs import GJSLossConfig, divergence_mode, topk_gjs
    >>> cfg = GJSLossConfig(k=8, alpha=0.5, support="union")
    >>> s = torch.randn(4, 32).log_softmax(-1)
    >>> t = torch.randn(4, 32).log_softmax(-1)
    >>> topk_gjs(s, t, **cfg.to_dict()).shape, divergence_mode(cfg)
    (torch.Size([4]), 'topk_gjs')
"""

from compaction_gym.trainers.gjs.loss import topk_gjs, topk_gjs_from_lists, topk_gjs_from_teacher_topk
from compaction_gym.trainers.gjs.loss_config import DIVERGENCE_MODES, SUPPORTS, GJSLossConfig, divergence_mode

__all__ = [
    "DIVERGENCE_MODES",
    "SUPPORTS",
    "GJSLossConfig",
    "divergence_mode",
    "topk_gjs",
    "topk_gjs_from_lists",
    "topk_gjs_from_teacher_topk",
]
