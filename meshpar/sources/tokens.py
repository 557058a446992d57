"""``data.source: tokens``: windows of a corpus prepared by ``python -m meshpar.data prepare``
(memory-mapped shards of token ids; its manifest names the tokenizer it was made with)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline import tokens as tokens_lib
from input_pipeline.errors import DataError
from meshpar.configuration.schema import ConfigError
from meshpar.sources.base import LoadTokenizer, Source, Spec, split_name


class Tokens(Source):
    name = "tokens"
    fields = ("path", "split", "eval_split", "length", "windows", "verify", "tokenizer")
    required = (
        ("path", " (a folder written by python -m meshpar.data prepare)"),
        ("split", " (the corpus's split to train on, e.g. train)"),
    )
    eval_key = "eval_split"
    token_windows = True

    def open(self, data: Any, split: str, seed: int, tokenizer: LoadTokenizer, vocab_limit: int | None = None) -> Any:
        name = split_name(data, split)
        if not name:
            return None
        return tokens_lib.TokenSource(
            data.path, name, data.length, windows=data.windows, vocab_limit=vocab_limit, verify=data.verify
        )

    def element_spec(self, data: Any, seed: int, tokenizer: LoadTokenizer) -> Spec:
        return {"tokens": ((data.length + 1,), tokens_lib.corpus_dtype(data.path))}

    def own_tokenizer(self, data: Any) -> str:
        """The tokenizer the corpus was prepared with; data.tokenizer, when set, must be it."""
        own = tokens_lib.corpus_tokenizer_file(data.path)
        if data.tokenizer and data.tokenizer != own:
            try:
                given, made = tokenizer_lib.load(data.tokenizer), tokenizer_lib.load(own)
            except DataError as e:
                raise ConfigError("data.tokenizer", str(e)) from None
            if given.fingerprint != made.fingerprint:
                raise ConfigError(
                    "data.tokenizer",
                    f"{data.tokenizer} is not the tokenizer the corpus {data.path} was prepared with ({made.name})",
                )
        return own

    def check_vocab(self, data: Any, vocab_size: int, tokenizer: LoadTokenizer, key: str) -> None:
        self.own_tokenizer(data)  # data.tokenizer, when set, must be the corpus's
        have = tokens_lib.corpus_vocab_size(data.path)
        if vocab_size < have:
            raise ConfigError(key, f"{vocab_size} but the corpus {data.path} was tokenized with a vocabulary of {have}")

    def tokenizer_sha256(self, data: Any, spec: Callable[[], str]) -> str | None:
        made = tokens_lib.read_manifest(data.path)["tokenizer"]
        return None if made["kind"] == tokenizer_lib.BYTE else made["sha256"]
