"""The CLI end to end, as a user runs it: exit codes, outputs, one-line errors."""

import json
import os
import re
import subprocess
import sys

import pytest

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
        capture_output=True, text=True, env=env, timeout=300,
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
        (["model.hidden=[66,32]"], r"config error: layout: dim 'hidden' of parameter layers/0/\w+ \(.*\) has size 66, not divisible by mesh axis 'model' of size 4$"),
        (["train.bogus=1"], r"config error: train\.bogus: unknown key \(known: steps, batch_size"),
        (["feed.mode=sideways"], r"config error: feed\.mode: 'sideways' is not one of: direct, routed$"),
        (["layout=hidden:nowhere"], r"config error: layout: dim 'hidden' is mapped to unknown mesh axis 'nowhere' \(mesh axes: 'data', 'model'\)$"),
        (["mesh=model:3,data:-1"], r"config error: mesh: axis 'data' = -1: 8 devices do not divide by the other axes' 3$"),
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
