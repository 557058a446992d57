"""The checks across a config's sections that need no device: paths, the coordinator's
address, batch and microbatches against the mesh, the pipeline, a length split, offload and experts against the
model's traits, and each data source's own check. Every failure is a :class:`ConfigError` whose
text is ``<key>: <what is wrong>``.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Mapping
from typing import Any

# mesh before anything that imports jax: it keeps a bad JAX_NUM_CPU_DEVICES from breaking
# `import jax` (see meshpar.sharding.mesh), so the value is reported here in one line.
from meshpar.sharding import mesh as mesh_lib  # isort: skip
from meshpar import models as models_lib
from meshpar import sources
from meshpar.configuration.schema import ConfigError, short
from meshpar.configuration.sections import Config, OffloadConfig
from meshpar.models import context_parallel as context_parallel_lib
from meshpar.models import fp8 as fp8_lib
from meshpar.models import remat as remat_lib
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import stages as pipeline_lib

# Folder and file settings: each becomes a path the run creates or reads ("byte", data.tokenizer's
# other value, passes as a name).
PATHS = (
    "workdir",
    "checkpoint.dir",
    "data.data_dir",
    "data.corpus_dir",
    "data.tokenizer",
    "data.path",
    "compile_cache.dir",
)
# The longest file name (one path component, in bytes) and path that Linux and macOS file systems
# take; a longer one fails deep inside a library (orbax, tfds) instead of here.
NAME_MAX, PATH_MAX = 255, 4095


def _check_path(key: str, path: str) -> None:
    if "\0" in path:
        raise ConfigError(key, f"{short(path)} holds a NUL character, which no path can")
    if len(path.encode("utf-8", "surrogatepass")) > PATH_MAX:
        raise ConfigError(key, f"{short(path)} is longer than {PATH_MAX} bytes")
    for part in pathlib.PurePath(path).parts:
        if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX:
            raise ConfigError(key, f"{short(part)} is longer than {NAME_MAX} bytes, too long for a file or folder name")


def _check_coordinator(address: str) -> None:
    """``host:port`` (``[v6 address]:port``), port 1..65535: what jax.distributed can listen on
    or connect to. Anything else failed with a traceback or a C++ message much later."""
    host, sep, port = address.rpartition(":")
    bad = None
    if not sep or not host.strip("[]"):
        bad = "is not 'host:port'"
    elif not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        bad = f"has port {short(port)}, not a number from 1 to 65535"
    elif not (host.isascii() and host.isprintable()) or " " in host:
        bad = "has a host name that is not printable ASCII without spaces"
    if bad:
        raise ConfigError("distributed.coordinator", f"{short(address)} {bad} (e.g. 10.0.0.1:1234)")


def check(cfg: Config) -> None:
    """Cross-section checks that need no device."""
    try:
        mesh_lib.cpu_devices_from_env()  # jax reads it too, when its CPU client starts
    except mesh_lib.MeshError as e:
        raise ConfigError("mesh", str(e)) from None
    if not cfg.workdir:
        raise ConfigError("workdir", "must not be empty (use '.' for the current folder)")
    for key in PATHS:
        section, _, name = key.rpartition(".")
        _check_path(key, getattr(getattr(cfg, section) if section else cfg, name))
    profile = cfg.train.profile
    if profile.steps and profile.start > cfg.train.steps:
        raise ConfigError(
            "train.profile.start",
            f"step {profile.start} is past train.steps {cfg.train.steps}: nothing would be traced",
        )
    d = cfg.distributed
    if d.process_id >= d.num_processes:
        raise ConfigError(
            "distributed.process_id", f"{d.process_id} is not below distributed.num_processes {d.num_processes}"
        )
    if d.coordinator:
        _check_coordinator(d.coordinator)
    for name in ("b1", "b2"):
        b = getattr(cfg.optimizer, name)
        if not 0 <= b < 1:
            raise ConfigError(f"optimizer.{name}", f"must be in [0, 1), got {b}")
    for against_mesh in (check_batch_size, check_pipeline, check_context_parallel):
        against_mesh(cfg, dict(cfg.mesh))
    source = sources.of(cfg.data)
    source.check(cfg.data)
    if cfg.feed.reuse_buffers and cfg.data.workers:
        raise ConfigError(
            "feed.reuse_buffers",
            f"needs data.workers: 0 (with {cfg.data.workers} workers, batches arrive in shared memory)",
        )
    if cfg.checkpoint.overwrite and cfg.checkpoint.resume == "auto":
        raise ConfigError("checkpoint.overwrite", "replaces the earlier run, so it cannot be combined with --resume")
    for i, key in enumerate(cfg.checkpoint.allow_changes):
        if not _is_key(cfg, key):
            raise ConfigError(f"checkpoint.allow_changes[{i}]", f"{short(key)} is not a config key or section")
    model = models_lib.traits(cfg.model)  # the family's reading of its config, not its fields by name
    if source.token_windows and model.max_length is not None and cfg.data.length > model.max_length:
        raise ConfigError("data.length", f"{cfg.data.length} exceeds {model.key('max_length')} {model.max_length}")
    _check_offload(cfg)
    _check_model_settings(cfg)
    _check_experts(cfg, dict(cfg.mesh))
    block, attention = model.attention_block, model.attention
    if (
        source.token_windows
        and attention in ("blockwise", "cudnn")
        and block < cfg.data.length
        and cfg.data.length % block
    ):
        raise ConfigError(
            model.key("attention_block"),
            f"{block} does not divide data.length {cfg.data.length} ({model.key('attention')}: {attention} splits "
            "it into blocks)",
        )


def _check_offload(cfg: Config) -> None:
    """Activation offload is a remat policy applied inside the layer loop: it needs that loop and
    takes model.remat's place. Oversubscription is unified memory's."""
    off = cfg.offload
    default = OffloadConfig.oversubscription
    if not off.unified_memory and off.oversubscription != default:
        raise ConfigError(
            "offload.oversubscription",
            f"{off.oversubscription:g} applies with offload.unified_memory: true (it is false)",
        )
    setting = cfg.offload.activations
    if setting == "none":
        return
    key, name, model = "offload.activations", cfg.model.name, models_lib.traits(cfg.model)
    if models_lib.family(name).activation_names is None:
        raise ConfigError(
            key, f"{setting} keeps the values a model family names, and family {name} names no activations "
            "(activation_names not given; use none)",
        )  # fmt: skip
    if model.scan_layers is None:
        raise ConfigError(key, f"{setting} needs a layer loop, and model {name} has none (use none)")
    if model.remat_on:
        remat = model.key("remat")
        raise ConfigError(key, f"{setting} replaces {remat}'s policy, so {remat} must be none (it is {model.remat})")
    if not model.scan_layers:
        raise ConfigError(key, f"{setting} needs the layer loop: set {model.key('scan_layers')} true")
    layers = model.stack_layers or 1
    if layers > 1 and model.scan_unroll >= layers:
        raise ConfigError(
            key,
            f"{setting} needs a layer loop, but {model.key('scan_unroll')} {model.scan_unroll} unrolls all "
            f"{layers} layers (use 0 or fewer than {layers})",
        )


def _check_model_settings(cfg: Config) -> None:
    """The model's run settings that name things: its remat policy's save list and its FP8 dots."""
    _check_remat_save(cfg)
    _check_fp8(cfg)


def _check_remat_save(cfg: Config) -> None:
    """``model.remat_save`` goes with ``model.remat: custom`` (which needs it), and lists only tags
    the family's layers put on their values (:attr:`meshpar.models.Family.checkpoint_names`)."""
    model = models_lib.traits(cfg.model)
    if "remat_save" not in model.keys:
        return
    family = models_lib.family(cfg.model.name)
    tagged = family.checkpoint_names(cfg.model) if family.checkpoint_names is not None else ()
    problem = remat_lib.check_save(model.remat or "none", model.remat_save, tagged, cfg.model.name)
    if problem:
        raise ConfigError(model.key("remat_save"), problem)


