"""Text generation under a layout: a trained language model continues prompts, from a run's
newest checkpoint or a Hugging Face folder (``python -m meshpar.generate``).

The model is the run's own (every LM family: its ``init_cache`` and ``decode``, see
:mod:`meshpar.models.kv_cache`; a mixture of experts too, each row routed on its own), on the run's mesh and layout or ones given as overrides, its
parameters read straight into that layout's shardings. Generation is one jitted prefill (every
prompt's tokens written into the key/value cache at once, the first new token sampled) and then
one jitted decode step per new token (the cache donated and updated in place), dispatched
without waiting on the host; the tokens are fetched when the last step is done.

Prompts of a batch are left-padded to the longest (their own positions count from their first
token, as Hugging Face's batched generation counts them), and the batch is padded with copies
of the first prompt to a multiple of the mesh axes ``batch`` is split over. The layout's rules
place the cache like every tensor (``batch``, ``heads``/``kv_heads``, and a ``length`` rule
splits the cache's positions); the new tokens' activations keep ``length`` whole, since a step
of one token cannot be split.

Sampling (:func:`sample`): ``temperature 0`` is greedy (the first of equal maxima); otherwise
the logits are divided by the temperature, cut to the ``top_k`` largest and to the smallest set
whose probability reaches ``top_p``, and drawn with the row's key at that step,
``fold_in(fold_in(key(seed), step), row)``: the same seed gives the same tokens, whatever the
layout and however the batch is padded.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from input_pipeline import tokenizer as tokenizer_lib
from meshpar import models
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import Config, ConfigError, DataConfig
from meshpar.configuration.errors import CheckpointError
from meshpar.hf import load as hf_load
from meshpar.hf import model_config as hf_config
from meshpar.run import init_from
from meshpar.sharding import layout as layout_lib
from meshpar.step import inputs as inputs_lib
from meshpar.step import parts, trainer

SLOTS = "slots"  # the cache's positions: the logical dim a layout's `length` rule splits during generation
EOS_CHECK_EVERY = 16  # decode steps between checks of whether every row has ended (a host sync each)


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0  # 1: no cut
    seed: int = 0

    def check(self, vocab: int) -> None:
        if not self.temperature >= 0 or not np.isfinite(self.temperature):
            raise ConfigError("--temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 <= self.top_k <= vocab:
            raise ConfigError("--top-k", f"must be in [0, {vocab}] (the vocabulary; 0 = no cut), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p", f"must be in (0, 1] (1 = no cut), got {self.top_p}")


def sample(logits: jax.Array, key: jax.Array, how: Sampling) -> jax.Array:
    """Next tokens int32 ``[batch]`` from float32 logits ``[batch, vocab]`` (see the module docstring)."""
    if how.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / how.temperature
    if how.top_k:
        kth = jax.lax.top_k(logits, how.top_k)[0][:, -1:]  # [batch, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if how.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each
        cut = jnp.min(jnp.where(before < how.top_p, ordered, jnp.inf), axis=-1, keepdims=True)  # smallest kept
        logits = jnp.where(logits < cut, -jnp.inf, logits)
    rows = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(logits.shape[0]))  # a key per row
    return jax.vmap(jax.random.categorical)(rows, logits).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Where the model comes from


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def run_config(workdir: Path, overrides: Sequence[str]) -> tuple[Config, init_from.SavedRun]:
    """The config of the run in `workdir` with `overrides` applied, and its newest checkpoint.

    The model and data sections are the checkpoint's run record (what its weights were trained
    as); everything else (mesh, layout, ...) is the run's ``summary.json`` where it has one, else
    the defaults."""
    run = init_from.SavedRun.find(workdir)
    if run is None:
        raise CheckpointError(
            f"{workdir} holds no committed checkpoint (give a run's workdir or its checkpoint folder)"
        )
    record = run.record().get("config", {})
    raw: dict = {}
    for folder in (workdir, run.directory.parent):
        summary = folder / "summary.json"
        if summary.is_file():
            raw = dict(json.loads(summary.read_text()).get("config", {}))
            break
    data_fields = {f.name for f in dataclasses.fields(DataConfig)}
    saved = _nested(
        {k: v for k, v in record.items() if k.startswith("model.") or k.removeprefix("data.") in data_fields}
    )
    raw["model"] = saved.get("model", {})
    raw["data"] = {**raw.get("data", {}), **saved.get("data", {})}
    return config_lib.from_dict(config_lib.apply_overrides(raw, overrides)), run


def hf_run_config(folder: Path, overrides: Sequence[str]) -> Config:
    """A config for the Llama or Mixtral in the Hugging Face `folder` (its config.json's
    architecture, :func:`meshpar.hf.model_config.model_section`; its tokenizer.json), with
    `overrides` applied (mesh, layout, model.compute_dtype, model.moe_dispatch, ...)."""
    if not init_from.is_hf_folder(folder):
        raise CheckpointError(
            f"{folder} is not a Hugging Face model folder (config.json with model.safetensors or its index)"
        )
    arch = hf_config.read(folder)
    model = hf_config.model_section(arch)
    tokenizer = folder / "tokenizer.json"
    raw = {"model": model, "data": {"tokenizer": str(tokenizer) if tokenizer.is_file() else tokenizer_lib.BYTE}}
    return config_lib.from_dict(config_lib.apply_overrides(raw, overrides))


def hf_eos(folder: Path) -> tuple[int, ...]:
    """The end-of-sequence ids a Hugging Face folder names (generation_config.json, else config.json)."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()


