"""meshpar.backend.unified_memory: the environment offload.unified_memory needs, decided from the config
and an environment passed in; the after-start check; the refusal on a host without a CUDA GPU.
What the variables do on a GPU is the device check's (scripts/device_check.sh)."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from meshpar import jax_compat
from meshpar.backend import quiet, unified_memory
from meshpar.backend.allocator import FRACTION_VARIABLES
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError, OffloadConfig

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
UM = OffloadConfig(unified_memory=True)  # oversubscription 1.5
NEW, OLD = FRACTION_VARIABLES  # XLA_CLIENT_MEM_FRACTION, XLA_PYTHON_CLIENT_MEM_FRACTION
DEFAULTS = {"TF_FORCE_UNIFIED_MEMORY": "1", NEW: "1.5", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def test_nothing_to_do_without_unified_memory():
    # Not even the platform is looked at: a CPU host with unified_memory false is fine.
    assert unified_memory.environment(OffloadConfig(), {"JAX_PLATFORMS": "cpu"}, False) is None


@pytest.mark.parametrize(
    "environ, plugin, why",
    [
        ({}, False, "no jax CUDA plugin is installed (jax[cuda12]): this process runs on cpu"),
        ({"JAX_PLATFORMS": ""}, False, "no jax CUDA plugin is installed (jax[cuda12]): this process runs on cpu"),
        ({"JAX_PLATFORMS": "cpu"}, True, "JAX_PLATFORMS=cpu starts jax's cpu backend"),
        ({"JAX_PLATFORMS": "cpu,cuda"}, True, "JAX_PLATFORMS=cpu,cuda starts jax's cpu backend"),
        ({"JAX_PLATFORMS": "tpu"}, True, "JAX_PLATFORMS=tpu starts jax's tpu backend"),
        ({"JAX_PLATFORMS": "cuda"}, False, "no jax CUDA plugin is installed (jax[cuda12]): JAX_PLATFORMS=cuda cannot start"),
        ({"JAX_PLATFORMS": "gpu"}, False, "no jax CUDA plugin is installed (jax[cuda12]): JAX_PLATFORMS=gpu cannot start"),
    ],
)  # fmt: skip
def test_no_cuda_backend_is_refused_in_one_line(environ, plugin, why):
    with pytest.raises(ConfigError) as e:
        unified_memory.environment(UM, environ, plugin)
    assert str(e.value) == f"offload.unified_memory: needs a CUDA GPU, and {why}"


@pytest.mark.parametrize("environ", [{}, {"JAX_PLATFORMS": ""}, {"JAX_PLATFORMS": "cuda"},
                                     {"JAX_PLATFORMS": "gpu,cpu"}, {"JAX_PLATFORMS": "cuda,cpu"}])  # fmt: skip
def test_with_a_cuda_backend_it_sets_the_three_variables(environ):
    env = unified_memory.environment(UM, environ, True)
    assert env.sets == DEFAULTS and env.kept == {} and env.fraction == 1.5
    assert env.lines == (
        f"unified memory: set TF_FORCE_UNIFIED_MEMORY=1 {NEW}=1.5 XLA_PYTHON_CLIENT_PREALLOCATE=false",
    )


def test_the_fraction_is_the_configs_oversubscription():
    env = unified_memory.environment(dataclasses.replace(UM, oversubscription=4.0), {}, True)
    assert env.sets[NEW] == "4" and env.fraction == 4.0


def test_a_users_old_fraction_name_is_kept_and_the_new_one_never_set():
    env = unified_memory.environment(UM, {OLD: "2"}, True)
    assert OLD not in env.sets and NEW not in env.sets  # jaxlib refuses both names set
    assert env.kept == {OLD: "2"} and env.fraction == 2.0
    assert env.sets == {"TF_FORCE_UNIFIED_MEMORY": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert env.lines[1] == (
        f"unified memory: kept from the environment: {OLD}=2 (the environment wins: the allocator may take 2x "
        "the device's memory, not offload.oversubscription=1.5x)"
    )


def test_a_users_new_fraction_name_equal_to_the_config_is_kept_quietly():
    env = unified_memory.environment(UM, {NEW: "1.5"}, True)
    assert NEW not in env.sets and OLD not in env.sets and env.fraction == 1.5
    assert env.lines[1] == f"unified memory: kept from the environment: {NEW}=1.5 (= offload.oversubscription)"


def test_a_fraction_below_one_means_one_under_unified_memory():
    env = unified_memory.environment(UM, {NEW: "0.8"}, True)
    assert env.fraction == 1.0 and env.kept == {NEW: "0.8"}
    assert "below 1, which means 1 under unified memory" in env.lines[1]
    assert "may take 1x the device's memory, not offload.oversubscription=1.5x" in env.lines[1]


def test_both_fraction_names_are_refused():
    with pytest.raises(ConfigError) as e:
        unified_memory.environment(UM, {NEW: "2", OLD: "2"}, True)
    assert str(e.value) == f"offload.unified_memory: {NEW} and {OLD} are both set, which jaxlib refuses: unset {OLD}"


@pytest.mark.parametrize("value", ["lots", "0", "-1", "nan", "inf"])
def test_a_fraction_that_is_no_positive_number_names_the_variable(value):
    with pytest.raises(ConfigError) as e:
        unified_memory.environment(UM, {OLD: value}, True)
    assert str(e.value).startswith(f"{OLD}: is '{value}': XLA's allocator fraction is a number above 0")


@pytest.mark.parametrize("value", ["1", "true", "True"])
def test_a_true_force_variable_is_kept(value):
    env = unified_memory.environment(UM, {"TF_FORCE_UNIFIED_MEMORY": value}, True)
    assert "TF_FORCE_UNIFIED_MEMORY" not in env.sets and env.kept == {"TF_FORCE_UNIFIED_MEMORY": value}
    assert (
        env.lines[1]
        == f"unified memory: kept from the environment: TF_FORCE_UNIFIED_MEMORY={value} (unified memory on)"
    )


REFUSED = [
    *((("TF_FORCE_UNIFIED_MEMORY", v), f"TF_FORCE_UNIFIED_MEMORY={v} turns unified memory off: unset it, or set "
       "offload.unified_memory false") for v in ("0", "false", "False")),
    *((("XLA_PYTHON_CLIENT_ALLOCATOR", v), f"XLA_PYTHON_CLIENT_ALLOCATOR={v} bypasses XLA's BFC allocator, the only "
       "one that reads TF_FORCE_UNIFIED_MEMORY: unset it") for v in ("platform", "cuda_async", "vmm", "address")),
]  # fmt: skip


@pytest.mark.parametrize(("variable", "said"), REFUSED)
def test_a_variable_that_keeps_unified_memory_from_working_is_refused(variable, said):
    name, value = variable
    with pytest.raises(ConfigError) as e:
        unified_memory.environment(UM, {name: value}, True)
    assert str(e.value) == f"offload.unified_memory: {said}"


def test_a_force_variable_xla_cannot_read_is_refused():
    with pytest.raises(ConfigError, match=r"^TF_FORCE_UNIFIED_MEMORY: is 'yes': XLA reads 1 or true"):
        unified_memory.environment(UM, {"TF_FORCE_UNIFIED_MEMORY": "yes"}, True)


def test_preallocation_set_by_the_user_is_kept_and_said():
    env = unified_memory.environment(UM, {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, True)
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in env.sets
    assert env.lines[1] == (
        "unified memory: kept from the environment: XLA_PYTHON_CLIENT_PREALLOCATE=true "
        "(the allocator reserves 1.5x the device's memory, managed, at start)"
    )
    env = unified_memory.environment(UM, {"XLA_PYTHON_CLIENT_PREALLOCATE": "0"}, True)
    assert env.kept == {"XLA_PYTHON_CLIENT_PREALLOCATE": "0"} and "grows as the step needs" in env.lines[1]


@pytest.mark.parametrize("value", ["default", "bfc", "BFC"])
def test_the_bfc_allocator_is_kept(value):
    env = unified_memory.environment(UM, {"XLA_PYTHON_CLIENT_ALLOCATOR": value}, True)
    assert env.sets == DEFAULTS and env.kept == {"XLA_PYTHON_CLIENT_ALLOCATOR": value}


def test_every_kept_variable_is_said_on_one_line():
    environ = {"TF_FORCE_UNIFIED_MEMORY": "true", NEW: "3", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
               "XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"}  # fmt: skip
    env = unified_memory.environment(UM, environ, True)
    assert env.sets == {} and env.kept == environ and env.fraction == 3.0
    [line] = env.lines
    assert line.startswith(
        "unified memory: kept from the environment: TF_FORCE_UNIFIED_MEMORY=true (unified memory on); "
    )
    assert all(f"{k}={v} (" in line for k, v in environ.items())


def test_environment_reads_the_mapping_passed_not_os_environ(monkeypatch):
    # Every one of these would be refused, were it read from os.environ.
    for name, value in {"JAX_PLATFORMS": "cpu", "TF_FORCE_UNIFIED_MEMORY": "0", NEW: "2", OLD: "2",
                        "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    env = unified_memory.environment(UM, {}, True)
    assert env.sets == DEFAULTS and env.kept == {}
    with pytest.raises(ConfigError, match="JAX_PLATFORMS=tpu"):
        unified_memory.environment(UM, {"JAX_PLATFORMS": "tpu"}, True)


# ---------------------------------------------------------------------------------------------
# set_up: the impure wrapper


@pytest.fixture
def cuda_platform():
    """jax's platforms setting as code would set it to CUDA (restored after: no backend starts)."""
    before = jax.config.jax_platforms
    jax.config.update("jax_platforms", "cuda")
    try:
        yield
    finally:
        jax.config.update("jax_platforms", before)