def _check_fp8(cfg: Config) -> None:
    """``model.fp8`` lists only kinds of dot that run in FP8 (:data:`meshpar.models.fp8.KINDS`)."""
    model = models_lib.traits(cfg.model)
    problem = fp8_lib.check(model.fp8)
    if problem:
        raise ConfigError(model.key("fp8"), problem)
    if "experts" in model.fp8 and not model.experts:
        raise ConfigError(
            model.key("fp8"), f"lists experts, and model {cfg.model.name} has none ({model.key('experts')} 0)"
        )
    if "experts" in model.fp8 and model.expert_dispatch == "dropless":
        raise ConfigError(
            model.key("fp8"),
            f"FP8 experts need {model.key('expert_dispatch')} capacity: dropless dispatch's ragged dots have no FP8 GEMM",
        )


def _check_experts(cfg: Config, mesh_shape: Mapping[str, int]) -> None:
    """A mixture-of-experts model's experts divide by the mesh axes a rule (``layout`` or
    ``param_layout``) splits ``experts`` over. A -1 axis is skipped as in :func:`check_batch_size`.

    A stage axis runs MoE layers: the pipeline hands each layer's statistics back beside the
    activations (:func:`meshpar.sharding.stages.run`). The experts cannot be split over the
    stage axis itself (:func:`check_pipeline` keeps that axis for ``layers``); what the model's
    routing asks of the pipeline (whole MoE groups per stage, routing groups within a sequence)
    reads settings the model's :class:`meshpar.models.Traits` do not carry, so the model checks
    it when first traced (:func:`meshpar.models.moe_stats.check`), before anything runs."""
    model = models_lib.traits(cfg.model)
    if not model.experts:
        return
    for key, rules in (("layout", cfg.layout), ("param_layout", cfg.param_layout)):
        named = dict(layout_lib.on_mesh(rules, mesh_shape))
        axes = layout_lib.mesh_axes(named.get("experts"))
        ways = math.prod(mesh_shape[a] for a in axes)
        if axes and ways > 0 and model.experts % ways:
            raise ConfigError(
                model.key("experts"),
                f"{model.experts} experts do not divide by the {ways} ways {key} "
                f"experts:{layout_lib.format_axes(named['experts'])} splits them",
            )


