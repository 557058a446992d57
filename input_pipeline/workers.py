"""Host batches assembled in worker processes by Grain, handed over through shared memory:
:class:`WorkerBatches` yields ``(step, loader.batch(step))`` in step order, whatever the
worker count.

The spec (how steps are shared out, what workers cost, memory, faults, spawning) is in
docs/data.md, "Worker processes: the spec".
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import mmap
import multiprocessing
import multiprocessing.util
import os
import pickle
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from input_pipeline import grain_compat
from input_pipeline.errors import DataError

_PARENT_POLL_S = 0.25  # how often a worker checks that its parent is alive
_CLOSE_GRACE_S = 2.0  # how long close() lets Grain stop the workers before killing them
_KILLED_JOIN_S = 5.0  # after the kill: Grain notices a dead worker within its 1 s queue timeout
_UNLINK_WAIT_S = 2.0  # for Grain's background unlinking, after close()
_GRAIN_DEATH = "Worker process was terminated unexpectedly"  # Grain's message for a dead worker
_GRAIN_EXIT_CODE = re.compile(r"exit code (-?\d+)")
_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory segments


class _Assemble:
    """Batch `step` of `loader`, tagged with the step and the worker's pid, its arrays in shared
    memory segments named ``<segments><random hex>`` (runs in the worker)."""

    def __init__(self, loader, segments: str):
        self.loader, self.segments = loader, segments

    def __call__(self, step) -> tuple[int, int, dict[str, np.ndarray]]:
        step = int(step)
        try:
            batch = self.loader.batch(step)
        except Exception as e:
            # The exception crosses to the parent by pickle; one that cannot would be lost on the
            # way and leave the parent waiting for a batch that never comes.
            try:
                pickle.loads(pickle.dumps(e))
            except Exception:
                raise RuntimeError(f"{type(e).__name__}: {e}") from None
            raise
        return step, os.getpid(), {name: self._shared(array) for name, array in batch.items()}

    def _shared(self, array):
        """`array` copied into a segment of this pipeline's own name, which Grain then sends as is.

        Grain would name the segment itself (``psm_<hex>``, as anyone's): with the pipeline's
        prefix, close() can find and unlink what a killed worker leaves behind."""
        from grain.multiprocessing import SharedMemoryArray  # imported by Grain's worker already

        array = np.asarray(array)
        if array.dtype.hasobject or array.size == 0:  # what Grain itself sends by pickle
            return array
        shm = shared_memory.SharedMemory(f"{self.segments}{secrets.token_hex(8)}", create=True, size=array.nbytes)
        out = SharedMemoryArray.from_shared_memory(shm, array.shape, array.dtype)
        out[...] = array
        return out


class _WorkerInit:
    """Grain's ``worker_init_fn``: runs first in each worker."""

    def __init__(self, pid_dir: str, parent_pid: int):
        self.pid_dir, self.parent_pid = pid_dir, parent_pid

    def __call__(self, index: int, count: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        path = os.path.join(self.pid_dir, str(index))
        with open(f"{path}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{path}.tmp", path)  # the parent never reads half a pid
        # The parent could not clean up: the last worker out removes the pid folder. Shared memory
        # is unlinked by the parent's resource tracker once every worker is gone.
        exit_with_parent(self.parent_pid, before_exit=(lambda: os.remove(path), lambda: os.rmdir(self.pid_dir)))


def exit_with_parent(parent_pid: int, before_exit: Sequence[Callable[[], None]] = ()) -> None:
    """In a worker process: exit as soon as `parent_pid`, the process that started it, is gone,
    even after a SIGKILL that ran no clean-up there (a daemon thread polls the parent's pid: a
    dead parent's children are re-parented, to init or a subreaper). `before_exit` run first;
    an OSError in one is ignored. A parent-death signal (``prctl``) would not do: it fires when
    the *thread* that started the worker exits, and pools start workers from helper threads."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        for step in before_exit:
            try:
                step()
            except OSError:
                pass
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _detach(array) -> np.ndarray:
    """A plain ndarray over this process's own mapping of `array`'s shared memory segment.

    Grain's ``SharedMemoryArray`` unlinks its segment only in ``__del__``, which fails for a batch
    still alive at interpreter shutdown (the segment then outlives the process, until the resource
    tracker removes it with a warning). A second mapping (~20 us) lets Grain unlink the name as
    soon as this function returns; the memory itself is freed when the caller drops the batch.
    """
    shm = getattr(array, "shm", None)
    path = os.path.join(_SHM_DIR, shm.name.lstrip("/")) if shm is not None else None
    if path is None or not os.path.exists(path):  # not in shared memory, or not a Linux /dev/shm
        return np.asarray(array)
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, array.nbytes)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, array.dtype, count=array.size).reshape(array.shape)


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker, unless running, with its exit warning off.

    The tracker (a process of its own) unlinks the shared memory a killed worker left half
    written, and at exit says so on stderr ("resource_tracker: There appear to be 1 leaked
    shared_memory objects"): a second and third line after the one-line error that already
    names the lost worker. It takes its warning filters from ``sys.warnoptions`` when it
    starts, so the filter is there only for that moment.
    """
    quiet = "ignore:resource_tracker:UserWarning"
    added = quiet not in sys.warnoptions
    if added:
        sys.warnoptions.append(quiet)
    try:
        resource_tracker.ensure_running()
    finally:
        if added:
            sys.warnoptions.remove(quiet)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "died (exit status unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the out-of-memory killer's signal)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


class _Workers:
    """The Grain pipeline and its worker processes; closing it is idempotent."""

    def __init__(self, loader, start: int, stop: int, workers: int, buffer: int):
        import cloudpickle  # Grain's own way of sending the pipeline to its workers
        import grain  # only callers that use workers pay for importing Grain
        from absl import flags

        # Grain reads absl flags (e.g. --grain_enable_multiprocess_worker_profiling) and refuses
        # unparsed ones; a program without absl's app.run never parses them.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        _start_resource_tracker()
        try:  # here, in one line, rather than from a helper thread at the first batch
            cloudpickle.dumps(loader)
        except Exception as e:
            raise TypeError(f"worker processes need a picklable loader and source: {type(e).__name__}: {e}") from None
        self.count = workers
        self.pid_dir = tempfile.mkdtemp(prefix="input-pipeline-workers-")
        # This pipeline's shared memory segments: the pid folder's unique name, not Grain's
        # ``psm_`` that every pool on the host shares.
        self.segments = f"{os.path.basename(self.pid_dir)}-"
        dataset = (
            grain.MapDataset.range(start, stop)
            .map(_Assemble(loader, self.segments))
            # One batch at a time in each worker: Grain's default (16 threads, 500 elements
            # ahead) would hold hundreds of batches per worker and fight over its GIL.
            .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
            .mp_prefetch(
                grain.multiprocessing.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=buffer),
                worker_init_fn=_WorkerInit(self.pid_dir, os.getpid()),
            )
        )
        self.iterator = iter(dataset)
        self.pids: list[int | None] = [None] * workers  # as the pid files say, once read
        self.closing = False  # set first thing in close(), from whichever thread
        _OPEN.add(self)

    def pid(self, index: int) -> int | None:
        if self.pids[index] is None:
            try:
                with open(os.path.join(self.pid_dir, str(index))) as f:
                    self.pids[index] = int(f.read())
            except (OSError, ValueError):
                return None
        return self.pids[index]

    def _kill(self) -> None:
        """SIGKILL this pipeline's workers that are still running."""
        ours = {p.pid for p in multiprocessing.active_children()}  # unreaped: pids not reused
        for pid in self.pids:
            if pid in ours:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self.closing = True
        iterator, self.iterator = self.iterator, None
        _OPEN.discard(self)
        if iterator is None:
            return
        for i in range(self.count):
            self.pid(i)  # read before the folder goes, for killing stragglers
        # Grain's close joins each worker only after it finishes the batch in hand, however long
        # that takes: it gets a grace period, then the workers still alive are killed.
        closer = threading.Thread(target=iterator.close, name="worker-batches-close", daemon=True)
        try:
            closer.start()
        except RuntimeError:  # interpreter shutdown: Python 3.12 starts no thread in exit hooks
            self._kill()  # no grace period to wait on: then Grain's close finds them gone
            iterator.close()
        else:
            closer.join(_CLOSE_GRACE_S)
            if closer.is_alive():
                self._kill()
                closer.join(_KILLED_JOIN_S)
        del iterator
        # Grain's prefetch threads end on an exception whose traceback keeps the last batch of
        # each worker (and its shared memory) alive in a reference cycle: collect it now.
        gc.collect()
        # A process that exits right after close() would otherwise leave the segments Grain is
        # still unlinking to its resource tracker ("leaked shared_memory objects" warnings).
        grain_compat.wait_for_unlinks(_UNLINK_WAIT_S)
        self._unlink_left_segments()
        shutil.rmtree(self.pid_dir, ignore_errors=True)

    def _unlink_left_segments(self) -> None:
        """Unlink this pipeline's segments that nobody will: the one a killed worker was filling,
        batches still queued when it died (they would stay in /dev/shm until this process exits
        and its resource tracker removes them)."""
        try:
            names = [name for name in os.listdir(_SHM_DIR) if name.startswith(self.segments)]
        except OSError:  # no /dev/shm: not Linux
            return
        for name in names:
            # Attached, then unlinked: the attach registers the name with this process's resource
            # tracker and the unlink unregisters it, a pair. A bare unregister would be one too
            # many for a batch a worker queued that this process never attached (the tracker
            # prints a KeyError traceback), and only one unlink of a name succeeds, so Grain's
            # unlinking thread and this one never both unregister it.
            try:
                segment = shared_memory.SharedMemory(name)
            except FileNotFoundError:  # Grain's unlinking got there first
                continue
            except ValueError:  # empty: a worker killed between creating the segment and sizing it,
                # before it registered the name (it registers once mapped), so nothing to unregister
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(_SHM_DIR, name))
                continue
            segment.close()
            try:
                segment.unlink()
            except FileNotFoundError:  # Grain's, between the attach and here: it unregistered the name
                continue


