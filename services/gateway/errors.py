"""ApiError: an OpenAI-style error response, and the mapping from gRPC statuses."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "request_cancelled",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}


# Overload and a component that is down or restarting: worth retrying soon.
RETRY_AFTER_S = {429: 1, 503: 2}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        aborted_downstream: bool = False,
        component: str = "gateway",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # The component that failed was told to give up by another one, whose own
        # error says why (an encode aborted by the language side).
        self.aborted_downstream = aborted_downstream
        self.component = component  # what raised it, for the request log

    @property
    def headers(self) -> dict[str, str]:
        retry = RETRY_AFTER_S.get(self.status)
        return {"Retry-After": str(retry)} if retry else {}

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
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.NOT_FOUND: 503,  # an instance the broker routed to went away
    grpc.StatusCode.ABORTED: 503,  # gave up because another component did
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


def from_grpc(error: grpc.aio.AioRpcError, what: str) -> ApiError:
    status = _STATUS.get(error.code(), 500)
    details = error.details() or error.code().name
    code = "context_length_exceeded" if "context length" in details else None
    if status >= 429:
        details = f"{what}: {details}"
    aborted = error.code() == grpc.StatusCode.ABORTED
    return ApiError(status, details, code=code, aborted_downstream=aborted, component=what)
