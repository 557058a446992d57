"""Host batches from worker processes: the loader's batches in step order for every worker count,
a source's error and a dead worker named at their step, workers that ignore Ctrl-C and die with
their parent, a prompt close that leaves no shared memory behind. Real processes throughout."""

import gc
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import shared_memory

import numpy as np
import pytest

from input_pipeline import corpus
from input_pipeline.batching import HostLoader
from input_pipeline.errors import DataError
from input_pipeline.synthetic import SyntheticSource
from input_pipeline.text import TextSource, stdlib_dir
from input_pipeline.tokens import TokenSource
from input_pipeline.workers import WorkerBatches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD_MESSAGE = "some/file.bin: record 7 is truncated (expected 4096 bytes, found 17)"


class FailingSource(SyntheticSource):
    """Fails, as a corrupt file would, on every read that includes row `bad_row`."""

    def __init__(self, bad_row: int):
        super().__init__(600, 8, 4, seed=0)
        self.bad_row = bad_row

    def read(self, indices):
        if self.bad_row in indices:
            raise DataError(BAD_MESSAGE)
        return super().read(indices)


class SlowSource(SyntheticSource):
    """Takes `seconds` for every read from step `from_step` on (rows are in order: no shuffle)."""

    def __init__(self, from_step: int, seconds: float):
        super().__init__(600, 8, 4, seed=0)
        self.from_row, self.seconds = from_step * 10, seconds

    def read(self, indices):
        if indices.min() >= self.from_row:
            time.sleep(self.seconds)
        return super().read(indices)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _wait_gone(pids, timeout_s: float) -> float:
    start = time.perf_counter()
    while any(_alive(p) for p in pids):
        assert time.perf_counter() - start < timeout_s, f"workers {[p for p in pids if _alive(p)]} still alive"
        time.sleep(0.05)
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def token_corpus(tmp_path_factory):
    """A prepared corpus of one standard-library package under the 2k BPE (uint16 ids)."""
    out = tmp_path_factory.mktemp("tokens") / "corpus"
    bpe = os.path.join(ROOT, "experiments", "tokenizers", "stdlib-bpe-2k.json")
    corpus.prepare(bpe, [os.path.join(stdlib_dir(), "json")], str(out), workers=1, eval_fraction=0.0)
    return str(out)


def _sources(token_corpus: str):
    return {
        "synthetic": lambda: SyntheticSource(1000, 8, 4, seed=3),  # 31 batches of 32 per epoch
        "text": lambda: TextSource("train", length=16, max_bytes=12_000),  # 749 windows: 23 batches
        "tokens": lambda: TokenSource(token_corpus, "train", length=64),  # memory-mapped shards
    }


@pytest.mark.parametrize("name", ["synthetic", "text", "tokens"])
def test_every_worker_count_yields_the_loaders_batches_in_step_order(name, request):
    """A resume (start > 0) across an epoch boundary, shuffled, one process's rows of the global
    batch: 0, 1 and 2 workers give exactly ``loader.batch(step)``, step by step."""
    make = _sources(request.getfixturevalue("token_corpus") if name == "tokens" else "")[name]
    source = make()
    loader = HostLoader(source, 32, seed=11, rows=slice(8, 24), shuffle=True)
    reference = HostLoader(make(), 32, seed=11, rows=slice(8, 24), shuffle=True)  # never pickled or shared
    start = loader.batches_per_epoch - 4
    stop = start + 9
    expected = [(s, reference.batch(s)) for s in range(start, stop)]
    assert start // loader.batches_per_epoch + 1 == (stop - 1) // loader.batches_per_epoch  # crosses an epoch
    for workers in (0, 1, 2):
        with WorkerBatches(loader, start, stop, workers) as batches:
            got = []
            for step, batch in batches:
                got.append((step, {k: v.copy() for k, v in batch.items()}))
                assert all(type(v) is np.ndarray for v in batch.values())
                if workers and len(got) == 2:  # every worker has delivered: all are running
                    pids = batches.pids
                    assert len(set(pids)) == workers and os.getpid() not in pids
                    assert all(_alive(p) and _parent_of(p) == os.getpid() for p in pids)
            assert batches.pids == ([] if workers == 0 else pids)
        assert [s for s, _ in got] == list(range(start, stop)), workers
        for (step, batch), (_, want) in zip(got, expected):
            assert batch.keys() == want.keys()
            for k in want:
                assert batch[k].dtype == want[k].dtype and batch[k].shape == want[k].shape, (workers, step, k)
                np.testing.assert_array_equal(batch[k], want[k], err_msg=f"workers={workers} step={step} {k}")
        if workers:
            _wait_gone(pids, 5.0)  # joined by close


