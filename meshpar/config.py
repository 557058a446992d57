"""Experiment configs: YAML + ``section.key=value`` overrides → frozen dataclasses.

Every check that needs no device runs here, and every failure is a :class:`ConfigError`
whose text is ``<key>: <what is wrong>``. Unknown keys are errors: a typo never silently
falls back to a default.
"""

from __future__ import annotations

import dataclasses
import pathlib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml

from meshpar import layout as layout_lib
from meshpar import mesh as mesh_lib
from meshpar.models import MODELS


class ConfigError(ValueError):
    """A config mistake: ``key`` is the dotted key, the message says what is wrong."""

    def __init__(self, key: str, message: str):
        # A key taken from YAML may hold a newline (`"a\nb": 1`): shown as repr, the message
        # stays one line. `self.key` keeps the key itself.
        super().__init__(f"{key if key.isprintable() else repr(key)}: {message}")
        self.key = key


def _min(n: float) -> dict:
    return {"min": n}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # Where examples come from: synthetic (seeded teacher-network task), tfds (array_record on
    # disk), text (byte-level windows of a directory of .py files; default the Python standard
    # library), tfds_text (byte-level windows of a tfds Text feature).
    source: Literal["synthetic", "tfds", "text", "tfds_text"] = "synthetic"
    # synthetic: train / eval rows, input width ("pixels") and number of classes.
    num_examples: int = dataclasses.field(default=16384, metadata=_min(1))
    num_eval_examples: int = dataclasses.field(default=2048, metadata=_min(0))
    num_features: int = dataclasses.field(default=784, metadata=_min(1))
    num_classes: int = dataclasses.field(default=10, metadata=_min(2))
    # tfds: dataset name, offline data_dir (prepared as array_record), splits, and which
    # features become the fields `inputs` and `targets`.
    name: str = ""
    data_dir: str = ""
    split: str = "train"
    eval_split: str = ""
    fields: dict[str, str] = dataclasses.field(default_factory=lambda: {"inputs": "image", "targets": "label"})
    # text / tfds_text: tokens per example window ("length"), the corpus ("" = the Python
    # standard library's own sources), the share of files held out for eval (chosen by a hash
    # of each file's path, so a file is never in both), a cap on bytes read per split (0 = all),
    # and the tfds Text feature to read.
    length: int = dataclasses.field(default=128, metadata=_min(1))
    corpus_dir: str = ""
    eval_fraction: float = dataclasses.field(default=0.05, metadata=_min(0.0))
    max_bytes: int = dataclasses.field(default=0, metadata=_min(0))
    text_feature: str = "text"


@dataclasses.dataclass(frozen=True)
class FeedConfig:
    # direct: each device gets its own slice from the host; routed: the whole batch goes to
    # the mesh's first device, which then hands out slices (Mesh TensorFlow's GPU path).
    mode: Literal["direct", "routed"] = "direct"
    # Batches kept already placed on the devices ahead of the step (0 = place on demand).
    prefetch: int = dataclasses.field(default=2, metadata=_min(0))
    # Read host batches into a pool of reused aligned buffers (synthetic source only); a buffer
    # that a placed batch aliases (CPU zero-copy) is never reused.
    reuse_buffers: bool = False


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    # optax optimizer.
    name: Literal["adam", "adamw", "sgd", "lion"] = "adamw"
    learning_rate: float = dataclasses.field(default=1e-3, metadata=_min(0.0))
    # Learning-rate schedule: constant, or cosine decay to 0 over train.steps; both after warmup.
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = dataclasses.field(default=0, metadata=_min(0))
    b1: float = 0.9  # adam/adamw/lion first moment; sgd momentum (0 = plain SGD)
    b2: float = 0.999  # adam/adamw/lion second moment
    weight_decay: float = dataclasses.field(default=0.0, metadata=_min(0.0))
    # Clip the global gradient norm to this (0 = no clipping).
    grad_clip_norm: float = dataclasses.field(default=0.0, metadata=_min(0.0))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = dataclasses.field(default=100, metadata=_min(1))
    # Global batch size, summed over all devices and processes.
    batch_size: int = dataclasses.field(default=128, metadata=_min(1))
    # Seeds parameter init, dropout and data order.
    seed: int = 0
    # Write metrics.jsonl / TensorBoard every this many steps (the last step is always logged).
    log_every: int = dataclasses.field(default=10, metadata=_min(1))
    # Validation every this many steps (0 = never); on `eval_batches` batches of the eval split.
    eval_every: int = dataclasses.field(default=0, metadata=_min(0))
    eval_batches: int = dataclasses.field(default=4, metadata=_min(1))
    # Show the rich progress bar (off in tests and under CI logs).
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    # Save the train state and input position every this many steps, at the end, and on
    # SIGINT/SIGTERM (orbax, async). 0 = no checkpoints at all.
    every: int = dataclasses.field(default=0, metadata=_min(0))
    # Checkpoints kept, oldest deleted first (0 = all).
    keep: int = dataclasses.field(default=3, metadata=_min(0))
    # Folder ("" = <workdir>/checkpoints).
    dir: str = ""
    # never: start from scratch; auto: continue from the newest complete checkpoint, if any
    # (the CLI's --resume sets auto). The mesh and layout may differ from the saved run's.
    resume: Literal["never", "auto"] = "never"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    # Multi-process (multi-host) runs on jax.distributed: every process runs the same command
    # with its own process_id. num_processes 1 = a single process, nothing to join. An empty
    # coordinator ("host:port" of process 0) or process_id -1 lets jax.distributed detect them
    # from the cluster environment (SLURM, Open MPI, TPU pods, ...).
    num_processes: int = dataclasses.field(default=1, metadata=_min(1))
    process_id: int = dataclasses.field(default=-1, metadata=_min(-1))
    coordinator: str = ""


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
    # Peak TFLOP/s per device for MFU; 0 = built-in bf16 figure for H100/H200/A100, or on CPU
    # a matmul measured at start.
    peak_tflops: float = dataclasses.field(default=0.0, metadata=_min(0.0))


