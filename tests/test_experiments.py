"""Every shipped experiment config builds and trains; throughput figures agree with each other."""

import json
import pathlib
import re
import shlex

import jax
import numpy as np
import pytest

from meshpar import train
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.plan import __main__ as plan_cli
from meshpar.run import experiment, loop
from meshpar.run.metrics import read_jsonl
from meshpar.step import aot, parts

EXPERIMENTS = sorted(pathlib.Path(__file__).parent.parent.glob("experiments/*.yaml"))
SHORT = ["train.steps=2", "train.log_every=1", "train.eval_batches=1", "train.progress=false"]


def _header(path: pathlib.Path) -> list[str]:
    """The opening comment lines of an experiment, without their '# '."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[2:])
    return lines


def _runs_with(path: pathlib.Path) -> list[str]:
    """The overrides of a command in the header that runs this experiment with changes (the
    change a refused config is trained with), else none."""
    command = f"  python -m meshpar.train --config experiments/{path.name} "
    return next((shlex.split(line[len(command) :]) for line in _header(path) if line.startswith(command)), [])


def test_there_are_experiments():
    names = {p.stem for p in EXPERIMENTS}
    assert {"quickstart", "mlp_data_parallel", "mlp_model_parallel", "transformer_2d"} <= names


# does_not_fit trains a 25.7M-parameter model (about 15 s here): its header's command runs it,
# test_preflight trains a refused config with the change its refusal proposes, and
# test_does_not_fit_is_refused_and_split_as_its_header_says keeps the header's figures true.
SLOW = {"does_not_fit"}


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW else p for p in EXPERIMENTS],
    ids=lambda p: p.stem,
)
def test_experiment_runs_two_steps(path, tmp_path):
    text = path.read_text()
    assert text.startswith(f"# python -m meshpar.train --config experiments/{path.name}\n")
    cfg = config.load(path, [*SHORT, *_runs_with(path), f"workdir={tmp_path}"])
    summary = train.run(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert "final_eval_loss" in summary


def test_does_not_fit_is_refused_and_split_as_its_header_says(tmp_path):
    path = pathlib.Path("experiments/does_not_fit.yaml")
    header = _header(path)
    text = " ".join(line.strip() for line in header)
    refusal = next(line.strip() for line in header if line.strip().startswith("config error: "))
    cfg = config.load(path, [f"workdir={tmp_path}"])
    with pytest.raises(ConfigError) as e:
        experiment.build(cfg)  # the analytic check alone: nothing compiled, nothing allocated
    assert f"config error: {e.value}" == refusal
    assert shlex.split(re.search(r"; fits with (.+) \(needs", refusal).group(1)) == _runs_with(path)
    # The table: parameters + AdamW state per device for model-axis size M, from the shardings.
    claimed = re.search(r"are ([\d.]+), ([\d.]+), ([\d.]+) and ([\d.]+) MiB for M = 1, 2, 4, 8", text).groups()
    whole = int(re.search(r"plus ([\d,]+) bytes held whole", text).group(1).replace(",", ""))
    layout = re.search(r"\(mesh data:8/M,model:M, layout (.+?)\)", text).group(1)
    sizes = (1, 2, 4, 8)
    arrays = {}
    for m in sizes:
        split = config.load(path, [f"mesh=data:{8 // m},model:{m}", f"layout={layout}"])
        arrays[m] = aot.state_bytes(parts.abstract_step(split).plan)
    kept = {name for name, a in arrays[8].items() if a["per_device_bytes"] == a["total_bytes"]}  # not split at all
    for m, mib in zip(sizes, claimed):
        assert f"{sum(a['per_device_bytes'] for a in arrays[m].values()) / 2**20:.2f}" == mib
        assert sum(arrays[m][name]["per_device_bytes"] for name in kept) == whole  # the replicated remainder
        assert all(a["per_device_bytes"] * m == a["total_bytes"] for name, a in arrays[m].items() if name not in kept)


def test_throughput_figures_are_consistent(tmp_path):
    # Two clocks (meshpar.run.loop): the plain figures come from the loop's wall time per step,
    # the step_-prefixed ones from the step time (dispatch → loss on the host).
    cfg = config.load("experiments/quickstart.yaml", [*SHORT, "train.steps=4", f"workdir={tmp_path}"])
    exp = experiment.build(cfg)
    summary = loop.train(exp)
    wall, step = summary["wall_time_per_step_s"], summary["median_step_time_s"]
    batch, devices, length = cfg.train.batch_size, exp.mesh.size, cfg.data.length
    assert exp.tokens_per_example == length
    # Every step's time lies inside the wall time of the same steps (the first, compiling one
    # is left out of both), so wall time per step is at least their mean step time.
    assert wall >= summary["mean_step_time_s"] > 0
    peak = summary["peak_tflops_per_device"]
    for prefix, seconds in (("", wall), ("step_", step)):
        assert summary[f"{prefix}examples_per_s"] == pytest.approx(batch / seconds)
        assert summary[f"{prefix}tokens_per_s"] == pytest.approx(batch * length / seconds)
        tflops = summary["model_flops_per_example"] * batch / seconds / devices / 1e12
        assert summary[f"{prefix}tflops_per_device"] == pytest.approx(tflops)
        assert summary[f"{prefix}mfu"] == pytest.approx(tflops / peak)
    assert 0 < summary["step_mfu"] < 1.5  # measured CPU peak: a sanity bound, not a target
    # The model computes in float32 and a CPU has no faster mode: the peak is a float32 matmul.
    assert summary["peak_tflops_source"] == "measured at start: cpu float32 matmul, all devices busy"
    for row in read_jsonl(tmp_path / "metrics.jsonl"):
        assert row["wall_time_per_step_s"] >= row["step_time_s"] > 0  # window means, same argument
        assert row["tokens_per_s"] == pytest.approx(batch * length / row["wall_time_per_step_s"])
        assert row["step_tokens_per_s"] == pytest.approx(batch * length / row["step_time_s"])
        assert row["mfu"] <= row["step_mfu"]


def test_configured_peak_is_used(tmp_path):
    cfg = config.load("experiments/mlp_data_parallel.yaml", [*SHORT, "hardware.peak_tflops=2.5", f"workdir={tmp_path}"])
    summary = train.run(cfg)
    assert summary["peak_tflops_per_device"] == 2.5 and summary["peak_tflops_source"] == "config"


def test_transformer_routed_equals_direct_bit_for_bit(tmp_path):
    losses = {}
    for mode in ("direct", "routed"):
        cfg = config.load(
            "experiments/quickstart.yaml", [*SHORT, "train.steps=3", f"feed.mode={mode}", f"workdir={tmp_path / mode}"]
        )
        exp = experiment.build(cfg)
        loop.train(exp)
        losses[mode] = ([r["loss"] for r in read_jsonl(tmp_path / mode / "metrics.jsonl")], exp.state.params)
    assert losses["direct"][0] == losses["routed"][0]
    for a, b in zip(jax.tree.leaves(losses["direct"][1]), jax.tree.leaves(losses["routed"][1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_trains_on_tfds_array_record_datasets(tmp_path):
    from tests.tfds_fixtures import build_tiny_dataset, build_tiny_text_dataset

    data_dir = str(tmp_path / "tfds")
    build_tiny_dataset(data_dir)
    build_tiny_text_dataset(data_dir)
    image = config.load(
        "experiments/mlp_data_parallel.yaml",
        [
            *SHORT,
            "train.steps=4",
            "train.batch_size=16",
            "data.source=tfds",
            "data.name=tiny_digits",
            f"data.data_dir={data_dir}",
            "data.eval_split=test",
            f"workdir={tmp_path / 'digits'}",
        ],
    )
    summary = train.run(image)
    assert summary["model_flops_per_example"] == 6 * (64 * 512 + 512 * 256 + 256 * 10)  # 8x8x1 images
    text = config.load(
        "experiments/quickstart.yaml",
        [
            *SHORT,
            "train.batch_size=8",
            "data.source=tfds_text",
            "data.name=tiny_text",
            "data.length=16",
            f"data.data_dir={data_dir}",
            "data.eval_split=test",
            f"workdir={tmp_path / 'text'}",
        ],
    )
    summary = train.run(text)
    assert np.isfinite(summary["final_loss"]) and summary["tokens_per_example"] == 16


@pytest.mark.slow  # the whole run, about a minute; `pytest -m slow` (test_experiment_runs_two_steps covers it in CI)
def test_llama_tiny_trains_as_its_header_says(tmp_path):
    path = pathlib.Path("experiments/llama_tiny.yaml")
    text = " ".join(_header(path))
    first, final = map(float, re.search(r"Train loss ([\d.]+) → ([\d.]+)", text).groups())
    at_50, at_200 = map(float, re.search(r"validation loss ([\d.]+) at step 50, ([\d.]+) at step 200", text).groups())
    summary = train.run(config.load(path, ["train.progress=false", f"workdir={tmp_path}"]))
    evals = {r["step"]: r["eval_loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_loss" in r}
    # float32 on CPU: another machine's reduction order moves the last digits, not the second
    for claimed, got in ((first, summary["first_loss"]), (final, summary["final_loss"]), (at_50, evals[50]),
                         (at_200, evals[200])):  # fmt: skip
        assert abs(got - claimed) <= 0.01 * claimed, (claimed, got)


@pytest.mark.gpu_target
def test_llama3_8b_fp8_is_planned_as_its_header_says(tmp_path):
    """experiments/llama3_8b_fp8.yaml and its bf16 original planned for h100-sxm-8 with XLA's GPU
    compiler (deviceless): the memory, the FP8 GEMMs emitted and both predicted steps as the
    FP8 experiment's header states them."""
    path = pathlib.Path("experiments/llama3_8b_fp8.yaml")
    header = " ".join(_header(path))
    needs = {
        "llama3_8b_fp8": float(re.search(r'plan says "needs ([\d.]+) GiB per device"', header).group(1)),
        "llama3_8b": float(re.search(r"the bf16 original: ([\d.]+) GiB", header).group(1)),
    }
    emitted, meant = (int(x) for x in re.search(r"FP8 dots: (\d+) of (\d+) emitted as FP8 GEMMs", header).groups())
    fp8_ms, bf16_ms = (
        float(x) for x in re.search(r"Predicted step ([\d.]+) ms FP8 against ([\d.]+) ms bf16", header).groups()
    )
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11):  # the header's jax 0.12 figures
        later = re.search(r"jax 0\.12's XLA: .*?([\d.]+) ms FP8 against ([\d.]+) ms bf16", header)
        fp8_ms, bf16_ms = (float(x) for x in later.groups())
    plans = {}
    for name in ("llama3_8b_fp8", "llama3_8b"):
        out = tmp_path / f"{name}.json"
        assert (
            plan_cli.main(["--config", f"experiments/{name}.yaml", "--topology", "h100-sxm-8", "--json", str(out)]) == 0
        )
        plans[name] = json.loads(out.read_text())
    fp8, bf16 = plans["llama3_8b_fp8"], plans["llama3_8b"]
    for name, plan in plans.items():
        assert plan["fits"] and "H100" in plan["compiled_for"]
        assert plan["needed_bytes"] / 2**30 == pytest.approx(needs[name], rel=0.01)
    assert (fp8["fp8"]["emitted"], fp8["fp8"]["meant"]) == (emitted, meant) and "fp8" not in bf16
    assert fp8["time"]["step"]["total_s"] * 1e3 == pytest.approx(fp8_ms, rel=0.01)
    assert bf16["time"]["step"]["total_s"] * 1e3 == pytest.approx(bf16_ms, rel=0.01)
