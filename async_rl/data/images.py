"""Images of vision-language rows: EasyR1's ``images`` field, read, checked and normalised.

A row's images are references, as EasyR1 datasets hold them: a base64 data URI
(``data:image/png;base64,...``), a ``file://`` URL or a file path (relative paths are
resolved against ``data.image_dir``, else the dataset file's folder), or an object with a
``path`` key (the Hugging Face ``datasets`` export). :func:`load_image` opens one, converts it
to RGB and resizes it into ``[min_pixels, max_pixels]`` pixels keeping its aspect ratio
(EasyR1's ``process_image``: scale by ``sqrt(bound / (w * h))``). :func:`image_blob` turns the
result into the bytes that travel (PNG, lossless) and their content hash, the key images
are stored under once per content, however many samples and groups use them.

Everything that can be wrong with an image raises :class:`ImageError` with a message that
names the reference, so the caller can reject the row (never crash the run).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

IMAGE_PLACEHOLDER = "<image>"
"""Where each image goes in the prompt text (EasyR1's convention)."""


DECODE_PIXELS_FACTOR = 16
"""A row's image is decoded only if its header gives at most this many times ``max_pixels``
(it is resized into the bounds after decoding): 67 Mpx at the default bounds, an 8K photo is
33 Mpx. A larger one (a decompression bomb: a tiny file that decodes to gigabytes) is
refused before a pixel is decoded."""


class ImageError(ValueError):
    """An image reference that cannot be used (missing, undecodable, malformed, too large)."""


@dataclass(frozen=True)
class PixelBounds:
    """Pixel-count bounds (width x height) an image is resized into, as EasyR1's
    ``data.min_pixels`` / ``data.max_pixels``."""

    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class ImageBlob:
    """One image as it travels: lossless PNG bytes and the SHA-256 of the decoded pixels
    (mode, size and RGB bytes), so equal images share one key whatever file they came from."""

    sha256: str
    png: bytes
    width: int
    height: int


def _describe(ref: str) -> str:
    """A reference short enough for a log line: a long data URI is cut, a path kept whole."""
    return f"{ref[:40]}... ({len(ref)} characters)" if ref.startswith("data:") and len(ref) > 60 else ref


def normalise_ref(ref: Any, base_dir: Path) -> str:
    """A reference as a self-contained string: a data URI unchanged, a path made absolute
    (against ``base_dir``). Raises :class:`ImageError` for a value of another shape."""
    if isinstance(ref, dict) and isinstance(ref.get("path"), str):
        ref = ref["path"]
    if not isinstance(ref, str) or not ref.strip():
        raise ImageError(f"an image must be a data URI, a file:// URL or a path (or {{'path': ...}}), got {ref!r:.60}")
    if ref.startswith("data:"):
        return ref
    if ref.startswith("file://"):
        ref = ref[len("file://") :]
    elif "://" in ref:
        raise ImageError(f"image {_describe(ref)}: only data URIs, file:// URLs and paths on this machine are read (no downloads)")
    path = Path(ref)
    return str(path if path.is_absolute() else base_dir / path)


def _open(ref: str, max_pixels: int) -> Image.Image:
    if ref.startswith("data:"):
        header, sep, payload = ref.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageError(f"image {_describe(ref)}: a data URI must look like data:image/png;base64,<payload>")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"image {_describe(ref)}: base64 payload does not decode ({exc})") from None
        source: Any = io.BytesIO(data)
    else:
        if not Path(ref).is_file():
            raise ImageError(f"image file {ref!r} not found (relative paths are read from data.image_dir, else the dataset file's folder)")
        source = ref
    return _decode(source, f"image {_describe(ref)}", max_pixels)


def _decode(source: Any, what: str, max_pixels: int) -> Image.Image:
    """Decode an image whose header gives at most ``max_pixels`` pixels (width x height)."""
    try:
        image = Image.open(source)  # reads the header only
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(f"{what} is {width}x{height} = {width * height} pixels, more than the {max_pixels} "
                             "decoded at most (a decompression bomb, or raise data.max_pixels)")
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, SyntaxError, ValueError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise ImageError(f"{what} does not decode: {type(exc).__name__}: {exc}") from None
    return image


def load_image(ref: str, bounds: PixelBounds) -> Image.Image:
    """Open a normalised reference as an RGB image resized into ``bounds`` (aspect kept).
    An image over ``DECODE_PIXELS_FACTOR * bounds.max_pixels`` pixels is refused from its header."""
    image = _open(ref, DECODE_PIXELS_FACTOR * bounds.max_pixels)
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"image {_describe(ref)} is empty ({width}x{height})")
    pixels = width * height
    if pixels > bounds.max_pixels or pixels < bounds.min_pixels:
        factor = math.sqrt((bounds.max_pixels if pixels > bounds.max_pixels else bounds.min_pixels) / pixels)
        width, height = max(1, int(width * factor)), max(1, int(height * factor))
        image = image.resize((width, height))
    return image.convert("RGB") if image.mode != "RGB" else image


def image_blob(image: Image.Image) -> ImageBlob:
    """The PNG bytes and content hash of an RGB image."""
    rgb = image.convert("RGB") if image.mode != "RGB" else image
    digest = hashlib.sha256(f"RGB|{rgb.width}x{rgb.height}|".encode())
    digest.update(rgb.tobytes())
    out = io.BytesIO()
    rgb.save(out, format="PNG")
    return ImageBlob(digest.hexdigest(), out.getvalue(), rgb.width, rgb.height)


def decode_blob(png: bytes, max_pixels: int) -> Image.Image:
    """PNG bytes of an :class:`ImageBlob` back to an RGB image. They come from the queue, so
    they are checked: :class:`ImageError` if they are not an image or their header gives
    more than ``max_pixels`` pixels (a blob is resized into ``data.max_pixels`` when made)."""
    image = _decode(io.BytesIO(png), "stored image", max_pixels)
    return image.convert("RGB") if image.mode != "RGB" else image


def chat_content(prompt: str, num_images: int) -> str | list[dict[str, str]]:
    """The user message content of a prompt: the text itself without images, else
    EasyR1's content list, the text split at each ``<image>`` with an image part in
    between. Raises :class:`ImageError` when the placeholders and images do not match."""
    if not num_images:
        return prompt
    pieces = prompt.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != num_images:
        raise ImageError(
            f"the prompt has {len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholders for {num_images} images; "
            f"put one {IMAGE_PLACEHOLDER} where each image goes"
        )
    content: list[dict[str, str]] = []
    for i, text in enumerate(pieces):
        if i:
            content.append({"type": "image"})
        if text:
            content.append({"type": "text", "text": text})
    return content
