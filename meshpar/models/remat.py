"""Rematerialisation: what each layer keeps for the backward pass, chosen by ``model.remat``.

meshpar's own three settings: ``none`` (no ``jax.checkpoint``: the backward reads every
intermediate the forward made), ``full`` (``nothing_saveable``: a layer keeps only its input
and runs its forward again) and ``dots`` (``dots_with_no_batch_dims_saveable``: the outputs of
its matmuls against weights, never attention's ``[length, length]`` scores). Besides them the
decoder families take the policies MaxText's ``remat_policy`` and Paxml's
``AutodiffCheckpointType`` name, each defined as its source defines it (:data:`POLICIES`, the
source cited beside each), and ``custom``: the names ``model.remat_save`` lists. The table of
what each keeps: docs/models.md, "Remat policies".

Most of those policies pick values by name: the models tag the values a layer may keep with
``jax.ad_checkpoint.checkpoint_name`` (each family lists its tags: ``Family.checkpoint_names``),
MaxText's and Paxml's names on the equivalent values of meshpar's layers. A name a policy lists
and the model does not tag keeps nothing (MaxText's ``kv_proj``, of multi-head latent attention).

The policy applies per layer, around the one function that runs a layer, inside the layer scan
(the values a layer keeps are then stacked over ``layers``) or around each unrolled layer. In
straight-line layers (``scan_layers: false``) XLA:CPU schedules the recomputation early and
keeps about what ``none`` keeps, so on CPU a scan is not unrolled by default when ``remat`` is on.

A step may replace ``model.remat``'s policy for the layers it traces with one that picks by
name (the trace's ``keep``, :class:`meshpar.sharding.tracing.Trace`): host offload of
activations (``offload.activations``, :mod:`meshpar.sharding.offload`) keeps the named values
in pinned host memory, and the same names kept in device memory are its reference. The models
never see the setting; like the layout, it is read at trace time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax

from meshpar.sharding import tracing

HOST = "pinned_host"  # where an offloading policy keeps its names (MaxText's offload_dst)
_cp = jax.checkpoint_policies

# The sources, cited by each policy below (repository, path, function).
MAXTEXT = "AI-Hypercomputer/maxtext, src/maxtext/layers/decoders.py, Decoder.get_remat_policy"
MAXTEXT_OFFLOAD = "AI-Hypercomputer/maxtext, src/maxtext/utils/maxtext_utils.py, get_save_and_offload_names"
PAXML = "google/praxis, praxis/layers/checkpoint_policy.py, custom_policy"


@dataclasses.dataclass(frozen=True)
class Policy:
    """One ``model.remat`` setting: the tags kept in device memory (`saves`) and in pinned host
    memory (`offloads`), or a jax built-in policy (`base`), and where the definition comes from."""

    saves: tuple[str, ...] = ()
    offloads: tuple[str, ...] = ()
    base: Callable[..., bool] | None = None
    source: str = "meshpar"
    checkpoint: bool = True  # False: no jax.checkpoint at all (none)

    def jax_policy(self, save: Sequence[str] = ()) -> Callable[..., bool]:
        """The ``jax.checkpoint`` policy; `save`: ``custom``'s names (``model.remat_save``)."""
        if self.base is not None:
            return self.base
        saves = tuple(n for n in (*self.saves, *save) if n not in INPUTS)
        if self.offloads:
            return _cp.save_and_offload_only_these_names(
                names_which_can_be_saved=list(saves), names_which_can_be_offloaded=list(self.offloads),
                offload_src="device", offload_dst=HOST,
            )  # fmt: skip
        return _cp.save_only_these_names(*saves)


# The names the models give a layer's input. A checkpoint keeps its input whatever the policy,
# so keeping one of these names would keep nothing more, but jax would keep the named value as
# a second copy: device policies leave them out (Paxml's SAVE_ITERATION_INPUT keeps what
# SAVE_NOTHING keeps; MaxText's custom list may name decoder_layer_input).
INPUTS = frozenset({"iteration_input", "decoder_layer_input", "layer_in"})

# MaxText's names for the attention projections (minimal_policy's list and the save_* policies'):
# query_proj, key_proj, value_proj (separate projections), kv_proj (multi-head latent attention's),
# qkv_proj (the fused projection).
_QKV = ("query_proj", "value_proj", "key_proj", "kv_proj", "qkv_proj")
# MaxText's minimal_policy: every matmul's output but attention's context.
_MINIMAL = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")

