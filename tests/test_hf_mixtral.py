"""Mixtral checkpoints and generation from a mixture-of-experts model: the key/value cache of an
MoE decoder against its full forward pass; a Hugging Face ``MixtralForCausalLM``
(tests/fixtures/hf/mixtral_f32, made by scripts/make_hf_fixture.py) imported under several
layouts with transformers' logits, greedy continuations equal to transformers' ``generate``,
import → export round trips in both tensor spellings, ``checkpoint.init_from`` into a training
run, and the one-line refusals."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from meshpar import convert, generate
from meshpar import train as train_cli
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.hf import export, load, names, reader, writer
from meshpar.hf import model_config as hf_config
from meshpar.models import llama
from meshpar.run import decoding, experiment, init_from, loop
from meshpar.run.metrics import read_jsonl
from meshpar.sharding import layout as layout_lib
from meshpar.step import parts
from tests.support import steps
from tests.support.cli import refuses_in_one_line
from tests.support.hf_import import import_report
from tests.support.kv_cache import decode_errors

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MIXTRAL = FIXTURES / "mixtral_f32"
LENGTH = 16
SPEC = {"tokens": ((LENGTH + 1,), np.dtype(np.int32))}
EXPERTS, TOP_K = 4, 2
# Capacity dispatch that drops nothing: each expert takes a whole group (factor = experts / k),
# and the groups are one row each, so that they split over the batch's axis.
NO_DROP = {"moe_dispatch": "capacity", "moe_capacity_factor": EXPERTS / TOP_K, "moe_group_size": LENGTH}
LAYOUTS = {
    "single": ("data:1", "batch:data", {}),
    "data8": ("data:8", "batch:data", {}),
    "data4-model2": ("data:4,model:2", "batch:data; heads:model; d_ff:model; vocab:model", {}),
    "experts-split": ("data:4,model:2", "batch:data; experts:model", NO_DROP),
    "dropless-experts-split": ("data:4,model:2", "batch:(data,model); experts:model", {}),
}


def _cfg(mesh: str = "data:8", layout: str = "batch:data", folder: Path = MIXTRAL, **model) -> config.Config:
    section = hf_config.model_section(hf_config.read(folder))
    return config.from_dict({
        "mesh": mesh, "layout": layout, "model": {**section, **model},
        "data": {"source": "text", "length": LENGTH}, "train": {"batch_size": 8},
    })  # fmt: skip


def _step(cfg: config.Config) -> parts.AbstractStep:
    """The config's parts (mesh, layout, state plan), built once per config."""
    return steps.abstract_step(cfg, SPEC)


def _load(cfg: config.Config, folder: Path = MIXTRAL):
    step = _step(cfg)
    return load.open(folder, cfg.model).load(step.plan.abstract.params, step.plan.shardings.params)


def _logits(cfg: config.Config, params, inputs: np.ndarray) -> tuple[np.ndarray, dict]:
    """meshpar's logits of the fixture's 2 rows, run as a batch of 8, and each MoE layer's statistics."""
    step = _step(cfg)
    with layout_lib.activate(step.layout, step.mesh):
        out, stats = jax.jit(lambda p, x: nnx.merge(step.plan.graphdef, p).forward(x))(params, np.tile(inputs, (4, 1)))
    return np.asarray(out)[: len(inputs)], stats


