"""An image classification source whose reads do real work: JPEG records written locally
(:func:`write_jpeg_records`) and read back by index, decoded, cropped and normalised
(:class:`JpegRecords`); the decode-bound counterpart of the token sources.

The spec (the images drawn, the record layout, what a read returns, its cost, how it travels
to worker processes) is in docs/data.md, "JPEG image records".
"""

from __future__ import annotations

import colorsys
import dataclasses
import io
import os
import struct
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, UnidentifiedImageError

from input_pipeline.batching import checked_indices
from input_pipeline.errors import DataError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_HEADER = struct.Struct("<I")  # the label
_MIN_JPEG = 4  # SOI + EOI markers: anything shorter cannot be a JPEG
WRITER_OPTIONS = "group_size:1,uncompressed"
# No readahead and no reader threads: a batch reads scattered records, and each worker process
# is one reader already (the module's options for random access).
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"


@dataclasses.dataclass(frozen=True)
class Written:
    """What :func:`write_jpeg_records` wrote."""

    path: str
    count: int
    bytes: int  # the file's size
    jpeg_bytes_mean: float  # JPEG bytes per image, on average


def draw_image(label: int, size: tuple[int, int], seed: int, index: int, num_classes: int) -> Image.Image:
    """Image `index` of the set seeded by `seed` (RGB, `size` = (H, W)); its class is `label`."""
    rng = np.random.default_rng([seed, index])
    h, w = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = xx * np.cos(angle) + yy * np.sin(angle)
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    c0, c1 = rng.uniform(40, 215, 3), rng.uniform(40, 215, 3)
    img = Image.fromarray((c0 + t[..., None] * (c1 - c0)).astype(np.uint8))
    draw = ImageDraw.Draw(img)

    def shape(kind: int, color: tuple[int, int, int], scale: tuple[float, float]) -> None:
        s = rng.uniform(*scale) * min(h, w)
        cx, cy = rng.uniform(s / 2, w - s / 2), rng.uniform(s / 2, h - s / 2)
        box = [cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2]
        if kind == 0:
            draw.ellipse(box, fill=color)
        elif kind == 1:
            draw.rectangle(box, fill=color)
        else:
            draw.polygon([(cx, cy - s / 2), (cx - s / 2, cy + s / 2), (cx + s / 2, cy + s / 2)], fill=color)

    for _ in range(int(rng.integers(2, 5))):  # distractors: low saturation, any kind, smaller
        grey = rng.uniform(60, 200)
        shape(int(rng.integers(3)), tuple(int(v) for v in np.clip(grey + rng.uniform(-25, 25, 3), 0, 255)), (0.1, 0.3))
    r, g, b = colorsys.hsv_to_rgb(label / num_classes, 0.85, rng.uniform(0.7, 1.0))
    shape(label % 3, (int(r * 255), int(g * 255), int(b * 255)), (0.4, 0.6))
    pixels = np.asarray(img.filter(ImageFilter.GaussianBlur(1)), np.float32)
    pixels += 4.0 * rng.standard_normal(pixels.shape, np.float32)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_jpeg_records(
    path: str | os.PathLike,
    count: int,
    size: tuple[int, int] = (256, 256),
    seed: int = 0,
    quality: int = 90,
    num_classes: int = 10,
) -> Written:
    """Draw `count` labelled images (see the module docstring) and write them as JPEG records
    into one array_record file at `path`. Labels are ``rng.integers(num_classes)``, seeded."""
    from array_record.python.array_record_module import ArrayRecordWriter

    path = os.fspath(path)
    labels = np.random.default_rng([seed, 2**31]).integers(num_classes, size=count)
    writer = ArrayRecordWriter(path, WRITER_OPTIONS)
    if not writer.ok():
        raise DataError(f"{path}: cannot write an array_record file there")
    jpeg_total = 0
    try:
        for i, label in enumerate(labels):
            buf = io.BytesIO()
            draw_image(int(label), size, seed, i, num_classes).save(buf, "JPEG", quality=quality)
            jpeg = buf.getvalue()
            jpeg_total += len(jpeg)
            writer.write(_HEADER.pack(int(label)) + jpeg)
    finally:
        writer.close()
    return Written(path, count, os.path.getsize(path), jpeg_total / max(count, 1))


_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic)."""
    x = x + _GAMMA
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def crop_keys(seed: int, indices: np.ndarray) -> np.ndarray:
    """One uint64 per index, a function of ``(seed, index)`` only: the crop offsets' bits."""
    with np.errstate(over="ignore"):
        base = _splitmix64(np.full(len(indices), seed % 2**64, np.uint64))
        return _splitmix64(base ^ np.asarray(indices).astype(np.uint64))


