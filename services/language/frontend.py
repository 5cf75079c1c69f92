"""The language side's request path, in the steps of the lifecycle
(docs/architecture.md), on the wire dataclasses:

    render          the prompt: the chat template with each image or video
                    expanded to its token hint (or a completion's prompt as it is);
                    sampling resolved and checked, the grammar compiled       (step 3)
    receive         receive blocks preallocated for the hints, the embeddings
                    awaited and taken out of the pool (ReceiverDriver)      (steps 3-7)
    rebuild         the prompt again from the real grids where they differ
                    from the hints, or a Qwen3-VL video spells out its
                    timestamps                                                (step 7)
    engine_request  M-RoPE positions, placeholders and the media             (step 8)
    stream          the engine's outputs as GenerateResponse messages        (step 8)

Where the gateway hinted every item's grid, the prompt is final at `render`,
and the request goes to the engine at once (`prefill_while_encoding`): `feed`
hands it each part of the embeddings as it lands, and the engine prefills up
to the first media token still missing meanwhile (steps 6-8 overlap). A grid
that differs from its hint sends the request back to the path above. Where the
gateway says this instance may hold some of the items (`held_items`: the
broker sent it this chat's prefix before), the engine takes the request's
cached pages first and says which media tokens they cover; the preallocation
asks for none of those, and the encoder encodes and sends none of them.

The servicer runs them in that order (`generate`); the monolithic baseline
runs the same steps with pixels its own engine encodes in place of `receive`.
In E/P/D a prefill instance runs them up to the first token and hands the KV
pages to the decode instance (`prefill`); the decode instance renders the
request for its sampling, receives the pages and streams (`decode`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from services.language.engine.interface import Engine
from services.language.engine.kv_cache import prefix_digests
from services.language.engine.outputs import RequestOutput
from services.language.engine.request import Request, new_request, prefilled_request
from services.language.kv_handoff import KVHandoff, KVObserver
from services.language.prefix_moves import FETCH_TIMEOUT_S, PrefixPeers
from services.model.spec import ModelSpec
from services.model.tokenizer import (
    ChatMessages,
    Prompt,
    Tools,
    build_prompt,
    completion_prompt,
)
from services.runtime import tracing
from services.transfer.receiver_driver import ReceiverDriver
from services.wire.messages import EmbeddingMeta, KvMeta, MediaGrid, kv_transfer_id
from services.wire.request import (
    ChatMessage,
    GenerateChunk,
    GenerateComplete,
    GenerateRequest,
    GenerateResponse,
    ImagePart,
    PrefillReply,
    SamplingParams,
    ToolCall,
)

ROLES = ("system", "user", "assistant", "tool")
MEDIA_WAIT_SMOOTHING = 0.25  # the weight of the newest request in the media wait the engine is told


class MediaMismatchError(RuntimeError):
    """The encoder sent another number of images and videos than the prompt has."""


@dataclass(frozen=True, slots=True)
class Media:
    """A request's images and videos as the engine takes them, in prompt order:
    their grids, and either their embeddings (with deepstack, its features) or,
    for an engine with its own vision tower, their pixels."""

    grids: tuple[MediaGrid, ...] = ()
    embeddings: torch.Tensor | None = None  # [tokens, hidden]
    deepstack: torch.Tensor | None = None  # [tokens, levels * hidden]
    pixel_values: torch.Tensor | None = None  # [patches, patch_dim]


@dataclass(frozen=True, slots=True)
class Rendered:
    """A request after `render`: its prompt and resolved sampling."""

    request_id: str
    chat: ChatMessages  # the chat template's input (empty for a completion)
    hints: tuple[int, ...]  # each image's and video's token hint (0: unknown)
    prompt: Prompt
    sampling: SamplingParams  # max_tokens resolved
    grammar: Any  # the compiled grammar of a guided request, else None
    tools: Tools = ()  # the functions the chat template renders
    media_keys: tuple[str, ...] = ()  # each image's and video's content hash ("": none)
    # every item's grid, where the caller hinted them all: the prompt is built
    # from them, and the request may prefill while its embeddings arrive
    grids: tuple[MediaGrid, ...] | None = None
    held_items: int = 0  # the leading items the prefix cache may hold (GenerateRequest's)
    cache_salt: str = ""  # the client's cache scope (GenerateRequest's)
    prefix_holder: str = ""  # another instance that holds the chat's KV pages (GenerateRequest's)
    arrived: float = field(default_factory=time.monotonic)  # when it was rendered


@dataclass(frozen=True, slots=True)
class MediaHints:
    """What a chat says of its images and videos before they are encoded, in
    prompt order: each one's token hint (0: unknown), content hash ("": none)
    and grid hint (None: unknown)."""

    tokens: tuple[int, ...] = ()
    keys: tuple[str, ...] = ()
    grids: tuple[MediaGrid | None, ...] = ()


def chat_messages(messages: Sequence[ChatMessage]) -> tuple[ChatMessages, MediaHints]:
    """The chat template's messages, and what they say of their images and videos."""
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    hints: list[int] = []
    keys: list[str] = []
    grids: list[MediaGrid | None] = []
    for message in messages:
        if message.role not in ROLES:
            raise ValueError(f"unknown role {message.role!r}; expected one of {', '.join(ROLES)}")
        parts: list[dict[str, Any]] = []
        for part in message.content:
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
            else:
                parts.append({"type": "image" if isinstance(part, ImagePart) else "video"})
                hints.append(part.token_hint)
                keys.append(part.key)
                grids.append(part.grid_hint)
        entry: dict[str, Any] = {"role": message.role, "content": parts}
        if message.tool_calls:
            entry["tool_calls"] = [template_call(call) for call in message.tool_calls]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out, MediaHints(tuple(hints), tuple(keys), tuple(grids))


