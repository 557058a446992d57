"""Random-access reader for a TFDS dataset prepared as array_record, no TF.

`tfds.data_source` serves array_record files through tfds's pure-numpy
deserializer, so the host pipeline can fetch arbitrary rows by index (for
deterministic, resumable sharded sampling) without TensorFlow installed.
Nothing here downloads: `data_dir` must already hold the prepared dataset.
Image features are PNG/JPEG on disk and tfds decodes them with Pillow (or
OpenCV); it logs a one-time "OpenCV is not installed" warning when using PIL.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Callable

import numpy as np

from input_pipeline.batching import checked_indices
from input_pipeline.errors import DataError

Spec = tuple[tuple[int, ...], np.dtype]


def _one_line(err: BaseException) -> str:
    # tfds messages are often multi-line (e.g. the list of every registered
    # dataset); keep only the first line so our DataError stays one line.
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


# The names read here: tfds's grammar without a namespace (community datasets are fetched, not
# read from data_dir) or builder kwargs (``name/data_dir=...`` would point tfds elsewhere).
# Every part is one path component under data_dir: ``DATASET[/CONFIG][:VERSION]``.
_NAME = re.compile(r"(?P<dataset>[A-Za-z]\w*)(/(?P<config>[\w+\-.]+))?(:(?P<version>(\d+|\*)(\.(\d+|\*)){2}))?")
_SHOWN = 12  # folders listed in an error line, at most


def name_problem(name: str) -> str | None:
    """Why `name` is not a dataset name this source reads (None when it is). A name is never a
    path: it names folders inside ``data_dir`` and nothing outside it."""
    m = _NAME.fullmatch(name)
    if m and not (m["config"] and set(m["config"]) == {"."}):
        return None
    path = any(c in name for c in "/\\") or name.startswith((".", "~"))
    hint = "; a dataset name is not a path: the folder that holds the datasets is data.data_dir" if path else ""
    return f"{name!r} is not a tfds dataset name: expected NAME[/CONFIG][:VERSION], e.g. mnist or mnist:3.0.1{hint}"


def _folders(folder: str) -> str:
    """The sub-folders of `folder` (one inside data_dir), for an error line."""
    try:
        names = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)) and d != "downloads")
    except OSError as e:
        return f"cannot list it: {e.strerror or e}"
    more = f", and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more if names else "no folders"


def _missing(data_dir: str, parts: list[str]) -> tuple[str, str] | None:
    """The first of the folders `parts` (dataset, config, version) leads to under data_dir that
    does not exist, and the folder before it; None when all do."""
    for i in range(1, len(parts) + 1):
        if not os.path.isdir(os.path.join(data_dir, *parts[:i])):
            return "/".join(parts[:i]), "/".join(parts[: i - 1])
    return None


def _converter(key: str, feat) -> tuple[Spec, Callable[[list], np.ndarray]]:
    """Per-example spec + batch converter for one tfds feature connector."""
    import tensorflow_datasets as tfds  # loaded by TfdsSource already; a lookup here

    shape, dtype = tuple(feat.shape), np.dtype(feat.np_dtype)
    if isinstance(feat, tfds.features.Image):
        if dtype != np.uint8 or None in shape or len(shape) != 3:
            raise DataError(
                f"image feature {key!r} must be uint8 with a fixed HxWxC shape, got shape={shape} dtype={dtype}"
            )
        if not (importlib.util.find_spec("PIL") or importlib.util.find_spec("cv2")):
            raise DataError(f"image feature {key!r} needs Pillow (or OpenCV) to decode: pip install pillow")
        size = int(np.prod(shape))

        # Flattened float32 in [0, 1]: what an MLP consumes as "pixels".
        def images(vals):
            arr = np.asarray(vals, dtype=np.uint8).reshape(len(vals), size)
            return arr.astype(np.float32) / np.float32(255.0)

        return ((size,), np.dtype(np.float32)), images
    if isinstance(feat, tfds.features.Text):
        # Raw UTF-8 bytes; tokenization happens elsewhere. np.empty + slice
        # assignment guarantees a 1-D object array whatever the contents.
        def texts(vals):
            out = np.empty(len(vals), dtype=object)
            out[:] = [bytes(v) for v in vals]
            return out

        return ((), np.dtype(object)), texts
    if shape == () and np.issubdtype(dtype, np.integer):  # ClassLabel, ids
        return ((), np.dtype(np.int32)), lambda vals: np.asarray(vals, dtype=np.int32)
    if isinstance(feat, tfds.features.Tensor) and None not in shape and np.dtype(dtype).kind != "O":
        # Fixed-shape numeric tensors pass through unchanged.
        return (shape, dtype), lambda vals: np.asarray(vals, dtype=dtype).reshape((len(vals), *shape))
    raise DataError(
        f"feature {key!r} of type {type(feat).__name__} (shape={shape}, dtype={dtype}) "
        "is not supported; use an Image, Text, integer scalar or fixed-shape Tensor"
    )


def _builder(tfds, name: str, data_dir: str):
    """tfds's (the module `tfds`) builder of the prepared dataset `name` in `data_dir`; else what is missing."""
    problem = name_problem(name)
    if problem:
        raise DataError(problem)
    if not os.path.isdir(data_dir):
        raise DataError(f"data_dir does not exist: {data_dir}")
    # Check the dataset directory ourselves: for names tfds ships code for
    # (e.g. "mnist") tfds.builder would happily build an empty code builder
    # and fail later with a confusing split error. Error lines list folders
    # inside data_dir only: the name is checked above to stay inside it.
    m = _NAME.fullmatch(name)
    base = m["dataset"]
    if not os.path.isdir(os.path.join(data_dir, base)):
        raise DataError(
            f"dataset {name!r} not found: no folder {base} in data_dir {data_dir} "
            f"(datasets there: {_folders(data_dir)})"
        )
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # tfds raises many types, all multi-line
        parts = [p for p in (base, m["config"], m["version"]) if p and "*" not in p]
        missing = _missing(data_dir, parts)
        if missing:  # tfds would say "Dataset <name> not found" of a dataset that is there
            wanted, parent = missing
            raise DataError(
                f"dataset {name!r} not found: no folder {wanted} in data_dir {data_dir} "
                f"({parent}/ holds: {_folders(os.path.join(data_dir, parent))})"
            ) from None
        raise DataError(
            f"cannot load dataset {name!r} from data_dir {data_dir}: {_one_line(e)} "
            f"({'/'.join(parts)}/ holds: {_folders(os.path.join(data_dir, *parts))})"
        ) from None
    if not builder.is_prepared():
        raise DataError(f"dataset {name!r} is not prepared in data_dir {data_dir} (expected {builder.data_path})")
    return builder


