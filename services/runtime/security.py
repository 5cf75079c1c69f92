"""The control plane's security: a cluster token on every internal RPC, and
optional TLS (mutual when a CA is given) on every gRPC server and client.

    EPD_CLUSTER_TOKEN   sent by every client as `authorization: Bearer TOKEN`,
                        checked by every server; grpc.health.v1 and reflection
                        stay open (health checks, grpcurl's `list`)
    EPD_TLS_CERT/KEY    this process's PEM certificate chain and key: servers
                        serve TLS, clients present them
    EPD_TLS_CA          PEM roots that clients verify servers with; a server
                        given one requires (and verifies) client certificates

Every process reads them once from its environment (`epd` commands set them
from their flags; `epd serve` generates a token per stack). With no token,
the servers take any caller, and say so at start-up.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.runtime import env

METADATA_KEY = "authorization"
# Open without the token: health checks and grpcurl's service listing.
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True, slots=True)
class Security:
    token: str = ""
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS needs both a certificate and its key")

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, f"Bearer {self.token}"),) if self.token else ()

    def authenticated(self, metadata: Any) -> bool:
        """Whether call metadata carries this cluster's token (always, with none set)."""
        if not self.token:
            return True
        expected = f"Bearer {self.token}".encode()
        given = [v for k, v in (metadata or ()) if k == METADATA_KEY]
        return any(hmac.compare_digest(str(v).encode(), expected) for v in given)

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.cert is not None and self.key is not None
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca,
            require_client_auth=self.ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenCheck(self)] if self.token else []

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        if not self.token:
            return []
        kinds = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)
        return [kind(self.metadata) for kind in kinds]


@functools.cache
def _cached(token: str, cert: str, key: str, ca: str) -> Security:
    return Security(
        token,
        Path(cert).read_bytes() if cert else None,
        Path(key).read_bytes() if key else None,
        Path(ca).read_bytes() if ca else None,
    )


def current() -> Security:
    """This process's security, from its environment."""
    return _cached(env.CLUSTER_TOKEN.get(), env.TLS_CERT.get(), env.TLS_KEY.get(), env.TLS_CA.get())


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the cluster token, except the
    open methods."""

    def __init__(self, security: Security) -> None:
        self.security = security

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if (
            handler is None
            or details.method.startswith(OPEN_METHODS)
            or self.security.authenticated(details.invocation_metadata)
        ):
            return handler
        return _refusing(handler, details.method)


def _refusing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{method} needs the cluster token (metadata 'authorization: Bearer ...')",
        )

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _with_token(
    details: grpc.aio.ClientCallDetails, metadata: tuple[tuple[str, str], ...]
) -> grpc.aio.ClientCallDetails:
    merged = grpc.aio.Metadata(*(details.metadata or ()), *metadata)
    return details._replace(metadata=merged)  # type: ignore[attr-defined]


class _TokenSender:
    """Adds the cluster token to every call of a channel. grpc.aio files each
    interceptor under the first call kind it implements, hence one class per kind."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata


class _UnaryUnaryToken(_TokenSender, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.metadata), request)


class _UnaryStreamToken(_TokenSender, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.metadata), request)


class _StreamUnaryToken(_TokenSender, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_token(details, self.metadata), requests)


class _StreamStreamToken(_TokenSender, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_token(details, self.metadata), requests)


def aio_channel(
    address: str,
    options: list[tuple[str, Any]],
    security: Security | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    security = security or current()
    interceptors = [*security.client_interceptors(), *interceptors]
    if security.tls or security.ca is not None:
        return grpc.aio.secure_channel(
            address, security.channel_credentials(), options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def sync_channel(address: str, security: Security | None = None) -> grpc.Channel:
    """A blocking channel with this process's TLS, for the open methods (health
    checks); a caller of any other passes `metadata=security.metadata`."""
    security = security or current()
    if security.tls or security.ca is not None:
        return grpc.secure_channel(address, security.channel_credentials())
    return grpc.insecure_channel(address)
