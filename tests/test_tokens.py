"""Reading prepared token corpora (input_pipeline.tokens.TokenSource): packed windows across
shards, the text source's windows from a byte corpus, document windows, every one-line error,
pickling to a spawned process, and the helpers that read only the manifest."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import pickle
import shutil

import numpy as np
import pytest

from input_pipeline import corpus as corpus_lib
from input_pipeline import text as text_lib
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline import tokens as tokens_lib
from input_pipeline.batching import HostLoader
from input_pipeline.errors import DataError
from input_pipeline.text import TextSource, TextWindows
from input_pipeline.tokens import TokenSource

ROOT = pathlib.Path(__file__).resolve().parents[1]
BPE_2K = str(ROOT / "experiments" / "tokenizers" / "stdlib-bpe-2k.json")
PACKAGES = ("json", "wsgiref", "importlib/metadata", "concurrent", "email/mime")
EVAL = 0.25


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    """A few standard-library packages, as files."""
    d = tmp_path_factory.mktemp("stdlib")
    src = pathlib.Path(text_lib.stdlib_dir())
    for rel in text_lib.list_py_files(str(src)):
        if rel.startswith(tuple(f"{p}/" for p in PACKAGES)):
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, d / rel)
    return d


@pytest.fixture(scope="module")
def byte_corpus(folder, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("corpora") / "byte"
    # Units of ~20 kB: many shards, so that windows cross shard boundaries.
    corpus_lib.prepare("byte", [str(folder)], str(out), workers=1, eval_fraction=EVAL, shard_mb=0.02)
    return out


@pytest.fixture(scope="module")
def bpe_corpus(folder, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("corpora") / "bpe"
    corpus_lib.prepare(BPE_2K, [str(folder)], str(out), workers=1, eval_fraction=EVAL, shard_mb=0.02)
    return out


def _copy(corpus: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """A private copy to damage."""
    dest = tmp_path / corpus.name
    shutil.copytree(corpus, dest)
    return dest


def _stream(corpus: pathlib.Path, split: str) -> np.ndarray:
    m = tokens_lib.read_manifest(str(corpus))
    return np.concatenate([np.fromfile(corpus / r["tokens"], m["dtype"]) for r in m["splits"][split]["shards"]])


def _all(src) -> np.ndarray:
    return src.read(np.arange(len(src)))["tokens"]


@pytest.mark.parametrize("length", [1, 37, 256])
def test_packed_windows_are_the_windows_of_the_joined_documents(folder, byte_corpus, length):
    m = tokens_lib.read_manifest(str(byte_corpus))
    assert len(m["splits"]["train"]["shards"]) >= 5
    train, _ = text_lib.split_files(text_lib.list_py_files(str(folder)), EVAL)
    # Built from the input files alone: every document followed by its separator.
    stream = np.frombuffer(b"".join((folder / f).read_bytes() + b"\n" for f in train), np.uint8)
    src = TokenSource(str(byte_corpus), "train", length)
    ref = TextWindows(stream, length)
    assert len(src) == len(ref) and src.element_spec == ref.element_spec
    np.testing.assert_array_equal(_all(src), _all(ref))
    order = np.random.default_rng(0).permutation(len(src))[:300]
    np.testing.assert_array_equal(src.read(order)["tokens"], ref.read(order)["tokens"])
    assert src.dropped_tokens == stream.size - (len(src) * length + 1)


def test_packed_windows_cross_shards_under_a_tokenizer(bpe_corpus):
    stream = _stream(bpe_corpus, "eval")
    src = TokenSource(str(bpe_corpus), "eval", 100)
    assert src.dtype == np.uint16 and len(tokens_lib.read_manifest(str(bpe_corpus))["splits"]["eval"]["shards"]) >= 3
    np.testing.assert_array_equal(_all(src), _all(TextWindows(stream, 100, vocab_size=2048)))


@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_byte_corpus_gives_the_text_sources_windows(folder, byte_corpus, split):
    src = TokenSource(str(byte_corpus), split, 64)
    ref = TextSource(split, 64, corpus_dir=str(folder), eval_fraction=EVAL)
    # The text source's stream has no separator after its last document: one token shorter.
    assert len(ref) <= len(src) <= len(ref) + 1
    np.testing.assert_array_equal(src.read(np.arange(len(ref)))["tokens"], _all(ref))


@pytest.mark.parametrize("length", [1, 48])
def test_document_windows_stay_inside_documents(bpe_corpus, length):
    src = TokenSource(str(bpe_corpus), "train", length, windows="document")
    sep = int(tokenizer_lib.load(BPE_2K).separator[0])
    m = tokens_lib.read_manifest(str(bpe_corpus))
    # Worked out here from each shard's bin and idx: each document span's windows, in order.
    want, dropped, short, docs_of_two = [], 0, 0, 0
    for r in m["splits"]["train"]["shards"]:
        tokens = np.fromfile(bpe_corpus / r["tokens"], "<u2")
        ends = np.fromfile(bpe_corpus / r["index"], "<i8")
        for begin, end in zip(np.concatenate([[0], ends[:-1]]), ends):
            span = tokens[begin:end]
            assert span[-1] == sep and (span[:-1] != sep).all()
            k = 0
            while k + length + 1 <= span.size:
                want.append(span[k : k + length + 1])
                k += length
            dropped += span.size - (k + 1) if k else span.size
            short += k == 0
            docs_of_two += span.size >= 2
    got = _all(src)
    assert (short > 0 or length == 1) and len(src) == len(want) > 100
    np.testing.assert_array_equal(got, np.stack(want))
    assert src.dropped_tokens == dropped
    # A separator only ever ends a window (where the window ends its document's span): with
    # windows of 2, the last window of every document of 2 tokens or more.
    rows, cols = np.nonzero(got == sep)
    assert (cols == length).all()
    if length == 1:
        assert rows.size == docs_of_two


def test_host_loader_reads_a_token_source(byte_corpus):
    src = TokenSource(str(byte_corpus), "train", 32)
    loader = HostLoader(src, batch_size=16, seed=3, reuse_buffers=True)
    for step in (0, 1, loader.batches_per_epoch + 2):
        batch = loader.batch(step)
        np.testing.assert_array_equal(batch["tokens"], src.read(loader.indices(step))["tokens"])
        loader.recycle(batch, aliased=False)


def _read_in_child(src: TokenSource, indices: np.ndarray) -> tuple[np.ndarray, int]:
    return src.read(indices)["tokens"], len(tokens_lib._HASHED)


def test_pickling_reopens_without_hashing(bpe_corpus):
    for windows in ("packed", "document"):
        src = TokenSource(str(bpe_corpus), "train", 40, windows=windows, vocab_limit=4096)
        blob = pickle.dumps(src)
        assert len(blob) < 20_000  # the arguments and the manifest, no token data
        tokens_lib._HASHED.clear()
        back = pickle.loads(blob)
        assert not tokens_lib._HASHED  # the checksums are not computed again
        idx = np.arange(len(src))[::-1]
        np.testing.assert_array_equal(back.read(idx)["tokens"], src.read(idx)["tokens"])
        assert (len(back), back.vocab_limit, back.windows, back.dropped_tokens) == (
            len(src), 4096, windows, src.dropped_tokens,
        )  # fmt: skip
    idx = np.arange(0, len(src), 7)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got, hashed = pool.apply(_read_in_child, (src, idx))
    np.testing.assert_array_equal(got, src.read(idx)["tokens"])
    assert hashed == 0


def test_helpers_read_only_the_manifest(byte_corpus, bpe_corpus):
    assert tokens_lib.corpus_vocab_size(str(byte_corpus)) == 256
    assert tokens_lib.corpus_dtype(str(byte_corpus)) == np.uint8
    assert tokens_lib.corpus_tokenizer_file(str(byte_corpus)) == "byte"
    assert tokens_lib.corpus_vocab_size(str(bpe_corpus)) == 2048
    assert tokens_lib.corpus_dtype(str(bpe_corpus)) == np.uint16
    copied = tokens_lib.corpus_tokenizer_file(str(bpe_corpus))
    assert copied == str(bpe_corpus / "tokenizer.json")
    fingerprint = tokens_lib.read_manifest(str(bpe_corpus))["tokenizer"]["fingerprint"]
    assert tokenizer_lib.load(copied).fingerprint == fingerprint


def _error(*args, **kw) -> str:
    with pytest.raises(DataError) as e:
        src = TokenSource(*args, **kw)
        src.read(np.arange(len(src)))
    message = str(e.value)
    assert "\n" not in message
    return message


def test_missing_unfinished_and_bad_manifests(byte_corpus, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    msg = _error(str(empty), "train", 8)
    assert f"{empty} is not a prepared token corpus" in msg and "python -m meshpar.data prepare" in msg
    assert "no such folder" in _error(str(tmp_path / "absent"), "train", 8)
    c = _copy(byte_corpus, tmp_path)
    manifest = (c / "manifest.json").read_text()
    (c / "manifest.json").unlink()
    msg = _error(str(c), "train", 8)
    assert "preparation did not finish" in msg and "rerunning the same" in msg and "resumes it" in msg
    (c / "manifest.json").write_text(manifest[:-20])
    assert "manifest.json: not valid JSON" in _error(str(c), "train", 8)
    (c / "manifest.json").write_text(manifest.replace('"meshpar-tokens"', '"other"'))
    assert "format 'other' is not 'meshpar-tokens'" in _error(str(c), "train", 8)
    (c / "manifest.json").write_text(manifest.replace('"version": 1', '"version": 9'))
    assert "version 9" in _error(str(c), "train", 8)
    (c / "manifest.json").write_text(manifest)
    assert "no split 'test' (the corpus has 'train', 'eval')" in _error(str(c), "test", 8)
    tokens = tokens_lib.read_manifest(str(c))["splits"]["eval"]["tokens"]
    assert f"has {tokens} tokens, fewer than one window of {tokens + 1}" in _error(str(c), "eval", tokens)


def test_missing_and_truncated_shards(byte_corpus, tmp_path):
    c = _copy(byte_corpus, tmp_path)
    rec = tokens_lib.read_manifest(str(c))["splits"]["train"]["shards"][2]
    bin_path = c / rec["tokens"]
    data = bin_path.read_bytes()
    bin_path.write_bytes(data[:-5])
    msg = _error(str(c), "train", 8)
    assert f"{bin_path}: {len(data) - 5} bytes, but the manifest says {len(data)}" in msg
    bin_path.unlink()
    assert f"{bin_path}: shard file missing" in _error(str(c), "train", 8)
    bin_path.write_bytes(data)
    (c / rec["index"]).unlink()
    assert f"{c / rec['index']}: shard file missing" in _error(str(c), "train", 8)


def test_a_changed_byte_fails_the_checksum(byte_corpus, tmp_path):
    c = _copy(byte_corpus, tmp_path)
    rec = tokens_lib.read_manifest(str(c))["splits"]["train"]["shards"][1]
    path = c / rec["tokens"]
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    msg = _error(str(c), "train", 8)
    assert msg.startswith(f"{path}: sha256 ") and rec["sha256"][:16] in msg and "changed after preparation" in msg
    src = TokenSource(str(c), "train", 8, verify=False)  # the change itself is a valid byte
    assert len(src) > 0


def test_an_id_outside_the_vocabulary_names_shard_document_and_example(bpe_corpus, tmp_path):
    c = _copy(bpe_corpus, tmp_path)
    m = tokens_lib.read_manifest(str(c))
    k = 3
    rec = m["splits"]["train"]["shards"][k]
    ends = np.fromfile(c / rec["index"], "<i8")
    doc = 1
    local = int(ends[doc - 1]) + 10  # token 10 of the shard's second document
    tokens = np.fromfile(c / rec["tokens"], "<u2")
    tokens[local] = 5000
    tokens.tofile(c / rec["tokens"])
    length = 64
    pos = sum(r["tokens_count"] for r in m["splits"]["train"]["shards"][:k]) + local
    example = pos // length  # the window starting at or before it holds it
    src = TokenSource(str(c), "train", length, verify=False)
    clean = [i for i in range(len(src)) if not i * length <= pos <= i * length + length]
    src.read(np.array(clean))  # every other window reads
    with pytest.raises(DataError) as e:
        src.read(np.array([0, example, 1]))
    msg = str(e.value)
    assert msg.startswith(f"{c / rec['tokens']}: token id 5000 at or above the vocabulary limit 2048")
    assert f"in document {doc} of the shard (token {local})" in msg and f"example {example} of" in msg
    out = {"tokens": np.empty((1, length + 1), np.uint16)}
    with pytest.raises(DataError, match=f"example {example} of"):
        src.read_into(np.array([example]), out)
    # A limit below the corpus's own ids is refused when the source opens, from the manifest.
    assert "at or above the vocabulary limit 100" in _error(str(bpe_corpus), "train", 8, vocab_limit=100)


def test_a_bad_index_is_refused(byte_corpus, tmp_path):
    c = _copy(byte_corpus, tmp_path)
    rec = next(r for r in tokens_lib.read_manifest(str(c))["splits"]["train"]["shards"] if r["documents"] >= 3)
    path = c / rec["index"]
    good = np.fromfile(path, "<i8")
    bad = good.copy()
    bad[1], bad[2] = good[2], good[1]
    bad.tofile(path)
    msg = _error(str(c), "train", 8, verify=False)
    assert f"{path}: document ends are not strictly increasing (document 2 ends at {good[1]}, after {good[2]})" in msg
    bad = good.copy()
    bad[-1] -= 1
    bad.tofile(path)
    msg = _error(str(c), "train", 8, verify=False)
    assert f"{path}: the last document ends at token {good[-1] - 1}, but the shard holds {good[-1]} tokens" in msg
    assert f"{path}: sha256" in _error(str(c), "train", 8)  # verify=True: the checksum says it first


def test_bad_arguments(byte_corpus):
    with pytest.raises(DataError, match="window length"):
        TokenSource(str(byte_corpus), "train", 0)
    with pytest.raises(DataError, match="windows must be"):
        TokenSource(str(byte_corpus), "train", 8, windows="rows")
    src = TokenSource(str(byte_corpus), "train", 8)
    with pytest.raises(IndexError):
        src.read(np.array([len(src)]))
    with pytest.raises(IndexError):
        src.read(np.zeros((2, 2), np.int64))
    assert json.loads((byte_corpus / "manifest.json").read_text())["created_by"] == "python -m meshpar.data prepare"
    assert os.path.exists(byte_corpus / "plan.json")
