"""Models shipped inside the package, usable offline by name.

``babyai-tiny`` is a 4,880,384-parameter (4.9 M) Qwen3 agent trained by this project's own pipeline (expert-bot
demonstrations through :class:`~compaction_gym.wrappers.LLMAgentWrapper`, then tree SFT); its model
card is ``compaction_gym/models/babyai-tiny/README.md``. Each bundled model is a ``save_pretrained``
directory (``config.json``, ``model.safetensors``, tokenizer files) plus ``compaction_gym.json``
(the prompt format it was trained for).

Example:
    >>> from compaction_gym import models
    >>> models.path("babyai-tiny")  # doctest: +SKIP
    PosixPath('.../compaction_gym/models/babyai-tiny')
    >>> model, tokenizer = models.load("babyai-tiny")  # doctest: +SKIP

The names also resolve on the command line (``compaction-gym eval --model babyai-tiny``) through
:func:`compaction_gym.models.registry.resolve_model`. This module imports nothing heavy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compaction_gym.errors import InvalidArgumentError

#: Names of the models shipped in this package (one directory each, beside this file).
BUNDLED_MODELS: tuple[str, ...] = ("babyai-tiny",)
#: Per-model metadata file written next to the weights (prompt format, training provenance).
METADATA_FILE = "compaction_gym.json"


def path(name: str) -> Path:
    """The directory of bundled model ``name`` (loadable with ``from_pretrained``).

    Raises:
        InvalidArgumentError: ``name`` is not a bundled model, or its files are missing from this
            install (e.g. a source checkout before the weights were trained).
    """
    if name not in BUNDLED_MODELS:
        raise InvalidArgumentError(f"unknown bundled model {name!r}; bundled models: {list(BUNDLED_MODELS)}")
    directory = Path(__file__).resolve().parent / name
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise InvalidArgumentError(
            f"bundled model {name!r} has no weights at {directory}; reinstall compaction-gym or rebuild them "
            "with benchmarks/recipes/README.md"
        )
    return directory


def metadata(name: str) -> dict[str, Any]:
    """The bundled model's ``compaction_gym.json`` (``prompt``, ``recipe``, ...); ``{}`` if absent."""
    file = path(name) / METADATA_FILE
    return json.loads(file.read_text()) if file.is_file() else {}


def load(name: str, *, dtype: Any = None, device: Any = None) -> tuple[Any, Any]:
    """Load bundled model ``name`` as ``(model, tokenizer)`` (``transformers`` objects, eval mode).

    Args:
        name: a name in :data:`BUNDLED_MODELS`.
        dtype: torch dtype for the weights (default: float32, as saved).
        device: where to put the model (default: CPU).

    Returns:
        ``(Qwen3ForCausalLM, PreTrainedTokenizerFast)``. For the directory itself (e.g. to build an
        :class:`~compaction_gym.engine.Engine`), use :func:`path`.
    """
    import torch

    from compaction_gym.models.registry import load_model

    return load_model(path(name), dtype=dtype or torch.float32, device=device)


__all__ = ["BUNDLED_MODELS", "METADATA_FILE", "load", "metadata", "path"]
