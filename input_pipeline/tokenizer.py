"""Tokenizers for the text sources: documents (bytes) → one stream of token ids.

Two kinds, one interface (:class:`Tokenizer`):
  * :class:`ByteTokenizer` (``"byte"``) — one token per byte, vocabulary 256; documents are
    joined with ``b"\\n"``, exactly the byte stream the text sources have always served.
  * :class:`HFTokenizer` — a Hugging Face ``tokenizer.json`` read with ``tokenizers`` (the
    file's bytes, read once, are both loaded and hashed for the cache). Documents are UTF-8
    text (the few bytes that are not valid UTF-8 become U+FFFD, since the library takes
    ``str``) encoded with ``encode_batch`` and *no* special tokens from the post-processor (a
    BOS per file would be noise inside a stream cut into fixed windows); special tokens written
    in a document are encoded as text; documents are separated by the end-of-document ids.

The end-of-document token (:attr:`Tokenizer.separator`) of a Hugging Face tokenizer, first
that applies: the ``eos_token`` of a ``tokenizer_config.json`` beside the file (what the
model was trained to emit at a document's end), when it is in the vocabulary; else the first
of :data:`EOD_TOKENS` in the vocabulary (GPT-2's ``<|endoftext|>``, Llama 3's
``<|end_of_text|>``, SentencePiece's ``</s>``, Gemma's ``<eos>``); else the encoding of
``"\\n"`` (what the byte tokenizer puts there).

Ids come out in the narrowest dtype that holds the vocabulary (:func:`token_dtype`).

Tokenizing a large corpus takes a while (the standard library's 30 MB: 15 s or more on two cores), so
:func:`encode_documents` keeps token streams in a cache folder, one ``.npy`` per stream, named
by a hash of everything the tokens depend on: the documents' bytes (their content, not their
names or times, so an edited corpus never hits a stale entry), the tokenizer file's bytes, the
separator, the ``tokenizers`` version, and the caller's own key parts (split, byte cap). Entries
are written to a temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np

from input_pipeline.errors import DataError

BYTE = "byte"
BYTE_SEPARATOR = b"\n"
# Conventional end-of-document tokens, tried in this order when no tokenizer_config.json names one.
EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# Text handed to the library per encode_batch call: bounds the memory of its Encoding objects
# (each keeps its tokens as strings), while still giving every core documents to work on.
_CHUNK_BYTES = 4 << 20
# Bumped whenever the meaning of a cached stream changes.
_CACHE_FORMAT = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype holding token ids ``0 .. vocab_size - 1``: uint8 up to 256 (bytes),
    uint16 up to 65536, int32 above (what the model's embedding lookup takes anyway)."""
    if vocab_size < 1:
        raise DataError(f"vocab_size must be >= 1, got {vocab_size}")
    for dtype in (np.uint8, np.uint16):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    if vocab_size > np.iinfo(np.int32).max + 1:
        raise DataError(f"vocab_size {vocab_size} does not fit int32 token ids")
    return np.dtype(np.int32)


