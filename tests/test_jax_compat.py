"""meshpar.jax_compat and input_pipeline.grain_compat: each shim over a non-public API of jax,
Python's threading or Grain works on the installed versions (jax 0.10 on Python 3.11 in the main
suite; the whole file is in the smoke subset, which CI also runs on jax 0.12 on Python 3.12), the
public APIs that replaced the old fallbacks are there, and nothing outside the two compat modules
reaches past those libraries' public APIs (a new reach-in fails here)."""

import ast
import gc
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend.backend
import jax.numpy as jnp
import numpy as np
import pytest
from grain.multiprocessing import SharedMemoryArray
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from input_pipeline import grain_compat
from meshpar import jax_compat, jaxprs
from meshpar.configuration import config
from meshpar.plan import gpu_target, topology
from meshpar.plan.time import gemm
from meshpar.step import aot, parts

REPO = Path(__file__).resolve().parents[1]

# A single-process jax.distributed, in its own interpreter (it must come before the backend).
_CLIENT = """
import socket, sys, time
import jax
from meshpar import jax_compat
assert jax_compat.coordination_client() is None  # not joined yet
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
jax.config.update("jax_enable_preemption_service", False)
jax.distributed.initialize(f"127.0.0.1:{port}", 1, 0, initialization_timeout=30)
c = jax_compat.coordination_client()
c.key_value_set("t/alive/1", "1")
c.key_value_set("t/alive/1", "2", allow_overwrite=True)
c.key_value_set("t/alive/2", "done")
assert sorted(c.key_value_dir_get("t/alive/")) == [("t/alive/1", "2"), ("t/alive/2", "done")]
assert c.blocking_key_value_get("t/alive/1", 1000) == "2"
asked = time.monotonic()
try:
    c.blocking_key_value_get("t/never", 200)
except jax.errors.JaxRuntimeError:  # a read that times out raises only after its timeout
    assert time.monotonic() - asked >= 0.2
else:
    raise AssertionError("a missing key was read")
print("ok")
"""


def test_coordination_client_is_the_key_value_store_jax_distributed_made(env):
    # What meshpar.processes.together uses of it: overwritten heartbeats, one read of a folder of
    # keys, blocking reads, and a timeout told by its duration (not by jax's message).
    out = subprocess.run([sys.executable, "-c", _CLIENT], check=False, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


X = np.ones((64, 32), np.float32)
W = jax.ShapeDtypeStruct((32, 16), jnp.float32)


def test_saved_residuals_name_their_sources():
    def layers(w):
        def body(c, _):
            y = checkpoint_name(jnp.tanh(c @ w), "y")
            return (y * (1.0 - y)) @ w.T, None

        return jax.lax.scan(body, X, None, length=4)[0].sum()

    got = [(r.source, r.shape, r.nbytes) for r in jax_compat.saved_residuals(layers, W)]
    body = ("scan", (4, 64, 16), 4 * 64 * 16 * 4)  # a body value, stacked over the iterations
    assert sorted(set(got)) == sorted([
        ("argument", (32, 16), 32 * 16 * 4),  # w
        ("transpose", (16, 32), 16 * 32 * 4),  # w.T, made once outside the loop
        ("scan", (4, 64, 32), 4 * 64 * 32 * 4),  # the carry of each iteration, stacked
        body,
    ])  # fmt: skip
    assert got.count(body) >= 4  # y and what tanh's derivative needs (jax 0.10: 5, 0.12: 4)

    def named(w):
        y = checkpoint_name(jnp.sin(X @ w), "y")
        return jnp.sum(y * y)

    policy = jax.checkpoint_policies.save_only_these_names("y")
    sources = sorted(r.source for r in jax_compat.saved_residuals(jax.checkpoint(named, policy=policy), W))
    assert sources == ["argument", "constant", "named"]  # w, X, and y by its name; sin is recomputed


def test_an_unknown_residual_description_is_an_error_not_a_guess():
    assert jax_compat._source("output of cos from x.py:1 (f)") == "cos"
    try:
        jax_compat._source("something jax has never said")
    except ValueError as e:
        assert "unrecognized residual description" in str(e)
    else:
        raise AssertionError("an unknown description was classified")


def test_the_public_apis_that_replaced_the_fallbacks_are_here():
    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices, ("devices",))
    split = NamedSharding(mesh, PartitionSpec("devices"))
    # jax.shard_map (meshpar.plan.topology's all-reduce measurement)
    total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "devices"), mesh=mesh, in_specs=PartitionSpec("devices"),
                                  out_specs=PartitionSpec("devices")))  # fmt: skip
    x = jax.device_put(np.arange(8, dtype=np.float32), split)
    assert np.asarray(total(x)).tolist() == [28.0] * 8
    # ArgInfo.shape/.dtype and Compiled.out_info (meshpar.step.aot's host-memory bytes)
    compiled = (
        jax.jit(lambda a, b: a @ b, donate_argnums=0)
        .lower(jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=split), jax.ShapeDtypeStruct((4, 2), jnp.bfloat16))
        .compile()
    )
    args = jax.tree.leaves(compiled.args_info)
    assert [(a.shape, a.dtype, a.donated) for a in args] == [((8, 4), jnp.float32, True), ((4, 2), jnp.bfloat16, False)]
    [out] = jax.tree.leaves(compiled.out_info)
    assert (out.shape, out.dtype) == ((8, 2), jnp.float32) and out.sharding.memory_kind == "device"
    # the backend's platform version (meshpar.models.attention: CUDA or not) and memory stats
    assert jax.extend.backend.get_backend().platform_version == "cpu"
    assert jax.devices()[0].memory_stats() is None  # CPU: none; a GPU reports a dict


