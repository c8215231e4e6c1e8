"""Device defaults shared by the trainers' TRL configs."""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def use_cpu_without_accelerator(config: Any) -> None:
    """Set ``config.use_cpu`` when no accelerator (CUDA, XPU, MPS, ...) is available.

    TRL's configs default to ``bf16=True``; ``TrainingArguments`` rejects that on a machine without an
    accelerator unless ``use_cpu`` is set, so a config written as in TRL's docs (and ours) would not
    build on CPU. Run before ``TrainingArguments.__post_init__``. Logged at INFO.
    """
    if config.use_cpu or torch.accelerator.is_available():
        return
    config.use_cpu = True
    logger.info("no accelerator found: use_cpu=True (bf16=%s runs as CPU autocast)", config.bf16)
