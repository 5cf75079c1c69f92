"""ApiError: an OpenAI-style error response, and the mapping from gRPC statuses."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "request_cancelled",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.NOT_FOUND: 503,  # an instance the broker routed to went away
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


def from_grpc(error: grpc.aio.AioRpcError, what: str) -> ApiError:
    status = _STATUS.get(error.code(), 500)
    details = error.details() or error.code().name
    code = "context_length_exceeded" if "context length" in details else None
    if status >= 500:
        details = f"{what}: {details}"
    return ApiError(status, details, code=code)
