"""jax's first import, with a JAX_NUM_CPU_DEVICES that is not an integer hidden from it.

jax reads the variable once, while it is imported, and such a value makes ``import jax`` itself
raise: a traceback before any meshpar code could say what is wrong. :func:`import_jax` hides it
from that import and puts it back right after, so that
:func:`meshpar.sharding.mesh.cpu_devices_from_env` reports it in one line. Every meshpar module
that may be the first to import jax (:mod:`meshpar.backend.quiet` where a CUDA plugin is
installed, :mod:`meshpar.sharding.mesh` otherwise) imports it through here.
"""

from __future__ import annotations

import os

CPU_DEVICES_ENV = "JAX_NUM_CPU_DEVICES"


def import_jax():
    """The jax module, imported with a bad JAX_NUM_CPU_DEVICES hidden from the import."""
    hidden = os.environ.pop(CPU_DEVICES_ENV, None)
    if hidden is not None:
        try:
            int(hidden)  # what jax does with it
        except ValueError:
            pass  # stays hidden from the import below
        else:
            os.environ[CPU_DEVICES_ENV], hidden = hidden, None
    try:
        import jax
    finally:
        if hidden is not None:
            os.environ[CPU_DEVICES_ENV] = hidden
    return jax
