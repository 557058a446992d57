"""A model family from outside meshpar, named by its import path (examples/custom_model): it
trains under two layouts through the CLI, the plan names the figures it cannot give, bad
``model.name`` values are one line each, and a family with only the required parts trains."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from meshpar import generate, models, train
from meshpar.configuration import config as config_lib
from meshpar.plan import __main__ as plan_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
NGRAM = ROOT / "examples" / "custom_model" / "ngram.yaml"
FAMILY = "examples.custom_model.ngram:FAMILY"
MODEL_PARALLEL = ("mesh=data:4,model:2", "layout=batch:data; hidden:model; vocab:model")


def _run(module, *args, cwd=ROOT):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], check=False, capture_output=True,
                          text=True, env=env, timeout=300, cwd=cwd)  # fmt: skip


def _losses(workdir):
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_the_example_trains_under_two_layouts_as_its_yaml_says(tmp_path):
    # The YAML's header: train loss 5.55 → 2.60 in 40 steps, the same losses model parallel.
    data = _run("meshpar.train", "--config", NGRAM, f"workdir={tmp_path / 'data'}")
    assert data.returncode == 0, data.stderr
    summary = json.loads((tmp_path / "data" / "summary.json").read_text())
    assert summary["config"]["model"]["name"] == FAMILY and summary["mesh"] == "data:8"
    assert summary["first_loss"] == pytest.approx(5.55, abs=0.01) and summary["final_loss"] < 2.65
    assert summary["mfu"] is not None  # the family gives its FLOPs
    model = _run("meshpar.train", "--config", NGRAM, f"workdir={tmp_path / 'model'}", *MODEL_PARALLEL, "train.steps=20")
    assert model.returncode == 0, model.stderr
    assert json.loads((tmp_path / "model" / "summary.json").read_text())["mesh"] == "data:4,model:2"
    losses = _losses(tmp_path / "model")
    assert losses[-1] < losses[0] < 4.0  # logged at steps 10 and 20: falling
    assert losses == pytest.approx(_losses(tmp_path / "data")[:2], rel=1e-4)  # the same model, split otherwise


def test_the_plan_names_what_the_family_does_not_give(tmp_path):
    out = tmp_path / "plan.json"
    result = _run("meshpar.plan", "--config", NGRAM, "--json", out)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    said = [line for line in lines if "not given)" in line]
    assert len(said) == 2, result.stdout
    assert said[0].startswith(f"search: family {FAMILY} gives no activation all-reduces")
    assert said[1].startswith(f"offload.activations: family {FAMILY} names no activations")
    missing = json.loads(out.read_text())["missing"]
    assert [m["part"] for m in missing] == ["activation_all_reduces", "activation_names"]
    assert [m["line"] for m in missing] == said
    assert json.loads(out.read_text())["fits"] is True


def test_the_search_of_a_bare_family_says_what_it_lacks(tmp_path):
    out = tmp_path / "search.json"
    result = _run("meshpar.plan", "--config", NGRAM, "--search", "--top", "1", "--json", out,
                  "model.name=examples.custom_model.ngram:BARE")  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = json.loads(out.read_text())
    assert found["missing"][0].startswith("time: family examples.custom_model.ngram:BARE gives no FLOPs")
    assert any(line.startswith("search: no model-axis candidates") for line in found["missing"])
    for line in found["missing"]:
        assert line in result.stdout.splitlines()
    # No model-axis split: no candidate puts a dim on model (batch may go there).
    assert found["rows"] and all("hidden" not in r["layout"] and "vocab" not in r["layout"] for r in found["rows"])
    assert all(r["estimate"]["compute_s"] == 0.0 for r in found["rows"])  # no FLOPs: no compute term


@pytest.mark.parametrize(
    "name, says",
    [
        ("gpt", ["'gpt' is not a model", "mlp, transformer, llama", "package.module:ATTRIBUTE"]),
        ("no_such_pkg.models:FAMILY", ["cannot import module 'no_such_pkg.models'", "No module named 'no_such_pkg'"]),
        ("examples.custom_model.ngram:NOPE", ["module 'examples.custom_model.ngram' has no attribute 'NOPE'"]),
        ("examples.custom_model.ngram:NgramConfig", ["is a type, not a meshpar.models.Family"]),
        ("examples.custom_model.ngram:FIELDS", ["is a dict, not a meshpar.models.Family"]),
    ],
)
def test_a_bad_model_name_is_one_line(name, says, capsys, tmp_path):
    assert train.main(["--config", str(NGRAM), f"model.name={name}", f"workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: model.name: "), err
    for text in says:
        assert text in err


def test_the_family_config_validates_the_section(capsys, tmp_path):
    args = ["--config", str(NGRAM), f"workdir={tmp_path}"]
    assert train.main([*args, "model.hidden=0"]) == 2
    assert capsys.readouterr().err == "config error: model.hidden: must be >= 1, got 0\n"
    assert train.main([*args, "model.depth=3"]) == 2
    assert capsys.readouterr().err.startswith("config error: model.depth: unknown key (known: name, vocab_size,")
    assert train.main([*args, f"model.embed={2**31}"]) == 2  # jax's int32 limit holds for any family
    assert "model.embed: must be <= 2147483647" in capsys.readouterr().err
    assert train.main([*args, "offload.activations=dots"]) == 2  # needs a part the family does not give
    err = capsys.readouterr().err
    assert err.startswith("config error: offload.activations: ") and f"family {FAMILY} names no activations" in err


BARE_MODULE = """
import dataclasses

