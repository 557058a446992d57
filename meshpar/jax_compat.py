"""What meshpar needs from jax and Python beyond their public APIs, in one place (jax 0.10 and
0.12, Python 3.11 and 3.12).

Every use of a private jax API (``jax._src...``, private attributes, a client's runtime type),
every match on a jax repr or message text, every branch on the jax version, every workaround
for an older jax's return types, and the one private hook of Python's ``threading`` meshpar uses
live here, and nowhere else (tests/test_jax_compat.py checks the rest of the repository for
them; Grain's private shared-memory pool, which the input pipeline needs and which must not
import meshpar, is in :mod:`input_pipeline.grain_compat`). Each shim names the public API to
move to once there is one; tests/test_jax_compat.py exercises each on every supported jax: 0.10
on Python 3.11 in the main suite, 0.12 on Python 3.12 in the smoke run (``.ci/run``).

Moved to public API (jax >= 0.10 has it; the old fallbacks were dead code):
``jax.shard_map`` (was ``getattr(jax, "shard_map")`` with a ``jax.experimental.shard_map``
fallback), ``jax.stages.ArgInfo.shape``/``.dtype`` (was ``ArgInfo._aval``),
``jax.stages.Compiled.out_info`` (was a ``getattr`` with a default),
``jax.extend.backend.get_backend().platform_version`` (was ``Device.client.platform_version``),
``jax.Device.memory_stats()`` (was guarded by ``hasattr``). The coordination-service reads no
longer tell a timeout from a failure by the error's text (``DEADLINE_EXCEEDED``): a read that
fails only after its whole timeout has passed is the timeout (:mod:`meshpar.processes.together`).

Elsewhere, on purpose: jaxpr primitive names and the jax-version differences in jaxpr params
live in :mod:`meshpar.jaxprs`, the one jaxpr walker; the regex on orbax/tensorstore error text
in ``meshpar/checkpoints/checkpoint.py`` is about orbax and tensorstore, not jax.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np


def coordination_client() -> Any | None:
    """The coordination service's client that ``jax.distributed.initialize`` made (its
    key-value store: ``key_value_set``, ``blocking_key_value_get``, ``key_value_dir_get``, ...),
    or None before that (or in a single-process run that never joined).

    Public API to move to: none in jax 0.10 or 0.12 (``jax.distributed`` exposes only
    ``initialize``, ``is_initialized`` and ``shutdown``). Orbax reads the same private global.
    """
    from jax._src.distributed import global_state  # private: see above

    return global_state.client


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value a function's backward pass keeps from its forward pass."""

    shape: tuple[int, ...]
    dtype: np.dtype
    # Where it comes from: "argument", "constant", "literal", "named" (a checkpoint_name tag),
    # or the primitive whose output it is ("scan", "tanh", "jit", ...).
    source: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


# jax's own descriptions of a residual's source (jax/_src/ad_checkpoint.py, 0.10 to 0.12).
_SOURCES = (
    (re.compile(r"from the argument\b"), "argument"),
    (re.compile(r"from a constant\b"), "constant"),
    (re.compile(r"from a literal\b"), "literal"),
    (re.compile(r"named '"), "named"),
    (re.compile(r"output of jitted function\b"), "jit"),
)
_OUTPUT_OF = re.compile(r"output of (\S+) from\b")


def _source(description: str) -> str:
    for pattern, source in _SOURCES:
        if pattern.match(description):
            return source
    m = _OUTPUT_OF.match(description)
    if m is None:
        raise ValueError(f"unrecognized residual description from jax: {description!r}")
    return m[1]


def saved_residuals(fn: Callable, *args: Any) -> list[Residual]:
    """The residuals jax's autodiff saves for ``jax.grad(fn)(*args)`` (args may be
    ShapeDtypeStructs), in jax's order.

    Public API to move to: ``jax.ad_checkpoint.print_saved_residuals`` prints the same list
    as text; no public API returns it (jax 0.10, 0.12). The private function returns each
    residual's source as a description string, parsed here into :attr:`Residual.source`.
    """
    from jax._src.ad_checkpoint import saved_residuals as private  # private: see above

    return [Residual(tuple(aval.shape), np.dtype(aval.dtype), _source(where)) for aval, where in private(fn, *args)]


def load_jax_plugins() -> None:
    """Import jax and load its installed PJRT plugins (each ``jax_plugins`` module's
    ``initialize()``, which registers its platform) without starting a backend: what the first
    ``jax.devices()`` does before it starts one. :mod:`meshpar.backend.quiet` runs it with stderr captured,
    since the CUDA plugin prints its noise as it loads; ``jax.distributed.initialize`` may still
    follow, as no backend has started. Idempotent: jax loads its plugins once per process.

    Public API to move to: none in jax 0.10 or 0.12 (the plugins load only inside the backend's
    start: ``jax.devices()``, ``jax.extend.backend.get_backend()`` and the like).
    """
    from jax._src import xla_bridge  # private: see above

    xla_bridge._discover_and_register_pjrt_plugins()


def backends_started() -> bool:
    """Whether jax has started its backends (the first ``jax.devices()``, ``jax.jit`` call and the
    like), without starting them: after that, the environment variables a backend reads at its
    start (XLA's allocator's: :mod:`meshpar.backend.unified_memory`) come too late for this process.

    Public API to move to: none in jax 0.10 or 0.12 (every public way to ask about a backend
    starts it).
    """
    from jax._src import xla_bridge  # private: see above

    return xla_bridge.backends_are_initialized()


