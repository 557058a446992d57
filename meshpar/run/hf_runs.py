"""Conversions between a Hugging Face folder and a meshpar run (``python -m meshpar.convert``).

**from-hf** makes a run folder whose checkpoint is step 0 of the run a config describes: the
parameters read from the Hugging Face folder into that run's shardings, fresh optimizer state
and random key (:func:`meshpar.run.init_from.fresh_state`), the config's run record, input position
0 — saved by :class:`meshpar.checkpoints.checkpoint.Checkpointer` into ``<workdir>/checkpoints``. So
``python -m meshpar.train --config X workdir=W --resume`` continues from it (with the same
overrides: the record must match), and ``checkpoint.init_from: W`` starts other runs from its
weights. The tokenizer files and the original config come along (:mod:`meshpar.hf.files`).

**to-hf** reads a run's newest committed step (its parameters only, onto the host, checked
against the step's file manifest) and the model config from its run record, and writes a
Hugging Face folder (:mod:`meshpar.hf.export`): a Llama, or a Mixtral where the model has
experts (in every layer: ``moe_every`` 1).

Either way everything that can be checked is checked before a byte is written, and the target
folder appears only when complete.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from meshpar import models
from meshpar.checkpoints.checkpoint import Checkpointer, Codec
from meshpar.configuration.config import Config, ConfigError
from meshpar.configuration.errors import CheckpointError
from meshpar.configuration.schema import build
from meshpar.hf import export, files, names, writer
from meshpar.hf import load as hf_load
from meshpar.models import fp8
from meshpar.run import experiment, init_from
from meshpar.run import resume as resume_lib
from meshpar.step import parts


@dataclasses.dataclass
class FromHF:
    source: hf_load.Source
    report: hf_load.Report
    checkpoint: Path
    copied: list[str]
    mesh: str
    layout: str


def from_hf(cfg: Config, hf_dir: str | Path, workdir: str | Path) -> FromHF:
    hf_dir, workdir = Path(hf_dir), Path(workdir)
    if not init_from.is_hf_folder(hf_dir):
        raise CheckpointError(
            f"{hf_dir} is not a Hugging Face model folder (config.json with model.safetensors or its index)"
        )
    files.check_new(workdir, "workdir")
    # The run this checkpoint starts: its folder, checkpoints in <workdir>/checkpoints.
    checkpoint = dataclasses.replace(cfg.checkpoint, dir="", resume="never", overwrite=False)
    cfg = dataclasses.replace(cfg, workdir=str(workdir), checkpoint=checkpoint)
    source = hf_load.open(hf_dir, cfg.model)
    step, _, record = experiment.built(cfg, parts.make_mesh(cfg))
    with files.new_folder(workdir, "workdir") as tmp:
        params, report = source.load(step.plan.abstract.params, step.plan.shardings.params)
        state = init_from.fresh_state(params, step.plan, step.tx, cfg.train.seed)
        ckpt = Checkpointer(tmp / "checkpoints", every=0, keep=0, codec=Codec.of_plan(step.plan))
        try:
            ckpt.maybe_save(state, resume_lib.position(0), record, force=True)
        finally:
            ckpt.close()
        copied = files.copy_present(hf_dir, tmp, {**{n: n for n in files.TOKENIZER_FILES}, **files.KEPT})
    return FromHF(source, report, workdir / "checkpoints" / "0", copied, cfg.mesh_str, str(step.layout))


def model_config(run: init_from.SavedRun):
    """The model config a run was saved with (its run record's ``model.*`` values)."""
    values = run.record().get("config", {})
    raw = {k.removeprefix("model."): v for k, v in values.items() if k.startswith("model.")}
    name = raw.get("name")
    try:
        cls = models.config_class(name)
    except ConfigError as e:
        raise CheckpointError(f"{run.describe()} records no known model ({e})") from None
    try:
        return build(cls, raw, "model")
    except ConfigError as e:
        raise CheckpointError(f"{run.describe()} records a model this meshpar cannot build ({e})") from None


@dataclasses.dataclass
class ToHF:
    run: init_from.SavedRun
    written: list[str]
    tensors: int
    bytes: int
    dtype: str


def to_hf(run_dir: str | Path, out: str | Path, max_shard_bytes: int = writer.MAX_SHARD_BYTES) -> ToHF:
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} is not a folder (give a run's workdir or its checkpoint folder)")
    run = init_from.SavedRun.find(run_dir)
    if run is None:
        raise CheckpointError(
            f"{run_dir} holds no committed checkpoint (give a run's workdir or its checkpoint folder)"
        )
    model = model_config(run)
    if model.name != "llama":
        raise ConfigError(
            "model.name", f"{run.describe()} holds a {model.name} model; to-hf writes Llama (and Mixtral) models only"
        )
    if model.moe_experts and model.moe_every != 1:
        raise ConfigError(
            "model.moe_every",
            f"{run.describe()} has a mixture of experts every {model.moe_every} layers; a Mixtral has one in every layer (1)",
        )
    files.check_new(out, "output folder")
    run.verify_files()
    saved = run.param_metadata()
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])  # whole arrays in host memory
    arrays = run.restore_params(
        {n: jax.ShapeDtypeStruct(shape, dtype, sharding=host) for n, (shape, dtype) in saved.items()}
    )
    params = {n.removeprefix("params/").removesuffix("/value"): np.asarray(a) for n, a in arrays.items()}
    params = {n: a for n, a in params.items() if not fp8.is_history(n)}  # training state, not weights
    expected = {t.param for t in names.tensors(model)}
    missing, extra = sorted(expected - set(params)), sorted(set(params) - expected)
    if missing:
        raise CheckpointError(
            f"{run.describe()} has no parameter {missing[0]}, which a {names.kind(model)} of its config has"
        )
    if extra:
        raise CheckpointError(
            f"{run.describe()} holds parameter {extra[0]}, which a {names.kind(model)} of its config has not"
        )
    base, generation, tokenizer = export.find_origin(run_dir)
    written = export.write(out, model, params, base, generation, tokenizer, max_shard_bytes)
    return ToHF(run, written, len(names.tensors(model)), sum(a.nbytes for a in params.values()), model.param_dtype)
