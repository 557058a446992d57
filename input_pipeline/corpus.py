"""Preparing a tokenized corpus: files and JSON lines → shards on disk (:mod:`input_pipeline.tokens`).

What the inputs are (files, folders, JSON lines), how each document's train/eval key is made
and how the work is cut into units: :mod:`input_pipeline.documents`.

Units run in a ``spawn`` process pool (``workers`` processes, each loading the tokenizer once),
or in this process when one worker (or one unit) is left. A corpus of one unit (the standard
library under the default 64 MB) gets its parallelism from the ``tokenizers`` library's own
threads. With several workers the library's threads are turned off in them
(``TOKENIZERS_PARALLELISM=false``): measured on a two-core machine with the 2k BPE over the
standard library cut into 8 units (``--shard-mb 4``), two workers took 23.4 s with the library's
threads on and 13.3 s with them off, since two pools of threads per core only contend. (On that
machine two busy processes each ran at half speed, so one process with the library's threads,
10.1 s, beat both; ``workers=1`` is the choice there.)

Resuming: ``plan.json`` (inputs with size and mtime_ns, units, tokenizer fingerprint, options)
is written first; each finished unit writes ``units/<u>.json`` (its shards' manifest records)
after its shards; every file goes to a temporary name and is renamed. A rerun of the same
preparation reads the plan, refuses if an input or option differs (naming it), removes the
temporaries a killed run left, skips units whose record and shards (at their recorded sizes)
exist, and assembles ``manifest.json`` from the records: killed at any point and rerun, the
corpus comes out byte for byte the same (``manifest.json``'s ``seconds`` apart). A folder that
is not empty and holds no ``plan.json`` is refused: the preparer never overwrites or removes
files that are not its own.

The library prints nothing: ``progress(done_bytes, total_bytes)`` reports input bytes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from input_pipeline import documents as documents_lib
from input_pipeline import text as text_lib
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline import tokens as tokens_lib
from input_pipeline.errors import DataError
from input_pipeline.tokenizer import Tokenizer
from input_pipeline.workers import exit_with_parent

PLAN_FORMAT = "meshpar-tokens-plan"
PLAN_VERSION = 1
UNITS = "units"
MB = 10**6
DEFAULT_EVAL_FRACTION = 0.05  # as the text source's
DEFAULT_SHARD_MB = 64.0
MAX_WORKERS = 256  # as data.workers: no host needs more, and each costs a process and a tokenizer
STDLIB_INCLUDE = ("*.py",)
# Input handed to the tokenizer per encode_batch call, as input_pipeline.tokenizer does: bounds
# the memory of the library's Encoding objects while giving every core documents to work on.
_CHUNK_BYTES = 4 << 20

Progress = Callable[[int, int], None]


@dataclasses.dataclass
class Result:
    output: str
    already_complete: bool  # nothing was done: the corpus was complete before
    units: int
    units_skipped: int  # done by an earlier, interrupted run
    files: int
    input_bytes: int
    bytes_read: int  # by this run
    documents: dict[str, int]
    tokens: dict[str, int]
    seconds: float


# ---------------------------------------------------------------------------------------------
# One unit


def _unit_file(out: str, unit: int) -> str:
    return os.path.join(out, UNITS, f"{unit:05d}.json")


def run_unit(
    out: str,
    unit: int,
    pieces: Sequence[tuple[documents_lib.InputFile, int, int]],
    tokenizer: Tokenizer,
    eval_fraction: float,
    text_field: str,
    tick: Callable[[int], None] | None = None,
) -> dict:
    """Tokenize one unit, write its shards and then its done record; returns the record."""
    docs: dict[str, list[np.ndarray]] = {"train": [], "eval": []}
    chunk: list[bytes] = []
    where: list[str] = []
    size = consumed = 0

    def flush() -> None:
        nonlocal size, consumed
        for split, ids in zip(where, tokenizer.encode_batch(chunk)):
            docs[split].append(ids)
        chunk.clear()
        where.clear()
        if tick and consumed:
            tick(consumed)
        size = consumed = 0

    for f, start, end in pieces:
        for key, data, used in documents_lib.documents(f, start, end, text_field):
            consumed += used
            if key is None:
                continue
            chunk.append(data)
            where.append("eval" if text_lib.is_eval_file(key, eval_fraction) else "train")
            size += len(data)
            if size >= _CHUNK_BYTES:
                flush()
    flush()
    record: dict = {"unit": unit, "input_bytes": sum(e - s for _, s, e in pieces), "shards": {}}
    for split in tokens_lib.SPLITS:
        if docs[split]:
            stem = tokens_lib.shard_stem(split, unit)
            shard = tokens_lib.write_shard(out, stem, docs[split], tokenizer.separator, tokenizer.dtype)
            record["shards"][split] = shard
        else:
            record["shards"][split] = None
    tokens_lib.atomic_write(_unit_file(out, unit), tokens_lib.json_bytes(record))
    return record


def _unit_done(out: str, unit: int) -> dict | None:
    """The done record of `unit` when it and its shards (at their recorded sizes) exist."""
    try:
        with open(_unit_file(out, unit), encoding="utf-8") as f:
            record = json.load(f)
        if record["unit"] != unit:
            return None
        for rec in record["shards"].values():
            if rec is None:
                continue
            if os.path.getsize(os.path.join(out, rec["tokens"])) != rec["bytes"]:
                return None
            if os.path.getsize(os.path.join(out, rec["index"])) != rec["documents"] * 8:
                return None
        return record
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _init_worker(parent_pid: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before the library first runs (see the module's docstring)
    # A pool's workers outlive a SIGKILLed preparer (blocked on its queue, forever) and could
    # still be renaming shards into the folder when the rerun starts: they go with it.
    exit_with_parent(parent_pid)


def _worker_unit(job: tuple) -> tuple[int, dict]:
    spec, fingerprint, out, unit, pieces, eval_fraction, text_field = job
    tok = tokenizer_lib.load(spec)  # once per process: load() keeps it while the file is unchanged
    if tok.fingerprint != fingerprint:
        raise DataError(f"tokenizer {spec} changed while the corpus was being prepared")
    return unit, run_unit(out, unit, pieces, tok, eval_fraction, text_field)


# ---------------------------------------------------------------------------------------------
# The preparation


def _tmp_files(folder: str) -> list[str]:
    try:
        return [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(tokens_lib.TMP_PREFIX)]
    except FileNotFoundError:
        return []


def _remove_temporaries(out: str) -> None:
    """What a killed run left half-written: only the preparer's own temporary names."""
    for path in _tmp_files(out) + _tmp_files(os.path.join(out, UNITS)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _plan_difference(old: dict, new: dict) -> str | None:
    """What differs between the plan on disk and this run's, in words (None: the same)."""
    if old.get("format") != PLAN_FORMAT or old.get("version") != PLAN_VERSION:
        return f"not a plan this preparer knows (format {old.get('format')!r}, version {old.get('version')!r})"
    if old.get("tokenizer", {}).get("fingerprint") != new["tokenizer"]["fingerprint"]:
        was = old.get("tokenizer", {}).get("spec")
        return f"a different tokenizer ({new['tokenizer']['spec']}; the plan was made with {was})"
    for key, value in new["options"].items():
        planned = old.get("options", {}).get(key)
        if planned != value:
            return f"a different --{key.replace('_', '-')} ({value!r}; the plan has {planned!r})"
    was = {f["path"]: f for f in old.get("inputs", [])}
    now = {f["path"]: f for f in new["inputs"]}
    for path in now:
        if path not in was:
            return f"input file {path} added since the plan was made"
    for path in was:
        if path not in now:
            return f"input file {path} removed since the plan was made"
    for path, f in now.items():
        size = was[path]["size"]
        if (size, was[path]["mtime_ns"]) != (f["size"], f["mtime_ns"]):
            return f"input file {path} changed since the plan was made (size {size} -> {f['size']}, or its time)"
    if old.get("inputs") != new["inputs"] or old.get("units") != new["units"]:
        return "the inputs in a different order or division into units"
    return None


def prepare(
    tokenizer: str,
    inputs: Sequence[str] | None,
    output: str,
    *,
    stdlib: bool = False,
    workers: int | None = None,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    include: Sequence[str] | None = None,
    text_field: str = "text",
    shard_mb: float = DEFAULT_SHARD_MB,
    progress: Progress | None = None,
) -> Result:
    """Prepare (or resume preparing) the corpus of `inputs` (or the standard library, `stdlib`)
    under `tokenizer` (``"byte"`` or a tokenizer.json / its folder) into the folder `output`.
    A file that cannot be read or written (a full disk, a folder without permission) is a
    one-line DataError naming it; what was written so far is kept for a rerun to resume."""
    try:
        return _prepare(
            tokenizer, inputs, output, stdlib=stdlib, workers=workers, eval_fraction=eval_fraction,
            include=include, text_field=text_field, shard_mb=shard_mb, progress=progress,
        )  # fmt: skip
    except OSError as e:
        raise DataError(f"{e.filename or output}: {e.strerror or e}") from None


def _prepare(
    tokenizer: str,
    inputs: Sequence[str] | None,
    output: str,
    *,
    stdlib: bool,
    workers: int | None,
    eval_fraction: float,
    include: Sequence[str] | None,
    text_field: str,
    shard_mb: float,
    progress: Progress | None,
) -> Result:
    began = time.perf_counter()
    workers = _check_options(inputs, stdlib, eval_fraction, shard_mb, workers)
    if stdlib:
        inputs, include = [text_lib.stdlib_dir()], list(include or STDLIB_INCLUDE)
    include = list(include) if include else []
    out = os.path.abspath(os.path.expanduser(output))
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"output {output} exists and is not a folder")

    tok = tokenizer_lib.load(tokenizer)
    hf_file = None if isinstance(tok, tokenizer_lib.ByteTokenizer) else tokenizer_lib.tokenizer_file(tokenizer)
    files = documents_lib.list_inputs(inputs, include, skip=out)
    units = documents_lib.make_units(files, max(1, int(shard_mb * MB)))
    options = {"eval_fraction": eval_fraction, "include": include, "text_field": text_field, "shard_mb": shard_mb}
    plan = _make_plan(tok, hf_file, files, units, options)
    total = sum(f.size for f in files)
    if _open_output(out, output, plan):
        splits = tokens_lib.read_manifest(out)["splits"]
        seconds = time.perf_counter() - began
        return _result(out, True, len(units), len(units), len(files), total, 0, splits, seconds)
    tok_record = _copy_tokenizer(out, tok, hf_file)

    records = _done_units(out, len(units))
    skipped = len(records)
    done = sum(records[u]["input_bytes"] for u in records)
    if progress:
        progress(done, total)
    todo = {u: [(files[i], s, e) for i, s, e in units[u]] for u in range(len(units)) if u not in records}
    if len(todo) <= 1 or workers == 1:
        bytes_read = _run_here(out, todo, tok, eval_fraction, text_field, records, done, total, progress)
    else:
        spec = (hf_file or tokenizer_lib.BYTE, tok.fingerprint)
        bytes_read = _run_in_pool(out, todo, spec, eval_fraction, text_field, workers, records, done, total, progress)

    splits = _splits(records, len(units))
    seconds = time.perf_counter() - began
    tokens_lib.write_manifest(out, _manifest(tok, tok_record, options, splits, len(files), total, seconds))
    return _result(out, False, len(units), skipped, len(files), total, bytes_read, splits, seconds)


