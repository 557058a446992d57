"""Tiny Hugging Face Llamas and their reference logits, for tests/test_hf.py and tests/test_convert.py.

Needs torch and transformers, which meshpar itself does not (run it from an environment that
has them, e.g. ``pip install torch transformers safetensors numpy`` in a venv of its own):

    python scripts/make_hf_fixture.py [--out tests/fixtures/hf] [--only NAME ...]

(``--only trained`` writes that variant alone and leaves the other folders as they are; the
``trained`` variant also needs the repository root on ``PYTHONPATH``, for ``input_pipeline``.)

Each model is a ``transformers.LlamaForCausalLM`` with seeded random weights (normal, std 0.2 for
the projections so that the logits are far from uniform, norms around 1; ``trained``'s are
trained instead, see below), saved with ``save_pretrained`` into ``<out>/<name>/``, beside
``reference.npz``: ``inputs`` int32 [2, 16]
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
- ``trained``: a model briefly trained on text, so that greedy decoding gives varied
  continuations (an untrained one repeats one token), for the parity of ``meshpar.generate``
  with ``transformers``' ``generate(do_sample=False)``. Its tokenizer is
  ``experiments/tokenizers/stdlib-bpe-2k.json`` (2048-token byte-level BPE), copied into the
  folder as ``tokenizer.json``; its one special token, ``<|endoftext|>`` (id 0), is the
  end-of-document token, so config.json has ``eos_token_id`` 0, ``pad_token_id`` 0 and
  ``bos_token_id`` null (the tokenizer adds none). The model: vocab 2048, d_model 64, 4 query
  heads, 2 key/value heads, head_dim 16, d_ff 128, 2 layers, tied embeddings,
  max_position_embeddings 128, rms_eps 1e-5, default rope (theta 10000), float32. Training,
  seeded and deterministic on CPU (a minute or so): transformers' own initialization, then
  AdamW (lr 3e-3, weight decay 0.01, gradients clipped to norm 1; a linear warmup of 50 steps,
  then a cosine decay to 3e-4) for 1000 steps of 16 random 64-token windows of a token stream
  of the Python standard library's ``.py`` files: the ``text`` source's corpus of the running
  Python (``input_pipeline.text.list_py_files``, sorted by path), without test folders and
  ``encodings`` (codec tables), every third file, the first 4 MB of them, tokenized as meshpar
  does (``input_pipeline.tokenizer``, documents joined by ``<|endoftext|>``). The stream
  depends on the Python version, so the weights differ between Pythons; the references are
  those of the saved weights.
  Beside ``inputs``/``logits`` (as above), ``reference.npz`` holds greedy continuations by
  ``model.generate(do_sample=False, max_new_tokens=32)`` (eager attention, float32):
  ``generate_prompts`` (the 4 prompt texts, ``GENERATE_PROMPTS``), ``generate_inputs`` int32
  [4, P] (their token ids left-padded with the pad id to the longest, P), ``generate_mask``
  int32 [4, P] (1 = real token), ``generate_tokens`` int32 [4, 32] (the new tokens of the
  batch, left-padded as transformers generates batches), and ``generate_single`` int32 [32]
  (the continuation of the first prompt alone, unpadded). No row stops early: every row holds
  32 new tokens and no end-of-document token (the script fails otherwise).

- ``mixtral_f32``: a ``transformers.MixtralForCausalLM`` (``MIXTRAL``): d_model 32, 4 query
  heads, 2 key/value heads, head_dim 8, 2 layers, each a mixture of 4 experts (d_ff 32) with
  every token routed to its top 2, vocab 256, untied, rope theta 1e6 (Mixtral's), float32,
  random weights as the other random variants (std 0.2: the router's logits have a std near
  1, so the tokens spread over the experts; the script prints each layer's share per expert
  and fails if any expert takes none). Saved with ``save_pretrained``, which writes transformers 4's
  tensor names (``block_sparse_moe.experts.j.w1/w2/w3``); the script also checks that the
  fused spelling transformers 5 holds in memory (``save_original_format=False``) loads to
  the same logits. Beside ``inputs``/``logits``, ``reference.npz`` holds greedy continuations
  as ``trained``'s do, of token-id prompts (no tokenizer: the byte-level one reads the
  256-token vocabulary): ``generate_inputs`` int32 [3, P] (``MIXTRAL_PROMPTS``'s lengths,
  random ids from 3 up, left-padded with 0), ``generate_mask``, ``generate_tokens`` int32
  [3, 16] and ``generate_single`` int32 [16] (the first prompt alone), generated without an
  end token (``eos_token_id`` unset for ``generate``), so every row holds 16 new tokens.

The four random Llamas stay under 1 MB together, the Mixtral under 300 KB; ``trained`` is larger (its 2048 x 64
embedding, its tokenizer and its [2, 16, 2048] logits). It prints each model's size and the
largest |logit|, and for ``trained`` the loss, each continuation's number of distinct tokens
and its text.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import safetensors
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

LENGTH, ROWS = 16, 2
BASE = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
    num_hidden_layers=2, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
VARIANTS = {
    "untied_f32": dict(config={}, dtype=torch.float32),
    "tied_f32": dict(
        config=dict(
            tie_word_embeddings=True,
            num_hidden_layers=3,
            vocab_size=320,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        dtype=torch.float32,
        shard="40KB",
    ),
    "bf16": dict(config={}, dtype=torch.bfloat16),
    "v4_llama3": dict(
        config=dict(
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        dtype=torch.float32,
        v4=True,
    ),
}

MIXTRAL_NAME = "mixtral_f32"
MIXTRAL = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=32,
    num_hidden_layers=2, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
    num_local_experts=4, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
MIXTRAL_PROMPTS = (5, 9, 3)  # prompt lengths (tokens)
MIXTRAL_NEW_TOKENS = 16

TRAINED = {
    "vocab_size": 2048, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "num_hidden_layers": 2, "tie_word_embeddings": True, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0,
}  # fmt: skip
ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "experiments" / "tokenizers" / "stdlib-bpe-2k.json"
SPECIAL = "<|endoftext|>"  # the tokenizer's one special token: end of document, eos and pad
CORPUS_BYTES = 4 << 20
SKIP_PARTS = {"test", "tests", "idle_test", "encodings"}  # encodings: codec tables, not code
STRIDE = 3  # every third file, so that the selection spans the whole library
WINDOW, BATCH, STEPS, LR, WARMUP = 64, 16, 1000, 3e-3, 50
GENERATE_PROMPTS = ["def ", "import os\n", "class Foo(", "    return "]
NEW_TOKENS = 32
TRAINED_NAME = "trained"


def _randomize(model: torch.nn.Module, seed: int) -> None:
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


def _logits(folder: Path, inputs: np.ndarray, dtype: torch.dtype, cls=LlamaForCausalLM) -> np.ndarray:
    """Logits of the saved model read back (so the v4 config is what transformers reads)."""
    model = cls.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        out = model(torch.from_numpy(inputs).long()).logits
    return out.float().numpy()


def _write_references(folder: Path, ref: dict[str, np.ndarray], extra: str = "") -> None:
    """`ref` as ``<folder>/reference.npz``, and a line: the folder's size, the largest logit, `extra`."""
    np.savez_compressed(folder / "reference.npz", **ref)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder.name}: {size / 1024:.0f} KiB, max |logit| {np.abs(ref['logits']).max():.2f}{extra}")


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
    extra = ""
    if "logits_bf16" in ref:
        extra = f", torch bf16 vs f32 max |Δ| {np.abs(ref['logits_bf16'] - ref['logits']).max():.4f}"
    _write_references(folder, ref, extra)


