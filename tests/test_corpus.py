"""Preparing tokenized corpora (input_pipeline.corpus, python -m meshpar.data): the documents
and split read back from the shards, resuming after kill -9, refusals, workers, the command."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from input_pipeline import corpus as corpus_lib
from input_pipeline import text as text_lib
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline import tokens as tokens_lib
from input_pipeline.errors import DataError
from tests.support import script

ROOT = pathlib.Path(__file__).resolve().parents[1]
runs = script("train_runs")  # its process helpers: what a killed run left running
BPE_2K = str(ROOT / "experiments" / "tokenizers" / "stdlib-bpe-2k.json")
STDLIB_PACKAGES = ("json", "wsgiref", "importlib/metadata", "concurrent")


def _copy_stdlib(dest: pathlib.Path, packages=STDLIB_PACKAGES) -> None:
    """Real text: a few standard-library packages (their .py files only)."""
    src = pathlib.Path(text_lib.stdlib_dir())
    for rel in text_lib.list_py_files(str(src)):
        if rel.startswith(tuple(f"{p}/" for p in packages)):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, dest / rel)


def _jsonl_lines(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["naïve", "café", "def", "<|endoftext|>", "λ", "return", "x", "\n", "  ", "json"]
    return [" ".join(rng.choice(words, size=int(rng.integers(0, 60)))) for _ in range(n)]


@pytest.fixture
def inputs(tmp_path) -> pathlib.Path:
    """A folder of standard-library files, a .jsonl (with a blank line), a .jsonl.gz, and what
    the walk skips (hidden entries, __pycache__)."""
    d = tmp_path / "in"
    _copy_stdlib(d)
    lines = _jsonl_lines(300, 0)
    body = "".join(json.dumps({"id": i, "text": t}) + "\n" + ("\n" if i == 7 else "") for i, t in enumerate(lines))
    (d / "data").mkdir()
    (d / "data" / "rows.jsonl").write_text(body, encoding="utf-8")
    with gzip.open(d / "data" / "more.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in _jsonl_lines(40, 1))
    (d / ".hidden.py").write_text("hidden = True\n")
    (d / "__pycache__").mkdir()
    (d / "__pycache__" / "x.py").write_text("cached = True\n")
    (d / "json" / ".git").mkdir()
    (d / "json" / ".git" / "HEAD").write_text("ref\n")
    return d


def _taken(folder: pathlib.Path) -> list[pathlib.Path]:
    """The files a walk of `folder` takes: not hidden, not under a hidden folder or __pycache__."""
    return [
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part[0] == "." or part == "__pycache__" for part in p.relative_to(folder).parts)
    ]


def _expected_documents(folder: pathlib.Path, eval_fraction: float) -> dict[str, list[bytes]]:
    """Every document of `folder` and its split, worked out from the files here on their own."""
    out: dict[str, list[bytes]] = {"train": [], "eval": []}
    rels = sorted(p.relative_to(folder).as_posix() for p in _taken(folder))
    for rel in rels:
        raw = (folder / rel).read_bytes()
        if rel.endswith((".jsonl", ".jsonl.gz")):
            data = gzip.decompress(raw) if rel.endswith(".gz") else raw
            offset = 0
            for line in data.splitlines(keepends=True):
                if line.strip():
                    split = "eval" if text_lib.is_eval_file(f"{rel}:{offset}", eval_fraction) else "train"
                    out[split].append(json.loads(line)["text"].encode())
                offset += len(line)
        else:
            out["eval" if text_lib.is_eval_file(rel, eval_fraction) else "train"].append(raw)
    return out


def _read_documents(corpus: pathlib.Path, split: str) -> list[np.ndarray]:
    """The documents of `split`, cut out of its shards by their indexes, separators included."""
    m = json.loads((corpus / "manifest.json").read_text())
    docs = []
    for rec in m["splits"][split]["shards"]:
        tokens = np.fromfile(corpus / rec["tokens"], dtype=m["dtype"])
        ends = np.fromfile(corpus / rec["index"], dtype="<i8")
        docs += np.split(tokens, ends[:-1])
    return docs


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    """Every file's bytes, manifest.json without its one clock-dependent field (seconds)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "manifest.json":
                m = json.loads(data)
                assert m.pop("seconds") >= 0
                data = json.dumps(m).encode()
            out[p.relative_to(folder).as_posix()] = data
    return out


