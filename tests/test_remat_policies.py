"""Remat policies by name (meshpar.models.remat): MaxText's and Paxml's names and custom each
train the same model as remat none, each keeps the residuals its definition names (read from
jax's own list of saved residuals), the memory plan and XLA's compiled step follow them, and a
bad name or remat_save is one config error line."""

from __future__ import annotations

import contextlib
import functools
import io
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from meshpar import train
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError
from meshpar.models import MODELS, decoder, llama, remat, transformer
from meshpar.plan.memory import analytic as memory
from meshpar.plan.memory import trace
from meshpar.step import aot, parts

V, LENGTH = 64, 16
SPEC = {"tokens": ((LENGTH + 1,), np.int32)}
TINY = {
    "llama": llama.LlamaConfig(d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=48, n_layers=2, vocab_size=V,
                               max_length=LENGTH),
    "transformer": transformer.TransformerConfig(d_model=32, n_heads=4, d_head=8, d_ff=64, n_layers=2, vocab_size=V,
                                                 max_length=LENGTH),
}  # fmt: skip
SAVED = ("query_proj", "out_proj")  # custom's names in these tests
LLAMA = "experiments/llama_tiny.yaml"
SMALL = ["data.max_bytes=200000", "train.progress=false"]


def _cfg(family: str, policy: str):
    save = SAVED if policy == "custom" else ()
    return TINY[family].__class__(**{**TINY[family].__dict__, "remat": policy, "remat_save": save})


@functools.cache
def _losses(family: str, policy: str, steps: int = 3) -> np.ndarray:
    """The loss of each of `steps` plain SGD steps of the tiny model of `family` under `policy`."""
    graphdef, params = nnx.split(MODELS[family].build(_cfg(family, policy), SPEC, nnx.Rngs(0)))
    tokens = np.random.default_rng(0).integers(0, V, (4, LENGTH + 1)).astype(np.int32)

    def step(params, _):
        loss, grads = jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss({"tokens": tokens})[0])(params)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

    return np.asarray(jax.jit(lambda p: jax.lax.scan(step, p, None, length=steps)[1])(params))  # one step compiled


@pytest.mark.parametrize("policy", [n for n in remat.NAMES if n != "none"])
def test_every_policy_trains_the_same_model(policy):
    for family in TINY:
        ref, got = _losses(family, "none"), _losses(family, policy)
        assert ref[-1] < ref[0]  # it trains
        np.testing.assert_allclose(got, ref, rtol=1e-6, err_msg=f"{family} under {policy}")


def _kept(family: str, policy: str) -> list[str]:
    """What one layer keeps beside its arguments under `policy`, from jax's own list: a tag's
    name, ``dot`` (an unnamed matmul output ``[rows, out]``, ``dot[b]`` one with batch dims) or
    ``host`` (a value kept in host memory)."""
    cfg = (llama if family == "llama" else transformer).switches(_cfg(family, policy))
    sizes = {"embed": 32, "heads": 4, "kv_heads": cfg.kv_heads, "kv": 8, "d_ff": cfg.d_ff}
    p = {n: np.ones([sizes[d] for d in dims], np.float32) for n, dims in decoder.block_dims(cfg).items()}
    fn = remat.checkpointed(lambda p, x: decoder.block(cfg, p, x, None).sum(), policy, in_scan=True,
                            save=cfg.remat_save)  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, p, np.ones((2, LENGTH, 32), np.float32))
    kept = []
    for line in out.getvalue().splitlines():
        if "from the argument" in line or "from a constant" in line:
            continue
        named, shape = re.search(r"named '(\w+)'", line), line.split()[0]
        if "<host>" in shape:
            kept.append("host")
        elif named:
            kept.append(named[1])
        elif "dot_general" in line:
            kept.append("dot" if shape.count(",") == 1 else "dot[b]")
        else:
            kept.append("other")
    return sorted(kept)


