"""The run settings of a decoder family's config (:mod:`meshpar.models.decoder`): the dtypes, the
layer loop, remat and the attention core. They change how a model runs, never what it computes
beyond rounding; the decoder takes them by the same names (:func:`meshpar.models.decoder.configure`).

:class:`RunSettings` is a dataclass base, as :class:`meshpar.models.moe_config.MoEFields` is: a
family's config lists its own fields in a base of its own and takes these after them, before the
mixture-of-experts ones (``class LlamaConfig(MoEFields, RunSettings, _LlamaFields)``: a dataclass
puts the fields of its last base first). :func:`meshpar.config_reference.field_docs` reads their
comments here.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshpar.models import remat as remat_lib


@dataclasses.dataclass(frozen=True)
class RunSettings:
    # Dtype the parameters are stored (and the optimizer's moments kept) in, and the dtype the
    # layers compute in: bfloat16 compute with float32 parameters is mixed precision. The loss
    # (softmax cross-entropy) is float32 regardless.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    scan_layers: bool = True  # run the stacked layers with lax.scan (True) or unrolled (False)
    # What each layer keeps for the backward pass (meshpar.models.remat; every name's definition
    # and source: docs/models.md, "Remat policies"): none = everything; full = only its input,
    # recomputing the layer; dots = its weight matmuls' outputs; MaxText's remat_policy names
    # (lower case; qkv_proj_offloaded and minimal_offloaded keep their names in pinned host
    # memory) and Paxml's AutodiffCheckpointType names (upper case), each as its source defines
    # it; custom = the values tagged with the names remat_save lists.
    remat: Literal[remat_lib.NAMES] = "none"
    # With remat custom only: the checkpoint_name tags whose values each layer keeps on the device
    # (MaxText's tensors_on_device), e.g. [query_proj, key_proj, value_proj, out_proj]; a name
    # the family's layers do not tag is a config error that lists those they do.
    remat_save: tuple[str, ...] = ()
    # Attention core (meshpar.models.attention): xla = full [length, length] scores; blockwise =
    # flash-style over key blocks of attention_block positions (memory grows with length x
    # block); cudnn = cuDNN's fused attention where it applies (CUDA GPU, bfloat16/float16,
    # supported head dim), else blockwise; auto = cuDNN where it applies, else xla.
    attention: Literal["auto", "xla", "blockwise", "cudnn"] = "auto"
    # Key/value positions per block of blockwise attention; must divide the length when smaller.
    attention_block: int = dataclasses.field(default=512, metadata={"min": 1})
    # Context parallelism: how attention runs where the layout splits length over one mesh axis
    # (meshpar.models.context_parallel; docs/models.md, "Context parallelism"). all_gather =
    # each device's query block against K and V all-gathered along length (only the key/value
    # heads move); ring = K/V blocks passed around the axis under an online softmax, blocks
    # wholly after the query block skipped; ulysses = all-to-all from a length split to a heads
    # split and back (the query heads must divide by the length split times any heads split);
    # auto = all_gather for now (a choice by the planner's estimate is to come). Without a
    # length split: no effect.
    context_parallel: Literal["auto", "all_gather", "ring", "ulysses"] = "auto"
    # Layers per iteration of the layer scan (lax.scan's unroll). 0 = by backend, at trace time:
    # on CPU the whole stack when it has at most UNROLL_LAYERS_CPU layers (a loop iteration
    # costs more there than the compile time it saves: stacked residuals are zero-filled,
    # sliced and copied) unless remat is on, else 1.
    scan_unroll: int = dataclasses.field(default=0, metadata={"min": 0})
    # The kinds of dot whose operands are FP8 (meshpar.models.fp8; docs/fp8.md): mlp (the dense
    # MLP's weight matmuls), experts (an MoE layer's, capacity dispatch), attention (the query,
    # key, value and output projections). e4m3 operands forward, e5m2 output gradients, each
    # tensor scaled as fp8_scaling says. The embedding, the logits, the router and attention's
    # scores and values stay in compute_dtype. Generation runs the same dots in FP8. [] = no FP8.
    fp8: tuple[str, ...] = ()
    # FP8 dots' weights gathered in FP8 where param_layout splits them further (FSDP): each
    # weight is quantized where it is stored and its FP8 form all-gathered, one byte per element.
    fp8_gather: bool = False
    # How FP8 operands are scaled: current = each tensor's own amax this step (no state);
    # delayed = the max of each dot's amax history (MaxText's and Transformer Engine's recipe),
    # kept in the train state and checkpoints, max-reduced over microbatches, pipeline ticks,
    # replicas and shards.
    fp8_scaling: Literal["current", "delayed"] = "current"
    # Delayed scaling: steps of amax each history keeps (1024: MaxText's and Transformer
    # Engine's default amax_history_len).
    fp8_history: int = dataclasses.field(default=1024, metadata={"min": 1})