def template_call(call: ToolCall) -> dict[str, Any]:
    """A call as chat templates take it: arguments as an object (the templates
    write them with `tojson`; a string would come out quoted)."""
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        raise ValueError(f"tool call {call.id!r}: arguments are not JSON") from None
    function = {"name": call.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def request_tools(request: GenerateRequest) -> Tools:
    """The functions of a chat request (OpenAI's `tools`, JSON), checked for shape."""
    if not request.tools:
        return ()
    try:
        tools = json.loads(request.tools)
    except json.JSONDecodeError:
        raise ValueError("tools: not JSON") from None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
    ):
        raise ValueError('tools: a list of {"type": "function", "function": {...}}')
    return tuple(tools)


def hinted_grids(hints: MediaHints, merge_size: int) -> tuple[MediaGrid, ...] | None:
    """Every item's grid hint, where each has one that agrees with its token hint."""
    grids = tuple(g for g in hints.grids if g is not None)
    if len(grids) != len(hints.tokens) or not grids:
        return None
    for grid, tokens in zip(grids, hints.tokens, strict=True):
        if (
            grid.h % merge_size
            or grid.w % merge_size
            or not 0 < grid.num_tokens(merge_size) == tokens
        ):
            return None
    return grids


def check_hints(hints: Sequence[int], max_media_tokens: int | None, max_model_len: int) -> None:
    """Token hints come from the caller: bounded by the largest image the model
    takes and by the context, before anything is built from them."""
    for index, hint in enumerate(hints):
        if max_media_tokens is not None and hint > max_media_tokens:
            raise ValueError(
                f"image {index}: token_hint {hint} exceeds {max_media_tokens}, the tokens of "
                "the largest image this model takes"
            )
    if sum(hints) > max_model_len:
        raise ValueError(
            f"the images' token hints ({sum(hints)}) exceed the context length of "
            f"{max_model_len} tokens"
        )


def responses(output: RequestOutput, media_tokens: int) -> list[GenerateResponse]:
    """One engine output as stream messages: its chunk, then the completion if it is the last."""
    out = []
    if output.token_ids or output.text:
        chunk = GenerateChunk(tuple(output.token_ids), output.text, tuple(output.logprobs))
        out.append(GenerateResponse(output.request_id, chunk, output.index))
    if output.finish_reason is not None:
        complete = GenerateComplete(
            output.finish_reason,
            output.num_prompt_tokens,
            output.num_output_tokens,
            media_tokens,
            output.num_cached_tokens,
        )
        out.append(GenerateResponse(output.request_id, complete, output.index))
    return out


