"""Byte-level text sources: stdlib corpus split by file, windows, tfds text path."""

from __future__ import annotations

import os

import numpy as np
import pytest

from input_pipeline.batching import HostLoader
from input_pipeline.errors import DataError
from input_pipeline.text import (
    SEPARATOR,
    TextSource,
    TextWindows,
    from_tfds,
    list_py_files,
    split_files,
    stdlib_dir,
    token_dtype,
    tokenize_bytes,
)

try:  # works whether or not tests/ is a package on sys.path
    from tests import tfds_fixtures as fx
except ImportError:  # pragma: no cover
    import tfds_fixtures as fx

LENGTH = 64
CAP = 200_000  # bytes of the train split read by most tests (fast)


@pytest.fixture(scope="module")
def train() -> TextSource:
    return TextSource("train", LENGTH, max_bytes=CAP)


def _first_bytes(corpus: str, files: list[str], n: int) -> bytes:
    out = b""
    for rel in files:
        with open(os.path.join(corpus, rel), "rb") as f:
            out += (SEPARATOR if out else b"") + f.read()
        if len(out) >= n:
            break
    return out[:n]


def test_element_spec_len_and_cap(train):
    # One field of bytes: the window the model cuts inputs and targets from.
    assert train.element_spec == {"tokens": ((LENGTH + 1,), np.dtype(np.uint8))}
    assert train.tokens.size == CAP and train.tokens.dtype == np.uint8
    assert len(train) == (CAP - 1) // LENGTH
    assert len(train.files_read) < len(train.files)  # the cap stopped reading early


def test_deterministic_across_instances(train):
    other = TextSource("train", LENGTH, max_bytes=CAP)
    idx = np.array([3, 0, len(train) - 1, 3, 1000])
    a, b = train.read(idx), other.read(idx)
    assert set(a) == {"tokens"}
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert a["tokens"].dtype == np.uint8 and a["tokens"].shape == (5, LENGTH + 1)


def test_windows_are_real_text_at_stride_length(train):
    w = train.read(np.arange(len(train)))["tokens"]
    np.testing.assert_array_equal(w[:-1, -1], w[1:, 0])  # window i+1 starts at window i's last token
    want = _first_bytes(train.corpus_dir, train.files, 2 * LENGTH + 1)
    assert bytes(w[0]) == want[: LENGTH + 1]
    assert bytes(w[1]) == want[LENGTH : 2 * LENGTH + 1]
    text = bytes(w[:50].ravel()).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text or '"""' in text  # Python source, not noise


def test_read_into_reused_buffers_equals_read(train):
    reused = HostLoader(train, batch_size=8, seed=3, reuse_buffers=True)
    plain = HostLoader(train, batch_size=8, seed=3)
    for step in (0, 5, 0):
        np.testing.assert_array_equal(reused.batch(step)["tokens"], plain.batch(step)["tokens"])


def test_token_dtype_is_the_narrowest_that_holds_the_vocabulary():
    assert [token_dtype(v) for v in (2, 256, 257, 65536, 65537)] == [np.uint8, np.uint8, np.uint16, np.uint16, np.int32]
    # A word-piece stream (ids up to 999, stored as int64): windows come out uint16, same ids.
    ids = np.random.default_rng(0).integers(0, 1000, 101)
    ids[[5, 50]] = 0, 999
    w = TextWindows(ids, 10, vocab_size=1000)
    assert w.element_spec == {"tokens": ((11,), np.dtype(np.uint16))}
    np.testing.assert_array_equal(w.read(np.array([3]))["tokens"][0], ids[30:41])
    _one_line_error(
        r"token ids span \[0, 999\], outside the vocabulary \[0, 512\)", TextWindows, ids, 10, vocab_size=512
    )
    _one_line_error("must be integers", TextWindows, ids.astype(np.float32), 10, vocab_size=1000)
    _one_line_error(
        r"span \[10, 122\], outside the vocabulary \[0, 100\)",
        TextWindows,
        tokenize_bytes([b"az"] * 6),
        4,
        vocab_size=100,
    )


def test_stdlib_split_by_file_disjoint_and_complete():
    files = list_py_files(stdlib_dir())
    assert files == sorted(files) and not any("site-packages" in f for f in files)
    assert "os.py" in files
    evals = TextSource("eval", LENGTH)  # the whole eval split (~5% of the stdlib)
    tr, ev = split_files(files, 0.05)
    assert evals.files == ev
    assert set(tr).isdisjoint(ev) and sorted(tr + ev) == files
    assert 0.02 < len(ev) / len(files) < 0.10
    sizes = [os.path.getsize(os.path.join(stdlib_dir(), f)) for f in ev]
    assert evals.tokens.size == sum(sizes) + len(ev) - 1  # files joined by one separator byte


