"""Structured output: JSON grammars compiled by xgrammar (the engine vLLM and
SGLang use), off the engine loop and cached by schema; each guided request
gets its own matcher, which masks its logits and follows its tokens."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch
import xgrammar as xgr

from services.language.engine.request import Request, SamplingParams
from services.model.spec import ModelSpec

# json_object: any JSON object (OpenAI's JSON mode), as a schema.
ANY_OBJECT = json.dumps({"type": "object"})

# xgrammar (0.2.9) spells a character of a string with minLength or maxLength as
# this class, which lets raw control characters (U+0000-U+001F) in: JSON forbids
# them, and strict parsers (Python's json, JSON.parse, pydantic) refuse the output.
# Its unbounded strings exclude them (basic_string_sub): so does `strict`.
LAX_CHARACTER = r"[^\"\\\r\n]"
STRICT_CHARACTER = r"[^\0-\x1f\"\\\r\n]"


# xgrammar prints U+0080-U+00FF as \xHH, which its EBNF parser reads on into the
# hex digits after it ("é" then "a", printed "\xe9a", comes back as U+0E9A): so
# does its compiler, with its cache on, for a Grammar it is given (it compiles the
# printed text). Spelled \u00HH, the printed grammar parses back to itself.
_PRINTED_ESCAPE = re.compile(r"\\(\\|x([0-9A-Fa-f]{2}))")


def strict(grammar: xgr.Grammar) -> str | None:
    """The grammar's EBNF with no raw control character in any JSON string, spelled
    to parse back to itself; None where xgrammar wrote no LAX_CHARACTER (nothing to
    fix, as once it is fixed upstream)."""
    text = str(grammar)
    if LAX_CHARACTER not in text:
        return None
    fixed = text.replace(LAX_CHARACTER, STRICT_CHARACTER)
    return _PRINTED_ESCAPE.sub(lambda m: m[0] if m[2] is None else f"\\u00{m[2]}", fixed)


class Grammars:
    def __init__(self, tokenizer: Any, spec: ModelSpec) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=spec.text.vocab_size, stop_token_ids=list(spec.eos_token_ids)
        )
        self.vocab_size = info.vocab_size
        self.tokenizer_info = info
        # The compiler caches what it compiled, keyed by the schema.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    async def compile(self, params: SamplingParams) -> xgr.CompiledGrammar | None:
        """The request's grammar (None when its output is free): tool calls' (the
        gateway builds their structural tag from `tools` and `tool_choice`) or a
        JSON schema's; ValueError for one xgrammar cannot use."""
        schema = ANY_OBJECT if params.json_object else params.json_schema
        if params.structural_tag:
            tag = params.structural_tag
            grammar = partial(xgr.Grammar.from_structural_tag, tag)
            compiled = partial(self.compiler.compile_structural_tag, tag)
            unusable = "tools: unusable function parameters"
        elif schema:
            # Compact JSON: free whitespace would let a weak model pad forever.
            grammar = partial(xgr.Grammar.from_json_schema, schema, any_whitespace=False)
            compiled = partial(self.compiler.compile_json_schema, schema, any_whitespace=False)
            unusable = "response_format: unusable JSON schema"
        else:
            return None

        def build() -> xgr.CompiledGrammar:
            fixed = strict(grammar())
            return compiled() if fixed is None else self.compiler.compile_grammar(fixed)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, build)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"{unusable}: {exc}") from None

    def deserialize(self, serialized: str) -> xgr.CompiledGrammar:
        """A grammar another process compiled (CompiledGrammar.serialize_json)."""
        return xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)


def mask_logits(logits: torch.Tensor, requests: list[Request]) -> None:
    """Sets, in place, the logits of tokens each guided request's grammar does
    not allow next to -inf; rows of free requests are not touched."""
    guided = [i for i, r in enumerate(requests) if r.matcher is not None]
    if not guided:
        return
    bitmask = xgr.allocate_token_bitmask(len(requests), logits.shape[-1])
    for i in guided:
        requests[i].matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=guided)