def test_a_source_error_in_a_worker_reaches_the_caller_unchanged_at_its_step():
    source = FailingSource(bad_row=7 * 32 + 5)  # unshuffled: row 229 is in step 7, worker 1's
    loader = HostLoader(source, 32, seed=0, shuffle=False)
    got = []
    batches = WorkerBatches(loader, 2, 15, workers=2)
    with pytest.raises(DataError) as raised:
        for step, batch in batches:
            np.testing.assert_array_equal(batch["inputs"], loader.batch(step)["inputs"])
            got.append(step)
    assert str(raised.value) == BAD_MESSAGE
    assert got == [2, 3, 4, 5, 6]
    pids = batches.pids
    assert all(pids)
    _wait_gone(pids, 5.0)  # an error closes the iterator
    assert next(batches, None) is None
    batches.close()  # again: harmless


def test_a_killed_worker_is_named_in_one_line_with_its_pid_signal_and_step():
    loader = HostLoader(SyntheticSource(1000, 8, 4, seed=0), 32, seed=0)
    start = 5
    got = []
    with WorkerBatches(loader, start, 10_000, workers=2) as batches:
        got.append(next(batches)[0])
        while None in batches.pids:
            time.sleep(0.02)
        victim = batches.pids[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(DataError) as raised:
            for step, _ in batches:
                got.append(step)
    message = str(raised.value)
    assert "\n" not in message
    match = re.fullmatch(rf"data worker 1 of 2 \(pid {victim}\) was killed by SIGKILL .* step (\d+)", message)
    assert match, message
    step = int(match.group(1))
    assert got == list(range(start, step)) and (step - start) % 2 == 1, (got, message)


CHILD = textwrap.dedent(
    """
    import sys, time
    from input_pipeline.batching import HostLoader
    from input_pipeline.synthetic import SyntheticSource
    from input_pipeline.workers import WorkerBatches

    loader = HostLoader(SyntheticSource(512, 8, 4, seed=0), 32, seed=0)
    batches = WorkerBatches(loader, 0, 10_000, workers=2)
    step, batch = next(batches)
    while None in batches.pids:  # both workers past their start-up (signals set)
        time.sleep(0.02)
    print(*batches.pids, flush=True)
    sys.stdin.readline()
    for _ in range(30):  # more than the workers hold ready: both must still be working
        step, batch = next(batches)
    print("read", step, flush=True)
    if sys.argv[1] == "wait":
        time.sleep(120)
    # else: exit holding a batch, the iterator never closed
    """
)


def test_workers_ignore_sigint_and_do_not_outlive_their_parent():
    env = {**os.environ, "PYTHONPATH": ROOT}
    children = {
        mode: subprocess.Popen(
            [sys.executable, "-c", CHILD, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for mode in ("wait", "exit")
    }
    try:
        pids = {mode: [int(p) for p in child.stdout.readline().split()] for mode, child in children.items()}
        assert all(len(p) == 2 for p in pids.values()), pids
        for mode, child in children.items():
            for pid in pids[mode]:
                os.kill(pid, signal.SIGINT)  # what Ctrl-C sends the whole process group
        time.sleep(0.3)
        for mode, child in children.items():
            assert all(_alive(p) for p in pids[mode])
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "read 30", child.stderr.read()
        children["wait"].kill()  # SIGKILL: no cleanup runs in the parent
        children["wait"].wait()
        _wait_gone(pids["wait"], 10.0)  # they watch their parent (every 0.25 s): not forever
        # Leaving without close(): the finalizer stops the workers and the interpreter exits.
        assert children["exit"].wait(timeout=20) == 0
        _wait_gone(pids["exit"], 5.0)
        stderr = children["exit"].stderr.read()
        assert "Traceback" not in stderr and "Exception ignored" not in stderr and "leaked" not in stderr, stderr
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()


def test_close_is_prompt_idempotent_and_leaves_no_shared_memory(monkeypatch):
    # Other processes on the host use /dev/shm too: segments carry the pipeline's own prefix, and
    # the semaphores of Grain's queues (made by this process) a tag of this test's.
    tag = f"wbtest{os.getpid()}x{time.monotonic_ns() % 10**6}"
    monkeypatch.setitem(multiprocessing.current_process()._config, "semprefix", f"/{tag}sem")

    loader = HostLoader(SyntheticSource(1000, 8, 4, seed=0), 32, seed=0)
    with WorkerBatches(loader, 0, 14, workers=2, buffer=3) as batches:
        prefix = batches.segment_prefix

        def ours() -> set[str]:
            return {name for name in os.listdir("/dev/shm") if name.startswith(prefix) or tag in name}

        for step, batch in batches:
            if step == 7:  # stop early, holding the last batch
                break
        pids = batches.pids
        kept = batch["inputs"].copy()
        deadline = time.perf_counter() + 10.0  # the workers reach the end of their steps
        in_use = ours()
        while not any(name.startswith(prefix) for name in in_use) and time.perf_counter() < deadline:
            time.sleep(0.05)
            in_use = ours()
        # What a worker killed while filling a segment leaves: a segment nobody will unlink.
        left = shared_memory.SharedMemory(f"{prefix}killed", create=True, size=4096)
        left.close()
        start = time.perf_counter()
    took = time.perf_counter() - start
    assert any(name.startswith(prefix) for name in in_use), in_use  # batches travel through /dev/shm
    assert any(name.startswith(f"sem.{tag}sem") for name in in_use), in_use
    # Prompt: not Grain's own 25 s wait for its workers (a bound wide enough for a loaded machine).
    assert took < 10.0, took
    _wait_gone(pids, 5.0)
    assert not os.path.exists(f"/dev/shm/{prefix}killed")  # close() sweeps its own prefix
    np.testing.assert_array_equal(batch["inputs"], kept)  # a batch handed out outlives close
    np.testing.assert_array_equal(batch["inputs"], loader.batch(7)["inputs"])
    batches.close()  # again: harmless
    assert next(batches, None) is None
    deadline = time.perf_counter() + 10.0  # Grain unlinks in a background thread
    while ours() and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert not ours()

    # Dropped without close(), and its workers stuck in a minute-long read: collecting the
    # iterator stops them, the stuck ones killed after the grace period.
    slow = HostLoader(SlowSource(from_step=3, seconds=60), 10, seed=0, shuffle=False)
    batches = WorkerBatches(slow, 0, 50, workers=2)
    assert [next(batches)[0] for _ in range(3)] == [0, 1, 2]
    pids = batches.pids
    start = time.perf_counter()
    del batches
    gc.collect()
    assert time.perf_counter() - start < 15.0  # the 2 s grace, then the kill: not the minute-long read
    _wait_gone(pids, 5.0)


def test_arguments_are_checked():
    loader = HostLoader(SyntheticSource(100, 8, 4, seed=0), 10, seed=0)
    for kwargs in (dict(workers=-1), dict(workers=1, buffer=0), dict(workers=1, start=5, stop=4)):
        args = dict(start=0, stop=10) | kwargs
        with pytest.raises(ValueError):
            WorkerBatches(loader, **args)
    with WorkerBatches(loader, 3, 3, workers=2) as empty:  # nothing to read: no worker started
        assert list(empty) == [] and empty.pids == []
