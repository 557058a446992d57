"""Rematerialisation: what each layer keeps for the backward pass, chosen by ``model.remat``.

* ``none`` — no ``jax.checkpoint``: the backward pass reads every intermediate the forward pass
  made (fastest, most activation memory);
* ``full`` — ``jax.checkpoint`` with ``nothing_saveable``: a layer keeps only its input and
  runs its forward pass again in the backward pass (least memory, about one more forward pass
  of compute);
* ``dots`` — ``dots_with_no_batch_dims_saveable``: a layer keeps the outputs of its matmuls
  against weights (projections, MLP matrices) and recomputes the cheap rest — norms,
  activations, dropout, and attention's batched contractions and softmax (its ``[length,
  length]`` scores are never kept).

The policy applies per layer, around the one function that runs a layer, inside the layer scan
(the values a layer keeps are then stacked over ``layers``) or around each unrolled layer. The
models tag the values a layer may keep with ``jax.ad_checkpoint.checkpoint_name`` (the names are
listed in each model's docstring), so a policy that picks by name (``save_only_these_names``,
or an offloading one) can refer to them; the three settings here do not look at the names.

The saving is real inside the layer loop. In straight-line layers (``scan_layers: false``)
XLA:CPU schedules the recomputation early and keeps about what ``none`` keeps (quickstart at 8
layers, compiled temp per device: 78 MiB for none, full and dots alike), so on CPU a scan is
not unrolled by default when ``remat`` is on.

A step may replace ``model.remat``'s policy for the layers it traces with one that picks by
name (the trace's ``keep``, :class:`meshpar.sharding.tracing.Trace`): host offload of activations (``offload.activations``, see
:mod:`meshpar.sharding.offload`) keeps the named values in pinned host memory, and the same names kept
in device memory are its reference. The models never see the setting; like the layout, it is
read at trace time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from meshpar.sharding import tracing

# model.remat → the jax.checkpoint policy ("none" → no checkpoint at all).
POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def kept() -> tuple[tuple[str, ...], str] | None:
    """What every layer keeps for its backward pass in the enclosing trace (names, memory; see
    :class:`meshpar.sharding.tracing.Trace`'s ``keep``), or None: model.remat decides."""
    return tracing.current().keep


def named_policy(names: Sequence[str], memory: str) -> Callable[..., bool]:
    """The jax.checkpoint policy keeping `names` in `memory` (``pinned_host`` or ``device``)."""
    if memory == "device":
        return jax.checkpoint_policies.save_only_these_names(*names)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names), offload_src="device", offload_dst=memory
    )


def checkpointed(fn: Callable, remat: str, *, in_scan: bool) -> Callable:
    """`fn` (one layer) under ``model.remat``'s policy.

    `in_scan`: `fn` runs as the body of a ``lax.scan``. There XLA cannot merge the backward
    pass's recomputation with the forward pass (one loop iteration holds only one of them), so
    jax's CSE barriers are left out; an unrolled layer needs them, or XLA would reuse the forward
    values and keep them alive after all.
    """
    override = kept()
    if override is not None:
        return jax.checkpoint(fn, policy=named_policy(*override), prevent_cse=not in_scan)
    if remat == "none":
        return fn
    return jax.checkpoint(fn, policy=POLICIES[remat], prevent_cse=not in_scan)