QKV = ["key_proj", "query_proj", "value_proj"]  # a layer's projections (before rotary)
MLPWI = {"llama": ["mlpwi_0", "mlpwi_1"], "transformer": ["mlpwi"]}  # the MLP's input projections
# What each policy keeps of one layer, beside the layer's input: its definition's names that the
# layer tags and the backward reads (the MLP's output, mlpwo, it never reads: saved, it is unused).
EXPECTED = {
    "full": lambda f: [], "SAVE_NOTHING": lambda f: [], "SAVE_ITERATION_INPUT": lambda f: [],
    # the projections' and the MLP's input projections' outputs (not the MLP's output: unread)
    "dots": lambda f: ["dot"] * (4 + len(MLPWI[f])),
    "SAVE_DOT_WITH_NO_BATCH_DIM": lambda f: ["dot"] * (4 + len(MLPWI[f])),
    "SAVE_DOT_ONLY": lambda f: ["dot"] * (4 + len(MLPWI[f])) + ["dot[b]"] * 2,  # attention's two contractions too
    "minimal": lambda f: sorted([*QKV, "out_proj", *MLPWI[f]]),
    "minimal_with_context": lambda f: sorted([*QKV, "context", "out_proj", *MLPWI[f]]),
    "minimal_flash": lambda f: sorted([*QKV, "context", "out_proj", *MLPWI[f]]),
    "save_dot_with_context_except_mlp": lambda f: sorted([*QKV, "context", "out_proj"]),
    "save_dot_except_mlpwi": lambda f: sorted([*QKV, "out_proj"]),
    "save_dot_except_mlp": lambda f: sorted([*QKV, "out_proj"]),
    "save_qkv_proj": lambda f: QKV,
    "save_out_proj": lambda f: ["out_proj"],
    "qkv_proj_offloaded": lambda f: ["host"] * 3,
    "minimal_offloaded": lambda f: ["host"] * (4 + len(MLPWI[f])),
    "custom": lambda f: sorted(SAVED),
    "SAVE_QKV_OUT_PROJ": lambda f: ["combined_qkv_proj"] * 3 + ["out_proj"],
    "SAVE_QKV_OUT_PROJ_SEPARATE": lambda f: sorted([*QKV, "out_proj"]),
    "SAVE_OUT_PROJ": lambda f: ["out_proj"],
    "SAVE_CONTEXT": lambda f: ["context"],
    "SAVE_CONTEXT_AND_OUT_PROJ": lambda f: ["context", "out_proj"],
    "SAVE_DOT_FOR_MLPERF_200B": lambda f: sorted([*QKV, "context", "out_proj"]),
}  # fmt: skip


@pytest.mark.parametrize("family", list(TINY))
def test_each_policy_keeps_what_its_definition_names(family):
    assert set(EXPECTED) | {"none", "SAVE_EVERYTHING"} == set(remat.NAMES)
    for policy, expected in EXPECTED.items():
        assert _kept(family, policy) == expected(family), policy
    # everything: more than any policy that picks, the layer's input by its name among it
    everything = _kept(family, "SAVE_EVERYTHING")
    assert len(everything) > len(_kept(family, "SAVE_DOT_ONLY")) and "layer_in" in everything


def test_every_definition_cites_its_source_and_the_families_tag_its_names():
    for name, policy in remat.POLICIES.items():
        assert (policy.source == "meshpar") == (name in ("none", "full", "dots")), name
        assert policy.source.startswith(("AI-Hypercomputer/maxtext, ", "google/praxis, ")) or policy.source == "meshpar"
    tags = {f: MODELS[f].checkpoint_names(TINY[f]) for f in TINY}
    assert {"mlpwi_0", "mlpwi_1"} <= set(tags["llama"]) and "mlpwi" not in tags["llama"]
    assert "mlpwi" in tags["transformer"] and "mlpwi_0" not in tags["transformer"]
    # every name a policy lists is tagged by the decoder, but MaxText's multi-head latent attention's
    # kv_proj (no such attention here) and the MLP input projections of the other MLP
    listed = {n for p in remat.POLICIES.values() for n in (*p.saves, *p.offloads)}
    assert listed - set(tags["llama"]) - set(tags["transformer"]) == {"kv_proj"}
    # the offload reference names are tags too, unchanged
    assert set(MODELS["llama"].kept_activations("dots")) <= set(tags["llama"])


def test_the_recomputed_work_follows_the_policy():
    # the sums a model-axis split adds: a policy that recomputes attention's output repeats its sum
    spec, dims = {"tokens": ((129,), "uint8")}, ("heads", "d_ff")
    count = {p: MODELS["llama"].activation_all_reduces(_cfg("llama", p), spec, 8, dims)[0] for p in remat.NAMES}
    assert count["none"] == count["dots"] == count["minimal"] == count["save_out_proj"] == 4 * 2
    assert count["full"] == count["save_qkv_proj"] == count["SAVE_CONTEXT"] == 5 * 2
    # the step's matmul work, traced: more recomputed, more work
    factor = {p: trace.recompute(parts.abstract_step(config_lib.load(LLAMA, [*SMALL, f"model.remat={p}"]))).factor
              for p in ("none", "SAVE_EVERYTHING", "minimal", "save_dot_except_mlp", "save_qkv_proj", "full")}  # fmt: skip
    assert factor["none"] == factor["SAVE_EVERYTHING"] == 1.0
    assert 1.0 < factor["minimal"] < factor["save_dot_except_mlp"] < factor["save_qkv_proj"] < factor["full"] < 4 / 3


