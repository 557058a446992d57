"""meshpar.jax_compat: each shim over jax's non-public API works on this jax (0.10 in the main
suite; the whole file is in the smoke subset, which CI also runs on jax 0.12), the public APIs
that replaced the old fallbacks are there, and nothing outside jax_compat reaches past jax's
public API."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend.backend
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshpar import jax_compat

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
    # What meshpar.distributed uses of it: overwritten heartbeats, one read of a folder of
    # keys, blocking reads, and a timeout told by its duration (not by jax's message).
    out = subprocess.run([sys.executable, "-c", _CLIENT], cwd=REPO, env=env, capture_output=True, text=True,
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
    # ArgInfo.shape/.dtype and Compiled.out_info (meshpar.aot's host-memory bytes)
    compiled = jax.jit(lambda a, b: a @ b, donate_argnums=0).lower(
        jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=split), jax.ShapeDtypeStruct((4, 2), jnp.bfloat16)
    ).compile()
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
    "a device's client": re.compile(r"\.client\.platform_version|devices\(\)\[\d+\]\.client"),
    "a match on a jax/gRPC status text": re.compile(
        r"[\"'](DEADLINE_EXCEEDED|UNAVAILABLE|ALREADY_EXISTS|NOT_FOUND|RESOURCE_EXHAUSTED|CANCELLED)\b"
    ),
}


def test_jax_internals_live_only_in_jax_compat():
    found = []
    for path in sorted([*REPO.glob("meshpar/**/*.py"), *REPO.glob("input_pipeline/**/*.py"),
                        *REPO.glob("scripts/**/*.py"), *REPO.glob("tests/**/*.py")]):  # fmt: skip
        if path.name == "jax_compat.py" or path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in _INTERNALS.items():
                if pattern.search(line) and not (what.startswith("a match") and path.parts[-2] == "tests"):
                    found.append(f"{path.relative_to(REPO)}:{n}: {what}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_cublas_workspace_rule_names_the_jaxlib_it_holds_for():
    # jaxlib 0.10 (the main suite) is the one the memory model's cuBLAS figure is checked on.
    newer = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
    assert jax_compat.step_cublas_workspace_exceeds_lone() == newer
