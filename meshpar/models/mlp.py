"""Multi-layer perceptron classifier, after Mesh TensorFlow's mnist example.

``[batch, pixels] → hidden → … → [batch, classes]``. Parameters and activations are named in
logical dims only: the first hidden layer is ``hidden``, further ones ``hidden_2``,
``hidden_3``… (a weight ``[hidden, hidden]`` could not be split on one mesh axis twice, so
consecutive layers need distinct names; ``hidden:model`` then gives the Megatron pattern of a
column-split layer followed by a row-split one).

``param_dtype`` / ``compute_dtype``: parameters (and so the optimizer's moments) are stored in
one, every layer computes in the other, and the logits are cast to float32 for the softmax
cross-entropy. ``remat`` (``none | full | dots``, :mod:`meshpar.models.remat`) applies to each
hidden layer, whose values are tagged for name-based policies: ``layer_in`` (the layer's input)
and ``pre_activation`` (its matmul's output ``[batch, hidden_i]``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshpar.models import remat as remat_lib
from meshpar.models.contract import Traits
from meshpar.sharding.layout import constrain, use


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    name: Literal["mlp"] = "mlp"  # the family: a multi-layer perceptron classifier
    # Widths of the hidden layers, in order; their dims are named hidden, hidden_2, ...
    hidden: tuple[int, ...] = dataclasses.field(default=(512,), metadata={"min": 1})
    # Output classes ("classes" dim); must match the data's labels.
    num_classes: int = dataclasses.field(default=10, metadata={"min": 2})
    activation: Literal["relu", "gelu", "tanh"] = "relu"  # after each hidden layer
    # Dtype the parameters are stored (and the optimizer's moments kept) in, and the dtype the
    # layers compute in: bfloat16 compute with float32 parameters is mixed precision. The loss
    # (softmax cross-entropy) is float32 regardless.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # What each hidden layer keeps for the backward pass (meshpar.models.remat): none =
    # everything; full = only its input, recomputing the layer; dots = its matmul's output.
    remat: Literal["none", "full", "dots"] = "none"


def hidden_dim(i: int) -> str:
    return "hidden" if i == 0 else f"hidden_{i + 1}"


class Dense(nnx.Module):
    """``y = x @ kernel + bias`` with the kernel named ``(d_in, d_out)``."""

    def __init__(self, d_in: int, d_out: int, dims: tuple[str, str], *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        # Drawn in float32 and rounded, so a bfloat16 model starts from the float32 one's values.
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), jnp.float32).astype(param_dtype), dims=dims)
        self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype), dims=dims[1:])
        self.compute_dtype = compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.compute_dtype
        # Each weight placed by the activation layout where it is used (gathered here, in the
        # compute dtype, when a param_layout splits it further).
        kernel, bias = (use(w[...], w.dims, dt) for w in (self.kernel, self.bias))
        return x.astype(dt) @ kernel + bias


class MLP(nnx.Module):
    def __init__(self, cfg: MLPConfig, num_features: int, *, rngs: nnx.Rngs):
        dims = ["pixels", *(hidden_dim(i) for i in range(len(cfg.hidden))), "classes"]
        widths = [num_features, *cfg.hidden, cfg.num_classes]
        dtypes = {"param_dtype": jnp.dtype(cfg.param_dtype), "compute_dtype": jnp.dtype(cfg.compute_dtype)}
        self.dims = tuple(dims)
        self.layers = nnx.List(
            [
                Dense(widths[i], widths[i + 1], (dims[i], dims[i + 1]), **dtypes, rngs=rngs)
                for i in range(len(widths) - 1)
            ]
        )
        self.activation = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "tanh": jnp.tanh}[cfg.activation]
        self.compute_dtype = dtypes["compute_dtype"]
        self.remat = cfg.remat

    def __call__(self, x: jax.Array) -> jax.Array:
        """``inputs [batch, ...]`` → logits ``[batch, classes]`` in the compute dtype."""
        x = constrain(x.reshape(x.shape[0], -1).astype(self.compute_dtype), ("batch", "pixels"))  # [batch, pixels]
        for layer, dim in zip(self.layers[:-1], self.dims[1:-1]):

            def hidden(x, layer=layer, dim=dim):  # one hidden layer, under model.remat
                pre = checkpoint_name(layer(checkpoint_name(x, "layer_in")), "pre_activation")
                return constrain(self.activation(pre), ("batch", dim))

            x = remat_lib.checkpointed(hidden, self.remat, in_scan=False)(x)  # [batch, hidden_i]
        return constrain(self.layers[-1](x), ("batch", "classes"))  # [batch, classes]

    def loss(self, batch: dict[str, jax.Array], rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        logits = self(batch["inputs"]).astype(jnp.float32)  # the softmax and the loss in float32
        labels = batch["targets"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        accuracy = (logits.argmax(-1) == labels).mean()
        return loss, {"accuracy": accuracy}


def build(cfg: MLPConfig, element_spec: dict, rngs: nnx.Rngs) -> MLP:
    shape, _ = element_spec["inputs"]
    return MLP(cfg, math.prod(shape), rngs=rngs)


def flops_per_example(cfg: MLPConfig, element_spec: dict) -> float:
    """Training FLOPs of one example: 6 per weight (2 forward, 4 backward); biases ignored."""
    shape, _ = element_spec["inputs"]
    widths = [math.prod(shape), *cfg.hidden, cfg.num_classes]
    return float(6 * sum(a * b for a, b in zip(widths, widths[1:])))


# ---------------------------------------------------------------------------------------------
# What the planner reads (meshpar.models.Family)

# The MLP has no layer loop, so offload.activations does not apply to it (the config refuses it).
ACTIVATION_NAMES: dict[str, tuple[str, ...]] = {"none": ()}


def _widths(cfg: MLPConfig, element_spec: dict) -> list[int]:
    shape, _ = element_spec["inputs"]
    return [math.prod(shape), *cfg.hidden, cfg.num_classes]


def split_dims(cfg: MLPConfig) -> tuple[str, ...]:
    """The first hidden layer's dim: column-split, with the next layer row-split (Megatron)."""
    return (hidden_dim(0),)