def _flat(params) -> dict[str, np.ndarray]:
    return {load.param_path(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "mixtral"
    shutil.copytree(MIXTRAL, folder, ignore=shutil.ignore_patterns("reference.npz"))
    return folder


def _rewrite(folder: Path, change) -> None:
    """Rewrite `folder`'s model.safetensors with `change(dict of arrays)` applied."""
    files = reader.Folder(folder)
    arrays = {name: files.read(name) for name in files.tensors}
    change(arrays)
    writer.write_file(
        folder / reader.SINGLE, [writer.Entry(k, v.dtype, v.shape, lambda v=v: v) for k, v in arrays.items()]
    )


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _fuse(arrays: dict[str, np.ndarray]) -> None:
    """transformers 5's in-memory spelling of the experts: per layer ``mlp.gate.weight``,
    ``mlp.experts.gate_up_proj [E, 2f, d]`` (each expert's w1 rows, then its w3 rows) and
    ``mlp.experts.down_proj [E, d, f]``."""
    for i in range(2):
        at = f"model.layers.{i}."
        arrays[at + "mlp.gate.weight"] = arrays.pop(at + "block_sparse_moe.gate.weight")
        expert = [{w: arrays.pop(f"{at}block_sparse_moe.experts.{j}.{w}.weight") for w in ("w1", "w2", "w3")}
                  for j in range(EXPERTS)]  # fmt: skip
        arrays[at + "mlp.experts.gate_up_proj"] = np.stack([np.concatenate([e["w1"], e["w3"]]) for e in expert])
        arrays[at + "mlp.experts.down_proj"] = np.stack([e["w2"] for e in expert])


# -------------------------------------------------------------------------------------------
# Decoding with the key/value cache

SMALL = {"d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_head": 8, "d_ff": 32, "n_layers": 4, "vocab_size": 64,
         "max_length": 32, "moe_experts": EXPERTS, "moe_top_k": TOP_K}  # fmt: skip


def _moe_model(**changes) -> tuple[llama.LlamaConfig, nnx.Module]:
    cfg = llama.LlamaConfig(**{**SMALL, **changes})
    return cfg, llama.build(cfg, {"tokens": ((17,), np.int32)}, nnx.Rngs(0))


@pytest.mark.parametrize(
    "dispatch, every", [("dropless", 1), ("dropless", 2), ("capacity", 1), ("capacity", 2)], ids=lambda v: str(v)
)
def test_decoding_an_moe_model_with_the_cache_gives_the_full_forward_passs_logits(dispatch, every):
    """Prefill then one token at a time, one row left-padded by 3, every layer or every other
    one a mixture of experts: each step's logits are the full forward pass's at that token's
    position (float32). Capacity dispatch with a factor of experts / k drops nothing in either."""
    cfg, model = _moe_model(moe_dispatch=dispatch, moe_every=every, moe_capacity_factor=EXPERTS / TOP_K)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size))
    full, stats = model.forward(jnp.asarray(tokens))
    full = np.asarray(full)
    assert np.asarray(stats["dropped"]).max() < 1e-6 and len(stats["dropped"]) == cfg.n_layers // every
    errors, cache = decode_errors(model, tokens, full, pad=3)
    assert int(cache.index) == 12 and cache.k.shape[0] == cfg.n_layers
    assert max(errors) < 1e-5, errors
    # The experts count: the same model with its experts' outputs zeroed gives other logits.
    model.blocks.experts_down[...] = jnp.zeros_like(model.blocks.experts_down[...])
    assert np.abs(np.asarray(model(jnp.asarray(tokens))) - full).max() > 1e-2


def test_capacity_decoding_routes_each_row_on_its_own():
    """With a capacity that drops (factor 0.5), a row's decoded logits do not depend on the other
    rows of the batch: each row's tokens are routing groups of their own."""
    cfg, model = _moe_model(moe_dispatch="capacity", moe_capacity_factor=0.5)
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (3, 8), 0, cfg.vocab_size))
    assert np.asarray(model.forward(jnp.asarray(tokens[:1]))[1]["dropped"]).min() > 0  # a row alone drops
    seen = []
    for other in (1, 2):
        cache = model.init_cache(2, 10, jnp.zeros(2, jnp.int32))
        logits, cache = model.decode(jnp.asarray(tokens[[0, other]]), cache)
        step, _ = model.decode(jnp.asarray(tokens[[0, other], :1]), cache)
        seen.append((np.asarray(logits[0]), np.asarray(step[0])))
    np.testing.assert_array_equal(seen[0][0], seen[1][0])
    np.testing.assert_array_equal(seen[0][1], seen[1][1])