def _check_options(
    inputs: Sequence[str] | None, stdlib: bool, eval_fraction: float, shard_mb: float, workers: int | None
) -> int:
    """Refuse options out of range; returns the number of workers (default: one per core)."""
    if stdlib == bool(inputs):
        raise DataError("give input files or folders, or the standard library, not both or neither")
    if not 0.0 <= eval_fraction <= 1.0:
        raise DataError(f"eval fraction must be in [0, 1], got {eval_fraction}")
    if not shard_mb > 0:
        raise DataError(f"shard size must be positive, got {shard_mb} MB")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if not 1 <= workers <= MAX_WORKERS:
        raise DataError(f"workers must be from 1 to {MAX_WORKERS}, got {workers}")
    return workers


def _make_plan(
    tok: Tokenizer,
    hf_file: str | None,
    files: list[documents_lib.InputFile],
    units: list[list[list[int]]],
    options: dict,
) -> dict:
    """The plan of this run (``plan.json``): what a rerun must match to resume it."""
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "tokenizer": {
            "spec": os.path.abspath(hf_file) if hf_file else tokenizer_lib.BYTE,
            "fingerprint": tok.fingerprint,
        },
        "options": options,
        "inputs": [dataclasses.asdict(f) for f in files],
        "units": units,
    }


