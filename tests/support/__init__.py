"""What tests share that is not a test of its own.

:func:`script` imports a module of ``scripts/`` (a folder of files run as programs, not a
package) for a test that uses it as a library: the shared helpers the scripts use
(``scripts/train_runs.py``: the train command launched, killed and read back from outside;
``scripts/common.py``), or a script whose functions a test checks. One place puts ``scripts/`` on
``sys.path``, so that no test reaches for a file path itself.

Its modules hold checks more than one test file makes: :mod:`.cli` (a command's one-line
refusal), :mod:`.kv_cache` (cached decoding against the full forward pass), :mod:`.hf_import` (a
Hugging Face import's host memory, in a process of its own), :mod:`.steps` (abstract train
steps built once per config). pytest rewrites the asserts of
:mod:`.cli` and :mod:`.hf_import` as a test's, so that a failure shows the values compared.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.register_assert_rewrite("tests.support.cli", "tests.support.hf_import")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module, imported once per session like any other. ``scripts/``
    goes at the end of ``sys.path``: a script's imports of its siblings (``import common``)
    resolve as when it runs, and nothing installed is shadowed."""
    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))
    return importlib.import_module(name)
