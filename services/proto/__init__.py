"""Generated protobuf and gRPC code for the `epd.v1` contracts in protos/.

Everything under epd/ comes from `epd protos`; never edit it. protoc writes
absolute imports (`from epd.v1 import common_pb2`), so this folder goes on
sys.path once and every generated module is imported under that single name.
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)

from epd.v1 import (  # noqa: E402
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
    telemetry_pb2,
    telemetry_pb2_grpc,
)

__all__ = [
    "broker_pb2",
    "broker_pb2_grpc",
    "common_pb2",
    "encoder_pb2",
    "encoder_pb2_grpc",
    "language_pb2",
    "language_pb2_grpc",
    "telemetry_pb2",
    "telemetry_pb2_grpc",
]
