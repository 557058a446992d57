"""Checkpoints of the train state, the input position and the run record, with orbax.

Saves are asynchronous: ``maybe_save`` returns once orbax has copied the arrays to host; the
files are written by a background thread into ``<step>.orbax-checkpoint-tmp``, sealed with a
file manifest (:mod:`meshpar.checkpoints.integrity`), and renamed to ``<step>`` only then. A process
killed mid-save leaves a tmp folder that is never listed as a step (orbax removes it when the
next manager starts). A save that fails (a full disk) ends the run with one line naming the
step and the last step saved.

A checkpoint is deleted only by ``keep`` rotation, after a newer save committed. ``restore``
takes the newest step and tells three cases apart:

- **damaged**, verified against the step's own records (manifest, array digests): the step
  is set aside as ``<step>.damaged`` — kept, never listed — and the one before is tried;
- **healthy but not this run** (other model, optimizer, widths): ``ConfigError`` naming the
  first difference; nothing falls back, nothing on disk changes;
- **cannot be verified either way** (an I/O error, a timeout, a tensorstore error on files
  that match the manifest): ``CheckpointError``; every checkpoint stays as it is.

What a checkpoint holds may differ from the run's state: a circular pipeline stores its layers
permuted, and checkpoints hold them in the canonical order, so that any layout can resume them.
The :class:`Codec` the checkpointer is built with says how, both ways: ``save`` writes
``codec.to_saved(state)`` and ``restore`` returns ``codec.from_saved(what was read)``, so a
caller saves and restores its own state and never converts either way itself.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshpar import jax_compat
from meshpar.checkpoints import integrity
from meshpar.configuration.config import ConfigError
from meshpar.configuration.errors import CheckpointError

__all__ = ["CheckpointError", "Checkpointer", "Codec", "Restored"]


class _OrbaxOnly(logging.Filter):
    """orbax logs through absl: INFO per save, ERROR with a traceback for a failed one. meshpar
    reports every checkpoint failure itself in one line, so orbax's records stay out of the
    run's output (unless the caller configured absl logging themselves)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "orbax" not in record.pathname.replace("\\", "/")


if logging.getLogger("absl").level == logging.NOTSET:
    logging.getLogger("absl").addFilter(_OrbaxOnly())


def _quiet_abandoned_reads() -> None:
    """When a restore fails on one array, orbax abandons the reads of the others: their
    coroutines end with the same error nobody awaits any more, and tensorstore hands results
    still in flight to an event loop the failure already closed ("Event loop is closed"); a
    save that fails (e.g. at interpreter shutdown) leaves the same. Both reach
    ``sys.unraisablehook`` as tracebacks — dozens, burying the one line that says what failed.
    Drop exactly those two kinds."""
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
        in_asyncio = tb is not None and tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(
            "asyncio/base_events.py"
        )
        return (
            unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed" and in_asyncio
        )

    def hook(unraisable):
        if not abandoned(unraisable):
            previous(unraisable)

    hook._meshpar_quiet = True
    sys.unraisablehook = hook
    # The failed writes' tasks, collected unretrieved, are reported through asyncio's logger
    # instead ("Task exception was never retrieved", one traceback each): the same drop.
    logging.getLogger("asyncio").addFilter(_drop_abandoned_orbax_tasks)


