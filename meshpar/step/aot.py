"""A config's programs compiled ahead of time on abstract inputs, and what XLA says of them.

The parts come from :mod:`meshpar.step.parts` (nothing allocated: the state is its plan, the batch
and the stop flags ``ShapeDtypeStruct``s with the shardings a run gives them), so what XLA
compiles here is exactly what :func:`meshpar.run.experiment.build` runs, and its
``memory_analysis()`` is the step's per-device memory (argument + output + temp − alias) before
any array exists.
"""

from __future__ import annotations

import math

import jax

from meshpar import jax_compat
from meshpar.configuration.config import Config
from meshpar.sharding import offload
from meshpar.step import parts, trainer

# compiled.memory_analysis() fields reported per device, in bytes.
MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")


def compile_train_step(cfg: Config) -> jax.stages.Compiled:
    """The config's train step, lowered and compiled for its mesh with its XLA flags (nothing allocated)."""
    return parts.abstract_step(cfg).compile()


def _host_bytes(compiled: jax.stages.Compiled) -> tuple[int, int, int]:
    """Per-device bytes of the program's ``pinned_host`` arguments, outputs, and donated
    arguments among them, from their shardings (:func:`shard_bytes`)."""
    args = jax.tree.leaves(compiled.args_info)
    arg_shardings = jax.tree.leaves(compiled.input_shardings[0])
    outs = jax.tree.leaves(compiled.out_info)
    arg, donated, out = 0, 0, 0
    for info, s in zip(args, arg_shardings):
        if offload.on_host(s):
            n = shard_bytes(jax.ShapeDtypeStruct(info.shape, info.dtype), [s])
            arg += n
            donated += n if info.donated else 0
    for o in outs:
        if offload.on_host(o.sharding):
            out += shard_bytes(o)
    return arg, out, min(donated, out)


def memory(compiled: jax.stages.Compiled) -> dict:
    """Per-device bytes of a compiled program in device memory: ``<field>_bytes`` for each of
    MEMORY_FIELDS, and ``total_bytes`` = argument + output + temp − alias (what the program
    holds at its peak); ``host_<field>_bytes`` for its ``pinned_host`` arguments, outputs and
    aliases, and ``host_from``: where those came from.

    XLA reports host-memory buffers in its ``host_*`` fields where the backend honours memory
    kinds (GPU, TPU): ``host_from`` is ``"xla"`` then. The CPU backend ignores memory kinds
    inside a computation and counts ``pinned_host`` arguments and outputs as ordinary ones,
    with every ``host_*`` field 0: their bytes are computed from the shardings instead and
    taken out of argument, output and alias (``host_from`` = ``"shardings"``)."""
    stats = jax_compat.memory_analysis(compiled)
    out = {f"{f}_bytes": int(getattr(stats, f"{f}_size_in_bytes")) for f in MEMORY_FIELDS}
    host = {f: int(getattr(stats, f"host_{f}_size_in_bytes", 0) or 0) for f in ("argument", "output", "alias", "temp")}
    out["host_from"] = "xla"
    if not any(host.values()):
        arg, res, alias = _host_bytes(compiled)
        if arg or res:
            host.update(argument=arg, output=res, alias=alias)
            out["argument_bytes"] -= arg
            out["output_bytes"] -= res
            out["alias_bytes"] -= alias
            out["host_from"] = "shardings"
    out.update({f"host_{f}_bytes": n for f, n in host.items()})
    out["host_total_bytes"] = host["argument"] + host["output"] + host["temp"] - host["alias"]
    out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out


def step_memory(cfg: Config) -> dict[str, int]:
    """Per-device memory of the config's compiled train step (see :func:`memory`)."""
    return memory(compile_train_step(cfg))


def shard_bytes(abstract, shardings=None) -> int:
    """Bytes one device holds of every leaf of `abstract`, each by its sharding's shard shape
    (`shardings`: a matching tree; default each leaf's own ``.sharding``)."""
    leaves = jax.tree.leaves(abstract)
    shards = jax.tree.leaves(shardings) if shardings is not None else [a.sharding for a in leaves]
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in zip(leaves, shards))


def state_bytes(plan: trainer.StatePlan) -> dict[str, dict]:
    """Every train-state array by path (``params/blocks/w_in``, ``opt_state/1/0/mu/...``):
    shape, dtype, total bytes and bytes per device, the latter from its sharding's shard shape
    (exactly what each device will hold)."""
    leaves = jax.tree_util.tree_leaves_with_path(plan.abstract)
    out = {}
    for (path, a), s in zip(leaves, jax.tree.leaves(plan.shardings)):
        name = jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")
        item = a.dtype.itemsize
        out[name] = {
            "shape": list(a.shape), "dtype": str(a.dtype), "spec": str(s.spec),
            "total_bytes": math.prod(a.shape) * item, "per_device_bytes": math.prod(s.shard_shape(a.shape)) * item,
        }  # fmt: skip
    return out
