"""Safetensors files read lazily: headers first, then one tensor's bytes at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range; an optional ``__metadata__``), then the tensors' bytes. The
header is parsed here (the ``safetensors`` package's numpy reader cannot give bfloat16), and a
tensor is read with ``readinto`` into a numpy buffer of its own: a map of the whole file would
count its touched pages in the process's resident memory for as long as it is mapped, while
read pages stay in the kernel's page cache. A folder holds one ``model.safetensors``, or shards
listed by ``model.safetensors.index.json`` (``weight_map``: tensor name → file).

Every problem is a :class:`meshpar.configuration.errors.CheckpointError` naming the file and, where there is
one, the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from meshpar.configuration.errors import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors dtype names → numpy (little-endian, as the format stores them).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}  # fmt: skip
NAMES = {v: k for k, v in DTYPES.items()}
# A header larger than this is no safetensors header (the format's own reader caps it at 100 MB).
MAX_HEADER = 100 * 2**20
_CHUNK = 64 * 2**20  # bytes per read call: some systems cap one read near 2 GiB


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    path: Path
    offset: int  # of its first byte in the file
    nbytes: int

    def describe(self) -> str:
        return f"{NAMES.get(self.dtype, self.dtype)}{list(self.shape)}"


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict]:
    """The tensors of one safetensors file (name → :class:`TensorInfo`) and its ``__metadata__``."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is not a safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise CheckpointError(f"{path} is not a safetensors file (header length {n} of a {size}-byte file)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    start, out = 8 + n, {}
    for name, entry in header.items():
        out[name] = _entry(path, name, entry, start, size)
    return out, metadata


def _entry(path: Path, name: str, entry, start: int, size: int) -> TensorInfo:
    where = f"tensor {name} in {path}"
    try:
        dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        shape = tuple(int(d) for d in shape)
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{where} has a malformed header entry {str(entry)[:80]}") from None
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise CheckpointError(
            f"{where} has dtype {dtype_name}, which meshpar does not read (known: {', '.join(DTYPES)})"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if any(d < 0 for d in shape) or end - begin != nbytes or begin < 0 or start + end > size:
        raise CheckpointError(
            f"{where} has bytes {begin}..{end} for {dtype_name}{list(shape)} ({nbytes} bytes) in a file of {size} bytes"
        )
    return TensorInfo(name, dtype, shape, path, start + begin, nbytes)


def read(info: TensorInfo) -> np.ndarray:
    """One tensor's bytes, read into a new array (C order, its own dtype)."""
    return _read(info, info.offset, info.nbytes, info.shape)


def read_block(info: TensorInfo, part: int, shape: tuple[int, ...]) -> np.ndarray:
    """Block `part` of a tensor read as ``[blocks, *shape]`` (a block's bytes are contiguous),
    read alone into a new array of `shape`."""
    nbytes = math.prod(shape) * info.dtype.itemsize
    if not nbytes or info.nbytes % nbytes or not 0 <= part < info.nbytes // nbytes:
        raise CheckpointError(f"tensor {info.name} in {info.path} has no block {part} of shape {list(shape)}")
    return _read(info, info.offset + part * nbytes, nbytes, shape)


def _read(info: TensorInfo, offset: int, nbytes: int, shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(shape, info.dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    try:
        with open(info.path, "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < nbytes:
                got = f.readinto(view[done : done + _CHUNK])
                if not got:
                    raise CheckpointError(f"tensor {info.name} in {info.path} ends early ({done} of {nbytes} bytes)")
                done += got
    except OSError as e:
        raise CheckpointError(f"cannot read tensor {info.name} from {info.path}: {e.strerror or e}") from None
    return out


class Folder:
    """The safetensors of a model folder: ``model.safetensors``, or the shards its index lists."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index, single = self.folder / INDEX, self.folder / SINGLE
        if index.is_file():
            self.files = self._from_index(index)
            self.tensors = self._sharded(index, self.files)
        elif single.is_file():
            self.files = [single]
            self.tensors, _ = read_header(single)
        else:
            raise CheckpointError(f"{self.folder} holds neither {SINGLE} nor {INDEX}")

    def _from_index(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({str(f) for f in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map of tensor → file)") from None
        self._weight_map = weight_map
        for name in files:
            if Path(name).name != name:  # a shard is a file of this folder, never a path elsewhere
                raise CheckpointError(f"{index} names shard {name!r}, which is not a file name")
            if not (self.folder / name).is_file():
                raise CheckpointError(f"{index} names shard {name}, which {self.folder} does not hold")
        return [self.folder / f for f in files]

    def _sharded(self, index: Path, files: list[Path]) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for path in files:
            found, _ = read_header(path)
            for name, info in found.items():
                if name in tensors:
                    raise CheckpointError(f"tensor {name} is in both {tensors[name].path.name} and {path.name}")
                tensors[name] = info
        for name, file in self._weight_map.items():
            if name not in tensors or tensors[name].path.name != file:
                where = f"in {tensors[name].path.name}" if name in tensors else "in no shard"
                raise CheckpointError(f"{index} puts tensor {name} in {file}, but it is {where}")
        for name, info in tensors.items():
            if name not in self._weight_map:
                raise CheckpointError(f"tensor {name} in {info.path.name} is not in {index.name}'s weight_map")
        return tensors

    def read(self, name: str) -> np.ndarray:
        return read(self.tensors[name])

    def read_block(self, name: str, part: int, shape: tuple[int, ...]) -> np.ndarray:
        return read_block(self.tensors[name], part, shape)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
