"""Images in chat messages: OpenAI's `image_url` content parts, checked, fetched, decoded and counted.

A part is `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` in a user message. The
url is a `data:` URL (PNG, JPEG, WebP or GIF, base64) or, only for hosts an operator allow-lists
(IMAGE_URL_ALLOWED_HOSTS; empty by default, so the gateway fetches nothing it is pointed at), an
http(s) URL fetched with a timeout, a size cap and no redirect off the allow-list. Every refusal is
a 400 whose `param` names the part (`messages[i].content[j]`).

Three steps, cheapest first:
- `message_content` (validation, no I/O): the parts' shape, the data URL's media type and size;
  `check_count` the images per request.
- `check_model`: only a model whose catalog entry takes images (`ServedModel.accepts_images`).
- `prepare` (after admission's cheap checks): fetch, decode (pixel limit checked on the header,
  before any pixel is decoded), shrink to the model's largest input, and count each image's tokens
  the way the engine does.

The chat template sees an image part as `{"type": "image"}` and writes one image placeholder token
for it; the engine expands that placeholder into the image's tokens (`PreparedImage.tokens`).
"""

import base64
import binascii
import io
import json
import math
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from gateway.errors import InvalidRequest, ServiceUnavailable

# Media types accepted, as data URL types and as the decoder's format names.
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)(?:;[\w.+-]+=[\w.+-]+)*;base64,(?P<data>.*)", re.S | re.I)
_DETAILS = {"auto", "low", "high"}
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class ImageRef:
    """An image part as validated: where it is (`param`) and its URL; `data` holds a data URL's bytes."""

    param: str
    url: str
    data: bytes | None = None


@dataclass(frozen=True)
class PreparedImage:
    """An image ready for the engine: encoded bytes (PNG, JPEG or WebP) and the prompt tokens it takes."""

    param: str
    data: bytes
    width: int
    height: int
    tokens: int

    def wire(self) -> dict:
        return {"data": base64.b64encode(self.data).decode("ascii"), "tokens": self.tokens}


def _refuse(message: str, param: str, code: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


# -- validation (no I/O) ------------------------------------------------------------------------


def message_content(where: str, role: str, content: list) -> str | list[dict]:
    """A message's list of content parts: its text when all parts are text (as before images), else
    the parts for the chat template, each image part `{"type": "image", "image": ImageRef}`."""
    parts: list[dict] = []
    for index, part in enumerate(content):
        param = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            if role != "user":
                raise _refuse(f"'{param}': image parts are only allowed in user messages.", param, "invalid_value")
            parts.append({"type": "image", "image": _image_ref(param, part)})
        else:
            raise _refuse(
                f"'{param}' must be a text part ({{'type': 'text', 'text': ...}}) or an image part "
                "({'type': 'image_url', 'image_url': {'url': ...}}).",
                param,
                "unsupported_content",
            )
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _image_ref(param: str, part: dict) -> ImageRef:
    image_url = part.get("image_url")
    if isinstance(image_url, str):  # some clients send the URL itself
        image_url = {"url": image_url}
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str) or not image_url["url"]:
        raise _refuse(f"'{param}.image_url.url' must be a non-empty string.", f"{param}.image_url", "invalid_value")
    unknown = set(image_url) - {"url", "detail"}
    if unknown:
        raise _refuse(
            f"'{param}.image_url' has unknown fields: {sorted(unknown)}.", f"{param}.image_url", "invalid_value"
        )
    detail = image_url.get("detail")
    if detail is not None and detail not in _DETAILS:
        raise _refuse(
            f"'{param}.image_url.detail' must be one of {sorted(_DETAILS)}.",
            f"{param}.image_url.detail",
            "invalid_value",
        )
    url = image_url["url"]
    if url[:5].lower() == "data:":
        return ImageRef(param, url[:40], _data_url_bytes(param, url))
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError:
        parts = None
    if parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise _refuse(
            f"'{param}.image_url.url' must be a data: URL (base64 PNG, JPEG, WebP or GIF) or an http(s) URL.",
            param, "invalid_image_url",
        )  # fmt: skip
    return ImageRef(param, url)


def _data_url_bytes(param: str, url: str) -> bytes:
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise _refuse(f"'{param}' is not a base64 data URL (data:image/png;base64,...).", param, "invalid_image_url")
    media_type = match["type"].lower()
    if media_type not in FORMATS:
        raise _refuse(
            f"'{param}': images of type {media_type} are not supported; use one of {', '.join(FORMATS)}.",
            param, "unsupported_image_type",
        )  # fmt: skip
    encoded = match["data"]
    # Refused before decoding: base64 takes 4 characters per 3 bytes.
    if len(encoded) * 3 // 4 > settings.IMAGE_MAX_BYTES + 2:
        raise _too_large(param)
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(f"'{param}': the data URL's base64 is not valid.", param, "invalid_image_url") from None
    if len(data) > settings.IMAGE_MAX_BYTES:
        raise _too_large(param)
    return data


