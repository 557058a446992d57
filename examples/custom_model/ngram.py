"""An n-gram MLP language model, written outside meshpar as a model family of its own.

Each position predicts the next token from the ``context`` tokens up to it (the first positions
see zeros before the window's start): their embeddings, concatenated, a hidden layer, back to
``embed``, then logits over the vocabulary. Shapes in logical dims::

    tokens [batch, length + 1] → inputs, targets [batch, length]
    inputs → [batch, length, context, embed] → hidden [batch, length, hidden]
           → [batch, length, embed] → logits [batch, length, vocab]

The dims are all meshpar needs to split it: ``layout: batch:data; hidden:model; vocab:model``
splits the hidden layer Megatron-style (column-split in, row-split out) and the output layer
over the vocabulary; ``param_layout: embed:data`` shards every weight over the data axis (FSDP).

Two families of the same model (``model.name`` picks one):

* :data:`FAMILY` gives its FLOPs, tokens, split dims and FSDP dims, and its traits (the one
  setting other code reads, its vocabulary), and leaves the other planner parts out (it has no
  layer loop, so no ``num_layers``, ``layer_flops``, ``activation_names``; and no
  ``activation_all_reduces``): the plan says what it cannot give for them.
* :data:`BARE` gives only what is required (config, build, fields): it trains all the same, and
  the run and the plan say which figures they cannot give (MFU, model FLOPs, model-axis
  candidates); its traits are read by the conventional field names (``vocab_size`` here).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshpar.models import Family, Traits, constrain, use


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    # The family: model.name as written in the YAML (an import path); meshpar fills it in.
    name: str = "examples.custom_model.ngram:FAMILY"
    # Token ids the model embeds and predicts ("vocab" dim); bytes: 256.
    vocab_size: int = dataclasses.field(default=256, metadata={"min": 2})
    # Tokens each prediction sees: the one at the position and those before it ("context" dim).
    context: int = dataclasses.field(default=4, metadata={"min": 1})
    # Width of each token's embedding ("embed" dim).
    embed: int = dataclasses.field(default=32, metadata={"min": 1})
    # Width of the hidden layer ("hidden" dim).
    hidden: int = dataclasses.field(default=256, metadata={"min": 1})


class Ngram(nnx.Module):
    def __init__(self, cfg: NgramConfig, *, rngs: nnx.Rngs):
        normal = nnx.initializers.normal(0.02)
        lecun = nnx.initializers.lecun_normal(in_axis=(0, 1), out_axis=2)
        v, c, e, h = cfg.vocab_size, cfg.context, cfg.embed, cfg.hidden
        self.context = c
        self.table = nnx.Param(normal(rngs.params(), (v, e)), dims=("vocab", "embed"))
        self.w_in = nnx.Param(lecun(rngs.params(), (c, e, h)), dims=("context", "embed", "hidden"))
        self.b_in = nnx.Param(jnp.zeros((h,)), dims=("hidden",))
        self.w_out = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (h, e)), dims=("hidden", "embed"))
        self.b_out = nnx.Param(jnp.zeros((e,)), dims=("embed",))
        self.w_vocab = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (e, v)), dims=("embed", "vocab"))
        self.b_vocab = nnx.Param(jnp.zeros((v,)), dims=("vocab",))

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs [batch, length]`` (int32 ids) → logits ``[batch, length, vocab]``."""
        table = use(self.table[...], self.table.dims)
        length = inputs.shape[1]
        # The token j places back from each position (0 before the window's start), for j < context.
        padded = jnp.pad(inputs, ((0, 0), (self.context - 1, 0)))
        starts = [self.context - 1 - j for j in range(self.context)]
        shifted = jnp.stack([padded[:, s : s + length] for s in starts], -1)  # [batch, length, context]
        x = constrain(jnp.take(table, shifted, axis=0), ("batch", "length", "context", "embed"))
        w_in, b_in = use(self.w_in[...], self.w_in.dims), use(self.b_in[...], self.b_in.dims)
        h = constrain(jax.nn.gelu(jnp.einsum("blce,ceh->blh", x, w_in) + b_in), ("batch", "length", "hidden"))
        w_out, b_out = use(self.w_out[...], self.w_out.dims), use(self.b_out[...], self.b_out.dims)
        y = constrain(h @ w_out + b_out, ("batch", "length", "embed"))  # a row-split matmul: summed over model
        w_vocab, b_vocab = use(self.w_vocab[...], self.w_vocab.dims), use(self.b_vocab[...], self.b_vocab.dims)
        return constrain(y @ w_vocab + b_vocab, ("batch", "length", "vocab"))

    def loss(self, batch: dict[str, jax.Array], rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy (nats) and accuracy of ``batch["tokens"] [batch, length + 1]``."""
        tokens = constrain(batch["tokens"], ("batch", None))  # the window dim is never split
        inputs = constrain(tokens[:, :-1].astype(jnp.int32), ("batch", "length"))
        targets = constrain(tokens[:, 1:].astype(jnp.int32), ("batch", "length"))
        logits = self(inputs).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return loss, {"accuracy": (logits.argmax(-1) == targets).mean()}


def build(cfg: NgramConfig, element_spec: dict, rngs: nnx.Rngs) -> Ngram:
    """The model for data whose ``tokens`` are windows of ``length + 1`` ids (its size does not
    depend on the length)."""
    return Ngram(cfg, rngs=rngs)


def tokens_per_example(cfg: NgramConfig, element_spec: dict) -> int:
    """Predicted tokens of one window: ``length`` of its ``length + 1``."""
    (window,), _ = element_spec["tokens"]
    return window - 1


def flops_per_example(cfg: NgramConfig, element_spec: dict) -> float:
    """Training FLOPs of one window: 6 per weight per predicted token (2 forward, 4 backward);
    the embedding lookup is a gather (no FLOPs), biases ignored."""
    weights = cfg.context * cfg.embed * cfg.hidden + cfg.hidden * cfg.embed + cfg.embed * cfg.vocab_size
    return float(6 * weights * tokens_per_example(cfg, element_spec))


def traits(cfg: NgramConfig) -> Traits:
    """What meshpar reads of the config: its vocabulary (checked against the tokenizer's and the
    corpus's). No layer stack, remat, dtype or length limit: each trait's default says so."""
    return Traits(vocab_size=cfg.vocab_size, keys={"vocab_size": "vocab_size"})


FIELDS = {"tokens": (1, "iu")}  # [length + 1] token ids: the model cuts inputs and targets on device

FAMILY = Family(
    config=NgramConfig,
    build=build,
    fields=FIELDS,
    flops_per_example=flops_per_example,
    tokens_per_example=tokens_per_example,
    # A model-axis split: the hidden layer (column then row) and the output's vocabulary.
    split_dims=lambda cfg: ("hidden", "vocab"),
    # FSDP: embed is a dim of every weight, so it shards them all; then hidden, then vocab.
    fsdp_dims=lambda cfg, spec: ("embed", "hidden", "vocab"),
    traits=traits,
    # Left out: activation_all_reduces, num_layers, layer_flops, activation_names (no layer loop).
)

# The same model with only the required parts: no FLOPs (no MFU), no planner parts.
BARE = Family(config=NgramConfig, build=build, fields=FIELDS)
