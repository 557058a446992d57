"""``python -m meshpar.convert`` and ``checkpoint.init_from``: a Hugging Face Llama into a run that
resumes and fine-tunes, back out to a folder transformers loads, and inputs that cannot be
converted (one line, exit status 2, nothing written)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from meshpar import convert, train
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.hf import export, reader, writer
from meshpar.hf import load as hf_load
from meshpar.run import experiment, hf_runs, init_from, loop
from meshpar.run.metrics import read_jsonl
from meshpar.sharding import layout as layout_lib
from meshpar.step import parts
from tests.support.cli import refuses_in_one_line

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
# A run of the untied_f32 fixture's architecture: byte-level text (its vocabulary is 256).
CONFIG = """
mesh: data:2,model:4
layout: batch:data; heads:model; d_ff:model; vocab:model
model: {name: llama, d_model: 32, n_heads: 4, n_kv_heads: 2, d_head: 8, d_ff: 64, n_layers: 2, vocab_size: 256,
        max_length: 64, rms_eps: 1.0e-5}
data: {source: text, length: 16, max_bytes: 100000}
optimizer: {name: adamw, learning_rate: 0.001}
train: {steps: 3, batch_size: 8, log_every: 1, progress: false}
plan: {check: false}  # the pre-flight has tests of its own; here it would only add compiles
"""
TOKENIZER = {"tokenizer_config.json": '{"model_max_length": 64}', "special_tokens_map.json": '{"bos_token": "<s>"}'}


def _config(tmp_path: Path, text: str = CONFIG) -> Path:
    path = tmp_path / "llama.yaml"
    path.write_text(text)
    return path


def _hf_copy(tmp_path: Path, fixture: str = "untied_f32") -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(FIXTURES / fixture, folder, ignore=shutil.ignore_patterns("reference.npz"))
    return folder


def _run(env, module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_from_hf_resumes_fine_tunes_with_init_from_and_goes_back_to_hf(tmp_path, env, capsys):
    hf = _hf_copy(tmp_path)
    for name, text in TOKENIZER.items():
        (hf / name).write_text(text)
    yaml_path, work, tuned = _config(tmp_path), tmp_path / "W", tmp_path / "tuned"

    done = _run(env, "meshpar.convert", "from-hf", hf, "--config", yaml_path, "--workdir", work)
    assert done.returncode == 0, done.stderr
    assert "peak RSS" in done.stdout and f"workdir={work} --resume" in done.stdout
    assert sorted(p.name for p in work.iterdir()) == sorted(
        ["checkpoints", "hf_config.json", "hf_generation_config.json", *TOKENIZER]
    )
    assert [p.name for p in (work / "checkpoints").iterdir()] == ["0"]

    # A new run from the converted weights (python -m meshpar.train's entry point, in this
    # process): 3 steps, its first loss the imported weights' loss.
    capsys.readouterr()
    assert (
        train.main(
            ["--config", str(yaml_path), f"workdir={tuned}", f"checkpoint.init_from={work}", "checkpoint.every=3"]
        )
        == 0
    )
    assert (
        f"checkpoint.init_from: parameters from {work / 'checkpoints'} (meshpar run, step 0)" in capsys.readouterr().err
    )
    losses = [row["loss"] for row in read_jsonl(tuned / "metrics.jsonl")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # The converted folder is step 0 of the run its config describes: --resume continues it,
    # with the same first step as the run started from it (same weights, state, key and data),
    # whose loss is that of the Hugging Face weights on the first batch, computed here too.
    exp = experiment.build(config.load(yaml_path, [f"workdir={work}", "checkpoint.resume=auto", "train.steps=1"]))
    assert exp.resumed_from == 0
    weights, _ = hf_load.open(hf, exp.cfg.model).load(
        exp.state.params, jax.tree.map(lambda x: x.sharding, exp.state.params)
    )
    first, _ = exp.inputs.eval_feeder.place(exp.inputs.train.batch(0))
    assert float(exp.eval_step(weights, first)["loss"]) == pytest.approx(losses[0], rel=1e-5)
    assert loop.train(exp)["first_loss"] == losses[0]

    # Back out: the fine-tuned run's step 3, with the tokenizer files and the original config
    # found through its init_from.
    out = tmp_path / "out"
    assert convert.main(["to-hf", os.path.relpath(tuned), str(out)]) == 0, (
        capsys.readouterr().err
    )  # a relative path too
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", *TOKENIZER]
    )
    hf_json = json.loads((out / "config.json").read_text())
    assert hf_json["bos_token_id"] == 1 and hf_json["hidden_size"] == 32 and hf_json["dtype"] == "float32"
    saved = init_from.SavedRun.find(tuned)
    assert saved.step == 3
    files = reader.Folder(out)
    layers = files.read("model.layers.1.mlp.down_proj.weight")  # [d_model, d_ff] = W_down(layer 1).T
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    w_down = saved.restore_params(
        {"params/blocks/w_down/value": jax.ShapeDtypeStruct((2, 64, 32), np.float32, sharding=host)}
    )
    np.testing.assert_array_equal(layers, np.asarray(w_down["params/blocks/w_down/value"])[1].T)
    assert not np.array_equal(layers, reader.Folder(hf).read("model.layers.1.mlp.down_proj.weight"))  # it trained


def test_init_from_hf_equals_from_hf_then_resume_and_init_from_a_run_converts_its_dtype(tmp_path):
    hf, yaml_path = _hf_copy(tmp_path), _config(tmp_path)
    work = tmp_path / "W"

    def cfg(*overrides):
        return config.load(yaml_path, list(overrides))

    hf_runs.from_hf(cfg(f"workdir={work}"), hf, work)
    direct = experiment.build(cfg(f"workdir={tmp_path / 'direct'}", f"checkpoint.init_from={hf}"))
    resumed = experiment.build(cfg(f"workdir={work}", "checkpoint.resume=auto"))
    resumed.checkpointer.close()
    assert resumed.resumed_from == 0 and direct.resumed_from is None and direct.checkpointer is None
    for a, b in zip(jax.tree.leaves(direct.state), jax.tree.leaves(resumed.state), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()  # params, fresh moments, step, key

    # From a run into bfloat16 parameters: the same values as a bfloat16 import of the folder.
    bf16 = cfg(f"checkpoint.init_from={work}", "model.param_dtype=bfloat16")
    plan = parts.abstract_step(bf16).plan
    params, line = init_from.load_params(init_from.open_source(bf16, plan.abstract.params), plan)
    assert line == f"checkpoint.init_from: parameters from {work / 'checkpoints'} (meshpar run, step 0); 12 parameters"
    expected, _ = hf_load.open(hf, bf16.model).load(plan.abstract.params, plan.shardings.params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        assert a.dtype == jax.numpy.bfloat16 and a.sharding == b.sharding
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    other = cfg(f"checkpoint.init_from={work}", "model.rms_eps=1.0e-6")
    with pytest.raises(
        ConfigError, match=r"^model\.rms_eps: 1e-06 in the config but 1e-05 in .*W/checkpoints \(meshpar run, step 0\)$"
    ):
        init_from.open_source(other, plan.abstract.params)


def _mistral(folder: Path) -> None:
    (folder / "config.json").write_text(
        json.dumps({**json.loads((folder / "config.json").read_text()), "model_type": "mistral"})
    )


def _tensors(change):
    def apply(folder: Path) -> None:
        files = reader.Folder(folder)
        arrays = {name: files.read(name) for name in files.tensors}
        change(arrays)
        writer.write_file(
            folder / reader.SINGLE, [writer.Entry(k, v.dtype, v.shape, lambda v=v: v) for k, v in arrays.items()]
        )

    return apply


BAD = {
    "architecture": (_mistral, [], r"config error: .*hf/config\.json: model_type is 'mistral', not 'llama' or 'mixtral' \(meshpar reads Llama and Mixtral checkpoints\)"),
    "missing": (_tensors(lambda a: a.pop("model.norm.weight")), [],
                r"checkpoint error: .*hf: tensor model\.norm\.weight is missing \(meshpar's final_norm, \[32\]\)"),
    "extra": (_tensors(lambda a: a.update({"model.layers.2.mlp.up_proj.weight": a["model.layers.1.mlp.up_proj.weight"]})), [],
              r"checkpoint error: .*hf: tensor model\.layers\.2\.mlp\.up_proj\.weight \(F32\[64, 32\]\) is no parameter of this Llama"),
    "shape": (_tensors(lambda a: a.update({"lm_head.weight": a["lm_head.weight"][:128]})), [],
              r"checkpoint error: .*hf: tensor lm_head\.weight has shape \[128, 32\]; this model's unembed needs \[256, 32\]"),
    "model": (lambda folder: None, ["model.n_kv_heads=4"],
              r"config error: model\.n_kv_heads: 4 in the config but 2 in .*hf/config\.json \(num_key_value_heads\)"),
}  # fmt: skip


@pytest.mark.parametrize("kind", BAD)
def test_from_hf_refuses_in_one_line_and_writes_nothing(tmp_path, capsys, kind):
    damage, overrides, expected = BAD[kind]
    hf = _hf_copy(tmp_path)
    damage(hf)
    work = tmp_path / "W"
    argv = ["from-hf", str(hf), "--config", str(_config(tmp_path)), "--workdir", str(work), *overrides]
    refuses_in_one_line(convert.main, argv, capsys, expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "llama.yaml"]  # no W, no partial folder


def test_a_failure_while_writing_leaves_no_folder_behind(tmp_path, capsys, monkeypatch):
    hf = _hf_copy(tmp_path)
    real = reader.read

    def fails_on_layer_1(info):
        if info.name.startswith("model.layers.1."):
            raise reader.CheckpointError(f"tensor {info.name} in {info.path} cannot be read: Input/output error")
        return real(info)

    monkeypatch.setattr(reader, "read", fails_on_layer_1)
    status = convert.main(["from-hf", str(hf), "--config", str(_config(tmp_path)), "--workdir", str(tmp_path / "W")])
    assert status == 2 and "checkpoint error: tensor model.layers.1." in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "llama.yaml"]


def test_the_command_exits_2_with_one_line_and_refuses_a_folder_in_use(tmp_path, env):
    hf = _hf_copy(tmp_path)
    _tensors(lambda a: a.pop("model.layers.0.self_attn.v_proj.weight"))(hf)
    work = tmp_path / "W"
    done = _run(env, "meshpar.convert", "from-hf", hf, "--config", _config(tmp_path), "--workdir", work)
    assert done.returncode == 2 and not work.exists()
    assert done.stderr.strip().splitlines() == [
        f"checkpoint error: {hf}: tensor model.layers.0.self_attn.v_proj.weight is missing (meshpar's blocks/wv layer 0, [16, 32])"
    ]
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    assert (
        convert.main(
            ["from-hf", str(FIXTURES / "untied_f32"), "--config", str(_config(tmp_path)), "--workdir", str(work)]
        )
        == 2
    )
    assert convert.main(["to-hf", str(tmp_path), str(tmp_path / "out")]) == 2  # no checkpoint there
    assert (work / "notes.txt").read_text() == "mine" and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "where, expected",
    [
        ("missing", r"checkpoint\.init_from: .*missing does not exist$"),
        (
            "file.txt",
            r"checkpoint\.init_from: .*file\.txt is a file; give a Hugging Face model folder or a meshpar run's folder$",
        ),
        ("empty", r"checkpoint\.init_from: .*empty is neither a Hugging Face model folder .* nor a meshpar run"),
    ],
)
def test_init_from_names_what_is_wrong_with_the_path(tmp_path, where, expected):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    cfg = config.load(_config(tmp_path), [f"checkpoint.init_from={tmp_path / where}"])
    with pytest.raises(ConfigError, match=expected):
        init_from.open_source(cfg, None)


def test_init_from_a_hugging_face_folder_checks_the_model_section(tmp_path):
    cfg = config.load(_config(tmp_path), [f"checkpoint.init_from={FIXTURES / 'tied_f32'}"])
    with pytest.raises(
        ConfigError, match=r"^model\.n_layers: 2 in the config but 3 in .*tied_f32/config\.json \(num_hidden_layers\)$"
    ):
        init_from.open_source(cfg, None)
    cfg = config.load(_config(tmp_path), [f"checkpoint.init_from={FIXTURES / 'untied_f32'}"])
    assert isinstance(init_from.open_source(cfg, None), hf_load.Source)
    resumed = config.load(_config(tmp_path), [f"checkpoint.init_from={tmp_path / 'gone'}", "checkpoint.resume=auto",
                                              f"workdir={tmp_path / 'run'}"])  # fmt: skip
    (Path(resumed.checkpoint_dir) / "7").mkdir(parents=True)  # a run with a step of its own resumes from it
    assert init_from.open_source(resumed, None) is None


# -------------------------------------------------------------------------------------------
# transformers reads what to-hf writes (where transformers and torch are installed)


@pytest.mark.parametrize("fixture", ["untied_f32", "tied_f32", "v4_llama3"])
def test_transformers_loads_the_export_and_computes_meshpars_logits(tmp_path, fixture):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    arch = json.loads(json.dumps(hf_load.hf_config.read(FIXTURES / fixture)))
    cfg = config.from_dict({"mesh": "data:8", "model": {"name": "llama", **arch},
                            "data": {"source": "text", "length": 16}, "train": {"batch_size": 8}})  # fmt: skip
    step = parts.abstract_step(cfg, element_spec={"tokens": ((17,), np.dtype(np.int32))})
    params, _ = hf_load.open(FIXTURES / fixture, cfg.model).load(step.plan.abstract.params, step.plan.shardings.params)
    # Weights of meshpar's own (not the fixture's): every one changed, position by position.
    params = jax.tree.map(lambda x: x * (1.0 + 0.1 * jax.numpy.cos(jax.numpy.arange(x.size).reshape(x.shape))), params)
    inputs = np.load(FIXTURES / fixture / "reference.npz")["inputs"]
    with layout_lib.activate(step.layout, step.mesh):
        ours = jax.jit(lambda p, x: nnx.merge(step.plan.graphdef, p)(x))(params, np.tile(inputs, (4, 1)))
    host = {hf_load.param_path(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    export.write(tmp_path / "out", cfg.model, host, hf_load.hf_config.read_json(FIXTURES / fixture / "config.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    with torch.no_grad():
        theirs = model(torch.from_numpy(inputs).long()).logits.numpy()
    assert np.abs(np.asarray(ours)[:2] - theirs).max() < 1e-5
    assert (
        np.abs(theirs - np.load(FIXTURES / fixture / "reference.npz")["logits"]).max() > 1e-2
    )  # not the fixture's weights
