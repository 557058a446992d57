"""Hugging Face's Llama and Mixtral tensor names and layouts ↔ meshpar's parameters, both ways.

A ``torch.nn.Linear`` weight is ``[out, in]``; meshpar's is ``[in, out]`` with the heads split
out, and every block parameter is stacked along a leading ``layers`` dim (a Mixtral's experts
along ``layers`` and then ``experts``: expert j of layer i is the tensor at ``(i, j)`` of its
stack). The tables, name by name: docs/huggingface.md ("Names and layouts") and docs/moe.md
("Mixtral checkpoints").

transformers 5 holds a Mixtral's experts fused (``mlp.experts.gate_up_proj [E, 2f, d]``,
``mlp.experts.down_proj [E, d, f]``) and may write them so; those are read too, each expert's
block of a fused tensor read on its own (its bytes are contiguous: :attr:`Tensor.part`), so every
byte is still read once and the host holds one expert's matrix at a time. A folder is one
spelling or the other (:func:`fused`); exports write the unfused one, which both versions load.

Splitting a transposed axis is a view, so each tensor is converted with one copy, which also
casts it to the parameter dtype (none at all for a tensor already in meshpar's layout and
dtype). Names that hold nothing meshpar needs are skipped, as transformers skips them: the
rotary ``inv_freq`` buffers older conversions saved, and ``lm_head.weight`` when the embeddings
are tied.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

# (Hugging Face name inside layer i, meshpar block parameter, leading dims that are W's input)
ATTENTION = (
    ("input_layernorm.weight", "attn_norm", None),
    ("self_attn.q_proj.weight", "wq", 1),
    ("self_attn.k_proj.weight", "wk", 1),
    ("self_attn.v_proj.weight", "wv", 1),
    ("self_attn.o_proj.weight", "wo", 2),
    ("post_attention_layernorm.weight", "mlp_norm", None),
)
MLP = (("mlp.gate_proj.weight", "w_gate", 1), ("mlp.up_proj.weight", "w_up", 1), ("mlp.down_proj.weight", "w_down", 1))
LAYER = ATTENTION + MLP  # a Llama layer's
# A Mixtral layer's mixture of experts (after its attention's): the router, then expert j's.
ROUTER = {False: "block_sparse_moe.gate.weight", True: "mlp.gate.weight"}  # by fused
EXPERT = (("w1", "experts_gate"), ("w3", "experts_up"), ("w2", "experts_down"))
FUSED = {"experts_gate": "gate_up_proj", "experts_up": "gate_up_proj", "experts_down": "down_proj"}
_SKIPPED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_FUSED = re.compile(r"^model\.layers\.\d+\.mlp\.(gate\.weight|experts\.(gate_up_proj|down_proj))$")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor and where it lives in meshpar."""

    hf: str  # Hugging Face's name
    param: str  # meshpar's parameter path, e.g. blocks/wq
    # Its index in the parameter's leading stack dims: (layer,), or (layer, expert) in the
    # [layers, experts, ...] stacks of a mixture of experts (None: not stacked).
    layer: tuple[int, ...] | None
    shape: tuple[int, ...]  # meshpar's shape (one layer's, or one expert's, for a stacked parameter)
    n_in: int | None  # meshpar's leading dims that are W's input dim (None: W as it is)
    # Where a stored tensor holds several (transformers 5's fused experts): that tensor's shape,
    # and which block of it, the stored tensor read as [blocks, *hf_shape], this one is.
    stored: tuple[int, ...] | None = None
    part: int | None = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.n_in is None:
            return self.shape
        return math.prod(self.shape[self.n_in :]), math.prod(self.shape[: self.n_in])

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the stored tensor that holds this one."""
        return self.hf_shape if self.stored is None else self.stored

    def where(self) -> str:
        if self.layer is None:
            return self.param
        return f"{self.param} layer {self.layer[0]}" + "".join(f" expert {j}" for j in self.layer[1:])

    def to_meshpar(self, w: np.ndarray, dtype) -> np.ndarray:
        """Hugging Face's `w` → meshpar's layout, in `dtype`, C-ordered: `w` itself where that
        is already so (no second copy of the tensor), else a new array."""
        if self.n_in is None and w.dtype == np.dtype(dtype) and w.flags.c_contiguous:
            return w
        view = w if self.n_in is None else w.T.reshape(self.shape)
        out = np.empty(self.shape, dtype)
        np.copyto(out, view, casting="unsafe")  # the cast to the parameter dtype, in the same copy
        return out

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """meshpar's `x` → Hugging Face's layout (a view; the writer makes it contiguous)."""
        if self.n_in is None:
            return x
        return x.reshape(math.prod(self.shape[: self.n_in]), -1).T


def kind(cfg) -> str:
    """What Hugging Face calls a model of `cfg`: a Mixtral where it has experts, else a Llama."""
    return "Mixtral" if cfg.moe_experts else "Llama"


def tensors(cfg, fused: bool = False) -> list[Tensor]:
    """Every tensor of a Llama of `cfg` (a LlamaConfig; a Mixtral where it has experts, in
    every layer), in Hugging Face's order; a Mixtral's experts in transformers 5's fused
    spelling where `fused`."""
    d, h, kvh, k, f, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_ff, cfg.vocab_size
    shapes = {
        "attn_norm": (d,), "wq": (d, h, k), "wk": (d, kvh, k), "wv": (d, kvh, k), "wo": (h, k, d),
        "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }  # fmt: skip
    if cfg.moe_experts and cfg.moe_every != 1:
        raise ValueError(f"a Mixtral has experts in every layer; this model in every {cfg.moe_every}th (moe_every)")
    out = [Tensor("model.embed_tokens.weight", "embed", None, (v, d), None)]
    for i in range(cfg.n_layers):
        for hf, param, n_in in ATTENTION if cfg.moe_experts else LAYER:
            out.append(Tensor(f"model.layers.{i}.{hf}", f"blocks/{param}", (i,), shapes[param], n_in))
        if cfg.moe_experts:
            out += _experts(cfg, i, fused)
    out.append(Tensor("model.norm.weight", "final_norm", None, (d,), None))
    if not cfg.tie_embeddings:
        out.append(Tensor("lm_head.weight", "unembed", None, (d, v), 1))
    return out


def _experts(cfg, i: int, fused: bool) -> list[Tensor]:
    """Layer i's router and experts (see the module docstring)."""
    d, f, e = cfg.d_model, cfg.d_ff, cfg.moe_experts
    at = f"model.layers.{i}."
    out = [Tensor(at + ROUTER[fused], "blocks/router", (i,), (d, e), 1)]
    shapes = {"experts_gate": (d, f), "experts_up": (d, f), "experts_down": (f, d)}
    if not fused:
        for j in range(e):
            for w, param in EXPERT:
                out.append(
                    Tensor(f"{at}block_sparse_moe.experts.{j}.{w}.weight", f"blocks/{param}", (i, j), shapes[param], 1)
                )
        return out
    stored = {"gate_up_proj": (e, 2 * f, d), "down_proj": (e, d, f)}
    for param, name in FUSED.items():  # the gate_up blocks alternate: expert j's gate is 2j, its up 2j + 1
        for j in range(e):
            part = j if name == "down_proj" else 2 * j + (param == "experts_up")
            out.append(
                Tensor(f"{at}mlp.experts.{name}", f"blocks/{param}", (i, j), shapes[param], 1, stored[name], part)
            )
    return out


def fused(names) -> bool:
    """Whether a folder's tensor `names` spell a Mixtral's experts as transformers 5 holds them."""
    return any(_FUSED.match(n) for n in names)


def skipped(name: str, cfg) -> bool:
    """Whether a checkpoint's tensor `name` holds nothing meshpar reads (see the module docstring)."""
    return bool(_SKIPPED.match(name)) or (cfg.tie_embeddings and name == "lm_head.weight")


def by_param(entries: list[Tensor]) -> dict[str, list[Tensor]]:
    """meshpar parameter path → its tensors (one, or one per stacked slot in stack order)."""
    out: dict[str, list[Tensor]] = {}
    for t in entries:
        out.setdefault(t.param, []).append(t)
    return {param: sorted(group, key=lambda t: t.layer or ()) for param, group in out.items()}
