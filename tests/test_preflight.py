"""The memory pre-flight of a run (plan.check): refusals before anything exists, the change it
proposes, and the compiled train step the run then uses."""

import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

from meshpar import train
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.plan import cost, report
from meshpar.plan.search import candidates
from meshpar.run import experiment, loop
from meshpar.run.metrics import read_jsonl
from meshpar.step import parts, programs

# An MLP whose parameters and Adam moments (about 1.1 MiB per device when replicated over
# data:8) overflow a device planned at 1 MiB: split 8 ways they fit.
TINY = {
    "mesh": "data:8",
    "layout": "batch:data",
    "model": {"name": "mlp", "hidden": [256, 256]},
    "data": {"num_examples": 512, "num_eval_examples": 0, "num_features": 64},
    "train": {"steps": 3, "batch_size": 32, "log_every": 1, "progress": False},
    "hardware": {"memory_gib": 1 / 1024},
}
ABSURD = ["model.hidden=[2000000000,256]", "data.num_examples=512", "data.num_eval_examples=0", "train.progress=false"]


def _cfg(tmp_path, *overrides, **sections):
    raw = config.apply_overrides({**TINY, **sections, "workdir": str(tmp_path / "run")}, overrides)
    return config.from_dict(raw)


@pytest.fixture
def lowerings():
    """Names of the programs lowered to XLA while the test runs (every compilation, cached or
    not, starts with one)."""
    names = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            names.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield names
    jax.monitoring.unregister_event_duration_listener(listen)


def _steps(names):
    return [n for n in names if n == "jit(step)"]  # the train step (the eval step is off here)


def _proposal(message: str) -> list[str]:
    found = re.search(r"; fits with (.+) \(needs [\d.,]+ [KMG]iB\)$", message)
    assert found, message
    return shlex.split(found.group(1))


def test_an_absurd_size_is_refused_from_the_analytic_model_alone(tmp_path, lowerings):
    overrides = [*ABSURD, f"workdir={tmp_path / 'run'}", "checkpoint.every=1"]
    cfg = config.load("experiments/mlp_model_parallel.yaml", overrides)
    before = jax.live_arrays()
    with pytest.raises(ConfigError) as e:
        experiment.build(cfg)
    message = str(e.value)
    assert re.fullmatch(
        r"model: does not fit: needs [\d,.]+ GiB per device \(largest: optimizer [\d,.]+ GiB\), "
        r"[\d,.]+ [MG]iB usable on host RAM .+; none of the \d+ candidate changes fits "
        r"\(closest: mesh=data:1,model:8 offload.optimizer=true, needs at least [\d,.]+ GiB\)",
        message,
    ), message
    assert lowerings == []  # nothing compiled
    after = jax.live_arrays()  # nothing allocated
    assert len(after) <= len(before) and sum(a.nbytes for a in after) <= sum(a.nbytes for a in before)
    assert not (tmp_path / "run").exists()  # not even the run's folders


def test_a_refused_layout_trains_with_the_change_the_refusal_proposes(tmp_path):
    with pytest.raises(ConfigError) as e:
        experiment.build(_cfg(tmp_path))
    message = str(e.value)
    assert message.startswith("param_layout: does not fit: needs ")
    assert "usable on hardware.memory_gib=0.000976562" in message
    proposed = _proposal(message)
    assert proposed == ["param_layout=hidden:data"]  # the first candidate that fits: FSDP over data
    summary = train.run(_cfg(tmp_path, *proposed))
    assert np.isfinite(summary["final_loss"]) and summary["final_loss"] != summary["first_loss"]


def test_the_run_calls_the_programs_compiled_by_the_preflight_and_never_compiles_them_again(tmp_path, lowerings):
    def runs(*overrides):
        return _cfg(
            tmp_path / overrides[0], *overrides[1:], "data.num_eval_examples=64", "train.eval_every=3",
            "checkpoint.every=3", hardware={"memory_gib": 0},
        )  # fmt: skip

    def programs():  # the train and eval steps are both jit(step); the checkpoint digest is jit(_digest)
        return {n: lowerings.count(n) for n in ("jit(step)", "jit(_digest)")}

    exp = experiment.build(runs("checked"))
    assert exp.train_step.compiled is not None and exp.eval_step.compiled is not None
    assert exp.checkpointer.digest_program is not None
    assert programs() == {"jit(step)": 2, "jit(_digest)": 1}  # compiled ahead of time, before the state existed
    loop.train(exp)
    assert programs() == {"jit(step)": 2, "jit(_digest)": 1}  # three steps, an eval and a save later: the same
    lowerings.clear()
    unchecked = experiment.build(runs("unchecked", "plan.check=false"))
    assert not hasattr(unchecked.train_step, "compiled") and programs() == {"jit(step)": 0, "jit(_digest)": 0}
    loop.train(unchecked)  # compiled lazily, at their first call (the digest's lowering is cached in-process)
    assert programs()["jit(step)"] == 2
    # The same program either way: bit-identical losses.
    rows = [read_jsonl(tmp_path / run / "run" / "metrics.jsonl") for run in ("checked", "unchecked")]
    losses = [[r["loss"] for r in runs] for runs in rows]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_plan_check_false_skips_the_check(tmp_path, lowerings):
    exp = experiment.build(_cfg(tmp_path, "plan.check=false"))  # refused with the check on
    assert _steps(lowerings) == [] and not hasattr(exp.train_step, "compiled")
    assert int(exp.state.step) == 0


