"""Bad input of every kind gets exit 2 and one line, never a traceback (hypothesis-driven).

Each example starts from a valid tiny config and applies one mutation that is invalid by
construction, then runs the real CLI entry point in-process (``meshpar.train.main``), which
goes as far as the mistake lets it: config validation, mesh, layout, data, model checks.
"""

import os
import pathlib
import string
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from meshpar import train
from tests.tfds_fixtures import build_tiny_dataset

BASE = """
mesh: data:4,model:2
layout: batch:data; hidden:model
model: {name: mlp, hidden: [16]}
data: {num_examples: 256, num_eval_examples: 0, num_features: 8}
train: {steps: 2, batch_size: 16, progress: false}
"""

# field → (type, minimum) for the sections the fuzzer corrupts
FIELDS = {
    "train.steps": (int, 1),
    "train.batch_size": (int, 1),
    "train.log_every": (int, 1),
    "train.eval_every": (int, 0),
    "train.eval_batches": (int, 1),
    "train.seed": (int, 0),
    "train.progress": (bool, None),
    "feed.prefetch": (int, 0),
    "feed.mode": ("literal", None),
    "feed.reuse_buffers": (bool, None),
    "optimizer.learning_rate": (float, 0.0),
    "optimizer.weight_decay": (float, 0.0),
    "optimizer.warmup_steps": (int, 0),
    "optimizer.name": ("literal", None),
    "optimizer.schedule": ("literal", None),
    "optimizer.grad_clip_norm": (float, 0.0),
    "data.num_examples": (int, 1),
    "data.num_features": (int, 1),
    "data.num_classes": (int, 2),
    "data.source": ("literal", None),
    "data.length": (int, 1),
    "data.max_bytes": (int, 0),
    "data.name": (str, None),
    "data.split": (str, None),
    "checkpoint.every": (int, 0),
    "checkpoint.keep": (int, 0),
    "checkpoint.resume": ("literal", None),
    "hardware.peak_tflops": (float, 0.0),
    "model.hidden": ("int_list", 1),
    "model.num_classes": (int, 2),
    "model.activation": ("literal", None),
    "workdir": (str, None),
}
SECTIONS = ["data", "feed", "optimizer", "train", "checkpoint", "hardware", "model"]

ident = st.text(string.ascii_lowercase + "_", min_size=1, max_size=10).filter(lambda s: s.isidentifier())
words = st.text(string.ascii_letters, min_size=1, max_size=8).filter(
    lambda s: s.lower() not in {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}
)


def _wrong_value(kind):
    """A YAML value text of the wrong type for `kind`."""
    if kind is int:
        return st.one_of(words, st.just("1.5"), st.just("[1, 2]"), st.just("true"), st.just("{a: 1}"))
    if kind is float:
        return st.one_of(words, st.just("[0.1]"), st.just("false"), st.just("{a: 1}"))
    if kind is str:
        return st.one_of(st.integers().map(str), st.just("[a, b]"), st.just("{a: b}"))
    if kind is bool:
        return st.one_of(st.just("2"), words, st.just("[true]"))
    if kind == "int_list":
        return st.one_of(words, st.just("[a, 2]"), st.just("[1.5]"), st.just("7"))
    return words.map(lambda w: f"nope_{w}")  # literal: never one of the choices


def _below_min(kind, lo):
    if kind == "int_list":
        return st.integers(-5, lo - 1).map(lambda v: f"[4, {v}]")
    if kind is int:
        return st.integers(-(10**6), lo - 1).map(str)
    return st.floats(-1e6, lo, exclude_max=True, allow_nan=False).map(repr)


