"""Host batching and the two feeders: same arrays, same shardings, different relay traffic."""

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from input_pipeline.batching import HostLoader
from input_pipeline.errors import DataError
from input_pipeline.feeding import DirectFeeder, RoutedFeeder, process_rows
from input_pipeline.synthetic import SyntheticSource
from meshpar.mesh import build_mesh


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