class JpegRecords:
    """Random-access reads of a :func:`write_jpeg_records` file, decoded, cropped, normalised."""

    def __init__(
        self,
        path: str | os.PathLike,
        crop: int,
        seed: int,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ):
        from array_record.python.array_record_module import ArrayRecordReader

        self.path, self.crop, self.seed = os.fspath(path), int(crop), int(seed)
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        if self.crop < 1:
            raise DataError(f"{self.path}: crop must be >= 1, got {crop}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise DataError(f"{self.path}: mean and std need 3 channels each, std > 0: got {mean}, {std}")
        if not os.path.isfile(self.path):
            raise DataError(f"{self.path}: no such file")
        if not os.access(self.path, os.R_OK):
            raise DataError(f"{self.path}: not readable (permission denied)")
        # The reader does not raise on a bad file: it reports through ok().
        self._reader = ArrayRecordReader(self.path, READER_OPTIONS)
        if not self._reader.ok():
            raise DataError(f"{self.path}: not an array_record file (the reader cannot open it)")
        self._len = self._reader.num_records()
        # (x / 255 - mean) / std == x * scale + bias. The per-channel factors are tiled along
        # an image row ([crop * 3]): broadcasting a [3] vector makes numpy's inner loop 3 long,
        # 16x slower (125 ms against 7.8 ms for 64 crops of 224).
        scale = 1.0 / (255.0 * np.asarray(self.std))
        self._scale = np.tile(scale, self.crop).astype(np.float32)
        self._bias = np.tile(-np.asarray(self.mean) / np.asarray(self.std), self.crop).astype(np.float32)

    def __getstate__(self) -> dict:
        return {"path": self.path, "crop": self.crop, "seed": self.seed, "mean": self.mean, "std": self.std}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __len__(self) -> int:
        return self._len

    @property
    def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"inputs": ((self.crop, self.crop, 3), np.dtype(np.float32)), "targets": ((), np.dtype(np.int32))}

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Examples at `indices`, in that order."""
        n = len(indices)
        out = {"inputs": np.empty((n, self.crop, self.crop, 3), np.float32), "targets": np.empty(n, np.int32)}
        self.read_into(indices, out)
        return out

    def read_into(self, indices: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """:meth:`read` into `out`'s buffers (the loader's reused host buffers)."""
        idx = checked_indices(indices, self._len, self.path)
        positions = idx.tolist()
        try:
            records = self._reader.read(positions)
        except Exception as e:  # the reader's errors are C++ status strings, possibly multi-line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            some = f"{positions[:4]}{'...' if len(positions) > 4 else ''}"
            raise DataError(f"{self.path}: cannot read records {some}: {first}") from None
        keys = crop_keys(self.seed, idx)
        inputs, targets = out["inputs"], out["targets"]
        if not inputs.flags.c_contiguous:  # each row is written through a reshaped view
            raise ValueError(f"read_into needs a C-contiguous inputs buffer, got strides {inputs.strides}")
        rows_of = (self.crop, self.crop * 3)
        for row, (index, record, key) in enumerate(zip(positions, records, keys.tolist())):
            label, pixels = self._decode(index, record, key)
            targets[row] = label
            dst = inputs[row].reshape(rows_of)  # a view: `out` is C-contiguous per row
            np.multiply(pixels.reshape(rows_of), self._scale, out=dst)
            dst += self._bias

    def _decode(self, index: int, record: bytes, key: int) -> tuple[int, np.ndarray]:
        """Record `index` → (label, its uint8 crop [crop, crop, 3])."""
        where = f"{self.path}: record {index}"
        if len(record) < _HEADER.size + _MIN_JPEG:
            least = _HEADER.size + _MIN_JPEG
            raise DataError(f"{where}: {len(record)} bytes, too short for a label and a JPEG (>= {least})")
        (label,) = _HEADER.unpack_from(record)
        try:
            img = Image.open(io.BytesIO(memoryview(record)[_HEADER.size :]), formats=("JPEG",))
            h, w = img.height, img.width  # from the header, before decoding
            if h < self.crop or w < self.crop:
                raise DataError(f"{where}: image is {h}x{w}, smaller than the {self.crop}x{self.crop} crop")
            img.load()
        except DataError:
            raise
        except UnidentifiedImageError:  # its message names only an anonymous BytesIO
            raise DataError(f"{where}: JPEG does not decode: PIL cannot identify the bytes as a JPEG") from None
        except (OSError, SyntaxError, ValueError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{where}: JPEG does not decode: {reason}") from None
        if img.mode != "RGB":  # greyscale or CMYK JPEGs
            img = img.convert("RGB")
        y = (key >> 32) % (h - self.crop + 1)
        x = (key & 0xFFFFFFFF) % (w - self.crop + 1)
        return label, np.asarray(img)[y : y + self.crop, x : x + self.crop]
