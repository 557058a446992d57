"""scripts/device_check.sh, its section drivers (scripts/device_check.py) and its report
(scripts/device_report.py); and that the commands start on an image without the packages only
some commands need (orbax, tensorflow_datasets, tensorboardX, matplotlib).

The whole dry run (about a minute on 2 cores) is marked slow:
    python -m pytest -m slow tests/test_device_check.py
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTPUTS = ("device.json", "a_feed.json", "plan.json", "b_gpu_lm.json", "c_feeding.json", "d_offload.json",
           "e_predictions.json", "summary.md", "sections.tsv")  # fmt: skip
OPTIONAL = ("orbax", "tensorflow_datasets", "tensorflow", "tensorboardX", "matplotlib", "array_record")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


device_check = _script("device_check")
device_report = _script("device_report")


def test_the_topology_follows_the_devices_and_every_mesh_uses_them_all(monkeypatch):
    monkeypatch.delenv("DEVICE_CHECK_TOPOLOGY", raising=False)
    pick = device_check.pick_topology
    assert pick("gpu", "NVIDIA H200", 1) == "h200-sxm-1" and pick("gpu", "NVIDIA H200", 8) == "h200-sxm-8"
    assert pick("gpu", "NVIDIA GH200 480GB", 1) is None and pick("gpu", "NVIDIA H100 80GB HBM3", 8) == "h100-sxm-8"
    assert pick("cpu", "cpu", 2) == "cpu-sim" and pick("gpu", "NVIDIA H200", 3) is None
    monkeypatch.setenv("DEVICE_CHECK_TOPOLOGY", "a100-sxm-8")
    assert pick("gpu", "NVIDIA H200", 1) == "a100-sxm-8"
    assert device_check.meshes(1) == [(1, 1)]
    assert device_check.meshes(8) == [(8, 1), (4, 2), (2, 4), (1, 8)]


def test_a_command_that_hangs_is_stopped_at_its_limit_with_what_it_started(tmp_path):
    marker = tmp_path / "child.pid"
    # The command starts a child of its own that would outlive it: both must go.
    code = f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); open({str(marker)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)"  # noqa: E501
    start = time.monotonic()
    rc, text = device_check.run([sys.executable, "-c", code], 3.0, tmp_path / "x.log")
    assert rc is None and time.monotonic() - start < 20 and "started" in text
    child = pathlib.Path(f"/proc/{int(marker.read_text())}/status")
    time.sleep(0.5)
    # Gone, or a zombie waiting for a reaper (killed, not running).
    assert not child.exists() or "State:\tZ" in child.read_text()
    assert device_check.failure(rc, 3.0, text, "x")["status"] == "timed out"
    assert "started" in (tmp_path / "x.log").read_text()


def test_the_offload_section_is_one_skipped_line_when_its_script_is_missing_or_fails(tmp_path, monkeypatch):
    args = type("Args", (), {"work": tmp_path / "work", "results": tmp_path, "seconds": 30.0, "dry_run": True,
                             "log": tmp_path / "d.log"})()  # fmt: skip
    monkeypatch.setattr(device_check, "ROOT", tmp_path)
    out = device_check.offload(args, {})
    assert out == {"status": "skipped", "note": "skipped: scripts/bench_offload.py is not in this tree"}
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench_offload.py").write_text("import sys\nprint('offload: no device memory kinds here')\nsys.exit(3)\n")
    out = device_check.offload(args, {})
    assert out["status"] == "skipped"
    assert out["note"] == "skipped: bench_offload.py exited 3: offload: no device memory kinds here"


def test_a_spent_budget_still_leaves_every_output_file_saying_so(tmp_path, env):
    result = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run", str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**env, "DEVICE_CHECK_BUDGET": "20", "PYTHON": sys.executable})  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in OUTPUTS:
        assert (tmp_path / name).stat().st_size > 0, name
    for name in OUTPUTS[:6]:
        section = json.loads((tmp_path / name).read_text())
        assert section["status"] == "skipped" and "budget is spent" in section["note"]
    assert json.loads((tmp_path / "e_predictions.json").read_text())["status"] == "skipped"
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| {n} | skipped |" in summary for n in ("device", "a_feed", "plan", "b_gpu_lm", "c_feeding", "d_offload"))


def _write_sections(results: pathlib.Path) -> None:
    sections = {
        "device": {"status": "ok", "platform": "gpu", "device_kind": "NVIDIA H200", "devices": 1, "topology": "h200-sxm-1",
                   "jax": "0", "flax": "0", "optax": "0", "python": "3", "note": "1 x NVIDIA H200 (gpu)"},
        "a_feed": {"status": "ok", "note": "", "rows": [
            {"batch_mib": 64.0, "batch_bytes": 64 << 20, "mesh": 1, "host_memory": "pinned", "direct_s": 0.0015,
             "routed_s": 0.0016, "np_copy_s": 0.01, "aliased": False, "direct_gb_s": 44.7, "ratio_to_nominal": 0.71,
             "pinned_over_pageable": 2.0}]},
        "plan": {"status": "ok", "note": "", "plan": {"needed_bytes": 40 * 2**30, "time": {"step": {"total_s": 0.5}}}},
        "b_gpu_lm": {"status": "ok", "note": "", "steps": 40, "mesh": "data:1", "median_step_time_s": 0.6,
                     "first_step_time_s": 30.0, "tokens_per_s": 26000.0, "step_tokens_per_s": 16384 / 0.6, "mfu": 0.2,
                     "step_mfu": 0.2, "peak_tflops_per_device": 989.5, "peak_tflops_source": "datasheet",
                     "first_loss": 5.6, "final_loss": 3.0, "memory_stats_peak_bytes": 30 * 2**30, "plan_needed_bytes": 40 * 2**30},
        "c_feeding": {"status": "ok", "note": "", "devices": 1, "coincide": "one device: the same path", "meshes": [
            {"mesh": "data:1,model:1", "status": "ok", "losses_identical": True, "runs": [
                {"mode": m, "prefetch": 2, "median_place_time_s": 2e-4, "median_step_time_s": 0.01, "stall_fraction": 0.0,
                 "relay_peak_bytes": 4128} for m in ("routed", "direct")]}]},
    }  # fmt: skip
    for name, body in sections.items():
        (results / f"{name}.json").write_text(json.dumps({"section": name, **body}))


def test_the_report_sets_the_time_models_prediction_beside_each_measurement(tmp_path):
    from meshpar import config
    from meshpar.plan import cost, feed_time, topology

    _write_sections(tmp_path)
    (tmp_path / "sections.tsv").write_text("device\t0\t9\t40\na_feed\t0\t21\t45\n")
    device_report.main(["--results", str(tmp_path)])
    pred = json.loads((tmp_path / "e_predictions.json").read_text())
    rows = {r["quantity"]: r for r in pred["rows"]}
    assert pred["status"] == "ok" and pred["topology"] == "h200-sxm-1"
    topo = topology.load("h200-sxm-1")
    feed = rows["direct placement, 64 MiB, mesh 1, pinned"]
    assert feed["predicted"] == feed_time.placement_time(topo, "direct", 64 << 20, 1, 1, 1, False)
    assert feed["measured_over_predicted"] == pytest.approx(0.0015 / feed["predicted"])
    assert rows["gpu_lm step time (median)"]["measured_over_predicted"] == pytest.approx(0.6 / 0.5)
    assert rows["gpu_lm tokens/s (per step)"]["predicted"] == pytest.approx(16384 / 0.5)
    assert rows["gpu_lm peak memory per device"]["measured_over_predicted"] == pytest.approx(0.75)
    split = cost.config_split(config.load(ROOT / "experiments" / "quickstart.yaml", ["mesh=data:1,model:1"]), topo)
    routed = rows["quickstart routed placement, mesh data:1,model:1, prefetch 2"]
    assert routed["predicted"] == feed_time.placement_time(topo, "routed", split.batch_bytes, 1, 1, split.fields, False)
    summary = (tmp_path / "summary.md").read_text()
    assert "| device | ok | 9 | 40 |" in summary and "| d_offload | missing |" in summary
    assert "With one device: the same path." in summary and "| 40 | data:1 | 600.000 ms |" in summary


def _without_optional_packages(tmp_path: pathlib.Path, env: dict) -> dict:
    """An environment whose Python (and every process it starts) cannot see OPTIONAL, as on an
    image that never installed them: their finders answer "not found"."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"HIDDEN = {OPTIONAL!r}\n"
        "class Hidden:\n"
        "    def __init__(self, inner): self.inner = inner\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in HIDDEN: return None\n"
        "        return self.inner.find_spec(name, path, target)\n"
        "    def __getattr__(self, name): return getattr(self.inner, name)\n"
        "sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]\n"
    )
    return {**env, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def test_train_plan_and_compare_feeding_start_without_orbax_tfds_tensorboardx_and_matplotlib(tmp_path, env):
    bare = _without_optional_packages(tmp_path, env)

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=ROOT, env=bare, capture_output=True, text=True, timeout=300)

    # The environment really hides them (else this test would prove nothing).
    probe = run("-c", "import importlib.util as u, meshpar.checkpoint, meshpar.train, meshpar.compare_feeding, input_pipeline.tfds_source, sys; "
                      f"print([u.find_spec(m) for m in {OPTIONAL!r}], sorted(m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r}))")  # fmt: skip  # noqa: E501
    assert probe.returncode == 0 and probe.stdout.strip() == f"{[None] * len(OPTIONAL)} []", probe.stderr
    small = ["train.steps=2", "train.eval_every=2", "train.eval_batches=1", "checkpoint.every=0", "train.progress=false"]
    train = run("-m", "meshpar.train", "--config", "experiments/quickstart.yaml", *small, f"workdir={tmp_path / 'train'}")
    assert train.returncode == 0, train.stderr
    assert "tensorboard: skipped: tensorboardX is not installed" in train.stdout
    assert json.loads((tmp_path / "train" / "summary.json").read_text())["steps"] == 2
    plan = run("-m", "meshpar.plan", "--config", "experiments/quickstart.yaml")
    assert plan.returncode == 0 and "fits: needs" in plan.stdout, plan.stderr
    compare = run("-m", "meshpar.compare_feeding", "--config", "experiments/quickstart.yaml", "--modes", "direct", "--prefetch", "0",
                  *small, f"workdir={tmp_path / 'compare'}")  # fmt: skip
    assert compare.returncode == 0, compare.stderr
    assert "plots: skipped: matplotlib is not installed" in compare.stdout
    assert (tmp_path / "compare" / "feed_comparison.json").exists()


@pytest.mark.slow
def test_the_dry_run_runs_every_section_end_to_end_on_cpu(tmp_path, env):
    result = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run", str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=900, env={**env, "PYTHON": sys.executable})  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in OUTPUTS:
        assert (tmp_path / name).stat().st_size > 0, name
    status = {n: json.loads((tmp_path / f"{n}.json").read_text())["status"] for n in ("device", "a_feed", "plan", "b_gpu_lm", "c_feeding")}
    assert set(status.values()) == {"ok"}, status
    assert json.loads((tmp_path / "d_offload.json").read_text())["status"] in ("ok", "skipped")
    pred = json.loads((tmp_path / "e_predictions.json").read_text())
    assert pred["status"] == "ok" and {r["section"] for r in pred["rows"]} >= {"a", "b", "c"}
