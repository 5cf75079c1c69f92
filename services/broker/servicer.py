"""The Broker gRPC servicer: protobuf in and out, the Broker does the work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

from services.broker.broker import Broker
from services.broker.registry import DuplicateInstanceError, NoRouteError, RouteChoice, Session
from services.broker.rendezvous import FailoverError
from services.proto import broker_pb2, broker_pb2_grpc, common_pb2
from services.runtime import tracing
from services.wire.convert import from_proto, to_proto, unwrap, wrap
from services.wire.messages import Register, Role, RouteReply, RouteRequest

logger = logging.getLogger(__name__)


# A Route the broker itself refused carries this: the gateway retries a Route that
# did not reach the broker (restarting), never one the broker answered.
ANSWERED = (("epd-route", "answered"),)
ROUTE_POLL_S = 0.05


class BrokerServicer(broker_pb2_grpc.BrokerServicer):
    def __init__(
        self, broker: Broker, show_endpoints: bool = True, route_wait_s: float = 3.0
    ) -> None:
        self.broker = broker
        self.route_wait_s = route_wait_s
        # Shared-memory names and NIXL metadata only for authenticated callers
        # (with no cluster token, no caller is).
        self.show_endpoints = show_endpoints

    async def Attach(
        self,
        request_iterator: AsyncIterator[broker_pb2.PeerMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[broker_pb2.BrokerMessage]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "register":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message must be Register"
            )
        try:
            registration = from_proto(Register, first.register)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            session = self.broker.join(registration)
        except DuplicateInstanceError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        reader = asyncio.create_task(self._read(session, request_iterator))
        try:
            while (message := await session.outbox.get()) is not None:
                yield wrap(broker_pb2.BrokerMessage, message)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self.broker.leave(session, "stream closed")

    async def _read(
        self, session: Session, request_iterator: AsyncIterator[broker_pb2.PeerMessage]
    ) -> None:
        try:
            async for pb in request_iterator:
                try:
                    self.broker.handle(session, unwrap(pb))
                except ValueError as exc:
                    logger.warning("%s sent a bad message: %s", session.instance_id, exc)
        except grpc.aio.AioRpcError:
            pass
        finally:
            session.outbox.put_nowait(None)

    async def Route(
        self, request: broker_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.RouteReply:
        metadata = context.invocation_metadata()
        with tracing.serving("broker.route", metadata, request.request_id) as span:
            reply = await self._route(request, context)
            span.set_attributes(
                {
                    "epd.language": reply.language_id,
                    "epd.encoder": reply.encoder_id,
                    "epd.prefix_depth": reply.prefix_depth,
                    "epd.peer_items": sum(bool(h) for h in reply.holder_ids),
                    "epd.prefix_holder": reply.prefix_holder_id,
                }
            )
            return reply

    async def _route(
        self, pb: broker_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.RouteReply:
        request = from_proto(RouteRequest, pb)
        try:
            choice = await self._when_routable(request)
        except NoRouteError as exc:
            self.broker.metrics.routes.labels("unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), ANSWERED)
        except FailoverError as exc:
            self.broker.metrics.routes.labels("failover_refused").inc()
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        self.broker.metrics.routes.labels("ok").inc()
        language = choice.language
        reply = RouteReply(
            language.instance_id,
            language.registration.grpc_address,
            prefix_depth=choice.prefix_depth,
        )
        if (holder := choice.prefix_holder) is not None:
            reply = replace(
                reply,
                prefix_holder_id=holder.instance_id,
                prefix_holder_address=holder.registration.grpc_address,
                prefix_holder_depth=choice.prefix_holder_depth,
            )
        if choice.encoder is not None and choice.transport is not None:
            encoder = choice.encoder
            reply = replace(
                reply,
                encoder_id=encoder.instance_id,
                encoder_address=encoder.registration.grpc_address,
                transport=choice.transport,
                holder_ids=tuple(h.instance_id if h else "" for h in choice.holders),
                holder_addresses=tuple(
                    h.registration.grpc_address if h else "" for h in choice.holders
                ),
            )
        if choice.decode is not None:
            decode = choice.decode
            reply = replace(
                reply, decode_id=decode.instance_id, decode_address=decode.registration.grpc_address
            )
        return to_proto(reply)

    async def _when_routable(self, request: RouteRequest) -> RouteChoice:
        """The route, once the instances it needs are attached: after a broker
        restart (or an instance's) they attach again within a second or two, and a
        request in that moment waits for them, at most route_wait_s; NoRouteError
        after that."""
        deadline = time.monotonic() + self.route_wait_s
        while True:
            try:
                return self.broker.route(
                    request.request_id,
                    request.model,
                    request.needs_encoder,
                    request.language_id,
                    request.failed_encoder_id,
                    request.failed_language_id,
                    request.media_hashes,
                    request.prefix_hashes,
                )
            except NoRouteError:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(ROUTE_POLL_S)

    async def ListInstances(
        self, request: broker_pb2.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.ListInstancesReply:
        role = Role(request.role) if request.role != common_pb2.ROLE_UNSPECIFIED else None
        now = time.monotonic()
        reply = broker_pb2.ListInstancesReply(
            instances=[to_proto(s.info(now)) for s in self.broker.registry.sessions(role)],
            routed_with_media=self.broker.routed_with_media,
            routed_text=self.broker.routed_text,
        )
        if not self.show_endpoints:
            for instance in reply.instances:
                for endpoint in ("shm", "nixl", "cuda_ipc", "grpc"):
                    instance.registration.pool.ClearField(endpoint)
        return reply

    async def DescribeRequest(
        self, request: broker_pb2.DescribeRequestRequest, context: grpc.aio.ServicerContext
    ) -> broker_pb2.RequestDescription:
        pairing = self.broker.rendezvous.describe(request.request_id)
        if pairing is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"request {request.request_id!r} is not known to the broker",
            )
        return broker_pb2.RequestDescription(
            request_id=pairing.request_id,
            phase=broker_pb2.RequestDescription.Phase.Name(pairing.phase),
            encoder_id=pairing.encoder_id,
            language_id=pairing.language_id,
            has_meta=pairing.meta is not None,
            has_prealloc=pairing.prealloc is not None,
            sent_tokens=pairing.sent_tokens,
            total_tokens=pairing.total_tokens,
            num_resumes=pairing.num_resumes,
            num_failovers=pairing.num_failovers,
            abort_reason=pairing.abort_reason,
            age_s=time.monotonic() - pairing.created,
        )