# jax internals, found by pattern, that may appear in jax_compat.py only. (The primitive-name
# matching of the planner's jaxpr walkers is not among them: it moves with the planner.)
_INTERNALS = {
    "a private jax module": re.compile(r"\bjax\._src\b|from jax import _src|jaxlib\.(_jax|xla_extension|xla_client)"),
    "a private attribute": re.compile(r"\._aval\b"),
    "a jax version branch": re.compile(
        r"\b(get|has)attr\(\s*jax\b|jax\.__version__\s*[<>=!]|jax\.experimental\.shard_map"
    ),
    "a fallback for a public jax attribute": re.compile(
        r"\b(get|has)attr\([^)]*[\"'](out_info|args_info|aval|shard_map|memory_stats|platform_version|client)[\"']"
    ),
    "a device's client": re.compile(
        r"\.client\.(platform_version|runtime_type)\b|devices\(\)\[\d+\]\.client\b|\.flat\[\d+\]\.client\b|\bruntime_type\b"
    ),
    "a match on a jax/gRPC status text": re.compile(
        r"[\"'](DEADLINE_EXCEEDED|UNAVAILABLE|ALREADY_EXISTS|NOT_FOUND|RESOURCE_EXHAUSTED|CANCELLED)\b"
    ),
}


# ``memory_analysis()`` taken apart as a list (what older jax returned): jax_compat.memory_analysis.
_LIST_OF_STATS = re.compile(r"memory_analysis\(\)\s*(\[|\n[^\n]*\bisinstance\(\w+,\s*\(list,\s*tuple\)\))")

# The compat modules, where reach-ins belong, and this file, which exercises them.
_COMPAT = {REPO / "meshpar" / "jax_compat.py", REPO / "input_pipeline" / "grain_compat.py", Path(__file__).resolve()}


def _sources() -> list[Path]:
    paths = [*REPO.glob("meshpar/**/*.py"), *REPO.glob("input_pipeline/**/*.py"), *REPO.glob("scripts/**/*.py"),
             *REPO.glob("tests/**/*.py"), *REPO.glob("examples/**/*.py")]  # fmt: skip
    return sorted(p for p in paths if p not in _COMPAT)


def test_jax_internals_live_only_in_jax_compat():
    found = []
    for path in _sources():
        text = path.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            for what, pattern in _INTERNALS.items():
                if pattern.search(line) and not (what.startswith("a match") and path.parts[-2] == "tests"):
                    found.append(f"{path.relative_to(REPO)}:{n}: {what}: {line.strip()}")
        for m in _LIST_OF_STATS.finditer(text):
            n = text.count("\n", 0, m.start()) + 1
            found.append(f"{path.relative_to(REPO)}:{n}: memory_analysis() as a list: use jax_compat.memory_analysis")
    assert not found, "\n".join(found)


# Libraries whose private names (``_x``, not ``__x__``) only the compat modules may use.
_WATCHED = {"jax", "jaxlib", "grain", "threading", "orbax", "concurrent", "multiprocessing", "tensorstore", "flax",
            "optax"}  # fmt: skip


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.endswith("__") for p in dotted.split(".")[1:])