def check_batch_size(cfg: Config, mesh_shape: Mapping[str, int]) -> None:
    """train.batch_size splits evenly over the mesh axes the layout puts `batch` on, and each
    of those shards into train.microbatches.

    With the config's own mesh a -1 axis is not known yet and is skipped: call this again with
    the built mesh's shape (``dict(mesh.shape)``), where a -1 axis has its size.
    """
    axes = dict(layout_lib.on_mesh(cfg.layout, mesh_shape)).get("batch")  # an absent axis splits nothing
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    sizes = [mesh_shape[a] for a in names]
    if any(n <= 0 for n in sizes):
        return
    n, batch, k = math.prod(sizes), cfg.train.batch_size, cfg.train.microbatches
    split = " × ".join(f"mesh axis '{a}' of size {m}" for a, m in zip(names, sizes))
    rule = f"layout batch:{layout_lib.format_axes(axes)}" if names else ""
    if batch % n:
        raise ConfigError("train.batch_size", f"{batch} is not divisible by {split} ({rule})")
    if (batch // n) % k:
        shards = f"the {batch // n} rows of each of the {n} batch shards ({rule})" if names else f"the batch of {batch}"
        raise ConfigError("train.microbatches", f"{k} does not divide {shards}")


def check_pipeline(cfg: Config, mesh_shape: Mapping[str, int]) -> None:
    """A stage axis (``layers:<axis>``) the model, the microbatches and the schedule allow; the
    pipeline's settings only with one. A -1 axis is skipped as in :func:`check_batch_size`."""
    p = cfg.pipeline
    if p.repeats > 1 and p.schedule != "circular":
        raise ConfigError(
            "pipeline.repeats", f"{p.repeats} groups of layers per stage need pipeline.schedule: circular"
        )
    axes = dict(layout_lib.on_mesh(cfg.layout, mesh_shape)).get("layers")
    if axes is None:
        if p.schedule != "gpipe" or p.repeats > 1:
            raise ConfigError("pipeline.schedule", f"{p.schedule} needs a stage axis: a layout rule layers:<mesh axis>")
        return
    if isinstance(axes, tuple):
        raise ConfigError(
            "layout", f"layers:{layout_lib.format_axes(axes)}: the layers split over one mesh axis, the stage axis"
        )
    for key, rules in (("layout", cfg.layout), ("param_layout", cfg.param_layout)):
        for dim, on in layout_lib.on_mesh(rules, mesh_shape):
            if dim != "layers" and axes in ((on,) if isinstance(on, str) else on):
                raise ConfigError(
                    key, f"{dim}:{layout_lib.format_axes(on)} uses the stage axis '{axes}' (layers:{axes}); a stage axis "
                    "carries only layers",
                )  # fmt: skip
    if mesh_shape[axes] <= 0:
        return
    if cfg.offload.params or cfg.offload.activations != "none":
        key = "offload.params" if cfg.offload.params else "offload.activations"
        raise ConfigError(
            key, f"host offload inside a pipeline's stages is not supported (layers:{axes}); offload.optimizer is"
        )
    sched = pipeline_lib.Schedule(axes, mesh_shape[axes], cfg.train.microbatches, p.schedule, p.repeats)
    model = models_lib.traits(cfg.model)
    problem = pipeline_lib.problem(sched, model.stack_layers, model.key("stack_layers"))
    if problem:
        raise ConfigError(*problem)


def check_context_parallel(cfg: Config, mesh_shape: Mapping[str, int]) -> None:
    """A length split (``length:<axis>``) divides ``data.length``, and the strategy that runs it
    (``model.context_parallel``) the model's heads (:func:`meshpar.models.context_parallel.problem`).
    A stage axis over the same mesh axis is :func:`check_pipeline`'s refusal. A -1 axis is
    skipped as in :func:`check_batch_size`."""
    named = dict(layout_lib.on_mesh(cfg.layout, mesh_shape))
    axes = named.get("length")
    sizes = [mesh_shape[a] for a in layout_lib.mesh_axes(axes)]
    if not sizes or any(n <= 0 for n in sizes) or math.prod(sizes) == 1:
        return
    ways, rule = math.prod(sizes), f"layout length:{layout_lib.format_axes(axes)}"
    if sources.of(cfg.data).token_windows and cfg.data.length % ways:
        raise ConfigError("data.length", f"{cfg.data.length} is not divisible by the {ways} ways {rule} splits it")
    model = models_lib.traits(cfg.model)
    if model.context_parallel is None or model.heads is None or len(sizes) > 1:
        return  # a split over several mesh axes is left to XLA's partitioner
    heads = [mesh_shape[a] for a in layout_lib.mesh_axes(named.get("heads"))]
    if any(n <= 0 for n in heads):
        return
    heads_rule = f"heads:{layout_lib.format_axes(named['heads'])}" if heads else "heads"
    problem = context_parallel_lib.problem(
        model.context_parallel, model.heads, ways, math.prod(heads), rule, heads_rule
    )
    if problem:
        raise ConfigError(model.key("context_parallel"), f"{problem} ({model.key('heads')})")


def _is_key(cfg: Config, key: str) -> bool:
    """Whether dotted `key` names a section or a field of `cfg` (``optimizer``, ``model.hidden``)."""
    node: Any = cfg
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True
