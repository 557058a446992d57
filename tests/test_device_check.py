"""scripts/device_check.sh, its section drivers (scripts/device_check.py) and its report
(scripts/device_report.py); and that the commands start on an image without the packages only
some commands need (orbax, tensorflow_datasets, tensorboardX, matplotlib).

The whole dry run (about two minutes on 2 cores) is marked slow:
    python -m pytest -m slow tests/test_device_check.py
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from tests.support import script

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTION_FILES = ("device", "a_feed", "plan", "b_gpu_lm", "c_feeding", "f_kernels", "d_offload", "d_unified_memory")
OUTPUTS = (*(f"{n}.json" for n in SECTION_FILES), "e_predictions.json", "summary.md", "sections.tsv")
OPTIONAL = ("orbax", "tensorflow_datasets", "tensorflow", "tensorboardX", "matplotlib", "array_record")


device_check = script("device_check")
device_report = script("device_report")


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
    (tmp_path / "scripts" / "bench_offload.py").write_text(
        "import sys\nprint('offload: no device memory kinds here')\nsys.exit(3)\n"
    )
    out = device_check.offload(args, {})
    assert out["status"] == "skipped"
    assert out["note"] == "skipped: bench_offload.py exited 3: offload: no device memory kinds here"


def test_a_spent_budget_still_leaves_every_output_file_saying_so(tmp_path, env):
    result = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run", str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**env, "DEVICE_CHECK_BUDGET": "20", "PYTHON": sys.executable})  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in OUTPUTS:
        assert (tmp_path / name).stat().st_size > 0, name
    for name in SECTION_FILES:
        section = json.loads((tmp_path / f"{name}.json").read_text())
        assert section["status"] == "skipped" and "budget is spent" in section["note"]
    assert json.loads((tmp_path / "e_predictions.json").read_text())["status"] == "skipped"
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| {n} | skipped |" in summary for n in SECTION_FILES)


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
        "f_kernels": {"status": "ok", "note": "", "results": {
            "gemm": [{"shape": [8192, 8192, 8192], "measured_s": 0.0015, "tflops": 733.0, "predicted_s": 0.00148,
                      "ratio": 1.01}],
            "launch": {"kernels": 256, "measured_s": 4e-6, "predicted_s": 3e-6, "ratio": 1.33}}},
    }  # fmt: skip
    for name, body in sections.items():
        (results / f"{name}.json").write_text(json.dumps({"section": name, **body}))


def test_the_report_sets_the_time_models_prediction_beside_each_measurement(tmp_path):
    from meshpar.configuration import config
    from meshpar.plan import cost, topology
    from meshpar.plan.time import feed_time

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
    assert "| GEMM 8192x8192x8192 (733 TFLOP/s) |" in summary and "| a kernel's fixed cost |" in summary
    assert "With one device: the same path." in summary and "| 40 | data:1 | 600.000 ms |" in summary


GIB = 2**30


def _out_of_core_rows(sizes: list[int], device: int) -> list[dict]:
    """Rows as ``python -m meshpar.plan --compare-out-of-core --json`` writes them: no offload
    needs 16 GiB + 0.7 GiB per sequence; unified memory pages what exceeds the device."""
    rows = []
    for b in sizes:
        need = int((16 + 0.7 * b) * GIB)

        def row(method, kind, overrides, device_bytes, host=0, migrated=0, step=0.02 * b, fits=None):
            return {"batch_size": b, "method": method, "kind": kind, "overrides": overrides, "device_bytes": device_bytes,
                    "host_bytes": host, "migrated_bytes": migrated, "step_s": step,
                    "fits": device_bytes <= device if fits is None else fits}  # fmt: skip

        rows += [
            row("no offload", "none", ["offload.optimizer=false"], need),
            row("unified memory", "unified", ["offload.unified_memory=true", "offload.oversubscription=1.5"], min(need, device),
                migrated=max(0, need - device), step=0.02 * b + max(0, need - device) / 25e9, fits=need <= 1.5 * device),
            row("offload.optimizer", "swap", ["offload.optimizer=true"], need - 8 * GIB, host=8 * GIB, step=0.02 * b + 0.3),
            row("offload.activations=dots", "swap", ["model.remat=none", "offload.activations=dots"], (16 + 0.1 * b) * GIB,
                host=int(0.6 * b * GIB), step=0.02 * b + 1.0),
            row("model.remat=full", "remat", ["model.remat=full"], (16 + 0.2 * b) * GIB, step=0.03 * b),
        ]  # fmt: skip
    return rows


def test_the_out_of_core_sweep_and_the_rows_it_trains():
    sizes = device_check.batch_sweep(16)
    assert sizes[0] == 8 and sizes[-1] == 2048 and all(b % 8 == 0 for b in sizes)
    assert max(b / a for a, b in zip(sizes, sizes[1:]) if a >= 32) < 1.3  # four per doubling, rounded to multiples of 8
    assert device_check.batch_sweep(8)[:3] == [8, 16, 24]
    rows = _out_of_core_rows([128, 256], 100 * GIB)
    # At 128 both swap rows fit: the faster; at 256 only activations=dots does.
    assert device_check.out_of_core_runs(rows, 128)["swap"]["method"] == "offload.optimizer"
    picked = device_check.out_of_core_runs(rows, 256)
    assert {k: r["method"] for k, r in picked.items()} == {"none": "no offload", "unified": "unified memory",
                                                             "swap": "offload.activations=dots"}  # fmt: skip
    # No swap row fits: the one needing least device memory, still marked as not fitting.
    rows = [r for r in rows if r["method"] != "offload.activations=dots"]
    assert device_check.out_of_core_runs(rows, 256)["swap"]["fits"] is False
    assert device_check.is_cuda({"platform": "gpu", "device_kind": "NVIDIA H200"})
    assert not device_check.is_cuda({"platform": "cpu", "device_kind": "cpu"})


def _unified_section(tmp_path, monkeypatch, swap_fits: bool):
    """The section's GPU path without a GPU: the batch-size sweep, the planner and the two runs
    are stand-ins writing what the real commands write (on 8 GPUs: it runs on the first); the
    unified-memory run dies after two steps, out of memory."""
    device_bytes, calls = 100 * GIB, []

    def fake(cmd, seconds, log, env=None):
        calls.append((cmd, seconds, env))
        out = pathlib.Path(cmd[cmd.index("--json") + 1]) if "--json" in cmd else None
        if "out-of-core-sweep" in cmd:
            out.write_text(
                json.dumps({"batch_size": 152, "device_bytes": device_bytes, "none_device_bytes": {"128": 1, "152": 2}})
            )
            return 0, "batch 152\n"
        if "meshpar.plan" in cmd:
            rows = _out_of_core_rows([int(cmd[cmd.index("--batch-sweep") + 1])], device_bytes)
            rows = [r for r in rows if swap_fits or r["method"] != "offload.activations=dots"]
            out.write_text(json.dumps({"topology": "h200-sxm-1", "compiled_for": "XLA:GPU", "device_bytes": device_bytes,
                                       "usable_bytes": device_bytes, "oversubscription": 1.5, "rows": rows}))  # fmt: skip
            return 0, "planned\n"
        workdir = pathlib.Path(next(c for c in cmd if c.startswith("workdir=")).split("=", 1)[1])
        workdir.mkdir(parents=True)
        if "offload.unified_memory=true" in cmd:
            (workdir / "metrics.jsonl").write_text(
                '{"step": 1, "step_time_s": 40.0}\n{"step": 2, "step_time_s": 5.0}\n'
            )
            return 1, "step 2\ntraining error: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB\n"
        (workdir / "step_times.json").write_text(json.dumps({"step_time_s": [30.0, 3.0, 3.4, 3.1, 3.3, 3.2]}))
        (workdir / "summary.json").write_text(
            json.dumps({"input_memory": {"memory_stats_peak_bytes_in_use": {"0": 90 * GIB}}})
        )
        return 0, "done\n"

    monkeypatch.setattr(device_check, "run", fake)
    args = type("Args", (), {"work": tmp_path / "work", "results": tmp_path, "seconds": 200.0, "dry_run": False,
                             "log": tmp_path / "d.log"})()  # fmt: skip
    args.work.mkdir()
    device = {"platform": "gpu", "device_kind": "NVIDIA H200", "devices": 8, "topology": "h200-sxm-8"}
    out = device_check.unified(args, device)
    assert out["topology"] == "h200-sxm-1" and all(env == {"CUDA_VISIBLE_DEVICES": "0"} for _, _, env in calls)
    plan = next(c for c, _, _ in calls if "meshpar.plan" in c)
    assert plan[plan.index("--batch-sweep") + 1] == "152" and out["batch_size"] == 152
    assert out["planner"]["none_over_device"] == pytest.approx((16 + 0.7 * 152) / 100)
    train = [c for c, _, _ in calls if "meshpar.train" in c]
    assert all("train.batch_size=152" in c and "mesh=data:1" in c for c in train)
    runs = {r["name"]: r for r in out["runs"]}
    assert runs["none"]["status"] == "not run" and not runs["none"]["predicted"]["fits"]
    um = runs["unified"]
    assert um["predicted"]["migrated_bytes"] > 0 and um["predicted"]["device_bytes"] == device_bytes
    assert um["status"] == "failed" and um["note"].endswith(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB"
    )
    assert um["median_step_time_s"] == 5.0 and um["step_time_source"].startswith("metrics.jsonl")
    assert "offload.oversubscription=1.5" in train[0]
    assert out["status"] == "failed"  # the unified-memory run was predicted to fit
    return out, runs, train


def test_the_unified_memory_section_on_a_gpu_measures_both_runs_and_records_a_failed_one(tmp_path, monkeypatch):
    out, runs, train = _unified_section(tmp_path, monkeypatch, swap_fits=True)
    swap = runs["swap"]
    assert len(train) == 2 and "offload.activations=dots" in train[1]
    assert swap["method"] == "offload.activations=dots" and swap["status"] == "ok"
    assert swap["median_step_time_s"] == 3.2 and swap["memory_stats_peak_bytes"] == 90 * GIB

    # The report: the table, and each measurement beside its prediction (unified memory's peak
    # counts migrated pages too).
    _write_sections(tmp_path)
    (tmp_path / "d_unified_memory.json").write_text(json.dumps({"section": "d_unified_memory", **out}))
    device_report.main(["--results", str(tmp_path)])
    rows = {r["quantity"]: r for r in json.loads((tmp_path / "e_predictions.json").read_text())["rows"]}
    assert rows["out of core: offload.activations=dots, batch 152: step time (median)"]["measured"] == 3.2
    peak = rows["out of core: offload.activations=dots, batch 152: peak memory (vs device bytes)"]
    assert peak["predicted"] == swap["predicted"]["device_bytes"] and peak["measured"] == 90 * GIB
    assert (
        rows["out of core: unified memory, batch 152: step time (median)"]["predicted"]
        == runs["unified"]["predicted"]["step_s"]
    )
    summary = (tmp_path / "summary.md").read_text()
    assert "## (d) Unified memory vs swap" in summary and "| d_unified_memory | failed |" in summary
    assert "| unified memory | 152 | " in summary and "RESOURCE_EXHAUSTED" in summary


def test_with_no_swap_setting_that_fits_only_unified_memory_runs(tmp_path, monkeypatch):
    out, runs, train = _unified_section(tmp_path, monkeypatch, swap_fits=False)
    assert len(train) == 1 and runs["swap"]["status"] == "not run" and not runs["swap"]["predicted"]["fits"]
    assert runs["swap"]["note"].startswith("no swap setting fits at batch 152")


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
    probe = run("-c", "import importlib.util as u, meshpar.checkpoints.checkpoint, meshpar.train, meshpar.compare_feeding, input_pipeline.tfds_source, sys; "
                      f"print([u.find_spec(m) for m in {OPTIONAL!r}], sorted(m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r}))")  # fmt: skip  # noqa: E501
    assert probe.returncode == 0 and probe.stdout.strip() == f"{[None] * len(OPTIONAL)} []", probe.stderr
    small = [
        "train.steps=2",
        "train.eval_every=2",
        "train.eval_batches=1",
        "checkpoint.every=0",
        "train.progress=false",
    ]
    train = run(
        "-m", "meshpar.train", "--config", "experiments/quickstart.yaml", *small, f"workdir={tmp_path / 'train'}"
    )
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
    status = {n: json.loads((tmp_path / f"{n}.json").read_text())["status"]
              for n in ("device", "a_feed", "plan", "b_gpu_lm", "c_feeding", "f_kernels")}  # fmt: skip
    assert set(status.values()) == {"ok"}, status
    assert json.loads((tmp_path / "d_offload.json").read_text())["status"] in ("ok", "skipped")
    pred = json.loads((tmp_path / "e_predictions.json").read_text())
    assert pred["status"] == "ok" and {r["section"] for r in pred["rows"]} >= {"a", "b", "c"}
    # Unified memory vs swap: skipped off a CUDA GPU, but planned, and the run refused in one line.
    um = json.loads((tmp_path / "d_unified_memory.json").read_text())
    assert um["status"] == "skipped" and um["note"] == "skipped: unified memory needs a CUDA GPU (platform cpu)"
    planner, device_bytes = um["planner"], um["planner"]["device_bytes"]
    assert 0 < device_bytes <= device_check.DRY_UM_DEVICE_GIB * 2**30  # the dry run's small planned device
    # The batch size whose need without offload is closest to 1.3 x the device, of a geometric range.
    needs = {int(b): n for b, n in planner["none_device_bytes"].items()}
    assert len(needs) >= 8 and needs[um["batch_size"]] == min(needs.values(), key=lambda n: abs(n - 1.3 * device_bytes))
    assert planner["none_over_device"] == pytest.approx(needs[um["batch_size"]] / device_bytes)
    assert 1.1 < planner["none_over_device"] < 1.5 and {r["batch_size"] for r in um["rows"]} == {um["batch_size"]}
    runs = {r["name"]: r for r in um["runs"]}
    assert {"none", "unified", "swap"} <= set(runs) and all(
        r["status"] == "not run (no CUDA GPU)" for r in runs.values()
    )
    none, unified = runs["none"]["predicted"], runs["unified"]["predicted"]
    assert "offload.unified_memory=true" in runs["unified"]["overrides"]
    assert none["device_bytes"] > device_bytes and not none["fits"]
    assert unified["migrated_bytes"] > 0 and unified["device_bytes"] <= device_bytes and unified["fits"]
    assert (
        unified["device_bytes"] + unified["migrated_bytes"] >= none["device_bytes"] * 0.9
        and unified["step_s"] > none["step_s"]
    )
    refusal = um["refusal"]
    assert refusal["refused"] and refusal["rc"] == 2 and "offload.unified_memory=true" in refusal["command"]
    assert refusal["line"].startswith("config error: offload.unified_memory: needs a CUDA GPU")
    summary = (tmp_path / "summary.md").read_text()
    assert "## (d) Unified memory vs swap" in summary and "| d_unified_memory | skipped |" in summary
    assert "not run (no CUDA GPU)" in summary and f"`{refusal['line']}`" in summary