class Tokenizer:
    """Documents → token ids in ``[0, vocab_size)``."""

    name: str  # "byte", or the tokenizer.json file
    vocab_size: int
    separator: np.ndarray  # ids placed between two documents (the end-of-document token)
    fingerprint: str  # a hash of everything that decides the ids (cache keys)

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    def encode_batch(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def stream(self, docs: Sequence[bytes]) -> np.ndarray:
        """Every document's ids, in order, with :attr:`separator` between two documents."""
        parts: list[np.ndarray] = []
        chunk: list[bytes] = []
        size = 0
        for doc in docs:
            chunk.append(doc)
            size += len(doc)
            if size >= _CHUNK_BYTES:
                parts += self.encode_batch(chunk)
                chunk, size = [], 0
        if chunk:
            parts += self.encode_batch(chunk)
        joined: list[np.ndarray] = []
        for i, ids in enumerate(parts):
            if i:
                joined.append(self.separator)
            joined.append(ids)
        return np.concatenate(joined) if joined else np.zeros(0, self.dtype)


class ByteTokenizer(Tokenizer):
    name = BYTE
    vocab_size = 256
    separator = np.frombuffer(BYTE_SEPARATOR, np.uint8)
    fingerprint = BYTE

    def encode_batch(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(bytes(d), np.uint8) for d in docs]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(np.asarray(list(ids), np.uint8)).decode("utf-8", errors="replace")

    def stream(self, docs: Sequence[bytes]) -> np.ndarray:
        # One join: the byte stream exactly as it has always been built, without per-document arrays.
        return np.frombuffer(BYTE_SEPARATOR.join(bytes(d) for d in docs), dtype=np.uint8).copy()


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (see the module's docstring for the separator)."""

    def __init__(self, path: str):
        import tokenizers  # here, so that the byte tokenizer never needs the library

        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror})") from None
        try:
            tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception (and bytes may not be UTF-8)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DataError(f"{path} is not a Hugging Face tokenizer.json ({first})") from None
        vocab = tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"{path}: the tokenizer has an empty vocabulary")
        # Documents are data: a literal "<|endoftext|>" inside one is text, so that the
        # end-of-document id appears only where one document ends.
        tok.encode_special_tokens = True
        self.name, self._tok = path, tok
        # Ids need not be dense (added tokens may sit past the base vocabulary): the largest + 1.
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        self.eod_token, self.separator = self._separator(path, tok)
        self.fingerprint = hashlib.sha256(
            raw + b"\0" + self.separator.tobytes() + b"\0" + tokenizers.__version__.encode()
        ).hexdigest()

    def _separator(self, path: str, tok) -> tuple[str | None, np.ndarray]:
        named = _config_eos(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
        for token in ([named] if named else []) + list(EOD_TOKENS):
            i = tok.token_to_id(token)
            if i is not None:
                return token, np.array([i], self.dtype)
        ids = tok.encode("\n", add_special_tokens=False).ids
        if not ids:
            raise DataError(f"{path}: no end-of-document token ({', '.join(EOD_TOKENS)}) and '\\n' encodes to nothing")
        return None, np.array(ids, self.dtype)

    def encode_batch(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, (bytes, bytearray)) else str(d) for d in docs]
        # encode_batch, not encode_batch_fast: the latter skips the offsets (less work), but
        # measured with tokenizers 0.23 it kept a batch on one core, while encode_batch spreads
        # the documents over all of them.
        return [np.array(e.ids, self.dtype) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _config_eos(path: str) -> str | None:
    """The eos_token of a tokenizer_config.json (a string, or an AddedToken's dict), if any."""
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def tokenizer_file(spec: str) -> str:
    """The tokenizer.json that `spec` names: the file itself, or the one inside a folder."""
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        inside = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(inside):
            raise DataError(f"folder {spec} has no tokenizer.json")
        return inside
    if not os.path.exists(path):
        raise DataError(f"{spec}: no such file or folder")
    return path


def load(spec: str) -> Tokenizer:
    """``"byte"``, or the Hugging Face tokenizer at `spec` (a tokenizer.json or its folder)."""
    if spec == BYTE:
        return ByteTokenizer()
    path = tokenizer_file(spec)
    # Loading a large vocabulary takes a moment and the planner asks many times; a changed
    # file (size or time, the tokenizer's or its tokenizer_config.json's) is read again.
    stamps = tuple(_stamp(p) for p in (path, os.path.join(os.path.dirname(path), "tokenizer_config.json")))
    return _load_file(path, stamps)


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _load_file(path: str, stamps: tuple) -> HFTokenizer:
    return HFTokenizer(path)


def encode_documents(
    tokenizer: Tokenizer, docs: Sequence[bytes], cache_dir: str | None = None, key: Sequence[str] = ()
) -> np.ndarray:
    """:meth:`Tokenizer.stream` of `docs`, read from / written to `cache_dir` when given (see
    the module's docstring); `key`: the caller's own parts of the cache key. The byte tokenizer
    is never cached: its stream is the documents themselves."""
    if cache_dir is None or isinstance(tokenizer, ByteTokenizer):
        return tokenizer.stream(docs)
    path = os.path.join(os.path.expanduser(cache_dir), f"{cache_key(tokenizer, docs, key)}.npy")
    try:
        cached = np.load(path, allow_pickle=False)
        if cached.ndim == 1 and cached.dtype == tokenizer.dtype:
            return cached
    except (OSError, ValueError, EOFError):
        pass  # absent, unreadable or not an array: tokenize again and rewrite it
    stream = tokenizer.stream(docs)
    _write(path, stream)
    return stream


def cache_key(tokenizer: Tokenizer, docs: Sequence[bytes], key: Sequence[str] = ()) -> str:
    h = hashlib.sha256(f"meshpar tokens {_CACHE_FORMAT}\0{tokenizer.fingerprint}\0".encode())
    for part in key:
        h.update(f"{part}\0".encode())
    h.update(f"{len(docs)}\0".encode())
    for doc in docs:
        h.update(f"{len(doc)}\0".encode())  # lengths too: ["ab", "c"] and ["a", "bc"] differ
        h.update(doc)
    return h.hexdigest()


def _write(path: str, stream: np.ndarray) -> None:
    """Best effort: a cache folder that cannot be written costs the next start time, not this run."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".npy")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, stream, allow_pickle=False)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
