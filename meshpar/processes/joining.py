"""Joining a multi-process run on ``jax.distributed``: every process connects and starts its
backend within ``distributed.initialization_timeout`` seconds, or ends with one line
(``distributed error: ...``, exit status 2) instead of jax's C++ abort. The design:
docs/multi-process.md, "How processes start and stop together"."""

from __future__ import annotations

import contextlib
import math
import socket
import threading

import jax

from meshpar.configuration.config import DistributedConfig
from meshpar.configuration.errors import DistributedError
from meshpar.processes import liveness, together
from meshpar.processes.lines import exit_now, one_line

_BACKSTOP_S = 10  # jax's own initialization limit, past our deadline: the one line is ours


@contextlib.contextmanager
def _deadline(seconds: float, describe_failure):
    """End the process with ``describe_failure()`` (one line, exit 2) if the block is still
    running after `seconds`. The block waits inside jax's C++ code, which releases the GIL."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            exit_now(describe_failure(), 2)

    thread = threading.Thread(target=watch, name="meshpar-join-deadline", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _probe(address: str) -> str | None:
    """Why a TCP connection to `address` fails, or None if it opens."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return None
    except (OSError, ValueError) as e:
        return (getattr(e, "strerror", None) or str(e) or type(e).__name__).lower()


def _startup_failure(cfg: DistributedConfig, phase: str) -> str:
    who = f"process {cfg.process_id}" if cfg.process_id >= 0 else "this process"
    wait = f"within {cfg.initialization_timeout} s (distributed.initialization_timeout)"
    address = cfg.coordinator or "the coordinator"
    if phase == "backend":
        return (
            f"distributed error: {who}: the {cfg.num_processes} processes joined, but not all of them "
            f"started their devices {wait}"
        )
    if cfg.process_id == 0:
        return (
            f"distributed error: not all {cfg.num_processes} processes joined the coordinator at "
            f"{address} {wait}: a process never came"
        )
    why = _probe(cfg.coordinator) if cfg.coordinator else None
    if why:
        return (
            f"distributed error: {who} cannot reach the coordinator at {address} ({why}) {wait}; "
            f"process 0 must run there (distributed.coordinator)"
        )
    return (
        f"distributed error: {who} could not join the coordinator at {address} {wait}: "
        f"a process never came, or that address is not process 0's coordinator"
    )


def join(cfg: DistributedConfig, checkpoint_dir: str | None = None) -> None:
    """Connect this process to the others and start the backend (before any other JAX call).

    Raises DistributedError (one line) when jax refuses the settings; ends the process with
    one line and exit status 2 when the others cannot be reached in time (see module doc).
    CPU devices of different processes exchange collectives over gloo; accelerators use
    their own (NCCL on GPU), so the setting is harmless there. Inside
    :func:`meshpar.processes.together.stop_together`, meshpar watches for lost processes itself
    (`checkpoint_dir`: where the line it ends with looks for the last checkpoint) and jax's
    heartbeat timeout becomes the backstop.
    """
    jax.config.update("jax_enable_preemption_service", False)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    minutes = max(1, math.ceil(cfg.initialization_timeout / 60))
    jax.config.update("jax_cpu_get_local_topology_timeout_minutes", minutes)
    jax.config.update("jax_cpu_get_global_topology_timeout_minutes", minutes + 1)  # must be longer
    watcher = together.current()
    phase = "connect"
    with _deadline(cfg.initialization_timeout, lambda: _startup_failure(cfg, phase)):
        try:
            jax.distributed.initialize(
                cfg.coordinator or None,
                cfg.num_processes,
                None if cfg.process_id < 0 else cfg.process_id,
                initialization_timeout=cfg.initialization_timeout + _BACKSTOP_S,
                heartbeat_timeout_seconds=(
                    cfg.heartbeat_timeout_seconds
                    if watcher is None
                    else liveness.jax_heartbeat_timeout(cfg.heartbeat_timeout_seconds)
                ),
                shutdown_timeout_seconds=cfg.shutdown_timeout_seconds,
            )
        except (RuntimeError, ValueError, TypeError) as e:  # bad ids, no cluster detected, joined twice
            keys = "distributed.coordinator, distributed.num_processes, distributed.process_id"
            raise DistributedError(f"cannot join the other processes: {one_line(e)} ({keys})") from None
        phase = "backend"
        if watcher is not None:
            # Before the backend: a peer failing (or lost) from here on is heard.
            watcher.start(cfg.heartbeat_timeout_seconds, checkpoint_dir)
        try:
            jax.devices()
        except RuntimeError as e:
            raise DistributedError(
                f"process {jax.process_index()}: the processes' devices could not be gathered: {one_line(e)}"
            ) from None
