"""Host batching and the two feeders: same arrays, same shardings, different relay traffic;
what actually moves (device-to-device copies, the relay's staging copy) and the exact
per-device input memory it costs."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from input_pipeline.batching import HostLoader
from input_pipeline.errors import DataError
from input_pipeline.feeding import DirectFeeder, LiveBytes, RoutedFeeder, process_rows
from input_pipeline.synthetic import SyntheticSource
from meshpar.sharding.mesh import build_mesh


def _batch(rows=64):
    rng = np.random.default_rng(0)
    return {"inputs": rng.standard_normal((rows, 12), np.float32), "targets": rng.integers(0, 10, rows, dtype=np.int32)}


@pytest.mark.parametrize(
    "mesh_spec, spec",
    [("data:8", P("data")), ("data:4,model:2", P("data")), ("data:2,model:4", P("model")), ("data:8", P())],
)
def test_direct_and_routed_give_equal_arrays_and_shardings(mesh_spec, spec):
    mesh = build_mesh(mesh_spec)
    batch = _batch()
    shardings = {"inputs": NamedSharding(mesh, P(*spec, None)), "targets": NamedSharding(mesh, spec)}
    direct, _ = DirectFeeder(shardings, 64).place(batch)
    routed, _ = RoutedFeeder(shardings, 64).place(batch)
    for key, rows in batch.items():
        assert direct[key].sharding == routed[key].sharding == shardings[key]
        np.testing.assert_array_equal(np.asarray(direct[key]), rows)
        np.testing.assert_array_equal(np.asarray(routed[key]), rows)
        for a, b in zip(direct[key].addressable_shards, routed[key].addressable_shards):
            assert a.device == b.device and a.index == b.index
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


@pytest.mark.parametrize("data", [2, 4, 8])
def test_relay_receives_whole_batch_only_when_routed(data):
    mesh = build_mesh(f"data:{data}")
    shardings = {"inputs": NamedSharding(mesh, P("data", None)), "targets": NamedSharding(mesh, P("data"))}
    batch = _batch()
    total = sum(v.nbytes for v in batch.values())
    direct, routed = DirectFeeder(shardings, 64), RoutedFeeder(shardings, 64)
    _, direct_info = direct.place(batch)
    _, routed_info = routed.place(batch)
    assert routed_info.relay_bytes == total == routed_info.total_bytes
    assert direct_info.relay_bytes * data == total
    assert direct.relay == routed.relay == mesh.devices.flat[0]


def _one_field(data, rows=64):
    mesh = build_mesh(f"data:{data}")
    return {"inputs": NamedSharding(mesh, P("data", None))}, {"inputs": _batch(rows)["inputs"]}


@pytest.mark.parametrize("data", [2, 8])
def test_routed_moves_device_to_device_and_direct_does_not(data):
    # What moves, not a byte formula: with device-to-device copies refused, direct (host →
    # each device) still places, routed (host → relay → each device) cannot.
    mesh = build_mesh(f"data:{data}")
    shardings = {"inputs": NamedSharding(mesh, P("data", None)), "targets": NamedSharding(mesh, P("data"))}
    batch = _batch()
    with jax.transfer_guard_device_to_device("disallow_explicit"):
        direct, _ = DirectFeeder(shardings, 64).place(batch)
        np.testing.assert_array_equal(np.asarray(direct["inputs"]), batch["inputs"])
        with pytest.raises(Exception, match="Disallowed device-to-device transfer"):
            RoutedFeeder(shardings, 64).place(batch)
    # And the relay really holds the whole (process) batch, in one array, on itself.
    routed = RoutedFeeder(shardings, 64)
    placed, _ = routed.place(batch)
    for key, rows in batch.items():
        staged = routed.staging[key]
        assert staged.devices() == {routed.relay} and staged.shape == rows.shape
        np.testing.assert_array_equal(np.asarray(staged), rows)
        np.testing.assert_array_equal(np.asarray(placed[key]), rows)


def test_routed_gives_direct_s_shards_and_its_relay_keeps_the_whole_batch():
    # Same values, shards and devices as direct; the relay holds the whole batch (staging) plus
    # its own slice, every other device its slice only; and every slice left the relay.
    mesh = build_mesh("data:4,model:2")
    shardings = {"inputs": NamedSharding(mesh, P("data", None)), "targets": NamedSharding(mesh, P("data"))}
    batch = _batch()
    direct, _ = DirectFeeder(shardings, 64).place(batch)
    routed = RoutedFeeder(shardings, 64)
    placed, _ = routed.place(batch)
    for key in batch:
        assert placed[key].sharding == direct[key].sharding
        for a, b in zip(placed[key].addressable_shards, direct[key].addressable_shards):
            assert a.device == b.device and a.index == b.index
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    total = sum(v.nbytes for v in batch.values())
    assert routed.live_bytes() == {0: total + total // 4, **{i: total // 4 for i in range(1, 8)}}
    with (
        jax.transfer_guard_device_to_device("disallow_explicit"),
        pytest.raises(Exception, match="Disallowed device-to-device"),
    ):
        routed.place(batch)


@pytest.mark.parametrize("data", [2, 4, 8])
def test_relay_peak_covers_the_whole_batch_only_when_routed(data):
    shardings, batch = _one_field(data)
    total, relay = batch["inputs"].nbytes, 0
    direct, routed = DirectFeeder(shardings, 64), RoutedFeeder(shardings, 64)
    direct.place(batch)
    routed.place(batch)
    d_peak, r_peak = ({int(k): v for k, v in f.memory_report()["peak_input_bytes"].items()} for f in (direct, routed))
    assert d_peak == {i: total // data for i in range(data)}  # no device above its own slice
    # Routed: the relay held the staging copy and every device's slice before they were copied
    # out (twice the batch); every other device only ever held its own slice.
    assert r_peak == {i: 2 * total if i == relay else total // data for i in range(data)}
    assert routed.memory_report()["source"] == "live_buffers"
    assert "memory_stats_peak_bytes_in_use" not in routed.memory_report()  # CPU reports none


def test_peak_is_kept_through_releases_and_counts_every_live_batch():
    # Updated at each placement and release, not sampled: three batches alive at once leave
    # a peak of three slices per device after all are dropped and a fourth is placed.
    shardings, batch = _one_field(8)
    slice_bytes = batch["inputs"].nbytes // 8
    feeder = DirectFeeder(shardings, 64)
    held = [feeder.place(batch)[0] for _ in range(3)]
    assert feeder.live_bytes() == {i: 3 * slice_bytes for i in range(8)}
    del held
    assert feeder.live_bytes() == {}
    kept, _ = feeder.place(batch)
    assert feeder.live_bytes() == {i: slice_bytes for i in range(8)}
    assert feeder.memory_report()["peak_input_bytes"] == {str(i): 3 * slice_bytes for i in range(8)}


def test_shared_buffers_count_once_until_their_last_array_goes():
    # The routed relay's own slice is first a temporary, then a shard of the placed batch: one
    # buffer under two arrays, counted once, uncounted only when both are gone.
    shardings, batch = _one_field(4)
    routed = RoutedFeeder(shardings, 64)
    placed, _ = routed.place(batch)
    total, relay = batch["inputs"].nbytes, routed.relay.id
    assert routed.live_bytes() == {relay: total + total // 4, 1: total // 4, 2: total // 4, 3: total // 4}
    ledger = LiveBytes(jax.devices()[:1])
    first = jax.device_put(batch["inputs"], jax.devices()[0])
    second = jax.device_put(first, jax.devices()[0])  # same device: no copy, the same buffer
    ledger.add(second, shared=ledger.add(first))
    assert ledger.live() == {0: total}
    del first
    assert ledger.live() == {0: total}
    del second
    assert ledger.live() == {} and ledger.peak() == {0: total}


def test_process_rows_single_process_is_the_whole_batch():
    mesh = build_mesh("data:4,model:2")
    assert process_rows(NamedSharding(mesh, P("data")), (32,)) == slice(0, 32)


def test_loader_is_a_pure_function_of_seed_and_step():
    source = SyntheticSource(100, 6, 3, seed=1)
    a, b = HostLoader(source, 16, seed=5), HostLoader(source, 16, seed=5)
    steps = [0, 3, 7, 2, 6, 0]  # out of order, across the epoch boundary (6 batches per epoch)
    for s in steps:
        np.testing.assert_array_equal(a.batch(s)["inputs"], b.batch(s)["inputs"])
    assert not np.array_equal(a.indices(0), HostLoader(source, 16, seed=6).indices(0))
    epoch0 = np.concatenate([a.indices(s) for s in range(6)])
    assert len(set(epoch0)) == 96  # no row twice within an epoch
    assert not np.array_equal(a.indices(0), a.indices(6))  # a new order each epoch


def test_loader_reads_only_its_rows():
    source = SyntheticSource(64, 4, 3, seed=0)
    full, part = HostLoader(source, 16, seed=0), HostLoader(source, 16, seed=0, rows=slice(4, 12))
    np.testing.assert_array_equal(part.batch(2)["targets"], full.batch(2)["targets"][4:12])


def test_loader_rejects_a_split_smaller_than_a_batch():
    with pytest.raises(DataError, match="8 examples, fewer than one batch of 16"):
        HostLoader(SyntheticSource(8, 4, 3, seed=0), 16, seed=0)


def test_synthetic_task_is_seeded_and_splits_differ():
    a, b = SyntheticSource(50, 5, 4, seed=3), SyntheticSource(50, 5, 4, seed=3)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    assert not np.array_equal(a.inputs, SyntheticSource(50, 5, 4, seed=3, split="eval").inputs)
    assert len(np.unique(a.targets)) > 1  # the teacher uses more than one class