def _open_output(out: str, output: str, plan: dict) -> bool:
    """Resume in `out` (same plan) or start it (new or empty, plan written); True when already complete."""
    plan_path = os.path.join(out, tokens_lib.PLAN)
    if os.path.exists(plan_path):
        diff = _plan_difference(_read_plan(plan_path), plan)
        if diff:
            raise DataError(
                f"{plan_path}: {diff}; rerun with the inputs and options it was made with, or prepare into a new folder"
            )
        if os.path.exists(os.path.join(out, tokens_lib.MANIFEST)):
            return True
        _remove_temporaries(out)
    else:
        if os.path.isdir(out):
            foreign = sorted(n for n in os.listdir(out) if not n.startswith(tokens_lib.TMP_PREFIX))
            if foreign:
                more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
                raise DataError(
                    f"output {output} is not empty and holds no plan.json (it has {foreign[0]!r}{more}): "
                    "prepare into a new or empty folder"
                )
        os.makedirs(out, exist_ok=True)
        _remove_temporaries(out)
        tokens_lib.atomic_write(plan_path, tokens_lib.json_bytes(plan))
    os.makedirs(os.path.join(out, UNITS), exist_ok=True)
    return False


def _read_plan(plan_path: str) -> dict:
    """The plan an earlier run left at `plan_path`, or a DataError when it cannot be read."""
    try:
        with open(plan_path, encoding="utf-8") as f:
            old = json.load(f)
        if not isinstance(old, dict):
            raise ValueError("not an object")
    except (OSError, ValueError) as e:
        raise DataError(f"{plan_path}: unreadable ({e}); prepare into a new folder") from None
    return old


