"""meshpar.sharding.layout: rules, PartitionSpecs, one-line errors, constrain, and a sharded MLP init."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.sharding import layout as layout_lib
from meshpar.sharding import tracing
from meshpar.sharding.layout import Layout, LayoutError, activate, constrain, parse_rules
from meshpar.sharding.mesh import build_mesh

SIZES = {"data": 4, "model": 2}


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and msg.splitlines() == [msg], f"not one line: {msg!r}"
    return msg


def expect(e: pytest.ExceptionInfo, *substrings: str) -> None:
    msg = one_line(e)
    for s in substrings:
        assert s in msg, (s, msg)


@pytest.fixture(scope="module")
def mesh():
    return build_mesh("data:4,model:2")


# --------------------------------------------------------------------------------------------
# parse_rules


@pytest.mark.parametrize(
    "rules, expected",
    [
        ("batch:data; hidden:model", (("batch", "data"), ("hidden", "model"))),
        ("batch:data;hidden:model", (("batch", "data"), ("hidden", "model"))),
        ("batch:data,hidden:model", (("batch", "data"), ("hidden", "model"))),
        ("batch:data, hidden:model; hidden_2:model", (("batch", "data"), ("hidden", "model"), ("hidden_2", "model"))),
        ("  batch :  data ;\thidden: model  ", (("batch", "data"), ("hidden", "model"))),
        ("batch:data;", (("batch", "data"),)),  # empty rules are skipped
        (";; batch:data ;, ", (("batch", "data"),)),
        ("batch:data", (("batch", "data"),)),
        ("", ()),
        ("  ;  ", ()),
        (None, ()),
        ({"batch": "data", "hidden": "model"}, (("batch", "data"), ("hidden", "model"))),
        ({" batch ": " data "}, (("batch", "data"),)),
        ({}, ()),
        ((("batch", "data"), ("hidden", "model")), (("batch", "data"), ("hidden", "model"))),
        # Mesh TensorFlow's separators: ';', ',', '.' and whitespace between complete rules
        ("batch:b1;hidden:b2", (("batch", "b1"), ("hidden", "b2"))),
        ("batch:b1.hidden:b2", (("batch", "b1"), ("hidden", "b2"))),
        ("batch:b1 hidden:b2\nhidden_2:b2", (("batch", "b1"), ("hidden", "b2"), ("hidden_2", "b2"))),
        ("batch:b1.;, hidden:b2.", (("batch", "b1"), ("hidden", "b2"))),
        ("batch : data hidden : model", (("batch", "data"), ("hidden", "model"))),  # spaces inside a rule stay
        ("batch:(replica, data) hidden:model", (("batch", ("replica", "data")), ("hidden", "model"))),
        ("batch : ( replica , data ).d_ff:model", (("batch", ("replica", "data")), ("d_ff", "model"))),
        (
            "ensemble:ensemble,batch:batch,d_ff:model,heads:model,vocab:model,experts:batch",
            (
                ("ensemble", "ensemble"),
                ("batch", "batch"),
                ("d_ff", "model"),
                ("heads", "model"),
                ("vocab", "model"),
                ("experts", "batch"),
            ),
        ),  # fmt: skip
    ],
)
def test_parse_rules(rules, expected):
    assert parse_rules(rules) == expected


@pytest.mark.parametrize(
    "rules, substrings",
    [
        ("batch", ["'batch'", "not 'dim:axis'"]),
        ("batch:data; hidden", ["'hidden'", "not 'dim:axis'"]),
        ("batch:data:model", ["'batch:data:model'", "not 'dim:axis'"]),
        ("batch:data hidden", ["'hidden'", "not 'dim:axis'", "separated by ';', ',', '.' or spaces"]),
        ("batch:da ta", ["'ta'", "not 'dim:axis'"]),  # whitespace ends a complete rule
        ("batch:(data model)", ["axis name 'data model'", "not an identifier"]),  # not inside parentheses
        ("batch:(replica,(data))", ["nested parentheses"]),
        (":data", ["':data'", "empty dim or axis"]),
        ("batch:", ["'batch:'", "empty dim or axis"]),
        ("batch: ; hidden:model", ["'batch:'", "empty dim or axis"]),
        ({"batch": ""}, ["'batch:'", "empty dim or axis"]),
        # a dim mapped twice: names the dim and both axes
        ("batch:data; batch:model", ["dim 'batch'", "mapped twice", "'data'", "'model'"]),
        ("hidden:model, hidden:model", ["dim 'hidden'", "mapped twice"]),
        ((("batch", "data"), ("batch", "model")), ["dim 'batch'", "mapped twice", "'data'", "'model'"]),
        # wrong type
        (5, ["int"]),
        (["batch:data"], ["list"]),
    ],
)
def test_parse_rules_errors(rules, substrings):
    with pytest.raises(LayoutError) as e:
        parse_rules(rules)
    expect(e, *substrings)


@pytest.mark.parametrize("rules", ["a\nb:data; a\nb:model", "a\nb:", "x:\n", "a\u2028b:data;a\u2028b:data"])
def test_errors_stay_one_line_with_odd_names(rules):
    # Names are quoted with repr, so even a dim holding a line break gives a one-line message.
    with pytest.raises(LayoutError) as e:
        Layout.create(rules, SIZES)
    one_line(e)


@pytest.mark.parametrize(
    "rules, substrings",
    [
        ("batch:data; données:model", ["dim name 'données'", "'données:model'", "ASCII"]),
        ("batch:modèle", ["axis name 'modèle'", "ASCII"]),
        ({"ｂａｔｃｈ": "data"}, ["dim name 'ｂａｔｃｈ'", "ASCII"]),
        ("2d:data", ["dim name '2d'", "not an identifier"]),
        ("batch:da-ta", ["axis name 'da-ta'", "not an identifier"]),
        ({"batch": "da ta"}, ["axis name 'da ta'", "not an identifier"]),
        ((("batch", 3),), ["axis name 3", "not a string"]),
        ("batch:" + "a" * 65, ["axis name", "65 characters", "at most 64"]),
    ],
)
def test_parse_rules_names_are_ascii_identifiers(rules, substrings):
    # Dims without a model tensor are never looked up, so only this check catches them.
    with pytest.raises(LayoutError) as e:
        parse_rules(rules)
    expect(e, *substrings)
    assert parse_rules("b" * 64 + ":data") == (("b" * 64, "data"),)


def test_layout_error_is_value_error():
    assert issubclass(LayoutError, ValueError)


# --------------------------------------------------------------------------------------------
# Layout.create / spec / check_shape


def test_create_leaves_out_axes_the_mesh_does_not_have():
    # Mesh TensorFlow ignores a rule whose mesh axis is absent: one rule string serves several
    # meshes. A rule naming several axes keeps those the mesh has.
    lay = Layout.create("batch:data; hidden:tensor; embed:(replica,data); d_ff:(model,tensor)", SIZES,
                        params="embed:ensemble; hidden:(data,rows)")  # fmt: skip
    assert lay.rules == (("batch", "data"), ("embed", "data"), ("d_ff", "model"))
    assert lay.param_rules == (("hidden", "data"),)
    assert lay.spec(("batch", "hidden", "d_ff")) == P("data", None, "model")
    assert lay.params.spec(("hidden",)) == P("data") and lay.params.spec(("embed",)) == P("data")
    assert lay.overlay("hidden:tensor").spec(("hidden",)) == P(None)
    assert lay.overlay("hidden:(tensor,model)").spec(("hidden",)) == P("model")
    assert Layout.create("experts:ensemble", SIZES).rules == ()


def test_unused_and_applies():
    rules = "ensemble:ensemble,batch:batch,d_ff:model,heads:model,vocab:model,experts:batch"
    dims = {"batch", "length", "embed", "heads", "kv", "d_ff", "vocab", "layers"}
    mesh = {"batch": 4, "model": 2}
    said = "this model has no dim ensemble, experts; the mesh has no axis ensemble"
    assert layout_lib.unused(rules, mesh, dims) == said
    assert layout_lib.unused("batch:batch; d_ff:model", mesh, dims) is None
    assert layout_lib.unused("batch:(replica,batch,pod); pod:pod", mesh, dims, "no parameter has dim") == (
        "no parameter has dim pod; the mesh has no axis replica, pod"
    )
    assert layout_lib.applies(rules, mesh, dims)
    assert not layout_lib.applies("nosuchdim:batch", mesh, dims)
    assert not layout_lib.applies("embed:rows", mesh, dims)  # the dim is there, the axis is not
    assert layout_lib.applies("embed:(rows,model)", mesh, dims)
    assert not layout_lib.applies(None, mesh, dims)


def test_recording_collects_the_dims_constrain_places(mesh):
    lay = Layout.create("batch:data", dict(mesh.shape))
    with tracing.using(layout=lay, mesh=mesh, seen=set()) as trace:
        jax.eval_shape(lambda a: constrain(constrain(a, ("batch", None)), ("batch", "hidden")), jnp.ones((8, 4)))
    assert trace.seen == {"batch", "hidden"}
    with tracing.using(seen=set()) as outside:
        constrain(jnp.ones(2), ("pixels",))  # no layout active: nothing is placed, nothing recorded
    assert outside.seen == set()


def test_create_duplicate_dim():
    with pytest.raises(LayoutError) as e:
        Layout.create("hidden:model; hidden:data", SIZES)
    expect(e, "dim 'hidden'", "mapped twice", "'model'", "'data'")


def test_layout_accessors():
    lay = Layout.create("batch:data; hidden:model", SIZES)
    assert str(lay) == "batch:data; hidden:model"
    assert Layout.create(str(lay), SIZES) == lay  # str round-trips
    assert lay.axis("batch") == "data" and lay.axis("hidden") == "model" and lay.axis("pixels") is None
    assert lay.axis_size("batch") == 4 and lay.axis_size("hidden") == 2 and lay.axis_size("pixels") == 1
    assert Layout.create({"batch": "data", "hidden": "model"}, SIZES) == lay  # mapping form is the same layout


@pytest.mark.parametrize(
    "dims, expected",
    [
        (("batch", "hidden"), P("data", "model")),
        (("batch", "pixels"), P("data", None)),  # a dim without a rule is replicated
        (("pixels", "hidden"), P(None, "model")),
        (("hidden", "classes"), P("model", None)),
        (("batch", None), P("data", None)),  # an unnamed dim is replicated
        ((None, "hidden"), P(None, "model")),
        ((None, None), P(None, None)),
        (("pixels", "classes"), P(None, None)),
        (("batch", None, "hidden", None), P("data", None, "model", None)),
        (("batch",), P("data")),
        ((), P()),
    ],
)
def test_spec(dims, expected):
    lay = Layout.create("batch:data; hidden:model", SIZES)
    assert lay.spec(dims) == expected
    assert lay.spec(list(dims)) == expected


def test_spec_with_no_rules_replicates_everything():
    lay = Layout.create(None, SIZES)
    assert lay.spec(("batch", "hidden", None)) == P(None, None, None)


def test_spec_two_dims_on_one_axis():
    lay = Layout.create("batch:data; hidden:model; hidden_2:model", SIZES)
    assert lay.spec(("hidden", "classes")) == P("model", None)  # fine one at a time
    assert lay.spec(("batch", "hidden_2")) == P("data", "model")
    with pytest.raises(LayoutError) as e:
        lay.spec(("hidden", "hidden_2"))
    expect(e, "'hidden'", "'hidden_2'", "mesh axis 'model'", "one tensor")
    with pytest.raises(LayoutError) as e:
        lay.spec(("batch", "hidden", None, "hidden"))  # the same dim twice in one tensor
    expect(e, "'hidden'", "mesh axis 'model'")


def test_check_shape_ok():
    lay = Layout.create("batch:data; hidden:model", SIZES)
    lay.check_shape(("pixels", "hidden"), (784, 512))
    lay.check_shape(("batch", None), (8, 7))  # an unnamed dim may have any size
    lay.check_shape(("pixels", "classes"), (783, 9))  # replicated dims may have any size
    lay.check_shape((), ())


@pytest.mark.parametrize(
    "dims, shape, substrings",
    [
        (("pixels", "hidden"), (784, 101), ["dim 'hidden'", "size 101", "mesh axis 'model'", "size 2"]),
        (("batch", None), (6, 3), ["dim 'batch'", "size 6", "mesh axis 'data'", "size 4"]),
        (("hidden",), (3,), ["dim 'hidden'", "size 3", "'model'", "size 2"]),
    ],
)
def test_check_shape_not_divisible(dims, shape, substrings):
    lay = Layout.create("batch:data; hidden:model", SIZES)
    with pytest.raises(LayoutError) as e:
        lay.check_shape(dims, shape, what="parameter layers/0/kernel")
    expect(e, "parameter layers/0/kernel", *substrings)


def test_check_shape_default_what_and_rank_mismatch():
    lay = Layout.create("batch:data; hidden:model", SIZES)
    with pytest.raises(LayoutError) as e:
        lay.check_shape(("hidden",), (5,))
    expect(e, "tensor", "dim 'hidden'", "size 5")
    with pytest.raises(LayoutError) as e:
        lay.check_shape(("batch", "hidden"), (8,), what="x")
    expect(e, "x has shape (8,)", "('batch', 'hidden')")


def test_check_shape_reports_axis_conflict():
    lay = Layout.create("hidden:model; hidden_2:model", SIZES)
    with pytest.raises(LayoutError) as e:
        lay.check_shape(("hidden", "hidden_2"), (4, 4))
    expect(e, "'hidden'", "'hidden_2'", "'model'")


def test_sharding(mesh):
    lay = Layout.create("batch:data; hidden:model", dict(mesh.shape))
    s = lay.sharding(mesh, ("batch", "hidden"))
    assert isinstance(s, NamedSharding) and s.mesh is mesh and s.spec == P("data", "model")


# --------------------------------------------------------------------------------------------
# constrain / activate


def test_constrain_is_identity_outside_activate():
    x = jnp.arange(12.0).reshape(3, 4)  # 3 rows: would not even split 4 ways
    assert constrain(x, ("batch", "hidden")) is x
    y = jax.jit(lambda a: constrain(a * 2, ("batch", "hidden")))(x)
    np.testing.assert_array_equal(y, x * 2)
    assert len(y.sharding.device_set) == 1


def test_constrain_inside_activate_under_jit(mesh):
    lay = Layout.create("batch:data; hidden:model", dict(mesh.shape))
    x = jnp.arange(8.0 * 6).reshape(8, 6)

    def f(a):
        return constrain(a * 2 + 1, ("batch", "hidden"))

    with activate(lay, mesh):
        y = jax.jit(f)(x)
    expected = NamedSharding(mesh, P("data", "model"))
    assert y.sharding.is_equivalent_to(expected, 2)
    assert {s.data.shape for s in y.addressable_shards} == {(2, 3)}
    assert len(y.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2 + 1)

    with activate(lay, mesh):
        z = jax.jit(lambda a: constrain(a, (None, "hidden")))(x)
    assert z.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    assert {s.data.shape for s in z.addressable_shards} == {(8, 3)}


def test_activate_restores_on_exit_and_on_error(mesh):
    lay = Layout.create("batch:data", dict(mesh.shape))
    x = jnp.ones((8, 2))
    with tracing.using(keep=(("mlp_out",), "device")):  # activate changes only its own fields
        with activate(lay, mesh, params_on_host=True):
            assert tracing.current() == tracing.Trace(lay, mesh, True, keep=(("mlp_out",), "device"))
        assert tracing.current() == tracing.Trace(keep=(("mlp_out",), "device"))
    assert tracing.current() == tracing.Trace()
    with pytest.raises(RuntimeError):
        with activate(lay, mesh):
            raise RuntimeError("boom")
    assert tracing.current() == tracing.Trace()
    assert constrain(x, ("batch", None)) is x


def test_constrain_raises_layout_error_on_conflict(mesh):
    lay = Layout.create("hidden:model; hidden_2:model", dict(mesh.shape))
    with activate(lay, mesh), pytest.raises(LayoutError) as e:
        jax.jit(lambda a: constrain(a, ("hidden", "hidden_2")))(jnp.ones((4, 4)))
    expect(e, "'hidden'", "'hidden_2'", "'model'")


# --------------------------------------------------------------------------------------------
# Sharded initialisation of the MLP: each device holds exactly its slice.


@dataclasses.dataclass
class _Initialised:
    mesh: object
    layout: Layout
    state: object


@pytest.fixture(scope="module")
def mlp_experiment():
    """The MLP's train state after sharded initialisation, wired as ``meshpar.train.build`` does
    (config → mesh → layout → check_params → init_state), without the input pipeline."""
    from meshpar.configuration import config as config_lib
    from meshpar.models import MODELS
    from meshpar.step import trainer

    cfg = config_lib.from_dict(
        {"mesh": "data:4,model:2", "layout": "batch:data; hidden:model", "model": {"name": "mlp", "hidden": [64, 32]}}
    )
    mesh = build_mesh(cfg.mesh)
    lay = Layout.create(cfg.layout, dict(mesh.shape))
    element_spec = {"inputs": ((28, 28), np.float32), "targets": ((), np.int32)}  # 784 pixels
    build_model = functools.partial(MODELS["mlp"].build, cfg.model, element_spec)
    _, abstract_params = trainer.abstract_model(build_model)
    trainer.check_params(abstract_params, lay)
    tx = trainer.make_optimizer(cfg.optimizer, cfg.train.steps)
    _, state, _ = trainer.init_state(build_model, tx, 0, lay, mesh)
    return _Initialised(mesh, lay, state)


def _model_index(mesh) -> dict:
    """device → its index along the `model` mesh axis."""
    devices = np.asarray(mesh.devices)
    axis = list(mesh.axis_names).index("model")
    return {d: idx[axis] for idx, d in np.ndenumerate(devices)}


def test_mlp_first_kernel_sharded_over_model(mlp_experiment):
    exp = mlp_experiment
    mesh = exp.mesh
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    kernel = exp.state.params["layers"][0]["kernel"][...]
    assert kernel.shape == (784, 64)
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    full = np.asarray(kernel)
    model_of = _model_index(mesh)
    shards = kernel.addressable_shards
    assert sorted(s.device.id for s in shards) == sorted(d.id for d in mesh.devices.flat)
    by_model: dict[int, list[np.ndarray]] = {0: [], 1: []}
    for s in shards:
        data = np.asarray(s.data)
        assert data.shape == (784, 32)  # half the columns, never the whole kernel
        m = model_of[s.device]
        np.testing.assert_array_equal(data, full[:, m * 32 : (m + 1) * 32])
        by_model[m].append(data)
    for m, group in by_model.items():
        assert len(group) == 4  # one per data index
        for g in group[1:]:
            np.testing.assert_array_equal(g, group[0])  # replicas over `data` agree
    np.testing.assert_array_equal(np.concatenate([by_model[0][0], by_model[1][0]], axis=1), full)
    assert not np.array_equal(by_model[0][0], by_model[1][0])  # the halves really differ


def test_mlp_other_params_follow_their_dims(mlp_experiment):
    exp = mlp_experiment
    mesh = exp.mesh
    layers = exp.state.params["layers"]
    expected = {
        (0, "bias"): (P("model"), (32,)),  # ("hidden",)
        (1, "kernel"): (P("model", None), (32, 32)),  # ("hidden", "hidden_2"): row-split
        (1, "bias"): (P(None), (32,)),  # ("hidden_2",): replicated
        (2, "kernel"): (P(None, None), (32, 10)),  # ("hidden_2", "classes")
        (2, "bias"): (P(None), (10,)),
    }
    for (i, name), (spec, shard_shape) in expected.items():
        arr = layers[i][name][...]
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), (i, name, arr.sharding)
        assert {s.data.shape for s in arr.addressable_shards} == {shard_shape}, (i, name)


def test_check_params_names_the_parameter():
    from meshpar.models import MODELS
    from meshpar.models.mlp import MLPConfig
    from meshpar.step import trainer

    lay = Layout.create("batch:data; hidden:model", SIZES)
    build_model = functools.partial(MODELS["mlp"].build, MLPConfig(hidden=(101,)), {"inputs": ((784,), np.float32)})
    _, abstract_params = trainer.abstract_model(build_model)
    with pytest.raises(LayoutError) as e:
        trainer.check_params(abstract_params, lay)
    # The first offending parameter in flat-state order (layers/0/bias or layers/0/kernel).
    expect(e, "parameter layers/0/", "dim 'hidden'", "size 101", "mesh axis 'model'", "size 2")