def fsdp_dims(cfg: MLPConfig, element_spec: dict) -> tuple[str, ...]:
    """Every dim, by the weight elements it covers, most first (ties: input side first): a dim
    covers the kernels and the bias it names. Taking them in this order, each unless it shares
    a kernel with one taken, shards the most bytes."""
    dims = ["pixels", *(hidden_dim(i) for i in range(len(cfg.hidden))), "classes"]
    widths = _widths(cfg, element_spec)
    covered = [0] * len(dims)
    for i in range(len(dims) - 1):  # kernel [dims[i], dims[i + 1]] and bias [dims[i + 1]]
        covered[i] += widths[i] * widths[i + 1]
        covered[i + 1] += widths[i] * widths[i + 1] + widths[i + 1]
    order = sorted(range(len(dims)), key=lambda i: -covered[i])
    return tuple(dims[i] for i in order)


def activation_all_reduces(cfg: MLPConfig, element_spec: dict, rows: int, dims: tuple[str, ...]) -> tuple[int, int]:
    """(count, elements each) of the all-reduces over the model axis per step, for `rows` batch
    rows per device with `dims` split over it: one after each split hidden layer, where the
    row-split layer after it sums its output ``[rows, next width]``."""
    widths = _widths(cfg, element_spec)
    split = [i for i in range(len(cfg.hidden)) if hidden_dim(i) in dims]
    return len(split), rows * max((widths[i + 2] for i in split), default=0)


def traits(cfg: MLPConfig) -> Traits:
    """What other code reads of `cfg` (:class:`meshpar.models.contract.Traits`), each set by the
    field of the same name. No ``stack_layers``: each hidden layer's parameters have dims of
    their own (``hidden``, ``hidden_2``, ...), so no stack for a stage axis to split."""
    values = {"compute_dtype": cfg.compute_dtype, "param_dtype": cfg.param_dtype, "remat": cfg.remat,
              "num_classes": cfg.num_classes}  # fmt: skip
    return Traits(**values, keys={trait: trait for trait in values})


def num_layers(cfg: MLPConfig) -> int:
    """The hidden layers (each one checkpointed call under ``remat``); the output layer is not one."""
    return len(cfg.hidden)


def layer_flops(cfg: MLPConfig, element_spec: dict) -> tuple[float, ...]:
    """Training FLOPs of one example in each hidden layer: 6 per weight of its kernel."""
    widths = _widths(cfg, element_spec)
    return tuple(float(6 * widths[i] * widths[i + 1]) for i in range(len(cfg.hidden)))
