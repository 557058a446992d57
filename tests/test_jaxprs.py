"""Reading jaxprs (meshpar.jaxprs): the one place meshpar matches primitives by name."""

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from meshpar import jaxprs
from meshpar.sharding import offload

REPO = Path(__file__).resolve().parents[1]
X = jax.ShapeDtypeStruct((8, 4), jnp.float32)
W = jax.ShapeDtypeStruct((4, 4), jnp.float32)


def _eqns(fn, *args):
    return jax.make_jaxpr(fn)(*args).jaxpr.eqns


def test_a_scans_parts_length_and_whether_it_runs_as_a_loop():
    def layers(w, x, xs, unroll):
        def body(c, x_i):
            return jnp.tanh(c @ w + x_i), c.sum()

        return jax.lax.scan(body, x, xs, unroll=unroll)

    xs = jax.ShapeDtypeStruct((5, 8, 4), jnp.float32)
    for unroll, rolled in ((1, True), (5, False), (True, False)):
        (eqn,) = [e for e in _eqns(lambda w, x, xs: layers(w, x, xs, unroll), W, X, xs) if jaxprs.is_scan(e)]
        body, consts, carry = jaxprs.scan_parts(eqn)
        assert (consts, carry, jaxprs.scan_length(eqn)) == (1, 1, 5)  # w; the carry c; 5 iterations
        assert [v.aval.shape for v in body.invars] == [(4, 4), (8, 4), (8, 4)]
        assert [v.aval.shape for v in body.outvars] == [(8, 4), ()]
        assert jaxprs.is_rolled(eqn) is rolled
    # the body's matmul runs once per iteration
    walked = [
        (jaxprs.op(e), n) for e, n, _ in jaxprs.walk(jax.make_jaxpr(lambda w, x, xs: layers(w, x, xs, 1))(W, X, xs))
    ]
    assert ("scan", 1) in walked and ("dot_general", 5) in walked and ("tanh", 5) in walked


def test_a_checkpointed_layer_and_its_tag():
    def f(w, x):
        layer = jax.checkpoint(lambda x: jnp.sin(checkpoint_name(x @ w, "pre")))
        return layer(layer(x))

    closed = jax.make_jaxpr(f)(W, X)
    calls = [e for e in closed.jaxpr.eqns if jaxprs.is_layer_call(e)]
    assert len(calls) == 2 and all(jaxprs.call_body(e) is not None for e in calls)
    seen = list(jaxprs.walk(closed))
    tags = [(jaxprs.tag_of(e), in_layer) for e, _, in_layer in seen if jaxprs.tag_of(e)]
    assert tags == [("pre", True), ("pre", True)]  # inside the checkpointed layers, both calls
    flops = [jaxprs.matmul_flops(e) for e, _, _ in seen if jaxprs.is_matmul(e)]
    assert flops == [(2.0 * 8 * 4 * 4, False)] * 2  # [8, 4] x [4, 4]: 2 x 32 outputs x 4 contracted
    assert not any(jaxprs.is_layer_call(e) or jaxprs.tag_of(e) for e in _eqns(lambda w, x: jnp.sin(x @ w), W, X))


def test_a_jit_call_is_inlined_one_to_one_and_relabels_and_cheap_ops_are_told_apart():
    inner = jax.jit(lambda x, w: (jnp.exp(x @ w), x.reshape(32)))
    (call,) = _eqns(lambda w, x: inner(x, w), W, X)
    body = jaxprs.call_body(call)
    assert body is not None and len(body.invars) == 2 and len(body.outvars) == 2
    assert jaxprs.subjaxprs(call) == [body]
    ops = {jaxprs.op(e): e for e in body.eqns}
    assert set(ops) == {"dot_general", "exp", "reshape"}
    assert jaxprs.is_relabel(ops["reshape"]) and not jaxprs.is_relabel(ops["exp"])
    assert jaxprs.is_matmul(ops["dot_general"]) and not jaxprs.is_cheap(ops["exp"])
    (add,) = _eqns(lambda x: x + 1.0, X)
    assert jaxprs.is_cheap(add) and jaxprs.call_body(add) is None and jaxprs.subjaxprs(add) == []
    assert jaxprs.is_literal(add.invars[1]) and not jaxprs.is_literal(add.invars[0])
    assert jaxprs.nbytes(add.outvars[0]) == 8 * 4 * 4
    # nested: the top level, then the jit's body
    assert [len(j.eqns) for j in jaxprs.nested(jax.make_jaxpr(lambda w, x: inner(x, w))(W, X))] == [1, 3]


def test_a_broadcast_along_leading_dims_only():
    (row,) = _eqns(lambda s: jnp.broadcast_to(s, (8, 4)), jax.ShapeDtypeStruct((4,), jnp.float32))
    (col,) = _eqns(lambda s: jnp.broadcast_to(s, (8, 4)), jax.ShapeDtypeStruct((8, 1), jnp.float32))
    assert jaxprs.broadcast_grown(row) == (0,)  # a per-feature scale over rows
    assert jaxprs.broadcast_grown(col) == (1,)
    (add,) = _eqns(lambda x: x + 1.0, X)
    assert jaxprs.broadcast_grown(add) is None


def test_a_tagged_value_moved_to_host_memory():
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    device = host.with_memory_kind("device")

    def f(x):
        y = checkpoint_name(jnp.sin(x), "hidden")
        z = checkpoint_name(jnp.cos(x), "other")
        return jax.device_put(y, host), jax.device_put(z, device)

    moves = [v for e in _eqns(f, X) for v in jaxprs.host_transfers(e)]
    assert len(moves) == 1 and moves[0].aval.shape == (8, 4)
    assert offload.host_moves(jax.make_jaxpr(f)(X)) == {"hidden": (8, 4)}
    assert jaxprs.host_transfers(_eqns(jnp.sin, X)[0]) == []


def test_the_residuals_of_a_rolled_scan_under_vjp_are_read_the_same_way():
    # a program jax itself builds for the backward pass: the walker sees its loop and its matmuls
    def loss(w):
        def body(c, _):
            return jnp.tanh(c @ w), None

        return jax.lax.scan(body, np.ones((8, 4), np.float32), None, length=3)[0].sum()

    closed = jax.make_jaxpr(lambda w: jax.vjp(loss, w))(W)
    counts = {}
    for e, n, _ in jaxprs.walk(closed):
        counts[jaxprs.op(e)] = counts.get(jaxprs.op(e), 0) + n
    assert counts["dot_general"] == 3 and counts["tanh"] == 3


def _reads_primitive_name(tree: ast.AST) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "name"
        and isinstance(node.value, ast.Attribute) and node.value.attr == "primitive"
    ]  # fmt: skip


def test_only_meshpar_jaxprs_matches_primitives_by_name():
    found = []
    for path in sorted(REPO.glob("meshpar/**/*.py")):
        if path == REPO / "meshpar" / "jaxprs.py":
            continue
        for line in _reads_primitive_name(ast.parse(path.read_text(), str(path))):
            found.append(f"{path.relative_to(REPO)}:{line}")
    assert not found, "reads .primitive.name outside meshpar/jaxprs.py: " + ", ".join(found)
    # the check itself sees such a read
    assert _reads_primitive_name(ast.parse("def f(eqn):\n    return eqn.primitive.name == 'scan'\n")) == [2]
    assert _reads_primitive_name(ast.parse((REPO / "meshpar" / "jaxprs.py").read_text()))
