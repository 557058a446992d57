"""experiments/gpu_lm.yaml: a 0.5-1.5 B-parameter byte LM for one 80-141 GB GPU that the memory
plan and an AOT compile accept on CPU (nothing allocated; about 4 s each on 2 cores).

Its 2-step run at laptop size is ``tests/test_experiments.py::test_experiment_runs_two_steps[gpu_lm]``
(the header's small-size command); the device check's --dry-run uses the same overrides.
"""

import json
import pathlib
import shlex
import subprocess
import sys

import jax.numpy as jnp
import pytest

from meshpar.configuration import config
from meshpar.models import attention
from tests.support import script

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_LM = ROOT / "experiments" / "gpu_lm.yaml"
GIB = 1 << 30


def _device_check():
    return script("device_check")


def test_gpu_lm_is_a_bf16_language_model_with_float32_weights_and_cudnn_attention_over_long_sequences():
    cfg = config.load(GPU_LM)
    m = cfg.model
    assert (m.name, m.compute_dtype, m.param_dtype, m.attention) == ("transformer", "bfloat16", "float32", "cudnn")
    assert cfg.data.length >= 1024 and cfg.data.source in ("text", "synthetic")
    assert cfg.checkpoint.every == 0 and cfg.hardware.memory_gib == 0  # planned against the device it runs on
    # Off a CUDA GPU, cudnn falls back to the blockwise kernel: no [length, length] scores.
    shape = (1, cfg.data.length, m.n_heads, m.d_head)
    assert attention.resolve(m.attention, shape, jnp.bfloat16, m.attention_block) == "blockwise"


def test_the_headers_small_size_command_is_the_device_checks_dry_run():
    """The suite's 2-step run (the header's command) and the dry run train the same small model."""
    prefix = "#   python -m meshpar.train --config experiments/gpu_lm.yaml "
    line = next(line for line in GPU_LM.read_text().splitlines() if line.startswith(prefix))
    overrides = shlex.split(line[len(prefix) :])
    assert overrides == [*_device_check().DRY_OVERRIDES, "train.eval_every=2"]
    small = config.load(GPU_LM, overrides).model
    assert small.n_layers * small.d_model * small.d_ff < 1e6  # laptop size, seconds per step


@pytest.mark.parametrize("gib", [80, 141])
def test_gpu_lm_plans_and_compiles_for_an_80_and_a_141_gib_device(gib, tmp_path, env):
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "meshpar.plan", "--config", str(GPU_LM), "mesh=data:1", f"hardware.memory_gib={gib}",
           "--json", str(out)]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    plan = json.loads(out.read_text())
    # bfloat16 compute on XLA:CPU is out of the analytic model's scope: the plan says so and
    # stands on XLA's figures alone.
    assert plan["analytic"] is None and plan["analytic_missing"].startswith("out of scope: bfloat16 compute")
    # The compiled step really holds the full model: its arguments are the float32 weights and
    # two AdamW moments (12 bytes per parameter), not a shrunk stand-in.
    assert 0.5e9 <= plan["xla"]["argument_bytes"] / 12 <= 1.5e9
    assert plan["capacity"]["bytes"] == gib * GIB and plan["capacity"]["source"] == f"hardware.memory_gib={gib}"
    assert plan["fits"] and plan["needed_bytes"] <= plan["capacity"]["usable_bytes"]
    assert plan["verdict"].startswith("fits: ")


def test_on_a_laptop_the_full_size_model_is_refused_in_one_line_before_anything_is_allocated(tmp_path, env):
    cmd = [sys.executable, "-m", "meshpar.train", "--config", str(GPU_LM), "mesh=data:1", "hardware.memory_gib=8",
           f"workdir={tmp_path}"]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: ") and "does not fit" in lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()
