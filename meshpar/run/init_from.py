"""``checkpoint.init_from``: a fresh run's parameters from a Hugging Face folder or a meshpar run.

A run that starts fresh (not resumed from its own checkpoint) with ``checkpoint.init_from``
set takes its parameters from there instead of random initialisation; everything else is new:
its own record, step 0, optimizer state initialised for these parameters (the optimizer may
differ from the one that trained them), and the random key a fresh run of its seed has.
The parameters are read straight into the run's shardings (``plan.shardings.params``: its
layout, ``param_layout`` and offload); the optimizer state is made by ``tx.init`` under jit in
the plan's shardings.

Two kinds of folder, told apart by what they hold:

- **Hugging Face** (``config.json`` and ``model.safetensors`` or its index): a Llama or Mixtral
  whose ``config.json`` agrees with the run's model section (:mod:`meshpar.hf.load`);
- **a meshpar run**: its workdir (``checkpoints/`` inside) or a checkpoint folder; the newest
  committed step's parameters, checked against their saved digests. Its model settings must
  equal this run's, except how the model runs or trains (:data:`EXECUTION`: dtypes, the layer
  loop, remat, attention, dropout, FP8 dots): a different ``param_dtype`` is converted. FP8
  amax histories the run does not hold as this model has them start empty.

Everything is checked before anything is allocated (:func:`open_source`), and a problem is one
line naming the key or tensor. A resumed run continues from its own checkpoint, and ignores
``init_from`` (a ``--resume`` whose checkpoint folder is still empty starts from it).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshpar.checkpoints import integrity, rundir
from meshpar.configuration.config import Config, ConfigError
from meshpar.configuration.errors import CheckpointError
from meshpar.hf import load as hf_load
from meshpar.hf import reader
from meshpar.models import fp8
from meshpar.step import trainer

KEY = "checkpoint.init_from"
# Model settings that choose how a model runs or trains, not what it computes from its parameters.
EXECUTION = (
    "param_dtype",
    "compute_dtype",
    "scan_layers",
    "remat",
    "remat_save",
    "attention",
    "attention_block",
    "context_parallel",
    "scan_unroll",
    "dropout",
    "fp8",
    "fp8_gather",
    "fp8_scaling",
    "fp8_history",
)


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and ((path / reader.SINGLE).is_file() or (path / reader.INDEX).is_file())


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """The newest committed step of a meshpar checkpoint folder."""

    directory: Path  # the checkpoint folder
    step: int

    @classmethod
    def find(cls, path: Path) -> SavedRun | None:
        """The run at `path`: a workdir (its ``checkpoints/``) or a checkpoint folder; None if neither."""
        for folder in (path / "checkpoints", path):
            steps = rundir.committed_steps(folder)
            if steps:
                return cls(folder, steps[-1])
        return None

    @property
    def step_dir(self) -> Path:
        return (self.directory / str(self.step)).absolute()  # orbax takes absolute paths only

    def describe(self) -> str:
        return f"{self.directory} (meshpar run, step {self.step})"

    def _json(self, item: str) -> dict:
        import orbax.checkpoint as ocp  # here: commands without checkpoints start without orbax

        try:
            return dict(ocp.JsonCheckpointHandler().restore(self.step_dir / item))
        except Exception as e:  # noqa: BLE001 — what failed is named in one line
            raise CheckpointError(
                f"cannot read the {item} record of step {self.step} in {self.directory}: {e}"
            ) from None

    def record(self) -> dict:
        """The run record the step was saved with (:mod:`meshpar.run.resume`)."""
        return self._json("run")

    def digests(self) -> dict:
        """Leaf name → the digest of the array saved (:mod:`meshpar.checkpoints.integrity`)."""
        return self._json("integrity").get("leaves", {})

    def verify_files(self) -> None:
        try:
            integrity.verify_files(self.step_dir, self.step)
        except integrity.Unrecorded:
            pass  # saved before its manifest was written: the array digests decide
        except integrity.Damaged as e:
            raise CheckpointError(f"step {self.step} in {self.directory} is damaged: {e}") from None
        except OSError as e:
            raise CheckpointError(f"step {self.step} in {self.directory} cannot be read: {e.strerror or e}") from None

    def param_metadata(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``params/...`` leaf name → (shape, dtype) as saved."""
        import orbax.checkpoint as ocp

        try:
            meta = ocp.PyTreeCheckpointHandler().metadata(self.step_dir / "state")
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read step {self.step} in {self.directory}: {e}") from None
        flat = jax.tree_util.tree_flatten_with_path(dict(meta.tree)["params"])[0]
        return {"params/" + hf_load.path_name(p): (tuple(m.shape), np.dtype(m.dtype)) for p, m in flat}

    def restore_params(self, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        """The parameters named in `targets` (``params/...`` → shape, saved dtype and sharding),
        read with orbax straight into those shardings."""
        import orbax.checkpoint as ocp

        nested: dict = {}
        args: dict = {}
        for name, target in targets.items():
            *parents, last = name.split("/")
            node, arg = nested, args
            for p in parents:
                node, arg = node.setdefault(p, {}), arg.setdefault(p, {})
            node[last] = target
            arg[last] = ocp.ArrayRestoreArgs(sharding=target.sharding, global_shape=target.shape, dtype=target.dtype)
        try:
            restore = ocp.args.PyTreeRestore(nested, restore_args=args, partial_restore=True)
            out = ocp.PyTreeCheckpointHandler().restore(self.step_dir / "state", args=restore)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read the parameters of step {self.step} in {self.directory}: {e}") from None
        return {name: functools.reduce(lambda n, p: n[p], name.split("/"), out) for name in targets}


@dataclasses.dataclass
class RunSource:
    """A meshpar run checked against this config: the same model, its parameters as saved."""

    run: SavedRun
    saved: dict[str, tuple[tuple[int, ...], np.dtype]]

    def describe(self) -> str:
        return self.run.describe()

    def load(self, abstract_params, shardings) -> tuple[object, str]:
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
        names = ["params/" + hf_load.path_name(p) for p, _ in flat]
        # FP8 amax histories the run holds as this model has them; the others start empty.
        empty = {n for n, (_, a) in zip(names, flat) if fp8.is_history(n) and self.saved.get(n, (None,))[0] != a.shape}
        targets = {
            n: jax.ShapeDtypeStruct(a.shape, self.saved[n][1], sharding=s)
            for n, (_, a), s in zip(names, flat, jax.tree.leaves(shardings))
            if n not in empty
        }
        self.run.verify_files()
        arrays = self.run.restore_params(targets)
        digests = self.run.digests()
        kept = [n for n in names if n not in empty]
        got = integrity.array_digests([arrays[n] for n in kept], kept)
        for n in kept:
            if got[n] != digests.get(n):
                raise CheckpointError(
                    f"step {self.run.step} in {self.run.directory} is damaged: {n} does not match its saved digest"
                )
        out = []
        for n, (_, a), s in zip(names, flat, jax.tree.leaves(shardings)):
            if n in empty:
                out.append(jax.device_put(np.zeros(a.shape, a.dtype), s))
                continue
            x = arrays.pop(n)
            out.append(x if x.dtype == a.dtype else _cast(x, a.dtype, s))
        return jax.tree.unflatten(treedef, out), f"{len(names)} parameters"


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def _cast_jit(x, dtype, sharding):
    return jax.lax.with_sharding_constraint(x.astype(dtype), sharding)


def _cast(x: jax.Array, dtype, sharding) -> jax.Array:
    return _cast_jit(x, jnp.dtype(dtype), sharding)


def check_run(cfg: Config, run: SavedRun, abstract_params) -> RunSource:
    """`run`'s model is this config's (except how it runs), and it holds every parameter of this
    model with the same shape: ConfigError naming the first key or parameter that differs."""
    record = run.record().get("config", {})
    where = run.describe()
    model = dataclasses.asdict(cfg.model)
    for field, mine in model.items():
        key = f"model.{field}"
        if field in EXECUTION or key not in record:
            continue
        theirs = record[key]
        if _plain(mine) != theirs:
            raise ConfigError(key, f"{_plain(mine)!r} in the config but {theirs!r} in {where}")
    saved = run.param_metadata()
    flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    names = set()
    for path, a in flat:
        name = "params/" + hf_load.path_name(path)
        names.add(name)
        if fp8.is_history(name):
            continue  # training state: restored where it fits (RunSource.load), else empty
        if name not in saved:
            raise ConfigError(KEY, f"{where} has no {name}, which this model has ({a.dtype}{list(a.shape)})")
        if saved[name][0] != tuple(a.shape):
            raise ConfigError(
                KEY, f"{where} holds {name} as {list(saved[name][0])}; this model makes it {list(a.shape)}"
            )
    extra = sorted(n for n in set(saved) - names if not fp8.is_history(n))
    if extra:
        raise ConfigError(KEY, f"{where} holds {extra[0]} {list(saved[extra[0]][0])}, which this model has not")
    return RunSource(run, saved)


def _plain(value):
    """A config value as the run record stores it (JSON: tuples are lists)."""
    return list(value) if isinstance(value, tuple) else value


def open_source(cfg: Config, abstract_params) -> hf_load.Source | RunSource | None:
    """``checkpoint.init_from`` checked against this config and its model's parameters (an nnx
    State of shapes), reading no weight; None when unset."""
    text = cfg.checkpoint.init_from
    if not text or (cfg.checkpoint.resume == "auto" and rundir.committed_steps(cfg.checkpoint_dir)):
        return None  # unset, or the run continues from its own checkpoint
    path = Path(text).expanduser()
    if not path.exists():
        raise ConfigError(KEY, f"{text} does not exist")
    if not path.is_dir():
        raise ConfigError(KEY, f"{text} is a file; give a Hugging Face model folder or a meshpar run's folder")
    if is_hf_folder(path):
        return hf_load.open(path, cfg.model)
    run = SavedRun.find(path)
    if run is None:
        raise ConfigError(
            KEY,
            f"{text} is neither a Hugging Face model folder (config.json with model.safetensors or "
            f"{reader.INDEX}) nor a meshpar run (a workdir whose checkpoints/ holds a committed step, or such a folder)",
        )
    return check_run(cfg, run, abstract_params)


def load_params(source, plan: trainer.StatePlan) -> tuple[object, str]:
    """`source`'s parameters in the plan's shardings, and a line saying what was read."""
    params, report = source.load(plan.abstract.params, plan.shardings.params)
    what = report.describe() if isinstance(report, hf_load.Report) else report
    return params, f"{KEY}: parameters from {source.describe()}; {what}"


def initial_state(cfg: Config, source, plan: trainer.StatePlan, tx) -> trainer.TrainState:
    """A fresh run's state with `source`'s parameters: step 0, ``tx.init`` of them and the random
    key of a fresh run of this seed (:func:`meshpar.step.trainer.plan_state`), in the plan's shardings."""
    params, line = load_params(source, plan)
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)
    return fresh_state(params, plan, tx, cfg.train.seed)


def fresh_state(params, plan: trainer.StatePlan, tx, seed: int) -> trainer.TrainState:
    def init(params):
        _, state_rng = jax.random.split(jax.random.key(seed))  # as plan_state's init splits it
        params = plan.reorder.to_stored(params)  # a pipeline's layer order (source weights are canonical)
        return trainer.TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=jax.random.key_data(state_rng)
        )

    return jax.jit(init, in_shardings=(plan.shardings.params,), out_shardings=plan.shardings, donate_argnums=0)(params)
