"""The failures a command reports in one line instead of a traceback, and their exit statuses.

Each error's message is one line that names what is wrong (the key, the file, the step); the
commands print ``<prefix>: <message>`` on stderr and exit with the status below.
"""

from __future__ import annotations

import sys

from input_pipeline.errors import DataError
from meshpar.configuration.schema import ConfigError


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that cannot be written or verified: names the folder or step."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss, a peer process lost); the message names the step."""


class OutputError(RuntimeError):
    """A run output (metrics, summary, TensorBoard events) cannot be written: names the path."""


class DistributedError(RuntimeError):
    """The processes of a multi-process run could not start together (a coordinator that
    cannot be reached, a peer that never came) or one of them stopped with an error."""


class CompileError(RuntimeError):
    """XLA's compiler failed on the step for its target (an internal compiler error, not a config
    mistake): names the target and the compiler's own first line."""


# exception → (prefix, exit status). Order matters: the first class that matches wins.
FAILURES: dict[type[Exception], tuple[str, int]] = {
    ConfigError: ("config error", 2),
    DataError: ("data error", 2),
    CheckpointError: ("checkpoint error", 2),
    OutputError: ("output error", 2),
    DistributedError: ("distributed error", 2),
    TrainingError: ("training error", 1),
    CompileError: ("compile error", 1),
}


def describe(error: BaseException) -> tuple[str, int] | None:
    """(the one line to print, exit status) for a reportable failure, else None."""
    for cls, (prefix, status) in FAILURES.items():
        if isinstance(error, cls):
            text = " ".join(str(error).split())  # one line, whatever the message held
            return f"{prefix}: {text}", status
    return None


def report(error: BaseException) -> int:
    """Print a reportable failure's one line to stderr and return its exit status; anything
    else is re-raised (a bug keeps its traceback). For commands, inside ``except Exception``."""
    failure = describe(error)
    if failure is None:
        raise error
    print(failure[0], file=sys.stderr)
    return failure[1]
