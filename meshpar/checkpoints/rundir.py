"""A run's folders: the workdir (metrics, summary, TensorBoard events) and its checkpoints.

One checkpoint folder holds one run. A fresh run (not ``--resume``) into a folder that already
holds checkpoint steps would otherwise mix two runs: orbax skips saving a step number that
exists, ``keep`` rotation counts the old steps, and a later ``--resume`` continues whichever
run saved last. So such a run stops before its first step with one line, unless
``checkpoint.overwrite=true`` says to replace the earlier run: then its steps, metrics, summary
and TensorBoard events are removed here, before anything of the new run is written.

``--resume`` into a folder with no committed step yet starts at step 0 and says so in one line
(``resume: no checkpoint in DIR yet; starting at step 0``, stderr), so that one command line
serves a job's first launch and every relaunch; a folder whose steps were all set aside as
damaged holds a run that cannot be continued, and is refused instead of started over.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from pathlib import Path

import jax

from meshpar.checkpoints.checkpoint import IDENTITY, Checkpointer, CheckpointError, Codec
from meshpar.configuration.config import Config, ConfigError

# What a run writes into its workdir besides checkpoints (replaced by a fresh run).
OUTPUTS = ("metrics.jsonl", "summary.json", "step_times.json", "tb")
# Entries of a checkpoint folder that belong to meshpar runs: committed steps, saves that never
# committed (orbax's tmp folders), steps set aside as damaged. Nothing else is ever removed.
_RUN_ENTRY = re.compile(r"^\d+(\.orbax-checkpoint-tmp.*|\.damaged(-\d+)?)?$")


def _creatable(key: str, path: Path) -> None:
    """Make `path` a directory, or raise ConfigError naming `key` and what is in the way."""
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            where = "is" if parent == path else f"lies under {parent}, which is"
            raise ConfigError(key, f"{path} {where} a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(key, f"cannot create {path}: {os.strerror(e.errno) if e.errno else e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(key, f"{path} is not writable")


def uses_checkpoints(cfg: Config) -> bool:
    """Whether the run saves checkpoints (periodically, or at the end of a resumable run)."""
    return bool(cfg.checkpoint.every or cfg.checkpoint.resume == "auto")


def check_paths(cfg: Config) -> None:
    """The workdir, and the checkpoint folder when checkpoints are used, exist as directories."""
    _creatable("workdir", Path(cfg.workdir))
    if uses_checkpoints(cfg):
        _creatable("checkpoint.dir" if cfg.checkpoint.dir else "workdir", Path(cfg.checkpoint_dir))


def run_entries(directory: str | Path) -> list[Path]:
    """The entries of a checkpoint folder that belong to runs (see ``_RUN_ENTRY``)."""
    d = Path(directory)
    return sorted(p for p in d.iterdir() if _RUN_ENTRY.match(p.name)) if d.is_dir() else []


def committed_steps(directory: str | Path) -> list[int]:
    return sorted(int(p.name) for p in run_entries(directory) if p.name.isdigit() and p.is_dir())


def _remove(path: Path) -> None:
    try:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise CheckpointError(f"cannot remove {path} of the earlier run: {os.strerror(e.errno or errno.EIO)}") from None


def _sync(name: str) -> None:
    """Every process waits here until process 0 has replaced the earlier run."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _check_nothing_to_resume(directory: Path) -> None:
    """``--resume`` into a folder without committed steps starts at step 0 (a job's first launch
    and its relaunches share one command line), unless the folder held steps that a resume set
    aside as damaged: that run's progress is what the command asks for, and starting over
    without it would be silent."""
    damaged = [p for p in run_entries(directory) if ".damaged" in p.name]
    damaged.sort(key=lambda p: int(p.name.split(".")[0]))  # by step
    if damaged:
        raise CheckpointError(
            f"no usable checkpoint in {directory}: its steps were set aside as damaged "
            f"({', '.join(p.name for p in damaged)}); to start over, move them away, or run without --resume "
            "and with checkpoint.overwrite=true (which removes them)"
        )


def open_checkpoints(cfg: Config, codec: Codec = IDENTITY) -> Checkpointer | None:
    """The run's Checkpointer, built with `codec` (None when the run neither saves nor resumes),
    after making sure the checkpoint folder holds no earlier run that this fresh run would mix
    with."""
    directory = Path(cfg.checkpoint_dir)
    resuming = cfg.checkpoint.resume == "auto"
    steps = committed_steps(directory)
    if steps and not resuming and not cfg.checkpoint.overwrite:
        raise CheckpointError(
            f"{directory} already holds steps {steps} of an earlier run; continue it with --resume, "
            "or choose a new workdir / checkpoint.dir, or replace it with checkpoint.overwrite=true"
        )
    if resuming and not steps:
        _check_nothing_to_resume(directory)
        if jax.process_index() == 0:
            print(f"resume: no checkpoint in {directory} yet; starting at step 0", file=sys.stderr)
    if not (resuming and steps):  # this run starts at step 0
        if jax.process_index() == 0:
            # The earlier run's outputs go with it: metrics.jsonl would be rewritten anyway, and
            # its TensorBoard events would mix with the new run's curves.
            for path in [
                *(run_entries(directory) if cfg.checkpoint.overwrite else []),
                *(Path(cfg.workdir) / o for o in OUTPUTS),
            ]:
                _remove(path)
        _sync("meshpar_fresh_run")
    if not uses_checkpoints(cfg):
        return None
    return Checkpointer(directory, cfg.checkpoint.every, cfg.checkpoint.keep, codec=codec)
