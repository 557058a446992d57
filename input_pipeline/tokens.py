"""Tokenized corpora on disk: the format, its writer primitives, and :class:`TokenSource`,
which memory-maps a prepared corpus and serves it as windows of ``length + 1`` tokens.

The spec (the folder's files, ``manifest.json``'s fields, the two window modes, what opening
checks, what reads cost) is in docs/data.md, "The prepared corpus format".
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Literal

import numpy as np

from input_pipeline.batching import checked_indices
from input_pipeline.errors import DataError
from input_pipeline.tokenizer import BYTE, token_dtype

FORMAT = "meshpar-tokens"
VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
CREATED_BY = "python -m meshpar.data prepare"
SPLITS = ("train", "eval")
PREPARE_HINT = "python -m meshpar.data prepare"
# The preparer's temporary files start with this, so that they (and only they) may be removed.
TMP_PREFIX = ".meshpar-tmp-"
_INDEX_DTYPE = np.dtype("<i8")
_SHARD_KEYS = ("tokens", "index", "documents", "tokens_count", "bytes", "sha256", "index_sha256", "max_id")
_HASH_CHUNK = 8 << 20


# ---------------------------------------------------------------------------------------------
# Writing


def shard_stem(split: str, unit: int) -> str:
    """``train-00012``: the shards of work unit 12, numbered by unit so that name order is stream order."""
    return f"{split}-{unit:05d}"


def atomic_write(path: str, data: bytes | memoryview) -> None:
    """`data` at `path`, via a temporary file in the same folder and a rename: a reader (or a
    rerun after a kill) sees the whole file or none of it."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=TMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def json_bytes(obj) -> bytes:
    """The one way this format writes JSON: indented, keys in the order given, a final newline
    (deterministic, so that a resumed preparation writes the same bytes)."""
    return (json.dumps(obj, indent=1) + "\n").encode("utf-8")


def write_shard(
    folder: str, stem: str, documents: Sequence[np.ndarray], separator: np.ndarray, dtype: np.dtype
) -> dict:
    """Write ``<stem>.bin`` and ``<stem>.idx`` (each atomically) from `documents`' ids, each
    followed by `separator`; returns the shard's manifest record. `documents` must not be empty."""
    if not documents:
        raise ValueError("a shard holds at least one document")
    dtype = np.dtype(dtype).newbyteorder("<")
    sep = np.asarray(separator).astype(dtype)
    pieces: list[np.ndarray] = []
    for doc in documents:
        pieces.append(doc)
        pieces.append(sep)
    tokens = np.concatenate(pieces).astype(dtype, copy=False)
    lengths = np.fromiter((len(d) for d in documents), np.int64, len(documents)) + len(sep)
    index = np.cumsum(lengths).astype(_INDEX_DTYPE)
    bin_name, idx_name = f"{stem}.bin", f"{stem}.idx"
    tokens_bytes, index_bytes = memoryview(np.ascontiguousarray(tokens)).cast("B"), index.tobytes()
    atomic_write(os.path.join(folder, bin_name), tokens_bytes)
    atomic_write(os.path.join(folder, idx_name), index_bytes)
    return {
        "tokens": bin_name,
        "index": idx_name,
        "documents": len(documents),
        "tokens_count": int(tokens.size),
        "bytes": int(tokens.nbytes),
        "sha256": hashlib.sha256(tokens_bytes).hexdigest(),
        "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
        "max_id": int(tokens.max()),
    }


def write_manifest(folder: str, manifest: dict) -> None:
    """``manifest.json``, atomically: call it last, since its presence marks the corpus complete."""
    atomic_write(os.path.join(folder, MANIFEST), json_bytes(manifest))


# ---------------------------------------------------------------------------------------------
# Reading the manifest


