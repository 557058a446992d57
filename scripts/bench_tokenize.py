"""How long the text source takes to start with a tokenizer: the split's bytes (the baseline),
the same split tokenized with a Hugging Face tokenizer, and the same again read back from the
token cache. Medians over repeats, after one warm-up start (the files in the page cache).

    python scripts/bench_tokenize.py                       # the stdlib train split, the 2k BPE
    python scripts/bench_tokenize.py --split eval --repeats 5 --out runs/bench_tokenize.json
"""

from __future__ import annotations

import argparse
import os
import tempfile

import common

from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.text import TextSource


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=str(common.REPO / "experiments" / "tokenizers" / "stdlib-bpe-2k.json"))
    p.add_argument("--split", default="train", choices=("train", "eval"))
    p.add_argument("--corpus-dir", default="", help="'' = the Python standard library")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench_tokenize.json")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    tok = tokenizer_lib.load(args.tokenizer)
    corpus = args.corpus_dir or None

    def source(**kw):
        return TextSource(args.split, 128, corpus_dir=corpus, **kw)

    byte_s, byte_src = common.timed(source, args.repeats)  # its warm-up: the files in the page cache
    hf_s, hf_src = common.timed(lambda: source(tokenizer=tok), args.repeats, warmup=0)
    with tempfile.TemporaryDirectory() as cache:
        source(tokenizer=tok, cache_dir=cache)  # fills the cache
        cached_s, cached_src = common.timed(lambda: source(tokenizer=tok, cache_dir=cache), args.repeats, warmup=0)
    assert (cached_src.tokens == hf_src.tokens).all()
    n_bytes, n_tokens = int(byte_src.tokens.size), int(hf_src.tokens.size)
    row = {
        "split": args.split,
        "files": len(byte_src.files),
        "bytes": n_bytes,
        "tokenizer": os.path.basename(args.tokenizer),
        "tokens": n_tokens,
        "tokens_per_byte": n_tokens / n_bytes,
        "byte_start_s": byte_s,
        "tokenize_start_s": hf_s,
        "tokens_per_s": n_tokens / hf_s,
        "cached_start_s": cached_s,
        "tokenize_vs_bytes": hf_s / byte_s,
        "cached_vs_bytes": cached_s / byte_s,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
    }
    print(
        f"{args.split} split: {row['files']} files, {n_bytes:,} bytes -> {n_tokens:,} tokens ({row['tokens_per_byte']:.3f} tokens/byte)"
    )
    print(f"{'start':<28}{'median s':>10}{'x bytes':>10}")
    print(f"{'bytes (baseline)':<28}{byte_s:>10.2f}{1.0:>10.1f}")
    print(
        f"{'tokenize (' + row['tokenizer'] + ')':<28}{hf_s:>10.2f}{row['tokenize_vs_bytes']:>10.1f}   {row['tokens_per_s'] / 1e6:.2f} M tokens/s"
    )
    print(f"{'from the token cache':<28}{cached_s:>10.2f}{row['cached_vs_bytes']:>10.1f}")
    if args.out:
        common.write_json(args.out, row, indent=1)
    return row


if __name__ == "__main__":
    main()
