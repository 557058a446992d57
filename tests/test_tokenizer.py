"""Tokenizers for the text sources: bytes unchanged, Hugging Face tokenizer.json files (ids,
end-of-document token, dtype), the token-stream cache, `data.tokenizer` in meshpar (resolution,
element spec, the model's vocabulary), and scripts/train_tokenizer.py."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.errors import DataError
from input_pipeline.text import SEPARATOR, TextSource, from_tfds, tokenize_bytes
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError
from meshpar.sources import text as text_source
from meshpar.step import inputs, parts

try:  # works whether or not tests/ is a package on sys.path
    from tests import tfds_fixtures as fx
except ImportError:  # pragma: no cover
    import tfds_fixtures as fx

ROOT = pathlib.Path(__file__).resolve().parents[1]
BPE_2K = ROOT / "experiments" / "tokenizers" / "stdlib-bpe-2k.json"
EOD = "<|endoftext|>"
LM = {"name": "transformer", "d_model": 32, "n_heads": 2, "d_head": 16, "d_ff": 64, "n_layers": 1, "max_length": 32}


@pytest.fixture(scope="module")
def bpe() -> tokenizer_lib.HFTokenizer:
    return tokenizer_lib.load(str(BPE_2K))


@pytest.fixture
def corpus(tmp_path) -> pathlib.Path:
    """Six small Python files (one with non-ASCII text, one with a literal end-of-document
    string), all in the train split."""
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(6):
        (d / f"m{i}.py").write_text(f'"""Module {i}."""\n\n\ndef f_{i}(x):\n    return x * {i}  # ×{i}\n' * (i + 1))
    (d / "m2.py").write_text('SPECIAL = "<|endoftext|>"  # text, not a token\nname = "naïve café"\n')
    return d


def _docs(corpus: pathlib.Path) -> list[bytes]:
    return [(corpus / f"m{i}.py").read_bytes() for i in range(6)]


def _reference_ids(path, text: str) -> list[int]:
    """The library's own ids for `text`, special tokens in the text kept as text."""
    tok = tokenizers.Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True
    return tok.encode(text, add_special_tokens=False).ids


def _save(tok: tokenizers.Tokenizer, folder: pathlib.Path, config: str | None = None) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(config)
    return folder / "tokenizer.json"


def _word_level(post_processor: bool = False) -> tokenizers.Tokenizer:
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "<|im_end|>": 5}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _tiny_bpe(texts: list[str], vocab_size: int, special: list[str]) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _cfg(*overrides: str) -> config_lib.Config:
    raw = {
        "mesh": "data:4,model:2",
        "layout": "batch:data",
        "model": dict(LM),
        "data": {"source": "text", "length": 16},
    }
    raw["train"] = {"batch_size": 8, "progress": False}
    return config_lib.from_dict(config_lib.apply_overrides(raw, overrides))


# --- bytes: what the sources have always served ----------------------------------------------


def test_byte_tokenizer_is_the_byte_stream(corpus):
    byte = tokenizer_lib.load("byte")
    docs = _docs(corpus)
    assert byte.vocab_size == 256 and byte.dtype == np.uint8 and bytes(byte.separator) == SEPARATOR
    stream = tokenizer_lib.encode_documents(byte, docs, cache_dir=str(corpus / "cache"))
    assert stream.dtype == np.uint8 and bytes(stream) == b"\n".join(docs)
    np.testing.assert_array_equal(stream, tokenize_bytes(docs))
    assert not (corpus / "cache").exists()  # bytes are the documents themselves: nothing cached
    default = TextSource("train", 8, corpus_dir=str(corpus), eval_fraction=0.0, max_bytes=300)
    explicit = TextSource("train", 8, corpus_dir=str(corpus), eval_fraction=0.0, max_bytes=300, tokenizer=byte)
    assert default.tokens.dtype == explicit.tokens.dtype == np.uint8
    assert bytes(default.tokens) == bytes(explicit.tokens) == b"\n".join(docs)[:300]


# --- a Hugging Face tokenizer ------------------------------------------------------------------