def _reach_ins(tree: ast.AST) -> dict[int, str]:
    """Line → the private name of a watched library that line uses: imported (``import jax._src``,
    ``from threading import _register_atexit``), read as an attribute of a name bound to the
    library or anything imported from it (``threading._register_atexit``,
    ``SharedMemoryArray._del_thread_pool``), or by name through ``getattr`` and its kin."""
    bound: dict[str, str] = {}  # a name in the file -> the dotted path it was imported as
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(node: ast.AST) -> str | None:
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in bound:
            return None
        return ".".join([bound[node.id], *reversed(attrs)])

    found: dict[int, str] = {}
    for node in ast.walk(tree):
        names: list[str | None] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Attribute):
            names = [dotted(node)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):  # fmt: skip
            base = dotted(node.args[0])
            names = [base and f"{base}.{node.args[1].value}"]
        for name in names:
            if name and name.partition(".")[0] in _WATCHED and _private(name):
                found.setdefault(node.lineno, name)
    return found


# Known reach-ins outside the compat modules, each with its reason: (file, name) -> why.
_ALLOWED = {
    ("tests/test_workers.py", "multiprocessing.shared_memory._make_filename"): (
        "a test names its workers' shared memory segments, to find the ones a killed worker left"
    ),
}


def test_no_private_name_of_jax_grain_threading_or_orbax_outside_the_compat_modules():
    found = []
    for path in _sources():
        where = path.relative_to(REPO).as_posix()
        for n, name in sorted(_reach_ins(ast.parse(path.read_text(), str(path))).items()):
            if (where, name) not in _ALLOWED:
                found.append(f"{where}:{n}: {name} (move it into meshpar/jax_compat.py, or "
                             "input_pipeline/grain_compat.py for the input pipeline)")  # fmt: skip
    assert not found, "\n".join(found)


def test_the_reach_in_scan_finds_each_form():
    # The scan itself, on code that does each thing once (and on code that does none of them).
    code = """
import threading
import jax._src.xla_bridge
from jax._src import dtypes
from threading import _register_atexit
from grain.multiprocessing import SharedMemoryArray as Shm
import orbax.checkpoint as ocp
threading._register_atexit(print)
getattr(threading, "_register_atexit", None)
pool = Shm._del_thread_pool
ocp.handlers._internal
jax.numpy.__name__
threading.Thread
self._private
"""
    found = _reach_ins(ast.parse(code))
    assert sorted(found) == [3, 4, 5, 8, 9, 10, 11], found  # not the public imports, dunders or self._x
    assert found[10] == "grain.multiprocessing.SharedMemoryArray._del_thread_pool"
    older = "s = c.memory_analysis()\n    s = s[0] if isinstance(s, (list, tuple)) else s"
    for line in ("x = memory_analysis()[0]", older):
        assert _LIST_OF_STATS.search(line), line
    assert not _LIST_OF_STATS.search("t = compiled.memory_analysis().temp_size_in_bytes")


@pytest.mark.gpu_target
def test_the_cublas_workspace_rule_is_what_this_jaxlibs_xla_gpu_does():
    # The rule against the fact it stands for: a small transformer's train step (the quickstart's
    # data + model parallel layout, the config the GPU memory test skips under the rule) compiled
    # deviceless for an H100 with its matmuls lowered to cuBLAS calls (Triton GEMMs off), and each
    # of the step's matmuls compiled alone for the same device, the way the memory model's probe
    # compiles them; a cuBLAS call's workspace is the s8 element of its result. Measured: jaxlib
    # 0.10.2 gives 4 MiB both ways, 0.12.0.1 gives 32 MiB in the step (a small MLP's step: 4 MiB
    # on both, so it cannot tell the two apart).
    cfg = config.load("experiments/quickstart.yaml", [
        "model.d_model=64", "model.n_heads=4", "model.d_head=16", "model.d_ff=256", "model.max_length=64",
        "data.length=64", "data.max_bytes=200000", "train.batch_size=16", "model.n_layers=2", "train.progress=false",
    ])  # fmt: skip
    step = parts.abstract_step(cfg, devices=gpu_target.target(topology.load("h100-sxm-8"), cfg.mesh).devices)
    options = {"xla_gpu_enable_triton_gemm": False}
    text = step.lower().compile(compiler_options=options).as_text()
    in_step = max(int(n) for n in re.findall(r"s8\[(\d+)\]", text))
    device = step.mesh.devices.flat[0]
    matmuls = [e for j in jaxprs.nested(step.step.trace(*step.args).jaxpr) for e in j.eqns if jaxprs.is_matmul(e)]
    alone = max(gemm.lone_matmul_scratch(device, tuple(options.items()), e)[0] for e in matmuls)
    assert in_step > 0 and alone > 0
    assert jax_compat.step_cublas_workspace_exceeds_lone() == (in_step > alone), (in_step, alone)


