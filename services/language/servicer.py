"""The Language gRPC servicer: Generate, PushEmbeddings (the gRPC data plane), Abort."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import torch

from services.language.engine.engine import AsyncEngine, RequestFailedError, RequestOutput
from services.language.engine.request import SamplingParams, new_request
from services.language.metrics import LanguageMetrics
from services.language.receiver_driver import ReceiverDriver
from services.model.spec import ModelSpec
from services.model.tokenizer import (
    ChatMessages,
    Prompt,
    build_prompt,
    completion_prompt,
    count_images,
)
from services.proto import common_pb2, language_pb2, language_pb2_grpc
from services.transfer.state import PoolExhaustedError, TransferFailedError
from services.wire.messages import ImageGrid

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
FINISH_REASONS = {
    "stop": language_pb2.FINISH_REASON_STOP,
    "length": language_pb2.FINISH_REASON_LENGTH,
    "abort": language_pb2.FINISH_REASON_ABORT,
}


def messages_from_proto(
    messages: Sequence[language_pb2.ChatMessage],
) -> tuple[ChatMessages, list[int]]:
    """Chat-template messages and the token hint of each image and video, in order."""
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    hints: list[int] = []
    for message in messages:
        if message.role not in ROLES:
            raise ValueError(f"unknown role {message.role!r}; expected one of {', '.join(ROLES)}")
        parts: list[dict[str, Any]] = []
        for part in message.content:
            kind = part.WhichOneof("kind")
            if kind == "image":
                parts.append({"type": "image"})
                hints.append(part.image.token_hint)
            elif kind == "video":
                parts.append({"type": "video"})
                hints.append(part.video.token_hint)
            else:
                parts.append({"type": "text", "text": part.text})
        out.append({"role": message.role, "content": parts})
    return out, hints


def check_hints(hints: Sequence[int], max_image_tokens: int | None, max_model_len: int) -> None:
    """Token hints come from the caller: bounded by the largest image the model
    takes and by the context, before anything is built from them."""
    for index, hint in enumerate(hints):
        if max_image_tokens is not None and hint > max_image_tokens:
            raise ValueError(
                f"image {index}: token_hint {hint} exceeds {max_image_tokens}, the tokens of "
                "the largest image this model takes"
            )
    if sum(hints) > max_model_len:
        raise ValueError(
            f"the images' token hints ({sum(hints)}) exceed the context length of "
            f"{max_model_len} tokens"
        )


def sampling_from_proto(pb: common_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=pb.temperature,
        top_p=pb.top_p if pb.top_p > 0 else 1.0,
        top_k=pb.top_k,
        max_tokens=pb.max_tokens or max(1, default_max_tokens),
        seed=pb.seed if pb.HasField("seed") else None,
        stop=tuple(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs or pb.top_logprobs > 0,
        top_logprobs=pb.top_logprobs,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        repetition_penalty=pb.repetition_penalty or 1.0,
        min_tokens=pb.min_tokens,
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        json_schema=pb.json_schema,
        json_object=pb.json_object,
        n=max(1, pb.n),
    )


def responses(output: RequestOutput, image_tokens: int) -> list[language_pb2.GenerateResponse]:
    """One engine output as stream messages: its chunk, then the completion if it is the last."""
    out = [chunk_to_proto(output)] if output.token_ids or output.text else []
    if output.finish_reason is not None:
        out.append(
            language_pb2.GenerateResponse(
                request_id=output.request_id,
                index=output.index,
                complete=language_pb2.GenerateComplete(
                    finish_reason=FINISH_REASONS[output.finish_reason],
                    prompt_tokens=output.num_prompt_tokens,
                    completion_tokens=output.num_output_tokens,
                    image_tokens=image_tokens,
                ),
            )
        )
    return out


def chunk_to_proto(output: RequestOutput) -> language_pb2.GenerateResponse:
    chunk = language_pb2.GenerateChunk(
        token_ids=output.token_ids,
        text=output.text,
        logprobs=[
            language_pb2.TokenLogprob(
                token_id=lp.token_id,
                token=lp.token,
                logprob=lp.logprob,
                top=[language_pb2.TopLogprob(token_id=t, token=s, logprob=v) for t, s, v in lp.top],
            )
            for lp in output.logprobs
        ],
    )
    return language_pb2.GenerateResponse(
        request_id=output.request_id, index=output.index, chunk=chunk
    )


class LanguageServicer(language_pb2_grpc.LanguageServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        receiver: ReceiverDriver,
        tokenizer: Any,
        spec: ModelSpec,
        metrics: LanguageMetrics,
        max_active_requests: int = 256,
        max_image_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self.tokenizer = tokenizer
        self.spec = spec
        self.metrics = metrics
        self.max_model_len = engine.max_model_len
        self.max_active_requests = max_active_requests
        self.max_image_tokens = max_image_tokens
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # Every request between Generate's start and its end, receiving or generating:
        # a second Generate under a live id is refused without touching the first.
        self._active: set[str] = set()

    async def Generate(
        self, request: language_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[language_pb2.GenerateResponse]:
        request_id = request.request_id
        if not request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if request_id in self._active:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request id {request_id!r} is already in flight on this instance",
            )
        if len(self._active) >= self.max_active_requests:
            self.metrics.requests.labels("rejected").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this language instance has {len(self._active)} requests in flight, "
                "its limit; retry later",
            )
        self._active.add(request_id)
        try:
            async for response in self._generate(request, context):
                yield response
        finally:
            self._active.discard(request_id)

    async def _generate(
        self, request: language_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[language_pb2.GenerateResponse]:
        request_id = request.request_id
        try:
            if request.prompt or request.prompt_token_ids:
                if request.messages:
                    raise ValueError("a request has messages or a prompt, not both")
                hints: list[int] = []
                known = True
                prompt = await self._tokenize(
                    completion_prompt,
                    self.tokenizer,
                    self.spec,
                    request.prompt,
                    list(request.prompt_token_ids),
                )
            else:
                messages, hints = messages_from_proto(request.messages)
                if count_images(messages) != len(hints):
                    raise ValueError("image parts and hints disagree")
                check_hints(hints, self.max_image_tokens, self.max_model_len)
                known = all(h > 0 for h in hints)
                prompt = await self._prompt(messages, hints if known else [1] * len(hints))
            sampling = sampling_from_proto(
                request.sampling, self.max_model_len - len(prompt.token_ids)
            )
            self.engine.check_sampling(sampling)
            grammar = await self.engine.compile_grammar(sampling)
            if known:
                self.engine.check_fits(len(prompt.token_ids), sampling.max_tokens)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        grids: list = []
        planes: list[torch.Tensor] = []
        if hints:
            try:
                grids, planes = await self._receive(request_id, sum(hints))
            except PoolExhaustedError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"image embeddings: {exc}")
            except TransferFailedError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"image embeddings: {exc}")
            if len(grids) != len(hints):
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the encoder sent {len(grids)} images, the prompt has {len(hints)}",
                )
            merge = self.spec.vision.spatial_merge_size
            counts = [g.num_tokens(merge) for g in grids]
            # tokenize again where the hints were unknown or wrong, or a video
            # spells out its timestamps (Qwen3-VL), which hints do not carry
            if counts != hints or any(g.frame_seconds for g in grids):
                try:
                    prompt = await self._prompt(messages, grids)
                    self.engine.check_fits(len(prompt.token_ids), sampling.max_tokens)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        engine_request = new_request(
            request_id,
            prompt.token_ids,
            sampling,
            self.spec,
            grids,
            planes[0] if planes else None,
            grammar=grammar,
            deepstack=planes[1] if len(planes) > 1 else None,  # the pool's planes, in order
        )
        try:
            async for output in self.engine.generate(engine_request):
                if output.finish_reason is not None:
                    self.metrics.requests.labels(output.finish_reason).inc()
                for response in responses(output, prompt.num_image_tokens):
                    yield response
        except RequestFailedError as exc:
            self.metrics.requests.labels("error").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {exc}")

    async def _prompt(self, messages: ChatMessages, items: Sequence[ImageGrid | int]) -> Prompt:
        """The chat's prompt with each vision item expanded for its grid or token count."""
        return await self._tokenize(build_prompt, self.tokenizer, self.spec, messages, items)

    async def _tokenize(self, build: Callable[..., Prompt], *args: Any) -> Prompt:
        """Templating and tokenizing, on their own thread: a long prompt never holds
        the event loop (one thread: a fast tokenizer must not run concurrently)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, build, *args)

    async def _receive(self, request_id: str, hint_tokens: int) -> tuple[list, list[torch.Tensor]]:
        """Preallocates, waits for the embeddings, takes them out of the pool: the
        embeddings, then with deepstack its features."""
        try:
            await self.receiver.expect(request_id, hint_tokens)
            meta = await self.receiver.wait(request_id)
            return list(meta.grids), await self.receiver.take(request_id)
        finally:
            self.receiver.release(request_id, "the request ended before its embeddings arrived")

    async def PushEmbeddings(
        self,
        request_iterator: AsyncIterator[language_pb2.EmbeddingChunk],
        context: grpc.aio.ServicerContext,
    ) -> language_pb2.PushEmbeddingsReply:
        received = 0
        async for chunk in request_iterator:
            try:
                self.receiver.write_chunk(
                    chunk.request_id,
                    chunk.start_token,
                    chunk.num_tokens,
                    chunk.planes,
                    chunk.encoder_instance_id,
                )
            except TransferFailedError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            received += chunk.num_tokens
        return language_pb2.PushEmbeddingsReply(received_tokens=received)

    async def Abort(
        self, request: language_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> language_pb2.AbortReply:
        reason = request.reason or "aborted by the caller"
        receiving = request.request_id in self.receiver.transfers
        self.receiver.release(request.request_id, reason)
        generating = self.engine.has_request(request.request_id)
        self.engine.abort(request.request_id)
        return language_pb2.AbortReply(found=receiving or generating)