# ---------------------------------------------------------------------------------------------
# The model on the mesh


@dataclasses.dataclass
class Generator:
    """A language model's parameters placed by a layout, and what decodes with them."""

    cfg: Config
    mesh: jax.sharding.Mesh
    layout: layout_lib.Layout  # the run's layout (the cache's placement)
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: tokenizer_lib.Tokenizer
    eos: tuple[int, ...]
    source: str  # what the parameters were read from
    # (rows, prompt length, cache slots, sampling) → the compiled prefill and decode step
    programs: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def decode_layout(self) -> layout_lib.Layout:
        """The layout generation traces with: `length` whole for the new tokens, its split (if
        any) on the cache's positions."""
        rules = tuple((d, a) for d, a in self.layout.rules if d != "length")
        length = self.layout.axis("length")
        extra = () if length is None else ((SLOTS, length),)
        return dataclasses.replace(self.layout, rules=(*rules, *extra), param_rules=self.layout.param_rules)

    def vocab_size(self) -> int:
        return int(self.cfg.model.vocab_size)


def _window_spec(cfg: Config, record: dict | None) -> dict:
    """The element spec the model is built with: the run's own, else windows of max_length."""
    if record and "data.element_spec" in record:
        return {k: (tuple(shape), np.dtype(dtype)) for k, (shape, dtype) in record["data.element_spec"].items()}
    return {"tokens": ((int(cfg.model.max_length) + 1,), np.dtype(np.int32))}


def open_generator(cfg: Config, run: init_from.SavedRun | None = None, hf_dir: Path | None = None) -> Generator:
    """`cfg`'s model on its mesh and layout with the parameters of `run` (a meshpar checkpoint)
    or `hf_dir` (a Hugging Face folder), read straight into their shardings."""
    family = models.family(cfg.model.name)
    if "tokens" not in family.fields:
        raise ConfigError(
            "model.name", f"{cfg.model.name!r} reads no 'tokens' field: generation is for language models"
        )
    tokenizer = inputs_lib.load_tokenizer(cfg.data, cfg.checkpoint.init_from)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            "data.tokenizer",
            f"{tokenizer.name} has {tokenizer.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}",
        )
    record = run.record().get("config", {}) if run is not None else None
    if record and record.get("data.tokenizer_sha256") and tokenizer.name != tokenizer_lib.BYTE:
        if hashlib.sha256(Path(tokenizer.name).read_bytes()).hexdigest() != record["data.tokenizer_sha256"]:
            raise ConfigError(
                "data.tokenizer",
                f"{tokenizer.name} is not the tokenizer {run.describe()} was trained with (its sha256 differs)",
            )
    if cfg.distributed.num_processes > 1:
        raise ConfigError("distributed.num_processes", "generation runs in one process")
    mesh = parts.make_mesh(cfg)
    layout = parts.make_layout(cfg, mesh)
    model_cfg = dataclasses.replace(cfg.model, attention="xla") if hasattr(cfg.model, "attention") else cfg.model
    build = functools.partial(family.build, model_cfg, _window_spec(cfg, record))
    with parts.config_key("model", ValueError):
        graphdef, abstract = trainer.abstract_model(build)
    params_layout = layout.overlay(cfg.param_layout)
    with parts.config_key("param_layout" if cfg.param_layout else "layout", layout_lib.LayoutError):
        trainer.check_params(abstract, params_layout)
        shardings = trainer.tree_shardings(abstract, params_layout, mesh)
    if not hasattr(nnx.eval_shape(lambda: build(nnx.Rngs(0))), "decode"):
        raise ConfigError(
            "model.name", f"{cfg.model.name!r} has no decode method: see the generation contract in docs/generation.md"
        )
    if hf_dir is not None:
        source = hf_load.open(hf_dir, cfg.model)
        eos = hf_eos(hf_dir)
    else:
        source = init_from.check_run(cfg, run, abstract)
        eos = ()
    params, _ = source.load(abstract, shardings)
    return Generator(cfg, mesh, layout, graphdef, params, tokenizer, eos, source.describe())


