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