def _too_large(param: str) -> InvalidRequest:
    return _refuse(f"'{param}': the image is larger than {settings.IMAGE_MAX_BYTES} bytes.", param, "image_too_large")


def image_refs(messages: list[dict]) -> list[ImageRef]:
    return [
        part["image"]
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] == "image"
    ]


def check_count(messages: list[dict]) -> None:
    refs = image_refs(messages)
    if len(refs) > settings.IMAGE_MAX_PER_REQUEST:
        extra = refs[settings.IMAGE_MAX_PER_REQUEST]
        raise _refuse(
            f"A request may hold at most {settings.IMAGE_MAX_PER_REQUEST} images; '{extra.param}' is one more.",
            extra.param, "too_many_images",
        )  # fmt: skip


def check_model(model, messages: list[dict] | None) -> None:
    """400 when the request holds an image and the model takes none."""
    refs = image_refs(messages or [])
    if refs and not model.accepts_images:
        raise _refuse(
            f"The model '{model.model_id}' does not take images ('{refs[0].param}').",
            refs[0].param, "model_does_not_support_images",
        )  # fmt: skip


def text_of(content: str | list[dict]) -> str:
    """A message's text (what its content holds besides images)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")


# -- fetching --------------------------------------------------------------------------------------


def _host_allowed(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return False
    hosts = settings.IMAGE_URL_ALLOWED_HOSTS
    host = parts.hostname.lower()
    return host in hosts or (parts.port is not None and f"{host}:{parts.port}" in hosts)


class _AllowListRedirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not _host_allowed(newurl):
            raise _RedirectRefused(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _RedirectRefused(Exception):
    pass


# No proxy from the environment: an allow-listed host is reached directly.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _AllowListRedirects())


def fetch(ref: ImageRef) -> bytes:
    """The bytes at an allow-listed http(s) URL, within IMAGE_FETCH_TIMEOUT_SECONDS (the whole
    download) and IMAGE_MAX_BYTES."""
    if not settings.IMAGE_URL_ALLOWED_HOSTS:
        raise _refuse(
            f"'{ref.param}': image URLs are not fetched by this server; send the image as a base64 data URL.",
            ref.param, "image_url_not_allowed",
        )  # fmt: skip
    if not _host_allowed(ref.url):
        raise _refuse(
            f"'{ref.param}': this server fetches images only from its allowed hosts; send the image as a "
            "base64 data URL.",
            ref.param, "image_url_not_allowed",
        )  # fmt: skip
    timeout = settings.IMAGE_FETCH_TIMEOUT_SECONDS
    deadline = time.monotonic() + timeout
    # An http(s) URL on an allowed host (`_host_allowed`), redirects checked the same way.
    headers = {"User-Agent": "gemma-platform-image-fetch", "Accept": "image/*"}
    request = urllib.request.Request(ref.url, headers=headers)  # noqa: S310
    try:
        with _opener.open(request, timeout=timeout) as response:
            declared = response.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > settings.IMAGE_MAX_BYTES:
                raise _too_large(ref.param)
            chunks, size = [], 0
            while chunk := response.read(65536):
                size += len(chunk)
                if size > settings.IMAGE_MAX_BYTES:
                    raise _too_large(ref.param)
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunks.append(chunk)
            return b"".join(chunks)
    except _RedirectRefused:
        raise _refuse(
            f"'{ref.param}': the image URL redirects to a host this server does not fetch from.",
            ref.param, "image_url_not_allowed",
        ) from None  # fmt: skip
    except urllib.error.HTTPError as exc:
        raise _fetch_failed(ref, f"the server answered {exc.code}") from None
    except (TimeoutError, OSError, ValueError, urllib.error.URLError) as exc:
        reason = f"no answer within {timeout:g} s" if _is_timeout(exc) else str(getattr(exc, "reason", exc))
        raise _fetch_failed(ref, reason) from None


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError)


def _fetch_failed(ref: ImageRef, reason: str) -> InvalidRequest:
    return _refuse(f"'{ref.param}': the image could not be downloaded ({reason}).", ref.param, "image_fetch_failed")


# -- decoding and counting ---------------------------------------------------------------------


@dataclass(frozen=True)
class VisionGeometry:
    """How the model's image processor sizes an image: `max_soft_tokens` tokens at most, each from a
    `pooling` x `pooling` block of `patch` x `patch` pixel patches."""

    patch: int
    pooling: int
    max_soft_tokens: int

    @property
    def max_pixels(self) -> int:
        return self.max_soft_tokens * self.pooling**2 * self.patch**2

    def soft_tokens(self, width: int, height: int) -> int:
        """The tokens the vision tower gives an image of this size: vLLM's Gemma 4 count
        (`Gemma4ProcessingInfo._compute_num_soft_tokens`, vllm 0.32), which sizes the placeholders
        the engine prefills."""
        unit = self.patch * self.pooling
        max_patches = self.max_soft_tokens * self.pooling**2
        scale = math.sqrt(max_patches / ((height / self.patch) * (width / self.patch)))
        target_h = max(unit, int(math.floor(height * scale / unit)) * unit)
        target_w = max(unit, int(math.floor(width * scale / unit)) * unit)
        patches = (target_h // self.patch) * (target_w // self.patch)
        return min(patches // self.pooling**2, self.max_soft_tokens)


_geometry_lock = threading.Lock()
_geometries: dict[str, VisionGeometry] = {}


def geometry_for(path: str) -> VisionGeometry:
    """The model's vision geometry, read once from its config.json and processor_config.json."""
    geometry = _geometries.get(path)
    if geometry is not None:
        return geometry
    with _geometry_lock:
        if path not in _geometries:
            _geometries[path] = _read_geometry(Path(path))
        return _geometries[path]


