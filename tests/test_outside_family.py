"""A model family from outside meshpar whose config names its fields its own way (``depth``, not
``n_layers``; ``width``, ``precision``, ``recompute``, ``context``, ``vocab``): meshpar reads it
only through the family's traits, so it trains pipelined over a stage axis, plans (the stage
axis, the pipeline's traffic, remat's FLOPs and the pre-flight's remat change under the family's
own key) and its config errors name its own keys. The built-in families' traits are their
conventional reading, so nothing changes for them."""

import dataclasses
import json
from typing import Literal

import numpy as np
import pytest
import yaml

from meshpar import models, train
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError
from meshpar.models import Family, Traits, decoder, decoder_family, llama, mlp, transformer
from meshpar.plan import __main__ as plan_cli
from meshpar.plan import topology
from meshpar.plan.memory import analytic as memory
from meshpar.plan.memory import trace
from meshpar.plan.search import candidates, estimates
from meshpar.plan.search import options as options_lib
from meshpar.run.metrics import read_jsonl
from meshpar.step import inputs, parts, throughput

NAME = "tests.test_outside_family:FAMILY"  # imported from the working directory, the repository root


@dataclasses.dataclass(frozen=True)
class RenamedConfig:
    name: str = NAME  # the family: this module's FAMILY
    depth: int = dataclasses.field(default=4, metadata={"min": 1})  # layers of the stack ("layers")
    width: int = dataclasses.field(default=32, metadata={"min": 1})  # "embed"
    heads: int = dataclasses.field(default=2, metadata={"min": 1})  # "heads"
    head_width: int = dataclasses.field(default=16, metadata={"min": 1})  # "kv"
    hidden: int = dataclasses.field(default=64, metadata={"min": 1})  # the MLP's, "d_ff"
    vocab: int = dataclasses.field(default=256, metadata={"min": 2})  # "vocab" (bytes)
    context: int = dataclasses.field(default=32, metadata={"min": 1})  # longest window (learned positions)
    precision: Literal["float32", "bfloat16"] = "float32"  # the dtype the layers compute in
    recompute: Literal["none", "full", "dots"] = "none"  # each layer's remat policy
    unroll: int = dataclasses.field(default=0, metadata={"min": 0})  # layers per scan iteration (0: by backend)


def to_decoder(cfg: RenamedConfig) -> decoder.DecoderConfig:
    """The model is meshpar's decoder (its layer stack runs as a pipeline), under other names."""
    return decoder.DecoderConfig(
        d_model=cfg.width, n_heads=cfg.heads, d_head=cfg.head_width, d_ff=cfg.hidden, n_layers=cfg.depth,
        vocab_size=cfg.vocab, max_length=cfg.context, mlp="gelu", positions="learned", norm_eps=1e-6,
        tie_embeddings="none", compute_dtype=cfg.precision, remat=cfg.recompute, scan_unroll=cfg.unroll,
    )  # fmt: skip


def traits(cfg: RenamedConfig) -> Traits:
    return Traits(
        stack_layers=cfg.depth, width=cfg.width, compute_dtype=cfg.precision, remat=cfg.recompute,
        max_length=cfg.context, vocab_size=cfg.vocab, scan_layers=True, scan_unroll=cfg.unroll,
        keys={"stack_layers": "depth", "width": "width", "compute_dtype": "precision", "remat": "recompute",
              "max_length": "context", "vocab_size": "vocab", "scan_unroll": "unroll"},
    )  # fmt: skip


FAMILY = Family(config=RenamedConfig, **decoder_family.family_parts(to_decoder), traits=traits)

MODEL = {"name": NAME, "depth": 4, "width": 32, "heads": 2, "head_width": 16, "hidden": 64, "context": 32}
STAGED = {"mesh": "stage:2,data:4", "layout": "batch:data; layers:stage"}
FLAT = ["mesh=data:8", "layout=batch:data", "train.microbatches=1"]  # no stage axis (and 2 rows per device)
RAW = {
    **STAGED,
    "model": MODEL,
    "data": {"source": "text", "length": 32, "max_bytes": 100_000},
    "optimizer": {"name": "adamw", "learning_rate": 0.003},
    "train": {"steps": 3, "batch_size": 16, "microbatches": 4, "log_every": 1, "eval_every": 0, "progress": False},
}


def _cfg(*overrides, raw=RAW):
    return config_lib.from_dict(config_lib.apply_overrides(raw, list(overrides)))


