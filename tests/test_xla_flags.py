"""The ``xla:`` section (meshpar.backend.xla_flags): XLA's flags checked at config load, the GPU
defaults, and the same flags on every compile of a config's programs — the run's, the plan's, on
CPU and on XLA:GPU compiled deviceless. Each test reads the compiled program, so it fails if the
flags were dropped on the way."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from meshpar.backend import compile_cache, xla_flags
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError
from meshpar.plan import __main__ as plan_cli
from meshpar.plan import report as report_lib
from meshpar.run import experiment
from meshpar.step import parts, programs

TINY = {
    "mesh": "data:8",
    "layout": "batch:data",
    "model": {"name": "mlp", "hidden": [32, 32]},
    "data": {"num_examples": 64, "num_eval_examples": 0, "num_features": 16, "num_classes": 10},
    "train": {"steps": 2, "batch_size": 8, "progress": False},
}
# A flag whose effect on XLA:CPU's program is plain to see: no fusion pass, more instructions.
NO_FUSION = {"xla_disable_hlo_passes": "fusion"}


def _cfg(xla: dict | None = None, **more):
    return config_lib.from_dict({**TINY, **more, **({"xla": xla} if xla is not None else {})})


def _program(hlo: str) -> str:
    """HLO text without source locations (file paths and lines differ between call sites): the
    header and every computation, without the tables of files, functions and frames or metadata."""
    blocks = [b for b in hlo.split("\n\n") if b.split("\n", 1)[0] not in SOURCE_TABLES]
    return re.sub(r",? metadata=\{[^}]*\}", "", "\n\n".join(blocks))


SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _fusions(hlo: str) -> int:
    return len(re.findall(r" fusion\(", hlo))


def test_a_flag_changes_the_program_compiled_on_cpu_ahead_of_time_and_at_the_first_call():
    plain, flagged = parts.abstract_step(_cfg()), parts.abstract_step(_cfg({"flags": NO_FUSION}))
    assert plain.compiler_options == {} and flagged.compiler_options == NO_FUSION
    base, with_flag = plain.compile().as_text(), flagged.compile().as_text()
    assert _fusions(with_flag) != _fusions(base)
    # The jitted step itself carries them: a compile that names no options (the run's first call
    # when nothing was compiled ahead) gets the same program.
    assert _program(flagged.lower().compile().as_text()) == _program(with_flag)


def test_the_run_and_the_plan_compile_the_same_program(tmp_path):
    cfg = _cfg({"flags": NO_FUSION}, workdir=str(tmp_path))
    step = parts.abstract_step(cfg)
    planned = report_lib.plan(step, programs.compile_all(step))  # what `python -m meshpar.plan` compiles
    assert planned.xla_flags == NO_FUSION and planned.to_json()["xla_flags"] == NO_FUSION
    ran = experiment.build(cfg).train_step.compiled  # what `python -m meshpar.train` executes
    assert _program(ran.as_text()) == _program(planned.compiled.as_text())
    assert _program(ran.as_text()) != _program(parts.abstract_step(_cfg()).compile().as_text())


def test_without_the_pre_flight_the_run_still_compiles_with_the_flags(tmp_path):
    cfg = _cfg({"flags": NO_FUSION}, workdir=str(tmp_path), plan={"check": False})
    exp = experiment.build(cfg)
    assert not hasattr(exp.train_step, "compiled")  # jitted: compiled at its first call
    assert _program(exp.train_step.lower(*exp.step.args).compile().as_text()) == _program(
        parts.abstract_step(cfg).compile().as_text()
    )


def test_gpu_defaults_apply_to_gpu_compiles_only_and_a_flag_overrides_one():
    assert xla_flags.defaults("cpu") == {} and xla_flags.options({}, True, "cpu") == {}
    gpu = xla_flags.options({}, True, "gpu")
    assert gpu == xla_flags.defaults("gpu")
    assert gpu["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert set(gpu) <= set(xla_flags.GPU_DEFAULTS)
    override = xla_flags.options({"xla_gpu_all_reduce_combine_threshold_bytes": 5}, True, "gpu")
    assert override == {**gpu, "xla_gpu_all_reduce_combine_threshold_bytes": 5}
    assert xla_flags.options({"xla_gpu_all_reduce_combine_threshold_bytes": 5}, False, "gpu") == {
        "xla_gpu_all_reduce_combine_threshold_bytes": 5
    }
    # On CPU only the config's flags, GPU ones included: DebugOptions has them on every backend.
    lhs = {"xla_gpu_enable_latency_hiding_scheduler": True}
    step = parts.abstract_step(_cfg({"flags": lhs}))
    assert step.compiler_options == lhs
    assert step.compile() is not None


def test_a_default_the_installed_jaxlib_lacks_is_left_out(monkeypatch):
    monkeypatch.setitem(xla_flags.GPU_DEFAULTS, "xla_gpu_no_such_flag_anywhere", True)
    assert "xla_gpu_no_such_flag_anywhere" not in xla_flags.defaults("gpu")


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"xla_gpu_foo": True}, r"^xla\.flags\.xla_gpu_foo: not an XLA flag"),
        ({"gpu_foo": True}, r"^xla\.flags\.gpu_foo: not an XLA flag"),
        (
            {"xla_gpu_enable_latency_hiding_scheduler": "yes"},
            r"^xla\.flags\.xla_gpu_enable_latency_hiding_scheduler: expected true or false \(XLA's bool flag\), "
            r"got 'yes' \(str\)$",
        ),
        (
            {"xla_gpu_all_reduce_combine_threshold_bytes": 1.5},
            r"^xla\.flags\.xla_gpu_all_reduce_combine_threshold_bytes: expected an integer",
        ),
        ({"xla_disable_hlo_passes": 3}, r"^xla\.flags\.xla_disable_hlo_passes: expected a string"),
        ({"xla_gpu_enable_command_buffer": "NOPE"}, r"^xla\.flags\.xla_gpu_enable_command_buffer: XLA refuses"),
        ({"xla_disable_hlo_passes": [1]}, r"^xla\.flags\.xla_disable_hlo_passes: expected true or false, a number"),
    ],
)
def test_a_flag_xla_would_refuse_is_one_config_error_at_load(flags, message):
    with pytest.raises(ConfigError, match=message) as e:
        _cfg({"flags": flags})
    assert "\n" not in str(e.value)


def test_the_section_refuses_unknown_keys():
    with pytest.raises(ConfigError, match=r"^xla\.flag: unknown key \(known: flags, gpu_defaults\)"):
        _cfg({"flag": {}})


@pytest.mark.parametrize(
    "override, message",
    [
        ("xla.flags.xla_gpu_foo=true", r"^config error: xla\.flags\.xla_gpu_foo: not an XLA flag"),
        (
            "xla.flags.xla_gpu_enable_latency_hiding_scheduler=3",
            r"^config error: xla\.flags\.xla_gpu_enable_latency_hiding_scheduler: expected true or false",
        ),
    ],
)
def test_the_train_command_exits_2_with_one_line(tmp_path, env, override, message):
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(TINY))
    result = subprocess.run(
        [sys.executable, "-m", "meshpar.train", "--config", str(path), f"workdir={tmp_path / 'run'}", override],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(message, lines[0]), result.stderr
    assert not (tmp_path / "run").exists()


def test_the_plan_shows_the_flags_it_compiled_with(tmp_path, capsys):
    path, out = tmp_path / "x.yaml", tmp_path / "plan.json"
    path.write_text(yaml.safe_dump({**TINY, "xla": {"flags": NO_FUSION}}))
    plan_cli.main(["--config", str(path), "--json", str(out)])
    assert json.loads(out.read_text())["xla_flags"] == NO_FUSION
    assert "compiled with XLA flags: --xla_disable_hlo_passes=fusion" in " ".join(capsys.readouterr().out.split())


def test_a_compile_option_wins_over_the_same_flag_in_xla_flags(tmp_path, env):
    """XLA_FLAGS sets the process's defaults; a config's flag overrides the same flag there."""
    script = (
        "import re, sys; from meshpar.configuration import config; from meshpar.step import aot\n"
        "cfg = config.load(sys.argv[1], sys.argv[2:])\n"
        "print(len(re.findall(r' fusion\\(', aot.compile_train_step(cfg).as_text())))\n"
    )
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({**TINY, "compile_cache": {"dir": ""}}))

    def fusions(xla_env: str, *overrides: str) -> int:
        run_env = {**env, "XLA_FLAGS": xla_env}
        result = subprocess.run(
            [sys.executable, "-c", script, str(path), *overrides], capture_output=True, text=True, env=run_env,
            timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return int(result.stdout.split()[-1])

    plain, off = fusions(""), fusions("--xla_disable_hlo_passes=fusion")
    assert off != plain  # XLA_FLAGS applies to the config's compile
    assert fusions("--xla_disable_hlo_passes=fusion", "xla.flags.xla_disable_hlo_passes=''") == plain


def test_a_flag_string_becomes_the_mapping_and_a_config_section():
    text = (
        "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_all_reduce_combine_threshold_bytes=1073741824 "
        "--xla_gpu_enable_command_buffer= --xla_disable_hlo_passes=rematerialization --xla_gpu_enable_triton_gemm=false"
    )
    flags = xla_flags.parse_flag_string(text)
    assert flags == {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_all_reduce_combine_threshold_bytes": 1073741824,
        "xla_gpu_enable_command_buffer": "",
        "xla_disable_hlo_passes": "rematerialization",
        "xla_gpu_enable_triton_gemm": False,
    }
    assert xla_flags.parse_flag_string(xla_flags.format_flag_string(flags)) == flags
    cfg = config_lib.from_dict({**TINY, "xla": xla_flags.section(flags)})
    assert cfg.xla.flags == flags and cfg.xla.gpu_defaults is False
    # Bare flags, quoting, an enum as XLA_FLAGS writes it, a later flag over an earlier one.
    assert xla_flags.parse_flag_string(
        "--xla_gpu_enable_latency_hiding_scheduler --xla_gpu_enable_command_buffer=fusion,custom_call "
        "'--xla_dump_to=/tmp/a b' --xla_gpu_enable_latency_hiding_scheduler=false"
    ) == {
        "xla_gpu_enable_latency_hiding_scheduler": False,
        "xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL",
        "xla_dump_to": "/tmp/a b",
    }
    with pytest.raises(ValueError, match="'-x' is not an XLA flag"):
        xla_flags.parse_flag_string("--xla_a=1 -x")
    # A published run's flags may name fields this jaxlib no longer has: known() separates them.
    old = xla_flags.parse_flag_string("--xla_gpu_graph_level=0 --xla_gpu_enable_latency_hiding_scheduler=true")
    assert old == {"xla_gpu_graph_level": 0, "xla_gpu_enable_latency_hiding_scheduler": True}
    assert xla_flags.known(old) == ({"xla_gpu_enable_latency_hiding_scheduler": True}, ["xla_gpu_graph_level"])


def test_checking_flags_starts_no_backend():
    """A config is checked before jax.distributed and the unified-memory variables: asking XLA
    about its flags must not start jax's backends (a fresh process shows it)."""
    script = (
        "from meshpar import jax_compat; from meshpar.backend import xla_flags\n"
        "xla_flags.check({'xla_gpu_enable_latency_hiding_scheduler': True})\n"
        "assert xla_flags.problem('xla_gpu_foo', 1).startswith('not an XLA flag')\n"
        "print(jax_compat.backends_started())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.split()[-1] == "False", result.stderr


def test_checking_a_dump_flag_dumps_nothing(tmp_path, capfd):
    """XLA is asked by compiling a trivial program with the flag: one that dumps must not."""
    folder = tmp_path / "dumps"
    xla_flags.check({"xla_dump_to": str(folder), "xla_dump_hlo_as_text": True})
    assert not folder.exists() and "HloModule" not in capfd.readouterr().out


# --- XLA:GPU, compiled deviceless (the gpu-plan extra) ---------------------------------------------

# Gradients of 3 x 16 MiB: over XLA's own all-reduce combine threshold, under the defaults'.
WIDE = {**TINY, "model": {"name": "mlp", "hidden": [2048, 2048, 2048]}, "data": {**TINY["data"], "num_features": 2048}}


def _gpu_all_reduces(xla: dict) -> tuple[int, dict]:
    from meshpar.plan import gpu_target, topology

    target = gpu_target.target(topology.load("h100-sxm-8"), "data:8")
    assert target.compile_only
    with compile_cache.suspended():
        step = parts.abstract_step(config_lib.from_dict({**WIDE, "xla": xla}), devices=target.devices)
        text = step.compile().as_text()
    return len(re.findall(r" all-reduce-start\(", text)), step.compiler_options


@pytest.mark.gpu_target
def test_the_gpu_defaults_and_a_flag_change_the_h100_program():
    defaults, options = _gpu_all_reduces({})
    assert options == xla_flags.defaults("gpu") and options["xla_gpu_all_reduce_combine_threshold_bytes"] == 1 << 30
    none, bare = _gpu_all_reduces({"gpu_defaults": False})
    assert bare == {}
    assert defaults == 1 < none  # the defaults' 1 GiB threshold combines what XLA's own 30 MiB does not
    split, options = _gpu_all_reduces({"flags": {"xla_gpu_all_reduce_combine_threshold_bytes": 0}})
    assert options["xla_gpu_all_reduce_combine_threshold_bytes"] == 0
    assert options["xla_gpu_enable_latency_hiding_scheduler"] is True  # the other defaults stay
    assert split > none  # nothing combined: one all-reduce per gradient
