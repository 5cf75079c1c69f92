"""Malformed and hostile images for the bad-input tests."""

from __future__ import annotations

import struct
import zlib

from services.loadgen.synthetic import encode_image, random_image


def png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG that declares width x height (a decompression bomb when large)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def truncated_png() -> bytes:
    data = encode_image(random_image(64, 48))
    return data[: len(data) // 2]


def gif() -> bytes:
    return encode_image(random_image(20, 20), "GIF")
