from __future__ import annotations

import pytest

from services.loadgen.synthetic import encode_image, random_image
from services.media.decode import BadImageError, check_count, decode_image
from services.media.limits import ImageLimits
from tests.bad_images import gif, png_header_only, truncated_png

LIMITS = ImageLimits(max_images=4, max_image_bytes=200_000, max_image_pixels=1000 * 1000)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_supported_formats_decode(fmt: str) -> None:
    image = decode_image(encode_image(random_image(40, 30), fmt), 0, LIMITS)
    assert image.size == (40, 30)
    assert image.mode == "RGB"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "image 2: empty image data"),
        (b"not an image at all", "image 2: not a valid image"),
        (truncated_png(), "image 2: corrupt or truncated image"),
        (gif(), "image 2: format GIF is not supported"),
        (png_header_only(0, 10), "image 2: not a valid image"),
        (
            png_header_only(2000, 2000),
            "image 2: 2000x2000 = 4000000 pixels exceeds the limit of 1000000",
        ),
        (
            png_header_only(40000, 40000),
            "image 2: declared size exceeds the limit of 1000000 pixels",
        ),
        (b"\x89PNG" + b"\0" * 300_000, "image 2: 300004 bytes exceeds the limit of 200000 bytes"),
    ],
)
def test_bad_images_name_the_image_and_the_problem(data: bytes, message: str) -> None:
    with pytest.raises(BadImageError) as info:
        decode_image(data, 2, LIMITS)
    assert str(info.value).startswith(message)
    assert info.value.index == 2


def test_too_many_images() -> None:
    check_count(4, LIMITS)
    with pytest.raises(BadImageError, match="too many images: 5 > limit of 4"):
        check_count(5, LIMITS)
