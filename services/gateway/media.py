"""Loading the images and videos of a chat request: data: URLs and remote
http(s) URLs, checked against the limits from their headers alone.

Remote fetches have a timeout and a byte cap, follow redirects only after
checking each target, and refuse loopback, private, link-local and other
non-global addresses unless explicitly allowed. The connection goes to the
address that was checked (Host header and TLS SNI keep the name), so DNS
cannot swap in a private address after the check.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from services.gateway.config import FetchPolicy
from services.gateway.errors import ApiError
from services.media.decode import BadImageError, inspect_image, inspect_video
from services.media.limits import ImageLimits
from services.model.processor import ImageTokenRule
from services.model.video import VideoRule
from services.wire.messages import MediaGrid


@dataclass(frozen=True, slots=True)
class LoadedMedia:
    data: bytes
    width: int
    height: int
    grid: MediaGrid | None  # the grid the encoder will make of it (None: no rule is known)
    token_hint: int  # its tokens (0: no rule is known)


def _bad(index: int, reason: str, kind: str = "image") -> ApiError:
    return ApiError(400, f"{kind} {index}: {reason}", param="messages")


class MediaLoader:
    """Images and videos (`kind` "video"; indices count both, in request order)."""

    def __init__(
        self,
        limits: ImageLimits,
        policy: FetchPolicy,
        rule: ImageTokenRule | None,
        video_rule: VideoRule | None = None,
    ) -> None:
        self.limits = limits
        self.policy = policy
        self.rule = rule
        self.video_rule = video_rule
        self._client = httpx.AsyncClient(follow_redirects=False, timeout=policy.timeout_s)

    async def close(self) -> None:
        await self._client.aclose()

    async def load_all(self, urls: list[str], kinds: list[str] | None = None) -> list[LoadedMedia]:
        """`kinds`: "image" or "video" per URL (default: all images)."""
        if len(urls) > self.limits.max_images:
            raise ApiError(
                400,
                f"too many images: {len(urls)} > limit of {self.limits.max_images} "
                "(images and videos)",
                param="messages",
            )
        kinds = kinds or ["image"] * len(urls)
        return list(
            await asyncio.gather(
                *(self.load(u, i, k) for i, (u, k) in enumerate(zip(urls, kinds, strict=True)))
            )
        )

    async def load(self, url: str, index: int, kind: str = "image") -> LoadedMedia:
        cap = self.limits.max_video_bytes if kind == "video" else self.limits.max_image_bytes
        if url.startswith("data:"):
            data = self._decode_data_url(url, index, kind, cap)
        else:
            try:
                async with asyncio.timeout(self.policy.timeout_s):
                    data = await self._fetch(url, index, kind, cap)
            except TimeoutError:
                raise _bad(
                    index, f"fetching {url} took longer than {self.policy.timeout_s:.0f}s", kind
                ) from None
        try:
            if kind == "video":  # PyAV reads the header: off the event loop
                info = await asyncio.to_thread(inspect_video, data, index, self.limits)
                width, height = info.width, info.height
                grid = self.video_rule.grid(info) if self.video_rule else None
                merge = self.video_rule.frame.merge_size if self.video_rule else 1
            else:
                width, height = inspect_image(data, index, self.limits)
                grid = self.rule.grid(height, width) if self.rule else None
                merge = self.rule.merge_size if self.rule else 1
        except BadImageError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        except ValueError as exc:  # the resize rule's aspect-ratio check, too few frames
            raise _bad(index, str(exc), kind) from None
        return LoadedMedia(data, width, height, grid, grid.num_tokens(merge) if grid else 0)

    def _decode_data_url(self, url: str, index: int, kind: str, cap: int) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise _bad(index, f"data URLs must be base64 (data:{kind}/...;base64,...)", kind)
        if len(payload) * 3 // 4 > cap:
            raise _bad(index, f"more than the limit of {cap} bytes", kind)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise _bad(index, "invalid base64 in data URL", kind) from None

    async def _checked_address(self, host: str, port: int, index: int, kind: str) -> str:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except socket.gaierror:
            raise _bad(index, f"cannot resolve host {host!r}", kind) from None
        except UnicodeError as exc:  # IDNA: a label over 63 characters, an empty label
            raise _bad(index, f"invalid host name {host[:80]!r}: {exc}", kind) from None
        addresses = [str(info[4][0]) for info in infos]
        if not self.policy.allow_private:
            for address in addresses:
                ip = ipaddress.ip_address(address)
                if not ip.is_global or ip.is_multicast:
                    raise _bad(
                        index,
                        f"URL host {host!r} resolves to a non-public address ({address}); "
                        "fetching it is not allowed",
                        kind,
                    )
        return addresses[0]

    async def _fetch(self, url: str, index: int, kind: str, cap: int) -> bytes:
        for _ in range(self.policy.max_redirects + 1):
            try:
                parts = urlsplit(url)
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError as exc:  # a port out of range, a broken IPv6 literal
                raise _bad(index, f"invalid {kind} URL: {exc}", kind) from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise _bad(index, f"{kind} URLs must be data:, http: or https: URLs", kind)
            address = await self._checked_address(parts.hostname, port, index, kind)
            literal = f"[{address}]" if ":" in address else address
            pinned = urlunsplit(
                (parts.scheme, f"{literal}:{port}", parts.path or "/", parts.query, "")
            )
            request = self._client.build_request(
                "GET",
                pinned,
                headers={"Host": parts.netloc},
                extensions={"sni_hostname": parts.hostname} if parts.scheme == "https" else {},
            )
            try:
                response = await self._client.send(request, stream=True)
            except httpx.TimeoutException:
                raise _bad(
                    index, f"fetching {url} timed out after {self.policy.timeout_s:.0f}s", kind
                ) from None
            except httpx.HTTPError as exc:
                raise _bad(index, f"cannot fetch {url}: {exc}", kind) from None
            try:
                if response.is_redirect:
                    url = urljoin(url, response.headers.get("location", ""))
                    continue
                if response.status_code != 200:
                    raise _bad(index, f"fetching {url} returned HTTP {response.status_code}", kind)
                return await self._read_capped(response, index, kind, cap)
            finally:
                await response.aclose()
        raise _bad(index, f"more than {self.policy.max_redirects} redirects", kind)

    async def _read_capped(
        self, response: httpx.Response, index: int, kind: str, cap: int
    ) -> bytes:
        if int(response.headers.get("content-length") or 0) > cap:
            raise _bad(index, f"more than the limit of {cap} bytes", kind)
        body = bytearray()
        try:
            async for piece in response.aiter_bytes():
                body += piece
                if len(body) > cap:
                    raise _bad(index, f"more than the limit of {cap} bytes", kind)
        except httpx.TimeoutException:
            raise _bad(
                index, f"fetching timed out after {self.policy.timeout_s:.0f}s", kind
            ) from None
        return bytes(body)
