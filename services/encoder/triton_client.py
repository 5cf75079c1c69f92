"""The encoder's one door to Triton: the `vit` model over tritonclient.grpc.aio.

Tensor names and dtypes follow model_repository/vit/config.pbtxt. With Triton
on the same host, inputs and outputs travel through system shared memory:
a few slots, each an input and an output region registered once and grown on
demand, so concurrent encodes still reach Triton together and get batched.

A traced infer goes over Triton's HTTP endpoint when its address is given
(tritonclient.http.aio, the same regions): Triton's gRPC server reads a
request's `traceparent` past its end (GrpcServerCarrier::Get hands the W3C
propagator a string_ref's data as a C string, through 2.73), so about one
traced gRPC infer in three started a trace of its own instead of joining the
encoder's; its HTTP server reads the header whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import torch
import tritonclient.grpc.aio as triton_grpc
import tritonclient.http.aio as triton_http
import tritonclient.utils.shared_memory as triton_shm
from tritonclient.utils import InferenceServerException

from services.runtime import env, tracing
from services.runtime.grpc_server import KEEPALIVE_OPTIONS
from services.transfer.shared_memory import SHM_DIR

PIXELS, GRIDS = "pixel_values", "image_grid_thw"
EMBEDS, DEEPSTACK = "image_embeds", "deepstack_embeds"
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
CONTROL_TIMEOUT_S = 5.0  # registering a region, asking for readiness
IN_USE = "currently in use"  # Triton's refusal to unregister a region a request holds
GROW_PATIENCE_S = 1.0  # a grown slot's old region: Triton lets go of it after the reply
_TRANSPORT_FAILURES = (
    "StatusCode.UNAVAILABLE",
    "StatusCode.DEADLINE_EXCEEDED",
    "StatusCode.CANCELLED",
)


class TritonUnavailableError(RuntimeError):
    """Triton cannot be reached, or did not answer in time."""


class TritonRequestError(RuntimeError):
    """Triton answered this request with an error."""


@dataclass(frozen=True, slots=True)
class VitOutput:
    planes: tuple[torch.Tensor, ...]  # [tokens, width] float32: embeddings, then deepstack


@dataclass(slots=True)
class _Region:
    """A system shared-memory region this process created, under its Triton name."""

    name: str
    handle: Any
    size: int

    @classmethod
    def create(cls, name: str, size: int) -> _Region:
        return cls(name, triton_shm.create_shared_memory_region(name, "/" + name, size, True), size)

    def destroy(self) -> None:
        """Best effort: whatever stops the library's cleanup, the name is unlinked."""
        with contextlib.suppress(Exception):
            triton_shm.destroy_shared_memory_region(self.handle)
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / self.name).unlink()