_OPEN: set[_Workers] = set()


@atexit.register  # after multiprocessing's own exit hook is registered (imported above): runs before it
def _close_open_pools() -> None:
    """At exit, close what the caller left open, with close()'s grace period: multiprocessing's exit
    hook would otherwise wait for Grain's, which gives a worker stuck in a read 25 s before its kill."""
    for pool in list(_OPEN):
        pool.close()


class WorkerBatches:
    """Iterate ``(step, loader.batch(step))`` for ``step`` in ``[start, stop)``, in order.

    ``workers == 0``: read in this process. ``workers >= 1``: read by that many spawned worker
    processes (Grain), started by the first ``next()``, each keeping up to ``buffer`` batches
    ready. Use as a context manager or call :meth:`close`; after an error the iterator is closed
    and raises StopIteration. One thread iterates; ``close()`` may come from another, and a
    ``next()`` it interrupts ends with StopIteration.
    """

    def __init__(self, loader, start: int, stop: int, workers: int, buffer: int = 2):
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if buffer < 1:
            raise ValueError(f"buffer must be >= 1, got {buffer}")
        if not 0 <= start <= stop:
            raise ValueError(f"steps must satisfy 0 <= start <= stop, got start={start} stop={stop}")
        self.loader, self.start, self.stop, self.workers, self.buffer = loader, start, stop, workers, buffer
        self._next = start
        self._closed = False
        self._pool: _Workers | None = None
        self._finalizer = None
        if workers > 0 and stop > start:
            self._pool = _Workers(loader, start, stop, workers, buffer)
            # An iterator dropped without close() still stops its workers (at collection or exit).
            self._finalizer = weakref.finalize(self, self._pool.close)

    @property
    def segment_prefix(self) -> str | None:
        """How the names of this iterator's shared memory segments begin (None without workers)."""
        return None if self._pool is None else self._pool.segments

    @property
    def pids(self) -> list[int | None]:
        """Each worker's pid, by worker index (None until it has started); [] without workers."""
        if self._pool is None:
            return []
        return [self._pool.pid(i) for i in range(self.workers)]

    def __iter__(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        return self

    def __next__(self) -> tuple[int, dict[str, np.ndarray]]:
        if self._closed or self._next >= self.stop:
            raise StopIteration
        step = self._next
        if self._pool is None:
            batch = self.loader.batch(step)
        else:
            try:
                batch = self._take(step)
            except BaseException:
                self.close()
                raise
        self._next = step + 1
        return step, batch

    def _take(self, step: int) -> dict[str, np.ndarray]:
        pool = self._pool
        index = (step - self.start) % self.workers  # Grain's round-robin
        died = None
        try:
            got, pid, batch = next(pool.iterator)
        except Exception as e:
            if pool.closing:  # closed from another thread (or at exit) while this one waited
                raise StopIteration from None
            if isinstance(e, StopIteration):
                raise RuntimeError(f"workers ended before step {step} (stop={self.stop})") from None
            died = self._death(e, index, step)
            if died is None:
                raise  # the source's own error, from the worker: type and message unchanged
        if died is not None:
            raise died  # outside the handler: no __context__ keeping Grain's iterators alive
        expected_pid = pool.pid(index)
        if got != step or (expected_pid is not None and pid != expected_pid):
            raise RuntimeError(
                f"worker batches out of order: expected step {step} from worker {index} (pid {expected_pid}), "
                f"got step {got} from pid {pid}"
            )
        return {name: _detach(array) for name, array in batch.items()}

    def _death(self, error: Exception, index: int, step: int) -> DataError | None:
        """Grain's error for a dead worker, as a DataError naming it; None for any other error."""
        match = _GRAIN_EXIT_CODE.search(str(error))
        if not isinstance(error, RuntimeError) or match is None or not str(error).startswith(_GRAIN_DEATH):
            return None
        pid = self._pool.pid(index)
        return DataError(
            f"data worker {index} of {self.workers} (pid {pid if pid is not None else 'unknown'}) "
            f"{_describe_exit(int(match.group(1)))} while assembling step {step}"
        )

    def close(self) -> None:
        """Stop and join every worker; batches already handed out stay valid. Idempotent."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "WorkerBatches":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
