"""Placement's encoder rule as pure functions, property-tested: the choice is
within the load bound, holds the most of the request's items among those
within it, and otherwise is the items' rendezvous hash, which moves only what
an encoder that comes or goes held."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.broker.placement import (
    Candidate,
    LoadBound,
    by_cache,
    hrw_weight,
    least_loaded,
    prefix_depth,
    within_bound,
)

KEYS = [f"k{i}" for i in range(8)]
BOUND = LoadBound(factor=2.0, slack=2)

candidates = st.lists(
    st.builds(
        Candidate,
        st.sampled_from([f"e{i}" for i in range(6)]),
        st.integers(min_value=0, max_value=20),
        st.frozensets(st.sampled_from(KEYS), max_size=5),
    ),
    min_size=1,
    max_size=6,
    unique_by=lambda c: c.instance_id,
)
request_keys = st.lists(st.sampled_from(KEYS), max_size=4)


def _hits(candidate: Candidate, keys: list[str]) -> int:
    return sum(k in candidate.cached for k in keys)


@settings(max_examples=400, deadline=None)
@given(candidates, request_keys)
def test_the_choice_is_within_the_bound_and_holds_the_most_it_can(
    encoders: list[Candidate], keys: list[str]
) -> None:
    chosen = by_cache(encoders, keys, BOUND)
    least = min(c.load for c in encoders)
    assert chosen.load <= BOUND.factor * least + BOUND.slack
    if not keys:
        assert chosen == least_loaded(encoders)
        return
    eligible = within_bound(encoders, BOUND)
    assert _hits(chosen, keys) == max(_hits(c, keys) for c in eligible)
    if _hits(chosen, keys):  # of the ones holding as many, the least loaded
        assert chosen.load == min(c.load for c in eligible if _hits(c, keys) == _hits(chosen, keys))
    else:  # nobody within the bound holds any: the first item's rendezvous hash
        assert chosen == max(eligible, key=lambda c: hrw_weight(keys[0], c.instance_id))


@settings(max_examples=200, deadline=None)
@given(candidates, st.sampled_from(KEYS), st.integers(min_value=0, max_value=5))
def test_an_encoder_that_leaves_moves_only_its_own_new_items(
    encoders: list[Candidate], key: str, leaving: int
) -> None:
    """Idle encoders holding nothing: a new item's encoder stays the same when
    another one leaves (consistent hashing), so repeats still meet."""
    idle = [Candidate(c.instance_id, 0) for c in encoders]
    before = by_cache(idle, [key], BOUND)
    gone = idle[leaving % len(idle)]
    rest = [c for c in idle if c is not gone]
    if gone != before and rest:
        assert by_cache(rest, [key], BOUND) == before


def test_the_least_loaded_is_always_within_the_bound() -> None:
    encoders = [Candidate("a", 7), Candidate("b", 30), Candidate("c", 16)]
    assert [c.instance_id for c in within_bound(encoders, BOUND)] == ["a", "c"]


def test_a_hot_image_spills_once_its_encoder_is_past_the_bound() -> None:
    hot = frozenset({"k0"})
    holder, other = Candidate("a", 4, hot), Candidate("b", 1)
    assert by_cache([holder, other], ["k0"], BOUND) == holder  # 4 <= 2 x 1 + 2
    busier = Candidate("a", 5, hot)
    assert by_cache([busier, other], ["k0"], BOUND) == other


def test_the_encoder_holding_more_of_the_items_wins() -> None:
    one = Candidate("a", 0, frozenset({"k0"}))
    two = Candidate("b", 2, frozenset({"k1", "k2"}))
    assert by_cache([one, two], ["k0", "k1", "k2"], BOUND) == two


def test_a_bound_must_not_exclude_the_least_loaded() -> None:
    with pytest.raises(ValueError, match="factor >= 1"):
        LoadBound(factor=0.5)


def test_the_prefix_depth_is_the_deepest_prefix_held() -> None:
    assert prefix_depth({"a", "ab", "abc"}, ["a", "ab", "abc", "abcd"]) == 3
    assert prefix_depth({"a", "abc"}, ["a", "ab", "abc"]) == 3  # the deepest, gaps or not
    assert prefix_depth({"x"}, ["a", "ab"]) == 0
    assert prefix_depth(set(), []) == 0
