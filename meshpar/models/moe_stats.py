"""The statistics of the decoder's MoE layers (:mod:`meshpar.models.moe`) as its layer loop
hands them back, and the figures the loss and the metrics take from them.

Every value an MoE layer reports is a mean over its tokens but one: the router z-loss (mean
``logsumexp(logits)²``) and the share of assignments dropped (capacity dispatch drops within
groups of tokens, and a batch's share is the mean of its groups') are means; the Switch
load-balancing loss ``E · Σ_e f_e · p_e`` is a product of two means, ``f_e`` (the share of the
assignments routed to expert e) and ``p_e`` (its mean router probability). Where the stack runs
as a pipeline (:mod:`meshpar.sharding.stages`) each layer sees one microbatch at a time, and the
mean of the microbatches' losses is not the batch's. So the loop carries the factors
(:func:`factors`, means again), which average over the equally sized microbatches to the
batch's, and :func:`finish` forms the loss of them after the loop: the same value with or
without a stage axis.

Under a pipeline, capacity dispatch must route the same groups of tokens as without
microbatches (:func:`check`), so that the same tokens are dropped under every layout. A microbatch
takes every M-th sequence of the batch (:func:`meshpar.sharding.stages.split_microbatches`),
so a routing group spanning sequences would hold other tokens in a microbatch, and other
tokens would be dropped: each group must lie within one sequence.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from meshpar.configuration.schema import ConfigError
from meshpar.models import moe as moe_lib
from meshpar.sharding import stages, tracing


def factors(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """An MoE layer's values as the layer loop carries them: `stats` of :func:`meshpar.models.moe.moe`
    with the load-balancing loss left as its factors ``share`` (f) and ``probs`` (p), ``[experts]`` each."""
    return {name: stats[name] for name in ("share", "probs", "z", "dropped")}


def finish(values: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The layer loop's values (:func:`factors`, each ``[moe layers, ...]``) → each MoE layer's
    ``balance`` (``E · Σ_e f_e · p_e``, f carrying no gradient: counts), ``z`` and ``dropped``."""
    share, probs = values["share"], values["probs"]
    balance = share.shape[-1] * jnp.sum(share * probs, axis=-1)
    return {"balance": balance, "z": values["z"], "dropped": values["dropped"]}


def problem(cfg: Any, sched: stages.Schedule, rows: int, length: int) -> tuple[str, str] | None:
    """(config key, what is wrong) when capacity dispatch would route other groups of tokens
    in the microbatches of the pipeline `sched` than in a batch of `rows` sequences of `length`
    tokens (see the module docstring), else None."""
    if cfg.moe_dispatch != "capacity" or sched.microbatches == 1:
        return None
    group = moe_lib.group_size(cfg, rows * length)
    if length % group:
        return "model.moe_group_size", (
            f"{cfg.moe_group_size}: routing groups of {group} of the batch's {rows}×{length} tokens span sequences, "
            f"and each of the {sched.microbatches} microbatches of layers:{sched.axis} takes one sequence in "
            f"{sched.microbatches}, so its groups would hold other tokens; use a group size that "
            f"divides the sequence length {length}"
        )
    return None


def check(cfg: Any, x: jax.Array) -> None:
    """Raise :func:`problem`'s ConfigError for the stack's input ``x [batch, length, embed]``
    under the active pipeline (none: nothing to check). `x` has the batch's shape, or one
    device's where the trace is at one device's shapes (its batch split undone here)."""
    sched = stages.active()
    if sched is None:
        return
    splits = tracing.current().splits or {}
    found = problem(cfg, sched, x.shape[0] * max(splits.get("batch", 1), 1), x.shape[1])
    if found:
        raise ConfigError(*found)
