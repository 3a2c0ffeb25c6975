"""Vision-language rows: EasyR1's ``images`` field read, checked, resized; bad images reject the row."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from image_bombs import bomb_png
from PIL import Image

from async_rl.data.images import ImageError, PixelBounds, chat_content, decode_blob, image_blob, load_image, normalise_ref
from async_rl.data.prompts import ImageFields, read_prompt_rows, write_rejected


def _png(colour: tuple[int, int, int], size: tuple[int, int] = (8, 6), fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt)
    return out.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_rows_with_images_of_every_reference_kind_and_bad_ones_rejected(tmp_path: Path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "red.png").write_bytes(_png((255, 0, 0)))
    (tmp_path / "broken.png").write_bytes(_png((0, 0, 255))[:30])  # truncated file
    green = _data_uri(_png((0, 255, 0)))
    rows_text = [
        {"problem": "<image>Which colour?", "answer": "green", "images": [green]},  # 1: data URI
        {"problem": "<image>Which colour?", "answer": "red", "images": ["imgs/red.png"]},  # 2: relative path
        {"problem": "A <image> and <image>?", "answer": "x", "images": [f"file://{tmp_path}/imgs/red.png", {"path": "imgs/red.png"}]},  # 3
        {"problem": "No image here", "answer": "1"},  # 4: text-only row in the same file
        {"problem": "<image>?", "answer": "x", "images": ["data:image/png;base64,!!notbase64!!"]},  # 5
        {"problem": "<image>?", "answer": "x", "images": ["broken.png"]},  # 6: undecodable
        {"problem": "<image>?", "answer": "x", "images": ["imgs/missing.png"]},  # 7
        {"problem": "Which colour?", "answer": "x", "images": [green]},  # 8: no placeholder
        {"problem": "<image>?", "answer": "x", "images": ["https://example.invalid/a.png"]},  # 9: no downloads
        {"problem": "<image>?", "answer": "x", "images": green},  # 10: not a list
        {"problem": "<image>?", "answer": "x", "images": [_data_uri(b"not an image at all")]},  # 11
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows_text) + "\n")
    rows, rejected = read_prompt_rows(path)
    assert [r.line for r in rows] == [1, 2, 3, 4]
    assert rows[0].images == (green,)
    assert rows[1].images == (str(tmp_path / "imgs" / "red.png"),)
    assert rows[2].images == (str(tmp_path / "imgs" / "red.png"),) * 2
    assert rows[3].images == ()
    reasons = {r.line: r.reason for r in rejected}
    assert set(reasons) == {5, 6, 7, 8, 9, 10, 11}
    assert "base64 payload does not decode" in reasons[5]
    assert "broken.png does not decode" in reasons[6]
    assert "missing.png' not found" in reasons[7] and "data.image_dir" in reasons[7]
    assert "0 <image> placeholders for 1 images" in reasons[8]
    assert "no downloads" in reasons[9]
    assert "must be a list of images (data.image_key)" in reasons[10]
    assert "does not decode" in reasons[11]
    dead = tmp_path / "run" / "rejected_rows.jsonl"
    write_rejected(rejected, dead)
    assert [json.loads(line)["line"] for line in dead.read_text().splitlines()] == [5, 6, 7, 8, 9, 10, 11]


def test_image_dir_and_custom_key(tmp_path: Path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(_png((1, 2, 3)))
    path = tmp_path / "data" / "val.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"problem": "<image>", "answer": "a", "pictures": ["a.png"]}) + "\n")
    rows, rejected = read_prompt_rows(path, images=ImageFields(key="pictures", base_dir=str(tmp_path / "pics")))
    assert not rejected and rows[0].images == (str(tmp_path / "pics" / "a.png"),)


def test_resize_into_pixel_bounds_keeps_aspect(tmp_path: Path):
    ref = _data_uri(_png((10, 20, 30), size=(40, 10)))  # 400 pixels
    assert load_image(ref, PixelBounds(1, 10_000)).size == (40, 10)
    assert load_image(ref, PixelBounds(1, 100)).size == (20, 5)  # sqrt(100 / 400) = 0.5
    assert load_image(ref, PixelBounds(1600, 10_000)).size == (80, 20)  # sqrt(1600 / 400) = 2
    grey = _data_uri(_grey_png())
    assert load_image(grey, PixelBounds(1, 10_000)).mode == "RGB"


def _grey_png() -> bytes:
    out = io.BytesIO()
    Image.new("L", (4, 4), 128).save(out, format="PNG")
    return out.getvalue()


def test_blob_hash_is_of_the_pixels_not_the_file():
    red_png, red_bmp = _png((255, 0, 0), fmt="PNG"), _png((255, 0, 0), fmt="BMP")
    bounds = PixelBounds(1, 10_000)
    a = image_blob(load_image(_data_uri(red_png), bounds))
    b = image_blob(load_image(_data_uri(red_bmp, "image/bmp"), bounds))
    c = image_blob(load_image(_data_uri(_png((254, 0, 0))), bounds))
    assert a.sha256 == b.sha256 != c.sha256
    assert (a.width, a.height) == (8, 6)
    assert decode_blob(a.png, 48).tobytes() == Image.new("RGB", (8, 6), (255, 0, 0)).tobytes()
    with pytest.raises(ImageError, match="does not decode"):
        decode_blob(b"garbage", 48)
    with pytest.raises(ImageError, match=r"8x6 = 48 pixels, more than the 47"):
        decode_blob(a.png, 47)


def test_chat_content_splits_at_placeholders():
    assert chat_content("plain", 0) == "plain"
    assert chat_content("<image>What colour?", 1) == [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    assert chat_content("Left <image> right <image>", 2) == [
        {"type": "text", "text": "Left "}, {"type": "image"}, {"type": "text", "text": " right "}, {"type": "image"},
    ]
    with pytest.raises(ImageError, match="2 <image> placeholders for 1 images"):
        chat_content("<image><image>", 1)
    with pytest.raises(ImageError, match="got 3"):
        normalise_ref(3, Path("."))


def test_an_image_bomb_is_refused_from_its_header_and_its_row_rejected(tmp_path: Path):
    bounds = PixelBounds(1, 4_194_304)
    with pytest.raises(ImageError, match=r"12000x12000 = 144000000 pixels, more than the 67108864 decoded at most"):
        load_image(_data_uri(bomb_png(12000, 12000)), bounds)
    with pytest.raises(ImageError, match="DecompressionBombError"):  # PIL's own limit (179 Mpx) comes first here
        load_image(_data_uri(bomb_png(30000, 30000)), bounds)
    # 8000 x 8000 (64 Mpx, under 16 x max_pixels) is decoded and resized into the bounds; a truncated one is an error.
    with pytest.raises(ImageError, match="does not decode"):
        load_image(_data_uri(bomb_png(8000, 8000)), bounds)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"problem": "<image>what?", "answer": "a", "images": [_data_uri(bomb_png(30000, 30000))]}) + "\n"
                    + json.dumps({"problem": "<image>what?", "answer": "b", "images": [_data_uri(_png((1, 2, 3)))]}) + "\n")
    fields = ImageFields(key="images", base_dir=str(tmp_path), bounds=PixelBounds(1, 10_000))
    kept, rejected = read_prompt_rows(rows, "problem", "answer", images=fields)
    assert [r.answer for r in kept] == ["b"] and len(rejected) == 1 and "DecompressionBombError" in rejected[0].reason
