"""Device prefetch: same batches for every depth, errors surface, no thread left behind;
host-buffer reuse never overwrites a buffer a placed batch aliases; memory accounting."""

import dataclasses
import threading
import time
import weakref

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from input_pipeline.batching import HostLoader
from input_pipeline.feeding import FEEDERS, DirectFeeder, RoutedFeeder
from input_pipeline.prefetch import Prefetcher
from input_pipeline.synthetic import SyntheticSource
from meshpar import train
from meshpar.configuration import config
from meshpar.run.metrics import read_jsonl
from meshpar.sharding.mesh import build_mesh


def _threads():
    return {t for t in threading.enumerate() if t.name == "meshpar-prefetch"}


def _setup(mesh_spec="data:8", reuse=False, rows=64):
    mesh = build_mesh(mesh_spec)
    source = SyntheticSource(1024, 16, 4, seed=0)
    shardings = {"inputs": NamedSharding(mesh, P("data", None)), "targets": NamedSharding(mesh, P("data"))}
    return HostLoader(source, rows, seed=0, reuse_buffers=reuse), shardings


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_every_depth_yields_the_same_batches_in_order(depth):
    loader, shardings = _setup()
    feeder = DirectFeeder(shardings, 64)
    got = []
    with Prefetcher(lambda s: feeder.place(loader.batch(s)), 3, 13, depth) as batches:
        for fed in batches:
            got.append((fed.step, np.asarray(fed.arrays["inputs"])))
            del fed  # as the train loop does: depth 0 places the next batch only after this one is gone
    assert [s for s, _ in got] == list(range(3, 13))
    for step, inputs in got:
        np.testing.assert_array_equal(inputs, loader.batch(step)["inputs"])
    assert not _threads()


@pytest.mark.parametrize("depth", [0, 2])
def test_producer_error_reaches_the_consumer_at_its_batch(depth):
    def produce(step):
        if step == 4:
            raise OSError("disk went away at step 4")
        return step, None

    seen = []
    with pytest.raises(OSError, match="disk went away at step 4"):
        with Prefetcher(produce, 0, 10, depth) as batches:
            for fed in batches:
                seen.append(fed.arrays)
                del fed
    assert seen == [0, 1, 2, 3]
    assert not _threads()


def test_close_while_producer_is_blocked_waiting_for_a_slot_joins_it():
    batches = Prefetcher(lambda s: (s, None), 0, 1000, depth=2)
    assert next(batches).step == 0
    time.sleep(0.2)  # the producer takes every slot and waits for one to free
    assert _threads()
    batches.close()
    assert not _threads()
    with pytest.raises(StopIteration):
        next(batches)


def test_stall_time_is_measured():
    def slow(step):
        time.sleep(0.05)
        return step, None

    waits = []
    with Prefetcher(slow, 0, 3, depth=0) as batches:
        for fed in batches:
            waits.append(fed.wait_s)
            del fed
    assert min(waits) >= 0.05


def _iterate_like_the_loop(depth, mode, steps=6):
    """Iterate `steps` batches at `depth`, dropping each after use as the train loop does.
    Returns the most placed batches alive at once (counted with weak references at every
    placement, the one in use included), the feeder, and the steps in the order received."""
    loader, shardings = _setup()
    feeder = FEEDERS[mode](shardings, 64)
    lock, alive, most, placed, order = threading.Lock(), [], [0], [0], []

    def produce(step):
        arrays, info = feeder.place(loader.batch(step))
        with lock:
            alive.append(weakref.ref(arrays["inputs"]))
            most[0] = max(most[0], sum(r() is not None for r in alive))
            placed[0] += 1
        return arrays, info

    with Prefetcher(produce, 0, steps, depth) as batches:
        for fed in batches:
            # Hold the batch until the producer is `depth` ahead (or done), then a moment more,
            # so that a producer that places one batch too many gets the chance to.
            deadline = time.monotonic() + 10
            while placed[0] < min(fed.step + 1 + depth, steps) and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.01)
            np.testing.assert_array_equal(np.asarray(fed.arrays["inputs"]), loader.batch(fed.step)["inputs"])
            order.append(fed.step)
            del fed
    return most[0], feeder, order


