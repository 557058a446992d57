"""Every program a run executes has its own peak in the plan (meshpar.plan.programs)."""

import math

import jax
import numpy as np
import pytest

from input_pipeline.feeding import RoutedFeeder
from meshpar.configuration import config
from meshpar.plan import programs
from meshpar.plan import report as report_lib
from meshpar.step import parts
from meshpar.step import programs as step_programs

TINY = [
    "model.d_model=32", "model.n_heads=2", "model.d_head=16", "model.d_ff=64", "model.max_length=16",
    "data.length=16", "data.max_bytes=200000", "train.batch_size=16",
]  # fmt: skip


def _per_device(tree) -> int:
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def test_eval_and_digest_programs_are_planned_with_their_own_arguments(tmp_path):
    cfg = config.load(
        "experiments/transformer_fsdp.yaml",
        [*TINY, "train.eval_every=5", "checkpoint.every=5", "feed.prefetch=2", f"workdir={tmp_path}"],
    )
    step = parts.abstract_step(cfg)
    report = report_lib.plan(step, step_programs.compile_all(step))
    state, batch, _ = step.args
    peaks = {p.program: p for p in report.programs}
    assert list(peaks) == ["train step", "eval step", "checkpoint digest"]
    # The eval step is given the parameters (FSDP shards) and one batch; the digest, the whole state.
    assert peaks["eval step"].xla["argument_bytes"] == _per_device(state.params) + _per_device(batch)
    assert peaks["checkpoint digest"].xla["argument_bytes"] == _per_device(state)
    # Beside the eval step the rest of the state stays resident, and two prefetched batches.
    assert peaks["eval step"].resident["optimizer state, step, rng"] == _per_device(state) - _per_device(state.params)
    assert peaks["eval step"].resident["prefetched batches"] == 2 * _per_device(batch)
    assert peaks["train step"].resident["batch of the step in flight"] == _per_device(batch)
    assert report.needed_bytes >= max(p.bytes for p in report.programs)
    assert not tmp_path.joinpath("checkpoints").exists()  # planning saves nothing


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.eval_every=0", "checkpoint.every=0", "train.sync_every_step=true"], ["train step"]),
        (["train.eval_every=0", "checkpoint.every=10", "feed.mode=routed"], ["train step", "checkpoint digest"]),
    ],
)
def test_only_the_programs_the_run_executes_are_planned(tmp_path, overrides, expected):
    cfg = config.load("experiments/quickstart.yaml", [*TINY, *overrides, f"workdir={tmp_path}"])
    step = parts.abstract_step(cfg)
    peaks = programs.peaks(step, step_programs.compile_all(step))
    assert [p.program for p in peaks] == expected
    train = peaks[0].resident
    if cfg.feed.mode == "routed":  # what the real routed feeder holds on its relay beyond its own slice
        batch = step.args[1]
        feeder = RoutedFeeder({k: b.sharding for k, b in batch.items()}, cfg.train.batch_size)
        feeder.place({k: np.zeros(b.shape, b.dtype) for k, b in batch.items()})
        peak = feeder.memory_report()["peak_input_bytes"][str(feeder.relay.id)]
        assert train["relay copy of the process batch"] == peak - _per_device(batch) > 0
    else:
        assert "batch of the step in flight" not in train  # the loop waits for every step
