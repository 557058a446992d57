"""``python -m meshpar.generate``: a trained language model continues prompts.

    python -m meshpar.generate --workdir W --prompt "def " [--prompt ...] [--batch-file PROMPTS]
        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--json OUT]
        [section.key=value ...]
    python -m meshpar.generate --hf HF_DIR --prompt "..." [...]

From the newest checkpoint of the run in W (its model, tokenizer, mesh and layout) or from a
Hugging Face Llama or Mixtral folder, on the mesh and layout the overrides give (``mesh=data:8
layout=batch:data``; ``model.compute_dtype=bfloat16``). ``--temperature 0`` (the default) is
greedy; otherwise sampling, the same tokens for the same ``--seed``. ``--prompt-ids 1,2,3``
gives a prompt as token ids. ``--batch-file``: one prompt per line (a line that starts with
``"`` is a JSON string, so it can hold newlines). See :mod:`meshpar.run.decoding`.

A prompt is bytes: ``--prompt`` as the shell gave them (``os.fsencode`` undoes Python's
decoding of the command line), a batch file's line as the file holds it. A byte-level model
(``data.tokenizer=byte``) takes any bytes, UTF-8 or not, one token each; a tokenizer that reads
text needs UTF-8, and a prompt that is not is refused naming the prompt and the offending byte's
offset, not changed to U+FFFD. ``--json OUT`` is checked before anything is loaded (its folder
must exist and be writable) and written atomically after the continuations are printed.

Each prompt's continuation goes to stdout; the timing line (prefill, decode, tokens/s, wall
clock, compilation not counted) to stderr. Exit 0 done; 2 with one line (``config error: <key>:
…``, ``checkpoint error: …``, ``output error: …``) for a run without a checkpoint, a prompt
beyond the model's ``max_length``, a token id outside its vocabulary, a prompt that is not UTF-8
for a tokenizer that reads text, a ``--json`` that cannot be written, or any config mistake.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from input_pipeline import tokenizer as tokenizer_lib
from meshpar import models
from meshpar.configuration import errors
from meshpar.configuration.config import ConfigError
from meshpar.run import decoding


def _prompt_ids(text: str) -> np.ndarray:
    try:
        return np.asarray([int(t) for t in text.replace(",", " ").split()], np.int64)
    except ValueError:
        raise ConfigError("--prompt-ids", f"{text!r} is not a list of integer token ids like 1,2,3") from None


def read_batch_file(path: Path) -> list[str]:
    """One prompt per non-empty line; a line starting with ``"`` is a JSON string. The file is
    read as UTF-8; a byte that is not UTF-8 is kept as a surrogate escape (``\\udcff``), as
    Python keeps one from the command line (:func:`prompt_bytes` gives the bytes back)."""
    return [prompt for _, prompt in _batch_file_lines(path)]


def _batch_file_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, prompt) of each prompt of a batch file (see :func:`read_batch_file`)."""
    try:
        lines = path.read_bytes().decode("utf-8", "surrogateescape").splitlines()
    except OSError as e:
        raise ConfigError("--batch-file", f"cannot read {path}: {e.strerror or e}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                line = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    "--batch-file", f"{path}:{n} starts with '\"' but is not a JSON string ({e.msg})"
                ) from None
        prompts.append((n, line))
    return prompts


def prompt_bytes(text: str, tokenizer: tokenizer_lib.Tokenizer, key: str, what: str) -> bytes:
    """The bytes of prompt `text` (its surrogate escapes, ``\\udcff``, the bytes the command
    line or the batch file held) for `tokenizer`: any bytes for the byte-level one, UTF-8 for a
    tokenizer that reads text. Raises ConfigError on `key` naming `what` (the prompt) and the
    offending byte's offset (from 0) otherwise."""
    try:
        raw = os.fsencode(text)  # the inverse of Python's decoding of argv (UTF-8, surrogateescape)
    except UnicodeEncodeError as e:  # a lone surrogate that stands for no byte (a JSON line's "\ud800")
        raise ConfigError(
            key,
            f"{what} holds a lone surrogate U+{ord(text[e.start]):04X} at character {e.start} (neither text nor a byte)",
        ) from None
    if tokenizer.name == tokenizer_lib.BYTE:
        return raw
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            key,
            f"{what} is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} (tokenizer "
            f"{tokenizer.name} reads text; give UTF-8, or token ids with --prompt-ids)",
        ) from None
    return raw


def check_output(path: Path) -> None:
    """Before generating: `path` (``--json``) can be written, else OutputError naming it."""
    folder = path.parent
    why = None
    if path.is_dir():
        why = "it is a folder"
    elif not folder.exists():
        why = f"folder {folder} does not exist"
    elif not folder.is_dir():
        why = f"{folder} is not a folder"
    elif not os.access(folder, os.W_OK | os.X_OK):
        why = f"folder {folder} is not writable"
    if why:
        raise errors.OutputError(f"cannot write --json {path}: {why}")