@pytest.mark.parametrize("depth, mode", [(0, "direct"), (1, "direct"), (2, "direct"), (1, "routed")])
def test_prefetch_k_keeps_at_most_k_plus_one_placed_batches_alive(depth, mode):
    most, feeder, order = _iterate_like_the_loop(depth, mode)
    assert order == list(range(6))
    assert most == depth + 1  # reached (it does prefetch k ahead) and never exceeded
    # The feeder's own accounting agrees: every device's peak is k+1 of its slices, no more.
    batch = sum(v.nbytes for v in _setup()[0].batch(0).values())
    peaks = {int(k): v for k, v in feeder.memory_report()["peak_input_bytes"].items()}
    others = {d: v for d, v in peaks.items() if mode == "direct" or d != feeder.relay.id}
    assert others == {d: (depth + 1) * batch // 8 for d in others}
    assert peaks[feeder.relay.id] >= (batch if mode == "routed" else 0)
    # Every batch is released once dropped; routed keeps only the last batch's staging copy.
    assert feeder.live_bytes() == ({feeder.relay.id: batch} if mode == "routed" else {})


@pytest.mark.parametrize("depth", [0, 1])
def test_a_caller_holding_every_live_batch_gets_an_error_not_a_deadlock(depth):
    loader, shardings = _setup()
    feeder = DirectFeeder(shardings, 64)
    with Prefetcher(lambda s: feeder.place(loader.batch(s)), 0, 10, depth) as batches:
        held = [next(batches) for _ in range(depth + 1)]
        with pytest.raises(RuntimeError, match=f"prefetch depth {depth} allows {depth + 1} placed batch"):
            next(batches)
        del held  # released: iteration goes on where it stopped
        assert next(batches).step == depth + 1
    assert not _threads()


def _place_and_recycle(loader, feeder, step, check_aliasing=True):
    host = loader.batch(step)
    arrays, info = feeder.place(host)
    loader.recycle(host, info.aliased if check_aliasing else False)
    return arrays, info


def test_reused_host_buffers_never_overwrite_an_aliased_placed_batch():
    loader, shardings = _setup(reuse=True)
    feeder = DirectFeeder(shardings, 64)
    placed = [_place_and_recycle(loader, feeder, s) for s in range(6)]
    assert placed[0][1].aliased, "aligned buffers are aliased on CPU: the hazard this guards against is real"
    for step, (arrays, _) in enumerate(placed):  # every batch still holds its own rows
        np.testing.assert_array_equal(np.asarray(arrays["inputs"]), loader.source.read(loader.indices(step))["inputs"])
    assert loader.allocated == 6  # no aliased buffer went back to the pool


def test_recycling_an_aliased_buffer_would_corrupt_the_placed_batch():
    # The control for the test above: ignore aliasing and an earlier placed batch changes.
    loader, shardings = _setup(reuse=True)
    feeder = DirectFeeder(shardings, 64)
    first, _ = _place_and_recycle(loader, feeder, 0, check_aliasing=False)
    _place_and_recycle(loader, feeder, 1, check_aliasing=False)
    assert loader.allocated == 1
    assert not np.array_equal(np.asarray(first["inputs"]), loader.source.read(loader.indices(0))["inputs"])


def test_buffers_are_reused_when_placement_copies():
    loader, shardings = _setup("data:8", reuse=True)
    feeder = RoutedFeeder(shardings, 64)  # routed slices on the relay: placed shards are copies
    placed = [_place_and_recycle(loader, feeder, s) for s in range(5)]
    assert not any(info.aliased for _, info in placed)
    assert loader.allocated == 1
    for step, (arrays, _) in enumerate(placed):
        np.testing.assert_array_equal(
            np.asarray(arrays["targets"]), loader.source.read(loader.indices(step))["targets"]
        )


@pytest.mark.parametrize("data", [2, 4, 8])
def test_live_buffer_accounting_of_relay_and_other_devices(data):
    loader, shardings = _setup(f"data:{data}")
    direct, routed = DirectFeeder(shardings, 64), RoutedFeeder(shardings, 64)
    d_arrays, d_info = direct.place(loader.batch(0))
    r_arrays, r_info = routed.place(loader.batch(0))
    batch = d_info.total_bytes
    relay = direct.relay.id
    assert direct.live_bytes() == {i: batch // data for i in range(data)}  # 1/N of the batch everywhere
    assert routed.live_bytes()[relay] == batch + batch // data  # the staged whole batch + its own slice
    assert all(routed.live_bytes()[i] == batch // data for i in range(data) if i != relay)
    assert r_info.relay_bytes == data * d_info.relay_bytes  # what the host sent to the relay: N times more
    del d_arrays
    assert direct.live_bytes() == {}  # dropped batches no longer count


def _quick(**over):
    raw = {
        "mesh": "data:4,model:2",
        "layout": "batch:data; hidden:model",
        "model": {"name": "mlp", "hidden": [32]},
        "data": {"num_examples": 1024, "num_eval_examples": 0, "num_features": 16},
        "train": {"steps": 12, "batch_size": 32, "log_every": 1, "progress": False},
    }
    raw.update(over)
    return config.from_dict(raw)


def test_losses_are_bit_identical_across_modes_and_depths(tmp_path):
    results = {}
    for mode in ("direct", "routed"):
        for depth in (0, 1, 3):
            cfg = dataclasses.replace(
                _quick(feed={"mode": mode, "prefetch": depth}), workdir=str(tmp_path / f"{mode}{depth}")
            )
            summary = train.run(cfg)
            results[mode, depth] = [r["loss"] for r in read_jsonl(tmp_path / f"{mode}{depth}" / "metrics.jsonl")]
            assert 0 <= summary["stall_fraction"] < 1
    assert len(set(map(tuple, results.values()))) == 1, results
    assert not _threads()