@pytest.fixture
def clean_environment(monkeypatch):
    """None of the variables unified memory reads or sets, and each put back as it was after the
    test, including those set_up writes (a ``delenv`` of an absent variable records nothing)."""
    for name in ("JAX_PLATFORMS", *DEFAULTS, OLD, NEW, "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _cfg(*overrides):
    return config_lib.load(REPO / "experiments" / "quickstart.yaml", list(overrides))


def test_set_up_writes_the_variables_and_says_so(monkeypatch, capsys, cuda_platform, clean_environment):
    monkeypatch.setattr(quiet, "cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(jax_compat, "backends_started", lambda: False)
    env = unified_memory.set_up(_cfg("offload.unified_memory=true", "offload.oversubscription=2").offload)
    assert {k: os.environ.get(k) for k in DEFAULTS} == {**DEFAULTS, NEW: "2"} and env.fraction == 2.0
    assert capsys.readouterr().err == "\n".join(env.lines) + "\n"


def test_set_up_after_the_backend_started_still_sets_and_says_it_is_late(
    monkeypatch, capsys, cuda_platform, clean_environment
):
    monkeypatch.setattr(quiet, "cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(jax_compat, "backends_started", lambda: True)
    unified_memory.set_up(_cfg("offload.unified_memory=true").offload)
    assert os.environ["TF_FORCE_UNIFIED_MEMORY"] == "1"
    assert capsys.readouterr().err.splitlines()[-1].startswith("unified memory: jax's backend had started")


def test_set_up_takes_jax_platforms_from_jax_config(monkeypatch, clean_environment):
    # The suite's jax.config says cpu (conftest); the environment variable's cuda is not what runs.
    assert jax.config.jax_platforms == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setattr(quiet, "cuda_plugin_installed", lambda: True)
    with pytest.raises(ConfigError, match="JAX_PLATFORMS=cpu starts jax's cpu backend"):
        unified_memory.set_up(_cfg("offload.unified_memory=true").offload)
    assert unified_memory.set_up(_cfg().offload) is None


def test_backends_started_tells_before_from_after():
    code = ("from meshpar import jax_compat; import jax; before = jax_compat.backends_started(); jax.devices(); "
            "print(before, jax_compat.backends_started())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert out.returncode == 0 and out.stdout.split() == ["False", "True"], out.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# After the backend started: problem, check


ENV = unified_memory.Environment(DEFAULTS, {}, 1.5, ())
H200 = int(141 * GIB)


@pytest.mark.parametrize(
    "platform, limit, physical, expected",
    [
        ("gpu", int(1.5 * H200), H200, None),
        ("gpu", H200 + 1, H200, None),
        ("gpu", int(0.75 * H200), H200,
         ("XLA's allocator limit is 105.8 GiB, not above the device's 141.0 GiB: the unified-memory variables did "
          "not take effect (was jax's backend started before meshpar.train set them?)")),
        ("gpu", H200, H200, "XLA's allocator limit is 141.0 GiB, not above the device's 141.0 GiB: "),
        ("cpu", None, None, "the backend that started is cpu, not CUDA"),
        ("gpu", None, H200, "XLA's allocator reports no memory limit"),
        ("gpu", 0, H200, "XLA's allocator reports no memory limit"),
        ("gpu", int(0.75 * H200), None, None),  # the device's memory unknown: check() says it was not checked
    ],
)  # fmt: skip
def test_problem(platform, limit, physical, expected):
    got = unified_memory.problem(ENV, platform, limit, physical)
    assert got is None if expected is None else got.startswith(expected), got


def test_a_fraction_of_one_is_not_compared():
    # max(1, fraction) = 1: the limit is the device's with or without unified memory.
    one = dataclasses.replace(ENV, fraction=1.0)
    assert unified_memory.problem(one, "gpu", H200, H200) is None


@dataclasses.dataclass
class FakeGpu:
    limit: int | None
    platform: str = "gpu"
    local_hardware_id: int = 0

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit}


@dataclasses.dataclass
class FakeMesh:
    local_devices: list


def test_check_refuses_the_cpu_backend_that_started():
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(ConfigError) as e:
        unified_memory.check(ENV, mesh)
    assert str(e.value) == "offload.unified_memory: the backend that started is cpu, not CUDA"


def test_check_says_the_limit_once(monkeypatch, capsys):
    monkeypatch.setattr(unified_memory, "physical_memory_bytes", lambda device: H200)
    unified_memory.check(ENV, FakeMesh([FakeGpu(int(1.5 * H200)), FakeGpu(int(1.6 * H200))]))
    assert capsys.readouterr().err == (
        "unified memory: XLA's allocator may take 211.5 GiB per device, 1.5x the device's 141.0 GiB\n"
    )
    with pytest.raises(ConfigError, match=r"limit is 141\.0 GiB, not above the device's 141\.0 GiB"):
        unified_memory.check(ENV, FakeMesh([FakeGpu(int(1.5 * H200)), FakeGpu(H200)]))


def test_check_says_when_the_devices_memory_could_not_be_read(monkeypatch, capsys):
    monkeypatch.setattr(unified_memory, "physical_memory_bytes", lambda device: None)
    unified_memory.check(ENV, FakeMesh([FakeGpu(int(1.5 * H200))]))
    assert capsys.readouterr().err == (
        "unified memory: XLA's allocator may take 211.5 GiB per device; the device's memory could not be read "
        "from the CUDA driver: the limit was not checked against it\n"
    )


def test_physical_memory_is_none_off_a_gpu_or_without_a_driver():
    assert unified_memory.physical_memory_bytes(jax.devices()[0]) is None  # a cpu device
    if not quiet.cuda_driver_present():
        assert unified_memory.physical_memory_bytes(FakeGpu(H200)) is None
    assert unified_memory.physical_memory_bytes(FakeGpu(H200, local_hardware_id=None)) is None  # never raises


# ---------------------------------------------------------------------------------------------
# The command on this host (no CUDA GPU): one line, exit 2, nothing written


def _train(env, tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "meshpar.train", "--config", "experiments/quickstart.yaml",
         f"workdir={tmp_path / 'run'}", *overrides],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("platforms", ["cpu", None])
def test_the_cli_refuses_unified_memory_without_a_cuda_gpu(env, tmp_path, platforms):
    if quiet.cuda_driver_present():
        pytest.skip("a CUDA driver loads on this host")
    env = dict(env)
    why = "JAX_PLATFORMS=cpu starts jax's cpu backend"
    if platforms is None:  # jax's choice: cpu without the plugin; with it, meshpar.backend.quiet sets cpu (no driver)
        env.pop("JAX_PLATFORMS", None)
        if not quiet.cuda_plugin_installed():
            why = "no jax CUDA plugin is installed (jax[cuda12]): this process runs on cpu"
    result = _train(env, tmp_path, "offload.unified_memory=true")
    # This refusal, before the mesh is built, not the planner's for a cpu device later.
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"config error: offload.unified_memory: needs a CUDA GPU, and {why}"
    ], result.stderr
    assert not (tmp_path / "run").exists()


def test_the_cli_refuses_oversubscription_without_unified_memory(env, tmp_path):
    result = _train(env, tmp_path, "offload.oversubscription=2")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "config error: offload.oversubscription: 2 applies with offload.unified_memory: true (it is false)"
    ]
    assert not (tmp_path / "run").exists()