def _copy_tokenizer(out: str, tok: Tokenizer, hf_file: str | None) -> dict:
    """Copy a Hugging Face tokenizer (and its config) into `out`; returns the manifest's tokenizer record."""
    record: dict = {"kind": tokenizer_lib.BYTE, "sha256": tokenizer_lib.BYTE}
    if hf_file:
        record = {"kind": "hf", "file": "tokenizer.json"}
        config = os.path.join(os.path.dirname(hf_file), "tokenizer_config.json")
        for src, name in ((hf_file, "tokenizer.json"), (config, "tokenizer_config.json")):
            if name == "tokenizer.json" or os.path.isfile(config):
                data = _read(src)
                if name == "tokenizer.json":
                    record["sha256"] = hashlib.sha256(data).hexdigest()
                dest = os.path.join(out, name)
                if not (os.path.isfile(dest) and _read(dest) == data):
                    tokens_lib.atomic_write(dest, data)
    record.update(
        fingerprint=tok.fingerprint,
        vocab_size=int(tok.vocab_size),
        separator=[int(i) for i in tok.separator],
        eod_token=getattr(tok, "eod_token", None),
    )
    return record


def _done_units(out: str, n_units: int) -> dict[int, dict]:
    """Unit -> its done record, for the units an earlier run finished."""
    records: dict[int, dict] = {}
    for u in range(n_units):
        rec = _unit_done(out, u)
        if rec is not None:
            records[u] = rec
    return records


