"""Hugging Face checkpoints in and out.

    python -m meshpar.convert from-hf HF_DIR --config X [section.key=value ...] --workdir W
    python -m meshpar.convert to-hf W OUT_DIR [--max-shard-size 5GB]
    python -m meshpar.convert model-yaml HF_DIR

``from-hf`` writes W: step 0 of the run config X describes, with HF_DIR's weights in that run's
shardings and fresh optimizer state, the tokenizer files and the original config (see
:mod:`meshpar.run.hf_runs`). Continue it with ``python -m meshpar.train --config X [the same
overrides] workdir=W --resume``, or start other runs from it with ``checkpoint.init_from: W``.
X's model section must be ``name: llama`` with every architecture field equal to
``config.json``'s (nothing is filled in; ``model-yaml`` prints the section that matches: for a
Mixtral folder also its experts, ``moe_every: 1`` and ``moe_dispatch: dropless``).
``to-hf`` writes OUT_DIR from a run's newest checkpoint (``config.json``, ``model.safetensors``
in the parameter dtype, sharded with an index above --max-shard-size, the tokenizer files): a
Llama, or a Mixtral where the run's model has experts.

Exit status 0 when done; 2 with one line (``config error: <key>: …``, ``checkpoint error: …``
naming the tensor or file) when the input cannot be converted; nothing is written then.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from meshpar.backend import compile_cache
from meshpar.configuration import config as config_lib
from meshpar.configuration import errors
from meshpar.hf import model_config as hf_config
from meshpar.hf import writer
from meshpar.run import hf_runs

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _size(text: str) -> int:
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not found or found[2].upper() not in _UNITS or float(found[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 1000000")
    return int(float(found[1]) * _UNITS[found[2].upper()])


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def from_hf(args) -> int:
    cfg = config_lib.load(args.config, args.overrides)
    compile_cache.configure(cfg.compile_cache)
    done = hf_runs.from_hf(cfg, args.hf_dir, args.workdir)
    r = done.report
    print(f"from-hf: {done.source.describe()}, {_mib(r.file_bytes)} → {done.checkpoint} (step 0, fresh "
          f"{cfg.optimizer.name} state), model param_dtype {cfg.model.param_dtype}, mesh {done.mesh}, layout {done.layout}")  # fmt: skip
    print(
        f"from-hf: parameters {_mib(r.placed_bytes)} as placed (replicas included), read and placed in {r.seconds:.2f} s; {r.describe()}"
    )
    print(f"from-hf: copied {', '.join(done.copied) or 'nothing else (no tokenizer files)'}")
    overrides = "".join(f" {o}" for o in args.overrides)
    print(f"continue: python -m meshpar.train --config {args.config}{overrides} workdir={args.workdir} --resume "
          f"(or start a new run with checkpoint.init_from={args.workdir})")  # fmt: skip
    return 0


def to_hf(args) -> int:
    done = hf_runs.to_hf(args.run, args.out_dir, args.max_shard_size)
    print(f"to-hf: {done.run.describe()} → {args.out_dir}: {done.tensors} tensors, {_mib(done.bytes)} {done.dtype}")
    print(f"to-hf: wrote {', '.join(done.written)}")
    if not any(name.startswith("tokenizer") for name in done.written):
        print("to-hf: no tokenizer files found with the run or where it was initialised from: add them yourself")
    return 0


def model_yaml(args) -> int:
    print(hf_config.model_yaml(hf_config.read(args.hf_dir)), end="")
    return 0


def _parsers() -> dict[str, argparse.ArgumentParser]:
    prog = "python -m meshpar.convert"
    p1 = argparse.ArgumentParser(
        prog=f"{prog} from-hf", description="A Hugging Face Llama or Mixtral folder → step 0 of a meshpar run."
    )
    p1.add_argument("hf_dir", type=Path, help="folder with config.json and model.safetensors (or its index)")
    p1.add_argument("--config", required=True, help="the run's experiment YAML (model.name: llama)")
    p1.add_argument("--workdir", required=True, type=Path, help="the run folder to write (new or empty)")
    p1.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for meshpar.train")
    p2 = argparse.ArgumentParser(
        prog=f"{prog} to-hf", description="A meshpar run's newest checkpoint → a Hugging Face folder."
    )
    p2.add_argument("run", type=Path, help="the run's workdir, or its checkpoint folder")
    p2.add_argument("out_dir", type=Path, help="the folder to write (new or empty)")
    p2.add_argument("--max-shard-size", type=_size, default=writer.MAX_SHARD_BYTES,
                    help="split model.safetensors into shards of at most this size (default 5GB)")  # fmt: skip
    p3 = argparse.ArgumentParser(
        prog=f"{prog} model-yaml", description="The model section matching a Hugging Face folder."
    )
    p3.add_argument("hf_dir", type=Path)
    return {"from-hf": p1, "to-hf": p2, "model-yaml": p3}


COMMANDS = {"from-hf": from_hf, "to-hf": to_hf, "model-yaml": model_yaml}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshpar.convert", description="Hugging Face checkpoints in and out."
    )
    parser.add_argument("command", choices=list(COMMANDS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's arguments (COMMAND --help)")
    top = parser.parse_args(argv)
    args = _parsers()[top.command].parse_intermixed_args(top.args)
    try:
        return COMMANDS[top.command](args)
    except Exception as e:
        return errors.report(e)


if __name__ == "__main__":
    sys.exit(main())