def test_a_resumed_state_runs_on_the_compiled_step(tmp_path, lowerings):
    # decay_steps fixed: the resumed run's schedule (and so its step) is the first run's.
    first = _cfg(tmp_path, "checkpoint.every=2", "train.steps=2", "optimizer.decay_steps=4", hardware={"memory_gib": 0})
    train.run(first)
    lowerings.clear()
    resumed = _cfg(
        tmp_path, "checkpoint.every=2", "train.steps=4", "optimizer.decay_steps=4", "checkpoint.resume=auto",
        hardware={"memory_gib": 0},
    )  # fmt: skip
    exp = experiment.build(resumed)
    assert exp.resumed_from == 2 and exp.train_step.compiled is not None
    summary = loop.train(exp)
    assert np.isfinite(summary["final_loss"]) and len(_steps(lowerings)) == 1


def test_fsdp_dims_cover_every_weight_once_along_its_embed_like_dim():
    def params(cfg_path, *overrides):
        cfg = config.load(cfg_path, list(overrides))
        from meshpar.step import parts

        return candidates.param_dims(parts.abstract_step(cfg).plan.abstract.params)

    quick = params("experiments/quickstart.yaml", "data.max_bytes=100000")
    assert candidates.fsdp_dims(quick, {"batch", "d_ff", "heads", "vocab"}, 4) == ["embed"]
    mlp = params("experiments/mlp_model_parallel.yaml", "data.num_examples=64", "data.num_eval_examples=0")
    assert candidates.fsdp_dims(mlp, {"batch", "hidden"}, 4) == ["pixels", "hidden_2"]
    assert candidates.fsdp_dims(mlp, {"batch"}, 4) == ["hidden"]  # hidden_2 shares a weight with it
    assert candidates.fsdp_dims(mlp, {"batch", "hidden"}, 3) == []  # no dim divides 3 ways


def test_the_cli_refuses_in_one_line_with_exit_2(tmp_path, env):
    result = subprocess.run(
        [sys.executable, "-m", "meshpar.train", "--config", "experiments/mlp_model_parallel.yaml", *ABSURD,
         f"workdir={tmp_path / 'run'}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1
    assert result.stderr.startswith("config error: model: does not fit: needs ")
    assert not (tmp_path / "run").exists()


def test_xla_figures_that_do_not_fit_are_refused_after_the_compile(tmp_path, lowerings):
    step = parts.abstract_step(_cfg(tmp_path / "plan", hardware={"memory_gib": 0}))
    plan = report.plan(step, programs.compile_all(step))
    analytic, needed = plan.analytic.total, plan.needed_bytes
    if needed <= analytic:
        pytest.skip("XLA's figures for this config are not above the analytic total")
    # A device whose usable bytes lie between the two: the analytic check passes, XLA's fails.
    gib = (analytic + needed) / 2 / (1 - cost.HEADROOM_FRACTION) / cost.GIB
    lowerings.clear()
    cfg = _cfg(tmp_path, f"hardware.memory_gib={gib!r}")
    with pytest.raises(ConfigError) as e:
        experiment.build(cfg)
    assert re.match(rf"\w[\w.]*: does not fit: needs {report.fmt_bytes(needed)} per device \(.*peak", str(e.value))
    assert len(_steps(lowerings)) == 1  # refused by the compiled step's figures
    _proposal(str(e.value))  # and still a change that fits


def test_fsdp_takes_the_familys_dims_and_never_a_second_dim_on_an_axis():
    from meshpar.step import parts

    cfg = config.load("experiments/transformer_fsdp.yaml", ["data.max_bytes=100000"])
    step = parts.abstract_step(cfg)
    params = candidates.param_dims(step.plan.abstract.params)
    spec = {"tokens": ((129,), np.dtype(np.uint8))}
    sizes = dict(step.mesh.shape)
    # Its own param_layout has embed on data: no other dim of a weight may go there too (kv
    # would, by bytes alone: blocks/wk ('layers', 'embed', 'heads', 'kv')).
    assert candidates.fsdp_dims(params, {"batch", "d_ff", "heads", "vocab", "embed"}, 4) == ["kv"]
    assert candidates.fsdp_dims(params, {"batch", "d_ff", "heads", "vocab", "embed"}, 4, busy={"embed"}) == []
    with pytest.raises(ConfigError) as e:
        candidates.fsdp_param_layout(cfg, spec, params, ("data",), sizes)
    assert str(e.value) == "param_layout: FSDP over data: embed is split by param_layout already (embed:data)"
    # Without it, the family's embed; replacing it (the search), the same.
    assert candidates.fsdp_param_layout(cfg, spec, params, ("data",), sizes, param_layout="") == "embed:data"
    assert candidates.fsdp_dims(params, set(), 4, order=("embed",)) == ["embed"]
    # No proposal of the pre-flight puts two dims of one parameter on one axis.
    skipped = []
    for cand in candidates.candidates(cfg, step.mesh, step.plan.abstract.params, spec, skipped):
        assert "kv:" not in dict(cand.changes).get("param_layout", "")
    assert any(why.endswith("embed is split by param_layout already (embed:data)") for _, why in skipped)
