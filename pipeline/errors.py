"""The errors a request can end with, each carrying its HTTP status and OpenAI error type.

    PipelineError
    ├── InvalidRequest        400 invalid_request_error
    │   └── ContextTooLong    400 invalid_request_error, code context_length_exceeded
    ├── AuthenticationFailed  401 authentication_error
    ├── PermissionDenied      403 permission_error
    ├── NotFound              404 invalid_request_error (model_not_found, ...)
    ├── PayloadTooLarge       413 invalid_request_error
    ├── UpstreamError         502 api_error            (the LLM answered with an error)
    ├── ServiceUnavailable    503 service_unavailable  (the LLM or a store cannot be reached)
    └── DeadlineExceeded      504 timeout              (the request ran past its deadline)

Lower-layer exceptions (httpx, redis) are converted where they occur, with ``raise ... from exc``,
so the app has one handler that renders every one of them in OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any, ClassVar


class PipelineError(Exception):
    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "api_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


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


class UpstreamError(PipelineError):
    status_code = 502
    error_type = "api_error"


class ServiceUnavailable(PipelineError):
    status_code = 503
    error_type = "service_unavailable"


class DeadlineExceeded(PipelineError):
    status_code = 504
    error_type = "timeout"

    def __init__(self, message: str = "The request did not complete before its deadline.") -> None:
        super().__init__(message, code="timeout")