def _read_geometry(path: Path) -> VisionGeometry:
    try:
        vision = json.loads((path / "config.json").read_text())["vision_config"]
        processor_file = path / "processor_config.json"
        processor = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ServiceUnavailable(
            f"The model's vision configuration cannot be read: {exc}", code="model_config_unavailable"
        ) from exc
    image_processor = processor.get("image_processor", processor)
    max_soft_tokens = image_processor.get("max_soft_tokens") or vision.get("default_output_length") or 280
    return VisionGeometry(
        patch=int(vision.get("patch_size", 16)),
        pooling=int(vision.get("pooling_kernel_size", 3)),
        max_soft_tokens=int(max_soft_tokens),
    )


def prepare(model, messages: list[dict]) -> list[PreparedImage]:
    """Fetch (allow-listed URLs), decode and count the request's images, in prompt order."""
    refs = image_refs(messages)
    if not refs:
        return []
    geometry = geometry_for(model.path)
    return [decode(ref.param, ref.data if ref.data is not None else fetch(ref), geometry) for ref in refs]


def decode(param: str, data: bytes, geometry: VisionGeometry) -> PreparedImage:
    """Check and decode one image; shrink it to the model's largest input when it is larger.

    Each image costs its soft tokens plus its begin and end markers. The bytes kept are the
    original file when it is a PNG, JPEG or WebP the engine takes as it is, else a PNG."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:
        raise _refuse(f"'{param}': the image has too many pixels.", param, "image_too_large") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise _refuse(f"'{param}' is not a PNG, JPEG, WebP or GIF image.", param, "invalid_image") from None
    if image.format not in FORMATS.values():
        raise _refuse(
            f"'{param}': images in {image.format} format are not supported; use PNG, JPEG, WebP or GIF.",
            param, "unsupported_image_type",
        )  # fmt: skip
    width, height = image.size
    if width < 1 or height < 1 or width * height > settings.IMAGE_MAX_PIXELS:
        raise _refuse(
            f"'{param}': the image has {width}x{height} pixels; at most {settings.IMAGE_MAX_PIXELS} are allowed.",
            param, "image_too_large",
        )  # fmt: skip
    try:
        image.load()  # the first frame of an animation
        rgb = image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise _refuse(f"'{param}': the image data is corrupt or truncated.", param, "invalid_image") from None
    keep_original = image.format != "GIF" and rgb.size[0] * rgb.size[1] <= geometry.max_pixels and image.mode == "RGB"
    if rgb.size[0] * rgb.size[1] > geometry.max_pixels:
        scale = math.sqrt(geometry.max_pixels / (rgb.size[0] * rgb.size[1]))
        rgb = rgb.resize((max(1, int(rgb.size[0] * scale)), max(1, int(rgb.size[1] * scale))), Image.Resampling.BICUBIC)
    if not keep_original:
        out = io.BytesIO()
        rgb.save(out, format="PNG")
        data = out.getvalue()
    width, height = rgb.size
    return PreparedImage(param, data, width, height, geometry.soft_tokens(width, height) + 2)


def prompt_tokens(prompt_ids: list[int], images: list[PreparedImage]) -> int:
    """The prompt's length once the engine expands each image's placeholder token."""
    return len(prompt_ids) + sum(image.tokens - 1 for image in images)
