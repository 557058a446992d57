"""Clean stderr on a host that has jax's CUDA plugin installed but no GPU.

The ``gpu-plan`` extra installs XLA's GPU compiler (jax's CUDA plugin) so that the planner can
compile for a GPU on a host without one. On such a host every jax process prints, from C++
straight to file descriptor 2, a pair of lines each time one of jaxlib's CUDA modules loads
(jaxlib 0.10: three pairs at ``import jax``, one more when jax loads its plugins)::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1796178888.081558    2889 cudart_stub.cc:31] Could not find cuda drivers on your machine, ...

and, unless ``JAX_PLATFORMS`` names the platforms, the backend's start logs a whole traceback
("Jax plugin configuration error ... Unable to load CUDA", or cuDNN: jaxlib 0.10 and 0.12) before
it falls back to the CPU. No logging variable silences the C++ lines (``TF_CPP_MIN_LOG_LEVEL``
and glog's and absl's variables leave them), and all of it would break meshpar's promise of
one-line errors and clean output on every command.

:func:`set_up`, which ``meshpar/__init__.py`` runs on the import of any meshpar module, does
nothing unless a CUDA plugin is installed and no CUDA driver can be loaded. There it sets
``JAX_PLATFORMS=cpu`` when the user has not set it (or set it empty): the CPU is the backend
jax would fall back to anyway, so nothing changes but the traceback; a value the user set is
never overridden. Then it imports jax and loads jax's plugins (without starting a backend, so
``jax.distributed.initialize`` can still come after) with fd 2 captured, and prints again every
captured line that is not the known noise: whatever else jax or a plugin has to say still
reaches stderr, in its order.

:func:`native_stderr_filtered` is the same capture for other code that calls into XLA's GPU
compiler (a GPU topology's compile-only client, say) where it prints the same noise.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping

from meshpar import jax_compat
from meshpar.backend import jax_import

# The lines dropped from captured stderr (each pattern must match a whole line): absl's banner
# before its first message, and the CUDA runtime stub's "no driver" message (glog prefix:
# severity, date, time, thread id, file:line).
NOISE = (
    re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"),
    re.compile(
        r"[IWE]\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] "
        r"Could not find cuda drivers on your machine, GPU will not be used\."
    ),
)

# jax's CUDA plugin, by the module names its wheels install (the PJRT plugin; jaxlib's kernels).
CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_cuda12_plugin")


def drop_noise(text: str, patterns: tuple[re.Pattern, ...] = NOISE) -> str:
    """``text`` without its lines that match one of ``patterns`` in full; every other line is kept,
    in order, with its line ending."""
    return "".join(
        line for line in text.splitlines(keepends=True) if not any(p.fullmatch(line.rstrip("\r\n")) for p in patterns)
    )


def cuda_plugin_installed() -> bool:
    """Whether a jax CUDA plugin is installed, found without importing it or jax."""
    for name in CUDA_PLUGIN_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # no parent package (``jax_plugins``); a module without a spec
            continue
    return False


def cuda_driver_present() -> bool:
    """Whether the CUDA driver library loads (what the plugin needs to see a GPU)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Decision:
    quiet: bool  # capture fd 2 around ``import jax`` and jax's plugin loading
    jax_platforms: str | None  # what to set JAX_PLATFORMS to; None: leave it as it is


def decide(
    environ: Mapping[str, str], plugin_installed: Callable[[], bool], driver_present: Callable[[], bool]
) -> Decision:
    """What :func:`set_up` does, from the environment and two probes (called only as needed: the
    driver is probed only where a plugin is installed, so a host without one pays nothing)."""
    if not plugin_installed() or driver_present():
        return Decision(quiet=False, jax_platforms=None)
    # An empty JAX_PLATFORMS is no choice (jax reads it as unset): the CPU is what jax would take.
    return Decision(quiet=True, jax_platforms=None if environ.get("JAX_PLATFORMS") else "cpu")


def _write_fd2(data: bytes) -> None:
    while data:
        data = data[os.write(2, data) :]


@contextlib.contextmanager
def native_stderr_filtered(patterns: tuple[re.Pattern, ...] = NOISE) -> Iterator[None]:
    """Capture file descriptor 2 (C++ logging as well as Python's) for the block, then print
    what was captured less the lines that match ``patterns`` (:func:`drop_noise`).

    fd 2 belongs to the whole process: another thread's stderr output during the block is
    captured too, and printed after it (unless it is noise)."""
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (a closed stderr): nothing to capture, nowhere to print
        yield
        return
    with tempfile.TemporaryFile() as captured:
        if sys.stderr is not None:
            sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            if sys.stderr is not None:
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            # surrogateescape: bytes that are not UTF-8 come back out unchanged
            kept = drop_noise(captured.read().decode("utf-8", "surrogateescape"), patterns)
            _write_fd2(kept.encode("utf-8", "surrogateescape"))


def set_up() -> None:
    """Quiet jax's CUDA plugin where there is no GPU (see the module's docstring); nothing at all
    where no CUDA plugin is installed or a driver is there. A second call does nothing more."""
    decision = decide(os.environ, cuda_plugin_installed, cuda_driver_present)
    if not decision.quiet:
        return
    jax_imported = "jax" in sys.modules  # before meshpar: jax has read JAX_PLATFORMS already
    if decision.jax_platforms is not None:
        os.environ["JAX_PLATFORMS"] = decision.jax_platforms
    with native_stderr_filtered():
        # Imported here, inside the capture (importing jax prints the noise), and only where the
        # plugin is: on a host without one, importing meshpar does not import jax.
        jax = jax_import.import_jax()

        if jax_imported and decision.jax_platforms is not None and not jax.config.jax_platforms:
            jax.config.update("jax_platforms", decision.jax_platforms)
        jax_compat.load_jax_plugins()
