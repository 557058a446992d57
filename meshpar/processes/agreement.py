"""Every process's value of one figure, combined the same way on each: how the pre-flight's
processes agree (:mod:`meshpar.plan.preflight`), through the coordination service's key-value store."""

from __future__ import annotations

import json

import jax

from meshpar.configuration.errors import DistributedError
from meshpar.jax_compat import coordination_client
from meshpar.processes.lines import one_line


def agree(name: str, value, combine, timeout_s: float = 600):
    """`combine` of every process's `value` (JSON-able), exchanged through the coordination
    service's key-value store (each process posts its own, then reads all); `value` itself in a
    single-process run. Every process gets the same result. Raises DistributedError when a
    peer has not posted within `timeout_s`."""
    if jax.process_count() == 1:
        return value
    client = coordination_client()
    prefix = f"meshpar/agree/{name}"
    try:
        client.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(value))
        values = [
            json.loads(client.blocking_key_value_get(f"{prefix}/{k}", int(timeout_s * 1000)))
            for k in range(jax.process_count())
        ]
    except Exception as e:  # noqa: BLE001 — jax's JaxRuntimeError: a peer never posted its value
        raise DistributedError(f"could not gather every process's {name}: {one_line(e)}") from None
    return combine(values)
