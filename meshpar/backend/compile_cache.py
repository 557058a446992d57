"""JAX's persistent compilation cache, on by default: a second start reuses compiled programs.

The folder and the minimum compile time come from the config (``compile_cache``); the
environment variables JAX reads itself win over both, so a shell, CI or a test session can
point every run at its own folder (``JAX_COMPILATION_CACHE_DIR``; empty = no cache) without
touching configs:

- ``JAX_COMPILATION_CACHE_DIR`` over ``compile_cache.dir``,
- ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` over ``compile_cache.min_compile_secs``.

JAX's own default minimum (1 s) leaves out most of a small model's programs on CPU; the
config's default keeps everything that takes a tenth of a second or more to compile.
The cache is trusted: a folder others can write to lets them run code in this process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

from meshpar.configuration.schema import ConfigError

DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_SECS_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def configure(cfg) -> str | None:
    """Point JAX's persistent cache at the folder `cfg` (a ``CompileCacheConfig``) names,
    unless the environment names one. Returns the folder in use (None: no cache).

    Call before the first compilation; a folder changed later in the same process takes effect
    from the next compilation on (the cache is reset)."""
    if DIR_ENV in os.environ:
        path = os.environ[DIR_ENV] or None
    else:
        path = os.path.expanduser(cfg.dir) if cfg.dir else None
        if path:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as e:  # else jax warns on every program and keeps nothing
                raise ConfigError(
                    "compile_cache.dir", f'cannot create {path}: {e.strerror or e} ("" turns the cache off)'
                ) from None
    if MIN_SECS_ENV not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", cfg.min_compile_secs)
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()  # the next compilation opens the new folder
    return path


@contextlib.contextmanager
def suspended(active: bool = True) -> Iterator[None]:
    """No persistent cache within the block when `active` (as it was after). Programs compiled
    for a compile-only target (XLA's GPU compiler on a host without the GPU) would be written to
    the cache, but such a client cannot load them back: every later read would warn."""
    was = jax.config.jax_enable_compilation_cache
    if active:
        jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
