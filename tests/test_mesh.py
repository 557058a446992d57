"""meshpar.sharding.mesh: parsing ``"data:4,model:2"``, filling ``-1``, building the mesh on the 8 test CPUs."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from meshpar.sharding import mesh as mesh_lib
from meshpar.sharding.mesh import MeshError, build_mesh, describe, parse_mesh, resolve


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and msg.splitlines() == [msg], f"not one line: {msg!r}"
    return msg


# --------------------------------------------------------------------------------------------
# parse_mesh


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("data:4,model:2", (("data", 4), ("model", 2))),
        ("data:8", (("data", 8),)),
        (" data : 4 ,  model:2 ", (("data", 4), ("model", 2))),
        ("data:-1,model:2", (("data", -1), ("model", 2))),
        ("model:2,data:-1", (("model", 2), ("data", -1))),
        ("a:1,b:2,c:4", (("a", 1), ("b", 2), ("c", 4))),
        ("data:+4", (("data", 4),)),
        # Mesh TensorFlow's mesh_shape strings, verbatim: ';', ',', '.' and whitespace separate
        ("b1:4;b2:2", (("b1", 4), ("b2", 2))),
        ("b1:4.b2:2", (("b1", 4), ("b2", 2))),
        ("b1:4 b2:2", (("b1", 4), ("b2", 2))),
        ("b1:4\tb2:2\nb3:1", (("b1", 4), ("b2", 2), ("b3", 1))),
        ("batch:4;model:2,ensemble:1", (("batch", 4), ("model", 2), ("ensemble", 1))),
        ("b1 : 4 ; b2 : -1", (("b1", 4), ("b2", -1))),  # whitespace around a colon stays in its pair
        ("data:4,", (("data", 4),)),  # empty pairs are skipped, as in layouts and Mesh TensorFlow
        (";data:4;;model:2.", (("data", 4), ("model", 2))),
    ],
)
def test_parse_mesh_string(spec, expected):
    assert parse_mesh(spec) == expected


@pytest.mark.parametrize(
    "spec, expected",
    [
        ({"data": 4, "model": 2}, (("data", 4), ("model", 2))),
        ({"model": 2, "data": 4}, (("model", 2), ("data", 4))),  # order kept
        ({"data": -1}, (("data", -1),)),
        ({" data ": "4"}, (("data", 4),)),  # names stripped, numeric strings accepted
    ],
)
def test_parse_mesh_mapping(spec, expected):
    assert parse_mesh(spec) == expected


def test_parse_mesh_sizes_are_ints():
    assert all(type(n) is int for _, n in parse_mesh({"data": "4", "model": 2}))


@pytest.mark.parametrize(
    "spec, substrings",
    [
        # malformed 'name:size'
        ("data", ["'data'", "not 'name:size'"]),
        ("data:4,model", ["'model'", "not 'name:size'"]),
        ("data:4 model", ["'model'", "not 'name:size'", "separated by ';', ',', '.' or spaces"]),
        ("", ["no axes"]),
        (" ;. ", ["no axes"]),
        ("data=4", ["'data=4'", "not 'name:size'"]),
        # names
        ("1data:4", ["'1data'", "not an identifier"]),
        (":4", ["''", "not an identifier"]),
        ("da ta:4", ["'da'", "not 'name:size'"]),  # whitespace separates complete pairs only
        ("da-ta:4", ["'da-ta'", "not an identifier"]),
        ({"da ta": 4}, ["'da ta'", "not an identifier"]),
        # non-integer sizes
        ("data:four", ["'data'", "'four'", "not an integer"]),
        ("data:2.5", ["'data'", "'2.5'", "not an integer"]),  # a '.' between digits is no separator
        ("b1:2.5;b2:2", ["'b1'", "'2.5'", "not an integer"]),
        ("data:(4,2)", ["'data'", "'(4,2)'", "not an integer"]),
        ("data:(4", ["unclosed parenthesis"]),
        ("data:", ["'data'", "''", "not an integer"]),
        ("data:4:2", ["'data'", "'4:2'", "not an integer"]),
        ({"data": 2.5}, ["'data'", "'2.5'", "not an integer"]),
        ({"data": True}, ["'data'", "'True'", "not an integer"]),
        ({"data": None}, ["'data'", "not an integer"]),
        # zero / negative sizes other than -1
        ("data:0", ["'data'", "size 0", "-1 for the remaining devices"]),
        ("data:4,model:-2", ["'model'", "size -2"]),
        ({"data": -3}, ["'data'", "size -3"]),
        # duplicates
        ("data:4,data:2", ["'data'", "appears twice"]),
        ("data:4, data :2", ["'data'", "appears twice"]),
        # two -1 axes
        ("data:-1,model:-1", ["more than one axis is -1"]),
        ({"data": -1, "model": -1}, ["more than one axis is -1"]),
        # empty / wrong type
        ({}, ["no axes"]),
        (8, ["int"]),
        (["data:4"], ["list"]),
        (None, ["NoneType"]),
    ],
)
def test_parse_mesh_errors(spec, substrings):
    with pytest.raises(MeshError) as e:
        parse_mesh(spec)
    msg = one_line(e)
    for s in substrings:
        assert s in msg, (s, msg)


def test_mesh_error_is_value_error():
    assert issubclass(MeshError, ValueError)


# --------------------------------------------------------------------------------------------
# resolve / cpu_device_count


@pytest.mark.parametrize(
    "axes, n, expected",
    [
        ((("data", -1), ("model", 2)), 8, (("data", 4), ("model", 2))),
        ((("data", -1),), 8, (("data", 8),)),
        ((("model", 2), ("data", -1)), 8, (("model", 2), ("data", 4))),
        ((("data", -1), ("model", 8)), 8, (("data", 1), ("model", 8))),
        ((("data", -1), ("model", 2)), 16, (("data", 8), ("model", 2))),
        # nothing to fill: returned unchanged, whatever the device count
        ((("data", 4), ("model", 2)), 8, (("data", 4), ("model", 2))),
        ((("data", 2),), 8, (("data", 2),)),
    ],
)
def test_resolve(axes, n, expected):
    assert resolve(axes, n) == expected


@pytest.mark.parametrize("axes, n", [((("data", -1), ("model", 3)), 8), ((("data", -1), ("model", 16)), 8)])
def test_resolve_fill_does_not_divide(axes, n):
    with pytest.raises(MeshError) as e:
        resolve(axes, n)
    msg = one_line(e)
    fixed = axes[1][1]
    assert "'data'" in msg and "-1" in msg and str(n) in msg and str(fixed) in msg


def test_cpu_device_count(monkeypatch):
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    assert mesh_lib.cpu_device_count((("data", 4), ("model", 2))) == 8
    assert mesh_lib.cpu_device_count((("data", 2),)) == 2
    assert mesh_lib.cpu_device_count((("data", -1),)) == mesh_lib.DEFAULT_CPU_DEVICES
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "4")
    assert mesh_lib.cpu_device_count((("data", -1), ("model", 2))) == 4
    assert mesh_lib.cpu_device_count((("data", 3),)) == 3  # no -1: the env var is not consulted


# --------------------------------------------------------------------------------------------
# build_mesh on the 8 simulated CPU devices (tests/conftest.py)


def test_test_host_has_8_cpus():
    assert jax.devices()[0].platform == "cpu"
    assert len(jax.devices()) == 8


@pytest.mark.parametrize(
    "spec, shape",
    [
        ("data:4,model:2", {"data": 4, "model": 2}),
        ("data:-1,model:2", {"data": 4, "model": 2}),
        ("model:2,data:-1", {"model": 2, "data": 4}),
        ("data:-1", {"data": 8}),
        ({"data": 2, "model": -1}, {"data": 2, "model": 4}),
        ((("data", 8),), {"data": 8}),
        ("data:2", {"data": 2}),
        ("data:1,model:1", {"data": 1, "model": 1}),
        ("a:2,b:2,c:2", {"a": 2, "b": 2, "c": 2}),
    ],
)
def test_build_mesh_shape_and_devices(monkeypatch, spec, shape):
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    mesh = build_mesh(spec)
    assert dict(mesh.shape) == shape
    assert tuple(mesh.axis_names) == tuple(shape)
    n = int(np.prod(list(shape.values())))
    # The first n CPU devices, in order.
    assert list(np.asarray(mesh.devices).flat) == jax.devices()[:n]
    assert mesh.devices.shape == tuple(shape.values())


def test_build_mesh_axes_are_auto():
    mesh = build_mesh("data:-1,model:2")
    assert tuple(mesh.axis_types) == (AxisType.Auto, AxisType.Auto)
    assert all(t == AxisType.Auto for t in build_mesh("a:2,b:2,c:2").axis_types)


def test_build_mesh_fill_uses_jax_num_cpu_devices(monkeypatch):
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "4")
    mesh = build_mesh("data:-1,model:2")
    assert dict(mesh.shape) == {"data": 2, "model": 2}
    assert list(mesh.devices.flat) == jax.devices()[:4]


@pytest.mark.parametrize(
    "spec, substrings",
    [
        # -1 does not divide the 8 devices
        ("data:-1,model:3", ["'data'", "-1", "8 devices", "3"]),
        ("data:-1,model:16", ["'data'", "8 devices", "16"]),
        # bigger than the 8 devices
        ("data:16", ["16 devices", "8"]),
        ("data:4,model:4", ["16 devices", "8"]),
        ({"data": 3, "model": 3}, ["9 devices", "8"]),
        # parse errors surface unchanged
        ("data:0", ["'data'", "size 0"]),
        ("data:-1,model:-1", ["more than one axis is -1"]),
    ],
)
def test_build_mesh_errors(monkeypatch, spec, substrings):
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    with pytest.raises(MeshError) as e:
        build_mesh(spec)
    msg = one_line(e)
    for s in substrings:
        assert s in msg, (s, msg)


class _FakeAccelerator:
    platform = "gpu"


def test_build_mesh_on_accelerators_must_use_every_device(monkeypatch):
    # On an accelerator host the mesh takes every device; a smaller mesh is an error that names
    # both counts and the platform (checked before any real mesh is made, so fakes suffice).
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [_FakeAccelerator() for _ in range(8)])
    with pytest.raises(MeshError) as e:
        build_mesh("data:4")
    msg = one_line(e)
    assert "data:4" in msg and "4 devices" in msg and "8 gpu devices" in msg
    with pytest.raises(MeshError) as e:
        build_mesh("data:-1,model:3")
    assert "8 devices" in one_line(e)


# --------------------------------------------------------------------------------------------
# describe


@pytest.mark.parametrize(
    "spec, text",
    [
        ("data:4,model:2", "data:4,model:2"),
        ("data:-1,model:2", "data:4,model:2"),
        ("model:2,data:-1", "model:2,data:4"),
        ("data:8", "data:8"),
    ],
)
def test_describe(spec, text):
    mesh = build_mesh(spec)
    assert describe(mesh) == text
    assert parse_mesh(describe(mesh)) == tuple(mesh.shape.items())  # round-trips


# --------------------------------------------------------------------------------------------
# Names: ASCII identifiers of at most MAX_NAME_LENGTH characters (jax 0.10's XLA aborts the
# process on a non-ASCII axis name; see the CLI test in tests/test_fuzz_config.py)


@pytest.mark.parametrize(
    "spec, shown",
    [
        ("données:8", "'données'"),
        ("ｄａｔａ:8", "'ｄａｔａ'"),  # fullwidth: Python would read it as `data`
        ("data:4,modèle:2", "'modèle'"),
        ({"da\u2028ta": 8}, "'da\\u2028ta'"),
        ({"a\nb": 8}, "'a\\nb'"),
    ],
)
def test_parse_mesh_rejects_names_that_are_not_ascii_identifiers(spec, shown):
    with pytest.raises(MeshError) as e:
        parse_mesh(spec)
    msg = one_line(e)
    assert shown in msg and "ASCII" in msg, msg


def test_parse_mesh_name_length_limit():
    longest = "a" * mesh_lib.MAX_NAME_LENGTH
    assert parse_mesh(f"{longest}:8") == ((longest, 8),)
    with pytest.raises(MeshError) as e:
        parse_mesh(f"{longest}b:8")
    msg = one_line(e)
    assert f"at most {mesh_lib.MAX_NAME_LENGTH}" in msg and len(msg) < 200, msg  # the name is cut short
    with pytest.raises(MeshError) as e:
        parse_mesh("é" * 10**6 + ":8")
    assert len(one_line(e)) < 250


def test_parse_mesh_axis_count_limit():
    # 33 axes failed in jax.make_mesh with a traceback (numpy's 32-dimension limit).
    most = ",".join(f"a{i}:1" for i in range(mesh_lib.MAX_AXES))
    assert len(parse_mesh(most)) == mesh_lib.MAX_AXES
    with pytest.raises(MeshError) as e:
        parse_mesh(most + ",b:1")
    assert f"33 axes; at most {mesh_lib.MAX_AXES}" in one_line(e)


# --------------------------------------------------------------------------------------------
# Simulated CPU devices: JAX_NUM_CPU_DEVICES and MAX_CPU_DEVICES


@pytest.mark.parametrize(
    "value, expected", [("1", 1), (" 16 ", 16), ("+8", 8), (str(mesh_lib.MAX_CPU_DEVICES), mesh_lib.MAX_CPU_DEVICES)]
)
def test_cpu_devices_from_env(value, expected):
    assert mesh_lib.cpu_devices_from_env(value) == expected


@pytest.mark.parametrize(
    "value",
    ["abc", "", "1.5", "8 devices", "0", "-1", "-8", str(mesh_lib.MAX_CPU_DEVICES + 1), "100000", "9" * 30, "a\nb"],
)
def test_cpu_devices_from_env_rejects(value):
    with pytest.raises(MeshError) as e:
        mesh_lib.cpu_devices_from_env(value)
    msg = one_line(e)
    assert "JAX_NUM_CPU_DEVICES" in msg and str(mesh_lib.MAX_CPU_DEVICES) in msg and repr(value)[:20] in msg, msg


def test_cpu_device_count_and_build_mesh_reject_a_bad_env(monkeypatch):
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "0")
    with pytest.raises(MeshError) as e:
        mesh_lib.cpu_device_count((("data", -1),))
    assert "JAX_NUM_CPU_DEVICES='0'" in one_line(e)
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "100000")
    with pytest.raises(MeshError) as e:
        build_mesh("data:4,model:2")  # no -1 axis, but jax would still size its CPU client from it
    assert "JAX_NUM_CPU_DEVICES='100000'" in one_line(e)


def test_request_cpu_devices_never_asks_beyond_the_limit(monkeypatch):
    asked = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: asked.append((name, value)))
    mesh_lib.request_cpu_devices(100_000)
    mesh_lib.request_cpu_devices(mesh_lib.MAX_CPU_DEVICES + 1)
    assert asked == []
    mesh_lib.request_cpu_devices(mesh_lib.MAX_CPU_DEVICES)
    assert asked == [("jax_num_cpu_devices", mesh_lib.MAX_CPU_DEVICES)]


@pytest.mark.parametrize("spec", ["data:100000", "data:4,model:128", "data:257"])
def test_build_mesh_refuses_more_simulated_cpu_devices_than_the_limit(spec):
    with pytest.raises(MeshError) as e:
        build_mesh(spec)
    msg = one_line(e)
    assert f"at most {mesh_lib.MAX_CPU_DEVICES}" in msg and "JAX_NUM_CPU_DEVICES" in msg and f"mesh {spec}" in msg, msg


# --------------------------------------------------------------------------------------------
# plan_devices: the device-count rule, as a pure function of (axes, platform, devices, processes)


@pytest.mark.parametrize(
    "axes, platform, n, processes, expected, count",
    [
        # accelerators: a -1 axis takes the real devices (all processes), never the CPU default of 8
        ((("data", -1), ("model", 2)), "gpu", 16, 1, (("data", 8), ("model", 2)), 16),
        ((("data", -1),), "gpu", 64, 8, (("data", 64),), 64),
        ((("data", -1), ("model", 8)), "tpu", 512, 64, (("data", 64), ("model", 8)), 512),
        # ... and a fixed mesh as big as the host, far beyond the simulated-CPU limit
        ((("data", 128), ("model", 8)), "gpu", 1024, 128, (("data", 128), ("model", 8)), 1024),
        # CPU: the mesh takes the first devices it names; -1 fills DEFAULT_CPU_DEVICES
        ((("data", -1), ("model", 2)), "cpu", 16, 1, (("data", 4), ("model", 2)), 8),
        ((("data", 4),), "cpu", 8, 1, (("data", 4),), 4),
        ((("data", 256),), "cpu", 256, 1, (("data", 256),), 256),
        ((("data", 400),), "cpu", 400, 2, (("data", 400),), 400),  # 200 per process
    ],
)
def test_plan_devices(monkeypatch, axes, platform, n, processes, expected, count):
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    assert mesh_lib.plan_devices(axes, platform, n, processes) == (expected, count)


def test_plan_devices_cpu_fill_follows_jax_num_cpu_devices(monkeypatch):
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "32")
    assert mesh_lib.plan_devices((("data", -1), ("model", 2)), "cpu", 32) == ((("data", 16), ("model", 2)), 32)
    # on accelerators the variable does not size the mesh
    assert mesh_lib.plan_devices((("data", -1), ("model", 2)), "gpu", 8) == ((("data", 4), ("model", 2)), 8)


@pytest.mark.parametrize(
    "axes, platform, n, processes, substrings",
    [
        ((("data", 4),), "gpu", 8, 1, ["mesh data:4 has 4 devices", "8 gpu devices"]),
        ((("data", -1), ("model", 3)), "gpu", 16, 1, ["'data'", "16 devices", "3"]),
        ((("data", 512),), "cpu", 512, 1, ["512 simulated CPU devices", "at most 256", "JAX_NUM_CPU_DEVICES"]),
        ((("data", 600),), "cpu", 600, 2, ["600 simulated CPU devices (300 per process)", "at most 256"]),
        ((("data", 16),), "cpu", 8, 1, ["needs 16 devices", "CPU backend has 8"]),
    ],
)
def test_plan_devices_errors(monkeypatch, axes, platform, n, processes, substrings):
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    with pytest.raises(MeshError) as e:
        mesh_lib.plan_devices(axes, platform, n, processes)
    msg = one_line(e)
    for s in substrings:
        assert s in msg, (s, msg)


def test_build_mesh_sizes_a_fill_axis_from_the_real_accelerators(monkeypatch):
    # 12 (fake) GPUs: the -1 axis is sized from 12, not from the simulated-CPU default of 8
    # (checked before any real mesh is made, so fakes suffice).
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [_FakeAccelerator() for _ in range(12)])
    with pytest.raises(MeshError) as e:
        build_mesh("data:-1,model:5")
    assert "12 devices do not divide by the other axes' 5" in one_line(e)
    seen = {}
    monkeypatch.setattr(jax, "make_mesh", lambda shape, names, **k: seen.update(shape=shape, n=len(k["devices"])))
    build_mesh("data:-1,model:2")
    assert seen == {"shape": (6, 2), "n": 12}