# ---------------------------------------------------------------------------------------------
# Generation


@dataclasses.dataclass
class Result:
    prompts: list[np.ndarray]  # each prompt's token ids
    tokens: list[np.ndarray]  # each prompt's new tokens (cut after an end-of-sequence token)
    texts: list[str]  # the new tokens decoded
    batch: int  # rows run (prompts, padded to the batch split)
    slots: int  # the cache's positions
    compile_s: float
    prefill_s: float  # wall clock, the prompts' tokens through the model and the first new token
    decode_s: float  # wall clock, every later token

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens of every prompt made by the decode steps, per second of them (wall clock)."""
        steps = max(len(t) for t in self.tokens) - 1
        return len(self.tokens) * steps / self.decode_s if self.decode_s > 0 and steps > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Every new token of every prompt per second of prefill and decode (wall clock)."""
        return self.new_tokens / (self.prefill_s + self.decode_s)

    def summary(self) -> dict:
        return {
            "prompts": len(self.prompts), "prompt_tokens": [len(p) for p in self.prompts],
            "new_tokens": [len(t) for t in self.tokens], "batch_rows": self.batch, "cache_slots": self.slots,
            "compile_s": self.compile_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
            "tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
            "tokens": [t.tolist() for t in self.tokens], "texts": self.texts,
        }  # fmt: skip


def encode(gen: Generator, prompts: Sequence[str]) -> list[np.ndarray]:
    """The prompts' token ids by the run's tokenizer (no special tokens added)."""
    return [np.asarray(ids, np.int64) for ids in gen.tokenizer.encode_batch([p.encode() for p in prompts])]


def check_prompts(gen: Generator, prompts: Sequence[np.ndarray], max_new_tokens: int) -> None:
    vocab, limit = gen.vocab_size(), int(gen.cfg.model.max_length)
    if max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be >= 1, got {max_new_tokens}")
    if not prompts:
        raise ConfigError("--prompt", "no prompt given")
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise ConfigError("--prompt", f"prompt {i} has no tokens")
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise ConfigError(
                "--prompt",
                f"prompt {i} holds token id {int(bad[0])}, outside the vocabulary [0, {vocab}) of model.vocab_size",
            )
        if len(ids) > limit:
            raise ConfigError(
                "--prompt", f"prompt {i} is {len(ids)} tokens, longer than the model's max_length {limit}"
            )
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > limit:
        raise ConfigError(
            "--max-new-tokens",
            f"{max_new_tokens} new tokens after a prompt of {longest} make {longest + max_new_tokens}, beyond the model's max_length {limit}",
        )


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def generate(gen: Generator, prompts: Sequence[np.ndarray], max_new_tokens: int, how: Sampling = Sampling(),
             stop_at_eos: bool = True) -> Result:  # fmt: skip
    """Continue every prompt (token ids) by up to `max_new_tokens` tokens."""
    check_prompts(gen, prompts, max_new_tokens)
    how.check(gen.vocab_size())
    longest = max(len(p) for p in prompts)
    rows = _round_up(len(prompts), gen.layout.axis_size("batch"))
    slots = _round_up(longest + max_new_tokens, gen.layout.axis_size("length"))
    padded = list(prompts) + [prompts[0]] * (rows - len(prompts))
    tokens = np.zeros((rows, longest), np.int32)  # left-padded; the padding is never attended to
    start = np.zeros((rows,), np.int32)
    for i, ids in enumerate(padded):
        tokens[i, longest - len(ids) :] = ids
        start[i] = longest - len(ids)
    start_compile = time.perf_counter()
    first, later = _programs(gen, rows, longest, slots, how)
    compile_s = time.perf_counter() - start_compile
    key = jax.random.key(how.seed)
    tokens_dev = jax.device_put(tokens, gen.decode_layout.sharding(gen.mesh, ("batch", None)))
    start_dev = jax.device_put(start, gen.decode_layout.sharding(gen.mesh, ("batch",)))

    jax.block_until_ready(first(gen.params, tokens_dev, start_dev, key))  # warm-up: a first call costs more
    t0 = time.perf_counter()
    cache, token = first(gen.params, tokens_dev, start_dev, key)
    token.block_until_ready()
    t1 = time.perf_counter()
    out = [token]
    eos = np.asarray(gen.eos if stop_at_eos else (), np.int64)
    for t in range(1, max_new_tokens):
        cache, token = later(gen.params, cache, token, key, jnp.int32(t))
        # At most two steps in flight, as in the train loop: more can deadlock XLA:CPU's
        # collectives between simulated devices; on an accelerator the next step is queued
        # behind this one all the same.
        out[-1].block_until_ready()
        out.append(token)
        if eos.size and t % EOS_CHECK_EVERY == 0 and _all_ended(out, eos, len(prompts)):
            break
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    made = np.stack([np.asarray(x) for x in out], axis=1)[: len(prompts)]  # [prompts, new tokens]
    kept = []
    for row in made:
        ends = np.flatnonzero(np.isin(row, eos)) if eos.size else []
        kept.append(row[: ends[0] + 1] if len(ends) else row)
    texts = [gen.tokenizer.decode(row.tolist()) for row in kept]
    return Result(list(prompts), kept, texts, rows, slots, compile_s, t1 - t0, t2 - t1)


