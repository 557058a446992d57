"""Which process of a multi-process run is lost: heartbeats through the coordination service.

A process killed outright (SIGKILL, the OOM killer, a lost machine) cannot tell anyone. Its
TCP connections close, but gloo mostly does not report it, and the survivors' collectives
wait. jax's coordination service declares it dead only once it has missed its heartbeats for
jax's heartbeat timeout (jax's C++ client beats every half timeout, so that comes between half
the timeout and all of it after the death: 16 s measured at 20 s), and then every survivor's
error-polling thread calls ``LOG(FATAL)``: exit 134 (SIGABRT), jax's "Terminating process
because the JAX distributed service detected fatal errors" and a C++ stack trace. So meshpar
watches itself, through the coordination service's key-value store
(:mod:`meshpar.processes.distributed` runs the threads and ends the processes):

- every process but 0 raises a counter, ``meshpar/alive/<process>``, every :func:`period`
  (``min(1 s, heartbeat_timeout_seconds / 5)``) from a daemon thread of its own (:func:`beat`):
  a process busy in a long XLA compile or a checkpoint save still beats (both release the GIL;
  what would stop the beat is C code holding the GIL for seconds, or the process stopped);
- process 0 reads every counter in one call (:func:`read`) at the same rate; one that has not
  moved for ``distributed.heartbeat_timeout_seconds`` (default 10 s) is a lost process
  (:class:`Silence`). Process 0 needs no counter of its own: when it goes, the coordination
  service goes with it, and every other process's next read of the store fails at once;
- a process that finishes writes ``done`` in place of its counter first;
- should process 0's reads themselves be held up for half the timeout (a stopped or starved
  machine: nobody beat), it starts counting afresh instead of blaming the others;
- jax's own heartbeat timeout is set to :func:`jax_heartbeat_timeout` (``2 * (timeout + 10)``):
  it fires half that after the last beat at the earliest, after meshpar's check, and stays the
  backstop (for a lost process 0 as well, and for a peer lost while process 0 itself is stuck).

jax's client has ``get_live_nodes``, but it is a barrier (it returns once every live process
has called it) that learns of a death from the same heartbeat timeout: no use here.

Measured with jax 0.10.2 and 0.12 on CPU/gloo (tests/test_distributed.py), two processes of
experiments/mlp_model_parallel.yaml, one SIGKILLed: the survivor ends ~10 s after the kill at
the default 10 s, with ``training error: lost process 1 (no heartbeat for 10 s); last
checkpoint: step K in DIR`` and exit status 1 (jax alone: exit 134, 16 s after the kill at its
then default 20 s).
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