def step_cublas_workspace_exceeds_lone() -> bool:
    """Whether this jaxlib's XLA:GPU gives the cuBLAS calls of a whole train step a larger
    workspace than the same matmul compiled alone (jaxlib 0.12: 32 MiB in the step, 4 MiB
    alone), which the memory model's probe (:mod:`meshpar.plan.time.gemm`) reads: its cuBLAS figure
    is checked on jaxlib 0.10, where the two agree. Public API to move to: none (a property of
    XLA's GPU compiler, not of jax's API)."""
    import jax

    return tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


def compile_only_device(device: Any) -> bool:
    """Whether `device` belongs to a compile-only client (XLA's GPU compiler on a host without the
    GPU: :mod:`meshpar.plan.gpu_target`): programs lower and compile for it, nothing runs on it.

    Public API to move to: none in jax 0.10 or 0.12 (``jax.Device.client`` is the PJRT client,
    whose ``runtime_type`` is ``"compile_only_runtime"`` for such devices and ``"pjrt_ifrt"`` for
    devices that run programs).
    """
    return getattr(device.client, "runtime_type", "") == "compile_only_runtime"  # private: see above


def memory_analysis(compiled: Any) -> Any:
    """The per-device memory statistics of a compiled program (``argument_size_in_bytes``,
    ``output_size_in_bytes``, ``temp_size_in_bytes``, ``alias_size_in_bytes`` and their
    ``host_*`` counterparts).

    ``jax.stages.Compiled.memory_analysis()`` returns one object on jax 0.10 and 0.12 (checked
    by tests/test_jax_compat.py); earlier jax versions returned a list with one entry per
    program, whose first is the step's. Public API to move to: ``memory_analysis()`` itself, once
    no supported jax can return the list.
    """
    stats = compiled.memory_analysis()
    return stats[0] if isinstance(stats, (list, tuple)) else stats


@dataclasses.dataclass(frozen=True)
class OptionRefusal:
    """Why XLA refuses a compile option (a field of its ``DebugOptions``, set by name)."""

    known: bool  # False: no DebugOptions field has that name in this jaxlib
    expects: str  # the kind of value the field takes ("bool", "int32", "int64", "float", "enum", ...), or ""
    text: str  # XLA's own message, one line


# A module that compiles in a few milliseconds; the options are applied before it compiles.
_PROBE_MODULE = (
    "module @meshpar_option_probe { func.func public @main(%arg0: tensor<f32>) -> tensor<f32> "
    "{ return %arg0 : tensor<f32> } }"
)
# Dump no module, whatever a probed option asks (no module's name matches).
_NO_DUMPS = (("xla_dump_hlo_module_re", "^$"), ("xla_dump_max_hlo_modules", 0), ("xla_enable_dumping", False))
_NOT_VALID = re.compile(r"'.*' is not a valid (\w+) value")


def xla_option_refusals(options: Any) -> dict[str, OptionRefusal | None]:
    """For each ``name -> value`` of `options`, XLA's refusal to compile with
    ``compiler_options={name: value}`` (None where it takes it), without starting jax's backends:
    a trivial module is compiled on a CPU client of its own, which jax never sees (so a config can
    be checked before ``jax.distributed.initialize`` and the unified-memory variables). XLA reads
    compile options into its DebugOptions the same way on every backend, so a GPU flag is checked
    here as the GPU compile will read it.

    Public API to move to: none in jax 0.10 or 0.12 (jax exposes no list of DebugOptions fields,
    and every public way to compile starts its backends).
    """
    from jax._src.interpreters import mlir  # private: see above
    from jax._src.lib import _jax, xla_client
    from jax._src.lib.mlir import ir

    client = xla_client.make_cpu_client()
    devices = _jax.DeviceList(tuple(client.devices()[:1]))

    def refused(module, overrides: list) -> OptionRefusal | None:
        compile_options = xla_client.CompileOptions()
        try:
            compile_options.env_option_overrides = overrides
            client.compile_and_load(module, executable_devices=devices, compile_options=compile_options)
        except Exception as e:  # noqa: BLE001 (XLA's refusal, or a value the binding cannot convert)
            return _refusal(overrides[0][0], " ".join(str(e).split()))
        return None

    with mlir.make_ir_context():
        module = ir.Module.parse(_PROBE_MODULE)
        # Each option is set, then checked, then overridden so that nothing is dumped (xla_dump_to
        # names a folder, xla_dump_hlo_as_text prints): by the overrides this jaxlib has.
        quiet = [o for o in _NO_DUMPS if refused(module, [o]) is None]
        out = {name: refused(module, [(name, value), *quiet]) for name, value in options.items()}
        del module  # before its context closes
    return out


def _refusal(name: str, text: str) -> OptionRefusal:
    """XLA's message on refusing the compile option `name`, read: ``No such compile option: 'x'``
    or ``While setting option x, '3' is not a valid bool value.``"""
    text = text.removeprefix("INVALID_ARGUMENT: ")
    if f"No such compile option: '{name}'" in text:
        return OptionRefusal(False, "", text)
    found = _NOT_VALID.search(text)
    return OptionRefusal(True, found.group(1) if found else "", text)


def register_before_thread_shutdown(hook: Callable[[], Any]) -> bool:
    """Run `hook` at interpreter exit before ``concurrent.futures`` refuses new work and before
    non-daemon threads are joined (what an asynchronous save needs to finish: its writes are
    executor tasks). Returns whether the hook could be registered.

    Public API to move to: none in Python 3.11 or 3.12: ``atexit`` hooks run only after
    ``threading``'s shutdown has joined every non-daemon thread, so they come too late;
    ``threading._register_atexit`` is the private hook ``concurrent.futures`` itself uses, and
    its hooks run in reverse order of registration, so one registered after
    ``concurrent.futures`` was imported runs before that module's own refusal. Without it (a
    future Python) no hook: the caller's ``close()`` is what finishes a save.
    """
    register = getattr(threading, "_register_atexit", None)  # private: see above
    if register is None:
        return False
    register(hook)
    return True
