"""One-line reports of a multi-process run: an exception said on one line, and ending this
process with a line on stderr when its main thread may be stuck where nothing can raise."""

from __future__ import annotations

import os
import sys


def one_line(error: BaseException) -> str:
    """`error`'s message on one line (its type's name when it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def exit_now(line: str, status: int) -> None:
    """Print `line` on stderr and end the process with `status`, skipping interpreter shutdown."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 — a closed stdout must not keep the process alive
        pass
    try:
        print(line, file=sys.stderr, flush=True)
    finally:
        os._exit(status)
