"""Crafted images for the tests of untrusted input."""

from __future__ import annotations

import struct
import zlib


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header of ``width`` x ``height`` RGB pixels over a few bytes of data: what a
    decompression bomb looks like before decoding (no test allocates its gigabytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
