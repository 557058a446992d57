"""Device prefetch: keep ``depth`` batches already placed on the devices, ahead of the step.

A background thread reads host batches and places them while the previous step computes, so
host→device transfer overlaps compute. Batch ``step`` is always ``place(load(step))``,
whatever the depth, so order and content never depend on it. An exception in the producer is
re-raised in the consumer at the batch where it happened; ``close()`` (or leaving the
``with`` block) stops and joins the thread, so none is left behind.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

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


class Prefetcher:
    """Iterate placed batches ``start, start+1, ..., stop-1``.

    ``produce(step) -> (arrays, info)`` loads and places one batch; with ``depth == 0`` it runs
    on demand in the caller's thread, otherwise in one background thread, at most ``depth``
    batches ahead.
    """

    def __init__(self, produce: Callable[[int], tuple[Any, Any]], start: int, stop: int, depth: int):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self._produce, self._next, self._stop, self.depth = produce, start, stop, depth
        self._closed = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, args=(start,), name="meshpar-prefetch", daemon=True)
            self._thread.start()

    def _run(self, step: int) -> None:
        while step < self._stop and not self._closed.is_set():
            try:
                item: Any = (step, *self._produce(step))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, never swallowed
                item = _Failure(e)
            while not self._closed.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return
            step += 1

    def __iter__(self) -> Iterator[Fed]:
        return self

    def __next__(self) -> Fed:
        if self._next >= self._stop or self._closed.is_set():
            raise StopIteration
        start = time.perf_counter()
        if self._thread is None:
            step, (arrays, info) = self._next, self._produce(self._next)
        else:
            item = self._get()
            if isinstance(item, _Failure):
                self.close()
                raise item.error
            step, arrays, info = item
        self._next = step + 1
        return Fed(step, arrays, info, time.perf_counter() - start)

    def _get(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("prefetch thread ended without producing the next batch") from None

    def close(self) -> None:
        """Stop the producer and wait for it; placed batches not yet taken are dropped."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        while not self._queue.empty():
            self._queue.get_nowait()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
