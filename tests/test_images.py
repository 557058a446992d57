"""JPEG records: written, read back by index (decoded, cropped, normalised), deterministic,
picklable into spawned processes, one-line errors naming the file and the record."""

from __future__ import annotations

import io
import multiprocessing
import pickle
import struct

import numpy as np
import pytest
from PIL import Image

from input_pipeline.batching import HostLoader
from input_pipeline.errors import DataError
from input_pipeline.images import IMAGENET_MEAN, IMAGENET_STD, JpegRecords, Written, write_jpeg_records

COUNT, SIZE, CROP = 24, (40, 56), 32


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Written:
    return write_jpeg_records(tmp_path_factory.mktemp("images") / "train.arr", COUNT, size=SIZE, seed=3, num_classes=5)


@pytest.fixture(scope="module")
def source(written) -> JpegRecords:
    return JpegRecords(written.path, CROP, seed=0)


def _raw_records(path: str) -> list[bytes]:
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(path)
    return reader.read(list(range(reader.num_records())))


def _jpeg(size: tuple[int, int], value: int = 128) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size[1], size[0]), (value, value // 2, 255 - value)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _write(path, records: list[bytes]) -> str:
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        writer.write(r)
    writer.close()
    return str(path)


def test_written_file_and_layout(written):
    records = _raw_records(written.path)
    assert written.count == len(records) == COUNT
    assert written.bytes > sum(map(len, records))  # the file holds every record, plus its index
    # Drawn shapes and gradients compress like a photo, far below the raw pixels (not like noise).
    assert 0 < written.jpeg_bytes_mean < SIZE[0] * SIZE[1] * 3 / 2
    for r in records:
        (label,) = struct.unpack_from("<I", r)
        assert 0 <= label < 5 and r[4:6] == b"\xff\xd8"  # label, then a JPEG's SOI marker
    assert len({struct.unpack_from("<I", r)[0] for r in records}) > 1


def test_round_trip_decodes_crops_and_normalises(written, source):
    assert len(source) == COUNT
    spec = {"inputs": ((CROP, CROP, 3), np.dtype(np.float32)), "targets": ((), np.dtype(np.int32))}
    assert source.element_spec == spec
    batch = source.read(np.arange(COUNT))
    assert batch["inputs"].shape == (COUNT, CROP, CROP, 3) and batch["inputs"].dtype == np.float32
    assert batch["targets"].dtype == np.int32
    records = _raw_records(written.path)
    np.testing.assert_array_equal(batch["targets"], [struct.unpack_from("<I", r)[0] for r in records])
    mean, std = np.asarray(IMAGENET_MEAN), np.asarray(IMAGENET_STD)
    lo, hi = -mean / std, (1 - mean) / std
    x = batch["inputs"]
    assert (x >= lo - 1e-5).all() and (x <= hi + 1e-5).all()
    assert x.std() > 0.1  # images, not a constant
    # The decode is real: the pixels are PIL's decode of record i's JPEG, at some crop.
    pixels = np.asarray(Image.open(io.BytesIO(records[5][4:])), np.float32)
    back = np.rint((x[5] * std + mean) * 255)
    found = [
        (y, xo)
        for y in range(SIZE[0] - CROP + 1)
        for xo in range(SIZE[1] - CROP + 1)
        if np.abs(pixels[y : y + CROP, xo : xo + CROP] - back).max() <= 1
    ]
    assert found


def test_deterministic_and_independent_of_the_batch(source, written):
    a, b = source.read(np.array([7, 2, 19])), source.read(np.array([7, 2, 19]))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    alone = source.read(np.array([2]))  # an example's crop depends on (seed, index) only
    np.testing.assert_array_equal(alone["inputs"][0], a["inputs"][1])
    other = JpegRecords(written.path, CROP, seed=1).read(np.arange(COUNT))
    same = source.read(np.arange(COUNT))
    np.testing.assert_array_equal(other["targets"], same["targets"])
    differs = [not np.array_equal(other["inputs"][i], same["inputs"][i]) for i in range(COUNT)]
    assert sum(differs) >= COUNT // 2  # 9x25 offsets: a few may coincide


def test_pickles_only_its_arguments(source):
    blob = pickle.dumps(source)
    assert len(blob) < 1024  # no reader, no decoded data
    copy = pickle.loads(blob)
    idx = np.array([3, 11, 0, 23])
    a, b = source.read(idx), copy.read(idx)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def _read_in_child(blob: bytes, indices: list[int]) -> dict:
    return pickle.loads(blob).read(np.asarray(indices))


def test_reads_in_a_spawned_process(source):
    idx = [4, 9, 1]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(_read_in_child, (pickle.dumps(source), idx))
    here = source.read(np.asarray(idx))
    for k in here:
        np.testing.assert_array_equal(child[k], here[k])


def test_host_loader_over_it(source):
    loader = HostLoader(source, batch_size=8, seed=5)
    batch = loader.batch(4)  # epoch 1 (3 batches per epoch)
    assert batch["inputs"].shape == (8, CROP, CROP, 3) and batch["targets"].shape == (8,)
    again = HostLoader(source, batch_size=8, seed=5).batch(4)
    np.testing.assert_array_equal(batch["inputs"], again["inputs"])
    reused = HostLoader(source, batch_size=8, seed=5, reuse_buffers=True)
    for step in (0, 4):
        got = reused.batch(step)
        want = loader.batch(step)
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
        np.testing.assert_array_equal(got["targets"], want["targets"])
        reused.recycle(got, aliased=False)
    assert reused.allocated == 1


def test_bad_records_name_the_file_and_record(tmp_path):
    good = struct.pack("<I", 1) + _jpeg((40, 40))
    corrupt = bytearray(good)
    corrupt[4:40] = bytes(36)  # the JPEG's header zeroed: PIL cannot identify it
    truncated = good[: len(good) // 2]
    small = struct.pack("<I", 2) + _jpeg((40, 20))
    path = _write(tmp_path / "bad.arr", [good, b"\x01\x00", bytes(corrupt), truncated, small])
    src = JpegRecords(path, 32, seed=0)
    assert src.read(np.array([0]))["targets"].tolist() == [1]
    cases = {1: "too short", 2: "does not decode", 3: "does not decode", 4: "smaller than the 32x32 crop"}
    for index, words in cases.items():
        with pytest.raises(DataError) as e:
            src.read(np.array([0, index]))
        msg = str(e.value)
        assert "\n" not in msg and path in msg and f"record {index}" in msg and words in msg, msg


def test_greyscale_jpeg_reads_as_rgb(tmp_path):
    buf = io.BytesIO()
    Image.new("L", (40, 40), 200).save(buf, "JPEG")
    src = JpegRecords(_write(tmp_path / "grey.arr", [struct.pack("<I", 7) + buf.getvalue()]), 32, seed=0)
    batch = src.read(np.array([0]))
    assert batch["inputs"].shape == (1, 32, 32, 3) and batch["targets"].tolist() == [7]
    pixels = batch["inputs"][0] * np.asarray(IMAGENET_STD) + np.asarray(IMAGENET_MEAN)
    np.testing.assert_allclose(pixels, 200 / 255, atol=2 / 255)  # the grey in every channel
    strided = {"inputs": np.zeros((1, 32, 64, 3), np.float32)[:, :, :32], "targets": np.zeros(1, np.int32)}
    with pytest.raises(ValueError, match="C-contiguous"):  # rows are written through reshaped views
        src.read_into(np.array([0]), strided)


def test_bad_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        JpegRecords(tmp_path / "missing.arr", 32, seed=0)
    junk = tmp_path / "junk.arr"
    junk.write_bytes(b"not an array_record file" * 10)
    with pytest.raises(DataError, match="junk.arr: not an array_record file"):
        JpegRecords(junk, 32, seed=0)
    with pytest.raises(DataError, match="cannot write"):
        write_jpeg_records(tmp_path / "no" / "such" / "dir.arr", 2, size=(8, 8))
    with pytest.raises(IndexError, match="out of range"):
        JpegRecords(_write(tmp_path / "one.arr", [struct.pack("<I", 0) + _jpeg((8, 8))]), 4, seed=0).read(np.array([1]))