def _stream(tok) -> np.ndarray:
    """The token stream of the first CORPUS_BYTES of the standard library's sorted .py files."""
    from input_pipeline import text

    corpus = text.stdlib_dir()
    files = [f for f in text.list_py_files(corpus) if not SKIP_PARTS & set(f.split("/"))][::STRIDE]
    docs = []
    for f in files:
        docs.append((Path(corpus) / f).read_bytes())
        if sum(map(len, docs)) >= CORPUS_BYTES:
            break
    docs = text.cap_documents(docs, CORPUS_BYTES)
    stream = tok.stream(docs).astype(np.int64)
    print(f"corpus: {len(docs)} files of {corpus} ({files[0]} .. {files[len(docs) - 1]}), "
          f"{sum(map(len, docs)) / 2**20:.1f} MiB, {len(stream)} tokens")  # fmt: skip
    return stream


def _schedule(step: int) -> float:
    """The learning rate's factor: a linear warmup, then a cosine decay to a tenth."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def _train(model: LlamaForCausalLM, stream: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    model.train()
    start, recent = time.time(), []
    for step in range(STEPS):
        at = rng.integers(0, len(stream) - WINDOW - 1, BATCH)
        batch = torch.from_numpy(np.stack([stream[a : a + WINDOW + 1] for a in at]))
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss  # labels shift inside
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent.append(loss.item())
        if step == 0 or (step + 1) % 100 == 0:
            mean = sum(recent) / len(recent)
            print(f"  step {step + 1:4d}: loss {mean:.3f} (mean of the last {len(recent)}), {time.time() - start:.0f}s")
            recent = []
    model.eval()
    print(f"  (uniform over the vocabulary: {math.log(model.config.vocab_size):.3f})")


def _greedy(model, prompts: list[np.ndarray], pad: int, **kw) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Greedy continuations (``model.generate(do_sample=False, **kw)``, ``max_new_tokens`` among
    `kw`) of token-id `prompts`: left-padded with `pad` as a batch, and the first alone. The
    batch's new tokens [rows, max_new_tokens] and the first prompt's alone [max_new_tokens], and
    the references ``generate_inputs``, ``generate_mask``, ``generate_tokens`` and
    ``generate_single`` (int32)."""
    width = max(map(len, prompts))
    inputs = np.full((len(prompts), width), pad, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for i, x in enumerate(prompts):
        inputs[i, width - len(x) :], mask[i, width - len(x) :] = x, 1
    kw = {"do_sample": False, **kw, "pad_token_id": pad}
    with torch.no_grad():
        batch = model.generate(torch.from_numpy(inputs), attention_mask=torch.from_numpy(mask), **kw)
        alone = torch.from_numpy(prompts[0][None])
        one = model.generate(alone, attention_mask=torch.ones_like(alone), **kw)
    tokens, single = batch[:, width:].numpy(), one[0, len(prompts[0]) :].numpy()
    n = kw["max_new_tokens"]
    assert tokens.shape == (len(prompts), n) and single.shape == (n,), (tokens.shape, single.shape)
    refs = {
        "generate_inputs": inputs.astype(np.int32),
        "generate_mask": mask.astype(np.int32),
        "generate_tokens": tokens.astype(np.int32),
        "generate_single": single.astype(np.int32),
    }
    return tokens, single, refs


def _generate(model: LlamaForCausalLM, tok, pad: int) -> dict[str, np.ndarray]:
    """Greedy continuations of GENERATE_PROMPTS: left-padded as a batch, and the first alone."""
    ids = [np.asarray(x, np.int64) for x in tok.encode_batch([p.encode() for p in GENERATE_PROMPTS])]
    tokens, single, refs = _greedy(model, ids, pad, max_new_tokens=NEW_TOKENS)
    width = max(map(len, ids))
    eos = model.generation_config.eos_token_id
    assert eos is None or not np.isin(tokens, eos).any() and not np.isin(single, eos).any(), "a row stopped early"
    for i, prompt in enumerate(GENERATE_PROMPTS):
        if prompt == GENERATE_PROMPTS[0]:
            same = np.array_equal(tokens[i], single)
            verdict = "same" if same else "DIFFER"
            print(f"  row {i} (left-padded by {width - len(ids[i])}) vs the prompt alone: {verdict}")
            if not same:
                print(f"    batch:  {tokens[i].tolist()}\n    single: {single.tolist()}")
    for i, prompt in enumerate(GENERATE_PROMPTS):
        print(f"  {prompt!r}: {len(set(tokens[i].tolist()))} distinct of {NEW_TOKENS}: {tok.decode(tokens[i])!r}")
    return {"generate_prompts": np.array(GENERATE_PROMPTS), **refs}


def make_trained(out: Path, seed: int) -> None:
    from input_pipeline import tokenizer as tk

    folder = out / TRAINED_NAME
    shutil.rmtree(folder, ignore_errors=True)
    tok = tk.load(str(TOKENIZER))
    special = tok._tok.get_added_tokens_decoder()
    assert {i: t.content for i, t in special.items()} == {0: SPECIAL}, special
    assert tok.vocab_size == TRAINED["vocab_size"], tok.vocab_size
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    config = LlamaConfig(**TRAINED)
    model = LlamaForCausalLM(config).float()
    _train(model, _stream(tok), seed)
    model.generation_config.do_sample = False
    model.save_pretrained(folder)
    shutil.copyfile(TOKENIZER, folder / "tokenizer.json")
    inputs = np.random.default_rng(seed).integers(0, config.vocab_size, (ROWS, LENGTH)).astype(np.int32)
    ref = {"inputs": inputs, "logits": _logits(folder, inputs, torch.float32)}
    loaded = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ref.update(_generate(loaded.eval(), tok, pad=config.pad_token_id))
    _write_references(folder, ref)
    for p in sorted(folder.iterdir()):
        print(f"  {p.name}: {p.stat().st_size / 1024:.0f} KiB")


def _expert_shares(model: MixtralForCausalLM, inputs: np.ndarray) -> list[np.ndarray]:
    """Each layer's share of the top-k assignments per expert on `inputs`."""
    with torch.no_grad():
        out = model(torch.from_numpy(inputs).long(), output_router_logits=True)
    k, experts = model.config.num_experts_per_tok, model.config.num_local_experts
    shares = []
    for logits in out.router_logits:  # [tokens, experts] per layer
        top = torch.topk(logits, k, dim=-1).indices.reshape(-1)
        shares.append(np.bincount(top.numpy(), minlength=experts) / top.numel())
    return shares


def _generate_ids(model, prompts: list[np.ndarray], new_tokens: int, pad: int) -> dict[str, np.ndarray]:
    """Greedy continuations of token-id `prompts`, left-padded with `pad` as a batch, and the
    first alone, with no end token (every row runs `new_tokens`)."""
    tokens, single, refs = _greedy(model, prompts, pad, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    for i, row in enumerate(tokens):
        print(
            f"  prompt {i} ({len(prompts[i])} tokens): {len(set(row.tolist()))} distinct of {new_tokens}: {row.tolist()}"
        )
    print(f"  prompt 0 alone: {'same' if np.array_equal(tokens[0], single) else 'DIFFERS'} as in the batch")
    return refs


def make_mixtral(out: Path, seed: int) -> None:
    folder = out / MIXTRAL_NAME
    shutil.rmtree(folder, ignore_errors=True)
    config = MixtralConfig(**MIXTRAL)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config)
    _randomize(model, seed)
    model = model.float().eval()
    model.save_pretrained(folder)
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, config.vocab_size, (ROWS, LENGTH)).astype(np.int32)
    ref = {"inputs": inputs, "logits": _logits(folder, inputs, torch.float32, MixtralForCausalLM)}
    loaded = MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    for i, share in enumerate(_expert_shares(loaded, inputs)):
        print(f"  layer {i}: share of the assignments per expert {np.round(share, 3).tolist()}")
        assert share.min() > 0, "an expert takes no token: the routing is trivial"
    fused = out / f".{MIXTRAL_NAME}.fused"
    shutil.rmtree(fused, ignore_errors=True)
    loaded.save_pretrained(fused, save_original_format=False)
    with safetensors.safe_open(fused / "model.safetensors", "np") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys(), sorted(f.keys())
    again = _logits(fused, inputs, torch.float32, MixtralForCausalLM)
    shutil.rmtree(fused)
    assert np.array_equal(again, ref["logits"]), "the fused spelling loads to other logits"
    loaded.generation_config.eos_token_id = None  # no row ends early
    prompts = [rng.integers(3, config.vocab_size, n) for n in MIXTRAL_PROMPTS]
    ref.update(_generate_ids(loaded, prompts, MIXTRAL_NEW_TOKENS, pad=0))
    _write_references(folder, ref)


def main() -> None:
    names = [*VARIANTS, TRAINED_NAME, MIXTRAL_NAME]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "hf"))
    parser.add_argument("--only", nargs="+", choices=names, help="write these variants alone (default: all)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for i, name in enumerate(names):  # each variant's seed is its place in the full list
        if args.only and name not in args.only:
            continue
        if name == TRAINED_NAME:
            make_trained(out, seed=i)
        elif name == MIXTRAL_NAME:
            make_mixtral(out, seed=i)
        else:
            make(name, VARIANTS[name], out, seed=i)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"total {total / 1024:.0f} KiB in {out}")


if __name__ == "__main__":
    main()
