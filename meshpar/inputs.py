"""The one place meshpar and input_pipeline meet: config → source, loader, feeder."""

from __future__ import annotations

import dataclasses

import numpy as np

from jax.sharding import Mesh, NamedSharding

from input_pipeline.batching import HostLoader
from input_pipeline.feeding import FEEDERS, Feeder, process_rows
from input_pipeline.prefetch import Prefetcher
from input_pipeline.synthetic import SyntheticSource
from input_pipeline.text import VOCAB_SIZE, TextSource, from_tfds, token_dtype
from input_pipeline.tfds_source import TfdsSource  # tfds itself loads only when a source opens
from input_pipeline.tfds_source import name_problem as tfds_name_problem
from meshpar.config import Config, ConfigError, DataConfig
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

    def batches(self, start: int, stop: int) -> Prefetcher:
        """Placed train batches ``start..stop-1``, ``prefetch`` ahead (use as a context manager)."""

        def produce(step: int):
            host = self.train.batch(step)
            arrays, info = self.feeder.place(host)
            self.train.recycle(host, info.aliased)
            return arrays, info

        return Prefetcher(produce, start, stop, self.prefetch)


def make_source(data: DataConfig, split: str, seed: int):
    """The source for the train split (``split="train"``) or the eval split (``"eval"``); None if absent."""
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
        return TextSource(split, data.length, data.corpus_dir or None, data.eval_fraction, data.max_bytes or None)
    if data.source == "tfds_text":
        name = data.split if split == "train" else data.eval_split
        return from_tfds(data.name, name, data.data_dir, data.text_feature, length=data.length) if name else None
    raise ValueError(f"unknown data source {data.source!r}")


def element_spec(data: DataConfig, seed: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The train source's per-example ``(shape, dtype)`` by field, without reading the data
    where the config alone says it (synthetic, text); a tfds dataset's comes from its info."""
    if data.source == "synthetic":
        return {"inputs": ((data.num_features,), np.dtype(np.float32)), "targets": ((), np.dtype(np.int32))}
    if data.source in ("text", "tfds_text"):
        return {"tokens": ((data.length + 1,), token_dtype(VOCAB_SIZE))}
    return dict(make_source(data, "train", seed).element_spec)


def batch_shardings(element_spec: dict, layout: Layout, mesh: Mesh) -> dict[str, NamedSharding]:
    """Every field is ``[batch, ...]``: split on the batch dim, the rest whole."""
    return {k: layout.sharding(mesh, ("batch",) + (None,) * len(shape)) for k, (shape, _) in element_spec.items()}


def build(cfg: Config, mesh: Mesh, layout: Layout) -> Inputs:
    train_source = make_source(cfg.data, "train", cfg.train.seed)
    spec = train_source.element_spec
    shardings = batch_shardings(spec, layout, mesh)
    first = next(iter(shardings.values()))
    rows = process_rows(first, (cfg.train.batch_size, *spec[next(iter(spec))][0]))
    reuse = cfg.feed.reuse_buffers
    if reuse and not hasattr(train_source, "read_into"):
        raise ConfigError("feed.reuse_buffers", f"the {cfg.data.source} source cannot read into reused buffers")
    train = HostLoader(train_source, cfg.train.batch_size, cfg.train.seed, rows, reuse_buffers=reuse)
    eval_source = make_source(cfg.data, "eval", cfg.train.seed)
    evaluation = eval_source and HostLoader(eval_source, cfg.train.batch_size, cfg.train.seed, rows, shuffle=False)
    feeder = FEEDERS[cfg.feed.mode](shardings, cfg.train.batch_size)
    eval_feeder = FEEDERS[cfg.feed.mode](shardings, cfg.train.batch_size)
    return Inputs(spec, shardings, train, evaluation, feeder, eval_feeder, cfg.feed.prefetch)
