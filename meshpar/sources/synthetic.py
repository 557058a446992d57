"""``data.source: synthetic``: a seeded teacher network's classification task, made in memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from input_pipeline.synthetic import SyntheticSource
from meshpar.sources.base import LoadTokenizer, Source, Spec


class Synthetic(Source):
    name = "synthetic"
    fields = ("num_examples", "num_eval_examples", "num_features", "num_classes")
    eval_key = "num_eval_examples"

    def open(self, data: Any, split: str, seed: int, tokenizer: LoadTokenizer, vocab_limit: int | None = None) -> Any:
        n = data.num_examples if split == "train" else data.num_eval_examples
        return SyntheticSource(n, data.num_features, data.num_classes, seed, split) if n else None

    def element_spec(self, data: Any, seed: int, tokenizer: LoadTokenizer) -> Spec:
        return {"inputs": ((data.num_features,), np.dtype(np.float32)), "targets": ((), np.dtype(np.int32))}
