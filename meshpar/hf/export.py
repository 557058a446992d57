"""A Llama's parameters → a Hugging Face folder that ``AutoModelForCausalLM.from_pretrained`` loads
(a ``MixtralForCausalLM`` where the model has experts, its experts one tensor each as
transformers 4 and 5 both load them: :mod:`meshpar.hf.names`).

``config.json`` (over the original's fields where it is known, :func:`meshpar.hf.model_config.to_hf`),
the original ``generation_config.json`` where known, the weights in the parameter dtype as
``model.safetensors`` (shards and an index above ``max_shard_bytes``), and the tokenizer files
where known. Each tensor is made when its bytes are written (:mod:`meshpar.hf.writer`), so
beyond the parameters the host holds one tensor at a time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from meshpar.hf import files, names, writer
from meshpar.hf import model_config as hf_config


def entries(model, params: Mapping[str, np.ndarray]) -> list[writer.Entry]:
    """Every Hugging Face tensor of `params` (parameter path → array, stacked along ``layers``,
    a mixture of experts' along ``layers`` and ``experts``)."""
    out = []
    for t in names.tensors(model):
        x = params[t.param]
        stack = (model.n_layers, model.moe_experts)[: len(t.layer)] if t.layer is not None else ()
        if tuple(x.shape) != (*stack, *t.shape):
            raise ValueError(
                f"parameter {t.param} has shape {tuple(x.shape)}, a {names.kind(model)} of this config {(*stack, *t.shape)}"
            )

        def produce(t=t, x=x):
            return t.to_hf(np.asarray(x[t.layer] if t.layer is not None else x))

        out.append(writer.Entry(t.hf, np.dtype(x.dtype), t.hf_shape, produce))
    return out


def find_origin(run: Path) -> tuple[dict | None, Path | None, Path | None]:
    """(the original config.json, the folder holding the original generation_config.json, the
    folder holding tokenizer files), each None where none is found (:func:`files.origins`)."""
    config = generation = tokenizer = None
    for folder in files.origins(run):
        for name in ("config.json", files.KEPT["config.json"]):
            if config is None and (folder / name).is_file() and (name != "config.json" or _is_hf(folder)):
                config = hf_config.read_json(folder / name)
        for name in ("generation_config.json", files.KEPT["generation_config.json"]):
            if generation is None and (folder / name).is_file():
                generation = folder / name
        if tokenizer is None and any((folder / n).is_file() for n in files.TOKENIZER_FILES):
            tokenizer = folder
    return config, generation, tokenizer


def _is_hf(folder: Path) -> bool:
    return any((folder / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json"))


def write(
    out: Path,
    model,
    params: Mapping[str, np.ndarray],
    base_config: dict | None = None,
    generation: Path | None = None,
    tokenizer: Path | None = None,
    max_shard_bytes: int = writer.MAX_SHARD_BYTES,
) -> list[str]:
    """Write the folder `out` (new, or empty; it appears whole or not at all). Returns its files."""
    tensors = entries(model, params)
    with files.new_folder(Path(out), "output folder") as tmp:
        written = writer.write_folder(tmp, tensors, max_shard_bytes)
        config = hf_config.to_hf(model, base_config)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        written.append("config.json")
        if generation is not None:
            written += files.copy_present(generation.parent, tmp, {generation.name: "generation_config.json"})
        if tokenizer is not None:
            written += files.copy_present(tokenizer, tmp, {n: n for n in files.TOKENIZER_FILES})
    return sorted(written)
