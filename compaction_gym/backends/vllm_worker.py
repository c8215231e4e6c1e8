"""The vLLM worker extension: the embedded engine inside each of vLLM's workers (docs/vllm.md).

vLLM mixes :class:`CompactionWorkerExtension` into its worker class (``worker_extension_cls``);
:class:`~compaction_gym.backends.vllm_backend.VLLMBackend` calls its methods through
``collective_rpc``, so they run in every worker process (every tensor-parallel rank):

* :meth:`~CompactionWorkerExtension.compaction_gym_start` wraps the model vLLM loaded in
  :class:`~compaction_gym.backends.vllm_model.VLLMCausalLM` and builds an
  :class:`~compaction_gym.engine.Engine` on it (generic runner: the engine's attention and slot
  cache, vLLM's modules for everything else);
* :meth:`~CompactionWorkerExtension.compaction_gym_call` runs one engine method.

Arguments and results cross the process boundary as pickled bytes (vLLM's RPC carries bytes as
they are); the engine's typed errors come back as values and are raised again by the backend.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

from compaction_gym.errors import CompactionGymError

logger = logging.getLogger(__name__)

#: Engine methods and attributes the backend may reach (``compaction_gym_call``).
CALLS = frozenset(
    {
        "step_batch",
        "submit",
        "advance",
        "running_session_ids",
        "close",
        "fork",
        "compact",
        "session",
        "session_ids",
        "num_free_slots",
        "read_cache",
    }
)


class CompactionWorkerExtension:
    """Mixed into vLLM's worker; owns one :class:`~compaction_gym.engine.Engine` per worker process."""

    def compaction_gym_start(self, options: bytes) -> bytes:
        """Build the engine (``options``: pickled ``max_slots``, ``capacity``, ``prefill_chunk``,
        ``torch_threads``); return the pickled facts the backend needs (``eos_token_ids``,
        ``capacity``, ``max_slots``, ``vocab_size``, ``layout``, ``tp_rank``), or an error."""
        try:
            return pickle.dumps(("ok", self._compaction_gym_build(**pickle.loads(options))))
        except Exception as exc:  # noqa: BLE001 - sent back and raised in the caller
            return pickle.dumps(("error", exc))

    def compaction_gym_call(self, payload: bytes) -> bytes:
        """Run ``(name, args, kwargs)`` on the engine; return pickled ``("ok", result)`` or ``("error", exc)``."""
        name, args, kwargs = pickle.loads(payload)
        try:
            engine = self.__dict__.get("_compaction_gym_engine")
            if engine is None:
                raise RuntimeError("compaction_gym_start was not called in this worker")
            if name not in CALLS:
                raise ValueError(f"unknown engine call {name!r}")
            target = getattr(engine, name)
            result = target(*args, **kwargs) if callable(target) else target
            return pickle.dumps(("ok", result))
        except Exception as exc:  # noqa: BLE001 - the engine stays usable after its errors (docs/engine.md)
            if not isinstance(exc, CompactionGymError):  # a bug or a device error: keep its traceback here too
                logger.exception("compaction_gym_call %s failed in rank %s", name, getattr(self, "rank", "?"))
            return pickle.dumps(("error", exc))

    def _compaction_gym_build(
        self,
        max_slots: int = 8,
        capacity: int | None = None,
        prefill_chunk: int = 2048,
        torch_threads: int | None = None,
    ) -> dict[str, Any]:
        import torch
        from transformers import AutoTokenizer, GenerationConfig

        from compaction_gym.backends.vllm_model import VLLMCausalLM
        from compaction_gym.engine import Engine

        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        model_config = self.vllm_config.model_config
        parallel = self.vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            from compaction_gym.errors import InvalidArgumentError

            raise InvalidArgumentError("pipeline_parallel_size: the vLLM backend needs 1 (tensor parallelism is fine)")
        path = model_config.model
        try:
            generation = GenerationConfig.from_pretrained(path)
        except (OSError, ValueError):
            generation = None
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer or path)
        except (OSError, ValueError):
            tokenizer = None
        model = VLLMCausalLM(
            self.model_runner.get_model(), model_config.hf_config, generation, tp_size=parallel.tensor_parallel_size
        )
        engine = Engine(model, tokenizer, max_slots=max_slots, capacity=capacity, prefill_chunk=prefill_chunk, fast=False)
        self.__dict__["_compaction_gym_engine"] = engine
        return {
            "eos_token_ids": list(engine.eos_token_ids),
            "capacity": engine.capacity,
            "max_slots": engine.max_slots,
            "vocab_size": model.vocab_size,
            "layout": engine.layout,
            "tp_rank": int(getattr(self, "rank", 0)),
            "dtype": str(engine.dtype),
        }
