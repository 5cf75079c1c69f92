"""LLMEngine: the loop `step()`: `scheduler.schedule() -> runner.execute() -> sample ->
postprocess()` over the model, its paged KV cache, the scheduler and the sampler,
stepped by one thread. The network it runs is built in services/layers/build.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from services.language.engine.config import EngineConfig, RequestChecks
from services.language.engine.detokenizer import IncrementalDetokenizer
from services.language.engine.grammar import Grammars
from services.language.engine.kv_cache import (
    KVBlockManager,
    KVCache,
    KVCacheConfig,
    KVMemory,
    PrefixPages,
    device_memory,
)
from services.language.engine.outputs import (
    EngineLoad,
    Prefilled,
    RequestOutput,
    StepStats,
    first_token,
    sample_of,
    token_logprob,
)
from services.language.engine.pacing import Pacing
from services.language.engine.request import Request, RequestStatus, new_request
from services.language.engine.runner import ModelRunner
from services.language.engine.sampler import Sample, Sampler, SamplingError
from services.language.engine.scheduler import Scheduled, Scheduler
from services.language.engine.vision import VisionTower
from services.layers.build import build_network
from services.model.spec import ModelSpec
from services.wire.messages import FirstToken
from services.wire.request import FinishReason, SamplingParams

logger = logging.getLogger(__name__)


def _mark_started(batch: list[Scheduled], now: float) -> None:
    """When each request first ran, and how many steps computed its prompt (what
    its trace shows as queue time and prefill chunks)."""
    for s in batch:
        request = s.request
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        if request.num_computed_tokens < request.num_prompt_tokens:
            request.num_prefill_steps += 1


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
        network = build_network(
            spec.text,
            weights,
            device,
            config.dtype,
            config.backends,
            config.scheduler.max_num_batched_tokens,
        )
        graphs = config.cuda_graphs and network.capturable
        kv_cache = KVCache(spec.text, kv_config, device, spare_pages=int(graphs), memory=kv_memory)
        self.runner = ModelRunner(network, kv_cache, device, config.decode_layers)
        if graphs:
            self.runner.use_graphs(config.scheduler.max_num_seqs, config.max_model_len)
        self.blocks = KVBlockManager(kv_config, config.prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.blocks, config.max_model_len)
        self.sampler = Sampler(set(spec.eos_token_ids))
        self.grammars = Grammars(tokenizer, spec)
        self.checks = RequestChecks(config, spec)
        self.requests: dict[str, list[Request]] = {}  # each request's choices
        self.held: dict[str, list[Request]] = {}  # PREFILLED choices, until `release`
        self.detokenizers: dict[tuple[str, int], IncrementalDetokenizer] = {}
        self.eos = set(spec.eos_token_ids)
        self.vision = vision
        self.pacing = Pacing(config)
        self._stalled = False  # the last step computed nothing, and no news came since

    def add_request(self, request: Request) -> list[RequestOutput]:
        """Queues a request. One that pins its prefix takes its cached pages now
        and is answered at once with the media tokens they cover, which it will
        not be sent (RequestOutput.num_media_held)."""
        self._stalled = False
        self._register(request)
        if request.moved_prefix is not None:
            self.adopt_prefix(request.moved_prefix, request.prefix_hashes)
            request.moved_prefix = None
        self.scheduler.add(request)
        if not request.pin_prefix:
            return []
        held = self.scheduler.pin(request)
        for choice in request.forks:
            choice.num_media_ready = choice.num_media_held = held
        answer = RequestOutput(request.request_id, [], "", [], None, request.num_prompt_tokens, 0)
        return [replace(answer, num_cached_tokens=request.num_computed_tokens, num_media_held=held)]

    def export_prefix(
        self, digests: Sequence[bytes], min_pages: int = 1, with_planes: bool = True
    ) -> PrefixPages:
        """The cached pages the digests begin with, for another instance
        (prefix_moves.py); none if fewer than `min_pages`. Without planes: only
        which they are (what a fetch need not bring).

        Callable from another thread while the loop steps (a busy instance's step
        may take a second): a cached page is full and never written, unless it is
        evicted and taken for other tokens, which drops its digest first; so a
        page that still has its digest once read was read whole."""
        size = self.blocks.page_size
        pages = self.blocks.leading_cached(digests)
        if not with_planes:
            return PrefixPages(tuple(digests[: len(pages)]), size)
        if not pages or len(pages) < min_pages:
            return PrefixPages((), size)
        planes = self.runner.kv_cache.read_pages(pages)
        hash_of = self.blocks.hash_of
        read = zip(pages, digests[: len(pages)], strict=True)
        kept = next((i for i, (p, d) in enumerate(read) if hash_of.get(p) != d), len(pages))
        if not kept or kept < min_pages:
            return PrefixPages((), size)
        rows = kept * size
        return PrefixPages(tuple(digests[:kept]), size, tuple(p[:rows] for p in planes))

    def adopt_prefix(self, moved: PrefixPages, keep: Sequence[bytes] = ()) -> None:
        """Pages another instance computed, into the prefix cache as if computed
        here: the request they came for (added next) takes them as a hit, after
        its pages this cache held (`keep`: their digests, kept)."""
        self._stalled = False
        if moved.page_size != self.blocks.page_size or not moved.num_pages:
            return
        adopted = self.blocks.adopt(moved.digests, keep)
        if not adopted:
            return
        planes = moved.planes
        if len(adopted) < moved.num_pages:  # some were here already: only the others' rows
            size = moved.page_size
            index = torch.cat([torch.arange(i * size, (i + 1) * size) for i, _ in adopted])
            planes = tuple(p[index] for p in planes)
        self.runner.kv_cache.write_pages([page for _, page in adopted], planes)
        self.blocks.cache_adopted(moved.digests, adopted)

    def _register(self, request: Request) -> None:
        """Its choices, and a detokenizer each."""
        self.checks.check(request)
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
            if first.generator_state and choice.generator is not None:
                choice.generator.set_state(
                    torch.frombuffer(bytearray(first.generator_state), dtype=torch.uint8)
                )
            self.scheduler.add(choice)
        for choice, first in zip(choices, firsts, strict=True):
            try:
                outputs.append(self._advance(choice, sample_of(first), now, [], []))
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
        """Seconds to hold the next step (Pacing.delay)."""
        return self.pacing.delay(self.scheduler.has_prefill_work(), self.scheduler.running)

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
        with self.runner.tuning():
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
        """One step of the request lifecycle (docs/architecture.md, step 8):
        schedule, execute, sample, postprocess."""
        self._encode_pixels()
        held, unmet = self.pacing.take_held(), self.pacing.take_unmet()
        batch, lost, stats = self._schedule()
        if held or unmet:  # what the pacing cost the step, and each request (for its trace)
            stats = replace(stats, held_s=held, pacing_unmet=unmet)
            for s in batch:
                s.request.held_seconds += held
        outputs: list[RequestOutput] = []
        started, scheduled = time.monotonic(), batch
        if batch:
            logits = self.runner.execute(batch)
            batch, logits = self._fork(batch, logits)
            samples = self.sampler.sample(logits, [s.request for s in batch if s.samples])
            outputs, stats = self.postprocess(batch, samples, stats)
        self.pacing.ended(time.monotonic() - started, scheduled)
        return lost + outputs, stats

    def _encode_pixels(self) -> None:
        """The monolithic baseline's tower encodes the waiting requests' images,
        on the threads of a prompt step."""
        if self.vision is not None:
            self.pacing.set_threads()
            self.vision.encode_pending(self.scheduler.waiting)

    def _schedule(self) -> tuple[list[Scheduled], list[RequestOutput], StepStats]:
        """This step's batch (its pages' pending copies made, its threads set), the
        requests it lost, and what it took from the prefix cache. A step that
        computes nothing and changes nothing stalls the engine until news."""
        hits, media_hits = self.blocks.num_hit_tokens, self.blocks.num_hit_media_tokens
        preemptions = self.scheduler.num_preemptions
        batch = ModelRunner.order(self.scheduler.schedule())
        self.pacing.set_threads(batch)
        _mark_started(batch, time.monotonic())
        lost = [
            self._fail(
                r,
                "KV pages ran out on this decode instance, and a request whose "
                "images were prefilled elsewhere cannot be recomputed here",
            )
            for r in self.scheduler.take_lost()
        ]
        self.runner.kv_cache.copy_pages(self.blocks.take_copies())
        if not batch:
            self._stalled = not lost and preemptions == self.scheduler.num_preemptions
        stats = StepStats(
            0,
            0,
            [],
            [],
            num_cached_tokens=self.blocks.num_hit_tokens - hits,
            num_cached_media_tokens=self.blocks.num_hit_media_tokens - media_hits,
            threads=torch.get_num_threads(),
        )
        return batch, lost, stats

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
        self, batch: list[Scheduled], samples: list[Sample | SamplingError], stats: StepStats
    ) -> tuple[list[RequestOutput], StepStats]:
        """Each request's computed tokens counted and cached, its sample taken (or
        its failure), and the step's figures added to `stats`."""
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
        stats = replace(
            stats,
            num_tokens=sum(s.num_tokens for s in batch),
            num_generated=sum(1 for s in batch if s.samples),
            ttfts=ttfts,
            tpots=tpots,
        )
        return outputs, stats

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
        logprobs = [token_logprob(s, detok.token_text) for s in samples if s.logprob is not None]
        text = detok.take(final)
        prefilled = None
        if request.status is RequestStatus.PREFILLED:
            first = first_token(samples[0], request.generator)
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
