"""Language-modelling sources: fixed-length windows of a token stream.

A split's documents become one stream of token ids through a tokenizer
(:mod:`input_pipeline.tokenizer`): by default raw bytes (vocab 256, ``uint8``), or a Hugging
Face tokenizer (ids in ``uint16`` when its vocabulary fits). Example ``i`` is the
window ``stream[i*length : i*length + length + 1]`` (stride ``length``, so consecutive windows
share only their boundary byte and every byte after the first is a target exactly once),
served as one field, ``tokens [length + 1]``, in the narrowest dtype that holds the vocabulary
(:func:`token_dtype`: ``uint8`` for bytes). The model cuts ``inputs = tokens[:-1]`` and
``targets = tokens[1:]`` itself, on the devices: the host sends ``length + 1`` bytes per
example (bytes) instead of two int32 ``[length]`` arrays (``8 * length`` bytes), ~8x fewer.
Reads are random-access, so the host loader's seeded permutation decides the order.

Corpora:
  * :class:`TextSource` — by default the Python standard library's own ``.py`` files, found at
    run time (``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages``/``dist-packages``),
    sorted by relative path and split train/eval *by file*: a file is in eval iff the first 8
    bytes of ``sha256(relative posix path)``, as a fraction of 2**64, are below
    ``eval_fraction``. Stable across runs, machines and Python versions' hash seeds.
  * :func:`from_tfds` — every row of a tfds Text feature.
Documents (files, rows) are joined with the tokenizer's end-of-document ids: ``SEPARATOR``
(``b"\\n"``) for bytes. A Hugging Face tokenizer's stream is kept in a cache folder when one is
given (``cache_dir``), since tokenizing the standard library takes seconds.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Sequence
from typing import Literal

import numpy as np

from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.batching import checked_indices
from input_pipeline.errors import DataError
from input_pipeline.tfds_source import TfdsSource  # tfds itself loads only when a source opens
from input_pipeline.tokenizer import Tokenizer, token_dtype

VOCAB_SIZE = 256
SEPARATOR = tokenizer_lib.BYTE_SEPARATOR
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def tokenize_bytes(texts: Sequence[bytes], separator: bytes = SEPARATOR) -> np.ndarray:
    """Join documents with `separator` into one uint8 token stream (byte = token)."""
    return np.frombuffer(separator.join(bytes(t) for t in texts), dtype=np.uint8).copy()


class TextWindows:
    """Windows of ``length + 1`` tokens at stride ``length`` over a 1-D stream of token ids in
    ``[0, vocab_size)``, as ``{"tokens": [n, length + 1]}`` of :func:`token_dtype` (vocab_size)."""

    def __init__(self, token_stream: np.ndarray, length: int, what: str = "token stream", vocab_size: int = VOCAB_SIZE):
        if length < 1:
            raise DataError(f"window length must be >= 1, got {length}")
        stream = np.asarray(token_stream)
        if stream.ndim != 1:
            raise DataError(f"{what}: token stream must be 1-D, got shape {stream.shape}")
        if stream.size < length + 1:
            raise DataError(
                f"{what} has {stream.size} tokens, fewer than one window of {length + 1} (length {length} + 1)"
            )
        if not np.issubdtype(stream.dtype, np.integer):
            raise DataError(f"{what}: token ids must be integers, got dtype {stream.dtype}")
        # Ids are checked and narrowed once here, so windows are cut without a cast (a byte
        # stream under the byte vocabulary needs neither).
        if np.iinfo(stream.dtype).min < 0 or np.iinfo(stream.dtype).max >= vocab_size:
            low, high = int(stream.min()), int(stream.max())
            if low < 0 or high >= vocab_size:
                raise DataError(f"{what}: token ids span [{low}, {high}], outside the vocabulary [0, {vocab_size})")
        stream = stream.astype(token_dtype(vocab_size), copy=False)
        self.tokens, self.length, self.what, self.vocab_size = stream, length, what, vocab_size
        self._len = (stream.size - 1) // length

    def __len__(self) -> int:
        return self._len

    @property
    def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"tokens": ((self.length + 1,), self.tokens.dtype)}

    def _positions(self, indices: np.ndarray) -> np.ndarray:
        idx = checked_indices(indices, self._len, self.what)
        return idx[:, None] * self.length + np.arange(self.length + 1)  # [n, length + 1]

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Windows at `indices`, in that order: ``{"tokens": [n, length + 1]}``."""
        return {"tokens": self.tokens[self._positions(indices)]}

    def read_into(self, indices: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """:meth:`read` into `out`'s buffers (``feed.reuse_buffers``)."""
        np.take(self.tokens, self._positions(indices), out=out["tokens"])


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_py_files(corpus_dir: str) -> list[str]:
    """Relative posix paths of every ``.py`` file under `corpus_dir`, sorted (no site-packages)."""
    if not os.path.isdir(corpus_dir):
        raise DataError(f"corpus_dir does not exist: {corpus_dir}")
    found = []
    for root, dirs, files in os.walk(corpus_dir):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel = os.path.relpath(root, corpus_dir)
        for f in files:
            if f.endswith(".py"):
                found.append(f if rel == "." else f"{rel.replace(os.sep, '/')}/{f}")
    if not found:
        raise DataError(f"corpus_dir has no .py files: {corpus_dir}")
    return sorted(found)


def is_eval_file(rel_path: str, eval_fraction: float) -> bool:
    """Deterministic split by file: sha256 of the relative path, as a fraction in [0, 1)."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < eval_fraction


def split_files(files: Sequence[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    """(train, eval) file lists; disjoint, union = `files`, each in the order given."""
    train, evals = [], []
    for f in files:
        (evals if is_eval_file(f, eval_fraction) else train).append(f)
    return train, evals


def cap_documents(texts: Sequence[bytes], max_bytes: int | None) -> list[bytes]:
    """The documents whose ``SEPARATOR``-joined bytes are the first `max_bytes` of `texts`
    joined (the last one cut short): the same text under every tokenizer."""
    if max_bytes is None:
        return list(texts)
    out, total = [], 0
    for t in texts:
        if out:
            total += len(SEPARATOR)
        if total > max_bytes:
            break
        out.append(t[: max_bytes - total])
        total += len(out[-1])
    return out


class TextSource(TextWindows):
    """Token windows of one split of a directory of ``.py`` files (default: Python's stdlib).

    `max_bytes` keeps only the first `max_bytes` bytes of the split (files in sorted order),
    reading no more files than that needs; then `tokenizer` (default bytes) makes them ids.
    `cache_dir`: where a Hugging Face tokenizer's stream is kept (None = tokenize every time).
    """

    def __init__(
        self,
        split: Literal["train", "eval"],
        length: int,
        corpus_dir: str | None = None,
        eval_fraction: float = 0.05,
        max_bytes: int | None = None,
        tokenizer: Tokenizer | None = None,
        cache_dir: str | None = None,
    ):
        if split not in ("train", "eval"):
            raise DataError(f"split must be 'train' or 'eval', got {split!r}")
        if not 0.0 <= eval_fraction <= 1.0:
            raise DataError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
        if max_bytes is not None and max_bytes < 1:
            raise DataError(f"max_bytes must be positive, got {max_bytes}")
        self.corpus_dir = os.fspath(corpus_dir) if corpus_dir is not None else stdlib_dir()
        self.split = split
        train, evals = split_files(list_py_files(self.corpus_dir), eval_fraction)
        self.files = train if split == "train" else evals  # every file of the split
        texts, total = [], 0
        for rel in self.files:
            with open(os.path.join(self.corpus_dir, rel), "rb") as f:
                texts.append(f.read())
            total += len(texts[-1]) + len(SEPARATOR)
            if max_bytes is not None and total >= max_bytes:
                break
        self.files_read = self.files[: len(texts)]
        self.tokenizer = tokenizer = tokenizer or tokenizer_lib.ByteTokenizer()
        if isinstance(tokenizer, tokenizer_lib.ByteTokenizer):
            stream = tokenize_bytes(texts)[:max_bytes]
        else:
            key = (f"text split={split}", f"max_bytes={max_bytes or 0}")
            stream = tokenizer_lib.encode_documents(tokenizer, cap_documents(texts, max_bytes), cache_dir, key)
        what = f"split {split!r} of {self.corpus_dir} ({len(self.files)} files)"
        super().__init__(stream, length, what=what, vocab_size=tokenizer.vocab_size)


def from_tfds(
    name: str,
    split: str,
    data_dir: str,
    feature: str = "text",
    *,
    length: int,
    tokenizer: Tokenizer | None = None,
    cache_dir: str | None = None,
) -> TextWindows:
    """Token windows over every row of a tfds Text `feature`, rows joined with the tokenizer's
    end-of-document ids (default bytes: ``SEPARATOR``); `cache_dir` as for :class:`TextSource`."""
    src = TfdsSource(name, split, data_dir, {"text": feature})
    (shape, dtype) = src.element_spec["text"]
    if dtype != np.dtype(object) or shape != ():
        raise DataError(f"feature {feature!r} of dataset {name!r} is not a Text feature (shape={shape}, dtype={dtype})")
    rows = src.read(np.arange(len(src)))["text"]
    what = f"split {split!r} of tfds dataset {name!r} feature {feature!r}"
    tokenizer = tokenizer or tokenizer_lib.ByteTokenizer()
    key = (f"tfds {name} split={split} feature={feature}",)
    stream = tokenizer_lib.encode_documents(tokenizer, [bytes(r) for r in rows], cache_dir, key)
    return TextWindows(stream, length, what=what, vocab_size=tokenizer.vocab_size)
