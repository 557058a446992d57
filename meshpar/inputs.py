"""The one place meshpar and input_pipeline meet: config → source, loader, feeder."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib

import numpy as np
from jax.sharding import Mesh, NamedSharding

from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.batching import HostLoader
from input_pipeline.errors import DataError
from input_pipeline.feeding import FEEDERS, Feeder, process_rows
from input_pipeline.prefetch import Prefetcher
from input_pipeline.synthetic import SyntheticSource
from input_pipeline import tokens as tokens_lib
from input_pipeline.text import TextSource, from_tfds
from input_pipeline.tfds_source import TfdsSource  # tfds itself loads only when a source opens
from input_pipeline.tfds_source import name_problem as tfds_name_problem
from input_pipeline.workers import WorkerBatches
from meshpar.config import WINDOW_SOURCES, Config, ConfigError, DataConfig
from meshpar.hf import files as hf_files
from meshpar.layout import Layout


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


TEXT_SOURCES = ("text", "tfds_text")  # tokenized when the run starts (data.tokenizer)
# Where Hugging Face token streams are kept between starts (input_pipeline.tokenizer); the
# environment variable, when set, wins ("" = no cache: tokenize at every start).
TOKEN_CACHE_ENV, TOKEN_CACHE_DIR = "MESHPAR_TOKEN_CACHE", "~/.cache/meshpar/tokens"


def tokenizer_spec(data: DataConfig, init_from: str = "") -> str:
    """``data.tokenizer`` resolved: as given, or for "" the tokenizer.json of the weights
    ``checkpoint.init_from`` names, when there is one (a Hugging Face model's folder, or a
    meshpar run an import copied it into), else ``byte``. A run's tokenizer is looked for where
    the export looks (:func:`meshpar.hf.files.origins`): the folder, its parent (the run of a
    checkpoint folder), then the folders that run was itself started from. A prepared corpus
    (``data.source: tokens``) names its own: the copy in its folder, or ``byte``."""
    if data.source == "tokens":
        return _corpus_tokenizer(data)
    if data.tokenizer:
        return data.tokenizer
    if init_from:
        for folder in hf_files.origins(pathlib.Path(os.path.expanduser(init_from))):
            if (folder / "tokenizer.json").is_file():
                return str(folder / "tokenizer.json")
    return tokenizer_lib.BYTE


def _corpus_tokenizer(data: DataConfig) -> str:
    """The tokenizer a prepared corpus was made with; ``data.tokenizer``, when set, must be it."""
    own = tokens_lib.corpus_tokenizer_file(data.path)
    if data.tokenizer and data.tokenizer != own:
        try:
            given, made = tokenizer_lib.load(data.tokenizer), tokenizer_lib.load(own)
        except DataError as e:
            raise ConfigError("data.tokenizer", str(e)) from None
        if given.fingerprint != made.fingerprint:
            raise ConfigError("data.tokenizer", f"{data.tokenizer} is not the tokenizer the corpus {data.path} was prepared with ({made.name})")
    return own


def load_tokenizer(data: DataConfig, init_from: str = "") -> tokenizer_lib.Tokenizer:
    """The text sources' tokenizer (:func:`tokenizer_spec`); a bad file is one ConfigError."""
    spec = tokenizer_spec(data, init_from)
    try:
        return tokenizer_lib.load(spec)
    except DataError as e:
        raise ConfigError("data.tokenizer", str(e)) from None


def token_cache_dir() -> str | None:
    folder = os.environ.get(TOKEN_CACHE_ENV, TOKEN_CACHE_DIR)
    return os.path.expanduser(folder) if folder else None


def check_vocab(cfg: Config) -> None:
    """A model whose vocabulary is smaller than the tokenizer's would index past its embedding
    (XLA clamps the lookup silently): refused before the corpus is read. Reads only the
    tokenizer file."""
    vocab = getattr(cfg.model, "vocab_size", None)
    if cfg.data.source not in WINDOW_SOURCES or vocab is None:
        return
    if cfg.data.source == "tokens":
        tokenizer_spec(cfg.data)  # data.tokenizer, when set, must be the corpus's
        have = tokens_lib.corpus_vocab_size(cfg.data.path)
        if vocab < have:
            raise ConfigError("model.vocab_size", f"{vocab} but the corpus {cfg.data.path} was tokenized with a vocabulary of {have}")
        return
    tokenizer = load_tokenizer(cfg.data, cfg.checkpoint.init_from)
    if vocab < tokenizer.vocab_size:
        raise ConfigError(
            "model.vocab_size", f"{vocab} but data.tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens"
        )


