"""Hugging Face Llama checkpoints: safetensors files, config.json, parity of meshpar's logits with
transformers' own (tests/fixtures/hf, made by scripts/make_hf_fixture.py), import → export →
import, folders that cannot be read, and the host memory an import takes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.configuration.errors import CheckpointError
from meshpar.hf import export, load, names, reader, writer
from meshpar.hf import model_config as hf_config
from meshpar.sharding import layout as layout_lib
from meshpar.step import parts
from tests.support import steps
from tests.support.hf_import import import_report

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
LENGTH = 16
SPEC = {"tokens": ((LENGTH + 1,), np.dtype(np.int32))}
# Mesh TensorFlow's data + model layout; with 2 key/value heads and model:4, kv_heads stays whole.
MODEL_PARALLEL = "batch:data; heads:model; kv_heads:model; d_ff:model; vocab:model"
LAYOUTS = {
    "data8": ("data:8", "batch:data"),
    "data2-model4": ("data:2,model:4", "batch:data; heads:model; d_ff:model; vocab:model"),
    "data4-model2": ("data:4,model:2", MODEL_PARALLEL),
}


def _cfg(fixture: str, mesh: str = "data:8", layout: str = "batch:data", **model) -> config.Config:
    arch = hf_config.read(FIXTURES / fixture)
    return config.from_dict({
        "mesh": mesh, "layout": layout, "model": {"name": "llama", **arch, **model},
        "data": {"source": "text", "length": LENGTH}, "train": {"batch_size": 8},
    })  # fmt: skip


def _step(cfg: config.Config) -> parts.AbstractStep:
    """The config's parts (mesh, layout, state plan), built once per config."""
    return steps.abstract_step(cfg, SPEC)


def _load(fixture: str | Path, cfg: config.Config):
    step = _step(cfg)
    folder = fixture if isinstance(fixture, Path) else FIXTURES / fixture
    return load.open(folder, cfg.model).load(step.plan.abstract.params, step.plan.shardings.params)


def _logits(cfg: config.Config, params, inputs: np.ndarray) -> np.ndarray:
    """meshpar's logits of the fixture's 2 rows, run as a batch of 8 (the batch splits 8 ways)."""
    step = _step(cfg)
    with layout_lib.activate(step.layout, step.mesh):
        out = jax.jit(lambda p, x: nnx.merge(step.plan.graphdef, p)(x))(params, np.tile(inputs, (4, 1)))
    return np.asarray(out)[: len(inputs)]


