"""Hugging Face's Llama tensor names and layouts ↔ meshpar's parameters, both ways.

A ``torch.nn.Linear`` weight is ``[out, in]``; meshpar's is ``[in, out]`` with the heads split
out, and every block parameter is stacked along a leading ``layers`` dim:

==============================================  ======================  ==========================
Hugging Face                                    meshpar                 from HF weight W
==============================================  ======================  ==========================
``model.embed_tokens.weight [vocab, d]``        ``embed``               W
``model.layers.i.input_layernorm.weight``       ``blocks/attn_norm[i]`` W
``model.layers.i.self_attn.q_proj [h·k, d]``    ``blocks/wq[i]``        Wᵀ → [d, heads, kv]
``model.layers.i.self_attn.k_proj / v_proj``    ``blocks/wk[i], wv[i]`` Wᵀ → [d, kv_heads, kv]
``model.layers.i.self_attn.o_proj [d, h·k]``    ``blocks/wo[i]``        Wᵀ → [heads, kv, d]
``model.layers.i.post_attention_layernorm``     ``blocks/mlp_norm[i]``  W
``model.layers.i.mlp.gate_proj / up_proj``      ``blocks/w_gate, w_up`` Wᵀ [d, d_ff]
``model.layers.i.mlp.down_proj [d, d_ff]``      ``blocks/w_down[i]``    Wᵀ [d_ff, d]
``model.norm.weight``                           ``final_norm``          W
``lm_head.weight [vocab, d]`` (untied only)     ``unembed``             Wᵀ [d, vocab]
==============================================  ======================  ==========================

Splitting a transposed axis is a view, so each tensor is converted with one copy, which also
casts it to the parameter dtype (none at all for a tensor already in meshpar's layout and dtype). Names a checkpoint may carry that hold nothing meshpar needs
are skipped, as transformers skips them: the rotary ``inv_freq`` buffers older conversions
saved, and ``lm_head.weight`` when the embeddings are tied (transformers ties it to the embedding).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

# (Hugging Face name inside layer i, meshpar block parameter, leading dims that are W's input)
LAYER = (
    ("input_layernorm.weight", "attn_norm", None),
    ("self_attn.q_proj.weight", "wq", 1),
    ("self_attn.k_proj.weight", "wk", 1),
    ("self_attn.v_proj.weight", "wv", 1),
    ("self_attn.o_proj.weight", "wo", 2),
    ("post_attention_layernorm.weight", "mlp_norm", None),
    ("mlp.gate_proj.weight", "w_gate", 1),
    ("mlp.up_proj.weight", "w_up", 1),
    ("mlp.down_proj.weight", "w_down", 1),
)
_SKIPPED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor and where it lives in meshpar."""

    hf: str  # Hugging Face's name
    param: str  # meshpar's parameter path, e.g. blocks/wq
    layer: int | None  # its index in the parameter's ``layers`` stack (None: not stacked)
    shape: tuple[int, ...]  # meshpar's shape (one layer's, for a stacked parameter)
    n_in: int | None  # meshpar's leading dims that are W's input dim (None: W as it is)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.n_in is None:
            return self.shape
        return math.prod(self.shape[self.n_in :]), math.prod(self.shape[: self.n_in])

    def where(self) -> str:
        return self.param + (f" layer {self.layer}" if self.layer is not None else "")

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


def tensors(cfg) -> list[Tensor]:
    """Every tensor of a Llama of `cfg` (a LlamaConfig), in Hugging Face's order."""
    d, h, kvh, k, f, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_ff, cfg.vocab_size
    shapes = {
        "attn_norm": (d,), "wq": (d, h, k), "wk": (d, kvh, k), "wv": (d, kvh, k), "wo": (h, k, d),
        "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }  # fmt: skip
    out = [Tensor("model.embed_tokens.weight", "embed", None, (v, d), None)]
    for i in range(cfg.n_layers):
        for hf, param, n_in in LAYER:
            out.append(Tensor(f"model.layers.{i}.{hf}", f"blocks/{param}", i, shapes[param], n_in))
    out.append(Tensor("model.norm.weight", "final_norm", None, (d,), None))
    if not cfg.tie_embeddings:
        out.append(Tensor("lm_head.weight", "unembed", None, (d, v), 1))
    return out


def skipped(name: str, cfg) -> bool:
    """Whether a checkpoint's tensor `name` holds nothing meshpar reads (see the module docstring)."""
    return bool(_SKIPPED.match(name)) or (cfg.tie_embeddings and name == "lm_head.weight")


def by_param(entries: list[Tensor]) -> dict[str, list[Tensor]]:
    """meshpar parameter path → its tensors (one, or one per layer in layer order)."""
    out: dict[str, list[Tensor]] = {}
    for t in entries:
        out.setdefault(t.param, []).append(t)
    return out
