"""``ServerArgs``: every knob of the HTTP server, the TRL way (a dataclass whose fields carry help)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from compaction_gym.errors import InvalidArgumentError

DTYPES = ("auto", "float32", "float16", "bfloat16")
BACKENDS = ("local", "vllm")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass
class ServerArgs:
    """Arguments of ``compaction-gym serve`` and :func:`compaction_gym.servers.create_app`.

    Fields are grouped by concern: model loading (used by the CLI only; ``create_app`` takes a
    ready engine), networking, batching, session lifetime and request limits.
    """

    # --- model (CLI only) ---
    backend: str = field(
        default="local",
        metadata={
            "help": "what runs the sessions: the embedded engine (local) or vLLM's workers (vllm, docs/vllm.md)",
            "choices": BACKENDS,
        },
    )
    model: str | None = field(
        default=None,
        metadata={"help": "registered model name (babyai-tiny, tiny-random), local path or hub id"},
    )
    dtype: str = field(default="auto", metadata={"help": "weights dtype", "choices": DTYPES})
    device: str | None = field(default=None, metadata={"help": "torch device (default: cuda if available)"})
    max_slots: int = field(default=8, metadata={"help": "concurrent sessions (KV slots) the engine holds"})
    capacity: int | None = field(
        default=None, metadata={"help": "KV rows per slot (default: the engine's choice)"}
    )
    torch_threads: int | None = field(
        default=None, metadata={"help": "torch intra-op threads (default: torch's; 1 helps on a busy CPU)"}
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model id reported by /v1/models (default: the model path)"}
    )
    # --- network ---
    host: str = field(default="127.0.0.1", metadata={"help": "interface to bind"})
    port: int = field(default=8000, metadata={"help": "TCP port to bind"})
    log_level: str = field(default="info", metadata={"help": "uvicorn log level", "choices": LOG_LEVELS})
    keep_alive_s: float = field(
        default=30.0,
        metadata={
            "help": "idle HTTP connections stay open this long (clients must reuse them for less: "
            "HTTPBackend drops them after 2 s)"
        },
    )
    # --- batching ---
    batch_window_ms: float = field(
        default=5.0,
        metadata={
            "help": "a batch keeps collecting create/step requests while they arrive at most this far apart"
        },
    )
    max_batch_wait_ms: float | None = field(
        default=None,
        metadata={"help": "longest a batch waits after its first request (default: 10 x window)"},
    )
    max_batch_size: int | None = field(
        default=None, metadata={"help": "most requests in one step_batch (default: max_slots)"}
    )
    continuous_batching: bool = field(
        default=True,
        metadata={
            "help": "admit new requests into the running batch at every decode round (--no-continuous-batching: "
            "a batch runs to completion before the next starts)"
        },
    )
    fast_routes: bool = field(
        default=True,
        metadata={
            "help": "serve valid requests to the session routes without FastAPI's per-request layers (same "
            "responses, less CPU per request on the thread the engine worker shares; --no-fast-routes: "
            "FastAPI serves every request)"
        },
    )
    round_steps: int | None = field(
        default=None,
        metadata={
            "help": "decode steps per request per round: new requests join at most this many tokens later "
            "(default: the engine's decode chunk, 32)"
        },
    )
    # --- sessions ---
    session_ttl_s: float | None = field(
        default=600.0, metadata={"help": "close sessions idle this long, freeing their slots (0: never)"}
    )
    retry_after_s: int = field(default=1, metadata={"help": "Retry-After seconds sent with 429 responses"})
    # --- request limits ---
    max_request_bytes: int = field(
        default=64 * 1024 * 1024, metadata={"help": "bodies larger than this get 413"}
    )
    max_new_tokens_limit: int | None = field(
        default=32768,
        metadata={
            "help": "requests asking for more sampled tokens (max_new_tokens, max_tokens) get 422 (0: no limit)"
        },
    )
    max_prompt_tokens: int | None = field(
        default=None,
        metadata={
            "help": "prompts and step inputs longer than this get 422 (default: the KV capacity of a slot)"
        },
    )
    max_queue_s: float | None = field(
        default=None,
        metadata={
            "help": "a request not admitted into the running batch this long after it arrived gets 429 "
            "(nothing ran; default: it waits)"
        },
    )

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.log_level not in LOG_LEVELS:
            raise InvalidArgumentError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.max_slots <= 0:
            raise InvalidArgumentError(f"max_slots must be positive, got {self.max_slots}")
        if self.torch_threads is not None and self.torch_threads <= 0:
            raise InvalidArgumentError(f"torch_threads must be positive, got {self.torch_threads}")
        if self.capacity is not None and self.capacity <= 0:
            raise InvalidArgumentError(f"capacity must be positive, got {self.capacity}")
        if self.keep_alive_s <= 0:
            raise InvalidArgumentError(f"keep_alive_s must be positive, got {self.keep_alive_s}")
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"port must be in [0, 65535], got {self.port}")
        if self.batch_window_ms < 0:
            raise InvalidArgumentError(f"batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.max_batch_wait_ms is not None and self.max_batch_wait_ms < 0:
            raise InvalidArgumentError(f"max_batch_wait_ms must be >= 0, got {self.max_batch_wait_ms}")
        if self.max_batch_size is not None and self.max_batch_size <= 0:
            raise InvalidArgumentError(f"max_batch_size must be positive, got {self.max_batch_size}")
        if self.session_ttl_s is not None and self.session_ttl_s < 0:
            raise InvalidArgumentError(
                f"session_ttl_s must be >= 0 (0 disables it), got {self.session_ttl_s}"
            )
        if self.session_ttl_s == 0:
            self.session_ttl_s = None
        if self.retry_after_s < 0:
            raise InvalidArgumentError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        for name in ("round_steps", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidArgumentError(f"{name} must be positive, got {value}")
        if self.max_new_tokens_limit is not None and self.max_new_tokens_limit < 0:
            raise InvalidArgumentError(
                f"max_new_tokens_limit must be >= 0 (0: no limit), got {self.max_new_tokens_limit}"
            )
        if self.max_new_tokens_limit == 0:
            self.max_new_tokens_limit = None
        if self.max_queue_s is not None and self.max_queue_s <= 0:
            raise InvalidArgumentError(f"max_queue_s must be positive, got {self.max_queue_s}")
        if self.max_request_bytes <= 0:
            raise InvalidArgumentError(f"max_request_bytes must be positive, got {self.max_request_bytes}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerArgs:
        """Build from a mapping (e.g. a TOML file), rejecting unknown keys by name."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise InvalidArgumentError(
                f"unknown ServerArgs field(s): {sorted(unknown)}; valid: {sorted(names)}"
            )
        return cls(**data)