def read_manifest(path: str) -> dict:
    """The manifest of the prepared corpus at `path`, checked (format, version, the fields a
    reader needs); reads no shard."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise DataError(f"{path}: no such folder (a prepared token corpus is a folder; make one with `{PREPARE_HINT}`)")
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        if os.path.exists(os.path.join(path, PLAN)):
            raise DataError(
                f"{path}: preparation did not finish (plan.json but no manifest.json); "
                f"rerunning the same `{PREPARE_HINT}` command resumes it"
            )
        raise DataError(f"{path} is not a prepared token corpus (no manifest.json); make one with `{PREPARE_HINT}`")
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except OSError as e:
        raise DataError(f"{file}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise DataError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"{file}: format {got!r} is not {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise DataError(f"{file}: version {manifest.get('version')!r}, but this reader knows version {VERSION}")
    try:
        vocab = manifest["tokenizer"]["vocab_size"]
        dtype = manifest["dtype"]
        if not isinstance(vocab, int) or vocab < 1 or np.dtype(dtype) != token_dtype(vocab):
            raise DataError(f"{file}: dtype {dtype!r} does not match vocab_size {vocab!r}")
        for name, split in manifest["splits"].items():
            for key in ("documents", "tokens", "shards"):
                split[key]
            for i, shard in enumerate(split["shards"]):
                for key in _SHARD_KEYS:
                    if key not in shard:
                        raise DataError(f"{file}: shard {i} of split {name!r} has no {key!r}")
    except (KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{file}: missing or malformed field ({type(e).__name__}: {e})") from None
    return manifest


def corpus_vocab_size(path: str) -> int:
    """The vocabulary size of the prepared corpus at `path` (a model's smallest ``vocab_size``)."""
    return int(read_manifest(path)["tokenizer"]["vocab_size"])


def corpus_dtype(path: str) -> np.dtype:
    """The dtype the prepared corpus at `path` serves its tokens in."""
    return np.dtype(read_manifest(path)["dtype"])


def corpus_tokenizer_file(path: str) -> str:
    """``"byte"``, or the tokenizer.json copied into the prepared corpus at `path` (load it with
    :func:`input_pipeline.tokenizer.load`: its config lies beside it, so the separator is the same)."""
    tok = read_manifest(path)["tokenizer"]
    if tok.get("kind") == BYTE:
        return BYTE
    return os.path.join(os.fspath(path), tok["file"])


# ---------------------------------------------------------------------------------------------
# Checksums

# (real path, size, mtime_ns) -> sha256 hex: each file is hashed once per process, and again
# only if it changed on disk.
_HASHED: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str) -> str:
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
        _HASHED[key] = h.hexdigest()
    return _HASHED[key]


# ---------------------------------------------------------------------------------------------
# The source