def write_output(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it, renamed: a reader never sees
    half of it, and a failed write leaves no partial file. OutputError naming it on failure."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    except OSError as e:
        temporary.unlink(missing_ok=True)
        raise errors.OutputError(
            f"cannot write --json {path}: {e.strerror or e} (the continuations are printed above)"
        ) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m meshpar.generate", description="Continue prompts with a trained language model."
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", type=Path, help="a meshpar run's workdir (its newest checkpoint)")
    source.add_argument("--hf", type=Path, help="a Hugging Face Llama or Mixtral folder")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", default=[], help="a prompt as token ids, e.g. 1,2,3")
    p.add_argument("--batch-file", type=Path, help="prompts, one per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="sample among the most likely tokens holding p of the probability"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop a prompt at an end-of-sequence token")
    p.add_argument("--json", type=Path, help="write the prompts, tokens, texts and timings here")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for meshpar.train")
    return p


def run(args: argparse.Namespace) -> int:
    # Before the model is loaded: a path that cannot be written or a batch file that cannot be read wastes no run.
    if args.json is not None:
        check_output(args.json)
    lines = _batch_file_lines(args.batch_file) if args.batch_file else []
    if args.workdir is not None:
        cfg, saved = decoding.run_config(args.workdir, args.overrides)
        gen = decoding.open_generator(cfg, run=saved)
    else:
        cfg = decoding.hf_run_config(args.hf, args.overrides)
        gen = decoding.open_generator(cfg, hf_dir=args.hf)
    given = [("--prompt", f"prompt {i}", text) for i, text in enumerate(args.prompt)]
    for n, text in lines:
        given.append(("--batch-file", f"{args.batch_file}:{n} (prompt {len(given)})", text))
    raw = [prompt_bytes(text, gen.tokenizer, key, what) for key, what, text in given]
    texts = [b.decode("utf-8", "replace") for b in raw]  # as shown: a byte that is not UTF-8 as U+FFFD
    prompts = [np.asarray(ids, np.int64) for ids in gen.tokenizer.encode_batch(raw)] if raw else []
    prompts += [_prompt_ids(t) for t in args.prompt_ids]
    how = decoding.Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    result = decoding.generate(gen, prompts, args.max_new_tokens, how, stop_at_eos=not args.ignore_eos)
    shown = texts + [gen.tokenizer.decode(ids.tolist()) for ids in prompts[len(texts) :]]  # ids checked by now
    mesh = ",".join(f"{a}:{n}" for a, n in gen.mesh.shape.items())
    for i, (prompt, text) in enumerate(zip(shown, result.texts)):
        print(f"── prompt {i} ({len(result.prompts[i])} tokens) + {len(result.tokens[i])} new ──")
        print(prompt + text)
    print(
        f"generate: {len(prompts)} prompt{'s' * (len(prompts) > 1)}, {result.new_tokens} new tokens: "
        f"prefill {result.prefill_s * 1e3:.1f} ms, decode {result.decode_s * 1e3:.1f} ms, "
        f"{result.decode_tokens_per_s:,.1f} tokens/s decoding, {result.tokens_per_s:,.1f} tokens/s overall "
        f"(wall clock; compilation {result.compile_s:.1f} s not counted); {gen.source}; mesh {mesh}, "
        f"layout {gen.layout}, {result.batch} rows, {result.slots} cache slots; {_matmuls(gen.cfg)}",
        file=sys.stderr,
    )
    if args.json is not None:
        # the prompts' texts, as docs/generation.md says (the summary's "prompts" is their count)
        out = {**result.summary(), "source": gen.source, "mesh": mesh, "layout": str(gen.layout), "prompts": shown,
               "prompt_ids": [p.tolist() for p in result.prompts]}  # fmt: skip
        write_output(args.json, json.dumps(out, indent=1))
    return 0


def _matmuls(cfg) -> str:
    """What the model's matmuls run in while generating: its compute dtype, or which kinds of
    dot in FP8 and how they are scaled (meshpar.models.fp8)."""
    model = models.traits(cfg.model)
    if not model.fp8:
        return f"matmuls in {model.compute_dtype}"
    return f"FP8 dots ({', '.join(model.fp8)}; {model.fp8_scaling} scaling), the rest in {model.compute_dtype}"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)
    try:
        return run(args)
    except Exception as e:  # noqa: BLE001 - errors.report re-raises what it does not report
        return errors.report(e)


if __name__ == "__main__":
    sys.exit(main())
