"""The mixture-of-experts fields of a decoder family's config (:mod:`meshpar.models.moe`): how many
experts, how tokens are routed to them and dispatched, and the router's losses.

:class:`MoEFields` is a dataclass base: a family's config lists its own fields in a base of its
own and takes these after them (``class LlamaConfig(MoEFields, RunSettings, _LlamaFields)``: a dataclass puts
the fields of its last base first), so ``model.moe_*`` keys keep their place at the end of the
section. :func:`meshpar.config_reference.field_docs` reads their comments here.
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class MoEFields:
    # Mixture of experts (meshpar.models.moe): experts per MoE layer, the "experts" dim (0 =
    # every MLP dense); a layout rule experts:<axis> splits them, and the axis must divide them.
    moe_experts: int = dataclasses.field(default=0, metadata={"min": 0})
    # Experts each token is routed to, 1 <= k <= moe_experts: top-k of the router's softmax,
    # renormalised over the k when k > 1 (Mixtral), the probability itself when k = 1 (Switch).
    moe_top_k: int = dataclasses.field(default=2, metadata={"min": 1})
    # Every moe_every-th layer is an MoE layer (the last of each group of moe_every; 1 = all);
    # must divide n_layers. The layer loop runs over those groups.
    moe_every: int = dataclasses.field(default=1, metadata={"min": 1})
    # capacity = GShard/Switch: each expert takes at most ceil(moe_capacity_factor *
    # group * k / moe_experts) tokens of each group of moe_group_size, the rest are dropped
    # (counted in the metrics); dropless = every token runs (sorted by expert, ragged_dot;
    # with the experts split, each device runs its own on the tokens it gathers).
    moe_dispatch: Literal["capacity", "dropless"] = "capacity"
    moe_capacity_factor: float = dataclasses.field(default=1.25, metadata={"min": 0.0})  # > 0
    # Tokens per routing group (at most: the largest divisor of batch x length not above it).
    moe_group_size: int = dataclasses.field(default=1024, metadata={"min": 1})
    moe_aux_coef: float = dataclasses.field(default=0.01, metadata={"min": 0.0})  # x the load-balancing loss
    moe_z_coef: float = dataclasses.field(default=0.001, metadata={"min": 0.0})  # x the router z-loss
