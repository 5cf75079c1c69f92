"""The gRPC status an encoder gives a failed transfer, which tells the gateway
whether another encoder may succeed."""

from __future__ import annotations

import grpc
import pytest

from services.encoder.servicer import _status_for
from services.transfer.sender import Failure
from services.transfer.sender_driver import TransferError


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (Failure.ABORTED, grpc.StatusCode.ABORTED),  # the receiver gave up: so does the request
        (Failure.TIMED_OUT, grpc.StatusCode.DEADLINE_EXCEEDED),
        # a write that failed (a cut link times the connection out) is the path's
        # fault, not a bug here: another encoder's path may not share it
        (Failure.WRITE_FAILED, grpc.StatusCode.UNAVAILABLE),
        (Failure.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_a_failed_transfer_has_the_status_of_where_it_ended(
    failure: Failure, code: grpc.StatusCode
) -> None:
    assert _status_for(TransferError(failure, "why")) == code
