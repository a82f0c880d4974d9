"""Images in chat messages (gateway/images.py): every refusal is a 400 naming the part; data URLs are
always taken, http(s) URLs only from allow-listed hosts (fetched with a timeout, a size cap and no
redirect off the list); each image counts as the tokens the engine prefills for it.

Remote fetches go to an HTTP server the test runs on 127.0.0.1; the view tests run the real gateway
(catalog, tokenizer, quota scripts on Redis) with no worker."""

import base64
import http.server
import io
import json
import threading

import pytest
from django.test import Client
from PIL import Image

from catalog import selectors
from catalog.models import ServedModel
from contract.protocol import RequestInput
from gateway import images
from gateway.errors import InvalidRequest
from gateway.validation import chat_request
from workers.images import decode_images

MM_MODEL, TEXT_MODEL = "tiny-gemma4-mm", "tiny-gemma4"
GEOMETRY = images.VisionGeometry(patch=16, pooling=3, max_soft_tokens=70)


def _png(width=64, height=48, color=(200, 10, 10), format="PNG", mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (width, height), color if mode == "RGB" else 0).save(out, format=format)
    return out.getvalue()


def _data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def _chat(*parts, role="user", messages_before=()) -> dict:
    return {"model": "m", "messages": [*messages_before, {"role": role, "content": list(parts)}]}


def _refusal(body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as error:
        chat_request(body)
    assert error.value.status == 400
    return error.value


# 1. The parts' shape (validation, no I/O).


def test_text_only_parts_are_still_joined_into_one_string():
    request = chat_request(_chat({"type": "text", "text": "a"}, {"type": "text", "text": "b"}))
    assert request.messages[0]["content"] == "ab"


def test_an_image_part_becomes_an_image_part_for_the_chat_template():
    data = _png()
    request = chat_request(_chat({"type": "text", "text": "what is it?"}, _image_part(_data_url(data), detail="low")))
    text, image = request.messages[0]["content"]
    assert text == {"type": "text", "text": "what is it?"}
    assert image["type"] == "image" and image["image"].data == data
    assert image["image"].param == "messages[0].content[1]"


@pytest.mark.parametrize(
    ("part", "param", "code"),
    [
        ({"type": "image_url"}, "messages[1].content[0].image_url", "invalid_value"),
        ({"type": "image_url", "image_url": {"url": ""}}, "messages[1].content[0].image_url", "invalid_value"),
        (_image_part("data:image/png;base64,AAAA", x=1), "messages[1].content[0].image_url", "invalid_value"),
        (_image_part("data:image/png;base64,AAAA", detail="max"), "messages[1].content[0].image_url.detail",
         "invalid_value"),
        (_image_part("ftp://example.com/a.png"), "messages[1].content[0]", "invalid_image_url"),
        (_image_part("file:///etc/passwd"), "messages[1].content[0]", "invalid_image_url"),
        (_image_part("http://[::1/a.png"), "messages[1].content[0]", "invalid_image_url"),
        (_image_part("http://example.com:99999/a.png"), "messages[1].content[0]", "invalid_image_url"),
        (_image_part("https:///a.png"), "messages[1].content[0]", "invalid_image_url"),
        (_image_part("data:image/png,rawbytes"), "messages[1].content[0]", "invalid_image_url"),
        (_image_part("data:image/png;base64,@@@@"), "messages[1].content[0]", "invalid_image_url"),
        (_image_part("data:image/svg+xml;base64,PHN2Zz4="), "messages[1].content[0]", "unsupported_image_type"),
        (_image_part("data:image/bmp;base64,Qk0="), "messages[1].content[0]", "unsupported_image_type"),
        ({"type": "input_audio", "input_audio": {}}, "messages[1].content[0]", "unsupported_content"),
    ],
)  # fmt: skip
def test_a_malformed_image_part_is_a_400_naming_it(part, param, code):
    error = _refusal(_chat(part, messages_before=[{"role": "system", "content": "hi"}]))
    assert (error.param, error.code) == (param, code)


def test_an_image_outside_a_user_message_is_refused():
    error = _refusal(_chat(_image_part(_data_url(_png())), role="assistant"))
    assert (error.param, error.code) == ("messages[0].content[0]", "invalid_value")


def test_an_image_over_the_byte_limit_is_refused_before_it_is_decoded(settings):
    settings.IMAGE_MAX_BYTES = 1024
    error = _refusal(_chat(_image_part(_data_url(b"\0" * 1100))))
    assert (error.param, error.code) == ("messages[0].content[0]", "image_too_large")


def test_more_images_than_allowed_are_refused_naming_the_first_one_too_many(settings):
    settings.IMAGE_MAX_PER_REQUEST = 2
    url = _data_url(_png())
    body = {"model": "m", "messages": [
        {"role": "user", "content": [_image_part(url), _image_part(url)]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, _image_part(url)]},
    ]}  # fmt: skip
    error = _refusal(body)
    assert (error.param, error.code) == ("messages[2].content[1]", "too_many_images")


