"""The encoder's one door to Triton: the `vit` model over tritonclient.grpc.aio.

Tensor names and dtypes follow model_repository/vit/config.pbtxt. With Triton
on the same host, inputs and outputs travel through system shared memory:
a few slots, each an input and an output region registered once and grown on
demand, so concurrent encodes still reach Triton together and get batched.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import tritonclient.grpc.aio as triton_grpc
import tritonclient.utils.shared_memory as triton_shm
from tritonclient.utils import InferenceServerException

from services import env

PIXELS, GRIDS = "pixel_values", "image_grid_thw"
EMBEDS, DEEPSTACK = "image_embeds", "deepstack_embeds"
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
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
    embeddings: torch.Tensor  # [tokens, hidden] float32
    deepstack: torch.Tensor | None  # [tokens, levels * hidden]


class _ShmSlot:
    """An input and an output region registered with Triton, grown when too small."""

    def __init__(self, prefix: str, index: int) -> None:
        self.input_name = f"{prefix}_in{index}"
        self.output_name = f"{prefix}_out{index}"
        self.input: Any = None
        self.output: Any = None
        self.input_bytes = 0
        self.output_bytes = 0

    async def ensure(
        self, client: triton_grpc.InferenceServerClient, in_bytes: int, out_bytes: int
    ) -> None:
        if in_bytes > self.input_bytes:
            self.input = await self._grow(client, self.input_name, self.input, in_bytes)
            self.input_bytes = in_bytes
        if out_bytes > self.output_bytes:
            self.output = await self._grow(client, self.output_name, self.output, out_bytes)
            self.output_bytes = out_bytes

    async def _grow(
        self, client: triton_grpc.InferenceServerClient, name: str, old: Any, size: int
    ) -> Any:
        if old is not None:
            await client.unregister_system_shared_memory(name)
            triton_shm.destroy_shared_memory_region(old)
        region = triton_shm.create_shared_memory_region(name, "/" + name, size, create_only=True)
        await client.register_system_shared_memory(name, "/" + name, size)
        return region

    async def reregister(self, client: triton_grpc.InferenceServerClient) -> None:
        """After a Triton restart its registrations are gone; the regions are not."""
        for name, size in (
            (self.input_name, self.input_bytes),
            (self.output_name, self.output_bytes),
        ):
            if size:
                await client.register_system_shared_memory(name, "/" + name, size)

    async def release(self, client: triton_grpc.InferenceServerClient) -> None:
        for name, region in ((self.input_name, self.input), (self.output_name, self.output)):
            if region is None:
                continue
            with contextlib.suppress(InferenceServerException):  # Triton may be gone already
                await client.unregister_system_shared_memory(name)
            triton_shm.destroy_shared_memory_region(region)
        self.input = self.output = None
        self.input_bytes = self.output_bytes = 0


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
            ],
        )
        prefix = f"{env.SHM_PREFIX.get()}vit_{secrets.token_hex(4)}"
        self._all_slots = [_ShmSlot(prefix, i) for i in range(max_in_flight)]
        self._slots: asyncio.Queue[_ShmSlot] = asyncio.Queue()
        for slot in self._all_slots:
            self._slots.put_nowait(slot)

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.model_name, client_timeout=5.0))
        except InferenceServerException:
            return False

    async def infer(self, pixel_values: np.ndarray, grids: np.ndarray) -> VitOutput:
        """One Triton request for these images' patches; embeddings for all their tokens."""
        num_tokens = int(np.prod(grids, axis=-1).sum()) // (self.merge_size**2)
        slot = await self._slots.get()
        try:
            try:
                return await self._infer(slot, pixel_values, grids, num_tokens)
            except InferenceServerException as exc:
                if self.shared_memory and "shared memory region" in str(exc):
                    await slot.reregister(self._client)
                    return await self._infer(slot, pixel_values, grids, num_tokens)
                raise
        except InferenceServerException as exc:
            if str(exc.status()) in _TRANSPORT_FAILURES:
                raise TritonUnavailableError(f"Triton at {self.url}: {exc.message()}") from None
            raise TritonRequestError(f"Triton model {self.model_name}: {exc.message()}") from None
        finally:
            self._slots.put_nowait(slot)

    async def _infer(
        self, slot: _ShmSlot, pixel_values: np.ndarray, grids: np.ndarray, num_tokens: int
    ) -> VitOutput:
        # The leading 1 is this request's batch dimension (max_batch_size > 0).
        pixels = pixel_values.astype(np.float32, copy=False)[None]
        grid = grids.astype(np.int64, copy=False)[None]
        inputs = [
            triton_grpc.InferInput(PIXELS, list(pixels.shape), "FP32"),
            triton_grpc.InferInput(GRIDS, list(grid.shape), "INT64"),
        ]
        names = [EMBEDS] + ([DEEPSTACK] if self.deepstack_levels else [])
        widths = [self.hidden_size, self.deepstack_levels * self.hidden_size]
        outputs = [triton_grpc.InferRequestedOutput(n) for n in names]
        if not self.shared_memory:
            inputs[0].set_data_from_numpy(pixels)
            inputs[1].set_data_from_numpy(grid)
            result = await self._client.infer(
                self.model_name, inputs, outputs=outputs, client_timeout=self.timeout_s
            )
            arrays = [result.as_numpy(n) for n in names]
            tensors = [torch.from_numpy(a.reshape(num_tokens, -1).copy()) for a in arrays]
        else:
            sizes = [num_tokens * w * 4 for w in widths[: len(names)]]
            await slot.ensure(self._client, pixels.nbytes + grid.nbytes, sum(sizes))
            await asyncio.to_thread(triton_shm.set_shared_memory_region, slot.input, [pixels, grid])
            inputs[0].set_shared_memory(slot.input_name, pixels.nbytes, 0)
            inputs[1].set_shared_memory(slot.input_name, grid.nbytes, pixels.nbytes)
            offsets = [0, sizes[0]]
            for out, size, offset in zip(outputs, sizes, offsets, strict=False):
                out.set_shared_memory(slot.output_name, size, offset)
            await self._client.infer(
                self.model_name, inputs, outputs=outputs, client_timeout=self.timeout_s
            )
            tensors = [
                torch.from_numpy(
                    triton_shm.get_contents_as_numpy(
                        slot.output, np.float32, [num_tokens, width], offset
                    ).copy()
                )
                for width, offset in zip(widths, offsets, strict=False)
                if width
            ]
        return VitOutput(tensors[0], tensors[1] if len(tensors) > 1 else None)

    async def statistics(self) -> dict[str, Any]:
        stats = await self._client.get_inference_statistics(self.model_name, as_json=True)
        result: dict[str, Any] = stats["model_stats"][0]
        return result

    async def close(self) -> None:
        for slot in self._all_slots:
            await slot.release(self._client)
        await self._client.close()
