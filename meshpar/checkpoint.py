"""Checkpoints of the train state and the input position, with orbax's ``CheckpointManager``.

Saves are asynchronous: ``maybe_save`` returns once orbax has copied the arrays to host, and
the files are written by a background thread into ``<step>.orbax-checkpoint-tmp``, which is
renamed to ``<step>`` only when every item is written. So a process killed mid-save leaves a
tmp folder that orbax never lists as a step (and removes when the next manager starts).

A committed step can still be damaged later (a file deleted, truncated, overwritten). zstd
keeps incompressible bytes raw and unchecksummed, so a damaged float may read back silently:
each checkpoint also holds a digest of every array, computed on device, checked on restore.
An unreadable step is skipped with a one-line note, falling back to the one before.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

# orbax logs through absl at INFO per save/restore; keep that out of the run's output unless
# the caller configured absl logging themselves.
if logging.getLogger("absl").level == logging.NOTSET:
    logging.getLogger("absl").setLevel(logging.WARNING)


def _quiet_abandoned_reads() -> None:
    """When a restore fails on one array, orbax abandons the reads of the others: their
    coroutines end with the same error nobody awaits any more, and tensorstore hands results
    still in flight to an event loop the failure already closed ("Event loop is closed"). Both
    reach ``sys.unraisablehook`` as tracebacks — dozens, burying the one-line fallback note,
    which already says what failed. Drop exactly those two kinds."""
    previous = sys.unraisablehook
    if getattr(previous, "_meshpar_quiet", False):
        return

    def abandoned(unraisable) -> bool:
        code = getattr(unraisable.object, "cr_code", None)  # a coroutine nobody awaited
        if code is not None and "orbax" in code.co_filename.replace("\\", "/"):
            return True
        tb = unraisable.exc_traceback
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        in_asyncio = tb is not None and tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("asyncio/base_events.py")
        return unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed" and in_asyncio

    def hook(unraisable):
        if not abandoned(unraisable):
            previous(unraisable)

    hook._meshpar_quiet = True
    sys.unraisablehook = hook


class CheckpointError(RuntimeError):
    """No usable checkpoint (one-line message naming the directory)."""


def _path_name(path: tuple) -> str:
    # DictKey .key, SequenceKey .idx, GetAttrKey .name (e.g. an nnx Variable's `value`)
    return "/".join(str(next(getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a))) for k in path)


def _nest(tree: Any) -> tuple[dict, list[str], Any]:
    """TrainState → nested dict of str keys (what orbax stores), the leaf names, the treedef.

    orbax then only sees plain dicts of arrays: nnx Variables, optax namedtuples and their
    metadata stay out of the checkpoint and come back from the caller's abstract state.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    nested: dict = {}
    names = [_path_name(path) for path, _ in flat]
    for name, (_, leaf) in zip(names, flat):
        *parents, last = name.split("/")
        node = functools.reduce(lambda n, p: n.setdefault(p, {}), parents, nested)
        if last in node:
            raise ValueError(f"two state leaves share the checkpoint name {name}")
        node[last] = leaf
    return nested, names, treedef


def _leaves(nested: dict, names: list[str]) -> list:
    return [functools.reduce(lambda node, p: node[p], name.split("/"), nested) for name in names]