def test_the_config_is_read_through_the_familys_traits():
    cfg = _cfg("model.precision=bfloat16")
    assert not hasattr(cfg.model, "n_layers") and not hasattr(cfg.model, "remat")  # nothing by the built-ins' names
    own = models.traits(cfg.model)
    assert own.stack_layers == FAMILY.num_layers(cfg.model) == 4
    assert (own.key("stack_layers"), own.key("remat")) == ("model.depth", "model.recompute")
    assert own.key("attention") == "model"  # a trait the family names no field for
    assert throughput.compute_dtype(cfg.model) == "bfloat16"
    assert memory.out_of_scope(cfg, "cpu").startswith("bfloat16 compute on XLA:CPU")
    changed = models.with_settings(cfg.model, remat="full", scan_unroll=1, dropout=0.5)  # no field for dropout
    assert (changed.recompute, changed.unroll) == ("full", 1) and models.with_settings(changed, dropout=0.5) is changed
    # the stage axis is the pipeline's: a schedule over the family's 4 layers
    sched = parts.abstract_step(cfg).plan.schedule
    assert (sched.axis, sched.stages, sched.microbatches) == ("stage", 2, 4)


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["model.depth=3"], "model.depth: 3 layers do not split evenly into 2 stages (mesh axis 'stage')"),
        (["data.length=64"], "data.length: 64 exceeds model.context 32"),
        ([*FLAT, "model.recompute=full", "offload.activations=dots"],
         "offload.activations: dots replaces model.recompute's policy, so model.recompute must be none (it is full)"),
        ([*FLAT, "offload.activations=dots", "model.unroll=4"],
         "offload.activations: dots needs a layer loop, but model.unroll 4 unrolls all 4 layers "
         "(use 0 or fewer than 4)"),
    ],
)  # fmt: skip
def test_config_errors_name_the_familys_own_keys(overrides, error, capsys, tmp_path):
    with pytest.raises(ConfigError) as e:
        _cfg(*overrides)
    assert str(e.value) == error
    path = tmp_path / "renamed.yaml"
    path.write_text(yaml.safe_dump(RAW))
    assert train.main(["--config", str(path), *overrides, f"workdir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err == f"config error: {error}\n"  # one line


def test_it_trains_pipelined_over_the_stage_axis(tmp_path):
    summary = train.run(_cfg(f"workdir={tmp_path}"))
    assert summary["mesh"] == "stage:2,data:4" and summary["mfu"] is not None  # the decoder's FLOPs
    losses = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and np.isfinite(losses).all() and losses[-1] < losses[0]


def _estimate(cfg, topo):
    """The search's analytic estimate of `cfg` on `topo`, planned as the search plans it."""
    step = parts.abstract_step(cfg)
    sizes = dict(step.mesh.shape)
    stage = "stage" in sizes
    option = options_lib.Option(tuple(sizes.items()), ("data",), False, False, None, stage)
    return estimates.estimate(step, option, memory.analytic(step), topo, options_lib.model_dims(cfg))


def test_the_planner_sees_the_stack_the_width_and_remat_by_the_familys_traits():
    cfg = _cfg()
    # the search: stage axes of 2 and 4 (they divide the family's 4 layers and the 8 devices), not 8
    assert {dict(o.mesh).get("stage", 1) for o in options_lib.enumerate_options(cfg, 8) if o.stage} == {2, 4}
    # the estimate: a pipeline hands [rows, length, width] between its stages; remat runs the
    # forward again, as much of it as the policy's backward recomputes (traced: under full all
    # but each layer's last matmul, whose output nothing in the backward reads, and the output layer)
    topo = topology.load("h100-sxm-8")
    base, again = _estimate(cfg, topo), _estimate(_cfg("model.recompute=full"), topo)
    assert base.pipeline_s > 0
    factor = trace.recompute(parts.abstract_step(_cfg("model.recompute=full"))).factor
    assert 1.1 < factor < 4 / 3 and again.compute_s == pytest.approx(factor * base.compute_s)
    # the pre-flight: a remat change in the family's own field, named by it
    flat = _cfg(*FLAT)
    step = parts.abstract_step(flat)
    tried = candidates.candidates(flat, step.mesh, step.plan.abstract.params, step.element_spec)
    remat = next(c for c in tried if c.changes == (("model.recompute", "full"),))
    assert remat.key == "model.recompute" and remat.cfg.model.recompute == "full"
    assert any(dict(c.changes).get("mesh", "").startswith("stage:") for c in tried)  # a stage split of its stack


def test_the_plan_command_plans_it_over_the_stage_axis(tmp_path):
    path, out = tmp_path / "renamed.yaml", tmp_path / "plan.json"
    path.write_text(yaml.safe_dump(RAW))
    assert plan_cli.main(["--config", str(path), "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["mesh"] == "stage:2,data:4" and plan["fits"] is True and plan["missing"] == []
    assert plan["analytic"]["categories"]["activations"] > 0


@pytest.mark.parametrize(
    "cfg",
    [transformer.TransformerConfig(), transformer.TransformerConfig(n_layers=6, remat="full", compute_dtype="bfloat16"),
     llama.LlamaConfig(), mlp.MLPConfig(), mlp.MLPConfig(remat="dots", num_classes=3)],
)  # fmt: skip
def test_the_builtin_families_traits_are_their_conventional_reading(cfg):
    """What every check and the planner read of a built-in config is what they read by the field
    names before families gave traits: nothing changes for them."""
    own = models.traits(cfg)
    assert own == models.conventional_traits(cfg)
    family = models.family(cfg.name)
    if own.stack_layers is not None:  # the stack is the layer loop
        assert own.stack_layers == family.num_layers(cfg) == cfg.n_layers


def test_the_vocabulary_check_names_the_familys_field():
    with pytest.raises(ConfigError, match=r"^model\.vocab: 200 but data\.tokenizer .* has 256 tokens$"):
        inputs.check_vocab(_cfg("model.vocab=200"))
    inputs.check_vocab(_cfg())  # 256: the byte tokenizer's