def _flat(params) -> dict[str, np.ndarray]:
    return {load.param_path(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


# -------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize(
    "fixture, layout",
    [(f, lay) for f in ("untied_f32", "tied_f32", "v4_llama3", "bf16") for lay in ("data8", "data2-model4")]
    + [("untied_f32", "data4-model2")],
)
def test_logits_match_transformers(fixture, layout):
    """float32 weights (and bfloat16 ones, which convert to float32 exactly) give transformers'
    float32 logits within 1e-5, under data and model parallel layouts."""
    cfg = _cfg(fixture, *LAYOUTS[layout])
    params, report = _load(fixture, cfg)
    ref = np.load(FIXTURES / fixture / "reference.npz")
    logits = _logits(cfg, params, ref["inputs"])
    assert np.abs(logits - ref["logits"]).max() < 1e-5
    assert report.tensors == len(names.tensors(cfg.model)) and report.placed_bytes > 0
    if layout == "data4-model2":  # the heads' weights are split over model as the layout says
        wk = params["blocks"]["wk"].get_value()
        assert wk.sharding.spec == jax.sharding.PartitionSpec(None, None, "model", None)


def test_bfloat16_compute_is_no_further_from_float32_than_torchs_own_bfloat16():
    """bfloat16 parameters and compute: the logits' error against the float32 reference is within
    1.5x of what transformers' own bfloat16 run of the same weights has (max and RMS over all
    logits; the fixture's torch run: max 0.085, RMS 0.0135). Rounding differs with the order of
    reductions, so equality with torch's bfloat16 logits is not expected; the same size of error is."""
    cfg = _cfg("bf16", param_dtype="bfloat16", compute_dtype="bfloat16")
    params, _ = _load("bf16", cfg)
    assert params["embed"].get_value().dtype == jax.numpy.bfloat16
    ref = np.load(FIXTURES / "bf16" / "reference.npz")
    ours, torch_err = _logits(cfg, params, ref["inputs"]) - ref["logits"], ref["logits_bf16"] - ref["logits"]
    assert np.abs(ours).max() <= 1.5 * np.abs(torch_err).max()
    assert np.sqrt((ours**2).mean()) <= 1.5 * np.sqrt((torch_err**2).mean())
    assert np.abs(ours).max() > 1e-3  # it did compute in bfloat16


# -------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize(
    "fixture, dtype, shard", [("untied_f32", "float32", 0), ("tied_f32", "float32", 50_000), ("bf16", "bfloat16", 0)]
)
def test_import_export_import_is_bit_identical(tmp_path, fixture, dtype, shard):
    cfg = _cfg(fixture, *LAYOUTS["data2-model4"], param_dtype=dtype)
    params, _ = _load(fixture, cfg)
    host = _flat(params)
    out = tmp_path / "out"
    written = export.write(out, cfg.model, host, hf_config.read_json(FIXTURES / fixture / "config.json"),
                           max_shard_bytes=shard or writer.MAX_SHARD_BYTES)  # fmt: skip
    assert (reader.INDEX in written) == bool(shard)
    original, exported = reader.Folder(FIXTURES / fixture), reader.Folder(out)
    assert sorted(exported.tensors) == sorted(original.tensors)
    for name in original.tensors:
        a, b = original.read(name), exported.read(name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    assert hf_config.read(out) == hf_config.read(FIXTURES / fixture)
    again, _ = _load(out, cfg)
    for name, x in _flat(again).items():
        assert x.tobytes() == host[name].tobytes(), name


def test_names_convert_each_kind_of_tensor_both_ways():
    cfg = _cfg("v4_llama3").model  # head_dim 16 ≠ d_model / heads: q_proj is [64, 32]
    rng = np.random.default_rng(0)
    for t in names.tensors(cfg):
        w = rng.normal(size=t.hf_shape).astype(np.float32)
        x = t.to_meshpar(w, np.float32)
        assert x.shape == t.shape and x.flags.c_contiguous
        np.testing.assert_array_equal(t.to_hf(x), w)
    wq = next(t for t in names.tensors(cfg) if t.hf.endswith("q_proj.weight"))
    w = rng.normal(size=wq.hf_shape).astype(np.float32)  # [heads * d_head, d]: row h * d_head + k
    np.testing.assert_array_equal(wq.to_meshpar(w, np.float32)[:, 3, 5], w[3 * 16 + 5, :])


# -------------------------------------------------------------------------------------------
# safetensors files


def test_reader_agrees_with_safetensors_and_writer_round_trips_every_dtype(tmp_path):
    fixture = reader.Folder(FIXTURES / "untied_f32")
    theirs = load_file(FIXTURES / "untied_f32" / "model.safetensors")
    assert sorted(fixture.tensors) == sorted(theirs)
    for name, array in theirs.items():
        np.testing.assert_array_equal(fixture.read(name), array)
    rng = np.random.default_rng(1)
    arrays = {
        "a.f32": rng.normal(size=(3, 5)).astype(np.float32),
        "b.bf16": rng.normal(size=(7, 2)).astype(ml_dtypes.bfloat16),
        "c.f16": rng.normal(size=(4,)).astype(np.float16),
        "d.i64": np.arange(6, dtype=np.int64).reshape(2, 3),
    }
    entries = [writer.Entry(k, v.dtype, v.shape, lambda v=v: v) for k, v in arrays.items()]
    for limit, folder in ((writer.MAX_SHARD_BYTES, tmp_path / "one"), (64, tmp_path / "shards")):
        folder.mkdir()
        files = writer.write_folder(folder, entries, limit)
        back = reader.Folder(folder)
        for k, v in arrays.items():
            assert back.read(k).dtype == v.dtype and back.read(k).tobytes() == v.tobytes(), (folder, k)
        assert len(files) == (1 if limit > 1000 else 4)  # 3 shards + their index
    # safetensors' own reader reads what the writer wrote (it cannot read bfloat16 into numpy)
    save_file({"x": arrays["a.f32"]}, tmp_path / "theirs.safetensors")
    writer.write_file(tmp_path / "mine.safetensors", [e for e in entries if e.name != "b.bf16"])
    mine = load_file(tmp_path / "mine.safetensors")
    np.testing.assert_array_equal(mine["c.f16"], arrays["c.f16"])
    np.testing.assert_array_equal(mine["d.i64"], arrays["d.i64"])


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), r"tensor .* has bytes \d+\.\.\d+ .* in a file of \d+ bytes"),
        (lambda p: p.write_bytes(b"\xff" * 8 + p.read_bytes()[8:]), r"is not a safetensors file \(header length"),
        (lambda p: p.write_bytes(p.read_bytes()[:8] + b"x" + p.read_bytes()[9:]), r"its header is not JSON"),
        (lambda p: p.write_bytes(b"\x01"), r"is not a safetensors file \(1 bytes, no header\)"),
    ],
    ids=["truncated", "header-length", "header-json", "empty"],
)
def test_damaged_files_are_one_line_naming_the_file(tmp_path, damage, expected):
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "untied_f32", folder)
    damage(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=expected) as e:
        reader.Folder(folder)
    assert str(folder / "model.safetensors") in str(e.value) and "\n" not in str(e.value)


