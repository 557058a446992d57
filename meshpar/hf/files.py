"""The files around the weights: tokenizer files, the original config, and folders that appear
whole or not at all.

A conversion writes into a hidden sibling of its target (``.NAME.partial-PID``) and renames it
into place only once everything is written, so a failure leaves nothing under the target's
name (the sibling is removed). A target that exists and holds anything is refused up front.

A converted run keeps what it came with beside its checkpoints: the tokenizer files under
their own names (so ``data.tokenizer`` can name the run's folder) and the original
``config.json`` / ``generation_config.json`` as ``hf_config.json`` /
``hf_generation_config.json`` (not under their own names: a folder with a ``config.json`` would
read as a Hugging Face folder). ``to-hf`` finds them in the run's folder, or, for a run that was
started with ``checkpoint.init_from``, where that points (its ``summary.json`` says).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from meshpar.configuration.errors import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
# Hugging Face's name → the name it keeps inside a meshpar run.
KEPT = {"config.json": "hf_config.json", "generation_config.json": "hf_generation_config.json"}


def check_new(target: Path, what: str) -> None:
    """`target` may be written: it does not exist, or is an empty folder."""
    if target.is_file() or (target.is_dir() and any(target.iterdir())):
        raise CheckpointError(f"{what} {target} already exists and is not empty; choose a new folder")


@contextlib.contextmanager
def new_folder(target: Path, what: str) -> Iterator[Path]:
    """A hidden sibling of `target` to write into, renamed to `target` when the block succeeds
    and removed when it fails."""
    check_new(target, what)
    target = target.absolute()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {target.parent}: {e.strerror or e}") from None
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if target.is_dir():
            target.rmdir()  # empty (check_new)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def copy_present(source: Path, target: Path, names: dict[str, str]) -> list[str]:
    """Copy each file of `names` (name in `source` → name in `target`) that `source` holds."""
    copied = []
    for name, to in names.items():
        if (source / name).is_file():
            shutil.copyfile(source / name, target / to)
            copied.append(to)
    return copied


def origins(run: Path, depth: int = 8) -> Iterator[Path]:
    """Folders a run's tokenizer and original config may be in: the run's own folder (and its
    parent, for a checkpoint folder), then, for a run started from ``checkpoint.init_from``,
    that folder's, recursively."""
    seen: set[Path] = set()
    for _ in range(depth):
        for folder in (run, run.parent):
            if folder not in seen:
                seen.add(folder)
                yield folder
        summary = run / "summary.json"
        if not summary.is_file():
            summary = run.parent / "summary.json"
        try:
            origin = json.loads(summary.read_text())["config"]["checkpoint"]["init_from"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        if not origin or Path(origin) in seen:
            return
        run = Path(origin)
