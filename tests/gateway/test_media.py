"""Image loading in the gateway: data: URLs, remote URLs and their guards."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator

import pytest

from services.gateway.errors import ApiError
from services.gateway.media import FetchPolicy, MediaLoader
from services.loadgen.synthetic import encode_image, random_image, random_video
from services.media.limits import ImageLimits
from services.model.processor import ImageTokenRule
from services.model.video import VideoRule, probe
from tests.bad_images import png_header_only

pytestmark = pytest.mark.asyncio(loop_scope="session")

LIMITS = ImageLimits(
    max_images=3,
    max_image_bytes=300_000,
    max_image_pixels=1000 * 1000,
    max_video_bytes=200_000,
    max_video_seconds=20,
    max_video_frames=150,
    max_video_pixels=320 * 240,
)
PNG = encode_image(random_image(300, 200, seed=1))
MP4 = random_video(num_frames=30, width=64, height=48, fps=10)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        routes = {
            "/image.png": (200, {"Content-Type": "image/png"}, PNG),
            "/clip.mp4": (200, {"Content-Type": "video/mp4"}, MP4),
            "/redirect": (302, {"Location": "/image.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/missing": (404, {}, b""),
            "/huge": (200, {}, b"\0" * 400_000),
        }
        status, headers, body = routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def loader(allow_private: bool = False) -> MediaLoader:
    return MediaLoader(
        LIMITS,
        FetchPolicy(timeout_s=5, allow_private=allow_private),
        ImageTokenRule(),
        VideoRule(),
    )


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def test_data_url_gives_size_and_token_hint() -> None:
    image = await loader().load(data_url(PNG), 0)
    assert (image.width, image.height) == (300, 200)
    assert image.token_hint == ImageTokenRule().num_tokens(200, 300)
    assert image.data == PNG


async def test_remote_url_when_private_addresses_are_allowed(image_server: str) -> None:
    assert (await loader(True).load(f"{image_server}/image.png", 0)).data == PNG
    assert (await loader(True).load(f"{image_server}/redirect", 0)).data == PNG


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:9/x.png", "non-public address (127.0.0.1)"),
        ("http://localhost/x.png", "non-public address"),
        ("http://10.1.2.3/x.png", "non-public address (10.1.2.3)"),
        ("http://169.254.169.254/latest/meta-data", "non-public address (169.254.169.254)"),
        ("http://[::1]/x.png", "non-public address (::1)"),
        ("ftp://example.com/x.png", "must be data:, http: or https: URLs"),
        ("data:image/png,notbase64", "data URLs must be base64"),
        ("data:image/png;base64,@@@", "invalid base64"),
    ],
)
async def test_refused_urls(url: str, message: str) -> None:
    with pytest.raises(ApiError) as info:
        await loader().load(url, 1)
    assert info.value.status == 400
    assert info.value.message.startswith("image 1:")
    assert message in info.value.message


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/loop", "more than 3 redirects"),
        ("/missing", "returned HTTP 404"),
        ("/huge", "more than the limit of 300000 bytes"),
    ],
)
async def test_remote_failures(image_server: str, path: str, message: str) -> None:
    with pytest.raises(ApiError) as info:
        await loader(True).load(image_server + path, 0)
    assert message in info.value.message


async def test_image_checks_apply_to_urls() -> None:
    with pytest.raises(ApiError, match="exceeds the limit of 1000000 pixels"):
        await loader().load(data_url(png_header_only(2000, 2000)), 0)
    with pytest.raises(ApiError, match=r"too many images: 4 > limit of 3"):
        await loader().load_all([data_url(PNG)] * 4)


def video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


async def test_videos_from_data_and_remote_urls_get_their_hint_from_the_header(
    image_server: str,
) -> None:
    kinds = ["image", "video", "video"]
    urls = [data_url(PNG), video_url(MP4), f"{image_server}/clip.mp4"]
    image, *videos = await loader(True).load_all(urls, kinds)
    hint = VideoRule().num_tokens(probe(MP4))
    assert [(v.width, v.height, v.token_hint, v.data) for v in videos] == [(64, 48, hint, MP4)] * 2
    assert image.token_hint == ImageTokenRule().num_tokens(200, 300)


@pytest.mark.parametrize(
    ("video", "message"),
    [
        (b"", "video 1: empty video data"),
        (b"no container here" * 10, "video 1: cannot read the video"),
        (random_video(num_frames=1), "video 1: the video has 1 frames; at least 2 are needed"),
        (random_video(num_frames=21, fps=1), "video 1: 21.0 s exceeds the limit of 20 seconds"),
        (
            random_video(num_frames=151, fps=30),
            "video 1: 151 frames exceeds the limit of 150 frames",
        ),
        (
            random_video(num_frames=2, width=336, height=240),
            "video 1: 336x240 = 80640 pixels a frame exceeds the limit of 76800 pixels",
        ),
        (MP4 * 50, "video 1: more than the limit of 200000 bytes"),
    ],
    ids=["empty", "garbage", "one-frame", "too-long", "too-many-frames", "too-large", "bytes"],
)
async def test_video_limits_are_400s_that_name_them(video: bytes, message: str) -> None:
    with pytest.raises(ApiError) as info:
        await loader().load(video_url(video), 1, "video")
    assert info.value.status == 400
    assert message in info.value.message
