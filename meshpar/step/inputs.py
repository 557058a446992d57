"""The one place meshpar and input_pipeline meet: config → source, loader, feeder."""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib

import numpy as np
from jax.sharding import Mesh, NamedSharding

from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.batching import HostLoader
from input_pipeline.errors import DataError
from input_pipeline.feeding import FEEDERS, Feeder, process_rows
from input_pipeline.prefetch import Prefetcher
from input_pipeline.workers import WorkerBatches
from meshpar import models, sources
from meshpar.configuration.config import Config, ConfigError, DataConfig
from meshpar.hf import files as hf_files
from meshpar.sharding.layout import Layout
from meshpar.sources import base as sources_base


@dataclasses.dataclass
class Inputs:
    element_spec: dict  # field → (per-example shape, dtype)
    shardings: dict[str, NamedSharding]  # field → sharding of the global batch
    train: HostLoader
    eval: HostLoader | None
    feeder: Feeder  # places train batches (from the prefetch thread when prefetching)
    eval_feeder: Feeder  # places eval batches, so eval never touches the train feeder's staging or figures
    prefetch: int
    workers: int = 0  # processes assembling train host batches (0 = this one)
    tokenizer_sha256: str | None = None  # of the tokenizer.json the token ids come from (None: bytes, or no tokens)

    def batches(self, start: int, stop: int) -> Prefetcher:
        """Placed train batches ``start..stop-1``, ``prefetch`` ahead (use as a context manager).
        With ``workers``, host batches come from worker processes, in the same order and with
        the same content; closing the prefetcher stops them."""
        if not self.workers:

            def produce(step: int):
                host = self.train.batch(step)
                arrays, info = self.feeder.place(host)
                self.train.recycle(host, info.aliased)
                return arrays, info

            return Prefetcher(produce, start, stop, self.prefetch)

        assembled = WorkerBatches(self.train, start, stop, self.workers)

        def produce_assembled(step: int):
            got, host = next(assembled)
            if got != step:  # the workers' round-robin keeps the order: anything else is a bug
                raise RuntimeError(f"worker batches out of order: expected step {step}, got {got}")
            return self.feeder.place(host)

        return Prefetcher(produce_assembled, start, stop, self.prefetch, on_close=assembled.close)


# The Hugging Face token cache's environment variable (meshpar.sources.base, where the text sources use it).
TOKEN_CACHE_ENV = sources_base.TOKEN_CACHE_ENV


def tokenizer_spec(data: DataConfig, init_from: str = "") -> str:
    """``data.tokenizer`` resolved: the source's own where its data names one (a prepared corpus,
    ``data.source: tokens``: the copy in its folder, or ``byte``); else as given, or for "" the
    tokenizer.json of the weights ``checkpoint.init_from`` names, when there is one (a Hugging
    Face model's folder, or a meshpar run an import copied it into), else ``byte``. A run's
    tokenizer is looked for where the export looks (:func:`meshpar.hf.files.origins`): the
    folder, its parent (the run of a checkpoint folder), then the folders that run was itself
    started from."""
    own = sources.of(data).own_tokenizer(data)
    if own is not None:
        return own
    if data.tokenizer:
        return data.tokenizer
    if init_from:
        for folder in hf_files.origins(pathlib.Path(os.path.expanduser(init_from))):
            if (folder / "tokenizer.json").is_file():
                return str(folder / "tokenizer.json")
    return tokenizer_lib.BYTE


def load_tokenizer(data: DataConfig, init_from: str = "") -> tokenizer_lib.Tokenizer:
    """The text sources' tokenizer (:func:`tokenizer_spec`); a bad file is one ConfigError."""
    spec = tokenizer_spec(data, init_from)
    try:
        return tokenizer_lib.load(spec)
    except DataError as e:
        raise ConfigError("data.tokenizer", str(e)) from None


