"""The CLI end to end, as a user runs it: exit codes, outputs, one-line errors."""

import json
import os
import re
import subprocess
import sys

import pytest

from meshpar import train

TINY = """
mesh: data:4,model:2
layout: batch:data; hidden:model
model: {name: mlp, hidden: [64, 32]}
data: {num_examples: 4096, num_eval_examples: 256, num_features: 64}
optimizer: {learning_rate: 0.003}
train: {steps: 100, batch_size: 64, log_every: 10, eval_every: 30, progress: false}
"""


def _cli(tmp_path, *overrides, config=TINY):
    path = tmp_path / "tiny.yaml"
    path.write_text(config)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return subprocess.run(
        [sys.executable, "-m", "meshpar.train", "--config", str(path), f"workdir={tmp_path / 'run'}", *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _losses(workdir):
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_cli_trains_and_writes_outputs(tmp_path):
    result = _cli(tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10, 101, 10))
    for key in ("loss", "step_time_s", "feed_time_s", "examples_per_s"):
        assert all(isinstance(r[key], float) for r in rows), key
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_loss"] <= 0.5 * summary["first_loss"]
    assert summary["mesh"] == "data:4,model:2" and summary["feed_mode"] == "direct"
    assert summary["relay_input_bytes"] * 4 == summary["batch_input_bytes"]
    assert summary["median_step_time_s"] > 0 and summary["final_eval_loss"] > 0
    assert list((tmp_path / "run" / "tb").iterdir()), "TensorBoard events written"


def test_cli_routed_writes_the_same_losses(tmp_path):
    (tmp_path / "d").mkdir(), (tmp_path / "r").mkdir()
    direct = _cli(tmp_path / "d", "train.steps=20", "train.log_every=1")
    routed = _cli(tmp_path / "r", "train.steps=20", "train.log_every=1", "feed.mode=routed")
    assert direct.returncode == routed.returncode == 0, direct.stderr + routed.stderr
    assert _losses(tmp_path / "d" / "run") == _losses(tmp_path / "r" / "run")
    summary = json.loads((tmp_path / "r" / "run" / "summary.json").read_text())
    assert summary["feed_mode"] == "routed" and summary["relay_input_bytes"] == summary["batch_input_bytes"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["model.hidden=[66,32]"],
            r"config error: layout: dim 'hidden' of parameter layers/0/\w+ \(.*\) has size 66, not divisible by mesh axis 'model' of size 4$",
        ),
        (["train.bogus=1"], r"config error: train\.bogus: unknown key \(known: steps, batch_size"),
        (["feed.mode=sideways"], r"config error: feed\.mode: 'sideways' is not one of: direct, routed$"),
        (
            ["param_layout=nosuchdim:data"],
            r"config error: param_layout: none of its rules applies to a parameter, so it would split nothing \(this model's parameters have no dim nosuchdim; the parameters' dims: classes, hidden, hidden_2, pixels\)$",
        ),
        (
            ["param_layout=hidden:nowhere"],
            r"config error: param_layout: none of its rules applies to a parameter, so it would split nothing \(the mesh has no axis nowhere; ",
        ),
        (
            ["mesh=model:3,data:-1"],
            r"config error: mesh: axis 'data' = -1: 8 devices do not divide by the other axes' 3$",
        ),
        (["mesh=data:0"], r"config error: mesh: axis 'data' has size 0; sizes are positive, or -1"),
    ],
)
def test_cli_config_errors_exit_2_with_one_line(tmp_path, overrides, expected):
    cfg = TINY.replace("data:4,model:2", "data:2,model:4") if "66" in overrides[0] else TINY
    result = _cli(tmp_path, *overrides, config=cfg)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(expected, lines[0]), result.stderr
    assert "Traceback" not in result.stderr


def test_cli_missing_config_file(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "meshpar.train", "--config", str(tmp_path / "nope.yaml")], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"config error: config: file not found: {tmp_path / 'nope.yaml'}"


# ----------------------------------------------------------------------------------------------
# One checkpoint folder, one run; filesystem mistakes in one line.


