"""What a corpus is made of: input files and folders → documents, each with its train/eval key,
and the work units the preparer (:mod:`input_pipeline.corpus`) cuts them into.

Inputs are files and folders. A folder is walked recursively and its files taken in the order
of their relative posix paths, as :class:`input_pipeline.text.TextSource` takes the standard
library's (hidden entries, ``__pycache__``, ``site-packages`` and ``dist-packages`` skipped,
and the output folder when it lies inside). ``include`` globs filter them (default: every
file): a glob without ``/`` matches a file's name, one with ``/`` its relative path (both
case-sensitive, so a corpus is the same on every machine). A file named directly is always taken.
A plain file is one document, its bytes. A ``.jsonl`` file (or ``.jsonl.gz``) holds one
document per line: the ``text_field`` string of each JSON object (blank lines skipped).

Train/eval is decided per document by :func:`input_pipeline.text.is_eval_file` on a key: a
file's relative path (its name, for a file named directly), exactly as ``TextSource`` keys it,
so a byte-tokenized ``--stdlib`` corpus has TextSource's documents, order and split; a JSON
line's key is ``"<relative path>:<byte offset of the line>"`` (in the decompressed text, for
``.jsonl.gz``).

Work is cut into *units*: runs of consecutive whole files of up to ``shard_mb`` MB (10**6
bytes) of input; a larger ``.jsonl`` is cut into byte ranges of that size, each owning the
lines that *start* inside it (a ``.jsonl.gz`` cannot be cut: it is one unit). Unit ``u``
writes at most one train and one eval shard, ``train-<u>`` and ``eval-<u>``, so the shards in
unit order hold the documents in their global order, whatever finished first. The units, not
the worker count, decide the output: any ``workers`` gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import gzip
import json
import os
from collections.abc import Iterator, Sequence

from input_pipeline import text as text_lib
from input_pipeline.errors import DataError


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str  # absolute
    key: str  # relative posix path: the train/eval key
    size: int
    mtime_ns: int
    kind: str  # "text", "jsonl" or "jsonl.gz"


def _kind(name: str) -> str:
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".jsonl.gz"):
        return "jsonl.gz"
    return "text"


def _included(rel: str, include: Sequence[str] | None) -> bool:
    if not include:
        return True
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(rel if "/" in g else name, g) for g in include)


def _stat(path: str, key: str) -> InputFile:
    try:
        st = os.stat(path)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    return InputFile(path, key, st.st_size, st.st_mtime_ns, _kind(key))


def list_inputs(paths: Sequence[str], include: Sequence[str] | None = None, skip: str | None = None) -> list[InputFile]:
    """The input files of `paths` (files and folders), in corpus order (see the module's docstring);
    `skip`: a folder left out of the walk (the output)."""
    skip_real = os.path.realpath(skip) if skip else None
    found: list[InputFile] = []
    for given in paths:
        path = os.path.abspath(os.path.expanduser(given))
        if os.path.isfile(path):
            found.append(_stat(path, os.path.basename(path)))
            continue
        if not os.path.isdir(path):
            raise DataError(f"input {given}: no such file or folder")
        rels = []
        for root, dirs, files in os.walk(path):
            dirs[:] = [
                d
                for d in dirs
                if not d.startswith(".")
                and d not in text_lib._SKIP_DIRS
                and os.path.realpath(os.path.join(root, d)) != skip_real
            ]
            rel_root = os.path.relpath(root, path)
            for f in files:
                if f.startswith("."):
                    continue
                rel = f if rel_root == "." else f"{rel_root.replace(os.sep, '/')}/{f}"
                if _included(rel, include):
                    rels.append(rel)
        for rel in sorted(rels):
            found.append(_stat(os.path.join(path, *rel.split("/")), rel))
    if not found:
        globs = f" matching {', '.join(include)}" if include else ""
        raise DataError(f"no input files{globs} in {', '.join(paths)}")
    return found


def make_units(files: Sequence[InputFile], unit_bytes: int) -> list[list[list[int]]]:
    """Units of work: each a list of ``[file number, start byte, end byte]`` pieces."""
    units: list[list[list[int]]] = []
    current: list[list[int]] = []
    size = 0
    for i, f in enumerate(files):
        if f.kind == "jsonl" and f.size > unit_bytes:  # cut at byte ranges, each its own unit
            if current:
                units.append(current)
                current, size = [], 0
            for start in range(0, f.size, unit_bytes):
                units.append([[i, start, min(start + unit_bytes, f.size)]])
            continue
        if current and size + f.size > unit_bytes:
            units.append(current)
            current, size = [], 0
        current.append([i, 0, f.size])
        size += f.size
    if current:
        units.append(current)
    return units


# ---------------------------------------------------------------------------------------------
# Documents


def documents(f: InputFile, start: int, end: int, text_field: str) -> Iterator[tuple[str | None, bytes, int]]:
    """(split key, document bytes, input bytes consumed) of a piece of an input file; a blank
    line gives a key of None (bytes consumed, no document)."""
    current = os.stat(f.path)
    if (current.st_size, current.st_mtime_ns) != (f.size, f.mtime_ns):
        raise DataError(f"{f.path}: changed since the preparation was planned (size or modification time)")
    if f.kind == "text":
        with open(f.path, "rb") as fh:
            data = fh.read()
        if len(data) != f.size:
            raise DataError(f"{f.path}: changed while it was read ({len(data)} bytes, planned {f.size})")
        yield f.key, data, f.size
        return
    opener = gzip.open if f.kind == "jsonl.gz" else open
    try:
        with opener(f.path, "rb") as fh:
            if f.kind == "jsonl.gz":
                end, pos = float("inf"), 0  # one unit: every line
            elif start > 0:
                fh.seek(start - 1)
                fh.readline()  # the rest of a line that started before this range (maybe just its "\n")
                pos = fh.tell()
            else:
                pos = 0
            while pos < end:
                line = fh.readline()
                if not line:
                    break
                if line.strip():
                    yield f"{f.key}:{pos}", _line_text(f, pos, line, text_field), len(line)
                else:
                    yield None, b"", len(line)
                pos += len(line)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{f.path}: cannot read ({getattr(e, 'strerror', None) or e})") from None


def _line_text(f: InputFile, pos: int, line: bytes, field: str) -> bytes:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DataError(f"{f.path} line {_line_number(f, pos)}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{f.path} line {_line_number(f, pos)}: a JSON {type(obj).__name__}, not an object")
    if field not in obj:
        raise DataError(f"{f.path} line {_line_number(f, pos)}: no field {field!r}")
    value = obj[field]
    if not isinstance(value, str):
        kind = type(value).__name__
        raise DataError(f"{f.path} line {_line_number(f, pos)}: field {field!r} is a {kind}, not a string")
    return value.encode("utf-8", errors="surrogatepass")


def _line_number(f: InputFile, pos: int) -> int:
    """1-based number of the line starting at byte `pos` (for errors only: reads the file's start)."""
    opener = gzip.open if f.kind == "jsonl.gz" else open
    count, left = 0, pos
    with opener(f.path, "rb") as fh:
        while left > 0:
            chunk = fh.read(min(left, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count + 1