# -------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers(layout):
    """The fixture's logits within 1e-5 of transformers' float32 ones on one device, data
    parallel, Megatron-style model parallel (the experts' d_ff split), and capacity and dropless
    dispatch with the experts split over the model axis (the expert weights placed so)."""
    mesh, rules, model = LAYOUTS[layout]
    cfg = _cfg(mesh, rules, **model)
    params, report = _load(cfg)
    ref = np.load(MIXTRAL / "reference.npz")
    logits, stats = _logits(cfg, params, ref["inputs"])
    assert np.abs(logits - ref["logits"]).max() < 1e-5
    assert np.asarray(stats["dropped"]).max() < 1e-6  # none: one assignment of 256 would be 0.004
    assert report.tensors == len(names.tensors(cfg.model)) == 2 * (6 + 1 + 3 * EXPERTS) + 3
    gate = params["blocks"]["experts_gate"].get_value()
    assert gate.shape == (2, EXPERTS, 32, 32)
    if layout in ("experts-split", "dropless-experts-split"):
        assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "model", None, None)
    if layout == "data4-model2":
        assert gate.sharding.spec == jax.sharding.PartitionSpec(None, None, None, "model")


def test_names_place_each_expert_at_its_layer_and_index_both_ways():
    cfg = _cfg().model
    for fused in (False, True):
        rng = np.random.default_rng(0)
        for t in names.tensors(cfg, fused):
            w = rng.normal(size=t.hf_shape).astype(np.float32)
            np.testing.assert_array_equal(t.to_hf(t.to_meshpar(w, np.float32)), w)
    by = {t.hf: t for t in names.tensors(cfg)}
    w3 = by["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    assert (w3.param, w3.layer, w3.shape, w3.hf_shape) == ("blocks/experts_up", (1, 2), (32, 32), (32, 32))
    assert by["model.layers.0.block_sparse_moe.gate.weight"].hf_shape == (EXPERTS, 32)
    fused = [t for t in names.tensors(cfg, True) if t.hf == "model.layers.1.mlp.experts.gate_up_proj"]
    assert [(t.param, t.layer, t.part) for t in fused if t.layer[1] == 2] == [
        ("blocks/experts_gate", (1, 2), 4), ("blocks/experts_up", (1, 2), 5)
    ]  # fmt: skip
    assert {t.stored_shape for t in fused} == {(EXPERTS, 64, 32)}


# -------------------------------------------------------------------------------------------
# Generation


def _prompts(ref) -> list[np.ndarray]:
    return [row[mask.astype(bool)].astype(np.int64) for row, mask in zip(ref["generate_inputs"], ref["generate_mask"])]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "mesh=data:4,model:2",
            "layout=batch:data; experts:model",
            "model.moe_dispatch=capacity",
            f"model.moe_capacity_factor={EXPERTS / TOP_K}",
        ],
        ["mesh=data:4,model:2", "layout=batch:data; experts:model"],
    ],
    ids=["dropless", "capacity-experts-split", "dropless-experts-split"],
)
def test_greedy_continuations_equal_transformers_generate_token_for_token(overrides):
    """Three token-id prompts as one left-padded batch, and the first alone: 16 greedy tokens each
    equal transformers' ``generate(do_sample=False)``; also with capacity dispatch that drops
    nothing (each row's prompt a routing group of its own) and the experts split over the model
    axis, and dropless with the experts split."""
    ref = np.load(MIXTRAL / "reference.npz")
    cfg = decoding.hf_run_config(MIXTRAL, overrides)
    assert (cfg.model.moe_experts, cfg.model.moe_top_k, cfg.model.moe_every) == (EXPERTS, TOP_K, 1)
    gen = decoding.open_generator(cfg, hf_dir=MIXTRAL)
    prompts = _prompts(ref)
    n = ref["generate_tokens"].shape[1]
    batch = decoding.generate(gen, prompts, n, stop_at_eos=False)
    single = decoding.generate(gen, prompts[:1], n, stop_at_eos=False)
    assert [t.tolist() for t in batch.tokens] == ref["generate_tokens"].tolist()
    assert single.tokens[0].tolist() == ref["generate_single"].tolist()
    assert min(len(set(row.tolist())) for row in ref["generate_tokens"]) >= 8