POLICIES: dict[str, Policy] = {
    # meshpar's own
    "none": Policy(checkpoint=False),
    "full": Policy(base=_cp.nothing_saveable),  # MaxText's full too: nn.remat with policy None
    "dots": Policy(base=_cp.dots_with_no_batch_dims_saveable),
    # MaxText: AI-Hypercomputer/maxtext, src/maxtext/layers/decoders.py, Decoder.get_remat_policy
    "minimal": Policy(saves=_MINIMAL, source=MAXTEXT),
    "minimal_with_context": Policy(saves=(*_MINIMAL, "context"), source=MAXTEXT),
    "minimal_flash": Policy(saves=(*_MINIMAL, "context"), source=MAXTEXT),  # MaxText: a deprecated minimal_with_context
    "save_dot_with_context_except_mlp": Policy(saves=(*_QKV, "context", "out_proj"), source=MAXTEXT),
    "save_dot_except_mlpwi": Policy(saves=(*_QKV, "out_proj", "mlpwo"), source=MAXTEXT),
    "save_dot_except_mlp": Policy(saves=(*_QKV, "out_proj"), source=MAXTEXT),
    "save_qkv_proj": Policy(saves=_QKV, source=MAXTEXT),
    "save_out_proj": Policy(saves=("out_proj",), source=MAXTEXT),
    # MaxText's offloading presets: AI-Hypercomputer/maxtext, src/maxtext/utils/maxtext_utils.py,
    # get_save_and_offload_names (save_and_offload_only_these_names, device -> pinned_host)
    "qkv_proj_offloaded": Policy(offloads=("query_proj", "value_proj", "key_proj", "kv_proj"), source=MAXTEXT_OFFLOAD),
    "minimal_offloaded": Policy(offloads=_MINIMAL, source=MAXTEXT_OFFLOAD),
    # MaxText's custom, its tensors_on_device: the names model.remat_save lists (no offload)
    "custom": Policy(source=MAXTEXT),
    # Paxml: google/praxis, praxis/layers/checkpoint_policy.py, custom_policy
    "SAVE_NOTHING": Policy(base=_cp.nothing_saveable, source=PAXML),
    "SAVE_EVERYTHING": Policy(base=_cp.everything_saveable, source=PAXML),
    "SAVE_DOT_ONLY": Policy(base=_cp.checkpoint_dots, source=PAXML),
    "SAVE_DOT_WITH_NO_BATCH_DIM": Policy(base=_cp.checkpoint_dots_with_no_batch_dims, source=PAXML),
    "SAVE_QKV_OUT_PROJ": Policy(saves=("combined_qkv_proj", "out_proj"), source=PAXML),
    "SAVE_QKV_OUT_PROJ_SEPARATE": Policy(saves=("query_proj", "value_proj", "key_proj", "out_proj"), source=PAXML),
    "SAVE_OUT_PROJ": Policy(saves=("out_proj",), source=PAXML),
    "SAVE_CONTEXT": Policy(saves=("context",), source=PAXML),
    "SAVE_CONTEXT_AND_OUT_PROJ": Policy(saves=("context", "out_proj"), source=PAXML),
    "SAVE_DOT_FOR_MLPERF_200B": Policy(
        saves=("combined_qkv_proj", "query_proj", "value_proj", "key_proj", "context", "out_proj"), source=PAXML
    ),
    "SAVE_ITERATION_INPUT": Policy(saves=("iteration_input",), source=PAXML),
}
NAMES = tuple(POLICIES)  # the decoder families' model.remat (the mlp takes none, full and dots)


def policy(remat: str) -> Policy:
    """The :class:`Policy` of ``model.remat`` `remat`; a setting no table lists (a family's own)
    is taken as ``full``: a checkpoint around each layer."""
    return POLICIES.get(remat, POLICIES["full"])


def offloaded(remat: str | None) -> tuple[str, ...]:
    """The tags `remat`'s policy keeps in pinned host memory (none for most)."""
    return policy(remat or "none").offloads


def kept() -> tuple[tuple[str, ...], str] | None:
    """What every layer keeps for its backward pass in the enclosing trace (names, memory; see
    :class:`meshpar.sharding.tracing.Trace`'s ``keep``), or None: model.remat decides."""
    return tracing.current().keep


def named_policy(names: Sequence[str], memory: str) -> Callable[..., bool]:
    """The jax.checkpoint policy keeping `names` in `memory` (``pinned_host`` or ``device``)."""
    if memory == "device":
        return Policy(saves=tuple(names)).jax_policy()
    return Policy(offloads=tuple(names)).jax_policy()


def checkpointed(fn: Callable, remat: str, *, in_scan: bool, save: Sequence[str] = ()) -> Callable:
    """`fn` (one layer) under ``model.remat``'s policy; `save`: ``model.remat_save`` (``custom``'s names).

    `in_scan`: `fn` runs as the body of a ``lax.scan``. There XLA cannot merge the backward
    pass's recomputation with the forward pass (one loop iteration holds only one of them), so
    jax's CSE barriers are left out; an unrolled layer needs them, or XLA would reuse the forward
    values and keep them alive after all.
    """
    override = kept()
    if override is not None:
        return jax.checkpoint(fn, policy=named_policy(*override), prevent_cse=not in_scan)
    chosen = policy(remat)
    if not chosen.checkpoint:
        return fn
    names = tuple(save) if remat == "custom" else ()
    return jax.checkpoint(fn, policy=chosen.jax_policy(names), prevent_cse=not in_scan)


def check_save(remat: str, save: Sequence[str], tagged: Sequence[str], family: str) -> str | None:
    """What is wrong with ``model.remat_save`` `save` beside ``model.remat`` `remat`, for a family
    (named `family`) whose layers tag `tagged`, or None."""
    if remat != "custom":
        return (
            f"lists the names remat custom keeps, and remat is {remat} (use custom, or no remat_save)" if save else None
        )
    if not save:
        return "remat custom keeps the names listed here, and none is listed (to keep none, use remat full)"
    for name in save:
        if name not in tagged:
            return f"{name!r} is not a name the {family} layers tag (known: {', '.join(tagged)})"
    return None
