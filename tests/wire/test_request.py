"""A chat's prefix hashes: what the broker routes a conversation's turns by."""

from __future__ import annotations

from services.wire.request import ChatMessage, GenerateRequest, ImagePart


def _chat(*messages: ChatMessage, tools: str = "") -> GenerateRequest:
    return GenerateRequest("r", messages, tools=tools)


USER = ChatMessage("user", (ImagePart(64, "aa"), "What is it?"))
ANSWER = ChatMessage("assistant", ("A cat.",))
FOLLOW_UP = ChatMessage("user", ("What colour?",))


def test_the_next_turn_begins_with_the_last_turn_s_prefixes() -> None:
    first = _chat(USER).prefix_hashes()
    second = _chat(USER, ANSWER, FOLLOW_UP).prefix_hashes()
    assert len(first) == 1 and len(second) == 3
    assert second[:1] == first
    assert len(set(second)) == 3


def test_another_picture_or_other_tools_is_another_prefix() -> None:
    other = ChatMessage("user", (ImagePart(64, "bb"), "What is it?"))
    assert _chat(other).prefix_hashes() != _chat(USER).prefix_hashes()
    assert _chat(USER, tools='[{"x": 1}]').prefix_hashes() != _chat(USER).prefix_hashes()
    assert GenerateRequest("r", prompt="hi").prefix_hashes() == ()


def test_a_salt_or_a_prompt_cache_key_starts_prefixes_of_their_own() -> None:
    """Turns under one salt and key share their prefixes; another salt or another
    key (OpenAI's prompt_cache_key) gives others, so those turns are routed on
    their own. A completion has one prefix, its key's, where it has one."""
    salted = GenerateRequest("r", (USER,), cache_salt="s")
    assert (
        salted.prefix_hashes("k")[0]
        == GenerateRequest("r2", (USER, ANSWER), cache_salt="s").prefix_hashes("k")[0]
    )
    others = {
        _chat(USER).prefix_hashes()[0],
        salted.prefix_hashes()[0],
        salted.prefix_hashes("k")[0],
        salted.prefix_hashes("other")[0],
        _chat(USER).prefix_hashes("k")[0],
    }
    assert len(others) == 5
    completion = GenerateRequest("r", prompt="hi")
    assert len(completion.prefix_hashes("k")) == 1
    assert completion.prefix_hashes("k") == GenerateRequest("q", prompt="ho").prefix_hashes("k")
    assert completion.prefix_hashes("k") != completion.prefix_hashes("j")