def test_byte_level_bpe_round_trips_and_compresses(bpe):
    assert bpe.vocab_size == 2048 and bpe.dtype == np.uint16
    assert bpe.eod_token == EOD and bpe.separator.tolist() == [0]
    texts = [
        "def f(x):\n        return x  # ok\n",
        "naïve café, 日本語, emoji 🙂, tabs\tand\r\nCRLF",
        '    """Docstring."""\n\n\n',
        "",
        "<|endoftext|> written in a file",
    ]
    for text, ids in zip(texts, bpe.encode_batch([t.encode() for t in texts])):
        assert ids.dtype == np.uint16 and (ids < 2048).all()
        assert bpe.decode(ids) == text
        assert ids.tolist() == _reference_ids(BPE_2K, text)
    code = (pathlib.Path(os.__file__)).read_bytes()  # a real module: BPE merges make it ~3x shorter
    (ids,) = bpe.encode_batch([code])
    assert len(ids) < 0.45 * len(code)
    assert bpe.decode(ids) == code.decode()


def test_windows_have_the_narrow_dtype_and_ids_in_the_vocabulary(bpe):
    cap = 200_000
    src = TextSource("train", 64, max_bytes=cap, tokenizer=bpe)  # the stdlib, as the text source reads it
    assert src.element_spec == {"tokens": ((65,), np.dtype(np.uint16))}
    w = src.read(np.arange(len(src)))["tokens"]
    assert w.dtype == np.uint16 and int(w.max()) < 2048 and len(src) == (src.tokens.size - 1) // 64
    np.testing.assert_array_equal(w[:-1, -1], w[1:, 0])  # stride length, as for bytes
    # The whole stream decodes to the capped bytes, each end of document where a "\n" joined two files.
    text = bpe.decode(src.tokens).replace(EOD, "\n")
    assert text == TextSource("train", 64, max_bytes=cap).tokens.tobytes().decode("utf-8", errors="replace")
    assert src.tokens.size < 0.45 * cap


def test_documents_are_separated_by_the_end_of_document_token(bpe, corpus):
    docs = _docs(corpus)
    src = TextSource("train", 4, corpus_dir=str(corpus), eval_fraction=0.0, tokenizer=bpe)
    want = []
    for i, doc in enumerate(docs):
        want += ([0] if i else []) + _reference_ids(BPE_2K, doc.decode())
    assert src.tokens.tolist() == want
    assert int((src.tokens == 0).sum()) == len(docs) - 1  # m2.py's literal "<|endoftext|>" stays text
    # A byte cap cuts the last document, as for bytes; the text before the cut is the same.
    capped = TextSource("train", 4, corpus_dir=str(corpus), eval_fraction=0.0, max_bytes=150, tokenizer=bpe)
    assert bpe.decode(capped.tokens).replace(EOD, "\n") == b"\n".join(docs)[:150].decode()


def test_end_of_document_token_choice_and_no_post_processor_tokens(tmp_path):
    # tokenizer_config.json's eos_token (an AddedToken's dict) wins over the conventional </s>.
    path = _save(_word_level(), tmp_path / "named", '{"eos_token": {"content": "<|im_end|>", "special": true}}')
    assert tokenizer_lib.load(str(path)).separator.tolist() == [5]
    # Without it: the first conventional token in the vocabulary.
    plain = tokenizer_lib.load(str(_save(_word_level(post_processor=True), tmp_path / "plain")))
    assert plain.eod_token == "</s>" and plain.separator.tolist() == [2]
    # A post-processor that adds <s> adds nothing to the stream.
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "plain" / "tokenizer.json")).encode("a b").ids == [1, 3, 4]
    assert plain.stream([b"a b", b"b a"]).tolist() == [3, 4, 2, 4, 3]
    # No end-of-document token at all: the encoding of "\n", as the byte stream has it.
    texts = ["x = 1\n", "def g(y):\n    return y\n"] * 20
    bare = tokenizer_lib.load(str(_save(_tiny_bpe(texts, 300, special=[]), tmp_path / "bare")))
    assert bare.eod_token is None and bare.separator.tolist() == _reference_ids(
        tmp_path / "bare" / "tokenizer.json", "\n"
    )
    assert bare.decode(bare.stream([b"ab", b"cd"])) == "ab\ncd"


