"""Host offload (the ``offload`` config section): which parts of training live in the host's
pinned memory instead of on the devices, and the moves that bring them to the devices inside
the jitted step.

JAX memory kinds carry it all. A sharding with ``memory_kind="pinned_host"`` places an array
in the host memory of the device that owns each shard; inside a jitted computation
``jax.device_put(x, sharding.with_memory_kind("device"))`` moves it to the device and an
output sharding in ``pinned_host`` writes a result back. One operation may not mix the two
kinds (a trace-time error, on every backend), so every offloaded array is moved before its
first use.

* **Optimizer state** (``offload.optimizer``): its shardings in the state plan carry
  ``pinned_host`` (:func:`place_state`), so initialisation, checkpoint restore and the train
  step all agree; the step brings it to the devices for the update (:func:`fetch`) and the
  step's output shardings write it back. The state is donated as always.
* **Parameters** (``offload.params``): the same, and every use of a weight inside the model
  first moves it to the devices (:func:`meshpar.sharding.layout.use`, told by
  :func:`meshpar.sharding.layout.activate`): a scanned layer stack is sliced in host memory by the
  layer loop and each layer's slice moved inside the loop body, one layer at a time; the
  other weights where they are used. The gradient of a host array is a host array, so each
  layer's weight gradient goes back to host memory in the backward pass, and the update
  brings gradients and parameters to the devices once more. What it saves: the parameters'
  device memory between steps and through the forward pass. What it does not: the update
  still holds every parameter, its gradient and (unless offloaded too) the optimizer state
  on the devices at once, and with ``model.remat: none`` the backward pass keeps each
  layer's fetched weights as residuals (a remat policy, or activation offload, fetches them
  again instead).
* **Activations** (``offload.activations``): a remat policy that saves the named values of
  each layer (the ``checkpoint_name`` tags its family lists per policy:
  :attr:`meshpar.models.Family.activation_names`) in host memory, applied to the layer
  inside the layer loop (:mod:`meshpar.models.remat`); it replaces ``model.remat``'s policy.

On the CPU backend the memory kinds exist and survive the step, but XLA ignores memory spaces
inside a computation: no bytes move and ``memory_analysis()`` reports no host bytes. Only a
GPU shows what offload saves and costs (``scripts/bench_offload.py``).
"""

from __future__ import annotations

from typing import Any

import jax

from meshpar import jaxprs, models

HOST = "pinned_host"
DEVICE = "device"

# offload.activations → the names (checkpoint_name tags) a step keeps in host memory: each
# built-in family's own (meshpar.models.Family.activation_names), together. A model tags only
# its own names, so each keeps what its family lists. A family from outside meshpar adds its own
# at use time (activation_names).
ACTIVATION_NAMES: dict[str, tuple[str, ...]] = {}
for _family in models.MODELS.values():
    for _policy, _names in (_family.activation_names or {}).items():
        _known = ACTIVATION_NAMES.setdefault(_policy, ())
        ACTIVATION_NAMES[_policy] = _known + tuple(n for n in _names if n not in _known)


def activation_names(model_name: str, policy: str) -> tuple[str, ...]:
    """The names a step of family `model_name` keeps in host memory under ``offload.activations``
    `policy`: for a built-in family :data:`ACTIVATION_NAMES`'s, for a family from outside
    meshpar its own (none when it names none: the config refuses the policy then)."""
    if model_name in models.MODELS:
        return ACTIVATION_NAMES.get(policy, ())
    return tuple((models.family(model_name).activation_names or {}).get(policy, ()))


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
