"""The train loop fetches results a step late: same bits as waiting for every step, syncs
exactly at save, eval, stop and last steps, stops every process at one saved step, names the
first non-finite step; profiling traces exactly the steps asked for; the compile cache."""

import dataclasses
import gzip
import json
import os
import signal
import struct
import threading

import jax
import numpy as np
import pytest

from meshpar.backend import compile_cache
from meshpar.configuration import config, errors
from meshpar.processes import stop
from meshpar.run import experiment, loop
from meshpar.run.metrics import read_jsonl

STEPS, EVAL_EVERY, SAVE_EVERY = 12, 5, 4


def _cfg(workdir, sync: bool, train=(), checkpoint=None, **top):
    raw = {
        "mesh": "data:4,model:2",
        "layout": "batch:data; hidden:model",
        "model": {"name": "mlp", "hidden": [64, 32]},
        "data": {"num_examples": 1024, "num_eval_examples": 64, "num_features": 48},
        "train": {
            "steps": STEPS,
            "batch_size": 32,
            "log_every": 1,
            "eval_batches": 1,
            "progress": False,
            "sync_every_step": sync,
            **dict(train),
        },
        "workdir": str(workdir),
        **top,
    }
    if checkpoint:
        raw["checkpoint"] = checkpoint
    return config.from_dict(raw)


def _record_dispatches(exp, on_dispatch):
    """Wrap the experiment's step: `on_dispatch(step)` runs just before step `step` (1-based) is dispatched."""
    step_fn, dispatched = exp.train_step, [int(exp.state.step)]

    def wrapped(state, batch, flags):
        dispatched[0] += 1
        on_dispatch(dispatched[0])
        return step_fn(state, batch, flags)

    exp.train_step = wrapped


_TIMING = ("time", "_per_s", "tflops", "mfu")


