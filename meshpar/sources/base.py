"""What a data source is to meshpar: :class:`Source`, the one value of ``data.source`` it names.

A source is an object, registered in :mod:`meshpar.sources`, that says which ``data.<key>``
settings are its own, checks them (one-line :class:`~meshpar.configuration.schema.ConfigError`), names its eval
split's setting, and opens its host-side source (an ``input_pipeline`` class: ``len``,
``element_spec``, ``batch(indices)``). ``data`` is always the run's ``data`` section
(:class:`meshpar.configuration.config.DataConfig`); a source reads only its own fields from it. What a source
needs from the run it gets as arguments: the model's vocabulary, and ``tokenizer``, which loads
``data.tokenizer`` as the run resolves it (its own, ``checkpoint.init_from``'s, or bytes).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from input_pipeline import tokenizer as tokenizer_lib
from meshpar.configuration.schema import ConfigError

Spec = dict[str, tuple[tuple[int, ...], np.dtype]]  # field → (per-example shape, dtype)
# Loads data.tokenizer as the run resolves it (a bad file: one ConfigError); called only by a
# source that tokenizes, so the others never read a tokenizer file.
LoadTokenizer = Callable[[], tokenizer_lib.Tokenizer]

# Where Hugging Face token streams are kept between starts (input_pipeline.tokenizer); the
# environment variable, when set, wins ("" = no cache: tokenize at every start).
TOKEN_CACHE_ENV, TOKEN_CACHE_DIR = "MESHPAR_TOKEN_CACHE", "~/.cache/meshpar/tokens"


def token_cache_dir() -> str | None:
    folder = os.environ.get(TOKEN_CACHE_ENV, TOKEN_CACHE_DIR)
    return os.path.expanduser(folder) if folder else None


def split_name(data: Any, split: str) -> str:
    """The dataset's split for ``split`` ("train" or "eval"): data.split or data.eval_split."""
    return data.split if split == "train" else data.eval_split


class Source:
    """One value of ``data.source``. A subclass sets the attributes and defines :meth:`open`;
    every other method has a default that fits a source of arrays that names no tokenizer."""

    name: str = ""  # the value of data.source
    # The data.<key> settings it reads (besides source and workers, which every source has).
    fields: tuple[str, ...] = ()
    # (key, why) for each data.<key> it cannot run without, checked in this order: an empty one
    # is `data.<key>: required when data.source is <name><why>`.
    required: tuple[tuple[str, str], ...] = ()
    # The data.<key> whose zero or empty value leaves it without an eval split ("" = none).
    eval_key: str = ""
    # Examples are windows of data.length + 1 token ids ("tokens"): data.length is checked
    # against model.max_length and model.attention_block, the model's vocabulary against its ids.
    token_windows: bool = False

    def check(self, data: Any) -> None:
        """Its own settings' checks that read no file (run by :func:`meshpar.configuration.config.check`)."""
        for key, why in self.required:
            if not getattr(data, key):
                raise ConfigError(f"data.{key}", f"required when data.source is {self.name}{why}")

    def open(self, data: Any, split: str, seed: int, tokenizer: LoadTokenizer, vocab_limit: int | None = None) -> Any:
        """The host-side source of ``split`` ("train" or "eval"); None when the settings give it
        none. `vocab_limit`: the model's vocabulary (None: no model vocabulary), for sources that
        can check token ids against it on every read."""
        raise NotImplementedError(f"data source {self.name!r} defines no open()")

    def element_spec(self, data: Any, seed: int, tokenizer: LoadTokenizer) -> Spec:
        """The train split's per-example ``(shape, dtype)`` by field. By default the opened
        source's; a source whose settings say it overrides this, so planning reads no data."""
        return dict(self.open(data, "train", seed, tokenizer).element_spec)

    def own_tokenizer(self, data: Any) -> str | None:
        """The tokenizer its token ids were made with, where the data names one (a prepared
        corpus); None: data.tokenizer, as the run resolves it."""
        return None

    def check_vocab(self, data: Any, vocab_size: int, tokenizer: LoadTokenizer, key: str) -> None:
        """Refuse a model vocabulary smaller than its token ids need (reading only a tokenizer
        file or a manifest), as a ConfigError on `key` (the family's vocabulary field); sources
        of no token ids have nothing to check."""

    def tokenizer_sha256(self, data: Any, spec: Callable[[], str]) -> str | None:
        """The sha256 of the tokenizer.json its token ids come from; None: bytes, or no token ids.
        `spec`: data.tokenizer as the run resolves it."""
        return None


class TokenizedText(Source):
    """A source of text tokenized when the run starts, with data.tokenizer, into windows of
    data.length + 1 ids (whose dtype follows the tokenizer's vocabulary)."""

    token_windows = True

    def element_spec(self, data: Any, seed: int, tokenizer: LoadTokenizer) -> Spec:
        return {"tokens": ((data.length + 1,), tokenizer().dtype)}

    def check_vocab(self, data: Any, vocab_size: int, tokenizer: LoadTokenizer, key: str) -> None:
        loaded = tokenizer()
        if vocab_size < loaded.vocab_size:
            raise ConfigError(key, f"{vocab_size} but data.tokenizer {loaded.name} has {loaded.vocab_size} tokens")

    def tokenizer_sha256(self, data: Any, spec: Callable[[], str]) -> str | None:
        name = spec()
        if name == tokenizer_lib.BYTE:
            return None
        return hashlib.sha256(pathlib.Path(tokenizer_lib.tokenizer_file(name)).read_bytes()).hexdigest()
