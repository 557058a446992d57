"""scripts/bench_moe.py --quick: the table and JSON of MoE steps beside a dense baseline, and the
all-to-all bytes planned before compiling against the compiled program's (no timing is asserted)."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~1 min; `pytest -m slow`. In CI the planned bytes are checked in tests/test_plan_moe.py
def test_bench_moe_quick(tmp_path):
    out = tmp_path / "bench_moe.json"
    cmd = [sys.executable, "scripts/bench_moe.py", "--quick", "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for words in ("step ms (measured)", "all-to-all (HLO)", "all-to-all (planned)"):
        assert words in result.stdout
    data = json.loads(out.read_text())
    assert data["failures"] == [] and data["devices"] == 8
    rows = {r["row"]: r for r in data["results"]}
    assert list(rows)[0] == "dense" and rows["dense"]["all_to_all_measured_bytes"] == {}
    routed = rows["capacity all-to-all"]
    assert (
        routed["all_to_all_measured_bytes"] == routed["all_to_all_planned_bytes"]
        and "expert" in routed["all_to_all_measured_bytes"]
    )
    for name in ("capacity sliced", "capacity replicated", "dropless replicated"):
        assert rows[name]["all_to_all_measured_bytes"] == rows[name]["all_to_all_planned_bytes"] == {}
    assert all(r["median_step_s"] > 0 for r in rows.values())