def test_a_shard_the_index_names_must_exist_and_hold_its_tensors(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "tied_f32", folder)
    index = json.loads((folder / reader.INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00004.safetensors"
    (folder / reader.INDEX).write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError,
        match=r"puts tensor model\.norm\.weight in model-00001-of-00004.safetensors, but it is in model-0000\d",
    ):
        reader.Folder(folder)
    (folder / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"names shard model-00002-of-00004.safetensors, which .* does not hold"):
        reader.Folder(folder)


# -------------------------------------------------------------------------------------------
# config.json


def test_both_config_spellings_read_the_same_fields_and_write_back():
    v4 = hf_config.read(FIXTURES / "v4_llama3")  # rope_theta + rope_scaling, by hand
    assert v4["rope_scaling"] == "llama3" and v4["rope_original_max_length"] == 32 and v4["d_head"] == 16
    v5 = json.loads((FIXTURES / "v4_llama3" / "config.json").read_text())
    v5["rope_parameters"] = {**v5.pop("rope_scaling"), "rope_theta": v5.pop("rope_theta")}
    assert hf_config.architecture(v5, "v5") == v4
    old = json.loads((FIXTURES / "v4_llama3" / "config.json").read_text())
    old["rope_scaling"]["type"] = old["rope_scaling"].pop("rope_type")  # the oldest spelling
    assert hf_config.architecture(old, "old") == v4
    tied = hf_config.read(FIXTURES / "tied_f32")
    assert tied["tie_embeddings"] and tied["rope_theta"] == 500000.0 and tied["rms_eps"] == 1e-6
    no_head_dim = json.loads((FIXTURES / "untied_f32" / "config.json").read_text())
    del no_head_dim["head_dim"], no_head_dim["num_key_value_heads"]
    assert (
        hf_config.architecture(no_head_dim, "x")["d_head"],
        hf_config.architecture(no_head_dim, "x")["n_kv_heads"],
    ) == (8, 4)
    for fixture in ("v4_llama3", "tied_f32"):
        model = _cfg(fixture).model
        written = hf_config.to_hf(model)
        assert hf_config.architecture(written, "written") == hf_config.read(FIXTURES / fixture)
        assert hf_config.architecture(
            {**written, "rope_parameters": None}, "as transformers 4 reads it"
        ) == hf_config.read(FIXTURES / fixture)


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"model_type": "mistral"}, r"model_type is 'mistral', not 'llama'"),
        ({"architectures": ["LlamaModel"]}, r"architectures is \['LlamaModel'\], not \['LlamaForCausalLM'\]"),
        ({"hidden_act": "gelu"}, r"hidden_act is 'gelu'; meshpar's llama is SwiGLU with silu"),
        ({"attention_bias": True}, r"attention_bias is True; meshpar's llama has no biases"),
        ({"mlp_bias": True}, r"mlp_bias is True"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type is 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"\(rope low_freq_factor\): has no low_freq_factor"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor is 0.5"),
        ({"hidden_size": "32"}, r"hidden_size is '32', not a positive integer"),
        ({"num_hidden_layers": None}, r"has no num_hidden_layers"),
    ],
)
def test_config_json_that_meshpar_cannot_compute_is_one_line_naming_the_field(change, expected):
    raw = {**json.loads((FIXTURES / "untied_f32" / "config.json").read_text()), **change}
    with pytest.raises(ConfigError, match=f"^where.*{expected}"):
        hf_config.architecture(raw, "where")


def test_a_model_section_that_differs_from_config_json_names_the_key_and_both_values():
    cfg = _cfg("untied_f32", d_model=64)
    with pytest.raises(
        ConfigError, match=r"^model\.d_model: 64 in the config but 32 in .*untied_f32/config\.json \(hidden_size\)$"
    ):
        load.open(FIXTURES / "untied_f32", cfg.model)
    cfg = _cfg("untied_f32", rope_factor=2.0)  # not llama3: the factors do not matter
    load.open(FIXTURES / "untied_f32", cfg.model)
    assert "rope_factor" not in hf_config.model_yaml(hf_config.read(FIXTURES / "untied_f32"))
    assert "  rope_original_max_length: 32\n" in hf_config.model_yaml(hf_config.read(FIXTURES / "v4_llama3"))


# -------------------------------------------------------------------------------------------
# Tensors that do not fit the model


