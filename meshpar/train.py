"""``python -m meshpar.train --config experiments/x.yaml [--resume] [section.key=value ...]``

Exit status: 0 on success (or nothing left to train); 2 on a config, data, checkpoint, output
or multi-process start-up mistake, with one line ``config error: <key>: <what is wrong>``
(``data error: ...``, ``checkpoint error: ...``, ``output error: ...``, ``distributed error:
...``) on stderr; 1 when training cannot go on (``training error: step N: ...``); 128 + the
signal number after SIGINT/SIGTERM, once the state is checkpointed.
"""

from __future__ import annotations

import argparse
import sys

from meshpar.configuration import config as config_lib
from meshpar.configuration import errors
from meshpar.configuration.config import Config
from meshpar.processes import together
from meshpar.processes.stop import Interrupted
from meshpar.run import experiment, loop


def run(cfg: Config) -> dict:
    return loop.train(experiment.build(cfg))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshpar.train", description="Train a model on a device mesh.")
    parser.add_argument("--config", required=True, help="experiment YAML, e.g. experiments/quickstart.yaml")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint, or start at step 0 if none is saved yet (checkpoint.resume=auto)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, applied in order (a key given twice takes its last value)",
    )
    args = parser.parse_intermixed_args(argv)
    overrides = [*args.overrides, *(["checkpoint.resume=auto"] if args.resume else [])]
    try:
        with together.stop_together():
            summary = run(config_lib.load(args.config, overrides))
    except Interrupted as e:
        saved = f"; checkpoint saved at step {e.step}" if e.saved else " (checkpointing is off: nothing saved)"
        print(f"stopped by {e}{saved}", file=sys.stderr)
        return 128 + e.signum
    except Exception as e:
        return errors.report(e)
    if "already_at_step" in summary:
        print(f"nothing to train: the checkpoint is at step {summary['already_at_step']} of {summary['steps']}")
        return 0
    mfu = "MFU n/a (no peak: set hardware.peak_tflops)"
    if summary["model_flops_per_example"] is None:
        mfu = f"MFU unknown (model {summary['config']['model']['name']} gives no FLOPs: flops_per_example not given)"
    elif summary["mfu"] is not None:
        mfu = f"MFU {summary['mfu']:.1%} (per step {summary['step_mfu']:.1%})"
        if summary["config"]["model"].get("fp8"):  # the FP8 dots' peak is twice the compute dtype's
            mfu += " of the compute dtype's peak"
    print(
        f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} → {summary['final_loss']:.4f}, "
        f"{summary['examples_per_s']:,.0f} examples/s, {summary['tokens_per_s']:,.0f} tokens/s (wall clock), {mfu}, "
        f"feed={summary['feed_mode']}, mesh {summary['mesh']}, workdir {summary['config']['workdir']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
