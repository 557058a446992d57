"""scripts/bench_fp8.py --quick: FP8 and bf16 train steps of one model side by side (emulated on
this host's CPU, said so), and the plan's prediction of both for an H100 (no timing is asserted)."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~100 s on 2 cores: three experiments built and compiled, three deviceless plans
@pytest.mark.gpu_target
def test_bench_fp8_quick(tmp_path):
    out = tmp_path / "bench_fp8.json"
    cmd = [sys.executable, "scripts/bench_fp8.py", "--quick", "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for words in ("step ms (emulated)", "predicted ms (h100-sxm-8)", "XLA:CPU rounds to FP8"):
        assert words in result.stdout
    data = json.loads(out.read_text())
    assert data["failures"] == [] and data["kind"] == "emulated"
    bf16, fp8, delayed = data["results"]
    assert (bf16["row"], fp8["row"], delayed["row"]) == ("bf16", "fp8", "fp8-delayed") and bf16["fp8"] is None
    # The FP8 row's dots are FP8 in the program that ran (emulated: rounded, multiplied in bf16):
    # its first loss moves off the bf16 row's by the rounding, not by more.
    assert fp8["fp8"]["mode"] == "emulated" and fp8["fp8"]["meant"] > 0 and fp8["fp8"]["emitted"] == 0
    assert all(math.isfinite(r["first_loss"]) for r in (bf16, fp8, delayed))
    assert 0 < abs(fp8["first_loss"] - bf16["first_loss"]) < 0.05
    assert 0 < abs(delayed["first_loss"] - bf16["first_loss"]) < 0.05  # empty histories: scale 1, FP8 all the same
    # The prediction: both compiled deviceless for an H100, the FP8 one with FP8 GEMMs in it.
    plan = data["predicted"]
    rows = plan["rows"]
    assert rows["bf16"]["deviceless"] and rows["fp8"]["deviceless"] and rows["bf16"]["fp8"] is None
    assert rows["fp8"]["fp8"]["mode"] == "checked" and rows["fp8"]["fp8"]["emitted"] > 0
    assert plan["bf16_over_fp8"] == pytest.approx(rows["bf16"]["step_s"] / rows["fp8"]["step_s"])
    assert rows["fp8-delayed"]["fp8"]["emitted"] > 0
    assert plan["bf16_over_fp8_delayed"] == pytest.approx(rows["bf16"]["step_s"] / rows["fp8-delayed"]["step_s"])
