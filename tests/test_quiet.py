"""meshpar.backend.quiet: jax's CUDA plugin says nothing on a host without a GPU. The filter and the
decision as pure functions; the fd-2 capture on real writes; jax's plugins load without starting a
backend (jax.distributed can still follow); and, where the gpu-plan extra is installed, meshpar's
commands print nothing but their own words."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshpar.backend import quiet

REPO = Path(__file__).resolve().parents[1]

BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
STUB = (
    "I0000 00:00:1796178888.081558    2889 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
    "GPU will not be used.\n"
)
NOISE_LINES = ("WARNING: All log messages before absl::InitializeLog", "cudart_stub.cc")


def test_the_filter_drops_the_noise_and_keeps_every_other_line_in_order():
    text = "".join([
        BANNER, STUB, "first\n", BANNER, STUB,
        "Jax plugin configuration error: Exception when calling jax_plugins.xla_cuda12.initialize()\n",
        "RuntimeError: Unable to load CUDA. Is it installed?\r\n",
        # the noise's words inside another line: that line is not noise
        "a test said: Could not find cuda drivers on your machine, GPU will not be used.\n",
        STUB.replace("\n", "\r\n"), "W0101 12:00:00.000001    77 other.cc:5] something else\n",
        "last, without a newline",
    ])  # fmt: skip
    assert quiet.drop_noise(text) == (
        "first\n"
        "Jax plugin configuration error: Exception when calling jax_plugins.xla_cuda12.initialize()\n"
        "RuntimeError: Unable to load CUDA. Is it installed?\r\n"
        "a test said: Could not find cuda drivers on your machine, GPU will not be used.\n"
        "W0101 12:00:00.000001    77 other.cc:5] something else\n"
        "last, without a newline"
    )
    assert quiet.drop_noise(BANNER + STUB + BANNER + STUB) == ""
    assert quiet.drop_noise("") == ""


@pytest.mark.parametrize("plugin", [False, True])
@pytest.mark.parametrize("driver", [False, True])
@pytest.mark.parametrize("platforms", [None, "cpu", "cuda", ""])
def test_the_decision_quiets_only_a_plugin_without_a_driver_and_never_overrides_jax_platforms(
    plugin, driver, platforms
):
    probed = []

    def probe(name, value):
        def call():
            probed.append(name)
            return value

        return call

    environ = {"HOME": "/x"} if platforms is None else {"JAX_PLATFORMS": platforms}
    got = quiet.decide(environ, probe("plugin", plugin), probe("driver", driver))
    if plugin and not driver:
        # the CPU jax would fall back to anyway, only where the user named no platforms
        # (an empty JAX_PLATFORMS is no choice: jax reads it as unset)
        assert got == quiet.Decision(quiet=True, jax_platforms="cpu" if not platforms else None)
    else:
        assert got == quiet.Decision(quiet=False, jax_platforms=None)
    # no plugin: the driver is not even probed (a host without the extra pays nothing)
    assert probed == (["plugin", "driver"] if plugin else ["plugin"])
    assert environ.get("JAX_PLATFORMS") == platforms  # decide only decides


def test_the_capture_replays_what_is_not_noise_after_the_block_even_when_it_raises(capfdbinary):
    os.write(2, b"before\n")
    with quiet.native_stderr_filtered():
        os.write(2, (BANNER + STUB + "kept 1\n").encode())
        assert capfdbinary.readouterr().err == b"before\n"  # nothing gets through during the block
        os.write(2, STUB.encode() + b"kept 2 \xe9\n")  # not UTF-8: comes out unchanged
    assert capfdbinary.readouterr().err == b"kept 1\nkept 2 \xe9\n"
    with pytest.raises(KeyError), quiet.native_stderr_filtered():
        os.write(2, (STUB + "said before the error\n").encode())
        raise KeyError("x")
    os.write(2, b"after\n")  # fd 2 is back
    assert capfdbinary.readouterr().err == b"said before the error\nafter\n"


# Loading jax's plugins must not start a backend: jax.distributed.initialize (which must come
# before one) still works after it, and after importing meshpar, on every supported jax.
_PLUGINS_THEN_DISTRIBUTED = """
import socket
import meshpar.sharding.mesh, jax
from meshpar import jax_compat
jax_compat.load_jax_plugins()
jax_compat.load_jax_plugins()  # a second time: nothing
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
jax.config.update("jax_enable_preemption_service", False)
jax.distributed.initialize(f"127.0.0.1:{port}", 1, 0, initialization_timeout=30)
print(jax.process_count(), jax.devices()[0].platform)
"""


def test_loading_jax_plugins_starts_no_backend_so_jax_distributed_can_follow(env):
    out = subprocess.run([sys.executable, "-c", _PLUGINS_THEN_DISTRIBUTED], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout.split() == ["1", "cpu"], out.stderr[-3000:]


def _run(env, *args, platforms=None):
    environ = {k: v for k, v in env.items() if k != "JAX_PLATFORMS"}
    if platforms is not None:
        environ["JAX_PLATFORMS"] = platforms
    return subprocess.run([sys.executable, *args], cwd=REPO, env=environ, capture_output=True, text=True, timeout=300)


@pytest.fixture
def no_driver():
    if quiet.cuda_driver_present():
        pytest.skip("a CUDA driver is here: jax's CUDA plugin has nothing to complain about")


@pytest.mark.gpu_target
@pytest.mark.usefixtures("no_driver")
def test_a_config_mistake_is_one_line_on_stderr_with_the_cuda_plugin_installed(env):
    out = _run(env, "-m", "meshpar.train", "--config", "experiments/quickstart.yaml", "model.hidden=[255,128]")
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("config error:"), out.stderr[-3000:]


@pytest.mark.gpu_target
@pytest.mark.usefixtures("no_driver")
@pytest.mark.parametrize("platforms", [None, "cpu"])
def test_importing_meshpar_and_starting_jax_prints_nothing_with_the_cuda_plugin_installed(env, platforms):
    code = "import os, meshpar.sharding.mesh, jax; print(jax.devices()[0].platform, os.environ['JAX_PLATFORMS'])"
    out = _run(env, "-c", code, platforms=platforms)
    assert out.returncode == 0 and out.stdout.split() == ["cpu", "cpu"], out.stderr[-3000:]
    assert out.stderr == ""


@pytest.mark.gpu_target
@pytest.mark.usefixtures("no_driver")
def test_a_platform_the_user_named_is_kept_and_what_jax_says_about_it_is_not_swallowed(env):
    # JAX_PLATFORMS=cuda without a driver: meshpar keeps the user's choice, and the plugin's own
    # error (not noise) still reaches stderr, without the noise around it.
    out = _run(env, "-c", "import os, meshpar; print(os.environ['JAX_PLATFORMS'])", platforms="cuda")
    assert out.returncode == 0 and out.stdout.strip() == "cuda", out.stderr[-3000:]
    assert "Jax plugin configuration error" in out.stderr
    assert not any(noise in out.stderr for noise in NOISE_LINES), out.stderr[-3000:]


@pytest.mark.gpu_target
@pytest.mark.usefixtures("no_driver")
def test_jax_imported_before_meshpar_still_falls_back_to_the_cpu_without_a_traceback(env):
    # jax has read JAX_PLATFORMS at its own import (whose noise came before meshpar could act):
    # meshpar sets jax's config instead, so the backend's start is quiet.
    out = _run(
        env, "-c", "import jax, meshpar.sharding.mesh; print(jax.config.jax_platforms, jax.devices()[0].platform)"
    )
    assert out.returncode == 0 and out.stdout.split() == ["cpu", "cpu"], out.stderr[-3000:]
    assert "Jax plugin configuration error" not in out.stderr, out.stderr[-3000:]