def test_custom_corpus_streams_exactly_the_split_files(tmp_path):
    for i in range(30):
        sub = tmp_path / ("pkg" if i % 2 else "")
        sub.mkdir(exist_ok=True)
        (sub / f"m{i:02d}.py").write_bytes(f"x_{i} = {i}  # module {i}\n".encode() * 3)
    (tmp_path / "notes.txt").write_text("not python")
    sp = tmp_path / "site-packages"
    sp.mkdir()
    (sp / "vendored.py").write_text("skipped = True\n")
    files = list_py_files(str(tmp_path))
    assert len(files) == 30 and "pkg/m01.py" in files
    tr = TextSource("train", 8, corpus_dir=str(tmp_path), eval_fraction=0.3)
    ev = TextSource("eval", 8, corpus_dir=str(tmp_path), eval_fraction=0.3)
    assert ev.files and tr.files and set(tr.files).isdisjoint(ev.files) and sorted(tr.files + ev.files) == files
    for src in (tr, ev):
        want = SEPARATOR.join((tmp_path / f).read_bytes() for f in src.files)
        assert bytes(src.tokens) == want


def test_host_loader_gives_seeded_order(train):
    a = HostLoader(train, batch_size=8, seed=3).batch(5)
    b = HostLoader(train, batch_size=8, seed=3).batch(5)
    c = HostLoader(train, batch_size=8, seed=4).batch(5)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert not np.array_equal(a["tokens"], c["tokens"])


def test_text_windows_and_tokenize():
    stream = tokenize_bytes([b"abc", b"de"])
    assert bytes(stream) == b"abc\nde"
    w = TextWindows(stream, 2)
    assert len(w) == 2  # (6 - 1) // 2
    out = w.read(np.array([1, 0]))
    assert out["tokens"].tolist() == [[ord("c"), ord("\n"), ord("d")], [ord("a"), ord("b"), ord("c")]]
    with pytest.raises(IndexError):
        w.read(np.array([2]))


def _one_line_error(match: str, fn, *args, **kwargs):
    with pytest.raises(DataError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)


def test_errors(tmp_path):
    _one_line_error("corpus_dir does not exist", TextSource, "train", 8, corpus_dir=str(tmp_path / "nope"))
    (tmp_path / "a.txt").write_text("hi")
    _one_line_error("no .py files", TextSource, "train", 8, corpus_dir=str(tmp_path))
    (tmp_path / "tiny.py").write_text("x = 1\n")
    _one_line_error("fewer than one window", TextSource, "train", 100, corpus_dir=str(tmp_path), eval_fraction=0.0)
    # every file in train: the eval split is empty
    _one_line_error("split 'eval'.*0 tokens", TextSource, "eval", 4, corpus_dir=str(tmp_path), eval_fraction=0.0)
    _one_line_error("split must be", TextSource, "test", 8, corpus_dir=str(tmp_path))
    _one_line_error("window length", TextWindows, np.zeros(10, np.uint8), 0)


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tfds_text"))
    fx.build_tiny_text_dataset(d, num_train=48, num_test=16)
    return d


def test_from_tfds_windows_all_rows(tfds_dir):
    src = from_tfds("tiny_text", "train", tfds_dir, length=16)
    texts, _ = fx.text_rows("train", 48)
    want = "\n".join(texts).encode("utf-8")  # non-ASCII rows stay raw UTF-8 bytes
    assert bytes(src.tokens) == want
    assert len(src) == (len(want) - 1) // 16
    tokens = src.read(np.arange(len(src)))["tokens"]
    assert bytes(tokens[0]) == want[:17] and bytes(tokens[1]) == want[16:33]
    assert src.element_spec == {"tokens": ((17,), np.dtype(np.uint8))}


def test_from_tfds_errors(tfds_dir):
    _one_line_error("not a Text feature", from_tfds, "tiny_text", "train", tfds_dir, feature="label", length=16)
    _one_line_error("fewer than one window", from_tfds, "tiny_text", "test", tfds_dir, length=100_000)
    _one_line_error("not found", from_tfds, "missing_ds", "train", tfds_dir, length=16)
