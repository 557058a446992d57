"""Multi-layer perceptron classifier, after Mesh TensorFlow's mnist example.

``[batch, pixels] → hidden → … → [batch, classes]``. Parameters and activations are named in
logical dims only: the first hidden layer is ``hidden``, further ones ``hidden_2``,
``hidden_3``… (a weight ``[hidden, hidden]`` could not be split on one mesh axis twice, so
consecutive layers need distinct names; ``hidden:model`` then gives the Megatron pattern of a
column-split layer followed by a row-split one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshpar.layout import constrain


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    name: Literal["mlp"] = "mlp"
    # Widths of the hidden layers, in order; their dims are named hidden, hidden_2, ...
    hidden: tuple[int, ...] = dataclasses.field(default=(512,), metadata={"min": 1})
    # Output classes ("classes" dim); must match the data's labels.
    num_classes: int = dataclasses.field(default=10, metadata={"min": 2})
    activation: Literal["relu", "gelu", "tanh"] = "relu"


def hidden_dim(i: int) -> str:
    return "hidden" if i == 0 else f"hidden_{i + 1}"


class Dense(nnx.Module):
    """``y = x @ kernel + bias`` with the kernel named ``(d_in, d_out)``."""

    def __init__(self, d_in: int, d_out: int, dims: tuple[str, str], *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), jnp.float32), dims=dims)
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32), dims=dims[1:])

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...] + self.bias[...]


class MLP(nnx.Module):
    def __init__(self, cfg: MLPConfig, num_features: int, *, rngs: nnx.Rngs):
        dims = ["pixels", *(hidden_dim(i) for i in range(len(cfg.hidden))), "classes"]
        widths = [num_features, *cfg.hidden, cfg.num_classes]
        self.dims = tuple(dims)
        self.layers = nnx.List(
            [Dense(widths[i], widths[i + 1], (dims[i], dims[i + 1]), rngs=rngs) for i in range(len(widths) - 1)]
        )
        self.activation = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "tanh": jnp.tanh}[cfg.activation]

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x.reshape(x.shape[0], -1), ("batch", "pixels"))  # [batch, pixels]
        for layer, dim in zip(self.layers[:-1], self.dims[1:-1]):
            x = constrain(self.activation(layer(x)), ("batch", dim))  # [batch, hidden_i]
        return constrain(self.layers[-1](x), ("batch", "classes"))  # [batch, classes]

    def loss(self, batch: dict[str, jax.Array], rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        logits = self(batch["inputs"])
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
