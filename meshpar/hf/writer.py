"""Safetensors files written one tensor at a time, in any dtype the reader knows (bfloat16 too).

The header (dtype, shape and byte range of every tensor, ``__metadata__: {format: pt}``, which
transformers checks) is known from the shapes alone, so it is written first and each tensor's
bytes follow as its producer makes them: the host holds one tensor at a time. The header is
padded with spaces to a multiple of 8 bytes, as the format's own writer does, so that every
tensor starts aligned. A model larger than ``max_shard_bytes`` is split into
``model-0000i-of-0000n.safetensors`` shards in order, with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from meshpar.hf.reader import INDEX, NAMES, SINGLE

# transformers' own default shard size ("5GB").
MAX_SHARD_BYTES = 5 * 10**9


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]  # the tensor, made when its bytes are written

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def write_file(path: Path, entries: Sequence[Entry], metadata: dict | None = None) -> None:
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for e in entries:
        header[e.name] = {
            "dtype": NAMES[np.dtype(e.dtype)],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            dtype = np.dtype(e.dtype)
            dtype = dtype.newbyteorder("<") if dtype.kind in "fiu" else dtype  # the format is little-endian
            array = np.ascontiguousarray(e.produce(), dtype=dtype)
            if array.shape != tuple(e.shape):
                raise ValueError(f"tensor {e.name} was made with shape {array.shape}, announced {tuple(e.shape)}")
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
            del array
        f.flush()
        os.fsync(f.fileno())


def shards(entries: Sequence[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """`entries` in order, cut into runs of at most `max_shard_bytes` (a larger tensor alone)."""
    out: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if out[-1] and size + e.nbytes > max_shard_bytes:
            out.append([])
            size = 0
        out[-1].append(e)
        size += e.nbytes
    return out


def write_folder(folder: Path, entries: Sequence[Entry], max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """``model.safetensors``, or shards and their index when the total exceeds `max_shard_bytes`.
    Returns the names of the files written."""
    groups = shards(entries, max_shard_bytes)
    if len(groups) == 1:
        write_file(folder / SINGLE, entries)
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        write_file(folder / name, group)
        weight_map.update({e.name: name for e in group})
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX]