def _programs(gen: Generator, rows: int, longest: int, slots: int, how: Sampling):
    """The compiled prefill ``(params, tokens [rows, longest], start [rows], key) → (cache,
    token)`` and decode step ``(params, cache, token, key, step) → (cache, token)`` (the cache
    donated), once per shape and sampling."""
    name = (rows, longest, slots, dataclasses.replace(how, seed=0))  # the seed is an argument
    if name in gen.programs:
        return gen.programs[name]
    mesh, decode_layout, graphdef = gen.mesh, gen.decode_layout, gen.graphdef

    def prefill(params, tokens, start, key):
        with layout_lib.activate(decode_layout, mesh):
            model = nnx.merge(graphdef, params)
            cache = dataclasses.replace(model.init_cache(rows, slots, start), length=SLOTS)
            cache = dataclasses.replace(
                cache, k=layout_lib.constrain(cache.k, cache.dims), v=layout_lib.constrain(cache.v, cache.dims)
            )
            logits, cache = model.decode(tokens, cache)
            return cache, sample(logits, jax.random.fold_in(key, 0), how)

    def step(params, cache, token, key, t):
        with layout_lib.activate(decode_layout, mesh):
            logits, cache = nnx.merge(graphdef, params).decode(token[:, None], cache)
            return cache, sample(logits, jax.random.fold_in(key, t), how)

    batch = decode_layout.sharding(mesh, ("batch",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    key = jax.random.key(how.seed)
    tokens = jax.ShapeDtypeStruct((rows, longest), jnp.int32, sharding=decode_layout.sharding(mesh, ("batch", None)))
    start = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=batch)
    with parts.config_key("layout", layout_lib.LayoutError):
        cache = jax.eval_shape(prefill, gen.params, tokens, start, key)[0]
        sharding = decode_layout.sharding(mesh, cache.dims)
        cache_shardings = dataclasses.replace(cache, k=sharding, v=sharding, index=replicated, start=batch)
        param_shardings = jax.tree.map(lambda x: x.sharding, gen.params)
        first = jax.jit(prefill, out_shardings=(cache_shardings, batch)).lower(gen.params, tokens, start, key).compile()
        later = jax.jit(step, in_shardings=(param_shardings, cache_shardings, batch, replicated, replicated),
                        out_shardings=(cache_shardings, batch), donate_argnums=1)  # fmt: skip
        token = jax.ShapeDtypeStruct((rows,), jnp.int32)
        later = later.lower(gen.params, cache, token, key, jnp.int32(1)).compile()
    gen.programs[name] = first, later
    return first, later


def _all_ended(out: list[jax.Array], eos: np.ndarray, n: int) -> bool:
    made = np.stack([np.asarray(x) for x in out], axis=1)[:n]
    return bool(np.isin(made, eos).any(axis=1).all())