def test_the_generate_command_continues_a_mixtral_folder(tmp_path, capsys):
    ref = np.load(MIXTRAL / "reference.npz")
    prompts = _prompts(ref)
    out = tmp_path / "out.json"
    args = ["--hf", str(MIXTRAL), "--max-new-tokens", "16", "--ignore-eos", "--json", str(out)]
    args += [arg for p in prompts for arg in ("--prompt-ids", ",".join(map(str, p)))]
    assert generate.main([*args, "mesh=data:4,model:2", "layout=batch:data; heads:model"]) == 0
    assert json.loads(out.read_text())["tokens"] == ref["generate_tokens"].tolist()
    tensors = 2 * (6 + 1 + 3 * EXPERTS) + 3  # per layer: attention and norms, the router, 3 per expert
    assert f"{MIXTRAL} (Hugging Face, {tensors} tensors in 1 safetensors file)" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------
# Round trips and the two spellings


def test_import_export_import_is_bit_identical(tmp_path):
    """Under the experts-split layout: every tensor written back byte for byte under its name, a
    config.json that reads back as the fixture's, and the export imported again bit-identical."""
    cfg = _cfg(*LAYOUTS["experts-split"][:2], **NO_DROP)
    params, _ = _load(cfg)
    host = _flat(params)
    out = tmp_path / "out"
    export.write(out, cfg.model, host, hf_config.read_json(MIXTRAL / "config.json"), max_shard_bytes=60_000)
    original, exported = reader.Folder(MIXTRAL), reader.Folder(out)
    assert len(exported.files) > 1 and sorted(exported.tensors) == sorted(original.tensors)
    for name in original.tensors:
        a, b = original.read(name), exported.read(name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    assert hf_config.read(out) == hf_config.read(MIXTRAL)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "mixtral" and written["architectures"] == ["MixtralForCausalLM"]
    assert "attention_bias" not in written and written["router_aux_loss_coef"] == 0.001
    again, _ = _load(cfg, out)
    for name, x in _flat(again).items():
        assert x.tobytes() == host[name].tobytes(), name


def test_the_fused_spelling_imports_to_the_same_parameters(tmp_path):
    """transformers 5's fused experts (one gate_up_proj and one down_proj per layer) give the
    same parameters, each expert's block read on its own."""
    folder = _copy(tmp_path)
    _rewrite(folder, _fuse)
    assert len(reader.Folder(folder).tensors) == 2 * 9 + 3
    cfg = _cfg(*LAYOUTS["data4-model2"][:2])
    ours, report = _load(cfg, folder)
    theirs, _ = _load(cfg)
    for (name, a), b in zip(_flat(ours).items(), _flat(theirs).values(), strict=True):
        assert a.tobytes() == b.tobytes(), name
    assert report.tensors == 2 * 9 + 3
    assert (
        report.largest_tensor_bytes == 256 * 32 * 4
    )  # the embedding: one expert's block is read, never the fused whole


def test_model_yaml_prints_the_mixtral_section(capsys):
    assert convert.main(["model-yaml", str(MIXTRAL)]) == 0
    text = capsys.readouterr().out
    assert "  moe_experts: 4\n  moe_top_k: 2\n  moe_every: 1\n  moe_dispatch: dropless\n" in text
    assert "  rope_theta: 1000000.0\n" in text
    model = config.from_dict(yaml.safe_load(text)).model
    hf_config.check_model(model, hf_config.read(MIXTRAL), "x")  # the printed section matches the folder


# -------------------------------------------------------------------------------------------
# Host memory


def test_a_fused_mixtral_import_keeps_host_memory_within_placed_bytes_plus_two_tensors(tmp_path, env):
    """A 53 MB float32 Mixtral in transformers 5's fused spelling (8 experts; each layer's
    gate_up_proj 8 MiB, one expert's block of it 0.5 MiB; the largest tensor the 1 MiB
    embedding), imported in a process of its own on data:2,model:4: the peak stays below the
    baseline + the placed bytes + twice the largest tensor. Reading a fused tensor whole, or
    building an expert stack (16 MiB) on the host, would go over."""
    arch = dict(d_model=256, n_heads=8, n_kv_heads=4, d_head=32, d_ff=512, n_layers=4, vocab_size=1024, max_length=64,
                rms_eps=1e-5, tie_embeddings=False, moe_experts=8, moe_top_k=2)  # fmt: skip
    model = config.from_dict({"model": {"name": "llama", **arch}}).model
    folder = tmp_path / "big"
    folder.mkdir()
    rng = np.random.default_rng(0)
    stored = {t.hf: t.stored_shape for t in names.tensors(model, fused=True)}
    entries = [writer.Entry(n, np.dtype(np.float32), shape, lambda shape=shape: rng.standard_normal(shape, np.float32))
               for n, shape in stored.items()]  # fmt: skip
    writer.write_folder(folder, entries)
    (folder / "config.json").write_text(json.dumps(hf_config.to_hf(model)))
    raw = {"mesh": "data:2,model:4", "layout": "batch:data; heads:model; d_ff:model; vocab:model",
           "model": {"name": "llama", **arch, "moe_dispatch": "dropless"},
           "data": {"source": "text", "length": 16}, "train": {"batch_size": 8}}  # fmt: skip
    r = import_report(folder, raw, env)
    model_bytes = sum(e.nbytes for e in entries)
    assert model_bytes > 50e6 and max(e.nbytes for e in entries) == 8 * 1024 * 256 * 4  # a fused gate_up_proj
    assert r["largest_tensor_bytes"] == 1024 * 256 * 4 and r["tensors"] == len(entries)
    assert 1.9 * model_bytes < r["placed_bytes"] < 2.1 * model_bytes  # replicated twice over data
    assert r["peak_rss"] - r["baseline_rss"] > 0.9 * r["placed_bytes"]  # the measure sees the placed bytes
    assert r["peak_rss"] <= r["baseline_rss"] + r["placed_bytes"] + 2 * r["largest_tensor_bytes"], r


# -------------------------------------------------------------------------------------------
# Into a training run

CONFIG = """
mesh: data:8
layout: batch:data
model: {name: llama, d_model: 32, n_heads: 4, n_kv_heads: 2, d_head: 8, d_ff: 32, n_layers: 2, vocab_size: 256,
        max_length: 64, rms_eps: 1.0e-5, rope_theta: 1000000.0, moe_experts: 4, moe_top_k: 2, moe_every: 1,
        moe_dispatch: dropless}
data: {source: text, length: 16, max_bytes: 100000}
optimizer: {name: adamw, learning_rate: 0.001}
train: {steps: 3, batch_size: 8, log_every: 1, progress: false}
plan: {check: false}
"""


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "mixtral.yaml"
    path.write_text(CONFIG)
    return path


def test_init_from_a_mixtral_folder_trains_from_its_weights(tmp_path, capsys):
    """``python -m meshpar.train`` with ``checkpoint.init_from`` a Mixtral folder: 3 steps, the
    first loss that of the folder's weights on the first batch (computed here with the weights
    read by hand) and not that of a fresh model; then to-hf writes the trained Mixtral back."""
    yaml_path, tuned = _config(tmp_path), tmp_path / "tuned"
    argv = ["--config", str(yaml_path), f"workdir={tuned}", f"checkpoint.init_from={MIXTRAL}", "checkpoint.every=3"]
    assert train_cli.main(argv) == 0
    assert f"checkpoint.init_from: parameters from {MIXTRAL}" in capsys.readouterr().err
    rows = read_jsonl(tuned / "metrics.jsonl")
    losses = [row["loss"] for row in rows]
    assert len(losses) == 3 and "moe0_balance" in rows[0] and "moe1_dropped" in rows[0]
    exp = experiment.build(config.load(yaml_path, [f"workdir={tmp_path / 'fresh'}", "train.steps=1"]))
    first, _ = exp.inputs.eval_feeder.place(exp.inputs.train.batch(0))
    shardings = jax.tree.map(lambda x: x.sharding, exp.state.params)
    weights, _ = load.open(MIXTRAL, exp.cfg.model).load(exp.state.params, shardings)
    ce = float(exp.eval_step(weights, first)["cross_entropy"])
    assert ce == pytest.approx(rows[0]["cross_entropy"], rel=1e-5)
    assert abs(float(exp.eval_step(exp.state.params, first)["cross_entropy"]) - ce) > 1e-2  # not a fresh model's
    loop.train(exp)

    out = tmp_path / "out"
    assert convert.main(["to-hf", str(tuned), str(out)]) == 0, capsys.readouterr().err
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "mixtral" and written["num_local_experts"] == EXPERTS
    assert written["bos_token_id"] == 1  # the original config.json, found through init_from
    trained = reader.Folder(out).read("model.layers.1.block_sparse_moe.experts.3.w2.weight")
    saved = init_from.SavedRun.find(tuned)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    name = "params/blocks/experts_down/value"
    down = saved.restore_params({name: jax.ShapeDtypeStruct((2, EXPERTS, 32, 32), np.float32, sharding=host)})[name]
    np.testing.assert_array_equal(trained, np.asarray(down)[1, 3].T)
    assert not np.array_equal(
        trained, reader.Folder(MIXTRAL).read("model.layers.1.block_sparse_moe.experts.3.w2.weight")
    )


def test_from_hf_then_resume_equals_init_from(tmp_path, capsys):
    yaml_path, work = _config(tmp_path), tmp_path / "W"
    status = convert.main(["from-hf", str(MIXTRAL), "--config", str(yaml_path), "--workdir", str(work)])
    assert status == 0, capsys.readouterr().err
    direct = experiment.build(config.load(yaml_path, [f"workdir={tmp_path / 'd'}", f"checkpoint.init_from={MIXTRAL}"]))
    resumed = experiment.build(config.load(yaml_path, [f"workdir={work}", "checkpoint.resume=auto"]))
    resumed.checkpointer.close()
    assert resumed.resumed_from == 0
    for a, b in zip(jax.tree.leaves(direct.state), jax.tree.leaves(resumed.state), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


# -------------------------------------------------------------------------------------------
# One-line refusals


def _missing_expert(folder: Path) -> None:
    _rewrite(folder, lambda a: a.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))


REFUSED = {
    "experts": (None, ["model.moe_experts=8"],
                r"config error: model\.moe_experts: 8 in the config but 4 in .*mixtral/config\.json \(num_local_experts\)"),
    "top-k": (None, ["model.moe_top_k=1"],
              r"config error: model\.moe_top_k: 1 in the config but 2 in .*mixtral/config\.json \(num_experts_per_tok\)"),
    "every": (None, ["model.moe_every=2"],
              r"config error: model\.moe_every: 2 in the config but 1 in .*mixtral/config\.json \(every layer of a Mixtral is a mixture of experts\)"),
    "dense": (None, ["model.moe_experts=0"],
              r"config error: model\.moe_experts: 0 in the config but 4 in .*mixtral/config\.json \(num_local_experts\)"),
    "sliding-window": (lambda f: _edit_config(f, sliding_window=16), [],
                       r"config error: .*mixtral/config\.json: sliding_window is 16, shorter than max_position_embeddings 64; "
                       r"meshpar attends to every earlier position"),
    "jitter": (lambda f: _edit_config(f, router_jitter_noise=0.1), [],
               r"config error: .*mixtral/config\.json: router_jitter_noise is 0\.1; meshpar's router does not jitter \(0\.0\)"),
    "missing-expert": (_missing_expert, [],
                       r"checkpoint error: .*mixtral: tensor model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight is missing "
                       r"\(meshpar's blocks/experts_up layer 1 expert 2, \[32, 32\]\)$"),
    "expert-shape": (lambda f: _rewrite(f, lambda a: a.update({"model.layers.0.block_sparse_moe.gate.weight": np.zeros((8, 32), np.float32)})), [],
                     r"checkpoint error: .*mixtral: tensor model\.layers\.0\.block_sparse_moe\.gate\.weight has shape \[8, 32\]; "
                     r"this model's blocks/router layer 0 needs \[4, 32\]$"),
    "extra-expert": (lambda f: _rewrite(f, lambda a: a.update({"model.layers.0.block_sparse_moe.experts.4.w1.weight": np.zeros((32, 32), np.float32)})), [],
                     r"checkpoint error: .*mixtral: tensor model\.layers\.0\.block_sparse_moe\.experts\.4\.w1\.weight \(F32\[32, 32\]\) "
                     r"is no parameter of this Mixtral"),
}  # fmt: skip


@pytest.mark.parametrize("kind", REFUSED)
def test_from_hf_refuses_a_mixtral_that_does_not_fit_in_one_line(tmp_path, capsys, kind):
    damage, overrides, expected = REFUSED[kind]
    folder = _copy(tmp_path)
    if damage is not None:
        damage(folder)
    work = tmp_path / "W"
    argv = ["from-hf", str(folder), "--config", str(_config(tmp_path)), "--workdir", str(work), *overrides]
    refuses_in_one_line(convert.main, argv, capsys, expected)
    assert not work.exists()


def test_a_sliding_window_as_long_as_the_model_is_taken_and_a_llama_folder_has_no_experts(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, sliding_window=64)
    assert hf_config.read(folder) == hf_config.read(MIXTRAL)
    cfg = _cfg(folder=FIXTURES / "untied_f32", moe_experts=4)
    with pytest.raises(
        ConfigError,
        match=r"^model\.moe_experts: 4 in the config but 0 in .*untied_f32/config\.json \(model_type llama: no experts\)$",
    ):
        load.open(FIXTURES / "untied_f32", cfg.model)
    moe_every = config.load(_config(tmp_path), [f"checkpoint.init_from={MIXTRAL}", "model.moe_every=2"])
    with pytest.raises(ConfigError, match=r"^model\.moe_every: 2 in the config but 1 in "):
        init_from.open_source(moe_every, None)


def test_to_hf_refuses_experts_every_other_layer(tmp_path, capsys):
    work = tmp_path / "W"
    yaml_path = _config(tmp_path)
    overrides = ["model.moe_every=2", "model.n_layers=2", "train.steps=1", "checkpoint.every=1", f"workdir={work}"]
    assert train_cli.main(["--config", str(yaml_path), *overrides]) == 0
    capsys.readouterr()
    assert convert.main(["to-hf", str(work), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(
        r"config error: model\.moe_every: .* has a mixture of experts every 2 layers; a Mixtral has one in every layer \(1\)$",
        err[0],
    ), err
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------------------------------
# transformers reads what to-hf writes (where transformers and torch are installed)


def test_transformers_loads_the_export_and_the_fused_spelling_and_computes_meshpars_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = _cfg()
    params, _ = _load(cfg)
    # Weights of meshpar's own (not the fixture's): every one changed, position by position.
    params = jax.tree.map(lambda x: x * (1.0 + 0.1 * jnp.cos(jnp.arange(x.size).reshape(x.shape))), params)
    inputs = np.load(MIXTRAL / "reference.npz")["inputs"]
    ours, _ = _logits(cfg, params, inputs)
    export.write(tmp_path / "out", cfg.model, _flat(params), hf_config.read_json(MIXTRAL / "config.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert type(model).__name__ == "MixtralForCausalLM" and model.dtype == torch.float32
    with torch.no_grad():
        theirs = model(torch.from_numpy(inputs).long()).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-5
    assert np.abs(theirs - np.load(MIXTRAL / "reference.npz")["logits"]).max() > 1e-2  # not the fixture's weights
    # The fused spelling the import reads is the one transformers reads.
    fused = _copy(tmp_path)
    _rewrite(fused, _fuse)
    model = transformers.AutoModelForCausalLM.from_pretrained(fused, attn_implementation="eager")
    with torch.no_grad():
        theirs = model(torch.from_numpy(inputs).long()).logits.numpy()
    assert np.abs(theirs - np.load(MIXTRAL / "reference.npz")["logits"]).max() < 1e-5