@functools.cache
def _plan(policy: str) -> tuple[int, int, int]:
    """(analytic activations, analytic step total, XLA's compiled step total) of llama_tiny under `policy`."""
    extra = ["model.remat_save=[query_proj,key_proj,value_proj,out_proj]"] if policy == "custom" else []
    step = parts.abstract_step(config_lib.load(LLAMA, [*SMALL, f"model.remat={policy}", *extra]))
    plan = memory.analytic(step)
    total = plan.total - plan.categories["queued_inputs"]
    return plan.categories["activations"], total, aot.memory(step.lower().compile())["total_bytes"]


@pytest.mark.parametrize("policy", ["minimal_flash", "save_qkv_proj", "save_dot_except_mlp", "SAVE_DOT_ONLY", "custom"])
def test_the_memory_plan_is_within_ten_percent_of_xla(policy):
    _, analytic, xla = _plan(policy)
    assert abs(analytic / xla - 1) < 0.10


def test_the_memory_plan_and_the_compiled_step_order_the_policies():
    order = ("full", "save_qkv_proj", "save_dot_except_mlp", "minimal", "minimal_flash", "none")
    plans = {p: _plan(p) for p in order}
    acts = [plans[p][0] for p in order]
    assert acts == sorted(acts) and len(set(acts)) == len(acts), acts  # strictly more kept, in this order
    xla = [plans[p][2] for p in order]
    # XLA's totals: full least, none most, minimal_flash above minimal above the attention-only ones
    # (save_qkv_proj and save_dot_except_mlp come within 0.1% of each other on this config, XLA:CPU)
    assert xla[0] < min(xla[1:]) and xla[-1] > max(xla[:-1]) and xla[4] > xla[3] > max(xla[1], xla[2])
    assert xla[1] <= xla[2] * 1.001


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        config_lib.load(LLAMA, [*SMALL, *overrides])
    return str(e.value)


def test_bad_names_are_one_line_config_errors(capsys, tmp_path):
    known = ", ".join(MODELS["llama"].checkpoint_names(config_lib.load(LLAMA, SMALL).model))
    assert _error("model.remat=custom", "model.remat_save=[query_proj,mlpwx]") == (
        f"model.remat_save: 'mlpwx' is not a name the llama layers tag (known: {known})"
    )
    assert _error("model.remat=save_qkv_proj", "model.remat_save=[query_proj]").startswith(
        "model.remat_save: lists the names remat custom keeps, and remat is save_qkv_proj"
    )
    assert _error("model.remat=custom").startswith("model.remat_save: remat custom keeps the names listed here")
    assert _error("model.remat=minimal_flashy").startswith("model.remat: 'minimal_flashy' is not one of: none, full")
    # the MLP family keeps its three
    with pytest.raises(ConfigError, match="^model.remat: 'minimal' is not one of: none, full, dots$"):
        config_lib.load("experiments/mlp_data_parallel.yaml", ["model.remat=minimal"])
    # through the command: exit 2, one line
    argv = ["--config", LLAMA, *SMALL, f"workdir={tmp_path}", "model.remat=custom", "model.remat_save=[mlpwx]"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: model.remat_save: 'mlpwx' is not a name the llama layers tag (known: ")
    assert "\n" not in err


def test_a_named_policy_trains_through_the_command_as_none_does(tmp_path):
    def losses(*overrides: str) -> list[float]:
        out = tmp_path / "-".join(o.split("=")[1] for o in overrides)
        summary = train.run(config_lib.load(LLAMA, [*SMALL, "train.steps=2", "train.eval_every=0", f"workdir={out}",
                                                    *overrides]))  # fmt: skip
        return [summary["first_loss"], summary["final_loss"]]

    ref = losses("model.remat=none")
    for policy in ("save_dot_except_mlp", "SAVE_CONTEXT"):
        np.testing.assert_allclose(losses(f"model.remat={policy}"), ref, rtol=1e-5)
