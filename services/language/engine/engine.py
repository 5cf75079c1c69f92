"""LLMEngine: the loop `step()`: `scheduler.schedule() -> runner.execute() -> sample ->
postprocess()` over the model, its paged KV cache, the scheduler and the sampler,
stepped by one thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from services.language.engine.config import EngineConfig
from services.language.engine.detokenizer import IncrementalDetokenizer
from services.language.engine.grammar import Grammars
from services.language.engine.kv_cache import (
    KVBlockManager,
    KVCache,
    KVCacheConfig,
    KVMemory,
    device_memory,
)
from services.language.engine.request import Request, RequestStatus, new_request
from services.language.engine.runner import ModelRunner
from services.language.engine.sampler import Sample, Sampler, SamplingError
from services.language.engine.scheduler import Scheduled, Scheduler
from services.language.engine.vision import VisionTower
from services.layers.attention import AttentionBackend, FlashInferAttention, TorchAttention
from services.layers.backends import (
    attention_backend,
    linear_backend,
    moe_backend,
    ops_backend,
)
from services.layers.cpu_decode import compiled_decode
from services.layers.cpu_kernels import (
    BF16_KINDS,
    bf16_linear,
    bf16_prefill_attention,
    f32_linear,
    fused_ops,
    kv_writer,
    linear_kernel,
    paged_decode_attention,
)
from services.layers.language_model import LanguageModel
from services.layers.linear import (
    pack_linears,
    use_bf16_linears,
    use_f32_linears,
    use_linear_kernel,
)
from services.layers.moe import autotuning, fuse_experts
from services.model.spec import ModelSpec
from services.wire.request import FinishReason, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]]


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A choice's first token, sampled by the instance that prefilled the prompt,
    and its generator's state after it (a seeded choice goes on where it was)."""

    sample: Sample
    generator_state: bytes | None = None


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A hold_kv request's choice after its first token: the pages holding its
    prompt's KV (kept until `release`) and that token."""

    pages: tuple[int, ...]
    first: FirstToken


class RequestFailedError(RuntimeError):
    """The engine ended this one request with an error (the others go on)."""


class EngineLostError(RequestFailedError):
    """The engine's process died: what it ran is lost; another instance may serve it."""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # set on the last output of a request that failed
    index: int = 0  # the choice, for n > 1
    num_cached_tokens: int = 0  # of the prompt's, taken from the prefix cache
    prefilled: Prefilled | None = None  # the last output of a hold_kv request's choice
    # the answer to a request that pins its prefix, as it is added: the media
    # tokens its cached pages cover (no token yet)
    num_media_held: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.prefilled is not None


def _mark_started(batch: list[Scheduled], now: float) -> None:
    """When each request first ran, and how many steps computed its prompt (what
    its trace shows as queue time and prefill chunks)."""
    for s in batch:
        request = s.request
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        if request.num_computed_tokens < request.num_prompt_tokens:
            request.num_prefill_steps += 1


