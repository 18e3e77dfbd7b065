"""ditmesh.png: the file Pillow reads back is the picture, for every mode, size and number of deflate parts."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from ditmesh import png


def _decoded(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


@pytest.mark.parametrize("mode", ["L", "LA", "RGB", "RGBA", "P", "1", "I;16"])
@pytest.mark.parametrize("size", [(1, 1), (5, 3), (257, 129), (700, 600)])
def test_the_png_decodes_to_the_picture(mode, size):
    rng = np.random.default_rng(sum(size))
    picture = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 4), dtype=np.uint8), "RGBA").convert(mode)
    data = png.encode(picture)
    back = _decoded(data)
    expected = picture if mode in png.COLOUR_TYPES else picture.convert("RGBA" if "A" in picture.getbands() else "RGB")
    assert back.mode == expected.mode and back.size == picture.size
    assert back.tobytes() == expected.tobytes()


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 64])
def test_parts_join_into_one_stream_whatever_their_number(parts):
    rng = np.random.default_rng(parts)
    raw = np.concatenate([rng.integers(0, 256, 100_000, dtype=np.uint8), np.zeros(90_000, np.uint8),
                          np.tile(np.arange(256, dtype=np.uint8), 300)])
    stream = png.deflate_parallel(raw, parts=parts)
    assert zlib.decompress(stream) == raw.tobytes()  # the checksum at the end is verified too


def test_a_large_noise_picture_is_cut_into_parts_and_a_smooth_one_compresses():
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8))
    y, x = np.mgrid[0:1024, 0:1024]
    smooth = Image.fromarray(np.stack([x // 4, y // 4, (x + y) // 8], -1).astype(np.uint8))
    for picture in (noise, smooth):
        assert _decoded(png.encode(picture)).tobytes() == picture.tobytes()
    raw = png.filtered_rows(np.asarray(noise))
    assert raw.nbytes // png.PART_BYTES >= 2  # several parts where the machine has several threads
    # the "Up" filter keeps a smooth picture small: within twice what Pillow makes at the same zlib level
    pillow = io.BytesIO()
    smooth.save(pillow, format="PNG", compress_level=1)
    assert len(png.encode(smooth)) < 2 * len(pillow.getvalue())


def test_a_picture_that_does_not_shrink_is_stored_and_one_that_does_is_deflated():
    rng = np.random.default_rng(1)
    noise = Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8))
    y, x = np.mgrid[0:300, 0:400]
    smooth = Image.fromarray((np.stack([x // 4, y // 4, (x + y) // 8], -1) % 256).astype(np.uint8))
    for picture, stored in ((noise, True), (smooth, False)):
        raw = png.filtered_rows(np.asarray(picture))
        assert png.worth_deflating(raw) is not stored
        data = png.encode(picture)
        assert _decoded(data).tobytes() == picture.tobytes()  # the same pixels either way
        if stored:  # level 0: the filtered rows themselves, in stored blocks (a few bytes each), and no smaller
            assert raw.nbytes < len(data) < raw.nbytes * 1.01 and data == png.encode(picture, level=0)
        else:
            assert len(data) < raw.nbytes / 4


def test_the_service_and_generate_write_this_png():
    from ditmesh.serve.app import encode_picture

    picture = Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 30, 3), dtype=np.uint8))
    kind, data = encode_picture("image", picture)
    assert kind == "image/png" and data == png.encode(picture)


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [(1, 1), (129, 257), (700, 600)])
def test_pixels_are_written_byte_for_byte_as_the_one_piece_file(channels, size):
    """encode_pixels joins the file's pieces once: the same bytes as the file built from the whole zlib stream
    (chunk by chunk, as png.encode wrote it before), stored or deflated, and png.encode of the PIL picture gives
    them too."""
    rng = np.random.default_rng(channels)
    noise = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    y, x = np.mgrid[0:size[1], 0:size[0]]
    smooth = np.repeat(((x // 4 + y // 8) % 256).astype(np.uint8)[..., None], channels, -1)
    for pixels in (noise, smooth):
        raw = png.filtered_rows(pixels)
        level = png.LEVEL if png.worth_deflating(raw) else 0
        header = np.array([size[0], size[1]], ">u4").tobytes() + bytes(
            [8, {1: 0, 2: 4, 3: 2, 4: 6}[channels], 0, 0, 0])
        whole = (png.SIGNATURE + png._chunk(b"IHDR", header) + png._chunk(b"IDAT", png.deflate_parallel(raw, level))
                 + png._chunk(b"IEND", b""))
        assert png.encode_pixels(pixels) == whole
        mode = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}[channels]
        picture = Image.fromarray(pixels if channels > 1 else pixels[..., 0], mode)
        assert png.encode(picture) == whole
        assert _decoded(whole).tobytes() == picture.tobytes()


def test_the_ranks_send_pixels_and_the_front_end_writes_the_same_file():
    """A served picture crosses from rank 0 as its pixels (worker._pictures), and the front end's file is the one
    png.encode writes of the PIL picture; a mode PNG does not carry goes as the picture."""
    from types import SimpleNamespace

    from ditmesh.serve.app import encode_picture
    from ditmesh.serve.worker import _pictures

    rng = np.random.default_rng(5)
    rgb = Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))
    grey = Image.fromarray(rng.integers(0, 256, (20, 10), dtype=np.uint8))
    other = rgb.convert("P")
    sent = _pictures(SimpleNamespace(images=[rgb, grey, other]))
    assert [kind for kind, _ in sent] == ["pixels", "pixels", "image"]
    assert sent[0][1].shape == (40, 30, 3) and sent[1][1].shape == (20, 10, 1) and sent[2][1] is other
    for (kind, picture), original in zip(sent, (rgb, grey, other)):
        assert encode_picture(kind, picture) == ("image/png", png.encode(original))
