"""scripts/bench_pipeline.py --quick: the table and JSON of a pipelined step beside its baseline
(no timing is asserted: only what the compiled programs and first losses show)."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~30 s; `pytest -m slow`. In CI the pipeline's checks run in tests/test_pipeline.py
def test_bench_pipeline_quick(tmp_path):
    out = tmp_path / "bench_pipeline.json"
    cmd = [sys.executable, "scripts/bench_pipeline.py", "--quick", "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for words in ("bubble (computed)", "step ms (measured)", "not physical"):
        assert words in result.stdout
    data = json.loads(out.read_text())
    assert data["failures"] == [] and data["devices"] == 8
    base, *piped = data["results"]
    assert base["stages"] == 1 and base["ticks"] is None and base["hlo_collective_permutes"] == 0
    assert {r["schedule"] for r in piped} == {"gpipe", "circular"}
    for r in piped:
        S, M, R = r["stages"], r["microbatches"], r["repeats"]
        assert S > 1 and r["ticks"] == R * M + S - 1
        assert abs(r["bubble_computed"] - (S - 1) / (R * M + S - 1)) < 1e-12
        # The stages hand activations on (and cotangents back) with ppermutes over the stage axis.
        assert r["hlo_collective_permutes_over_stage_axis"] >= 1 and "stage" in r["hlo_collective_permute_axes"]
        # The same initial state and batch: the pipeline computes the baseline's loss.
        assert abs(r["first_loss"] - base["first_loss"]) <= 1e-5 * abs(base["first_loss"])
        assert r["median_step_s"] > 0 and r["memory_analysis"]["temp_size_in_bytes"] > 0