def check_vocab(cfg: Config) -> None:
    """A model whose vocabulary is smaller than the tokenizer's would index past its embedding
    (XLA clamps the lookup silently): refused before the corpus is read. Reads only the
    tokenizer file (or a prepared corpus's manifest)."""
    traits = models.traits(cfg.model)
    if traits.vocab_size is not None:
        tokenizer = functools.partial(load_tokenizer, cfg.data, cfg.checkpoint.init_from)
        sources.of(cfg.data).check_vocab(cfg.data, traits.vocab_size, tokenizer, traits.key("vocab_size"))


def tokenizer_sha256(data: DataConfig, init_from: str = "") -> str | None:
    """The sha256 of the tokenizer.json the run's token ids come from (None: bytes, or a source
    of no tokens): the file's content, not its path, since a file replaced in place changes
    every id. A prepared corpus's is its manifest's."""
    return sources.of(data).tokenizer_sha256(data, functools.partial(tokenizer_spec, data, init_from))


def make_source(data: DataConfig, split: str, seed: int, init_from: str = "", vocab_limit: int | None = None):
    """The source for the train split (``split="train"``) or the eval split (``"eval"``); None if
    absent. `init_from`: ``checkpoint.init_from``, where ``data.tokenizer: ""`` looks first.
    `vocab_limit`: the model's vocabulary, which a prepared corpus's ids are checked against on
    every read (a corrupt shard names itself instead of indexing past the embedding)."""
    tokenizer = functools.partial(load_tokenizer, data, init_from)
    return sources.of(data).open(data, split, seed, tokenizer, vocab_limit)


def element_spec(data: DataConfig, seed: int, init_from: str = "") -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The train source's per-example ``(shape, dtype)`` by field, without reading the data
    where the config alone says it (synthetic; text, whose dtype follows the tokenizer file's
    vocabulary); a tfds dataset's comes from its info. `init_from` as for :func:`make_source`."""
    return sources.of(data).element_spec(data, seed, functools.partial(load_tokenizer, data, init_from))


def batch_shardings(element_spec: dict, layout: Layout, mesh: Mesh) -> dict[str, NamedSharding]:
    """Every field is ``[batch, ...]``: split on the batch dim, the rest whole."""
    return {k: layout.sharding(mesh, ("batch",) + (None,) * len(shape)) for k, (shape, _) in element_spec.items()}


def build(cfg: Config, mesh: Mesh, layout: Layout) -> Inputs:
    check_vocab(cfg)  # before tokenizing the corpus, which can take seconds
    init_from = cfg.checkpoint.init_from
    vocab = models.traits(cfg.model).vocab_size
    train_source = make_source(cfg.data, "train", cfg.train.seed, init_from, vocab)
    spec = train_source.element_spec
    shardings = batch_shardings(spec, layout, mesh)
    first = next(iter(shardings.values()))
    rows = process_rows(first, (cfg.train.batch_size, *spec[next(iter(spec))][0]))
    reuse = cfg.feed.reuse_buffers
    if reuse and not hasattr(train_source, "read_into"):
        raise ConfigError("feed.reuse_buffers", f"the {cfg.data.source} source cannot read into reused buffers")
    train = HostLoader(train_source, cfg.train.batch_size, cfg.train.seed, rows, reuse_buffers=reuse)
    eval_source = make_source(cfg.data, "eval", cfg.train.seed, init_from, vocab)
    evaluation = eval_source and HostLoader(eval_source, cfg.train.batch_size, cfg.train.seed, rows, shuffle=False)
    feeder = FEEDERS[cfg.feed.mode](shardings, cfg.train.batch_size)
    eval_feeder = FEEDERS[cfg.feed.mode](shardings, cfg.train.batch_size)
    sha = tokenizer_sha256(cfg.data, init_from)
    return Inputs(spec, shardings, train, evaluation, feeder, eval_feeder, cfg.feed.prefetch, cfg.data.workers, sha)