def _resolved(sampling: SamplingParams, remaining: int) -> SamplingParams:
    """What proto3 leaves implicit, made explicit for the engine: no max_tokens
    means up to the context, and asking for top_logprobs asks for logprobs."""
    return replace(
        sampling,
        max_tokens=sampling.max_tokens or max(1, remaining),
        logprobs=sampling.logprobs or sampling.top_logprobs > 0,
    )


def _trace_engine(request: Request) -> None:
    """A finished request's time in the engine, as spans: waiting for its first
    step, its prefill (chunks) up to the first token, and its decode (tokens,
    TPOT), from the times the engine noted."""
    if not tracing.enabled():
        return
    ended = time.monotonic()
    started = request.first_scheduled_time or ended
    first = request.first_token_time or ended
    tracing.record("engine.queue", request.arrival_time, started, None)
    if request.num_prefill_steps:
        tracing.record(
            "engine.prefill",
            started,
            first,
            None,
            prompt_tokens=request.num_prompt_tokens,
            chunks=request.num_prefill_steps,
            cached_pages=request.num_cached_pages,
            preemptions=request.num_preemptions,
        )
    decoded = request.num_output_tokens - 1
    if decoded > 0:
        tpot_ms = (ended - first) / decoded * 1000
        held_ms = request.held_seconds * 1000  # its decode steps held while images encoded
        tracing.record(
            "engine.decode", first, ended, None, tokens=decoded, tpot_ms=tpot_ms, held_ms=held_ms
        )


class _HintsDiffer(Exception):
    """A streamed request's real grids differ from its hints: it runs again with
    these media, received whole."""

    def __init__(self, media: Media) -> None:
        super().__init__("the media's grids differ from their hints")
        self.media = media