def _rewrite(folder: Path, change) -> None:
    """Rewrite `folder`'s model.safetensors with `change(dict of arrays)` applied."""
    path = folder / "model.safetensors"
    files = reader.Folder(folder)
    arrays = {name: files.read(name) for name in files.tensors}
    change(arrays)
    writer.write_file(path, [writer.Entry(k, v.dtype, v.shape, lambda v=v: v) for k, v in arrays.items()])


BAD_TENSORS = {
    "missing": (lambda a: a.pop("model.layers.1.mlp.up_proj.weight"),
                r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing \(meshpar's blocks/w_up layer 1, \[64, 32\]\)"),
    "extra": (lambda a: a.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}),
              r"tensor model\.layers\.0\.self_attn\.q_proj\.bias \(F32\[32\]\) is no parameter of this Llama"),
    "shape": (lambda a: a.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)}),
              r"tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \[8, 32\]; this model's blocks/wk layer 0 needs \[16, 32\]"),
    "integer": (lambda a: a.update({"model.norm.weight": np.zeros(32, np.int32)}),
                r"tensor model\.norm\.weight is I32\[32\], not a float"),
}  # fmt: skip


@pytest.mark.parametrize("kind", BAD_TENSORS)
def test_tensors_that_do_not_fit_are_one_line_naming_the_tensor(tmp_path, kind):
    change, expected = BAD_TENSORS[kind]
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "untied_f32", folder)
    _rewrite(folder, change)
    with pytest.raises(CheckpointError, match=expected):
        load.open(folder, _cfg("untied_f32").model)


def test_tensors_transformers_skips_are_skipped(tmp_path):
    """Older conversions saved the rotary inv_freq buffers; tied models may carry lm_head."""
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "untied_f32", folder)
    _rewrite(folder, lambda a: a.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}))
    load.open(folder, _cfg("untied_f32").model)
    tied = tmp_path / "tied"
    tied.mkdir()
    shutil.copy(FIXTURES / "tied_f32" / "config.json", tied)
    files = reader.Folder(FIXTURES / "tied_f32")  # three shards, rewritten as one file with lm_head
    arrays = {name: files.read(name) for name in files.tensors}
    arrays["lm_head.weight"] = arrays["model.embed_tokens.weight"]
    writer.write_file(
        tied / reader.SINGLE, [writer.Entry(k, v.dtype, v.shape, lambda v=v: v) for k, v in arrays.items()]
    )
    assert "lm_head.weight" not in {t.hf for t in load.open(tied, _cfg("tied_f32").model).tensors}


# -------------------------------------------------------------------------------------------
# Host memory


def test_an_import_keeps_host_memory_within_placed_bytes_plus_two_tensors(tmp_path, env):
    """A 71 MB float32 Llama written by meshpar's writer, imported in a process of its own on
    data:2,model:4 (placed: twice the model, replicated over data, in host memory on CPU): the
    process's high-water resident memory stays below its baseline + the placed bytes + twice the
    largest tensor (4 MiB; the process's own allocations while it places, up to ~4 MiB on a loaded
    machine, stay within that). Reading the model whole first, or building a stacked parameter on
    the host, would add 71 MB or 16 MB over that."""
    arch = dict(d_model=256, n_heads=8, n_kv_heads=4, d_head=32, d_ff=1024, n_layers=16, vocab_size=4096, max_length=64,
                rms_eps=1e-5, tie_embeddings=False)  # fmt: skip
    model = config.from_dict({"model": {"name": "llama", **arch}}).model
    folder = tmp_path / "big"
    folder.mkdir()
    rng = np.random.default_rng(0)
    entries = [writer.Entry(t.hf, np.dtype(np.float32), t.hf_shape, lambda t=t: rng.standard_normal(t.hf_shape, np.float32))
               for t in names.tensors(model)]  # fmt: skip
    writer.write_folder(folder, entries)
    (folder / "config.json").write_text(json.dumps(hf_config.to_hf(model)))
    raw = {"mesh": "data:2,model:4", "layout": MODEL_PARALLEL, "model": {"name": "llama", **arch},
           "data": {"source": "text", "length": 16}, "train": {"batch_size": 8}}  # fmt: skip
    r = import_report(folder, raw, env)

    model_bytes = sum(e.nbytes for e in entries)
    assert model_bytes > 30e6 and r["largest_tensor_bytes"] == 4096 * 256 * 4
    assert 1.9 * model_bytes < r["placed_bytes"] < 2.1 * model_bytes  # replicated twice over data
    grew = r["peak_rss"] - r["baseline_rss"]
    assert grew > 0.9 * r["placed_bytes"]  # the placed bytes are host memory here: the measure sees them
    assert r["peak_rss"] <= r["baseline_rss"] + r["placed_bytes"] + 2 * r["largest_tensor_bytes"], r