def tokenizer_sha256(data: DataConfig, init_from: str = "") -> str | None:
    """The sha256 of the tokenizer.json the run's token ids come from (None: bytes, or a source
    of no tokens): the file's content, not its path, since a file replaced in place changes
    every id. A prepared corpus's is its manifest's."""
    if data.source == "tokens":
        made = tokens_lib.read_manifest(data.path)["tokenizer"]
        return None if made["kind"] == tokenizer_lib.BYTE else made["sha256"]
    if data.source not in TEXT_SOURCES:
        return None
    spec = tokenizer_spec(data, init_from)
    if spec == tokenizer_lib.BYTE:
        return None
    return hashlib.sha256(pathlib.Path(tokenizer_lib.tokenizer_file(spec)).read_bytes()).hexdigest()


def make_source(data: DataConfig, split: str, seed: int, init_from: str = "", vocab_limit: int | None = None):
    """The source for the train split (``split="train"``) or the eval split (``"eval"``); None if
    absent. `init_from`: ``checkpoint.init_from``, where ``data.tokenizer: ""`` looks first.
    `vocab_limit`: the model's vocabulary, which a prepared corpus's ids are checked against on
    every read (a corrupt shard names itself instead of indexing past the embedding)."""
    if data.source in ("tfds", "tfds_text"):
        problem = tfds_name_problem(data.name)
        if problem:  # e.g. a path: error lines must never show folders outside data_dir
            raise ConfigError("data.name", problem)
    if data.source == "synthetic":
        n = data.num_examples if split == "train" else data.num_eval_examples
        return SyntheticSource(n, data.num_features, data.num_classes, seed, split) if n else None
    if data.source == "tfds":
        name = data.split if split == "train" else data.eval_split
        return TfdsSource(data.name, name, data.data_dir, dict(data.fields)) if name else None
    if data.source == "text":
        if split == "eval" and data.eval_fraction == 0:
            return None
        tokenizer = load_tokenizer(data, init_from)
        return TextSource(
            split, data.length, data.corpus_dir or None, data.eval_fraction, data.max_bytes or None,
            tokenizer=tokenizer, cache_dir=token_cache_dir(),
        )  # fmt: skip
    if data.source == "tfds_text":
        name = data.split if split == "train" else data.eval_split
        if not name:
            return None
        tokenizer = load_tokenizer(data, init_from)
        return from_tfds(
            data.name,
            name,
            data.data_dir,
            data.text_feature,
            length=data.length,
            tokenizer=tokenizer,
            cache_dir=token_cache_dir(),
        )
    if data.source == "tokens":
        name = data.split if split == "train" else data.eval_split
        if not name:
            return None
        return tokens_lib.TokenSource(data.path, name, data.length, windows=data.windows, vocab_limit=vocab_limit, verify=data.verify)
    raise ValueError(f"unknown data source {data.source!r}")


def element_spec(data: DataConfig, seed: int, init_from: str = "") -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The train source's per-example ``(shape, dtype)`` by field, without reading the data
    where the config alone says it (synthetic; text, whose dtype follows the tokenizer file's
    vocabulary); a tfds dataset's comes from its info. `init_from` as for :func:`make_source`."""
    if data.source == "synthetic":
        return {"inputs": ((data.num_features,), np.dtype(np.float32)), "targets": ((), np.dtype(np.int32))}
    if data.source in TEXT_SOURCES:
        return {"tokens": ((data.length + 1,), load_tokenizer(data, init_from).dtype)}
    if data.source == "tokens":
        return {"tokens": ((data.length + 1,), tokens_lib.corpus_dtype(data.path))}
    return dict(make_source(data, "train", seed, init_from).element_spec)


def batch_shardings(element_spec: dict, layout: Layout, mesh: Mesh) -> dict[str, NamedSharding]:
    """Every field is ``[batch, ...]``: split on the batch dim, the rest whole."""
    return {k: layout.sharding(mesh, ("batch",) + (None,) * len(shape)) for k, (shape, _) in element_spec.items()}


def build(cfg: Config, mesh: Mesh, layout: Layout) -> Inputs:
    check_vocab(cfg)  # before tokenizing the corpus, which can take seconds
    init_from = cfg.checkpoint.init_from
    vocab = getattr(cfg.model, "vocab_size", None)
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
