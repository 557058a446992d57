"""meshpar.processes.liveness: the heartbeat goes on while the process is busy in XLA, and process 0's
rule names a silent process, never one that beats, finished, or was held up together with it.
(The whole path, a SIGKILLed process and its survivor's line: tests/test_distributed.py.)"""

import threading
import time

import jax
import jax.numpy as jnp

from meshpar.processes import liveness


class Store:
    """Stands in for the coordination service's key-value store (what the liveness check uses)."""

    def __init__(self):
        self.values, self.sets = {}, []

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.values
        self.values[key] = value
        self.sets.append((key, value, time.monotonic()))

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in list(self.values.items()) if k.startswith(prefix)]


def test_the_heartbeat_goes_on_through_a_long_xla_compile_and_ends_with_done():
    # A thread of its own, and XLA compiles with the GIL released: a process busy in a long
    # compile (a big model's first step) still beats, and is not taken for lost.
    store, finished = Store(), threading.Event()
    beat = threading.Thread(target=liveness.beat, args=(store, 1, 0.05, finished))
    beat.start()

    def deep(x):
        for i in range(45):
            x = jnp.sin(x @ x.T) + i
        return x * float(time.time_ns() % 999_983)  # a constant of its own: no compilation cache hit

    started = time.monotonic()
    jax.jit(deep).lower(jax.ShapeDtypeStruct((64, 64), jnp.float32)).compile()
    ended = time.monotonic()
    finished.set()
    beat.join()
    assert ended - started > 0.5  # a silence of 10 periods, were the beat on the main thread
    times = [started, *(when for _, _, when in store.sets if started < when < ended), ended]
    assert max(b - a for a, b in zip(times, times[1:])) < 0.5, times
    assert {k for k, _, _ in store.sets} == {"meshpar/alive/1"}
    assert store.sets[-1][1] == liveness.DONE and liveness.read(store) == {1: liveness.DONE}


def test_a_process_whose_counter_stands_still_for_the_timeout_is_lost():
    silence = liveness.Silence([1, 2, 3], lost_after=10, now=0.0)
    for t in range(1, 10):  # 1 beats every second, 2 beats until t=3, 3 finishes at t=2
        counters = {1: str(t), 2: str(min(t, 3))}
        if t >= 2:
            counters[3] = liveness.DONE
        assert silence.update(counters, now=float(t)) == []
    assert silence.update({1: "10", 2: "3", 3: liveness.DONE}, now=12.5) == []  # 2: silent 9.5 s
    assert silence.update({1: "11", 2: "3", 3: liveness.DONE}, now=13.0) == [2]  # 10 s
    assert silence.silent_for([2], now=13.0) == 10.0


def test_a_process_that_never_beat_counts_from_the_start():
    silence = liveness.Silence([1], lost_after=3, now=100.0)
    assert silence.update({}, now=101.0) == [] and silence.update({}, now=102.0) == []
    assert silence.update({}, now=103.0) == [1]


def test_nobody_is_blamed_for_a_stall_they_all_shared():
    # Every process held up at once (a stopped machine, a stalled VM): process 0's reads stop
    # too. Whoever has not moved when it resumes gets the full timeout again.
    silence = liveness.Silence([1], lost_after=4, now=0.0)
    assert silence.update({1: "1"}, now=1.0) == []
    assert silence.update({1: "1"}, now=30.0) == []  # the read came 29 s late: count afresh
    assert silence.update({1: "1"}, now=31.0) == [] and silence.update({1: "2"}, now=32.0) == []
    assert [silence.update({1: "2"}, now=t) for t in (33.0, 34.0, 35.0, 36.0)] == [[], [], [], [1]]  # 4 s


def test_a_finished_run_leaves_nobody_to_watch():
    silence = liveness.Silence([1, 2], lost_after=1, now=0.0)
    assert silence.update({1: liveness.DONE, 2: liveness.DONE}, now=0.5) == []
    assert not silence.watching()


def test_a_quick_look_finds_a_counter_that_stands_still():
    store = Store()
    store.key_value_set("meshpar/alive/2", "7")
    assert liveness.one_stands_still(store, [2], every=0.01)  # 2's counter stays at 7
    store.key_value_set("meshpar/alive/2", liveness.DONE, allow_overwrite=True)
    assert not liveness.one_stands_still(store, [2], every=0.01)  # 2 finished


def test_jax_heartbeat_is_the_backstop():
    # jax declares a process dead half its timeout after its last beat at the earliest: after
    # meshpar's check and the handshake that follows it.
    for lost_after in (1, 3, 10, 604800):
        assert liveness.jax_heartbeat_timeout(lost_after) / 2 >= lost_after + liveness.period(lost_after) + 5