@st.composite
def mutation(draw, tfds_dir):
    """(error class, extra CLI args) of one invalid change to BASE."""
    kind = draw(
        st.sampled_from(
            [
                "unknown_key",
                "wrong_type",
                "below_min",
                "batch_not_divisible",
                "mesh",
                "layout",
                "missing_file",
                "unknown_name",
                "data",
            ]
        )
    )
    if kind == "unknown_key":
        section = draw(st.sampled_from(SECTIONS + [""]))
        key = draw(
            ident.filter(
                lambda k: (
                    f"{section}.{k}".strip(".") not in FIELDS
                    and k not in {"name", "mesh", "layout", "model"} | set(SECTIONS)
                )
            )
        )
        return kind, [f"{section + '.' if section else ''}{key}=1"]
    if kind == "wrong_type":
        key = draw(st.sampled_from(sorted(FIELDS)))
        return kind, [f"{key}={draw(_wrong_value(FIELDS[key][0]))}"]
    if kind == "below_min":
        key = draw(st.sampled_from(sorted(k for k, (t, lo) in FIELDS.items() if lo is not None)))
        t, lo = FIELDS[key]
        return kind, [f"{key}={draw(_below_min(t, lo))}"]
    if kind == "batch_not_divisible":
        return kind, [f"train.batch_size={draw(st.integers(1, 200).filter(lambda b: b % 4))}"]
    if kind == "mesh":
        bad = draw(
            st.one_of(
                st.sampled_from(
                    ["data", "data:", ":4", "data:4:2", "data:4,data:2", "data:-1,model:-1", ";", ",", "data:4;data:2"]
                ),
                st.tuples(ident, st.sampled_from(["0", "-2", "x", "1.5", "", "-0"])).map(
                    lambda t: f"data:4,{t[0]}:{t[1]}"
                ),
                st.tuples(st.sampled_from(["4x", "2-", "a b", "1data"]), st.integers(1, 8)).map(
                    lambda t: f"{t[0]}:{t[1]},model:2"
                ),
                st.integers(3, 64)
                .filter(lambda n: n not in (4, 8))
                .map(lambda n: f"data:{n},model:2" if n * 2 > 8 else f"data:{n},model:3"),
            )
        )
        return kind, [f"mesh={bad}"]
    if kind == "layout":
        bad = draw(
            st.one_of(
                ident.filter(lambda a: a not in ("data", "model")).map(lambda a: f"batch:data; hidden:({a},{a})"),
                st.sampled_from(
                    [
                        "batch:data; hidden:model; hidden:data",
                        "batch:data; hidden:data",
                        "batch:model; hidden:model",
                        "batch:data; hidden",
                        "batch:data; :model",
                        "batch:data; pixels:model; hidden:model",
                    ]
                ),
            )
        )
        if draw(st.booleans()):
            return kind, [f"layout={bad}"]
        width = draw(st.integers(1, 99).filter(lambda w: w % 2))  # the model axis has 2 devices
        return kind, [f"model.hidden=[{width}]"]
    if kind == "missing_file":
        which = draw(st.sampled_from(["config", "tfds", "corpus"]))
        name = draw(ident)
        if which == "config":
            return kind, ["--config", f"/nonexistent/{name}.yaml"]
        if which == "tfds":
            return kind, ["data.source=tfds", f"data.name={name}", f"data.data_dir=/nonexistent/{name}"]
        return kind, [
            "data.source=text",
            f"data.corpus_dir=/nonexistent/{name}",
            "model={name: transformer, d_model: 8, n_heads: 2, d_head: 4, d_ff: 16, n_layers: 1, max_length: 16}",
            "data.length=16",
            "layout=batch:data",
        ]
    if kind == "unknown_name":
        which = draw(st.sampled_from(["model.name", "data.source", "feed.mode", "optimizer.name"]))
        return kind, [f"{which}=x_{draw(ident)}"]
    # data errors against a real (tiny) tfds dataset
    base = [
        "data.source=tfds",
        "data.name=tiny_digits",
        f"data.data_dir={tfds_dir}",
        "data.num_features=64",
        "layout=batch:data",
    ]
    bad = draw(
        st.sampled_from(
            [
                [f"data.split=x_{draw(ident)}"],
                [f"data.fields={{inputs: {draw(ident)}, targets: label}}"],
                ["data.split=train[:0]"],
                ["data.name=tiny_missing"],
                ["data.fields={inputs: label, targets: image}"],  # the MLP needs integer scalar targets
                [
                    "model={name: transformer, d_model: 8, n_heads: 2, d_head: 4, d_ff: 16, n_layers: 1}"
                ],  # float pixels are no tokens
            ]
        )
    )
    return kind, base + bad


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "base.yaml").write_text(BASE)
    build_tiny_dataset(str(root / "tfds"))
    return root


