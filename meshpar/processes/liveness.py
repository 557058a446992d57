"""Which process of a multi-process run is lost: heartbeats through the coordination service.

A process killed outright (SIGKILL, the OOM killer, a lost machine) cannot tell anyone, and
jax declares it dead only after its heartbeat timeout, with a C++ abort on every survivor. So
every process but 0 raises a counter (``meshpar/alive/<process>``) every :func:`period` from a
thread of its own (:func:`beat`), and process 0 reads them all (:func:`read`): one that has not
moved for ``distributed.heartbeat_timeout_seconds`` is a lost process (:class:`Silence`).
jax's own heartbeat timeout (:func:`jax_heartbeat_timeout`) stays the backstop.
:mod:`meshpar.processes.together` runs the threads and ends the processes. The design and
its measurements: docs/multi-process.md, "Naming a lost peer".
"""

from __future__ import annotations

import threading
import time
from typing import Any

ALIVE = "meshpar/alive"  # <ALIVE>/<process>: its counter, or DONE
DONE = "done"
_MAX_PERIOD_S = 1.0
_BACKSTOP_S = 10


def period(lost_after: float) -> float:
    """Seconds between heartbeats (and between process 0's reads of them)."""
    return min(_MAX_PERIOD_S, lost_after / 5)


def jax_heartbeat_timeout(lost_after: int) -> int:
    """jax's own heartbeat timeout while meshpar's check runs with `lost_after` seconds."""
    return 2 * (lost_after + _BACKSTOP_S)


def key(process: int) -> str:
    return f"{ALIVE}/{process}"


def beat(client: Any, process: int, every: float, finished: threading.Event) -> None:
    """Raise this process's counter every `every` seconds until `finished` (a thread's loop);
    then write DONE. Ends quietly when the store is gone (with process 0: whoever reads the
    store next says so)."""
    count = 0
    while True:
        count += 1
        try:
            client.key_value_set(key(process), str(count), allow_overwrite=True)
        except Exception:  # noqa: BLE001 — jax's JaxRuntimeError: the coordination service is gone
            return
        if finished.wait(every):
            break
    try:
        client.key_value_set(key(process), DONE, allow_overwrite=True)
    except Exception:  # noqa: BLE001 — as above
        pass


def read(client: Any) -> dict[int, str]:
    """Every process's counter (or DONE), by process, in one call."""
    prefix = f"{ALIVE}/"
    return {int(k[len(prefix) :]): v for k, v in client.key_value_dir_get(prefix)}


class Silence:
    """Process 0's view of the others' counters: who has been silent for `lost_after` seconds.

    `now` is this process's ``time.monotonic()``: counters are compared, never clocks of
    different machines."""

    def __init__(self, peers: list[int], lost_after: float, now: float):
        self.lost_after = lost_after
        self.seen = {k: (None, now) for k in peers}  # process -> (counter, when it last moved)
        self.last_read = now

    def update(self, counters: dict[int, str], now: float) -> list[int]:
        """The processes lost as of this read (sorted; none = []). A process at DONE is
        dropped: it finished, and its silence from now on is expected."""
        if now - self.last_read > self.lost_after / 2:
            # This process was held up between reads: it cannot tell who beat meanwhile.
            self.seen = {k: (count, now) for k, (count, _) in self.seen.items()}
        self.last_read = now
        for k, (count, _) in list(self.seen.items()):
            value = counters.get(k)
            if value == DONE:
                del self.seen[k]
            elif value != count:
                self.seen[k] = (value, now)
        return sorted(k for k, (_, moved) in self.seen.items() if now - moved >= self.lost_after)

    def silent_for(self, processes: list[int], now: float) -> float:
        return now - max(self.seen[k][1] for k in processes)

    def watching(self) -> bool:
        return bool(self.seen)


def one_stands_still(client: Any, peers: list[int], every: float) -> bool:
    """A quick look, not a verdict: whether a counter of `peers` stays put over three periods
    (a live process moves it every period)."""
    before = read(client)
    time.sleep(3 * every)
    after = read(client)
    return any(after.get(k) == before.get(k) != DONE for k in peers)
