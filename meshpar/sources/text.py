"""``data.source: text``: token windows of a folder of .py files (default: the Python standard
library's own sources), tokenized when the run starts."""

from __future__ import annotations

from typing import Any

from input_pipeline.text import TextSource
from meshpar.sources.base import LoadTokenizer, TokenizedText, token_cache_dir


class Text(TokenizedText):
    name = "text"
    fields = ("length", "corpus_dir", "eval_fraction", "max_bytes", "tokenizer")
    eval_key = "eval_fraction"

    def open(self, data: Any, split: str, seed: int, tokenizer: LoadTokenizer, vocab_limit: int | None = None) -> Any:
        if split == "eval" and data.eval_fraction == 0:
            return None
        return TextSource(
            split, data.length, data.corpus_dir or None, data.eval_fraction, data.max_bytes or None,
            tokenizer=tokenizer(), cache_dir=token_cache_dir(),
        )  # fmt: skip