class TokenSource:
    """Windows of ``length + 1`` tokens of one split of a prepared corpus (see the module's
    docstring), as ``{"tokens": [n, length + 1]}`` in the corpus's dtype: a source for
    :class:`input_pipeline.batching.HostLoader`, as :class:`input_pipeline.text.TextWindows`.

    `vocab_limit`: ids at or above it are an error when read (default: the corpus's vocabulary
    size; pass the model's when it is smaller). `verify`: check every file's sha256 at opening.
    """

    def __init__(
        self,
        path: str,
        split: str,
        length: int,
        windows: Literal["packed", "document"] = "packed",
        vocab_limit: int | None = None,
        verify: bool = True,
    ):
        self._open(os.fspath(path), split, length, windows, vocab_limit, verify, None)

    def _open(self, path, split, length, windows, vocab_limit, verify, manifest) -> None:
        if not isinstance(length, (int, np.integer)) or length < 1:
            raise DataError(f"window length must be a positive integer, got {length!r}")
        if windows not in ("packed", "document"):
            raise DataError(f"windows must be 'packed' or 'document', got {windows!r}")
        self.manifest = manifest = manifest if manifest is not None else read_manifest(path)
        self.path, self.split, self.length, self.windows = path, split, int(length), windows
        splits = manifest["splits"]
        if split not in splits:
            raise DataError(f"{path}: no split {split!r} (the corpus has {', '.join(repr(s) for s in splits)})")
        self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        self.vocab_limit = int(vocab_limit) if vocab_limit is not None else self.vocab_size
        self.verify = verify
        self.dtype = np.dtype(manifest["dtype"])
        self.what = f"split {split!r} of {path}"
        self._files, self._maps, self._indexes = [], [], []
        for rec in splits[split]["shards"]:
            bin_path, tokens, index = self._map_shard(rec)
            self._files.append(bin_path)
            self._maps.append(tokens)
            self._indexes.append(index)
        self._sizes = np.array([m.size for m in self._maps], np.int64)
        self._ends = np.cumsum(self._sizes)  # each shard's end in the split's stream
        self._begins = self._ends - self._sizes
        self.tokens = int(self._ends[-1]) if len(self._maps) else 0
        self.documents = sum(len(i) for i in self._indexes)
        self._cut_windows()
        # The per-read check is skipped only where the dtype cannot hold a bad id (bytes, 256).
        info = np.iinfo(self.dtype)
        self._check_ids = info.max >= self.vocab_limit or info.min < 0

    def _map_shard(self, rec: dict) -> tuple[str, np.ndarray, np.ndarray]:
        """One shard's files checked against its manifest record `rec` and mapped: (.bin path, tokens, index)."""
        bin_path, idx_path = os.path.join(self.path, rec["tokens"]), os.path.join(self.path, rec["index"])
        self._check_size(bin_path, rec["bytes"])
        self._check_size(idx_path, rec["documents"] * _INDEX_DTYPE.itemsize)
        if self.verify:
            for file, want in ((bin_path, rec["sha256"]), (idx_path, rec["index_sha256"])):
                got = file_sha256(file)
                if got != want:
                    raise DataError(
                        f"{file}: sha256 {got[:16]}... differs from the manifest's {want[:16]}... "
                        "(the file changed after preparation)"
                    )
        if rec["max_id"] >= self.vocab_limit:
            raise DataError(
                f"{bin_path}: holds token id {rec['max_id']}, at or above the vocabulary limit {self.vocab_limit}"
            )
        count = rec["tokens_count"]
        tokens = np.memmap(bin_path, dtype=self.dtype.newbyteorder("<"), mode="r", shape=(count,))
        index = np.memmap(idx_path, dtype=_INDEX_DTYPE, mode="r", shape=(rec["documents"],))
        _check_index(idx_path, index, count)
        # A plain ndarray over the map: slicing an np.memmap makes another memmap (its
        # bookkeeping was 60% of the read's time, measured as in the module's docstring).
        return bin_path, tokens.view(np.ndarray), index

    def _cut_windows(self) -> None:
        """Count the split's windows (and the tokens none holds) as `windows` cuts them; refuse a split without one."""
        window = self.length + 1
        if self.tokens < window:
            raise DataError(
                f"{self.what} has {self.tokens} tokens, fewer than one window of {window} (length {self.length} + 1)"
            )
        if self.windows == "packed":
            self._starts = None
            self._len = (self.tokens - 1) // self.length
            self.dropped_tokens = self.tokens - (self._len * self.length + 1)
        else:
            self._starts = self._document_starts()
            self._len = int(self._starts.size)
            if self._len == 0:
                raise DataError(f"{self.what}: no document has {window} tokens (length {self.length} + 1)")

    @staticmethod
    def _check_size(file: str, want: int) -> None:
        try:
            got = os.stat(file).st_size
        except FileNotFoundError:
            raise DataError(f"{file}: shard file missing (the corpus is incomplete; prepare it again)") from None
        except OSError as e:
            raise DataError(f"{file}: cannot read ({e.strerror})") from None
        if got != want:
            raise DataError(f"{file}: {got} bytes, but the manifest says {want} (truncated or rewritten)")

    def _document_starts(self) -> np.ndarray:
        """Every document window's start in the split's stream, documents in order (int64)."""
        ends = np.concatenate([b + i.astype(np.int64) for b, i in zip(self._begins, self._indexes)])
        begins = np.concatenate([[0], ends[:-1]])
        counts = np.maximum((ends - begins - 1) // self.length, 0)
        covered = np.where(counts > 0, counts * self.length + 1, 0)
        self.dropped_tokens = int(self.tokens - covered.sum())
        total = int(counts.sum())
        first = np.cumsum(counts) - counts  # each document's first window number
        k = np.arange(total, dtype=np.int64) - np.repeat(first, counts)
        return np.repeat(begins, counts) + k * self.length

    def __len__(self) -> int:
        return self._len

    @property
    def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"tokens": ((self.length + 1,), self.dtype)}

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Windows at `indices`, in that order: ``{"tokens": [n, length + 1]}``."""
        idx = self._indices(indices)
        out = np.empty((idx.size, self.length + 1), self.dtype)
        self._fill(idx, out)
        return {"tokens": out}

    def read_into(self, indices: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """:meth:`read` into `out`'s buffers (``feed.reuse_buffers``)."""
        self._fill(self._indices(indices), out["tokens"])

    def _indices(self, indices: np.ndarray) -> np.ndarray:
        return checked_indices(indices, self._len, self.what)

    def _fill(self, idx: np.ndarray, out: np.ndarray) -> None:
        window = self.length + 1
        starts = idx * self.length if self._starts is None else self._starts[idx]
        shard = np.searchsorted(self._ends, starts, side="right")
        local = starts - self._begins[shard]
        maps, sizes = self._maps, self._sizes
        for row, (k, off) in enumerate(zip(shard.tolist(), local.tolist())):
            if off + window <= sizes[k]:
                out[row] = maps[k][off : off + window]
            else:  # a packed window that runs on into the next shard(s)
                done = 0
                while done < window:
                    take = min(window - done, int(sizes[k]) - off)
                    out[row, done : done + take] = maps[k][off : off + take]
                    done, k, off = done + take, k + 1, 0
        if self._check_ids and out.size:
            # max (and min for a signed dtype) first: a reduction, no temporary; the mask only on failure.
            if out.max() >= self.vocab_limit or (self.dtype.kind == "i" and out.min() < 0):
                self._report_bad_id(idx, starts, out, (out >= self.vocab_limit) | (out < 0))

    def _report_bad_id(self, idx, starts, out, bad) -> None:
        row, col = (int(v) for v in np.argwhere(bad)[0])
        pos = int(starts[row]) + col
        k = int(np.searchsorted(self._ends, pos, side="right"))
        local = pos - int(self._begins[k])
        doc = int(np.searchsorted(self._indexes[k], local, side="right"))
        raise DataError(
            f"{self._files[k]}: token id {int(out[row, col])} at or above the vocabulary limit {self.vocab_limit} "
            f"in document {doc} of the shard (token {local}), read for example {int(idx[row])} of {self.what}"
        )

    def __reduce__(self):
        # Workers get the arguments and the manifest, and reopen the maps there: no token data
        # travels, and no file is hashed again.
        args = (self.path, self.split, self.length, self.windows, self.vocab_limit, self.manifest)
        return (_reopen, args)


def _reopen(path, split, length, windows, vocab_limit, manifest) -> TokenSource:
    src = TokenSource.__new__(TokenSource)
    src._open(path, split, length, windows, vocab_limit, False, manifest)
    return src


def _check_index(file: str, index: np.ndarray, tokens: int) -> None:
    """Each document ends after the previous one (a span holds at least its separator), and
    the last ends where the shard does."""
    if index.size == 0:
        raise DataError(f"{file}: no documents")
    steps = np.diff(index, prepend=0)
    if (steps <= 0).any():
        d = int(np.argmax(steps <= 0))
        before = int(index[d - 1]) if d else 0
        raise DataError(
            f"{file}: document ends are not strictly increasing (document {d} ends at {int(index[d])}, after {before})"
        )
    if int(index[-1]) != tokens:
        last = int(index[-1])
        raise DataError(f"{file}: the last document ends at token {last}, but the shard holds {tokens} tokens")