async def unregister(
    client: triton_grpc.InferenceServerClient, name: str, patience_s: float = 0.0
) -> None:
    """Unregisters a region, trying again for up to `patience_s` while Triton
    refuses because an inference holds it ("it is currently in use"). Triton
    lets go of a request's regions just after its reply has gone out: a slot
    grown right after its last request would otherwise stay mapped in Triton."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    while True:
        try:
            await client.unregister_system_shared_memory(name, client_timeout=CONTROL_TIMEOUT_S)
            return
        except InferenceServerException as exc:
            if IN_USE not in str(exc) or loop.time() >= deadline:
                raise
        await asyncio.sleep(0.01)


async def unregister_each(client: triton_grpc.InferenceServerClient, names: list[str]) -> list[str]:
    """Unregisters each region; the names gone from Triton now. One an inference
    still holds, or any while Triton is out of reach, stays for a later try; any
    other refusal means Triton no longer has it."""
    gone = []
    for name in names:
        try:
            await unregister(client, name)
        except InferenceServerException as exc:
            if IN_USE in str(exc) or str(exc.status()) in _TRANSPORT_FAILURES:
                continue
        gone.append(name)
    return gone


class _ShmSlot:
    """An input and an output region, registered with Triton, for one request at a time.

    A region that must grow is replaced by a new one under a fresh name; after
    any failure the slot is reset (both regions dropped, best effort) and made
    anew on its next use. No half-finished step can leave a name behind that
    the next use collides with. A region Triton would not let go of when it was
    dropped (a timed-out request it still runs) is unregistered on a later use."""

    def __init__(self, prefix: str, index: int) -> None:
        self._prefix = f"{prefix}_s{index}"
        self._generation = 0
        self.input: _Region | None = None
        self.output: _Region | None = None
        self.registered = False
        self.held_by_triton: list[str] = []  # dropped, but still registered at Triton

    def _new(self, kind: str, size: int) -> _Region:
        self._generation += 1
        return _Region.create(f"{self._prefix}_{kind}{self._generation}", size)

    async def ensure(
        self, client: triton_grpc.InferenceServerClient, in_bytes: int, out_bytes: int
    ) -> tuple[_Region, _Region]:
        """Regions of at least these sizes, registered with Triton."""
        await self.let_go(client)
        if self.input is None or self.input.size < in_bytes:
            await self._drop(client, self.input, GROW_PATIENCE_S)
            self.input, self.registered = None, False
            self.input = self._new("in", in_bytes)
        if self.output is None or self.output.size < out_bytes:
            await self._drop(client, self.output, GROW_PATIENCE_S)
            self.output, self.registered = None, False
            self.output = self._new("out", out_bytes)
        if not self.registered:
            for region in (self.input, self.output):
                await client.register_system_shared_memory(
                    region.name, "/" + region.name, region.size, client_timeout=CONTROL_TIMEOUT_S
                )
            self.registered = True
        return self.input, self.output

    async def _drop(
        self,
        client: triton_grpc.InferenceServerClient,
        region: _Region | None,
        patience_s: float = 0.0,
    ) -> None:
        if region is None:
            return
        try:
            await unregister(client, region.name, patience_s)
        except InferenceServerException as exc:  # Triton may be gone, or still using it
            if IN_USE in str(exc):
                self.held_by_triton.append(region.name)
        region.destroy()

    async def let_go(self, client: triton_grpc.InferenceServerClient) -> None:
        """Unregisters the regions Triton still held when they were dropped, as far
        as it has let go of them since (its mapping kept their memory alive)."""
        for name in await unregister_each(client, list(self.held_by_triton)):
            self.held_by_triton.remove(name)

    async def reset(self, client: triton_grpc.InferenceServerClient) -> None:
        """Forgets both regions: the next use creates and registers new ones."""
        regions, (self.input, self.output) = (self.input, self.output), (None, None)
        self.registered = False
        for region in regions:
            await self._drop(client, region)


class VitClient:
    def __init__(
        self,
        url: str,
        hidden_size: int,
        deepstack_levels: int = 0,
        merge_size: int = 2,
        model_name: str = "vit",
        shared_memory: bool = True,
        timeout_s: float = 60.0,
        max_in_flight: int = 8,
        http_url: str = "",
    ) -> None:
        self.url = url
        self.model_name = model_name
        self.hidden_size = hidden_size
        self.deepstack_levels = deepstack_levels
        self.merge_size = merge_size
        self.shared_memory = shared_memory
        self.timeout_s = timeout_s
        self._client = triton_grpc.InferenceServerClient(
            url,
            channel_args=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                # a frozen Triton fails its calls in ~8 s, not at their deadline
                # (the launcher lets Triton take these pings)
                *KEEPALIVE_OPTIONS,
                # gRPC's reconnect backoff grows to 120 s: a Triton that comes up
                # (or back) later than the encoder would be seen seconds late
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        # for traced infers (see the module's docstring); "": every infer over gRPC
        self._http = (
            triton_http.InferenceServerClient(http_url, conn_timeout=timeout_s)
            if http_url
            else None
        )
        self._family = f"{env.SHM_PREFIX.get()}vit_"  # every encoder's under this prefix
        self.shm_prefix = f"{self._family}{secrets.token_hex(4)}"
        # Where that prefix is this encoder's alone, what a killed predecessor left
        # registered at Triton is its to unregister (reclaim), until none is left.
        self.reclaiming = shared_memory and env.SHM_RECLAIM.get()
        self._all_slots = [_ShmSlot(self.shm_prefix, i) for i in range(max_in_flight)]
        self._slots: asyncio.Queue[_ShmSlot] = asyncio.Queue()
        for slot in self._all_slots:
            self._slots.put_nowait(slot)

    async def ready(self) -> bool:
        try:
            return bool(
                await self._client.is_model_ready(self.model_name, client_timeout=CONTROL_TIMEOUT_S)
            )
        except InferenceServerException:
            return False

    async def infer(self, pixel_values: np.ndarray, grids: np.ndarray) -> VitOutput:
        """One Triton request for these images' patches; embeddings for all their tokens.

        The request runs to its end on its own task even if the caller is
        cancelled: Triton may still read and write the slot's regions, so the
        slot returns to the pool only when the request is over."""
        num_tokens = int(np.prod(grids, axis=-1).sum()) // (self.merge_size**2)
        slot = await self._slots.get()
        task = asyncio.ensure_future(self._infer_in(slot, pixel_values, grids, num_tokens))
        task.add_done_callback(lambda done: self._release(slot, done))
        return await asyncio.shield(task)

    def _release(self, slot: _ShmSlot, task: asyncio.Future[VitOutput]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved here when the caller left before the end
        self._slots.put_nowait(slot)

    async def _infer_in(
        self, slot: _ShmSlot, pixel_values: np.ndarray, grids: np.ndarray, num_tokens: int
    ) -> VitOutput:
        try:
            try:
                return await self._infer(slot, pixel_values, grids, num_tokens)
            except InferenceServerException as exc:
                if not self.shared_memory or "shared memory region" not in str(exc):
                    raise
                # Triton restarted and forgot the registrations: make the slot anew.
                await slot.reset(self._client)
                return await self._infer(slot, pixel_values, grids, num_tokens)
        except InferenceServerException as exc:
            await slot.reset(self._client)
            if str(exc.status()) in _TRANSPORT_FAILURES:
                raise TritonUnavailableError(f"Triton at {self.url}: {exc.message()}") from None
            raise TritonRequestError(f"Triton model {self.model_name}: {exc.message()}") from None
        except (aiohttp.ClientError, TimeoutError) as exc:  # a traced infer's, over HTTP
            await slot.reset(self._client)
            raise TritonUnavailableError(f"Triton at {self.url}: {exc!r}") from None
        except BaseException:
            await slot.reset(self._client)
            raise

    async def _infer(
        self, slot: _ShmSlot, pixel_values: np.ndarray, grids: np.ndarray, num_tokens: int
    ) -> VitOutput:
        # The leading 1 is this request's batch dimension (max_batch_size > 0).
        pixels = pixel_values.astype(np.float32, copy=False)[None]
        grid = grids.astype(np.int64, copy=False)[None]
        api, infer = self._client_for(tracing.outgoing())
        inputs = [
            api.InferInput(PIXELS, list(pixels.shape), "FP32"),
            api.InferInput(GRIDS, list(grid.shape), "INT64"),
        ]
        names = [EMBEDS] + ([DEEPSTACK] if self.deepstack_levels else [])
        widths = [self.hidden_size, self.deepstack_levels * self.hidden_size]
        outputs = [api.InferRequestedOutput(n) for n in names]
        if not self.shared_memory:
            inputs[0].set_data_from_numpy(pixels)
            inputs[1].set_data_from_numpy(grid)
            result = await infer(inputs, outputs=outputs)
            arrays = [result.as_numpy(n) for n in names]
            tensors = [torch.from_numpy(a.reshape(num_tokens, -1).copy()) for a in arrays]
        else:
            sizes = [num_tokens * w * 4 for w in widths[: len(names)]]
            region_in, region_out = await slot.ensure(
                self._client, pixels.nbytes + grid.nbytes, sum(sizes)
            )
            await asyncio.to_thread(
                triton_shm.set_shared_memory_region, region_in.handle, [pixels, grid]
            )
            inputs[0].set_shared_memory(region_in.name, pixels.nbytes, 0)
            inputs[1].set_shared_memory(region_in.name, grid.nbytes, pixels.nbytes)
            offsets = [0, sizes[0]]
            for out, size, offset in zip(outputs, sizes, offsets, strict=False):
                out.set_shared_memory(region_out.name, size, offset)
            await infer(inputs, outputs=outputs)
            tensors = [
                torch.from_numpy(
                    triton_shm.get_contents_as_numpy(
                        region_out.handle, np.float32, [num_tokens, width], offset
                    ).copy()
                )
                for width, offset in zip(widths, offsets, strict=False)
                if width
            ]
        return VitOutput(tuple(tensors))

    def _client_for(self, headers: dict[str, str]) -> tuple[Any, Callable[..., Awaitable[Any]]]:
        """The client module and the infer call for a request whose trace headers
        these are (Triton joins the trace where it traces): over HTTP when traced
        and Triton's HTTP endpoint is known (its gRPC server misreads a
        traceparent), else over gRPC."""
        if headers and self._http is not None:
            traced = functools.partial(self._http.infer, self.model_name, headers=headers)
            return triton_http, traced
        infer = functools.partial(
            self._client.infer,
            self.model_name,
            client_timeout=self.timeout_s,
            headers=headers or None,
        )
        return triton_grpc, infer

    async def reclaim(self) -> bool:
        """Unregisters the regions Triton holds under this encoder's prefix but not
        its own: a killed predecessor's, whose memory Triton's mappings keep alive
        until they are unregistered. Only where EPD_SHM_PREFIX is this encoder's
        alone (EPD_SHM_RECLAIM). True once none is left (`reclaiming` is then
        over); False while Triton is out of reach or a predecessor's inference it
        still runs holds one."""
        try:
            status = await self._client.get_system_shared_memory_status(
                client_timeout=CONTROL_TIMEOUT_S
            )
            theirs = [
                name
                for name in status.regions
                if name.startswith(self._family) and not name.startswith(self.shm_prefix + "_")
            ]
        except InferenceServerException:
            return False
        self.reclaiming = len(await unregister_each(self._client, theirs)) < len(theirs)
        return not self.reclaiming

    async def statistics(self) -> dict[str, Any]:
        stats = await self._client.get_inference_statistics(self.model_name, as_json=True)
        result: dict[str, Any] = stats["model_stats"][0]
        return result

    async def close(self) -> None:
        for slot in self._all_slots:
            await slot.reset(self._client)
            await slot.let_go(self._client)
        await self._client.close()
        if self._http is not None:
            await self._http.close()
