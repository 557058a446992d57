"""8 simulated CPU devices for every test, set before any JAX backend starts; one compilation
cache per pytest run; the smoke subset; the tests that need the gpu-plan extra."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most of the suite's time is XLA compiling the same small programs again (each build, each CLI
# subprocess): a persistent cache, new for every pytest run so no run sees another's, and
# inherited by the subprocesses through the environment, halves it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="meshpar-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )

# meshpar before jax: its import quiets jax's CUDA plugin on a host without a GPU (meshpar.backend.quiet).
import jax  # noqa: E402
import pytest  # noqa: E402

from meshpar.backend import compile_cache, quiet

jax.config.update("jax_num_cpu_devices", 8)

# Tests that need the gpu-plan extra (XLA's GPU compiler: jax's CUDA plugin) are marked
# `gpu_target`; each is skipped where the extra is not installed (the main suite runs as a user
# without it) -- but fails where MESHPAR_REQUIRE_GPU_PLAN=1: .ci/run sets that in the venv it has
# installed the extra into, so that a broken install cannot pass there as a row of skips.
GPU_PLAN_MISSING = "the gpu-plan extra is not installed"


def require_gpu_plan() -> None:
    """Skip the calling test where the gpu-plan extra is not installed, or fail it where
    MESHPAR_REQUIRE_GPU_PLAN=1. Run before every `gpu_target` test (pytest_runtest_setup below);
    call it from a test or helper that needs the extra without the mark."""
    if quiet.cuda_plugin_installed():
        return
    if os.environ.get("MESHPAR_REQUIRE_GPU_PLAN") == "1":
        pytest.fail(f"{GPU_PLAN_MISSING}, and MESHPAR_REQUIRE_GPU_PLAN=1 says it must be", pytrace=False)
    pytest.skip(GPU_PLAN_MISSING)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu_target") is not None:
        require_gpu_plan()


@pytest.fixture(autouse=True)
def _no_cache_for_compile_only(request):
    """A gpu_target test compiles for compile-only devices, whose programs jax's persistent cache
    would store but could not load back: the session's cache is suspended for it, and only it."""
    if request.node.get_closest_marker("gpu_target") is None:
        yield
        return
    with compile_cache.suspended():
        yield


@pytest.fixture(scope="session")
def env():
    """Environment for CLI subprocesses: CPU devices (each CLI asks for as many as its mesh
    needs) and the session's compilation cache."""
    out = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out.pop("JAX_NUM_CPU_DEVICES", None)
    return out


# `pytest -m smoke`: a short cross-section of the suite (CLI, training, feeding, checkpoints,
# resume, faults, two processes), run by CI on the newest jax too. Node ids, so the list lives
# in one place and a renamed test is reported, not silently dropped.
SMOKE = (
    "tests/test_config.py",
    "tests/test_offload.py",
    "tests/test_unified_memory.py",
    "tests/test_plan_unified.py::test_more_oversubscription_migrates_more_and_slows_the_step",
    "tests/test_checkpoint.py",
    "tests/test_trainer.py::test_routed_and_direct_train_bit_identically",
    "tests/test_resume.py::test_resume_from_a_mid_run_checkpoint_is_bit_identical[direct-0]",
    "tests/test_resume.py::test_extending_a_run_keeps_its_schedule",
    "tests/test_train_cli.py::test_cli_trains_and_writes_outputs",
    "tests/test_train_cli.py::test_a_full_disk_at_save_time_ends_the_run_in_one_line_naming_the_last_step_saved",
    "tests/test_multihost.py",
    "tests/test_distributed.py::test_a_killed_peer_is_named_by_the_survivor_with_the_last_checkpoint",
    "tests/test_liveness.py::test_the_heartbeat_goes_on_through_a_long_xla_compile_and_ends_with_done",
    "tests/test_jax_compat.py",
    "tests/test_quiet.py",
    "tests/test_loop.py::test_lagged_loop_is_bit_identical_to_waiting_for_every_step_and_syncs_only_where_needed",
    "tests/test_loop.py::test_profile_traces_exactly_its_steps_and_the_compile_cache_fills_its_folder",
    "tests/test_generate.py::test_greedy_continuations_equal_transformers_generate_token_for_token",
    "tests/test_generate.py::test_decoding_with_the_cache_gives_the_full_forward_passs_logits[llama-gqa]",
    "tests/test_custom_model.py::test_a_family_with_only_the_required_parts_trains",
    "tests/test_workers.py",
    "tests/test_tokens.py",
    "tests/test_inputs.py::test_training_is_the_same_for_0_and_2_workers_and_resumes_across_them",
    "tests/test_inputs.py::test_a_worker_killed_by_the_os_stops_the_run_naming_it_and_the_last_checkpoint",
    "tests/test_pipeline.py::test_the_pipelined_stack_gives_the_sequential_loss_and_gradients[transformer-circular-2-2-None]",
    "tests/test_pipeline.py::test_the_pipelined_stack_gives_the_sequential_loss_and_gradients[llama-circular-2-4-embed:data]",
    "tests/test_pipeline.py::test_the_compiled_step_passes_activations_over_the_stage_axis_and_gathers_no_layer_weights",
    "tests/test_pipeline.py::test_two_processes_with_the_stage_axis_across_them_train_and_resume",
)


def pytest_collection_modifyitems(config, items):
    matched = set()
    for item in items:
        for entry in SMOKE:
            if item.nodeid == entry or item.nodeid.startswith(f"{entry}::"):
                item.add_marker("smoke")
                matched.add(entry)
    if any("::" in arg for arg in config.args):
        return  # single tests picked by node id: their files are only partly collected
    collected_files = {item.nodeid.split("::")[0] for item in items}
    missing = [e for e in SMOKE if e not in matched and e.split("::")[0] in collected_files]
    if missing:
        raise ValueError(f"smoke entries match no test: {missing}")