def test_bad_tokenizer_paths_are_one_line(tmp_path):
    (tmp_path / "not_json.json").write_text("{ nope")
    (tmp_path / "other.json").write_text('{"model": "nothing like a tokenizer"}')
    (tmp_path / "empty_folder").mkdir()
    cases = [
        (tmp_path / "missing.json", "no such file or folder"),
        (tmp_path / "not_json.json", "is not a Hugging Face tokenizer.json"),
        (tmp_path / "other.json", "is not a Hugging Face tokenizer.json"),
        (tmp_path / "empty_folder", "has no tokenizer.json"),
    ]
    for path, message in cases:
        with pytest.raises(DataError, match=message) as info:
            tokenizer_lib.load(str(path))
        assert "\n" not in str(info.value) and str(path) in str(info.value)
        data = _cfg(f"data.tokenizer={path}").data
        with pytest.raises(ConfigError, match=f"^data.tokenizer: .*{message}") as info:
            inputs.element_spec(data, 0)
        assert "\n" not in str(info.value)
    raw = config_lib.to_dict(_cfg())
    raw["data"]["tokenizer"] = "tok\0.json"  # from a YAML file's escaped string
    with pytest.raises(ConfigError, match="^data.tokenizer: .*NUL"):
        config_lib.from_dict(raw)


def test_tfds_text_rows_with_a_tokenizer(bpe, tmp_path):
    fx.build_tiny_text_dataset(str(tmp_path), num_train=24, num_test=8)
    src = from_tfds("tiny_text", "train", str(tmp_path), length=8, tokenizer=bpe)
    texts, _ = fx.text_rows("train", 24)
    want = []
    for i, text in enumerate(texts):
        want += ([0] if i else []) + _reference_ids(BPE_2K, text)
    assert src.tokens.tolist() == want and src.element_spec == {"tokens": ((9,), np.dtype(np.uint16))}
    assert bpe.decode(src.tokens) == EOD.join(texts)  # non-ASCII rows included


# --- the cache ---------------------------------------------------------------------------------


def test_cache_returns_the_same_stream_and_never_a_stale_one(bpe, corpus, tmp_path, monkeypatch):
    cache = tmp_path / "tokens"

    def source(tok):
        return TextSource("train", 4, corpus_dir=str(corpus), eval_fraction=0.0, tokenizer=tok, cache_dir=str(cache))

    first = source(bpe).tokens
    uncached = TextSource("train", 4, corpus_dir=str(corpus), eval_fraction=0.0, tokenizer=bpe).tokens
    np.testing.assert_array_equal(first, uncached)
    assert len(list(cache.glob("*.npy"))) == 1

    real_stream = tokenizer_lib.HFTokenizer.stream
    calls = []

    def counted(self, docs):
        calls.append(len(docs))
        return real_stream(self, docs)

    monkeypatch.setattr(tokenizer_lib.HFTokenizer, "stream", counted)
    again = source(bpe).tokens
    assert calls == [] and again.dtype == np.uint16
    np.testing.assert_array_equal(again, first)  # read back, not tokenized

    # A file edited in place, same size and modification time: the content decides, not the times.
    path = corpus / "m3.py"
    stat, old = path.stat(), path.read_bytes()
    path.write_bytes(old.replace(b"return", b"RETURN", 1))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    edited = source(bpe).tokens
    assert calls == [6] and not np.array_equal(edited, first)
    assert bpe.decode(edited).count("RETURN") == 1

    # Another tokenizer at the same path: its own ids.
    tok_path = tmp_path / "tok" / "tokenizer.json"
    _save(_tiny_bpe([d.decode() for d in _docs(corpus)], 300, [EOD]), tok_path.parent)
    small = source(tokenizer_lib.load(str(tok_path))).tokens
    shutil.copy(BPE_2K, tok_path)
    swapped = source(tokenizer_lib.load(str(tok_path))).tokens
    np.testing.assert_array_equal(swapped, edited)  # the 2k tokenizer's stream of the edited corpus
    assert not np.array_equal(small[: swapped.size], swapped) and int(small.max()) < 300

    # A damaged entry is tokenized again and rewritten.
    for entry in cache.glob("*.npy"):
        entry.write_bytes(entry.read_bytes()[:20])
    n = len(calls)
    np.testing.assert_array_equal(source(bpe).tokens, edited)
    assert len(calls) == n + 1
    np.testing.assert_array_equal(source(bpe).tokens, edited)
    assert len(calls) == n + 1


