"""Shared pieces of the GPU benchmarks: real model shapes, random models, bandwidth, tables.

The shapes are the public ``config.json`` values of Qwen/Qwen3-0.6B, -1.7B and -4B, of
meta-llama/Llama-3.2-1B (the model of the "No Bubbles" megakernel, the field's batch-1 anchor:
docs/fast-path.md) and of HuggingFaceTB/SmolLM2-135M-Instruct (the pretrained model this project
runs offline: docs/models.md); all of them tie the input embedding and the LM head. Weights are random: speed
does not depend on them.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: Public config.json values (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tying).
QWEN3_SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
    "qwen3-4b": dict(
        hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
}  # fmt: skip

#: Public config.json values of Llama-family shapes (built as ``LlamaForCausalLM``).
LLAMA_SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_theta=500_000.0, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "smollm2-135m": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
        rope_theta=100_000.0, rms_norm_eps=1e-5,
    ),
}  # fmt: skip

#: The shapes the benchmarks run unless told otherwise.
DEFAULT_SHAPES = ("qwen3-0.6b", "qwen3-4b")


def shape_names() -> list[str]:
    """Every shape :func:`random_model` builds."""
    return [*QWEN3_SHAPES, *LLAMA_SHAPES]


def shape_config(name: str) -> dict:
    """Shape ``name``'s config values (:data:`QWEN3_SHAPES` or :data:`LLAMA_SHAPES`)."""
    return LLAMA_SHAPES[name] if name in LLAMA_SHAPES else QWEN3_SHAPES[name]


def random_model(
    name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides: object
):
    """A random-weight model of shape ``name`` (``Qwen3ForCausalLM``, or ``LlamaForCausalLM`` for a
    :data:`LLAMA_SHAPES` name), built on ``device``; ``overrides`` replace config values (a CPU
    run's narrow widths)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from compaction_gym.engine.attention import register_attention

    llama = name in LLAMA_SHAPES
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if llama else (Qwen3Config, Qwen3ForCausalLM)
    config = config_cls(**{**shape_config(name), **overrides}, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=dtype)
    register_attention()
    return model.eval()


def save_random_model(
    name: str, path: str | Path, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Path:
    """Write a :func:`random_model` of shape ``name`` and a small tokenizer to ``path``; return ``path``.

    The folder loads like a downloaded checkpoint (``compaction-gym serve --model PATH``,
    ``Engine.from_pretrained(PATH)``) in ``dtype`` (the checkpoint's dtype: ``--dtype auto``). The
    tokenizer is the tiny models' byte-level BPE (:func:`compaction_gym.models.tiny.make_tokenizer`,
    1,024 ids of the model's 151,936): the benchmarks send token ids, and a response's text is decoded
    by it as a real server decodes it. A folder already holding this shape's config is reused.
    """
    from transformers import AutoConfig

    from compaction_gym.models.tiny import make_tokenizer

    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        config = AutoConfig.from_pretrained(path)
        shape = {k: v for k, v in shape_config(name).items() if isinstance(v, int)}
        if all(getattr(config, k, None) == v for k, v in shape.items()):
            return path
    path.mkdir(parents=True, exist_ok=True)
    model = random_model(name, device=device, dtype=dtype, seed=seed)
    model.save_pretrained(str(path))
    del model
    make_tokenizer(path)
    return path


def cuda_extension(source: str):
    """``benchmarks/<source>`` (a CUDA C++ torch extension) built for this device on first use, or None
    without a CUDA compiler (``CUDA_HOME``)."""
    from torch.utils.cpp_extension import CUDA_HOME, load

    if CUDA_HOME is None:
        return None
    path = Path(__file__).with_name(source)
    csrc = Path(__file__).parents[1] / "compaction_gym" / "engine" / "fast" / "csrc"  # bulk_stream.cuh
    return load(name=path.stem, sources=[str(path)], extra_cuda_cflags=["-O3"], extra_include_paths=[str(csrc)])


def copy_bandwidth(device: str = "cuda", nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = [cuda_time(lambda: dst.copy_(src)) for _ in range(3 + repeats)]
    return 2 * nbytes / statistics.median(times[3:])


def cuda_time(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes on the device (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def wall_time(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn``, the device synchronised before and after."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def device_line() -> str:
    """Device, software versions and date, for the header of a results table."""
    import transformers

    try:
        import triton

        tv = triton.__version__
    except ImportError:  # pragma: no cover
        tv = "none"
    name = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else (platform.processor() or platform.machine())
    )
    return (
        f"{name}, torch {torch.__version__}, transformers {transformers.__version__}, triton {tv}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    )


def print_table(headers: list[str], rows: list[list[object]], title: str = "") -> str:
    """Print (and return) a markdown table."""
    lines = [title] if title else []
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    for r in rows:
        lines.append("| " + " | ".join(_fmt(x) for x in r) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _fmt(x: object) -> str:
    if isinstance(x, float):
        return f"{x:,.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return str(x)