def test_fuzz_bad_input_exits_2_with_one_line(paths, capsys):
    seen = {}

    @settings(max_examples=240, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(mutation(str(paths / "tfds")))
    def check(case):
        kind, args = case
        argv = ["--config", str(paths / "base.yaml"), f"workdir={paths / 'run'}", *args]
        if args[0] == "--config":
            argv = [*args, f"workdir={paths / 'run'}"]
        capsys.readouterr()
        code = train.main(argv)
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code == 2, (argv, err)
        assert len(lines) == 1, (argv, err)
        assert lines[0].startswith(("config error: ", "data error: ")), (argv, err)
        assert "Traceback" not in err
        event(kind)
        seen[kind] = seen.get(kind, 0) + 1

    check()
    assert sum(seen.values()) >= 200
    assert set(seen) == {
        "unknown_key",
        "wrong_type",
        "below_min",
        "batch_not_divisible",
        "mesh",
        "layout",
        "missing_file",
        "unknown_name",
        "data",
    }


# --------------------------------------------------------------------------------------------
# Regressions from a sweep of every config field with extreme values through the CLI (0, -1,
# 2**31, 2**63, 2**64, 1e308, inf, nan, 10,000-character strings, unicode, empty, NUL): each of
# these used to end in a traceback, a C++ abort, a hang, a multi-line exit or a silently wrong
# run; each is now one config line, before the first step.

LONG = "a" * 300  # longer than a file name may be (255 bytes)

SWEPT = [
    # seeds: numpy refuses negative ones; jax keys keep 32 bits (2**32 would be seed 0 again)
    (["train.seed=-1"], "train.seed", "must be >= 0"),
    (["train.seed=4294967296"], "train.seed", "must be <= 4294967295"),
    (["train.seed=9223372036854775808"], "train.seed", "64-bit"),
    # step counts are int32 inside the jitted step (optax's schedule counts overflowed there)
    (["optimizer.warmup_steps=2147483648"], "optimizer.warmup_steps", "must be <= 2147483647"),
    (
        ["optimizer.decay_steps=2147483648", "optimizer.schedule=cosine"],
        "optimizer.decay_steps",
        "must be <= 2147483647",
    ),
    # float32 overflow in the step (a NaN loss, plus a RuntimeWarning line), and non-finite values
    (["optimizer.learning_rate=1.0e308"], "optimizer.learning_rate", "not a finite float32"),
    (["optimizer.weight_decay=.inf"], "optimizer.weight_decay", "not a finite float32"),
    (["optimizer.grad_clip_norm=.nan"], "optimizer.grad_clip_norm", "not a finite float32"),
    (["hardware.peak_tflops=.inf"], "hardware.peak_tflops", "not a finite float32"),
    (["optimizer.b1=1.0e308"], "optimizer.b1", "not a finite float32"),
    (["optimizer.b1=1"], "optimizer.b1", "must be in [0, 1)"),
    (["optimizer.b2=-0.5"], "optimizer.b2", "must be in [0, 1)"),
    # integers beyond 64 bits (numpy: "Maximum allowed dimension exceeded"; jax: OverflowError)
    (["model.hidden=[18446744073709551616]"], "model.hidden[0]", "64-bit"),
    (["data.num_examples=18446744073709551616"], "data.num_examples", "64-bit"),
    # paths: a NUL byte (ValueError) or a name too long for any file system (OSError)
    (['workdir="a\\0b"'], "workdir", "NUL"),
    ([f"workdir=/tmp/{LONG}"], "workdir", "longer than 255 bytes"),
    (['checkpoint.dir="a\\0b"', "checkpoint.every=1"], "checkpoint.dir", "NUL"),
    ([f"checkpoint.dir=/tmp/{LONG}", "checkpoint.every=1"], "checkpoint.dir", "longer than 255 bytes"),
    (["workdir=''"], "workdir", "must not be empty"),
    # tfds without a train split: the source was None (AttributeError)
    (["data.source=tfds", "data.name=x", "data.data_dir=/nonexistent", "data.split=''"], "data.split", "required"),
    # multi-process settings that failed with a traceback or a C++ message
    (
        ["distributed.num_processes=2", "distributed.coordinator=127.0.0.1"],
        "distributed.coordinator",
        "not 'host:port'",
    ),
    (["distributed.num_processes=2", "distributed.coordinator=127.0.0.1:-1"], "distributed.coordinator", "port"),
    (["distributed.num_processes=2", "distributed.process_id=2"], "distributed.process_id", "not below"),
    (["distributed.initialization_timeout=2147483647"], "distributed.initialization_timeout", "must be <= 604800"),
    # names: ASCII identifiers only (a dim no model has was never checked at all)
    (["layout=batch:data; hidden:model; données:model"], "layout", "'données'"),
    # more simulated CPU devices than a CPU-only host can run (19 GiB and no start at 100000)
    (["mesh=data:100000", "layout=batch:data", "train.batch_size=100000"], "mesh", "at most 256"),
    (["mesh=data:512", "layout=batch:data", "train.batch_size=512"], "mesh", "JAX_NUM_CPU_DEVICES"),
    # more mesh axes than jax.make_mesh takes (a numpy traceback past 32)
    (["mesh=data:8," + ",".join(f"a{i}:1" for i in range(32)), "layout=batch:data"], "mesh", "at most 32"),
    # a -1 batch axis is known once the mesh is built: batch 12 on 8 devices was an IndivisibleError traceback
    (["mesh=data:-1", "layout=batch:data", "train.batch_size=12"], "train.batch_size", "'data' of size 8"),
]


def _id(case) -> str:
    args = case.values[0] if hasattr(case, "values") else case[0]
    return " ".join(args)[:90]


@pytest.mark.parametrize("args, key, text", SWEPT, ids=[_id(c) for c in SWEPT])
def test_swept_values_exit_2_with_one_line(paths, capsys, args, key, text):
    code = train.main(["--config", str(paths / "base.yaml"), f"workdir={paths / 'run'}", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"config error: {key}: ") and text in err, err


@pytest.mark.parametrize("value", ["100000", "0", "-1", "257"])
def test_jax_num_cpu_devices_out_of_range_exits_2_with_one_line(paths, capsys, monkeypatch, value):
    # jax sizes its CPU client from it at start-up (100000 devices: 19 GiB, never started).
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", value)
    code = train.main(["--config", str(paths / "base.yaml"), f"workdir={paths / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert (
        err.count("\n") == 1 and err.startswith(f"config error: mesh: JAX_NUM_CPU_DEVICES='{value}' ") and "256" in err
    ), err


def test_process_level_failures_exit_2_with_one_line(paths):
    # Two failures that a test process cannot survive in-process, in one fresh process:
    # JAX_NUM_CPU_DEVICES=abc made `import jax` itself raise (a traceback before any meshpar
    # code ran), and a mesh axis named `données` aborted inside XLA's partitioner (exit 134,
    # jax 0.10). Each must now be one line and status 2.
    script = "\n".join(
        [
            "import os",
            "from meshpar import train",  # imports jax while JAX_NUM_CPU_DEVICES=abc
            f"base = ['--config', {str(paths / 'base.yaml')!r}, 'workdir=' + {str(paths / 'run')!r}]",
            "print(train.main(base), flush=True)",
            "del os.environ['JAX_NUM_CPU_DEVICES']",
            "print(train.main(base + ['mesh=données:4,model:2', 'layout=batch:données; hidden:model']), flush=True)",
        ]
    )
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "abc", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0 and result.stdout.split() == ["2", "2"], (
        result.returncode,
        result.stdout,
        result.stderr[-2000:],
    )
    first, second = result.stderr.splitlines()
    assert first.startswith("config error: mesh: JAX_NUM_CPU_DEVICES='abc' is not an integer"), first
    assert second.startswith("config error: mesh: axis name 'données' is not an identifier of ASCII"), second
