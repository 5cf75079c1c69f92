from __future__ import annotations

from pathlib import Path

from services.language.engine.detokenizer import IncrementalDetokenizer
from services.model.tokenizer import load_tokenizer


def test_never_emits_half_a_character(tiny_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(tiny_checkpoint)
    text = "Zürich 你好 😀 smørrebrød"
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = []
    for token in ids:
        detok.push(token)
        piece = detok.take(final=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(detok.take(final=True))
    assert "".join(pieces) == text
    assert any(p == "" for p in pieces)  # multi-token characters were held back


def test_stop_string_across_tokens_is_held_back(tiny_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(tiny_checkpoint)
    detok = IncrementalDetokenizer(tokenizer, stop=("brown fox",))
    emitted = ""
    for token in tokenizer("the quick brown fox jumps")["input_ids"]:
        detok.push(token)
        emitted += detok.take(final=False)
        assert "brown" not in emitted or detok.stopped
        if detok.stopped:
            break
    emitted += detok.take(final=True)
    assert detok.stopped
    assert emitted == "the quick "


def test_the_final_text_keeps_a_character_the_output_ended_inside_of(
    tiny_checkpoint: Path,
) -> None:
    """Cut inside a multi-byte character, the text equals the tokenizer's decode
    of all the tokens (Hugging Face's), U+FFFD where the character was cut."""
    tokenizer = load_tokenizer(tiny_checkpoint)
    ids = tokenizer("ok 😀")["input_ids"]
    cuts = [n for n in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:n])]
    assert cuts, "the emoji should span several tokens"
    for n in cuts:
        detok = IncrementalDetokenizer(tokenizer)
        streamed = ""
        for token in ids[:n]:
            detok.push(token)
            streamed += detok.take(final=False)
        assert "\ufffd" not in streamed  # never mid-stream
        streamed += detok.take(final=True)
        assert streamed == tokenizer.decode(ids[:n], skip_special_tokens=True)
        assert streamed.endswith("\ufffd")
