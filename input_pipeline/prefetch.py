"""Device prefetch: at most ``depth + 1`` placed batches alive at once, the one in use included.

A background thread reads host batches and places them while the previous step computes, so
host→device transfer overlaps compute. Batch ``step`` is always ``place(load(step))``,
whatever the depth, so order and content never depend on it. An exception in the producer is
re-raised in the consumer at the batch where it happened; ``close()`` (or leaving the
``with`` block) stops and joins the thread, so none is left behind.

The bound is kept with slots, not with the queue's size: the producer takes a slot *before*
it places a batch, and a slot frees only when that batch is released (its arrays, or the
``Fed`` when they cannot be weakly referenced, are garbage). A bounded queue alone lets one
more batch wait inside ``put``, placed but not counted (``depth + 2`` alive). With
``depth == 0`` batches are placed on demand in the caller's thread, so the caller must drop
the previous batch (the train loop's ``del fed``) before asking for the next; a caller that
keeps all ``depth + 1`` and asks for another gets a one-line error instead of a deadlock.
"""

from __future__ import annotations

import dataclasses
import gc
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax

_POLL_S = 0.05  # how often a blocked producer checks whether it was closed


@dataclasses.dataclass
class Fed:
    """One batch as the train loop receives it."""

    step: int
    arrays: Any  # what `place` returned: dict of global jax.Arrays
    info: Any  # what the feeder reported for this placement
    wait_s: float  # how long the consumer waited for it (input stall)


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class _Slots:
    """A count of live placed batches, at most ``limit``; a slot frees when its batch is garbage."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.waiting = False  # the producer is blocked for want of a slot
        # Reentrant: a batch can be collected, and its slot released, inside a locked section.
        self._cond = threading.Condition(threading.RLock())

    def acquire(self, closed: threading.Event | None = None) -> bool:
        """Take a slot, waiting for one if `closed` is given (else don't wait); False if none."""
        with self._cond:
            while self.held >= self.limit:
                if closed is None or closed.is_set():
                    return False
                self.waiting = True
                self._cond.wait(_POLL_S)
            self.waiting = False
            self.held += 1
            return True

    def release(self) -> None:
        with self._cond:
            self.held -= 1
            self._cond.notify_all()

    def starved(self) -> bool:
        """All slots are taken and the producer waits for one."""
        with self._cond:
            return self.waiting and self.held >= self.limit

    def tie(self, batch: Any) -> bool:
        """Release one slot when every weakly referenceable leaf of `batch` is garbage; False
        if it has none (plain Python values), for the caller to tie the slot to something else."""
        leaves = []
        for leaf in jax.tree.leaves(batch):
            try:
                weakref.ref(leaf)
            except TypeError:
                continue
            leaves.append(leaf)
        if not leaves:
            return False
        remaining = [len(leaves)]
        lock = threading.Lock()

        def gone() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self.release()

        for leaf in leaves:
            weakref.finalize(leaf, gone).atexit = False
        return True


def _held_error(depth: int) -> RuntimeError:
    return RuntimeError(
        f"prefetch depth {depth} allows {depth + 1} placed batch(es) alive and the caller still holds them all: "
        "drop the previous batch (e.g. `del fed`) before asking for the next"
    )


class Prefetcher:
    """Iterate placed batches ``start, start+1, ..., stop-1``.

    ``produce(step) -> (arrays, info)`` loads and places one batch; with ``depth == 0`` it runs
    on demand in the caller's thread, otherwise in one background thread, at most ``depth``
    batches ahead of the one in use. ``on_close`` runs once the producer has stopped (e.g. to
    stop the worker processes `produce` reads from).
    """

    def __init__(
        self,
        produce: Callable[[int], tuple[Any, Any]],
        start: int,
        stop: int,
        depth: int,
        on_close: Callable[[], None] | None = None,
    ):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self._produce, self._next, self._stop, self.depth = produce, start, stop, depth
        self._on_close = on_close
        self._closed = threading.Event()
        self._slots = _Slots(depth + 1)
        self._queue: queue.Queue = queue.Queue()  # unbounded: the slots bound it
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, args=(start,), name="meshpar-prefetch", daemon=True)
            self._thread.start()

    def _make(self, step: int) -> Any:
        """Place batch `step` in a slot already held: ``(step, arrays, info, tied)`` or a failure."""
        try:
            arrays, info = self._produce(step)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, never swallowed
            self._slots.release()  # nothing was placed
            return _Failure(e)
        return step, arrays, info, self._slots.tie(arrays)

    def _run(self, step: int) -> None:
        while step < self._stop and self._slots.acquire(self._closed):
            item = self._make(step)
            self._queue.put(item)
            if isinstance(item, _Failure):
                return
            del item  # the producer keeps no reference: a batch's slot frees when the consumer drops it
            step += 1

    def __iter__(self) -> Iterator[Fed]:
        return self

    def __next__(self) -> Fed:
        if self._next >= self._stop or self._closed.is_set():
            raise StopIteration
        start = time.perf_counter()
        if self._thread is None:
            if not self._slots.acquire():
                gc.collect()  # a dropped batch kept only by a reference cycle frees its slot
                if not self._slots.acquire():
                    raise _held_error(self.depth)
            item = self._make(self._next)
        else:
            item = self._get()
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        step, arrays, info, tied = item
        del item
        fed = Fed(step, arrays, info, time.perf_counter() - start)
        if not tied:
            weakref.finalize(fed, self._slots.release).atexit = False
        self._next = step + 1
        return fed

    def _get(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("prefetch thread ended without producing the next batch") from None
                if self._slots.starved() and self._queue.empty():  # every live batch is the caller's
                    gc.collect()
                    if self._slots.starved() and self._queue.empty():
                        raise _held_error(self.depth) from None

    def close(self) -> None:
        """Stop the producer and wait for it; placed batches not yet taken are dropped."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        while not self._queue.empty():
            self._queue.get_nowait()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