def _digest_one(x: jax.Array) -> jax.Array:
    """Position-weighted sums of the raw bits, mod 2**32: exact integer maths, so the same
    value under any sharding, and computed without a reshape (no resharding traffic)."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * min(x.dtype.itemsize, 4)}")).astype(jnp.uint32)
    idx, stride = jnp.zeros(bits.shape, jnp.uint32), 1
    for axis in reversed(range(bits.ndim)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    w1 = (idx * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)) | jnp.uint32(1)
    w2 = (idx * jnp.uint32(0x85EBCA6B) + jnp.uint32(0xC2B2AE35)) | jnp.uint32(1)
    mixed = bits ^ (bits >> 15) ^ (bits << 7)
    return jnp.stack([jnp.sum(bits * w1, dtype=jnp.uint32), jnp.sum(mixed * w2, dtype=jnp.uint32)])


def _spread(x: Any) -> NamedSharding | None:
    """x's sharding, also split over the mesh axes x is replicated on: reaching it is a local
    slice, and each element is then digested once, not once per replica (8x on data:8)."""
    s = getattr(x, "sharding", None)
    if not isinstance(s, NamedSharding) or any(t != AxisType.Auto for t in s.mesh.axis_types):
        return None
    spec = [p if isinstance(p, tuple) else (p,) if p else () for p in s.spec] + [()] * (x.ndim - len(s.spec))
    for axis in [a for a in s.mesh.axis_names if s.mesh.shape[a] > 1 and all(a not in p for p in spec)]:
        for d, p in enumerate(spec):
            if x.shape[d] % (math.prod(s.mesh.shape[a] for a in p) * s.mesh.shape[axis]) == 0:
                spec[d] = (*p, axis)  # minor-most: each new block lies inside the device's own block
                break
    return NamedSharding(s.mesh, PartitionSpec(*(p or None for p in spec)))


@functools.partial(jax.jit, static_argnums=1)
def _digest(leaves: list, spreads: tuple) -> list:
    return [_digest_one(x if s is None else jax.lax.with_sharding_constraint(x, s)) for x, s in zip(leaves, spreads)]


def _digests(leaves: list, names: list[str]) -> dict[str, list[int]]:
    out = jax.device_get(_digest(leaves, tuple(_spread(x) for x in leaves)))
    return {n: [int(v) for v in d] for n, d in zip(names, out)}


def _position_hash(position: dict) -> str:
    return hashlib.sha256(json.dumps(position, sort_keys=True).encode()).hexdigest()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:200]}"


class Checkpointer:
    def __init__(self, directory: str | Path, every: int, keep: int):
        self.directory = Path(directory).absolute()
        self.every, self.keep = every, keep
        self.skipped: list[str] = []  # one line per unreadable step met by restore()
        self._bad: set[int] = set()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep or None,
            enable_async_checkpointing=True,
            # A tmp folder left by a killed save would make a new save of that step fail.
            cleanup_tmp_directories=True,
            create=True,
        )
        # Handlers named up front: a restarted run restores before it has saved anything.
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, save, load, handler in (
            ("state", ocp.args.StandardSave, ocp.args.StandardRestore, ocp.StandardCheckpointHandler()),
            ("position", ocp.args.JsonSave, ocp.args.JsonRestore, ocp.JsonCheckpointHandler()),
            ("integrity", ocp.args.JsonSave, ocp.args.JsonRestore, ocp.JsonCheckpointHandler()),
        ):
            registry.add(item, save, handler)
            registry.add(item, load, handler)
        self._mgr = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        self._closed = False
        # At interpreter exit, concurrent.futures refuses new work *before* non-daemon threads
        # are joined, so an in-flight save would die half-written (safe: it stays a tmp folder,
        # but it is lost). Hooks registered here run before that refusal (and before atexit).
        ref = weakref.ref(self)  # the hook must not keep this object alive
        register = getattr(threading, "_register_atexit", lambda f: None)  # private, as used by concurrent.futures
        register(lambda: (c := ref()) is not None and not c._closed and c.wait())

    def maybe_save(self, state: Any, data_position: dict, force: bool = False) -> bool:
        step = int(state.step)
        if not (force or (self.every > 0 and step % self.every == 0)):
            return False
        if step in self._mgr.all_steps() and step not in self._bad:
            return False  # already saved (e.g. the final forced save right after a periodic one)
        # Unreadable steps that restore() skipped belong to an abandoned run: drop them now,
        # or the new one of the same number could not be written and max_to_keep would count them.
        for bad in sorted(self._bad):
            print(f"checkpoint: removing unreadable step {bad}", file=sys.stderr)
            self._mgr.delete(bad)
        self._bad.clear()
        nested, names, _ = _nest(state)
        integrity = {"leaves": _digests(jax.tree.leaves(state), names), "position": _position_hash(data_position)}
        jsons = {"position": ocp.args.JsonSave(data_position), "integrity": ocp.args.JsonSave(integrity)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(nested), **jsons)
        # force: `every` decided above; orbax's own policy would also refuse a step at or below
        # its latest one, which after falling back past an unreadable step is wrong.
        return bool(self._mgr.save(step, args=args, force=True))

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def steps(self) -> list[int]:
        # From disk, only renamed (committed) step folders: orbax's in-memory list includes a
        # save still being written.
        return sorted(ocp.path.step.checkpoint_steps(self.directory))

    def restore(self, abstract_state: Any, shardings: Any = None) -> tuple[Any, dict, int]:
        """Latest readable checkpoint, each array read straight into its target sharding.

        ``abstract_state``: a TrainState of arrays or ShapeDtypeStructs; ``shardings``: the
        matching tree of shardings (default: the abstract leaves' own ``.sharding``).
        """
        self.wait()
        _, names, treedef = _nest(abstract_state)
        leaves = jax.tree.leaves(abstract_state)
        shards = jax.tree.leaves(shardings) if shardings is not None else [x.sharding for x in leaves]
        if len(shards) != len(leaves):
            raise ValueError(f"shardings has {len(shards)} leaves, the state {len(leaves)}")
        if any(s is None for s in shards):
            raise ValueError("restore needs a sharding for every leaf (pass `shardings`)")
        targets = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, shards)]
        target_tree, _, _ = _nest(jax.tree.unflatten(treedef, targets))
        steps, reasons = self.steps(), []
        _quiet_abandoned_reads()  # before any read: the stray reports come while one fails
        for i, step in enumerate(reversed(steps)):
            try:
                state, position = self._restore_step(step, target_tree, names, treedef)
            except Exception as e:  # noqa: BLE001 — any failure to read means: try the one before
                reasons.append(f"step {step}: {_one_line(e)}")
                self.skipped.append(reasons[-1])
                self._bad.add(step)
                older = steps[-2 - i] if i + 1 < len(steps) else None
                then = f"falling back to step {older}" if older is not None else "no older checkpoint"
                print(f"checkpoint: step {step} unreadable ({_one_line(e)}); {then}", file=sys.stderr)
                continue
            return state, position, step
        newest = f" (newest: {reasons[0]})" if reasons else " (none saved)"
        raise CheckpointError(f"no usable checkpoint in {self.directory}{newest}")

    def _restore_step(self, step: int, target_tree: dict, names: list[str], treedef: Any) -> tuple[Any, dict]:
        # Shapes/dtypes against the stored metadata first: orbax would silently cast another
        # dtype, and a shape mismatch reads better here than as a tensorstore error.
        meta = self._mgr.item_metadata(step)["state"]
        stored = {_path_name(path): m for path, m in jax.tree_util.tree_flatten_with_path(meta)[0]}
        for name, want in zip(names, _leaves(target_tree, names)):
            got = stored.get(name)
            if got is None:
                raise ValueError(f"{name} is not in the checkpoint")
            if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
                have, wants = f"{got.dtype}{list(got.shape)}", f"{want.dtype}{list(want.shape)}"
                raise ValueError(f"{name} is {have}, the model wants {wants}")
        jsons = {"position": ocp.args.JsonRestore(), "integrity": ocp.args.JsonRestore()}
        out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target_tree), **jsons))
        leaves = _leaves(out["state"], names)
        integrity, position = out["integrity"], out["position"]
        digests = _digests(leaves, names)
        for name in names:
            if digests[name] != integrity["leaves"].get(name):
                raise ValueError(f"{name} does not match its saved digest")
        if _position_hash(position) != integrity["position"]:
            raise ValueError("data position does not match its saved digest")
        state = jax.tree.unflatten(treedef, leaves)
        if int(state.step) != step:
            raise ValueError(f"holds state.step {int(state.step)}")
        return state, position

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._mgr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