import jax.numpy as jnp
from flax import nnx

from meshpar.models import Family


@dataclasses.dataclass(frozen=True)
class Config:  # no `name` field: meshpar adds one
    vocab_size: int = 256  # token ids
    width: int = 16  # embedding width


class Bigram(nnx.Module):
    def __init__(self, cfg, rngs):
        table = nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.width))
        self.table = nnx.Param(table, dims=("vocab", "embed"))
        self.out = nnx.Param(jnp.zeros((cfg.width, cfg.vocab_size)), dims=("embed", "vocab"))

    def loss(self, batch, rngs=None):
        tokens = batch["tokens"].astype(jnp.int32)
        logits = self.table[...][tokens[:, :-1]] @ self.out[...]
        logp = nnx.log_softmax(logits)
        loss = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
        return loss, {}


FAMILY = Family(config=Config, build=lambda cfg, spec, rngs: Bigram(cfg, rngs), fields={"tokens": (1, "iu")})
"""


def test_a_family_with_only_the_required_parts_trains(tmp_path):
    # Imported from the working directory (not meshpar's, not on sys.path otherwise).
    (tmp_path / "my_models.py").write_text(BARE_MODULE)
    run = tmp_path / "run"
    result = _run("meshpar.train", "--config", NGRAM, "model={name: 'my_models:FAMILY', width: 8}", f"workdir={run}",
                  "train.steps=2", "train.log_every=1", "train.eval_every=0", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    done = result.stdout.strip().splitlines()[-1]
    assert "MFU unknown (model my_models:FAMILY gives no FLOPs: flops_per_example not given)" in done
    summary = json.loads((run / "summary.json").read_text())
    assert summary["config"]["model"] == {"vocab_size": 256, "width": 8, "name": "my_models:FAMILY"}
    assert summary["tflops_per_device"] is None and summary["mfu"] is None
    assert summary["tokens_per_s"] == summary["examples_per_s"]  # one token per example by default
    assert len(_losses(run)) == 2


def test_family_resolves_once_and_keeps_builtins():
    assert models.family("mlp") is models.MODELS["mlp"]
    assert models.family(FAMILY) is models.family(FAMILY)
    assert models.config_class(FAMILY) is models.family(FAMILY).config  # it declares `name`
    cfg = config_lib.load(str(NGRAM), [])
    assert cfg.model.name == FAMILY and cfg.model.hidden == 256
    assert [m["part"] for m in models.missing("mlp")] == []


# A module whose own code fails when imported: (source, the line of the failure, what it says).
FAILING_MODULES = {
    "name_error": ("import os\n\nFAMILY = undefined_name\n", 3, "NameError: name 'undefined_name' is not defined"),
    "syntax_error": ("import os\n\ndef broken(:\n", 3, "SyntaxError: invalid syntax"),
    "runtime_error": (
        "def check():\n    raise RuntimeError('needs a GPU\\nto import')\n\ncheck()\n", 2,
        "RuntimeError: needs a GPU to import",
    ),
}  # fmt: skip


def _failing_module(tmp_path, kind, monkeypatch):
    """Module `fails_<kind>` in tmp_path (on sys.path), and the one line that names its failure."""
    source, line, says = FAILING_MODULES[kind]
    module = f"fails_{kind}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return module, f"config error: model.name: importing {module} failed: {says} ({tmp_path / module}.py:{line})\n"


@pytest.mark.parametrize("kind", list(FAILING_MODULES))
@pytest.mark.parametrize("command", ["train", "plan", "generate"])
def test_a_family_module_that_fails_when_imported_is_one_line(command, kind, tmp_path, monkeypatch, capsys):
    """Not only ImportError: whatever a module's own code raises when imported (a SyntaxError,
    a NameError, a RuntimeError of several lines) is one line naming model.name, the module, the
    exception's type, message, file and line, exit 2, from each command."""
    module, expected = _failing_module(tmp_path, kind, monkeypatch)
    override = f"model.name={module}:FAMILY"
    if command == "train":
        code = train.main(["--config", str(NGRAM), override, f"workdir={tmp_path / 'run'}"])
    elif command == "plan":
        code = plan_cli.main(["--config", str(NGRAM), override])
    else:
        hf = ROOT / "tests" / "fixtures" / "hf" / "untied_f32"
        code = generate.main(["--hf", str(hf), "--prompt", "a", override])
    out = capsys.readouterr()
    assert (code, out.err) == (2, expected)


def test_a_family_module_that_fails_when_imported_is_one_line_from_the_shell(tmp_path, monkeypatch):
    """The same from ``python -m meshpar.train``, the module on PYTHONPATH: no traceback."""
    module, expected = _failing_module(tmp_path, "runtime_error", monkeypatch)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "meshpar.train", "--config", str(NGRAM),
                             f"model.name={module}:FAMILY", f"workdir={tmp_path / 'run'}"],
                            check=False, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)  # fmt: skip
    assert (result.returncode, result.stdout, result.stderr) == (2, "", expected)
