"""A command's refusal: exit status 2 and one line on stderr, as every meshpar command refuses."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence


def refuses_in_one_line(main: Callable[[list[str]], int], argv: Sequence[str], capsys, expected: str) -> None:
    """``main(argv)`` (a command's ``main``) returns 2 and writes one line to stderr, which
    `expected` (a regular expression) matches from its start; `capsys` is the test's fixture."""
    status = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert re.match(expected, err[0]), err[0]
