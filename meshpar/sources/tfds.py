"""``data.source: tfds``: a TensorFlow Datasets dataset prepared as array_record, read offline."""

from __future__ import annotations

from typing import Any

from input_pipeline.tfds_source import TfdsSource, name_problem  # tfds itself loads only when a source opens
from meshpar.configuration.schema import ConfigError
from meshpar.sources.base import LoadTokenizer, Source, split_name

# What every source read from a tfds data_dir cannot run without (tfds_text's too).
REQUIRED = (("name", ""), ("data_dir", " (data is read offline)"), ("split", " (the split to train on)"))


def check_name(data: Any) -> None:
    """data.name must be a dataset's name: e.g. a path would show folders outside data_dir in
    error lines."""
    problem = name_problem(data.name)
    if problem:
        raise ConfigError("data.name", problem)


class Tfds(Source):
    name = "tfds"
    fields = ("name", "data_dir", "split", "eval_split", "fields")
    required = REQUIRED
    eval_key = "eval_split"

    def open(self, data: Any, split: str, seed: int, tokenizer: LoadTokenizer, vocab_limit: int | None = None) -> Any:
        check_name(data)
        name = split_name(data, split)
        return TfdsSource(data.name, name, data.data_dir, dict(data.fields)) if name else None
