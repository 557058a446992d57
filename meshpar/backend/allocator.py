"""XLA's GPU allocator fraction: the share of a device's memory its allocator may take, read
from the environment as jaxlib reads it (the process's set-up, not a plan: the planner's
capacity, :mod:`meshpar.plan.cost`, and Unified Memory, :mod:`meshpar.backend.unified_memory`,
both start from it)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from meshpar.configuration.schema import ConfigError

# The variable's names, newest first (jaxlib reads one and refuses both), and jaxlib's default.
FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
DEFAULT_FRACTION = 0.75


def allocator_fraction(
    environ: Mapping[str, str] | None = None, oversubscription: float | None = None
) -> tuple[float, str]:
    """XLA's GPU allocator fraction and where it came from (see :mod:`meshpar.plan.cost`: 1 on CPU, where nothing caps the allocator). A value
    that is not a number in (0, 1] is a ConfigError on the variable.

    `oversubscription`: the config's under unified memory (``offload.unified_memory``), where a
    variable set in the environment still wins (:mod:`meshpar.backend.unified_memory`), any number
    above 0 is allowed, and the allocator takes ``max(1, fraction)`` of the device (XLA's BFC
    allocator under ``TF_FORCE_UNIFIED_MEMORY``)."""
    environ = os.environ if environ is None else environ
    unified = oversubscription is not None
    for name in FRACTION_VARIABLES:
        text = environ.get(name)
        if not text:  # jaxlib reads an empty one as unset
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if unified and 0 < value < math.inf:
            return max(value, 1.0), f"{name}={text}, unified memory"
        if not (0 < value < math.inf and (unified or value <= 1)):
            allowed = "a number above 0" if unified else "a number in (0, 1]"
            raise ConfigError(name, f"is {text!r}: XLA's allocator fraction is {allowed}")
        return value, f"{name}={text}"
    if unified:
        return max(oversubscription, 1.0), f"offload.oversubscription={oversubscription:g}"
    return DEFAULT_FRACTION, f"{DEFAULT_FRACTION:g} by default"