# 2. Decoding and counting.


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"hello, not an image", "invalid_image"),
        (_png()[:60], "invalid_image"),  # a PNG cut off after its header
        (_png(format="BMP"), "unsupported_image_type"),  # a BMP sent as image/png
        (_png(format="TIFF"), "unsupported_image_type"),
    ],
)
def test_bytes_that_are_no_accepted_image_are_refused(data, code):
    with pytest.raises(InvalidRequest) as error:
        images.decode("messages[0].content[0]", data, GEOMETRY)
    assert (error.value.param, error.value.code) == ("messages[0].content[0]", code)


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(settings):
    settings.IMAGE_MAX_PIXELS = 100 * 100
    with pytest.raises(InvalidRequest) as error:
        images.decode("p", _png(101, 100), GEOMETRY)
    assert error.value.code == "image_too_large" and "101x100" in error.value.message


@pytest.mark.parametrize("format", ["PNG", "JPEG", "WEBP"])
def test_an_image_within_the_models_largest_input_is_kept_as_sent(format):
    data = _png(64, 48, format=format)
    prepared = images.decode("p", data, GEOMETRY)
    assert prepared.data == data and (prepared.width, prepared.height) == (64, 48)


def test_a_large_image_is_shrunk_to_the_models_largest_input_keeping_its_shape():
    prepared = images.decode("p", _png(1600, 1200), GEOMETRY)
    assert prepared.width * prepared.height <= GEOMETRY.max_pixels
    assert abs(prepared.width / prepared.height - 4 / 3) < 0.01
    assert Image.open(io.BytesIO(prepared.data)).format == "PNG"