# What each shim over a private API does, on the installed jax, Python and Grain.


def test_memory_analysis_gives_the_fields_the_memory_plan_reads():
    compiled = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b.T).lower(jnp.ones((64, 32)), jnp.ones((32, 16))).compile()
    stats = jax_compat.memory_analysis(compiled)
    fields = [f"{f}_size_in_bytes" for f in aot.MEMORY_FIELDS]
    fields += [f"host_{f}_size_in_bytes" for f in ("argument", "output", "alias", "temp")]
    assert not isinstance(stats, (list, tuple))
    assert all(isinstance(getattr(stats, f), int) for f in fields), [f for f in fields if not hasattr(stats, f)]
    assert stats.argument_size_in_bytes == (64 * 32 + 32 * 16) * 4 and stats.output_size_in_bytes == 64 * 32 * 4

    class OlderJax:  # a list with one entry per program, the step's first
        def memory_analysis(self):
            return [stats, None]

    assert jax_compat.memory_analysis(OlderJax()) is stats


def test_compile_only_device_tells_a_compile_target_from_a_device_that_runs():
    assert not any(jax_compat.compile_only_device(d) for d in jax.devices())


def test_xla_option_refusals_name_unknown_fields_and_the_kind_a_field_takes():
    got = jax_compat.xla_option_refusals({
        "xla_gpu_enable_latency_hiding_scheduler": True, "xla_disable_hlo_passes": "rematerialization",
        "xla_gpu_no_such_flag": True, "xla_gpu_all_reduce_combine_threshold_bytes": "many",
        "xla_gpu_enable_command_buffer": "NOPE",
    })  # fmt: skip
    assert got["xla_gpu_enable_latency_hiding_scheduler"] is None and got["xla_disable_hlo_passes"] is None
    assert not got["xla_gpu_no_such_flag"].known
    assert (
        got["xla_gpu_all_reduce_combine_threshold_bytes"].known,
        got["xla_gpu_all_reduce_combine_threshold_bytes"].expects,
    ) == (True, "int64")
    assert got["xla_gpu_enable_command_buffer"].expects == "enum"
    assert all("\n" not in r.text for r in got.values() if r is not None)


@pytest.mark.gpu_target
def test_a_gpu_compile_target_is_compile_only():
    # Without the client's runtime type this would be False, and a GPU plan would trace the
    # attention a GPU that runs would (meshpar.models.attention): the check must see True here.
    [device] = gpu_target.devices(topology.load("h200-sxm-1"))
    assert jax_compat.compile_only_device(device)


# An executor's worker thread already runs; the hook must run before concurrent.futures' own
# exit hook refuses new work ("cannot schedule new futures after interpreter shutdown").
_BEFORE_SHUTDOWN = """
import concurrent.futures
from meshpar import jax_compat
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(int).result()
def hook():
    print(pool.submit(lambda: "accepted").result(timeout=10), flush=True)
assert jax_compat.register_before_thread_shutdown(hook)
print("registered", flush=True)
"""


def test_a_hook_registered_before_thread_shutdown_runs_while_executors_still_accept_work(env):
    command = [sys.executable, "-c", _BEFORE_SHUTDOWN]
    out = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["registered", "accepted"], out.stderr[-3000:]


def test_grain_compat_waits_until_grain_has_unlinked_a_dropped_batch(tmp_path):
    SharedMemoryArray.enable_async_del(num_threads=1)  # what Grain's multiprocessing prefetch does
    batch = SharedMemoryArray((256, 64), np.float32)
    batch.unlink_on_del()
    segment = Path("/dev/shm") / batch.shm.name.lstrip("/")
    assert segment.exists()
    del batch
    gc.collect()
    assert grain_compat.wait_for_unlinks(10.0)  # False: this Grain keeps its unlinking pool elsewhere
    assert not segment.exists()
