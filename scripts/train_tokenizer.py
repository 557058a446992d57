"""Train a small byte-level BPE tokenizer on the text source's train split and write its
tokenizer.json (for ``data.tokenizer``).

The corpus is what ``data.source: text`` trains on: the ``.py`` files of ``--corpus-dir``
(default the Python standard library), split train/eval by file exactly as the source splits
them (``--eval-fraction``, default 0.05, as ``data.eval_fraction``); the tokenizer sees only
the train split. It is a GPT-2-style byte-level BPE (``tokenizers``: ByteLevel pre-tokenizer
and decoder, so every text encodes and decodes back exactly), with one special token,
``<|endoftext|>`` (id 0), which the text sources put between documents. Afterwards it prints
the tokens per byte on both splits and how fast they tokenize.

The committed ``experiments/tokenizers/stdlib-bpe-2k.json`` was made on Python 3.11's standard
library with:

    python scripts/train_tokenizer.py --vocab-size 2048 --out experiments/tokenizers/stdlib-bpe-2k.json

(Another Python's standard library is another corpus, so it gives another tokenizer.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import common

from input_pipeline import text as text_lib
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.errors import DataError

EOD = "<|endoftext|>"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab-size", type=int, default=2048, help="tokens in all: 1 special + 256 bytes + merges")
    p.add_argument("--out", default="experiments/tokenizers/stdlib-bpe-2k.json", help="the tokenizer.json to write")
    p.add_argument("--corpus-dir", default="", help="a folder of .py files ('' = the Python standard library)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="as data.eval_fraction: the files held out")
    p.add_argument("--min-frequency", type=int, default=2, help="a pair seen fewer times is never merged")
    p.add_argument("--json", default="", help="also write the figures printed to this file")
    return p.parse_args(argv)


def read_split(corpus_dir: str, eval_fraction: float) -> tuple[list[bytes], list[bytes]]:
    files = text_lib.list_py_files(corpus_dir)
    train, evals = text_lib.split_files(files, eval_fraction)

    def read(names):
        out = []
        for rel in names:
            with open(os.path.join(corpus_dir, rel), "rb") as f:
                out.append(f.read())
        return out

    return read(train), read(evals)


def train(docs: list[bytes], vocab_size: int, min_frequency: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # No prefix space: a file's first word encodes as it is written, and decode(encode(x)) == x.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, seen or not
        show_progress=False,
    )
    # The text sources decode the same way (a file that is not UTF-8 gets U+FFFD).
    texts = (d.decode("utf-8", errors="replace") for d in docs)
    tok.train_from_iterator(texts, trainer, length=len(docs))
    return tok


def rate(tok: tokenizer_lib.Tokenizer, docs: list[bytes]) -> dict:
    started = time.perf_counter()
    stream = tok.stream(docs)
    seconds = time.perf_counter() - started
    n_bytes = sum(len(d) for d in docs) + len(docs) - 1  # as the byte stream: one "\n" between files
    return {
        "bytes": n_bytes,
        "tokens": int(stream.size),
        "tokens_per_byte": stream.size / n_bytes,
        "seconds": seconds,
        "tokens_per_s": stream.size / seconds,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.vocab_size < 257:
        sys.exit(f"--vocab-size must be at least 257 (1 special token + 256 bytes), got {args.vocab_size}")
    corpus = args.corpus_dir or text_lib.stdlib_dir()
    try:
        train_docs, eval_docs = read_split(corpus, args.eval_fraction)
    except DataError as e:
        sys.exit(f"data error: {e}")
    if not train_docs:
        sys.exit(f"data error: the train split of {corpus} has no files (--eval-fraction {args.eval_fraction})")
    started = time.perf_counter()
    tok = train(train_docs, args.vocab_size, args.min_frequency)
    train_s = time.perf_counter() - started
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    tok.save(args.out)
    loaded = tokenizer_lib.HFTokenizer(args.out)
    figures = {
        "corpus": "stdlib" if not args.corpus_dir else args.corpus_dir,
        "python": sys.version.split()[0],
        "train_files": len(train_docs),
        "train_bytes": sum(len(d) for d in train_docs),
        "eval_files": len(eval_docs),
        "vocab_size": loaded.vocab_size,
        "train_seconds": train_s,
        "file_bytes": os.path.getsize(args.out),
        "train_split": rate(loaded, train_docs),
        "eval_split": rate(loaded, eval_docs) if eval_docs else None,
    }
    print(
        f"corpus: {figures['corpus']} (Python {figures['python']}), train split {len(train_docs)} files, {figures['train_bytes']:,} bytes"
    )
    print(
        f"trained a {loaded.vocab_size}-token byte-level BPE in {train_s:.1f} s -> {args.out} ({figures['file_bytes']:,} bytes)"
    )
    for split in ("train_split", "eval_split"):
        r = figures[split]
        if r:
            print(
                f"{split.replace('_', ' ')}: {r['tokens']:,} tokens for {r['bytes']:,} bytes = {r['tokens_per_byte']:.3f} tokens/byte; "
                f"tokenized in {r['seconds']:.2f} s ({r['tokens_per_s'] / 1e6:.2f} M tokens/s)"
            )
    if args.json:
        common.write_json(args.json, figures, indent=1)
    return figures


if __name__ == "__main__":
    main()
