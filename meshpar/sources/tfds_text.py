"""``data.source: tfds_text``: token windows of a tfds dataset's Text feature, tokenized when the
run starts."""

from __future__ import annotations

from typing import Any

from input_pipeline.text import from_tfds
from meshpar.sources import tfds
from meshpar.sources.base import LoadTokenizer, TokenizedText, split_name, token_cache_dir


class TfdsText(TokenizedText):
    name = "tfds_text"
    fields = ("name", "data_dir", "split", "eval_split", "text_feature", "length", "tokenizer")
    required = tfds.REQUIRED
    eval_key = "eval_split"

    def open(self, data: Any, split: str, seed: int, tokenizer: LoadTokenizer, vocab_limit: int | None = None) -> Any:
        tfds.check_name(data)
        name = split_name(data, split)
        if not name:
            return None
        return from_tfds(
            data.name, name, data.data_dir, data.text_feature,
            length=data.length, tokenizer=tokenizer(), cache_dir=token_cache_dir(),
        )  # fmt: skip