@dataclass(frozen=True, slots=True)
class StepStats:
    num_tokens: int  # tokens computed this step
    num_generated: int
    ttfts: list[float]  # seconds, for requests that got their first token this step
    tpots: list[float]  # seconds per output token, for requests that finished this step
    num_cached_tokens: int = 0  # tokens admitted from the prefix cache this step
    num_cached_media_tokens: int = 0  # of those, images' and videos'
    threads: int = 0  # the OpenMP threads it ran on


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine holds, as of its last step or inbox drain: published by
    the engine thread as one immutable value, so any thread reads it whole."""

    running: int = 0
    waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_shared: int = 0


def check_fits(config: EngineConfig, num_prompt_tokens: int, max_tokens: int) -> None:
    """ValueError unless the request fits the context (and so the cache, alone)."""
    if num_prompt_tokens + max_tokens > config.max_model_len:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"context length of {config.max_model_len} tokens"
        )


def check_sampling(spec: ModelSpec, config: EngineConfig, params: SamplingParams) -> None:
    """ValueError unless the token ids the parameters name are in the vocabulary
    and its choices fit a batch."""
    vocab = spec.text.vocab_size
    if any(not 0 <= t < vocab for t in params.token_ids):
        raise ValueError(f"token ids in logit_bias and stop_token_ids must be in [0, {vocab})")
    seats = config.scheduler.max_num_seqs
    if params.n > seats:
        raise ValueError(f"n ({params.n}) exceeds the {seats} sequences a batch holds")


class LLMEngine:
    """The model, its KV cache, scheduler and sampler, stepped by one thread.
    `weights` (the loader's tensors by checkpoint name) are the engine's from
    then on: it changes the dict in place as it stacks and converts them."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        tokenizer: Any,
        config: EngineConfig,
        vision: VisionTower | None = None,
        kv_memory: KVMemory = device_memory,
    ) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.config = config
        device = torch.device(config.device)
        kv_config = KVCacheConfig.from_budget(
            spec.text, config.kv_cache_bytes, config.page_size, config.dtype
        )
        if kv_config.num_tokens < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {kv_config.num_tokens} tokens, less than max_model_len "
                f"{config.max_model_len}: raise kv_cache_bytes or lower max_model_len"
            )
        model, fused_moe = self._model(weights, device)
        attention = self._attention(device)
        # capturable: FlashInfer attention, and MoE experts without host syncs
        graphs = (
            config.cuda_graphs
            and isinstance(attention, FlashInferAttention)
            and (spec.text.moe is None or fused_moe)
        )
        kv_cache = KVCache(spec.text, kv_config, device, spare_pages=int(graphs), memory=kv_memory)
        self.runner = ModelRunner(model, kv_cache, attention, device, config.dtype)
        if graphs:
            self.runner.use_graphs(config.scheduler.max_num_seqs, config.max_model_len)
        self.runner.decode = compiled_decode(
            config.decode_layers,
            model,
            attention,
            self.runner.kv_cache.layers,
            kv_config.page_size,
            config.dtype,
        )
        self.blocks = KVBlockManager(kv_config, config.prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.blocks, config.max_model_len)
        self.sampler = Sampler(set(spec.eos_token_ids))
        self.grammars = Grammars(tokenizer, spec)
        self.requests: dict[str, list[Request]] = {}  # each request's choices
        self.held: dict[str, list[Request]] = {}  # PREFILLED choices, until `release`
        self.detokenizers: dict[tuple[str, int], IncrementalDetokenizer] = {}
        self.eos = set(spec.eos_token_ids)
        self.vision = vision
        # set by the loop's owner while requests await embeddings: `_pace_threads`, `step_delay`
        self.encoding = False
        self._last_step = 0.0  # when the last step ended (time.monotonic)
        self._stalled = False  # the last step computed nothing, and no news came since
        self._threads = torch.get_num_threads()
        self._decode_threads = min(config.decode_threads or self._threads, self._threads)

    def _model(
        self, weights: dict[str, torch.Tensor], device: torch.device
    ) -> tuple[LanguageModel, bool]:
        """The model in the config's dtype, with the backends its `auto` choices
        resolve to (experts, projections, fused operations); and whether its MoE
        experts are FlashInfer's fused ones."""
        config, spec = self.config, self.spec
        for name, tensor in weights.items():
            weights[name] = tensor.to(config.dtype)
        model = LanguageModel.from_weights(spec.text, weights, device)
        fused_moe = (
            spec.text.moe is not None
            and moe_backend(config.moe, config.dtype, device) == "flashinfer"
        )
        if fused_moe:
            fuse_experts(model, config.scheduler.max_num_batched_tokens)
        linear = linear_backend(config.linear, config.dtype, device)
        if linear == "onednn":
            pack_linears(model)
        elif linear == "cpu":
            kernel = linear_kernel()
            assert kernel is not None  # linear_backend checked
            use_linear_kernel(model, kernel)
        elif linear == "avx512":
            f32 = f32_linear()
            assert f32 is not None  # linear_backend checked
            use_f32_linears(model, f32)
        elif linear in BF16_KINDS:
            bf16 = bf16_linear(linear)
            assert bf16 is not None  # linear_backend checked
            use_bf16_linears(model, bf16)
        if ops_backend(config.ops, config.dtype, device) == "cpu":
            ops = fused_ops()
            assert ops is not None  # ops_backend checked
            model.use_fused_ops(ops)
        return model, fused_moe

    def _attention(self, device: torch.device) -> AttentionBackend:
        t = self.spec.text
        scale = t.head_dim**-0.5
        backend = attention_backend(self.config.attention, self.config.dtype, device)
        if backend == "flashinfer":
            return FlashInferAttention(
                t.num_heads, t.num_kv_heads, t.head_dim, scale, self.config.dtype, device
            )
        if backend != "cpu":
            return TorchAttention(scale)
        prefill = bf16_prefill_attention() if self.config.dtype == torch.bfloat16 else None
        return TorchAttention(scale, paged_decode_attention(), prefill, kv_writer())

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        check_fits(self.config, num_prompt_tokens, max_tokens)

    def check_sampling(self, params: SamplingParams) -> None:
        check_sampling(self.spec, self.config, params)

    def check(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.sampling.max_tokens)
        self.check_sampling(request.sampling)

    def add_request(self, request: Request) -> list[RequestOutput]:
        """Queues a request. One that pins its prefix takes its cached pages now
        and is answered at once with the media tokens they cover, which it will
        not be sent (RequestOutput.num_media_held)."""
        self._stalled = False
        self._register(request)
        self.scheduler.add(request)
        if not request.pin_prefix:
            return []
        held = self.scheduler.pin(request)
        for choice in request.forks:
            choice.num_media_ready = choice.num_media_held = held
        cached = request.num_computed_tokens
        return [
            RequestOutput(
                request.request_id,
                [],
                "",
                [],
                None,
                request.num_prompt_tokens,
                0,
                num_cached_tokens=cached,
                num_media_held=held,
            )
        ]

    def _register(self, request: Request) -> None:
        """Its choices, and a detokenizer each."""
        self.check(request)
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.forks = [request.choice(index) for index in range(1, request.sampling.n)]
        self.requests[request.request_id] = [request, *request.forks]
        for choice in self.requests[request.request_id]:
            self.detokenizers[request.request_id, choice.index] = IncrementalDetokenizer(
                self.tokenizer, request.sampling.stop
            )

    def add_prefilled(self, request: Request, firsts: Sequence[FirstToken]) -> list[RequestOutput]:
        """A request another instance prefilled: its block table holds the
        prompt's KV, and each choice's first token was sampled there. The first
        tokens go out now (a choice may end with its first); decoding goes on
        from the next step, every choice sharing the prompt's pages. Refused
        (ValueError), its pages are freed."""
        self._stalled = False
        try:
            self._register(request)
        except ValueError:
            self.blocks.allocator.free(request.block_table)
            raise
        choices, request.forks = self.requests[request.request_id], []
        if len(firsts) != len(choices):
            raise ValueError(f"{len(firsts)} first tokens for {len(choices)} choices")
        outputs, now = [], time.monotonic()
        for choice, first in zip(choices, firsts, strict=True):
            if choice is not request:
                self.blocks.share(request, choice)
            choice.num_computed_tokens = request.num_prompt_tokens
            if first.generator_state is not None and choice.generator is not None:
                choice.generator.set_state(
                    torch.frombuffer(bytearray(first.generator_state), dtype=torch.uint8)
                )
            self.scheduler.add(choice)
        for choice, first in zip(choices, firsts, strict=True):
            try:
                outputs.append(self._advance(choice, first.sample, now, [], []))
            except Exception as exc:  # the first token breaks its grammar
                return [self._fail(choice, str(exc))]
        return outputs

    def add_media(
        self,
        request_id: str,
        start: int,
        embeds: torch.Tensor,
        deepstack: torch.Tensor | None = None,
    ) -> list[RequestOutput]:
        """Streamed embeddings (and deepstack features) of a request's media tokens
        from `start` on, for every choice; a part that does not follow those
        already there fails the request. A request that has ended takes nothing."""
        self._stalled = False
        choices = self.requests.get(request_id)
        if not choices or choices[0].is_finished:
            return []
        first = choices[0]
        try:
            first.add_media(start, embeds, deepstack)
        except ValueError as exc:
            return [self._fail(first, str(exc))]
        for choice in choices[1:]:
            choice.media_embeds, choice.deepstack = first.media_embeds, first.deepstack
            choice.num_media_ready = first.num_media_ready
        return []

    def release(self, request_id: str) -> None:
        """Frees the pages of a request's PREFILLED choices."""
        self._stalled = False
        for choice in self.held.pop(request_id, []):
            self.blocks.free(choice)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """The final outputs of the request's choices that were still going."""
        self._stalled = False
        outputs = []
        for choice in self.requests.get(request_id, []):
            if not choice.is_finished:
                self.scheduler.finish(choice, RequestStatus.FINISHED_ABORTED)
                outputs.append(self._output(choice, [], [], final=True))
        return outputs

    def has_work(self) -> bool:
        """Whether a step would compute anything: a request has tokens to compute,
        and the last step did, or news (a request, media, an abort) came since."""
        return not self._stalled and self.scheduler.has_work()

    def step_delay(self) -> float:
        """Seconds to hold the next step: while requests await their embeddings, a
        step that would only decode waits config.decode_interval_while_encoding_ms
        after the last one ended: a vision tower on these cores gets that long
        however long a step takes."""
        interval = self.config.decode_interval_while_encoding_ms / 1000
        if not (interval and self.encoding) or self.scheduler.has_prefill_work():
            return 0.0
        return max(0.0, self._last_step + interval - time.monotonic())

    def warm_up(self) -> None:
        """Two short requests through a prefill-only, a mixed and a decode-only
        step, before serving: kernels (on CUDA, FlashInfer's, compiled on first
        use) are built and loaded now, not on the first client's time, and
        FlashInfer's fused MoE is autotuned. Then, on CUDA, the decode graphs
        are captured."""
        started = time.perf_counter()
        sampling = SamplingParams(max_tokens=3, ignore_eos=True)
        length = min(16, self.config.max_model_len - sampling.max_tokens)
        text = self.tokenizer.encode("An engine warms up. " * length, add_special_tokens=False)
        with autotuning(self.runner.model):
            for i in range(2):
                ids = text[: length >> i]
                self.add_request(new_request(f"warm-up-{i}", ids, sampling, self.spec))
                self.step()
            while self.has_work():
                self.step()
        self.runner.capture_graphs()
        logger.info("engine warmed up in %.2f s", time.perf_counter() - started)

    def load(self) -> EngineLoad:
        return EngineLoad(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.blocks.num_used_pages,
            self.blocks.num_shared_pages,
        )

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        if self.vision is not None:  # the tower's threads, as a prompt step's
            self._pace_threads()
            self.vision.encode_pending(self.scheduler.waiting)
        hits, media_hits = self.blocks.num_hit_tokens, self.blocks.num_hit_media_tokens
        preemptions = self.scheduler.num_preemptions
        batch = ModelRunner.order(self.scheduler.schedule())
        self._pace_threads(batch)
        _mark_started(batch, time.monotonic())
        cached = self.blocks.num_hit_tokens - hits
        cached_media = self.blocks.num_hit_media_tokens - media_hits
        lost = [
            self._fail(
                r,
                "KV pages ran out on this decode instance, and a request whose "
                "images were prefilled elsewhere cannot be recomputed here",
            )
            for r in self.scheduler.take_lost()
        ]
        if batch:
            self.runner.kv_cache.copy_pages(self.blocks.take_copies())
            logits = self.runner.execute(batch)
            batch, logits = self._fork(batch, logits)
            sampling = [s.request for s in batch if s.samples]
            samples = self.sampler.sample(logits, sampling)
            outputs, stats = self.postprocess(batch, samples)
        else:
            outputs, stats = [], self._stats([], [], [])
            self._stalled = not lost and preemptions == self.scheduler.num_preemptions
        stats = replace(stats, num_cached_tokens=cached, num_cached_media_tokens=cached_media)
        self._last_step = time.monotonic()
        return lost + outputs, stats

    def _pace_threads(self, batch: Sequence[Scheduled] = ()) -> None:
        """The step's OpenMP threads: all, or config.decode_threads for a batch
        that only decodes, and at most config.threads_while_encoding while the
        vision side computes for us. torch.set_num_threads holds for the calling
        thread, which is the one that steps."""
        decodes = bool(batch) and sum(s.num_tokens for s in batch) == len(batch)
        threads = self._decode_threads if decodes else self._threads
        fewer = self.config.threads_while_encoding
        if self.encoding and fewer:
            threads = min(threads, fewer)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def _fork(
        self, batch: list[Scheduled], logits: torch.Tensor
    ) -> tuple[list[Scheduled], torch.Tensor]:
        """The other choices of n > 1 requests whose prompt this step finished
        join the running batch: each shares the prompt's pages and samples its
        first token from the same logits (with its own generator)."""
        forked: list[Scheduled] = []
        rows = []
        for row, s in enumerate(s for s in batch if s.samples):
            parent = s.request
            for choice in parent.forks:
                choice.media_embeds = parent.media_embeds  # encoded by now if it came as pixels
                self.scheduler.join(parent, choice, s.num_tokens)
                forked.append(Scheduled(choice, 0, samples=True))
                rows.append(row)
            parent.forks = []
        if not forked:
            return batch, logits
        rows = list(range(logits.shape[0])) + rows
        return batch + forked, logits[rows]

    def postprocess(
        self, batch: list[Scheduled], samples: list[Sample | SamplingError]
    ) -> tuple[list[RequestOutput], StepStats]:
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        ttfts: list[float] = []
        tpots: list[float] = []
        sample_iter = iter(samples)
        for s in batch:
            request = s.request
            request.num_computed_tokens += s.num_tokens
            if s.is_prefill or request.num_computed_tokens % self.blocks.page_size == 0:
                self.blocks.cache_computed(request)  # a prompt's pages, or an output's full one
            if not s.samples or request.is_finished:  # another choice failed it this step
                continue
            sample = next(sample_iter)
            try:
                if isinstance(sample, SamplingError):
                    raise sample
                outputs.append(self._advance(request, sample, now, ttfts, tpots))
            except Exception as exc:  # this request's failure, not the batch's
                logger.warning("request %s failed: %s", request.request_id, exc)
                outputs.append(self._fail(request, str(exc)))
        return outputs, self._stats(batch, ttfts, tpots)

    def _advance(
        self, request: Request, sample: Sample, now: float, ttfts: list[float], tpots: list[float]
    ) -> RequestOutput:
        """Appends a sampled token; finishes the request if it stops here."""
        request.output_token_ids.append(sample.token_id)
        if request.matcher is not None and not request.matcher.accept_token(sample.token_id):
            raise SamplingError(f"token {sample.token_id} breaks the request's grammar")
        if request.first_token_time is None:
            request.first_token_time = now
            if request.index == 0:
                ttfts.append(now - request.arrival_time)
        detok = self.detokenizers[request.request_id, request.index]
        # Stop strings count only from min_tokens on (stop tokens are masked until then).
        detok.push(sample.token_id, stop=request.num_output_tokens >= request.sampling.min_tokens)
        if request.hold_kv:  # prefilled: the decode instance goes on (and checks the stops)
            self.scheduler.hold(request)
            self.held.setdefault(request.request_id, []).append(request)
            return self._output(request, [sample.token_id], [sample], final=True)
        status = self._stop_status(request, sample.token_id, detok)
        if status is not None:
            self.scheduler.finish(request, status)
            if request.num_output_tokens > 1 and request.first_token_time is not None:
                tpots.append((now - request.first_token_time) / (request.num_output_tokens - 1))
        return self._output(request, [sample.token_id], [sample], final=status is not None)

    def _fail(self, request: Request, error: str) -> RequestOutput:
        """Ends one request, all its choices, with an error; their pages are freed,
        the batch goes on."""
        for choice in self.requests.pop(request.request_id, [request]):
            if not choice.is_finished:
                self.scheduler.finish(choice, RequestStatus.FINISHED_ABORTED)
            self.detokenizers.pop((request.request_id, choice.index), None)
        return RequestOutput(
            request.request_id,
            [],
            "",
            [],
            FinishReason.ABORT,
            request.num_prompt_tokens,
            request.num_output_tokens,
            error=error,
            index=request.index,
        )

    def _stop_status(
        self, request: Request, token: int, detok: IncrementalDetokenizer
    ) -> RequestStatus | None:
        params = request.sampling
        if (
            (token in self.eos and not params.ignore_eos)
            or token in params.stop_token_ids
            or detok.stopped
            or (request.matcher is not None and request.matcher.is_terminated())
        ):
            return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(
        self, request: Request, token_ids: list[int], samples: list[Sample], final: bool
    ) -> RequestOutput:
        key = (request.request_id, request.index)
        detok = self.detokenizers[key]
        logprobs = [
            TokenLogprob(
                s.token_id,
                detok.token_text(s.token_id),
                s.logprob,
                [(t, detok.token_text(t), lp) for t, lp in s.top],
            )
            for s in samples
            if s.logprob is not None
        ]
        text = detok.take(final)
        prefilled = None
        if request.status is RequestStatus.PREFILLED:
            state = request.generator.get_state() if request.generator is not None else None
            first = FirstToken(samples[0], None if state is None else state.numpy().tobytes())
            prefilled = Prefilled(tuple(request.block_table), first)
        if final:
            del self.detokenizers[key]
            if all(choice.is_finished for choice in self.requests[request.request_id]):
                del self.requests[request.request_id]
        return RequestOutput(
            request.request_id,
            token_ids,
            text,
            logprobs,
            request.status.finish_reason if final else None,
            request.num_prompt_tokens,
            request.num_output_tokens,
            index=request.index,
            prefilled=prefilled,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _stats(self, batch: list[Scheduled], ttfts: list[float], tpots: list[float]) -> StepStats:
        return StepStats(
            num_tokens=sum(s.num_tokens for s in batch),
            num_generated=sum(1 for s in batch if s.samples),
            ttfts=ttfts,
            tpots=tpots,
            threads=torch.get_num_threads(),
        )