def test_cache_key_depends_on_split_cap_and_document_boundaries(bpe):
    docs = [b"ab", b"c"]
    key = tokenizer_lib.cache_key(bpe, docs, ("split=train",))
    assert key == tokenizer_lib.cache_key(bpe, list(docs), ("split=train",))
    assert key != tokenizer_lib.cache_key(bpe, docs, ("split=eval",))
    assert key != tokenizer_lib.cache_key(bpe, [b"a", b"bc"], ("split=train",))
    assert key != tokenizer_lib.cache_key(tokenizer_lib.load("byte"), docs, ("split=train",))


# --- meshpar: data.tokenizer -------------------------------------------------------------------


def test_empty_tokenizer_resolves_through_init_from(tmp_path):
    data = _cfg().data
    assert inputs.tokenizer_spec(data) == "byte"
    assert inputs.tokenizer_spec(data, str(tmp_path)) == "byte"  # a folder without one
    shutil.copy(BPE_2K, tmp_path / "tokenizer.json")
    assert inputs.tokenizer_spec(data, str(tmp_path)) == str(tmp_path / "tokenizer.json")
    assert inputs.element_spec(data, 0, str(tmp_path)) == {"tokens": ((17,), np.dtype(np.uint16))}
    assert inputs.element_spec(data, 0) == {"tokens": ((17,), np.dtype(np.uint8))}
    assert inputs.tokenizer_spec(_cfg("data.tokenizer=byte").data, str(tmp_path)) == "byte"  # an explicit setting wins
    # A run's checkpoint folder: the tokenizer an import copied into the run's folder.
    (tmp_path / "checkpoints").mkdir()
    assert inputs.tokenizer_spec(data, str(tmp_path / "checkpoints")) == str(tmp_path / "tokenizer.json")
    # A run started from a model folder, itself without a tokenizer: the model's, through its summary.json.
    run = tmp_path / "runs" / "finetune"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"config": {"checkpoint": {"init_from": str(tmp_path)}}}))
    assert inputs.tokenizer_spec(data, str(run)) == str(tmp_path / "tokenizer.json")
    (run / "summary.json").write_text(json.dumps({"config": {"checkpoint": {"init_from": ""}}}))
    assert inputs.tokenizer_spec(data, str(run)) == "byte"


