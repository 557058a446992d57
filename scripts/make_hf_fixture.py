"""Tiny Hugging Face Llamas and their reference logits, for tests/test_hf.py and tests/test_convert.py.

Needs torch and transformers, which meshpar itself does not (run it from an environment that
has them, e.g. ``pip install torch transformers safetensors numpy`` in a venv of its own):

    python scripts/make_hf_fixture.py [--out tests/fixtures/hf]

Each model is a ``transformers.LlamaForCausalLM`` with seeded random weights (normal, std 0.2 for
the projections so that the logits are far from uniform, norms around 1), saved with
``save_pretrained`` into ``<out>/<name>/``, beside ``reference.npz``: ``inputs`` int32 [2, 16]
(fixed token ids) and ``logits`` float32 [2, 16, vocab], the model's own logits in float32
(eager attention). The variants:

- ``untied_f32``: d_model 32, 4 query heads, 2 key/value heads (GQA), 2 layers, vocab 256,
  float32, its own output matrix.
- ``tied_f32``: tied embeddings, 3 layers, vocab 320, rope_theta 500000, rms_eps 1e-6, float32,
  saved in three shards (``model.safetensors.index.json``).
- ``bf16``: as untied_f32, stored in bfloat16. ``logits`` are the float32 computation of the
  stored (bfloat16-rounded) weights; ``logits_bf16`` the same model run in bfloat16 by torch,
  the error a bfloat16 run has against it.
- ``v4_llama3``: a transformers-4-style ``config.json`` written by hand (``rope_theta`` and
  ``rope_scaling: {rope_type: llama3, ...}`` instead of ``rope_parameters``), head_dim 16 ≠
  d_model / heads, and Llama 3.1's frequency scaling with original_max_position_embeddings 32,
  so that its three bands (kept, smoothed, stretched) all occur among the 8 frequencies.

The whole set stays under 1 MB. It prints each model's size and the largest |logit|.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

LENGTH, ROWS = 16, 2
BASE = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
    num_hidden_layers=2, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
VARIANTS = {
    "untied_f32": dict(config={}, dtype=torch.float32),
    "tied_f32": dict(
        config=dict(tie_word_embeddings=True, num_hidden_layers=3, vocab_size=320, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        dtype=torch.float32, shard="40KB",
    ),
    "bf16": dict(config={}, dtype=torch.bfloat16),
    "v4_llama3": dict(
        config=dict(head_dim=16, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        }),
        dtype=torch.float32, v4=True,
    ),
}


def _randomize(model: LlamaForCausalLM, seed: int) -> None:
    """Seeded weights far from HF's init (std 0.02 would leave the logits nearly uniform)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def _v4_config(folder: Path) -> None:
    """Rewrite config.json as transformers 4 wrote it: rope_theta and rope_scaling at the top."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype", "float32")
    config["transformers_version"] = "4.45.0"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _logits(folder: Path, inputs: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Logits of the saved model read back (so the v4 config is what transformers reads)."""
    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        out = model(torch.from_numpy(inputs).long()).logits
    return out.float().numpy()


def make(name: str, spec: dict, out: Path, seed: int) -> None:
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    config = LlamaConfig(**{**BASE, **spec["config"]})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    _randomize(model, seed)
    model = model.to(spec["dtype"])
    model.save_pretrained(folder, max_shard_size=spec.get("shard", "50MB"))
    if spec.get("v4"):
        _v4_config(folder)
    inputs = np.random.default_rng(seed).integers(0, config.vocab_size, (ROWS, LENGTH)).astype(np.int32)
    ref = {"inputs": inputs, "logits": _logits(folder, inputs, torch.float32)}
    if spec["dtype"] == torch.bfloat16:
        ref["logits_bf16"] = _logits(folder, inputs, torch.bfloat16)
    loaded = LlamaForCausalLM.from_pretrained(folder)
    if spec.get("v4"):
        assert loaded.config.rope_parameters["rope_type"] == "llama3", loaded.config.rope_parameters
    np.savez_compressed(folder / "reference.npz", **ref)
    size = sum(p.stat().st_size for p in folder.iterdir())
    extra = ""
    if "logits_bf16" in ref:
        extra = f", torch bf16 vs f32 max |Δ| {np.abs(ref['logits_bf16'] - ref['logits']).max():.4f}"
    print(f"{name}: {size / 1024:.0f} KiB, max |logit| {np.abs(ref['logits']).max():.2f}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for i, (name, spec) in enumerate(VARIANTS.items()):
        make(name, spec, out, seed=i)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"total {total / 1024:.0f} KiB in {out}")


if __name__ == "__main__":
    main()