def _values(row):
    return {k: v for k, v in row.items() if not any(t in k for t in _TIMING)}


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _tensorboard(workdir):
    """{step: {tag: value}} from the run's TensorBoard event files (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for path in sorted((workdir / "tb").glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 16 + length
            for value in event.summary.value:
                out.setdefault(event.step, {})[value.tag] = value.simple_value
    return out


def test_lagged_loop_is_bit_identical_to_waiting_for_every_step_and_syncs_only_where_needed(tmp_path):
    runs = {}
    for sync in (True, False):
        workdir = tmp_path / ("sync" if sync else "lagged")
        exp = experiment.build(_cfg(workdir, sync, {"eval_every": EVAL_EVERY}, {"every": SAVE_EVERY}))
        rows_at_dispatch = {}
        _record_dispatches(
            exp, lambda s, w=workdir, r=rows_at_dispatch: r.__setitem__(s, len(read_jsonl(w / "metrics.jsonl")))
        )
        summary = loop.train(exp)
        runs[sync] = exp, summary, read_jsonl(workdir / "metrics.jsonl"), rows_at_dispatch
    (sync_exp, sync_summary, sync_rows, sync_seen), (exp, summary, rows, seen) = runs[True], runs[False]
    # Same rows (every value but the clocks), same final state, same checkpoints, same eval.
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [_values(r) for r in rows] == [_values(r) for r in sync_rows]
    assert "eval_loss" in rows[EVAL_EVERY - 1] and "accuracy" in rows[0]
    for a, b in zip(_leaves(exp.state), _leaves(sync_exp.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert exp.checkpointer.steps() == sync_exp.checkpointer.steps() == [4, 8, 12]
    # TensorBoard gets every row's numbers (one event per row), as float32.
    events = _tensorboard(tmp_path / "lagged")
    assert sorted(events) == [r["step"] for r in rows]
    for row in rows:
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        assert events[row["step"]] == {k: float(np.float32(v)) for k, v in numbers.items()}
    assert summary["final_eval_loss"] == sync_summary["final_eval_loss"]
    # Waiting for every step: step n's row is written before step n+1 is dispatched. Lagged:
    # step n+1 is dispatched before step n's results are fetched, except after a step whose
    # state was needed (saves at 4, 8, evals at 5, 10).
    assert sync_seen == {s: s - 1 for s in range(1, STEPS + 1)}
    synced = {4, 5, 8, 10}
    assert seen == {s: s - 1 if s == 1 or s - 1 in synced else s - 2 for s in range(1, STEPS + 1)}
    # The two clocks keep their meaning: step times lie inside the wall time of their window.
    for row in rows:
        assert row["wall_time_per_step_s"] >= row["step_time_s"] > 0
    assert summary["wall_time_per_step_s"] >= summary["mean_step_time_s"] > 0


@pytest.mark.parametrize("sync", [False, True], ids=["lagged", "sync"])
def test_a_stop_read_a_step_late_stops_at_the_next_step_and_saves_it(tmp_path, sync):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are only installed from the main thread")
    exp = experiment.build(_cfg(tmp_path, sync, checkpoint={"every": 5}))
    # Sent while step 6 is dispatched: step 7 is the first whose input carries the flag.
    _record_dispatches(exp, lambda s: s == 6 and os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(stop.Interrupted) as stopped:
        loop.train(exp)
    # Waiting for every step, step 7's flag is read before step 8 is dispatched: stop at 7.
    # A step late, it is read after step 8 took step 7's state: stop at 8, which is saved.
    expected = 7 if sync else 8
    assert stopped.value.step == expected and stopped.value.saved and stopped.value.signum == signal.SIGTERM
    assert exp.checkpointer.steps() == [5, expected]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, expected + 1))


def test_the_nan_guard_names_the_first_non_finite_step_and_never_saves_one(tmp_path):
    # NaN inputs at step 5; step 6 is a save step, dispatched before step 5's loss is read.
    messages = {}
    for sync in (True, False):
        exp = experiment.build(_cfg(tmp_path / str(sync), sync, checkpoint={"every": 3}))
        step_fn, calls = exp.train_step, [0]

        def poisoned(state, batch, flags, step_fn=step_fn, calls=calls):
            calls[0] += 1
            if calls[0] == 5:
                batch = {**batch, "inputs": batch["inputs"] * np.float32("nan")}
            return step_fn(state, batch, flags)

        exp.train_step = poisoned
        with pytest.raises(errors.TrainingError) as failed:
            loop.train(exp)
        messages[sync] = str(failed.value)
        assert exp.checkpointer.steps() == [3]
    assert messages[False] == messages[True]
    assert messages[False].startswith("step 5: loss is nan") and messages[False].endswith(
        "; last good checkpoint: step 3"
    )


@pytest.fixture
def own_compile_cache(tmp_path, monkeypatch):
    """The environment's cache folder (the test session's) removed for the test, then restored."""
    yield tmp_path / "cache"
    monkeypatch.undo()
    compile_cache.configure(config.CompileCacheConfig())  # the environment's folder again


def test_profile_traces_exactly_its_steps_and_the_compile_cache_fills_its_folder(
    tmp_path, monkeypatch, own_compile_cache
):
    monkeypatch.delenv(compile_cache.DIR_ENV)  # the session's minimum compile time (0 s) stays
    cfg = _cfg(
        tmp_path / "run",
        False,
        {"steps": 6, "profile": {"start": 3, "steps": 2}},
        compile_cache={"dir": str(own_compile_cache)},
    )
    exp = experiment.build(cfg)
    loop.train(exp)
    traces = list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1  # TensorBoard's profile plugin reads it
    perfetto = traces[0].parent / "perfetto_trace.json.gz"
    events = json.loads(gzip.decompress(perfetto.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    # Every op the step ran carries its program and run: two runs of the train step, 3 and 4.
    runs = {
        e["args"]["run_id"]
        for e in events
        if (e.get("args") or {}).get("hlo_module") == f"jit_{exp.train_step.__name__}"
    }
    assert len(runs) == 2
    assert any(n.startswith(f"jit_{exp.train_step.__name__}-") for n in os.listdir(own_compile_cache))


def test_profile_and_cache_mistakes_are_one_line_config_errors(tmp_path, monkeypatch, own_compile_cache):
    with pytest.raises(
        config.ConfigError, match=r"^train\.profile\.start: step 13 is past train\.steps 12: nothing would be traced$"
    ):
        _cfg(tmp_path, False, {"profile": {"start": 13, "steps": 1}})
    monkeypatch.delenv(compile_cache.DIR_ENV)
    (tmp_path / "file").write_text("")
    with pytest.raises(config.ConfigError, match=r"^compile_cache\.dir: cannot create .*/file/jax: Not a directory"):
        compile_cache.configure(config.CompileCacheConfig(dir=str(tmp_path / "file" / "jax")))


# ----------------------------------------------------------------------------------------------
# Settings that cannot take effect as written are said, one line each on stderr, before step 1.


def test_a_profile_window_past_the_run_says_what_is_traced(tmp_path, capsys):
    exp = experiment.build(_cfg(tmp_path, False, {"steps": 4, "profile": {"start": 3, "steps": 5}}))
    loop.train(exp)
    assert capsys.readouterr().err.splitlines() == [
        "profile: train.profile asks for steps 3..7 but the run ends at step 4 (train.steps): tracing steps 3..4"
    ]
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1  # as said: the trace of steps 3 and 4
    events = json.loads(gzip.decompress((traces[0].parent / "perfetto_trace.json.gz").read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    runs = {
        e["args"]["run_id"]
        for e in events
        if (e.get("args") or {}).get("hlo_module") == f"jit_{exp.train_step.__name__}"
    }
    assert len(runs) == 2

    def said(resumed_at, **profile):  # of an 8-step run resumed from step `resumed_at`
        return loop.notices(
            dataclasses.replace(
                exp, step=dataclasses.replace(exp.step, cfg=_cfg(tmp_path, False, {"steps": 8, "profile": profile}))
            ),
            resumed_at,
        )

    assert said(4, start=2, steps=2) == [
        "profile: train.profile asks for steps 2..3 but this run resumes at step 5: nothing is traced"
    ]
    assert said(4, start=3, steps=9) == [
        "profile: train.profile asks for steps 3..11 but this run resumes at step 5 and the run ends at step 8 (train.steps): "
        "tracing steps 5..8"
    ]
    assert said(4, start=5, steps=4) == said(0, start=8, steps=1) == []  # windows the run covers: nothing to say


def test_eval_batches_beyond_the_eval_split_say_how_many_are_used(tmp_path, capsys):
    # The eval split holds 64 examples: 2 batches of 32.
    exp = experiment.build(_cfg(tmp_path / "five", False, {"steps": 2, "eval_every": 2, "eval_batches": 5}))
    summary = loop.train(exp)
    assert capsys.readouterr().err.splitlines() == [
        "eval: train.eval_batches is 5 but the eval split holds 2 batches of 32 (64 examples): evaluating on 2"
    ]
    assert summary["final_eval_loss"] == loop.evaluate(exp, exp.state)["eval_loss"] > 0
    two = _cfg(tmp_path / "two", False, {"steps": 2, "eval_every": 2, "eval_batches": 2})
    assert loop.notices(dataclasses.replace(exp, step=dataclasses.replace(exp.step, cfg=two)), 0) == []
    # No eval split at all: eval_every cannot take effect either.
    data = {"num_examples": 1024, "num_eval_examples": 0, "num_features": 48}
    exp = experiment.build(_cfg(tmp_path / "none", False, {"steps": 2, "eval_every": 2}, data=data))
    summary = loop.train(exp)
    assert capsys.readouterr().err.splitlines() == [
        "eval: train.eval_every is 2 but there is no eval split (data.num_eval_examples is 0): no eval"
    ]
    assert "final_eval_loss" not in summary