@dataclasses.dataclass(frozen=True)
class Config:
    # Device mesh: "data:4,model:2", or a mapping; one axis may be -1 (= the remaining devices).
    mesh: tuple[tuple[str, int], ...] = (("data", -1),)
    # Logical dim → mesh axis: "batch:data; hidden:model", or a mapping. Unnamed dims replicate.
    layout: tuple[tuple[str, str], ...] = (("batch", "data"),)
    model: Any = None  # one of the dataclasses in meshpar.models.MODELS, picked by model.name
    data: DataConfig = DataConfig()
    feed: FeedConfig = FeedConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()
    hardware: HardwareConfig = HardwareConfig()
    # Output folder: metrics.jsonl, summary.json, tb/.
    workdir: str = "runs/default"

    @property
    def mesh_str(self) -> str:
        return ",".join(f"{a}:{n}" for a, n in self.mesh)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(pathlib.Path(self.workdir) / "checkpoints")

    @property
    def layout_str(self) -> str:
        return "; ".join(f"{d}:{a}" for d, a in self.layout)


# --------------------------------------------------------------------------------------------
# Validation: a small type checker over dataclass annotations.


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {_describe(value)}")
        return value
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(str(c) for c in typing.get_args(tp))
            raise ConfigError(key, f"{value!r} is not one of: {choices}")
        return value
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        return _coerce(next(a for a in args if a is not type(None)), value, key)
    if origin is tuple:
        (item, _) = typing.get_args(tp)
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(key, f"expected a list, got {_describe(value)}")
        return tuple(_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        kt, vt = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping, got {_describe(value)}")
        return {_coerce(kt, k, key): _coerce(vt, v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    raise TypeError(f"unsupported config type {tp} at {key}")


def build(cls: type, raw: Any, key: str) -> Any:
    """Validate mapping `raw` into dataclass `cls`; `key` is the dotted prefix for errors."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(key, f"expected a mapping, got {_describe(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in raw:
        if name not in fields:
            known = ", ".join(fields)
            raise ConfigError(f"{key}.{name}" if key else str(name), f"unknown key (known: {known})")
    kwargs = {}
    for name, value in raw.items():
        sub = f"{key}.{name}" if key else name
        kwargs[name] = _coerce(hints[name], value, sub)
        lo = fields[name].metadata.get("min")
        values = kwargs[name] if isinstance(kwargs[name], tuple) else (kwargs[name],)  # a bound applies per item
        for i, v in enumerate(values):
            # `not >=` rather than `<`: a NaN (YAML .nan) compares false both ways and must not pass.
            if lo is not None and not v >= lo:
                where = f"{sub}[{i}]" if isinstance(kwargs[name], tuple) else sub
                raise ConfigError(where, f"must be >= {lo}, got {v}")
    return cls(**kwargs)


def _model(raw: Any) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError("model", f"expected a mapping with a 'name', got {_describe(raw)}")
    name = raw.get("name")
    # isinstance first: an unhashable name (a list, a mapping) would raise TypeError in `in`.
    if not isinstance(name, str) or name not in MODELS:
        raise ConfigError("model.name", f"{name!r} is not a model (known: {', '.join(MODELS)})")
    return build(MODELS[name].config, raw, "model")


def from_dict(raw: Any) -> Config:
    """Validate a parsed YAML document into a :class:`Config`."""
    if not isinstance(raw, Mapping):
        raise ConfigError("config", f"expected a mapping at the top level, got {_describe(raw)}")
    raw = dict(raw)
    if "model" not in raw:
        raise ConfigError("model", "missing (set model.name)")
    special = {"mesh": raw.pop("mesh", None), "layout": raw.pop("layout", None), "model": raw.pop("model")}
    cfg = build(Config, raw, "")
    try:
        mesh = mesh_lib.parse_mesh(special["mesh"]) if special["mesh"] is not None else cfg.mesh
    except mesh_lib.MeshError as e:
        raise ConfigError("mesh", str(e)) from None
    try:
        layout = layout_lib.parse_rules(special["layout"]) if special["layout"] is not None else cfg.layout
        layout_lib.Layout.create(layout, {a: max(n, 1) for a, n in mesh})
    except layout_lib.LayoutError as e:
        raise ConfigError("layout", str(e)) from None
    cfg = dataclasses.replace(cfg, mesh=mesh, layout=layout, model=_model(special["model"]))
    check(cfg)
    return cfg


def check(cfg: Config) -> None:
    """Cross-section checks that need no device."""
    t = cfg.train
    data_axis = dict(cfg.layout).get("batch")
    if data_axis is not None:
        n = dict(cfg.mesh)[data_axis]
        if n > 0 and t.batch_size % n:
            raise ConfigError(
                "train.batch_size", f"{t.batch_size} is not divisible by mesh axis '{data_axis}' of size {n} (layout batch:{data_axis})"
            )
    if cfg.data.source in ("tfds", "tfds_text") and not cfg.data.name:
        raise ConfigError("data.name", f"required when data.source is {cfg.data.source}")
    if cfg.data.source in ("tfds", "tfds_text") and not cfg.data.data_dir:
        raise ConfigError("data.data_dir", f"required when data.source is {cfg.data.source} (data is read offline)")
    max_length = getattr(cfg.model, "max_length", None)
    if cfg.data.source in ("text", "tfds_text") and max_length is not None and cfg.data.length > max_length:
        raise ConfigError("data.length", f"{cfg.data.length} exceeds model.max_length {max_length}")


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Apply ``section.key=value`` strings; values are parsed as YAML (``[512,256]``, ``true``)."""
    raw = dict(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(item, "override is not 'section.key=value'")
        # ValueError too: PyYAML's constructors let it through for `2001-13-45`, `!!int x`, or an
        # integer over Python's 4300-digit limit.
        try:
            value = yaml.safe_load(text)
        except (yaml.YAMLError, ValueError) as e:
            raise ConfigError(key, f"value {text!r} is not valid YAML ({str(e).splitlines()[0]})") from None
        node = raw
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None or not isinstance(child, Mapping):
                if child is not None and i == 0 and part in ("mesh", "layout"):
                    raise ConfigError(key, f"'{part}' is a single value; override it as {part}=...")
                child = {}
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = value
    return raw


def load(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> Config:
    """Read YAML at `path` (safe loader: no Python objects), apply overrides, validate."""
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("config", f"file not found: {path}") from None
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:  # a ValueError, not an OSError: e.g. a binary file
        raise ConfigError("config", f"cannot read {path}: not {e.encoding} text ({e.reason} at byte {e.start})") from None
    try:
        raw = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as e:  # ValueError: see apply_overrides
        raise ConfigError("config", f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    # Only an empty file means {}: a top-level list or scalar must not reach apply_overrides'
    # dict(), which raises TypeError/ValueError for it (or turns a list of pairs into a mapping).
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError("config", f"expected a mapping at the top level of {path}, got {_describe(raw)}")
    return from_dict(apply_overrides(raw, overrides))


def to_dict(cfg: Config) -> dict:
    """Plain dict for summary.json (mesh and layout as their strings)."""
    out = dataclasses.asdict(cfg)
    out["mesh"], out["layout"] = cfg.mesh_str, cfg.layout_str
    return out
