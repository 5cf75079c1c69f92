"""The encoder planner's decisions as a pure function of its readings and the
clock, property-tested over random load traces: it stays within its bounds,
never changes twice within a cool-down, adds only under lasting pressure and
retires only after a lasting quiet."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.launcher.planner import Planner, PlannerConfig, Reading

CONFIG = PlannerConfig(
    min_encoders=1,
    max_encoders=3,
    queue_per_encoder=2.0,
    latency_target_s=1.0,
    up_after_s=5.0,
    down_after_s=20.0,
    cooldown_s=10.0,
)


def reading(encoders: int, queue: int, seconds: float = 0.1, **extra: int) -> Reading:
    return Reading(encoders, queue, seconds, image_share=0.5, **extra)


Trace = list[tuple[int, float]]  # a reading a second: queue depth, encode seconds


def run(planner: Planner, trace: Trace) -> list[tuple[float, int, int]]:
    """Feeds the planner the trace from one encoder, applying its changes;
    returns (time, encoders before, change) for each change."""
    encoders, changes = 1, []
    for t, (queue, latency) in enumerate(trace):
        decision = planner.decide(reading(encoders, queue, latency), float(t))
        if decision.change:
            changes.append((float(t), encoders, decision.change))
            encoders += decision.change
    return changes


loads = st.lists(
    st.tuples(st.integers(min_value=0, max_value=12), st.floats(min_value=0, max_value=3)),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(loads)
def test_within_bounds_never_flapping_and_only_for_lasting_reasons(trace: Trace) -> None:
    changes = run(Planner(CONFIG), trace)
    encoders = 1
    last = None
    for t, before, change in changes:
        assert before == encoders
        encoders += change
        assert CONFIG.min_encoders <= encoders <= CONFIG.max_encoders
        if last is not None:
            assert t - last >= CONFIG.cooldown_s
        last = t
        window = trace[int(t - CONFIG.up_after_s) : int(t) + 1] if change > 0 else []
        for queue, latency in window:  # pressed every second of the last up_after_s
            assert queue / before > CONFIG.queue_per_encoder or latency > CONFIG.latency_target_s
        if change < 0:
            quiet = trace[int(t - CONFIG.down_after_s) : int(t) + 1]
            assert len(quiet) > CONFIG.down_after_s
            assert all(q / max(1, before - 1) <= 1.0 and s <= 0.5 for q, s in quiet)


def test_a_step_up_adds_encoders_then_a_quiet_retires_them() -> None:
    planner = Planner(CONFIG)
    trace = [(0, 0.0)] * 5 + [(9, 1.5)] * 40 + [(0, 0.0)] * 80
    changes = run(planner, trace)
    assert [(t, c) for t, _, c in changes] == [(10.0, 1), (20.0, 1), (65.0, -1), (86.0, -1)]


def test_a_brief_spike_changes_nothing() -> None:
    trace = [(0, 0.0)] * 3 + [(12, 2.0)] * 4 + [(0, 0.0)] * 10
    assert run(Planner(CONFIG), trace) == []


def test_the_minimum_is_restored_at_once() -> None:
    decision = Planner(CONFIG).decide(reading(0, 0), 0.0)
    assert decision.change == 1 and "minimum" in decision.reason


def test_an_imbalance_is_named() -> None:
    planner = Planner(CONFIG)
    saturated = planner.decide(reading(3, 12, 2.0, language_requests=2, language_capacity=64), 0.0)
    assert (
        saturated.imbalance
        == "encoders saturated at their maximum while the language side has room"
    )
    idle = planner.decide(reading(2, 0, 0.0, language_requests=60, language_capacity=64), 1.0)
    assert idle.imbalance == "language side saturated while the encoders idle"
    assert (
        planner.decide(
            reading(2, 1, 0.1, language_requests=10, language_capacity=64), 2.0
        ).imbalance
        == ""
    )


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_encoders"):
        PlannerConfig(min_encoders=3, max_encoders=2)
