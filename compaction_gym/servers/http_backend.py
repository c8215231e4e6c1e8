"""``HTTPBackend``: the :class:`~compaction_gym.backends.Backend` protocol over our HTTP server.

Agents switch backends by argument only: ``HTTPBackend("http://host:8000")`` returns the same
:class:`~compaction_gym.engine.types.StepResult` objects (events included, losslessly) that
``LocalBackend`` returns in process.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import httpx

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import CreateRequest, StepRequest, StepResult
from compaction_gym.errors import CapacityError, CompactionGymError, InvalidArgumentError
from compaction_gym.servers.errors import ServerError, error_from_response
from compaction_gym.servers.schemas import COMPACTION_FIELDS, SAMPLING_FIELDS, from_response

#: transport errors raised before the request reached the server: always safe to retry
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def config_fields(config: CompactionConfig | None) -> dict[str, Any]:
    """A CompactionConfig as request fields (every field, so the server rebuilds it exactly)."""
    if config is None:
        return {}
    out = {name: getattr(config, name) for name in COMPACTION_FIELDS}
    if out["budget_message_frame"] is not None:
        out["budget_message_frame"] = list(out["budget_message_frame"])  # a JSON array
    return out


def sampling_fields(sampling: SamplingParams | None) -> dict[str, Any]:
    """SamplingParams as request fields (every field, so the server rebuilds it exactly)."""
    if sampling is None:
        return {}
    out = {name: getattr(sampling, name) for name in SAMPLING_FIELDS}
    out["stop_token_ids"] = list(sampling.stop_token_ids)
    return out


class HTTPBackend:
    """Client of ``compaction-gym serve`` implementing the Backend protocol.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"``.
        tokenizer: the model's tokenizer; by default loaded on first use from the model path the
            server reports (works when client and server share a filesystem or hub access).
        timeout: seconds per HTTP request (generation can be long).
        max_retries: retries on 429 (no slot) and on connection errors; ``0`` disables them.
        backoff_s: first retry delay, doubled per retry (with jitter), capped at ``max_backoff_s``;
            a 429's ``Retry-After`` is honoured when longer.
        max_connections: size of the pooled ``httpx.Client``.
        keepalive_expiry: seconds an idle pooled connection is kept for reuse. It must be shorter
            than the server's keep-alive (``--keep-alive-s``, 30 s; uvicorn's own default is 5 s):
            otherwise a request can go out on a connection the server is closing at that moment
            and fail mid-request — which a step, not being idempotent, cannot retry.
        transport: an ``httpx`` transport to use instead of the network (tests, proxies).

    Raises (from every call):
        UnknownSessionError: HTTP 404. CapacityError: HTTP 429 after the retries.
        InvalidArgumentError: other 4xx. ServerError: 5xx, or the server is unreachable.

    Example:
        >>> backend = HTTPBackend("http://127.0.0.1:8000")  # doctest: +SKIP
        >>> r = backend.create_session([1, 2, 3], sampling=SamplingParams(temperature=0))  # doctest: +SKIP
        >>> backend.close(r.session_id)  # doctest: +SKIP
    """

    def __init__(
        self,
        base_url: str,
        *,
        tokenizer: Any = None,
        timeout: float = 600.0,
        max_retries: int = 5,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        max_connections: int = 64,
        keepalive_expiry: float = 2.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if max_retries < 0:
            raise InvalidArgumentError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=keepalive_expiry,
        )
        self._client = httpx.Client(
            base_url=self.base_url, timeout=timeout, limits=limits, transport=transport
        )
        self._tokenizer = tokenizer
        self._info: dict[str, Any] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ server facts
    def health(self) -> dict[str, Any]:
        """``GET /health``: model, slots, capacity, EOS ids, queue depth."""
        return self._request("GET", "/health", idempotent=True)

    @property
    def info(self) -> dict[str, Any]:
        """The first ``/health`` answer, cached (model facts that do not change)."""
        if self._info is None:
            self._info = self.health()
        return self._info

    @property
    def name(self) -> str:
        return str(self.info["model"])

    @property
    def eos_token_ids(self) -> list[int]:
        return [int(t) for t in self.info["eos_token_ids"]]

    @property
    def max_slots(self) -> int:
        return int(self.info["max_slots"])

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (loaded lazily from the server's model name or path if not given)."""
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                from compaction_gym.models.registry import resolve_model

                try:  # a registered name (babyai-tiny, smollm2-135m-instruct) loads its local copy
                    self._tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.name))
                except Exception as exc:  # noqa: BLE001
                    raise InvalidArgumentError(
                        f"could not load the tokenizer of {self.name!r} here ({exc}); "
                        "pass HTTPBackend(..., tokenizer=...)"
                    ) from exc
            return self._tokenizer

    def metrics(self) -> str:
        """``GET /metrics`` as Prometheus text."""
        return self._request("GET", "/metrics", idempotent=True, as_text=True)

    # ------------------------------------------------------------------ session API
    def create_session(
        self,
        prompt_ids: list[int],
        config: CompactionConfig | None = None,
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        score_input: bool = False,
    ) -> StepResult:
        """Prefill ``prompt_ids`` into a new session and generate (``POST /compact_session/create``)."""
        body: dict[str, Any] = {"prompt_ids": [int(t) for t in prompt_ids]}
        body |= config_fields(config) | sampling_fields(sampling)
        if session_id is not None:
            body["session_id"] = session_id
        if score_input:
            body["score_input"] = True
        return from_response(self._request("POST", "/compact_session/create", json=body, retry_429=True))

    def step(
        self,
        session_id: str,
        new_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        response_complete: bool = False,
        score_input: bool = False,
    ) -> StepResult:
        """Feed ``new_ids`` into the session, then generate (``POST /compact_session/step``)."""
        body = {"session_id": session_id, "new_token_ids": [int(t) for t in new_ids]} | sampling_fields(
            sampling
        )
        if response_complete:
            body["response_complete"] = True
        if score_input:
            body["score_input"] = True
        return from_response(self._request("POST", "/compact_session/step", json=body))

    def step_batch(self, requests: list[StepRequest | CreateRequest]) -> list[StepResult]:
        """Step (and open) many sessions in one HTTP request; the server runs them as one engine batch.

        Raises:
            ServerError: the first failed request's typed error (a subclass), with ``.results``
                holding every outcome (a StepResult, or the exception of that request; the
                successful steps were applied).
        """
        if not requests:
            return []
        items = [_batch_item(r) for r in requests]
        data = self._request("POST", "/compact_session/step_batch", json={"requests": items})
        outcomes: list[Any] = []
        for item in data["results"]:
            if "error" in item and "all_token_ids" not in item:
                outcomes.append(error_from_response(int(item["error"].get("code", 500)), item, "step failed"))
            else:
                outcomes.append(from_response(item))
        failures = [o for o in outcomes if isinstance(o, Exception)]
        if failures:
            failures[0].results = outcomes  # type: ignore[attr-defined]
            raise failures[0]
        return outcomes

    def close(self, session_id: str) -> None:
        """Close the session and free its slot (``DELETE /compact_session/{id}``)."""
        self._request("DELETE", f"/compact_session/{session_id}", idempotent=True)

    def compact_generate(
        self,
        prompt_ids: list[int],
        config: CompactionConfig | None = None,
        sampling: SamplingParams | None = None,
    ) -> StepResult:
        """One-shot generation with compaction (``POST /compact_generate``); no session is kept."""
        body = (
            {"prompt_ids": [int(t) for t in prompt_ids]} | config_fields(config) | sampling_fields(sampling)
        )
        return from_response(self._request("POST", "/compact_generate", json=body, retry_429=True))

    def inject_generate(
        self, prompt_ids: list[int], config: CompactionConfig, sampling: SamplingParams | None = None
    ) -> StepResult:
        """One prompt, no compaction, the budget message every ``config.inject_budget_every``
        sampled tokens (``POST /inject_generate``); no session is kept.

        Raises:
            InvalidArgumentError: ``config.inject_budget_every`` or ``config.max_total_tokens`` unset,
                or ``config.mode`` not ``none``.
        """
        if config.inject_budget_every is None or config.max_total_tokens is None or config.enabled:
            raise InvalidArgumentError(
                "inject_generate needs mode='none' with inject_budget_every and max_total_tokens set"
            )
        body: dict[str, Any] = {
            "prompt_ids": [int(t) for t in prompt_ids],
            "max_total_tokens": config.max_total_tokens,
            "inject_budget_every": config.inject_budget_every,
            "budget_message_template": config.budget_message_template,
        }
        if config.budget_message_frame is not None:
            body["budget_message_frame"] = list(config.budget_message_frame)
        body |= sampling_fields(sampling)
        return from_response(self._request("POST", "/inject_generate", json=body, retry_429=True))

    # ------------------------------------------------------------------ plumbing
    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        idempotent: bool = False,
        retry_429: bool = False,
        as_text: bool = False,
    ) -> Any:
        """Send with retries: 429 (``retry_429``: the server did nothing) and connection errors.

        A request that may have reached the server is retried only when ``idempotent``: retrying
        a step could apply it twice.
        """
        attempt = 0
        while True:
            try:
                resp = self._client.request(method, path, json=json)
            except _NOT_SENT as exc:
                if attempt >= self.max_retries:
                    raise ServerError(f"cannot reach {self.base_url}{path}: {exc!r}") from exc
            except httpx.TransportError as exc:
                if not idempotent or attempt >= self.max_retries:
                    raise ServerError(
                        f"{method} {self.base_url}{path} failed mid-request ({exc!r}); it may or may not "
                        "have been applied"
                    ) from exc
            else:
                if resp.status_code == 429 and (retry_429 or idempotent) and attempt < self.max_retries:
                    time.sleep(max(self._delay(attempt), _retry_after(resp)))
                    attempt += 1
                    continue
                if resp.status_code >= 400:
                    raise _typed_error(resp)
                return resp.text if as_text else resp.json()
            time.sleep(self._delay(attempt))
            attempt += 1

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)

    def shutdown(self) -> None:
        """Close the pooled HTTP connections (sessions on the server stay open)."""
        self._client.close()

    def __enter__(self) -> HTTPBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"HTTPBackend({self.base_url!r})"


