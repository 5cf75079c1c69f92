"""E/P/D under SIGKILL: `epd serve --prefill 1 --decode 2` under load, its
prefill instance killed, then a decode instance. Only the requests that touched
the dead instance fail, each within a bounded time with a clean 5xx; the
instance comes back and serves (requests started after each recovery all
succeed); afterwards every KV page, receive block and send buffer is back on
every instance."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.conftest import Load, Stack, launch_stack, stop, wait_for
from tests.chaos.test_burst import pools_are_whole
from tests.chaos.test_chaos import _assert_failures_are_clean, _kill, _recovered, _served_after

INSTANCES = 4  # an encoder, a prefill and two decode instances


@pytest.fixture(scope="module")
def epd_stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("epd-chaos-logs")
    stack = launch_stack(tiny_checkpoint, logs, ("--prefill", "1", "--decode", "2"), 3, 1)
    ports = stack.ports
    stack.ports = {**ports, "prefill": ports["language"], "decode": ports["language"] + 1}
    yield stack
    stop(stack)


def test_prefill_then_decode_killed(epd_stack: Stack) -> None:
    stack = epd_stack
    wait_for(lambda: sorted(stack.serving().values()) == ["serving"] * INSTANCES, 60, "serving")
    with Load(stack.url) as load:
        time.sleep(3)
        prefill_killed = _kill(stack, "services.launcher.cli language", "--instance-id prefill-0")
        _recovered(stack, "prefill-0", INSTANCES)
        prefill_back = time.monotonic()
        _served_after(load, prefill_back)
        decode_killed = _kill(stack, "services.launcher.cli language", "--instance-id decode-0")
        _recovered(stack, "decode-0", INSTANCES)
        _served_after(load, time.monotonic())
    _assert_failures_are_clean(load.outcomes)
    failed = [o for o in load.outcomes if o.status != 200]
    # Only what was on the dead instance: in flight when it died, or routed in the
    # instant before the broker saw its stream close (or, the one prefill instance
    # down, started while it was restarting: a fast 503).
    for o in failed:
        near_prefill = o.ended >= prefill_killed and o.started <= prefill_back
        near_decode = o.in_flight_at(decode_killed) or 0 <= o.started - decode_killed < 1.0
        assert near_prefill or near_decode, o
    assert len([o for o in failed if o.in_flight_at(decode_killed)]) <= load.workers
    wait_for(lambda: pools_are_whole(stack), 30, "every pool whole")