def test_a_gif_is_sent_as_its_first_frame_in_png():
    out = io.BytesIO()
    frames = [Image.new("RGB", (32, 32), color) for color in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    prepared = images.decode("p", out.getvalue(), GEOMETRY)
    frame = Image.open(io.BytesIO(prepared.data))
    assert frame.format == "PNG" and frame.convert("RGB").getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize(
    ("size", "soft_tokens"),
    [((640, 480), 63), ((463, 347), 63), ((64, 48), 63), ((48, 48), 64), ((3, 900), 70), ((4000, 10), 70)],
)
def test_an_images_tokens_follow_the_engines_count_and_never_exceed_the_budget(size, soft_tokens):
    # Every image is resized to fill the budget (70 soft tokens here), up or down, on a 48-pixel grid.
    assert GEOMETRY.soft_tokens(*size) == soft_tokens
    assert images.decode("p", _png(*size), GEOMETRY).tokens == soft_tokens + 2  # and its begin and end markers


def test_the_prompt_counts_each_image_once_expanded(tiny_mm_model_dir):
    assert images.geometry_for(str(tiny_mm_model_dir)) == GEOMETRY
    prepared = [images.decode("p", _png(), GEOMETRY), images.decode("q", _png(48, 48), GEOMETRY)]
    assert images.prompt_tokens([2, 4, 857, 5, 857], prepared) == 5 - 2 + 65 + 66
    request = RequestInput(request_id="r", model="m", prompt_token_ids=[2, 4, 857, 5, 857], params={}, tenant_id=1,
                           key_id=1, enqueued_at=0.0, images=[image.wire() for image in prepared])  # fmt: skip
    assert request.prompt_tokens == 134
    assert RequestInput.loads(request.dumps()).prompt_tokens == 134


def test_the_worker_gets_back_the_pixels_the_gateway_checked():
    prepared = images.decode("p", _png(64, 48, color=(1, 2, 3)), GEOMETRY)
    (image,) = decode_images([prepared.wire()])["image"]
    assert image.mode == "RGB" and image.size == (64, 48) and image.getpixel((5, 5)) == (1, 2, 3)


# 3. Remote URLs: only from allow-listed hosts.


class _ImageHost(http.server.ThreadingHTTPServer):
    """Serves /image.png, /big.png (over the size cap, no Content-Length), /missing (404),
    /to-elsewhere (a redirect off the allow-list), /to-image (a redirect to /image.png) and /stall
    (no answer until `release` is set)."""

    daemon_threads = True

    def __init__(self):
        self.release = threading.Event()
        super().__init__(("127.0.0.1", 0), _ImageHandler)
        self.base = f"http://127.0.0.1:{self.server_address[1]}"


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the standard library's name)
        if self.path == "/image.png":
            self._send(200, _png(), {"Content-Type": "image/png"})
        elif self.path == "/big.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(b"\0" * 5000)
        elif self.path == "/to-elsewhere":
            self._send(302, b"", {"Location": "http://elsewhere.invalid/image.png"})
        elif self.path == "/to-image":
            self._send(302, b"", {"Location": "/image.png"})
        elif self.path == "/stall":
            self.server.release.wait(30)
            self._send(200, _png(), {"Content-Type": "image/png"})
        else:
            self._send(404, b"no", {})

    def _send(self, status, body, headers):
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def image_host():
    server = _ImageHost()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def _fetch(url: str) -> bytes:
    request = chat_request(_chat(_image_part(url)))
    return images.fetch(images.image_refs(request.messages)[0])


def _fetch_refusal(url: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as error:
        _fetch(url)
    assert error.value.status == 400 and error.value.param == "messages[0].content[0]"
    return error.value


def test_no_url_is_fetched_by_default(image_host, settings):
    assert settings.IMAGE_URL_ALLOWED_HOSTS == []
    assert _fetch_refusal(f"{image_host.base}/image.png").code == "image_url_not_allowed"


def test_a_url_on_a_host_off_the_list_is_not_fetched(image_host, settings):
    settings.IMAGE_URL_ALLOWED_HOSTS = ["images.example.com"]
    assert _fetch_refusal(f"{image_host.base}/image.png").code == "image_url_not_allowed"


def test_an_allowed_host_is_fetched_and_may_redirect_within_the_list(image_host, settings):
    settings.IMAGE_URL_ALLOWED_HOSTS = ["127.0.0.1"]
    assert _fetch(f"{image_host.base}/image.png") == _png()
    assert _fetch(f"{image_host.base}/to-image") == _png()


def test_an_allowed_entry_with_a_port_allows_that_port_only(image_host, settings):
    port = image_host.server_address[1]
    settings.IMAGE_URL_ALLOWED_HOSTS = [f"127.0.0.1:{port + 1 if port < 65535 else port - 1}"]
    assert _fetch_refusal(f"{image_host.base}/image.png").code == "image_url_not_allowed"
    settings.IMAGE_URL_ALLOWED_HOSTS = [f"127.0.0.1:{port}"]
    assert _fetch(f"{image_host.base}/image.png") == _png()


def test_a_redirect_off_the_list_is_not_followed(image_host, settings):
    settings.IMAGE_URL_ALLOWED_HOSTS = ["127.0.0.1"]
    error = _fetch_refusal(f"{image_host.base}/to-elsewhere")
    assert error.code == "image_url_not_allowed" and "redirects" in error.message


def test_a_download_over_the_size_cap_is_cut_off(image_host, settings):
    settings.IMAGE_URL_ALLOWED_HOSTS, settings.IMAGE_MAX_BYTES = ["127.0.0.1"], 4096
    assert _fetch_refusal(f"{image_host.base}/big.png").code == "image_too_large"


def test_a_missing_image_or_a_silent_host_is_a_400(image_host, settings):
    settings.IMAGE_URL_ALLOWED_HOSTS, settings.IMAGE_FETCH_TIMEOUT_SECONDS = ["127.0.0.1"], 0.5
    assert _fetch_refusal(f"{image_host.base}/missing").code == "image_fetch_failed"
    error = _fetch_refusal(f"{image_host.base}/stall")
    assert error.code == "image_fetch_failed" and "no answer within 0.5 s" in error.message


# 4. Through the gateway: only models that take images; image tokens count for admission.


@pytest.fixture
def catalog(db, tiny_model_dir, tiny_mm_model_dir, monkeypatch):
    monkeypatch.setattr(selectors, "_cache", {"at": float("-inf"), "models": {}})
    ServedModel.objects.create(model_id=TEXT_MODEL, path=str(tiny_model_dir), pool="tiny", context_length=2048)
    return ServedModel.objects.create(
        model_id=MM_MODEL, path=str(tiny_mm_model_dir), pool="tiny-mm", context_length=2048, accepts_images=True
    )


def _post(key: str, body: dict):
    return Client().post(
        "/v1/chat/completions",
        json.dumps(body),
        content_type="application/json",
        headers={"Authorization": f"Bearer {key}"},
    )


# The views run on gateway threads, with connections of their own: the test data must be committed.
through_the_gateway = pytest.mark.django_db(transaction=True)


@through_the_gateway
def test_a_model_that_takes_no_images_refuses_an_image_naming_the_part(catalog, make_tenant, redis_client):
    _, key = make_tenant("alice")
    body = {"model": TEXT_MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, _image_part(_data_url(_png()))]}]}  # fmt: skip
    reply = _post(key, body)
    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == ("messages[0].content[1]", "model_does_not_support_images")
    assert not redis_client.keys("req:*")  # nothing enqueued


