"""The errors a request can end with, each carrying its HTTP status and OpenAI error type.

    PipelineError
    ├── InvalidRequest        400 invalid_request_error
    │   └── ContextTooLong    400 invalid_request_error, code context_length_exceeded
    ├── AuthenticationFailed  401 authentication_error
    ├── PermissionDenied      403 permission_error
    ├── NotFound              404 invalid_request_error (model_not_found, ...)
    ├── PayloadTooLarge       413 invalid_request_error
    ├── ClientClosedRequest   499 invalid_request_error, code client_closed_request (client gone)
    ├── UpstreamError         502 api_error            (the LLM answered with an error)
    ├── ServiceUnavailable    503 service_unavailable  (the LLM cannot be reached)
    │   ├── StoreUnavailable  503 service_unavailable, code store_unavailable (Redis)
    │   ├── UpstreamBusy      503 service_unavailable, code upstream_busy (no route slot in time)
    │   ├── ConverterBusy     503 service_unavailable, code converter_busy (too many uploads)
    │   └── StorageFull       507 service_unavailable, code index_storage_full (disk full)
    └── DeadlineExceeded      504 timeout              (the request ran past its deadline)

Lower-layer exceptions are converted where they occur, each in one table, with ``raise ... from
exc``: httpx's in ``pipeline.model.client``, redis-py's in ``pipeline.store.kv``. An error may
carry response headers (``Retry-After``); ``error_body`` is the one function that writes the
body, so every error leaves in OpenAI's shape, whichever part of the app renders it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def retry_after(seconds: float) -> dict[str, str]:
    """The ``Retry-After`` header for a wait of ``seconds`` (whole seconds, at least one)."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


class Described(Exception):
    """A failure that its type and message describe in full (an error a request ends with, a
    stage's spent budget): a span records it without formatting its stack (half a millisecond
    or more, paid most when the process is busiest: a wave of refusals, stages degrading under
    load). Anything else is a fault in the code, recorded with its stack."""


class PipelineError(Described):
    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "api_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, param=self.param, code=self.code)


class InvalidRequest(PipelineError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextTooLong(InvalidRequest):
    def __init__(self, message: str, *, param: str | None = "max_tokens") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class AuthenticationFailed(PipelineError):
    status_code = 401
    error_type = "authentication_error"

    def __init__(self, message: str = "Invalid or missing API key.") -> None:
        super().__init__(message, code="invalid_api_key")


class PermissionDenied(PipelineError):
    status_code = 403
    error_type = "permission_error"


class NotFound(PipelineError):
    status_code = 404
    error_type = "invalid_request_error"


class PayloadTooLarge(PipelineError):
    status_code = 413
    error_type = "invalid_request_error"


class ClientClosedRequest(PipelineError):
    """The client closed its connection before the answer was ready, and the request was
    stopped there (``app.http.disconnect``). The status is nginx's 499; the response goes
    nowhere, it is what the request log and metrics record."""

    status_code = 499
    error_type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__(
            "The client closed the connection before the answer was ready.",
            code="client_closed_request",
        )


class UpstreamError(PipelineError):
    status_code = 502
    error_type = "api_error"


class ServiceUnavailable(PipelineError):
    status_code = 503
    error_type = "service_unavailable"


class StorageFull(ServiceUnavailable):
    """The index directory has no room for a write's new snapshot: nothing was published."""

    status_code = 507


class StoreUnavailable(ServiceUnavailable):
    """Redis did not answer (down, refused, timed out) or refused a command; converted in
    ``pipeline.store.kv``, with the wait before its circuit breaker tries again."""

    what: ClassVar[str] = "The data store cannot be reached right now"
    reason: ClassVar[str] = "store_unavailable"

    def __init__(self, detail: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(
            f"{self.what} ({detail}); retry later.",
            code=self.reason,
            headers=retry_after(retry_after_s),
        )
        self.detail = detail
        self.retry_after_s = retry_after_s


class StoreBusy(StoreUnavailable):
    """Every connection of this process's Redis pool stayed busy past the pool's wait: this
    process is overloaded, Redis is not down (the circuit stays closed). A stage that would
    otherwise fail open into much more work (a cache lookup into a whole generation) sheds the
    request with this 503 instead."""

    what = "The service is overloaded right now"
    reason = "overloaded"


class UpstreamBusy(ServiceUnavailable):
    """No concurrency slot of the route came free for this tenant before the request's
    deadline (``pipeline.model.slots``), with the mean time a slot is held as the wait."""

    def __init__(self, route: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(
            f"The model route '{route}' is busy: no slot came free before the request's deadline; "
            "retry later.",
            code="upstream_busy",
            headers=retry_after(retry_after_s),
        )
        self.route = route


class ConverterBusy(ServiceUnavailable):
    """As many uploads as the file converter admits are in progress (``POST /v1/files``), with
    the mean time an upload takes as the wait."""

    def __init__(self, *, retry_after_s: float = 1.0) -> None:
        super().__init__(
            "The file converter is busy with other uploads; retry later.",
            code="converter_busy",
            headers=retry_after(retry_after_s),
        )


class DeadlineExceeded(PipelineError):
    status_code = 504
    error_type = "timeout"

    def __init__(self, message: str = "The request did not complete before its deadline.") -> None:
        super().__init__(message, code="timeout")