@pytest.mark.parametrize("tokenizer", ["byte", BPE_2K])
def test_documents_and_split_read_back(inputs, tmp_path, tokenizer):
    out = tmp_path / "out"
    # Small units: many shards, and the .jsonl cut into byte ranges (lines owned by their start).
    r = corpus_lib.prepare(tokenizer, [str(inputs)], str(out), workers=1, eval_fraction=0.3, shard_mb=0.01)
    tok = tokenizer_lib.load(tokenizer)
    expected = _expected_documents(inputs, 0.3)
    assert len(expected["eval"]) > 10 and len(expected["train"]) > 100
    m = tokens_lib.read_manifest(str(out))
    assert len(m["splits"]["train"]["shards"]) > 10
    for split in ("train", "eval"):
        got = _read_documents(out, split)
        assert len(got) == len(expected[split]) == m["splits"][split]["documents"] == r.documents[split]
        for g, doc in zip(got, expected[split]):
            want = np.concatenate([np.asarray(tok.encode_batch([doc])[0], tok.dtype), tok.separator])
            np.testing.assert_array_equal(g, want)
        assert sum(len(g) for g in got) == m["splits"][split]["tokens"]
    taken = _taken(inputs)
    assert m["inputs"] == {"files": len(taken), "bytes": sum(p.stat().st_size for p in taken)} and len(taken) == 26
    assert m["dtype"] == tok.dtype.name and m["tokenizer"]["vocab_size"] == tok.vocab_size
    assert m["tokenizer"]["separator"] == tok.separator.tolist()
    if tokenizer == "byte":
        assert m["tokenizer"]["kind"] == "byte" and not (out / "tokenizer.json").exists()
    else:  # self-contained: the copy loads as the same tokenizer
        assert (out / "tokenizer.json").read_bytes() == pathlib.Path(BPE_2K).read_bytes()
        assert tokenizer_lib.load(tokens_lib.corpus_tokenizer_file(str(out))).fingerprint == tok.fingerprint


def test_stdlib_byte_corpus_is_the_text_sources_documents(tmp_path):
    out = tmp_path / "stdlib"
    r = corpus_lib.prepare("byte", None, str(out), stdlib=True, workers=1)
    corpus_dir = text_lib.stdlib_dir()
    files = text_lib.list_py_files(corpus_dir)
    train, evals = text_lib.split_files(files, 0.05)
    assert r.files == len(files) and r.documents == {"train": len(train), "eval": len(evals)}
    for split, names in (("train", train), ("eval", evals)):
        want = b"".join(pathlib.Path(corpus_dir, f).read_bytes() + b"\n" for f in names)
        got = b"".join(g.tobytes() for g in _read_documents(out, split))
        assert got == want


def test_workers_give_the_same_bytes(inputs, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    corpus_lib.prepare(BPE_2K, [str(inputs)], str(one), workers=1, shard_mb=0.02)
    r = corpus_lib.prepare(BPE_2K, [str(inputs)], str(two), workers=2, shard_mb=0.02)
    assert r.units > 4
    assert _files(one) == _files(two)


RELS_FOR_LINES = (
    "email/_header_value_parser.py",
    "email/message.py",
    "json/decoder.py",
    "wsgiref/handlers.py",
    "http/client.py",
    "http/server.py",
    "urllib/request.py",
    "logging/__init__.py",
    "logging/handlers.py",
)


def _big_jsonl(folder: pathlib.Path) -> None:
    """About 0.8 MB of JSON lines of real text: hundreds of units at a tiny --shard-mb."""
    folder.mkdir()
    src = pathlib.Path(text_lib.stdlib_dir())
    with open(folder / "lines.jsonl", "w", encoding="utf-8") as f:
        for rel in RELS_FOR_LINES:
            text = (src / rel).read_text(encoding="utf-8")
            for i in range(0, len(text), 400):
                f.write(json.dumps({"text": text[i : i + 400]}) + "\n")


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshpar.data", *args], capture_output=True, text=True, cwd=ROOT, timeout=120, **kw
    )