class Frontend:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        spec: ModelSpec,
        receiver: ReceiverDriver | None = None,
        max_media_tokens: int | None = None,
        kv: KVHandoff | None = None,
        on_kv_received: KVObserver = lambda transport, tokens, seconds: None,
        on_media_held: Callable[[int], None] = lambda tokens: None,
        prefill_while_encoding: bool = True,
        prefix_peers: PrefixPeers | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.spec = spec
        # None: media come as pixels (the monolithic baseline); a decode instance's
        # receives KV pages
        self.receiver = receiver
        self.max_media_tokens = max_media_tokens
        self.kv = kv  # a prefill instance's
        self._on_kv_received = on_kv_received
        self._on_media_held = on_media_held  # media tokens a preallocation skipped
        self.prefill_while_encoding = prefill_while_encoding
        self.prefix_peers = prefix_peers  # None: a chat's KV pages never move here
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # when each request (by id) now awaiting its embeddings came: the engine is
        # told the oldest, and how long embeddings have taken to arrive lately (smoothed)
        self._awaiting_media: dict[str, float] = {}
        self._media_wait_s = 0.0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateResponse]:
        """The whole path of a request whose embeddings an encoder sends."""
        rendered = await self.render(request)
        async for response in self.stream(self.run(rendered)):
            yield response

    async def run(
        self, rendered: Rendered, hold_kv: bool = False
    ) -> AsyncIterator[tuple[Request, RequestOutput]]:
        """A rendered request through the engine, with the request each output is
        of: run while its media arrive where their grids were hinted, and run
        again with its media all received if a real grid differs from its hint."""
        if rendered.hints and rendered.grids is not None and self.prefill_while_encoding:
            try:
                async for pair in self._run_streamed(rendered, hold_kv):
                    yield pair
                return
            except _HintsDiffer as differ:
                media = differ.media
        else:
            media = await self.receive(rendered) if rendered.hints else Media()
        rendered = await self.rebuild(rendered, media.grids) if rendered.hints else rendered
        engine_request = self.engine_request(rendered, media)
        engine_request.hold_kv = hold_kv
        await self._move_prefix(rendered, engine_request)
        async for pair in self.outputs(engine_request):
            yield pair

    async def _run_streamed(
        self, rendered: Rendered, hold_kv: bool
    ) -> AsyncIterator[tuple[Request, RequestOutput]]:
        """The request run while `feed` hands it each part of its media as it
        lands; _HintsDiffer, with the media received, where a grid differs from
        its hint (the feed aborted the request before anything was sampled)."""
        assert rendered.grids is not None
        engine_request = self.engine_request(rendered, Media(rendered.grids), streamed=True)
        engine_request.hold_kv = hold_kv
        await self._move_prefix(rendered, engine_request)
        held = asyncio.get_running_loop().create_future() if engine_request.pin_prefix else None
        # told before the engine has it: its first step (the text before the
        # first image) takes the pacing's threads beside the tower, not all of
        # them (on 2 cores, a one-image TTFT ~60 ms longer, some of the time)
        self._await_media(rendered, True)
        feeding = asyncio.create_task(self.feed(rendered, held))
        try:
            async with contextlib.aclosing(self.engine.generate(engine_request)) as outputs:
                async for output in outputs:
                    if output.num_media_held is not None:  # the engine's first answer
                        assert held is not None
                        held.set_result(output.num_media_held)
                    elif feeding.done() and (media := feeding.result()) is not None:
                        raise _HintsDiffer(media)  # the feed's own error raises here
                    else:
                        yield engine_request, output
        finally:
            if not feeding.done():
                feeding.cancel()
                await asyncio.wait([feeding])
            self._await_media(rendered, False)  # the feed's end said so, unless it never began

    async def _move_prefix(self, rendered: Rendered, request: Request) -> None:
        """Where the route named another instance that holds the chat's KV pages,
        those of the prompt's prefix come from there (prefix_moves.py): the engine
        adopts them as it adds the request, which then computes only what follows."""
        if not rendered.prefix_holder or self.prefix_peers is None:
            return
        digests = prefix_digests(request, self.prefix_peers.shape.page_size)
        try:
            held = await self.engine.export_prefix(digests, 1, FETCH_TIMEOUT_S, with_planes=False)
        except TimeoutError:
            return  # its own engine did not say: the request computes its pages
        missing = digests[held.num_pages :]  # those it holds (a shared system prompt) stay
        if missing:
            request.moved_prefix = await self.prefix_peers.fetch(rendered.prefix_holder, missing)

    async def prefill(self, request: GenerateRequest) -> PrefillReply:
        """E/P/D, on a prefill instance: the path of `generate` up to each choice's
        first token, then the prompt's KV pages into those the decode instance
        allocated; returns once they are there (the pages are free again)."""
        assert self.kv is not None, "a prefill instance's frontend hands KV pages over"
        peer = await self.kv.sender.peer(request.decode_instance_id)
        rendered = await self.render(request)
        transfer = kv_transfer_id(request.request_id)
        handed_over = False
        try:
            ran = [pair async for pair in self.run(rendered, hold_kv=True)]
            engine_request, outputs = ran[-1][0], [output for _, output in ran]
            _trace_engine(engine_request)
            prompt = engine_request.num_prompt_tokens
            meta = self.kv.hold(peer.instance_id, engine_request, outputs)
            started = time.perf_counter()
            with tracing.span("language.kv_send", decode=peer.instance_id, tokens=prompt):
                done = self.kv.sender.start(peer, meta)
                handed_over = True  # the transfer lets the pages go when no write reads them
                try:
                    await asyncio.shield(done)
                except asyncio.CancelledError:
                    self.kv.sender.abort(transfer, "the prefill caller went away")
                    raise
            transport = self.kv.sender.transport_to(peer)
            if transport is not None:
                self.kv.on_sent(transport, prompt, time.perf_counter() - started)
            return PrefillReply(prompt)
        finally:
            if not handed_over:
                self.kv.source.release(transfer)

    async def decode(self, request: GenerateRequest) -> AsyncIterator[GenerateResponse]:
        """E/P/D, on a decode instance: pages preallocated for the prompt's KV,
        which the prefill instance writes, then the request admitted with them and
        every token streamed (each choice's first, sampled there, included)."""
        assert self.receiver is not None and self.receiver.blocks.keeps_blocks
        rendered = await self.render(request)  # the sampling, the grammar, a size hint
        transfer = kv_transfer_id(request.request_id)
        started = time.perf_counter()
        try:
            with tracing.span("language.kv_receive", prefill=request.prefill_instance_id):
                await self.receiver.expect(transfer, len(rendered.prompt.token_ids))
                meta = await self.receiver.wait(transfer)
                pages = self.receiver.take_blocks(transfer)
        finally:
            self.receiver.release(transfer, "the request ended before its KV pages arrived")
        assert isinstance(meta, KvMeta)
        self._on_kv_received(meta.transport, meta.total_tokens, time.perf_counter() - started)
        engine_request = prefilled_request(
            request.request_id,
            list(meta.prompt_token_ids),
            rendered.sampling,
            self.spec,
            meta.mrope_delta,
            pages,
            rendered.grammar,
            rendered.cache_salt,
        )
        pads = {self.spec.image_token_id, self.spec.video_token_id}
        media_tokens = sum(token in pads for token in meta.prompt_token_ids)
        async for output in self.engine.generate(engine_request, meta.first_tokens):
            if output.finished and output.index == 0:
                _trace_engine(engine_request)
            for response in responses(output, media_tokens):
                yield response

    async def render(self, request: GenerateRequest) -> Rendered:
        with tracing.span("language.render"):
            return await self._render(request)

    async def _render(self, request: GenerateRequest) -> Rendered:
        if request.is_completion:
            if request.messages:
                raise ValueError("a request has messages or a prompt, not both")
            chat: ChatMessages = []
            media = MediaHints()
            grids = None
            tools: Tools = ()
            known = True
            args = (request.prompt, list(request.prompt_token_ids))
            prompt = await self._tokenize(completion_prompt, *args)
        else:
            chat, media = chat_messages(request.messages)
            tools = request_tools(request)
            hints = media.tokens
            check_hints(hints, self.max_media_tokens, self.engine.max_model_len)
            known = all(h > 0 for h in hints)  # else the prompt's length waits for the grids
            grids = hinted_grids(media, self.spec.vision.spatial_merge_size)
            items = grids or (hints if known else [1] * len(hints))
            prompt = await self._tokenize(build_prompt, chat, items, tools)
        sampling = _resolved(request.sampling, self.engine.max_model_len - len(prompt.token_ids))
        self.engine.checks.check_sampling(sampling)
        grammar = await self.engine.compile_grammar(sampling)
        if known:
            self.engine.checks.check_fits(len(prompt.token_ids), sampling.max_tokens)
        return Rendered(
            request.request_id,
            chat,
            media.tokens,
            prompt,
            sampling,
            grammar,
            tools,
            media.keys,
            grids,
            request.held_items,
            request.cache_salt,
            request.prefix_holder,
        )

    async def receive(self, rendered: Rendered) -> Media:
        """Preallocates receive blocks for the hinted tokens, waits for the
        embeddings and takes them out of the pool (its blocks are free again)."""
        async with self._receiving(rendered) as receiver:
            meta = await receiver.wait(rendered.request_id)
            planes = await receiver.take(rendered.request_id)
        assert isinstance(meta, EmbeddingMeta)
        return Media(meta.grids, planes["embeddings"], planes.get("deepstack"))

    async def feed(self, rendered: Rendered, held: asyncio.Future[int] | None) -> Media | None:
        """Receives a request the engine already runs (`run`): each part of its
        embeddings goes to the engine as it lands (after the media tokens the
        engine's cached pages cover, `held`, once it says). None once all have; if
        the encoder's grids differ from the hinted ones the prompt was built from,
        the engine request is aborted and the media, received to the end,
        returned. On failure the engine request is aborted and the error raised."""
        request_id, hinted = rendered.request_id, sum(rendered.hints)
        differing: list[tuple[EmbeddingMeta, dict[str, torch.Tensor]]] = []
        try:
            start = await held if held is not None else 0
            self._on_media_held(start)
            async with self._receiving(rendered, start) as receiver:
                async for meta, planes in receiver.parts(request_id):
                    assert isinstance(meta, EmbeddingMeta)
                    if meta.grids != rendered.grids:
                        if held is not None and held.result():
                            raise MediaMismatchError(
                                "the encoder's grids differ from the hints the cached pages "
                                "were found by"
                            )
                        differing.append((meta, planes))
                        continue
                    embeds = planes["embeddings"]
                    if start + embeds.shape[0] >= hinted:  # the last part: told before it
                        self._await_media(rendered, False)  # lands, its prefill takes every thread
                    if embeds.shape[0]:
                        self.engine.add_media(request_id, start, embeds, planes.get("deepstack"))
                    start += embeds.shape[0]
        except BaseException:
            self.engine.abort(request_id)
            raise
        if not differing:
            return None
        self.engine.abort(request_id)
        planes = {name: torch.cat([p[name] for _, p in differing]) for name in differing[0][1]}
        return Media(differing[0][0].grids, planes["embeddings"], planes.get("deepstack"))

    @contextlib.asynccontextmanager
    async def _receiving(self, rendered: Rendered, skip: int = 0) -> AsyncIterator[ReceiverDriver]:
        """Receive blocks preallocated for the request's hinted tokens (but the
        first `skip`), its transfer released when the block ends however it ends;
        meanwhile the engine knows that a request awaits its media."""
        assert self.receiver is not None, "a frontend without a receiver takes pixels"
        request_id, hinted = rendered.request_id, sum(rendered.hints)
        self._await_media(rendered, True)
        try:
            with tracing.span("language.receive", hinted_tokens=hinted):
                await self.receiver.expect(request_id, hinted, skip)
                yield self.receiver
            if hinted > skip:  # it received them all
                waited = time.monotonic() - rendered.arrived
                self._media_wait_s += MEDIA_WAIT_SMOOTHING * (waited - self._media_wait_s)
        finally:
            self.receiver.release(request_id, "the request ended before its embeddings arrived")
            self._await_media(rendered, False)

    def _await_media(self, rendered: Rendered, awaits: bool) -> None:
        """A request now awaits its media, or no longer (again: no change): the
        engine is told when the oldest awaiting one came, as that changes, with
        how long embeddings have taken to arrive lately (Pacing.urgency). The
        engine's messages keep their order, so a request told done before its
        last part is added prefills on all the threads the pacing has."""
        oldest = min(self._awaiting_media.values(), default=None)
        if awaits:
            self._awaiting_media[rendered.request_id] = rendered.arrived
        else:
            self._awaiting_media.pop(rendered.request_id, None)
        if (oldest_now := min(self._awaiting_media.values(), default=None)) != oldest:
            self.engine.set_encoding(oldest_now, self._media_wait_s)

    async def rebuild(self, rendered: Rendered, grids: Sequence[MediaGrid]) -> Rendered:
        """The prompt for the real grids, tokenized again only where they differ
        from the hints or a video spells out its timestamps (Qwen3-VL)."""
        if len(grids) != len(rendered.hints):
            raise MediaMismatchError(
                f"the encoder sent {len(grids)} images, the prompt has {len(rendered.hints)}"
            )
        if tuple(grids) == rendered.grids:  # the prompt was built from them
            return rendered
        merge = self.spec.vision.spatial_merge_size
        counts = tuple(g.num_tokens(merge) for g in grids)
        if counts == rendered.hints and not any(g.frame_seconds for g in grids):
            return rendered
        prompt = await self._tokenize(build_prompt, rendered.chat, grids, rendered.tools)
        self.engine.checks.check_fits(len(prompt.token_ids), rendered.sampling.max_tokens)
        return replace(rendered, prompt=prompt)

    def engine_request(self, rendered: Rendered, media: Media, streamed: bool = False) -> Request:
        return new_request(
            rendered.request_id,
            rendered.prompt.token_ids,
            rendered.sampling,
            self.spec,
            media.grids,
            media.embeddings,
            media.pixel_values,
            grammar=rendered.grammar,
            deepstack=media.deepstack,
            media_keys=rendered.media_keys,
            streamed=streamed,
            pin_prefix=streamed and rendered.held_items > 0,
            cache_salt=rendered.cache_salt,
        )

    async def stream(
        self, outputs: AsyncIterator[tuple[Request, RequestOutput]]
    ) -> AsyncIterator[GenerateResponse]:
        """Engine outputs as stream messages; a request's engine spans once its
        first choice ends."""
        async for request, output in outputs:
            if output.finished and output.index == 0:
                _trace_engine(request)
            for response in responses(output, request.num_media_tokens):
                yield response

    async def outputs(self, request: Request) -> AsyncIterator[tuple[Request, RequestOutput]]:
        """The engine's outputs of a request, each with it."""
        async with contextlib.aclosing(self.engine.generate(request)) as outputs:
            async for output in outputs:
                yield request, output

    async def _tokenize(self, build: Callable[..., Prompt], *args: Any) -> Prompt:
        """Templating and tokenizing, on their own thread: a long prompt never holds
        the event loop (one thread: a fast tokenizer must not run concurrently)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizing, build, self.tokenizer, self.spec, *args)

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