def _main(capsys, tmp_path, *overrides):
    """The CLI in-process: (exit status, stderr lines)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    status = train.main(["--config", str(path), f"workdir={tmp_path / 'run'}", *overrides])
    return status, capsys.readouterr().err.strip().splitlines()


def _tree(directory):
    return {
        p.relative_to(directory).as_posix(): (p.read_bytes() if p.is_file() else None)
        for p in sorted(directory.rglob("*"))
    }


SHORT = ["train.steps=4", "checkpoint.every=2", "train.log_every=1", "train.eval_every=0"]


def test_a_fresh_run_never_mixes_with_an_earlier_one_in_its_checkpoint_folder(tmp_path, capsys):
    assert _main(capsys, tmp_path, *SHORT)[0] == 0
    ckpt, run = tmp_path / "run" / "checkpoints", tmp_path / "run"
    before, metrics = _tree(ckpt), (run / "metrics.jsonl").read_text()
    status, err = _main(capsys, tmp_path, *SHORT, "optimizer.learning_rate=0.03")
    assert status == 2 and err == [
        f"checkpoint error: {ckpt} already holds steps [2, 4] of an earlier run; continue it with --resume, "
        "or choose a new workdir / checkpoint.dir, or replace it with checkpoint.overwrite=true"
    ]
    assert _tree(ckpt) == before and (run / "metrics.jsonl").read_text() == metrics  # nothing touched

    # Replacing it, said explicitly: the old steps, metrics and events go before the first save,
    # so keep rotation (keep=1) can only ever see the new run's steps.
    (run / "checkpoints" / "4.orbax-checkpoint-tmp").mkdir()  # a save of the old run that never committed
    status, err = _main(
        capsys, tmp_path, *SHORT, "optimizer.learning_rate=0.03", "checkpoint.overwrite=true", "checkpoint.keep=1"
    )
    assert status == 0 and err == []
    assert sorted(p.name for p in ckpt.iterdir()) == ["4"] and len(list((run / "tb").iterdir())) == 1
    replaced = _losses(run)
    assert _main(capsys, tmp_path / "alone", *SHORT, "optimizer.learning_rate=0.03")[0] == 0
    assert (
        replaced == _losses(tmp_path / "alone" / "run") != [json.loads(line)["loss"] for line in metrics.splitlines()]
    )
    status, err = _main(capsys, tmp_path, *SHORT, "checkpoint.overwrite=true", "--resume")
    assert status == 2 and err == [
        "config error: checkpoint.overwrite: replaces the earlier run, so it cannot be combined with --resume"
    ]


@pytest.mark.parametrize(
    "setup, overrides, expected",
    [
        ("file", ["workdir={f}"], "config error: workdir: {f} is a file, not a directory"),
        (
            "file",
            ["workdir={f}/run"],
            "config error: workdir: {f}/run lies under {f}, which is a file, not a directory",
        ),
        (
            "file",
            ["checkpoint.every=2", "checkpoint.dir={f}/ckpt"],
            "config error: checkpoint.dir: {f}/ckpt lies under {f}, which is a file, not a directory",
        ),
        (
            "dir",
            ["checkpoint.every=2", "checkpoint.dir=/proc/meshpar-ckpt"],
            "config error: checkpoint.dir: cannot create /proc/meshpar-ckpt: No such file or directory",
        ),
    ],
)
def test_filesystem_mistakes_are_one_line_before_any_step(tmp_path, capsys, setup, overrides, expected):
    f = tmp_path / "in_the_way"
    f.write_text("not a folder") if setup == "file" else f.mkdir()
    status, err = _main(capsys, tmp_path, *[o.format(f=f) for o in overrides])
    assert status == 2 and err == [expected.format(f=f)]


def test_a_full_disk_at_save_time_ends_the_run_in_one_line_naming_the_last_step_saved(tmp_path, capsys):
    # A 4-step run leaves step 4; resumed to 8 with files capped below a checkpoint's size
    # (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with EFBIG, as on a full disk), step 6 cannot
    # be written: one line, exit 2, step 4 intact.
    assert _main(capsys, tmp_path, *SHORT)[0] == 0
    limit = max(p.stat().st_size for p in (tmp_path / "run" / "checkpoints" / "4").rglob("*") if p.is_file()) // 2

    capped = (
        "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
        "os.execv(sys.executable, [sys.executable, '-m', 'meshpar.train', *sys.argv[1:]])"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            capped,
            "--config",
            str(tmp_path / "tiny.yaml"),
            f"workdir={tmp_path / 'run'}",
            *SHORT,
            "train.steps=8",
            "--resume",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    ckpt = tmp_path / "run" / "checkpoints"
    assert re.fullmatch(
        rf"checkpoint error: cannot write step 6 to {ckpt}/6 \(File too large \[errno 27\]; .*\); last step saved: 4",
        lines[0],
    ), lines[0]
    assert 4 in [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()]


def _damage(step_dir):
    (step_dir / "state" / "manifest.ocdbt").unlink()  # the step's manifest no longer verifies


def test_resume_before_the_first_checkpoint_starts_at_step_0_and_a_damaged_run_never_does(tmp_path, capsys):
    # One command line serves a job's first launch and every relaunch.
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    status, err = _main(capsys, tmp_path, *SHORT, "--resume")
    assert status == 0 and err == [f"resume: no checkpoint in {ckpt} yet; starting at step 0"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    status, err = _main(capsys, tmp_path, *SHORT, "train.steps=6", "--resume")
    assert status == 0 and err == []  # continued: nothing to say
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 4
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))

    # Every step damaged: the relaunch sets them aside and stops; so does every relaunch after
    # it, instead of starting over as if the run had never been.
    steps = sorted(p.name for p in ckpt.iterdir())
    for step in steps:
        _damage(ckpt / step)
    outputs = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "summary.json")}
    status, err = _main(capsys, tmp_path, *SHORT, "train.steps=6", "--resume")
    assert status == 2 and err[-1].startswith(
        f"checkpoint error: no usable checkpoint in {ckpt} (newest: step {steps[-1]}: "
    )
    damaged = ", ".join(f"{s}.damaged" for s in steps)
    for _ in range(2):
        status, err = _main(capsys, tmp_path, *SHORT, "train.steps=6", "--resume")
        assert status == 2 and err == [
            f"checkpoint error: no usable checkpoint in {ckpt}: its steps were set aside as damaged ({damaged}); to start "
            "over, move them away, or run without --resume and with checkpoint.overwrite=true (which removes them)"
        ]
    assert sorted(p.name for p in ckpt.iterdir()) == [f"{s}.damaged" for s in steps]
    assert {name: (run / name).read_bytes() for name in outputs} == outputs  # nothing of the run touched
    # Starting over, said explicitly.
    status, err = _main(capsys, tmp_path, *SHORT, "checkpoint.overwrite=true")
    assert status == 0 and err == [] and sorted(p.name for p in ckpt.iterdir()) == ["2", "4"]
