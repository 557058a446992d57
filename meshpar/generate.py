"""``python -m meshpar.generate``: a trained language model continues prompts.

    python -m meshpar.generate --workdir W --prompt "def " [--prompt ...] [--batch-file PROMPTS]
        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--json OUT]
        [section.key=value ...]
    python -m meshpar.generate --hf HF_DIR --prompt "..." [...]

From the newest checkpoint of the run in W (its model, tokenizer, mesh and layout) or from a
Hugging Face Llama folder, on the mesh and layout the overrides give (``mesh=data:8
layout=batch:data``; ``model.compute_dtype=bfloat16``). ``--temperature 0`` (the default) is
greedy; otherwise sampling, the same tokens for the same ``--seed``. ``--prompt-ids 1,2,3``
gives a prompt as token ids. ``--batch-file``: one prompt per line (a line that starts with
``"`` is a JSON string, so it can hold newlines). See :mod:`meshpar.decoding`.

Each prompt's continuation goes to stdout; the timing line (prefill, decode, tokens/s, wall
clock, compilation not counted) to stderr. Exit 0 done; 2 with one line (``config error: <key>:
…``, ``checkpoint error: …``) for a run without a checkpoint, a prompt beyond the model's
``max_length``, a token id outside its vocabulary, or any config mistake.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from meshpar import decoding, errors
from meshpar.config import ConfigError


def _prompt_ids(text: str) -> np.ndarray:
    try:
        return np.asarray([int(t) for t in text.replace(",", " ").split()], np.int64)
    except ValueError:
        raise ConfigError("--prompt-ids", f"{text!r} is not a list of integer token ids like 1,2,3") from None


def read_batch_file(path: Path) -> list[str]:
    """One prompt per non-empty line; a line starting with ``"`` is a JSON string."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("--batch-file", f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
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
        prompts.append(line)
    return prompts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m meshpar.generate", description="Continue prompts with a trained language model."
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", type=Path, help="a meshpar run's workdir (its newest checkpoint)")
    source.add_argument("--hf", type=Path, help="a Hugging Face Llama folder")
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
    if args.workdir is not None:
        cfg, saved = decoding.run_config(args.workdir, args.overrides)
        gen = decoding.open_generator(cfg, run=saved)
    else:
        cfg = decoding.hf_run_config(args.hf, args.overrides)
        gen = decoding.open_generator(cfg, hf_dir=args.hf)
    texts = list(args.prompt) + (read_batch_file(args.batch_file) if args.batch_file else [])
    prompts = decoding.encode(gen, texts) + [_prompt_ids(t) for t in args.prompt_ids]
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
        f"layout {gen.layout}, {result.batch} rows, {result.slots} cache slots",
        file=sys.stderr,
    )
    if args.json is not None:
        out = {"source": gen.source, "mesh": mesh, "layout": str(gen.layout), "prompts": shown,
               "prompt_ids": [p.tolist() for p in result.prompts], **result.summary()}  # fmt: skip
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)
    try:
        return run(args)
    except Exception as e:
        return errors.report(e)


if __name__ == "__main__":
    sys.exit(main())