@through_the_gateway
def test_an_image_that_does_not_decode_is_a_400_through_the_gateway(catalog, make_tenant, redis_client):
    _, key = make_tenant("alice")
    body = {"model": MM_MODEL, "messages": [{"role": "user", "content": [
        _image_part(_data_url(b"GIF89a but not really"))]}]}  # fmt: skip
    reply = _post(key, body)
    assert reply.status_code == 400, reply.content
    assert (reply.json()["error"]["param"], reply.json()["error"]["code"]) == (
        "messages[0].content[0]",
        "invalid_image",
    )


@through_the_gateway
def test_image_tokens_count_against_the_context_length(catalog, make_tenant, redis_client):
    _, key = make_tenant("alice")
    text_only = {"model": MM_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "what is it?"}]}
    with_image = {"model": MM_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, _image_part(_data_url(_png()))]}]}  # fmt: skip
    # The text is 15 tokens once templated; the image is one placeholder that the engine expands
    # into 65 tokens (63 soft tokens, a begin and an end marker).
    catalog.context_length = 40
    catalog.save()
    reply = _post(key, with_image)
    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert "the prompt has 80" in error["message"]
    assert not redis_client.keys("req:*")
    # The text alone fits (and then finds no worker serving the pool).
    reply = _post(key, text_only)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_worker_available", reply.content