def test_kill_9_then_rerun_gives_the_same_corpus(tmp_path):
    src, ref, out = tmp_path / "in", tmp_path / "ref", tmp_path / "out"
    _big_jsonl(src)
    opts = ["--tokenizer", BPE_2K, "--input", str(src), "--shard-mb", "0.002", "--workers", "2"]
    opts += ["--eval-fraction", "0.1"]
    corpus_lib.prepare(BPE_2K, [str(src)], str(ref), workers=1, shard_mb=0.002, eval_fraction=0.1)
    units = len(list((ref / "units").iterdir()))
    assert units > 200

    proc = subprocess.Popen(
        [sys.executable, "-m", "meshpar.data", "prepare", *opts, "--output", str(out)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (out / "units").is_dir() or len(os.listdir(out / "units")) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "it ended before it could be killed"
            time.sleep(0.002)
        pool = runs.descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # the preparer alone: its pool's workers must follow it
    finally:
        proc.wait()
    assert len(pool) >= 2 and runs.still_running(pool) == [], f"workers {pool} outlived the killed preparer"
    done = [n for n in os.listdir(out / "units") if n.endswith(".json")]
    assert not (out / "manifest.json").exists() and 3 <= len(done) < units
    with pytest.raises(DataError, match="preparation did not finish.*resumes"):
        tokens_lib.TokenSource(str(out), "train", 16)

    r = _cli("prepare", *opts, "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert f"resumed with {len(done)} of {units} units done" in r.stdout and len(r.stdout.splitlines()) == 1
    assert _files(out) == _files(ref)


def test_a_changed_input_or_option_is_refused(inputs, tmp_path):
    out = tmp_path / "out"
    kw = dict(workers=1, shard_mb=0.05)
    corpus_lib.prepare("byte", [str(inputs)], str(out), **kw)
    before = _files(out)

    def refused(message: str, tok: str = "byte", **options) -> None:
        with pytest.raises(DataError, match="plan.json: " + message) as e:
            corpus_lib.prepare(tok, [str(inputs)], str(out), **{**kw, **options})
        assert "\n" not in str(e.value) and "new folder" in str(e.value)

    target = inputs / "json" / "decoder.py"
    original = target.read_bytes()
    target.write_bytes(original + b"# edited\n")
    refused(f"input file {target} changed")
    target.unlink()
    refused(f"input file {target} removed")
    target.write_bytes(original)
    os.utime(target, ns=(before_stamp := os.stat(inputs / "json" / "__init__.py").st_mtime_ns, before_stamp))
    refused(f"input file {target} changed")  # same bytes, but not the same file the plan saw
    (inputs / "new.py").write_text("y = 2\n")
    refused(f"input file {inputs / 'new.py'} added")
    (inputs / "new.py").unlink()
    refused("a different tokenizer", BPE_2K)
    refused("a different --eval-fraction", eval_fraction=0.5)
    refused("a different --shard-mb", shard_mb=1.0)
    refused("a different --include", include=["*.py"])
    assert _files(out) == before


def test_a_foreign_output_folder_is_refused(inputs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(DataError, match="is not empty and holds no plan.json.*'notes.txt'"):
        corpus_lib.prepare("byte", [str(inputs)], str(out), workers=1)
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine\n"
    # An unfinished preparation's temporaries alone do not make a folder foreign: they are removed.
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / f"{tokens_lib.TMP_PREFIX}abc").write_bytes(b"half")
    corpus_lib.prepare("byte", [str(inputs)], str(empty), workers=1)
    assert not any(n.startswith(tokens_lib.TMP_PREFIX) for n in os.listdir(empty))


def test_rerunning_a_complete_corpus_writes_nothing(inputs, tmp_path):
    out = tmp_path / "out"
    opts = ["prepare", "--tokenizer", "byte", "--input", str(inputs), "--output", str(out), "--shard-mb", "0.05"]
    first = _cli(*opts)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("prepared 26 files, ") and f"-> {out}" in first.stdout
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = _cli(*opts)
    assert again.returncode == 0 and "already complete" in again.stdout and "nothing written" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamps
    info = _cli("info", str(out))
    assert info.returncode == 0
    assert "vocab 256, dtype uint8" in info.stdout and "26 files" in info.stdout
    assert any(line.startswith("train") and "documents" in line for line in info.stdout.splitlines())


def test_bad_json_lines_name_the_file_and_line(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    body = [json.dumps({"text": "ok"})] * 5
    for i, bad in enumerate(['{"text": ', '["a list"]', '{"body": "x"}', '{"text": 3}']):
        (d / "rows.jsonl").write_text("\n".join(body + [bad] + body) + "\n")
        with pytest.raises(DataError, match="rows.jsonl line 6: ") as e:
            corpus_lib.prepare("byte", [str(d)], str(tmp_path / f"out{i}"), workers=1)
        assert "\n" not in str(e.value)
    # In a worker process too, the error comes back whole (and the other workers stop).
    for i in range(4):
        (d / f"part{i}.jsonl").write_text("\n".join(body * 40) + "\n")
    (d / "part2.jsonl").write_text("\n".join(body * 40 + ["{oops"]) + "\n")
    with pytest.raises(DataError, match="part2.jsonl line 201: not valid JSON") as e:
        corpus_lib.prepare("byte", [str(d)], str(tmp_path / "pool"), workers=2, include=["part*"], shard_mb=0.0005)
    assert "\n" not in str(e.value)
    for i in range(4):
        (d / f"part{i}.jsonl").unlink()
    # The field is chosen with text_field.
    (d / "rows.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    corpus_lib.prepare("byte", [str(d)], str(tmp_path / "body"), workers=1, text_field="body", eval_fraction=0.0)
    assert _read_documents(tmp_path / "body", "train")[0].tobytes() == b"hello\n"


def test_the_command_reports_errors_in_one_line(inputs, tmp_path):
    missing = tmp_path / "nope.json"
    r = _cli("prepare", "--tokenizer", str(missing), "--input", str(inputs), "--output", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"data error: {tmp_path / 'nope.json'}: no such file or folder"]
    assert not (tmp_path / "o").exists()
    r = _cli("info", str(inputs))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith(f"data error: {inputs} is not a prepared token corpus")
    assert "meshpar.data prepare" in r.stderr
    r = _cli("prepare", "--tokenizer", "byte", "--stdlib", "--input", str(inputs), "--output", str(tmp_path / "o"))
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