def test_element_spec_reads_the_tokenizer_file_only(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was tokenized")

    monkeypatch.setattr(tokenizer_lib.HFTokenizer, "encode_batch", refuse)
    monkeypatch.setattr(text_source, "TextSource", refuse)
    data = _cfg(f"data.tokenizer={BPE_2K}").data
    assert inputs.element_spec(data, 0) == {"tokens": ((17,), np.dtype(np.uint16))}
    # A folder holding a tokenizer.json (a Hugging Face model's) names it too.
    shutil.copy(BPE_2K, tmp_path / "tokenizer.json")
    assert inputs.element_spec(_cfg(f"data.tokenizer={tmp_path}").data, 0) == {"tokens": ((17,), np.dtype(np.uint16))}


def test_model_vocabulary_smaller_than_the_tokenizers_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(inputs.TOKEN_CACHE_ENV, str(tmp_path / "tokens"))
    with pytest.raises(ConfigError) as info:
        inputs.check_vocab(_cfg(f"data.tokenizer={BPE_2K}"))
    assert str(info.value) == f"model.vocab_size: 256 but data.tokenizer {BPE_2K} has 2048 tokens"
    with pytest.raises(ConfigError, match="model.vocab_size: 200 but data.tokenizer byte has 256 tokens"):
        inputs.check_vocab(_cfg("model.vocab_size=200"))
    inputs.check_vocab(_cfg(f"data.tokenizer={BPE_2K}", "model.vocab_size=2048"))
    inputs.check_vocab(_cfg(f"data.tokenizer={BPE_2K}", "model.vocab_size=4096"))  # a padded embedding is fine
    # The planner's path refuses it too, before the source is opened.
    monkeypatch.setattr(inputs, "make_source", lambda *a, **k: pytest.fail("the source was opened"))
    with pytest.raises(ConfigError, match="^model.vocab_size: 256 but data.tokenizer"):
        parts.abstract_step(_cfg(f"data.tokenizer={BPE_2K}"))


def test_inputs_build_serves_tokenizer_ids(tmp_path, monkeypatch, corpus):
    monkeypatch.setenv(inputs.TOKEN_CACHE_ENV, str(tmp_path / "tokens"))
    cfg = _cfg(
        f"data.tokenizer={BPE_2K}", "model.vocab_size=2048", f"data.corpus_dir={corpus}", "data.eval_fraction=0.3"
    )
    mesh = parts.make_mesh(cfg)
    built = inputs.build(cfg, mesh, parts.make_layout(cfg, mesh))
    assert built.element_spec == inputs.element_spec(cfg.data, 0) == {"tokens": ((17,), np.dtype(np.uint16))}
    batch = built.train.batch(0)["tokens"]
    assert batch.dtype == np.uint16 and batch.shape == (8, 17) and int(batch.max()) < 2048
    assert len(list((tmp_path / "tokens").glob("*.npy"))) >= 1  # the stream was kept for the next start


def test_cli_refuses_a_too_small_model_vocabulary_in_one_line(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", inputs.TOKEN_CACHE_ENV: str(tmp_path / "tokens")}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    result = subprocess.run(
        [sys.executable, "-m", "meshpar.train", "--config", str(ROOT / "experiments" / "quickstart.yaml"),
         f"data.tokenizer={BPE_2K}", f"workdir={tmp_path / 'run'}"],
        check=False, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == f"config error: model.vocab_size: 256 but data.tokenizer {BPE_2K} has 2048 tokens"
    assert not (tmp_path / "run").exists() and not (tmp_path / "tokens").exists()  # before anything ran


# --- scripts/train_tokenizer.py ----------------------------------------------------------------


def test_train_tokenizer_script_on_a_small_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stdlib = pathlib.Path(os.__file__).parent
    for name in (
        "os.py",
        "shutil.py",
        "tempfile.py",
        "pathlib.py",
        "textwrap.py",
        "string.py",
        "glob.py",
        "fnmatch.py",
    ):
        shutil.copy(stdlib / name, corpus / name)
    out = tmp_path / "out" / "tok.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_tokenizer.py"), "--corpus-dir", str(corpus), "--vocab-size", "400",
         "--eval-fraction", "0.3", "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "tokens/byte" in result.stdout and "trained a 400-token byte-level BPE" in result.stdout
    tok = tokenizer_lib.load(str(out))
    assert tok.vocab_size == 400 and tok.eod_token == EOD and tok.separator.tolist() == [0]
    text = (stdlib / "textwrap.py").read_text()
    (ids,) = tok.encode_batch([text.encode()])
    assert tok.decode(ids) == text and len(ids) < 0.7 * len(text.encode())


def test_committed_tokenizer_is_small_and_documented():
    assert BPE_2K.stat().st_size < 300_000
    command = f"python scripts/train_tokenizer.py --vocab-size 2048 --out experiments/tokenizers/{BPE_2K.name}"
    assert command in (BPE_2K.parent / "README.md").read_text()
    assert command in (ROOT / "scripts" / "train_tokenizer.py").read_text()