def _run_here(
    out: str,
    todo: dict[int, list],
    tok: Tokenizer,
    eval_fraction: float,
    text_field: str,
    records: dict[int, dict],
    done: int,
    total: int,
    progress: Progress | None,
) -> int:
    """Run the units `todo` (unit -> its pieces) in this process into `records`; returns the bytes read."""
    bytes_read = 0
    base = done

    def tick(n: int) -> None:  # within a unit, as its documents are tokenized
        nonlocal done
        done += n
        if progress:
            progress(min(done, total), total)

    for u, pieces in todo.items():
        records[u] = run_unit(out, u, pieces, tok, eval_fraction, text_field, tick)
        bytes_read += records[u]["input_bytes"]
        done = base = base + records[u]["input_bytes"]  # exact at each unit's end
        if progress:
            progress(done, total)
    return bytes_read


def _run_in_pool(
    out: str,
    todo: dict[int, list],
    tokenizer: tuple[str, str],  # (spec, fingerprint): what each worker loads, and checks it loaded
    eval_fraction: float,
    text_field: str,
    workers: int,
    records: dict[int, dict],
    done: int,
    total: int,
    progress: Progress | None,
) -> int:
    """Run the units `todo` (unit -> its pieces) in `workers` processes into `records`; returns the bytes read."""
    spec, fingerprint = tokenizer
    jobs = [(spec, fingerprint, out, u, pieces, eval_fraction, text_field) for u, pieces in todo.items()]
    bytes_read = 0
    # concurrent.futures rather than multiprocessing.Pool: a worker that dies (killed, out
    # of memory) fails the preparation instead of leaving it waiting forever for the unit.
    pool = concurrent.futures.ProcessPoolExecutor(
        min(workers, len(todo)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(os.getpid(),),
    )
    try:
        futures = {pool.submit(_worker_unit, job): job[3] for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            try:
                u, rec = future.result()
            except concurrent.futures.BrokenExecutor:
                raise DataError(
                    f"a worker process stopped (killed, or out of memory?) while preparing unit {futures[future]} "
                    f"into {out}; rerunning the same command resumes"
                ) from None
            records[u] = rec
            done += rec["input_bytes"]
            bytes_read += rec["input_bytes"]
            if progress:
                progress(done, total)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return bytes_read


def _splits(records: dict[int, dict], n_units: int) -> dict:
    """The manifest's splits, from every unit's done record: shards in unit (stream) order."""
    splits = {}
    for split in tokens_lib.SPLITS:
        shards = [records[u]["shards"][split] for u in range(n_units) if records[u]["shards"][split]]
        splits[split] = {
            "documents": sum(r["documents"] for r in shards),
            "tokens": sum(r["tokens_count"] for r in shards),
            "shards": shards,
        }
    return splits


def _manifest(
    tok: Tokenizer, tok_record: dict, options: dict, splits: dict, files: int, total: int, seconds: float
) -> dict:
    """The corpus's ``manifest.json`` (see :mod:`input_pipeline.tokens`), from the plan's `options`."""
    return {
        "format": tokens_lib.FORMAT,
        "version": tokens_lib.VERSION,
        "tokenizer": tok_record,
        "dtype": tok.dtype.name,
        "eval_fraction": options["eval_fraction"],
        "splits": splits,
        "inputs": {"files": files, "bytes": total},
        "options": {key: options[key] for key in ("include", "text_field", "shard_mb")},
        "seconds": round(seconds, 3),
        "created_by": tokens_lib.CREATED_BY,
    }


def _result(
    out: str,
    complete: bool,
    units: int,
    skipped: int,
    files: int,
    total: int,
    bytes_read: int,
    splits: dict,
    seconds: float,
) -> Result:
    """The Result of a preparation, its documents and tokens per split read from `splits` (the manifest's)."""
    documents = {s: splits[s]["documents"] for s in splits}
    tokens = {s: splits[s]["tokens"] for s in splits}
    return Result(out, complete, units, skipped, files, total, bytes_read, documents, tokens, seconds)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
