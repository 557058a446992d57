"""Host offload (the ``offload`` config section): which parts of training live in the host's
pinned memory instead of on the devices, and the moves that bring them to the devices inside
the jitted step, all carried by JAX memory kinds.

* **Optimizer state** (``offload.optimizer``) and **parameters** (``offload.params``): their
  shardings in the state plan carry ``pinned_host`` (:func:`place_state`), so initialisation,
  checkpoint restore and the train step all agree; the step brings them to the devices
  (:func:`fetch`; a weight where it is used: :func:`meshpar.sharding.layout.use`) and its output
  shardings write them back.
* **Activations** (``offload.activations``): a remat policy that saves the values its model
  family names (:meth:`meshpar.models.Family.kept_activations`) in host memory, inside the
  layer loop (:mod:`meshpar.models.remat`); :func:`host_moves` reads what a traced step moves.

On the CPU backend the memory kinds exist and survive the step, but XLA ignores memory spaces
inside a computation: only a GPU shows what offload saves and costs. The design and the
measurements: docs/offload.md.
"""

from __future__ import annotations

from typing import Any

import jax

from meshpar import jaxprs

HOST = "pinned_host"
DEVICE = "device"


def on_host(sharding: Any) -> bool:
    return getattr(sharding, "memory_kind", None) == HOST


def any_on_host(shardings: Any) -> bool:
    """Whether any leaf of a tree of shardings lives in pinned host memory."""
    return any(on_host(s) for s in jax.tree.leaves(shardings))


def to_host(shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


def on_device(shardings: Any) -> Any:
    """The same shardings in device memory (leaves already there are returned as they are, so
    a run without offload compiles the same program as before)."""
    return jax.tree.map(lambda s: s.with_memory_kind(DEVICE) if on_host(s) else s, shardings)


def place_state(shardings: Any, optimizer: bool, params: bool) -> Any:
    """A train state's shardings (a TrainState of NamedShardings) with the optimizer state and/or
    the parameters in pinned host memory; step and RNG key stay on the devices."""
    return shardings.replace(
        params=to_host(shardings.params) if params else shardings.params,
        opt_state=to_host(shardings.opt_state) if optimizer else shardings.opt_state,
    )


def fetch(tree: Any, shardings: Any) -> Any:
    """Inside a jitted step: every leaf of `tree` whose sharding is in host memory, moved to
    the devices (same split); the others as they are."""

    def one(x, s):
        return jax.device_put(x, s.with_memory_kind(DEVICE)) if on_host(s) else x

    return jax.tree.map(one, tree, shardings)


def memory_kinds(tree: Any) -> set[str]:
    """The memory kinds the arrays of `tree` live in (for checks and reports)."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if hasattr(x, "sharding")}


def names_moved_to_host(jaxpr: Any) -> set[str]:
    """The ``checkpoint_name`` tags whose values a traced program (a jaxpr, e.g. ``jit(f).trace(
    ...).jaxpr``) moves to host memory: the residuals an offloading remat policy sends there.

    Read from the program jax builds, before XLA: on CPU the moves compile to nothing, so the
    compiled HLO cannot show them there; on GPU they become host-memory copies (``S(5)``)."""
    return set(host_moves(jaxpr))


def host_moves(jaxpr: Any) -> dict[str, tuple[int, ...]]:
    """:func:`names_moved_to_host`, each name with the (global, per layer) shape of its value."""
    found: dict[str, tuple[int, ...]] = {}
    for jx in jaxprs.nested(jaxpr):  # a tag names a value of its own jaxpr
        named: dict = {}
        for eqn in jx.eqns:
            tag = jaxprs.tag_of(eqn)
            if tag is not None:
                named[eqn.outvars[0]] = tag
            for var in jaxprs.host_transfers(eqn):
                if var in named:
                    found[named[var]] = tuple(var.aval.shape)
    return found