def _check_split(info, name: str, split: str, data_dir: str) -> None:
    """Refuse a split the dataset (its tfds `info`) does not have, or one without examples."""
    available = list(info.splits)
    try:
        num_examples = info.splits[split].num_examples  # handles "train[:10%]"
    except (ValueError, KeyError) as e:
        raise DataError(
            f"split {split!r} is not valid for dataset {name!r} in {data_dir} "
            f"(available splits: {', '.join(available)}): {_one_line(e)}"
        ) from None
    if num_examples == 0:
        raise DataError(f"split {split!r} of dataset {name!r} in {data_dir} is empty")


def _converters(features, name: str, fields: dict[str, str]) -> tuple[dict[str, Spec], dict[str, tuple[str, Callable]]]:
    """(output field -> its spec, output field -> (feature key, batch converter)) for `fields`."""
    if not fields:
        raise DataError(f"no fields requested from dataset {name!r}")
    convert: dict[str, tuple[str, Callable]] = {}
    spec: dict[str, Spec] = {}
    for out_name, key in fields.items():
        if key not in features.keys():
            raise DataError(
                f"field {out_name!r} names feature key {key!r} which dataset "
                f"{name!r} lacks (available: {', '.join(features.keys())})"
            )
        spec[out_name], conv = _converter(key, features[key])
        convert[out_name] = (key, conv)
    return spec, convert


class TfdsSource:
    """Rows of one split of a prepared TFDS dataset, fetched by index.

    `fields` maps output field name -> tfds feature key, e.g.
    {"inputs": "image", "targets": "label"}.
    """

    def __init__(self, name: str, split: str, data_dir: str, fields: dict[str, str]):
        try:  # here, not at import: the other sources run on images without tfds
            import tensorflow_datasets as tfds
        except ImportError:
            raise DataError(
                f"dataset {name!r}: tensorflow_datasets is not installed (pip install tensorflow-datasets)"
            ) from None
        data_dir = os.fspath(data_dir)
        self.name, self.split, self.data_dir = name, split, data_dir
        info = _builder(tfds, name, data_dir).info
        _check_split(info, name, split, data_dir)
        self._spec, self._convert = _converters(info.features, name, fields)
        try:
            self._source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
        except Exception as e:  # e.g. prepared as tfrecord, not array_record
            raise DataError(
                f"cannot open {name!r} split {split!r} in {data_dir} for random "
                f"access (needs file_format=array_record): {_one_line(e)}"
            ) from None
        self._len = len(self._source)

    def __len__(self) -> int:
        return self._len

    @property
    def element_spec(self) -> dict[str, Spec]:
        """Per-example (shape, dtype) of each output field, from dataset info."""
        return dict(self._spec)

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows at `indices`, in that order, stacked per output field."""
        idx = checked_indices(indices, self._len, f"{self.name!r} split {self.split!r}")
        if idx.size == 0:
            return {k: np.zeros((0, *s), dtype=d) for k, (s, d) in self._spec.items()}
        keys = [int(i) for i in idx]
        # One batched array_record read (threads per shard) instead of N calls.
        if hasattr(self._source, "__getitems__"):
            rows = self._source.__getitems__(keys)
        else:
            rows = [self._source[i] for i in keys]
        return {out: conv([row[key] for row in rows]) for out, (key, conv) in self._convert.items()}
