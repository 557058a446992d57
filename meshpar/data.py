"""``python -m meshpar.data``: prepare a tokenized corpus on disk, and look at one.

    python -m meshpar.data prepare --tokenizer TOKENIZER (--input PATH [PATH ...] | --stdlib)
        --output OUT [--workers N] [--eval-fraction F] [--include GLOB[,GLOB...]]
        [--text-field text] [--shard-mb 64]
    python -m meshpar.data info OUT

``prepare`` tokenizes files and folders (plain files: one document each; ``.jsonl`` and
``.jsonl.gz``: one per line) into the shards of :mod:`input_pipeline.tokens`, with worker
processes, and resumes where a killed run stopped when run again the same way (see
:mod:`input_pipeline.corpus`). A progress bar over input bytes goes to stderr while it runs;
one summary line to stdout at the end. ``info`` prints a corpus's manifest in a few lines.

A thin command: the work is :func:`input_pipeline.corpus.prepare`. It does not import jax (nor
:mod:`meshpar.configuration.errors`, which does), so it starts in a moment. Errors: ``data error: <one line>``
on stderr, exit status 2, as :mod:`meshpar.configuration.errors` reports a ``DataError``; bad usage is
argparse's, also 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from input_pipeline import corpus as corpus_lib
from input_pipeline import tokens as tokens_lib
from input_pipeline.errors import DataError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meshpar.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize files into a prepared corpus (resumable)")
    p.add_argument(
        "--tokenizer", required=True, help="'byte', or a Hugging Face tokenizer.json or a folder holding one"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH", help="files and folders (folders walked recursively)")
    src.add_argument("--stdlib", action="store_true", help="Python's standard library (*.py unless --include)")
    p.add_argument("--output", required=True, metavar="OUT", help="a new or empty folder, or an unfinished preparation")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="worker processes (default: the CPU count)")
    p.add_argument("--eval-fraction", type=float, default=corpus_lib.DEFAULT_EVAL_FRACTION, metavar="F")
    p.add_argument(
        "--include", default=None, metavar="GLOB[,GLOB...]", help="only files matching (default: every file)"
    )
    p.add_argument("--text-field", default="text", help="the JSON field holding a .jsonl line's document")
    p.add_argument(
        "--shard-mb", type=float, default=corpus_lib.DEFAULT_SHARD_MB, metavar="MB", help="input MB per work unit"
    )
    i = sub.add_parser("info", help="print a prepared corpus's summary")
    i.add_argument("corpus", metavar="OUT")
    return parser


def _prepare(args) -> int:
    include = [g for g in args.include.split(",") if g] if args.include else None
    # Rich is imported here: `info` and the errors need none of it.
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    # The bar only on a terminal: rich leaves a blank line in a log or pipe even when transient.
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("tokenizing", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = corpus_lib.prepare(
            args.tokenizer,
            args.input,
            args.output,
            stdlib=args.stdlib,
            workers=args.workers,
            eval_fraction=args.eval_fraction,
            include=include,
            text_field=args.text_field,
            shard_mb=args.shard_mb,
            progress=progress,
        )
    docs, toks = result.documents, result.tokens
    counts = (
        f"{result.files} files, {docs['train']} / {docs['eval']} documents, "
        f"{toks['train']} / {toks['eval']} tokens (train / eval)"
    )
    if result.already_complete:
        print(f"{result.output}: already complete ({counts}); nothing written")
        return 0
    rate = result.bytes_read / MB / result.seconds if result.seconds > 0 else 0.0
    resumed = f", resumed with {result.units_skipped} of {result.units} units done" if result.units_skipped else ""
    print(f"prepared {counts} in {result.seconds:.1f} s ({rate:.1f} MB/s of input{resumed}) -> {result.output}")
    return 0


MB = corpus_lib.MB


def _info(args) -> int:
    m = tokens_lib.read_manifest(args.corpus)
    tok = m["tokenizer"]
    name = "byte" if tok["kind"] == "byte" else f"{tok['kind']} {tok['file']}"
    eod = f" ({tok['eod_token']})" if tok.get("eod_token") else ""
    print(f"corpus     {args.corpus}")
    print(f"tokenizer  {name}, vocab {tok['vocab_size']}, dtype {m['dtype']}, separator {tok['separator']}{eod}")
    inputs = m["inputs"]
    print(f"inputs     {inputs['files']} files, {inputs['bytes'] / MB:.1f} MB, eval fraction {m['eval_fraction']}")
    for split, s in m["splits"].items():
        print(f"{split:<10} {s['documents']} documents, {s['tokens']} tokens, {len(s['shards'])} shards")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _prepare(args) if args.command == "prepare" else _info(args)
    except DataError as e:
        print(f"data error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