def _retry_after(resp: httpx.Response) -> float:
    try:
        return float(resp.headers.get("retry-after", 0))
    except ValueError:
        return 0.0


def _typed_error(resp: httpx.Response) -> CompactionGymError:
    try:
        body = resp.json()
    except ValueError:
        body = None
    err = error_from_response(resp.status_code, body, resp.text[:500] or resp.reason_phrase)
    assert isinstance(err, CompactionGymError)
    if isinstance(err, CapacityError):
        err.retry_after = _retry_after(resp)  # type: ignore[attr-defined]
    return err


def _batch_item(req: StepRequest | CreateRequest) -> dict[str, Any]:
    """One item of a ``/compact_session/step_batch`` body (a create when it has ``prompt_ids``)."""
    if isinstance(req, CreateRequest):
        item: dict[str, Any] = {"prompt_ids": [int(t) for t in req.prompt_ids]}
        item |= config_fields(req.config) | sampling_fields(req.sampling)
        if req.session_id is not None:
            item["session_id"] = req.session_id
    else:
        item = {"session_id": req.session_id, "new_token_ids": [int(t) for t in req.new_ids]}
        item |= sampling_fields(req.sampling)
        if req.response_complete:
            item["response_complete"] = True
    if req.score_input:
        item["score_input"] = True
    return item