def _drop_abandoned_orbax_tasks(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's "<Task|_GatheringFuture> exception was never retrieved" about
    an orbax coroutine: its future's repr or its traceback names an orbax file."""
    message = record.getMessage()
    if "exception was never retrieved" not in message.partition("\n")[0]:
        return True
    files = [message]
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return not any("/orbax/" in f.replace("\\", "/") for f in files)


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


def _one_line(e: BaseException) -> str:
    """What went wrong, in one short line: the OS error where one is at the root (tensorstore
    reports it as ``[os_error_code='28']`` deep in a long message), else the message, cut."""
    code = e.errno if isinstance(e, OSError) and e.errno else None
    found = re.search(r"os_error_code='?(\d+)", str(e))
    if code is None and found:
        code = int(found[1])
    text = " ".join(str(e).split()) or type(e).__name__
    if code is not None:
        return f"{os.strerror(code)} [errno {code}]; {type(e).__name__}: {text[:160]}"
    return f"{type(e).__name__}: {text[:300]}"


def _shape(x: Any) -> str:
    return f"{np.dtype(x.dtype)}{list(x.shape)}"


def _identity(state: Any) -> Any:
    return state


@dataclasses.dataclass(frozen=True)
class Codec:
    """How a run's state becomes what its checkpoints hold, and back; fixed when the
    :class:`Checkpointer` is built.

    ``to_saved`` (state → saved state) and ``from_saved`` (its inverse, applied by ``restore``;
    it may donate its argument) keep the tree's structure, and each leaf's shape, dtype and
    sharding: they move values (a pipeline's layers between its stored and the canonical order,
    :meth:`meshpar.step.trainer.StatePlan.canonical` / ``.stored``). ``digest_program``: the
    checkpoint digest program compiled ahead of time for the saved state's leaves
    (:func:`meshpar.checkpoints.integrity.digest_program`, by the memory pre-flight:
    :mod:`meshpar.plan.programs`); None = compile it at the first save.
    """

    to_saved: Callable[[Any], Any] = _identity
    from_saved: Callable[[Any], Any] = _identity
    digest_program: Any = None

    @classmethod
    def of_plan(cls, plan: Any, digest_program: Any = None) -> Codec:  # plan: a step.trainer.StatePlan
        """The codec of a run whose state `plan` describes: its layers saved in the canonical
        order, restored into the order `plan` stores (the identity both ways without a circular
        pipeline)."""
        return cls(plan.canonical, plan.stored, digest_program)


IDENTITY = Codec()  # a state saved as it is


@dataclasses.dataclass
class Restored:
    state: Any
    position: dict
    record: dict
    step: int


_ITEMS = ("state", "position", "run", "integrity")


class Checkpointer:
    """Saves and restores one run's checkpoints in `directory`: a save every `every` steps (0:
    only forced ones), the `keep` newest kept (0: all); `codec`: what the run's state is saved as
    and restored from (default: the state itself)."""

    def __init__(self, directory: str | Path, every: int, keep: int, *, codec: Codec = IDENTITY):
        self.directory = Path(directory).absolute()
        self.every, self.keep = every, keep
        self.codec = codec
        self.skipped: list[str] = []  # one line per damaged step restore() set aside
        self._primary = jax.process_index() == 0
        self._saving: int | None = None  # the step whose save is in flight
        self._saved: set[int] = set()  # steps this object saved
        import orbax.checkpoint as ocp  # here: runs without checkpoints start without orbax

        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep or None,
            enable_async_checkpointing=True,
            # A tmp folder left by a killed save would make a new save of that step fail.
            cleanup_tmp_directories=True,
            create=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal),
        )
        # Handlers named up front: a restarted run restores before it has saved anything.
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("state", ocp.args.StandardSave, ocp.StandardCheckpointHandler())
        registry.add("state", ocp.args.StandardRestore, ocp.StandardCheckpointHandler())
        for item in _ITEMS[1:]:
            handler = ocp.JsonCheckpointHandler()
            registry.add(item, ocp.args.JsonSave, handler)
            registry.add(item, ocp.args.JsonRestore, handler)
        try:
            self._mgr = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        except OSError as e:
            raise CheckpointError(f"cannot use {self.directory}: {e.strerror or e}") from None
        self._closed = False
        _quiet_abandoned_reads()  # a failed save leaves the same stray reports as a failed read
        steps = self.steps()
        self.last_saved: int | None = steps[-1] if steps else None  # newest committed step
        # At interpreter exit (Python 3.11), concurrent.futures refuses new work *before*
        # non-daemon threads are joined, so an in-flight save would die half-written (safe: it
        # stays a tmp folder, but it is lost). Hooks registered here run before that refusal.
        # From Python 3.12 no thread can start once shutdown begins, so this cannot help
        # there: close() (or the `with` block) is what finishes a save; the train loop does.
        ref = weakref.ref(self)  # the hook must not keep this object alive
        jax_compat.register_before_thread_shutdown(
            lambda: (c := ref()) is not None and not c._closed and c._finish_at_exit()
        )

    @property
    def digest_program(self) -> Any:
        """The compiled checkpoint digest program this checkpointer was built with, or None."""
        return self.codec.digest_program

    # ------------------------------------------------------------------------------------------
    # Saving

    def _seal(self) -> None:
        """orbax's post-finalization callback (primary process, background thread): every item
        is written; record the files before the step is committed."""
        step = self._saving
        if step is None:
            return
        tmp = sorted(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
        integrity.write_manifest(tmp[-1] if tmp else self.directory / str(step), step)

    def maybe_save(self, state: Any, data_position: dict, record: dict, force: bool = False) -> bool:
        """Save `state` if its step is due (every `every` steps, or `force`). Returns whether a
        save started. Raises CheckpointError if the previous save failed."""
        step = int(state.step)
        if not (force or (self.every > 0 and step % self.every == 0)):
            return False
        if step in self._saved:
            return False  # already saved (e.g. the final forced save right after a periodic one)
        self.wait()  # the previous save must have committed (or its failure be reported) first
        if step in self.steps():
            # A fresh run refuses a folder with steps and a resumed one starts after its newest
            # step; a step of this number is not this run's to replace.
            raise CheckpointError(f"step {step} already exists in {self.directory} and was not saved by this run")
        state = self.codec.to_saved(state)
        nested, names, _ = _nest(state)
        leaves = jax.tree.leaves(state)
        digests = {
            "leaves": integrity.array_digests(leaves, names, self.codec.digest_program),
            "position": integrity.json_digest(data_position),
            "run": integrity.json_digest(record),
        }
        import orbax.checkpoint as ocp

        args = ocp.args.Composite(
            state=ocp.args.StandardSave(nested),
            position=ocp.args.JsonSave(data_position),
            run=ocp.args.JsonSave(record),
            integrity=ocp.args.JsonSave(digests),
        )
        self._saving = step
        try:
            # force: `every` decided above; orbax's own policy would also refuse a step at or
            # below its latest one, which after falling back past a damaged step is wrong.
            started = bool(self._mgr.save(step, args=args, force=True))
        except Exception as e:  # noqa: BLE001 — what failed is named in one line
            self._saving = None
            raise self._save_error(step, e) from None
        if started:
            self._saved.add(step)
        return started

    def _save_error(self, step: int, e: BaseException) -> CheckpointError:
        last = f"last step saved: {self.last_saved}" if self.last_saved is not None else "no step saved yet"
        return CheckpointError(f"cannot write step {step} to {self.directory / str(step)} ({_one_line(e)}); {last}")

    def wait(self) -> None:
        """Until the save in flight has committed. Raises CheckpointError if it failed."""
        step = self._saving  # cleared only after the commit: _seal reads it until then
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._saving = None
            self._saved.discard(step)
            raise self._save_error(step, e) from None
        self._saving = None
        if step is not None:
            self.last_saved = step if self.last_saved is None else max(step, self.last_saved)

    def _finish_at_exit(self) -> None:
        try:
            self.wait()
        except CheckpointError as e:
            # The save cannot finish now (Python 3.12: no thread starts once shutdown has
            # begun), and orbax's own threads would wait for its signals without end, holding
            # the exit: say so in one line and leave at once, with a failure status.
            print(f"checkpoint error: {e}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def steps(self) -> list[int]:
        """Committed steps, from disk: orbax's in-memory list includes a save still being written."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())

    # ------------------------------------------------------------------------------------------
    # Restoring

    def restore(
        self, abstract_state: Any, shardings: Any = None, accept: Callable[[dict, int], None] | None = None
    ) -> Restored:
        """The newest usable checkpoint, each array read straight into its target sharding, as
        the run's state (``codec.from_saved`` of what the checkpoint holds).

        ``abstract_state``: a TrainState of arrays or ShapeDtypeStructs; ``shardings``: the
        matching tree of shardings (default: the abstract leaves' own ``.sharding``);
        ``accept(run_record, step)`` may raise (ConfigError) before any array is read.
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
        steps = self.steps()
        for i, step in enumerate(reversed(steps)):
            try:
                return self._restore_step(step, targets, names, treedef, accept)
            except integrity.Damaged as e:
                older = steps[-2 - i] if i + 1 < len(steps) else None
                self._set_aside(step, str(e), older)
        newest = f" (newest: {self.skipped[0]})" if self.skipped else " (none saved)"
        raise CheckpointError(f"no usable checkpoint in {self.directory}{newest}")

    def _unreadable(self, step: int, e: BaseException) -> CheckpointError:
        return CheckpointError(
            f"step {step} in {self.directory} cannot be read ({_one_line(e)}); nothing on disk was changed: "
            f"fix the cause and resume again, or move step {step} aside to resume from the one before"
        )

    def _restore_step(self, step: int, targets: list, names: list[str], treedef: Any, accept) -> Restored:
        import orbax.checkpoint as ocp

        try:
            integrity.verify_files(self.directory / str(step), step)
        except integrity.Unrecorded:
            pass  # its save stopped between commit and manifest: the array digests decide
        except OSError as e:
            raise self._unreadable(step, e) from None
        try:
            jsons = {item: ocp.args.JsonRestore() for item in _ITEMS[1:]}
            meta = self._mgr.restore(step, args=ocp.args.Composite(**jsons))
            state_meta = self._mgr.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 — files verified, or no manifest: unknown either way
            raise self._unreadable(step, e) from None
        digests, record, position = meta["integrity"], meta["run"], meta["position"]
        if integrity.json_digest(record) != digests.get("run") or integrity.json_digest(position) != digests.get(
            "position"
        ):
            raise integrity.Damaged("its run record or data position does not match its digest")
        if accept is not None:
            accept(record, step)
        self._check_leaves(step, state_meta, names, targets)
        target_tree, _, _ = _nest(jax.tree.unflatten(treedef, targets))
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target_tree)))
            arrays = _leaves(out["state"], names)
            got = integrity.array_digests(arrays, names)
        except Exception as e:  # noqa: BLE001
            raise self._unreadable(step, e) from None
        for name in names:
            if got[name] != digests["leaves"].get(name):
                raise integrity.Damaged(f"{name} does not match its saved digest")
        saved = jax.tree.unflatten(treedef, arrays)
        if int(saved.step) != step:
            raise integrity.Damaged(f"it holds state.step {int(saved.step)}")
        return Restored(self.codec.from_saved(saved), position, record, step)

    def _check_leaves(self, step: int, state_meta: Any, names: list[str], targets: list) -> None:
        """The checkpoint holds exactly the leaves this config's state has, with the same shapes
        and dtypes (orbax would silently cast another dtype)."""
        stored = {_path_name(path): m for path, m in jax.tree_util.tree_flatten_with_path(state_meta)[0]}
        where = f"the checkpoint at step {step}"
        for name, want in zip(names, targets):
            got = stored.get(name)
            if got is None:
                raise ConfigError(
                    "checkpoint", f"{where} has no {name}, which this config's state has ({_shape(want)})"
                )
            if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
                raise ConfigError(
                    "checkpoint", f"{where} holds {name} as {_shape(got)}; this config makes it {_shape(want)}"
                )
        extra = sorted(set(stored) - set(names))
        if extra:
            raise ConfigError(
                "checkpoint",
                f"{where} holds {extra[0]} ({_shape(stored[extra[0]])}), which this config's state has not",
            )

    def _set_aside(self, step: int, reason: str, older: int | None) -> None:
        """Move a damaged step out of the list of steps, keeping its files."""
        line = f"step {step}: {reason}"
        self.skipped.append(line)
        target = self.directory / f"{step}.damaged"
        n = 1
        while target.exists():
            target, n = self.directory / f"{step}.damaged-{n}", n + 1
        if self._primary:
            try:
                os.rename(self.directory / str(step), target)
            except OSError as e:
                raise CheckpointError(
                    f"step {step} is damaged ({reason}) but cannot be set aside: {e.strerror or e}"
                ) from None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"meshpar_set_aside_{step}")
        self._mgr.reload()
        then = f"falling back to step {older}" if older is not None else "no older checkpoint"
        print(f"checkpoint: step {step} is damaged ({reason}); kept as {target.name}; {then}", file=sys.stderr)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.wait()
            finally:
                self._mgr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
