"""Generation (meshpar.run.decoding, python -m meshpar.generate): the key/value cache against the full
forward pass, greedy parity with transformers' ``generate`` on a briefly trained Llama
(tests/fixtures/hf/trained, made by scripts/make_hf_fixture.py), the same continuation under
different layouts, sampling, and the one-line failures."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshpar import generate
from meshpar import train as train_cli
from meshpar.models import llama, transformer
from meshpar.run import decoding
from tests.support.kv_cache import decode_errors

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TRAINED = FIXTURES / "trained"
MTF = "batch:data; heads:model; d_ff:model; vocab:model"  # Mesh TensorFlow's data + model layout
LAYOUTS = [
    ["mesh=data:8", "layout=batch:data"],
    ["mesh=data:4,model:2", f"layout={MTF}"],
    ["mesh=data:2,model:4", "layout=batch:data; length:model; d_ff:model"],  # the cache's positions split 4 ways
]


# -------------------------------------------------------------------------------------------
# The cache against the full forward pass

SMALL = {"d_model": 32, "n_heads": 4, "d_head": 8, "d_ff": 64, "n_layers": 2, "vocab_size": 64, "max_length": 32}


@pytest.mark.parametrize(
    "cfg",
    [
        llama.LlamaConfig(**SMALL, n_kv_heads=2),
        llama.LlamaConfig(
            **SMALL, n_kv_heads=1, tie_embeddings=True, rope_scaling="llama3", rope_original_max_length=8
        ),
        transformer.TransformerConfig(**SMALL),
        transformer.TransformerConfig(**SMALL, positions="rotary", tie_embeddings=True),
    ],
    ids=["llama-gqa", "llama-mqa-tied-llama3", "transformer-learned", "transformer-rotary-tied"],
)
def test_decoding_with_the_cache_gives_the_full_forward_passs_logits(cfg):
    """Prefill then one token at a time, one row left-padded by 3: each step's logits are the
    full forward pass's at that token's position, for each family and position scheme."""
    module = llama if isinstance(cfg, llama.LlamaConfig) else transformer
    model = module.build(cfg, {"tokens": ((17,), np.int32)}, nnx.Rngs(0))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size))
    full = np.asarray(model(jnp.asarray(tokens)))  # [2, 12, vocab]
    errors, cache = decode_errors(model, tokens, full, pad=3)
    assert int(cache.index) == 12
    assert max(errors) < 1e-5, errors
    assert np.abs(full).max() > 0.1  # the logits compared are not all zero


# -------------------------------------------------------------------------------------------
# Parity with transformers' generate


def _hf(overrides=(), **kwargs) -> decoding.Generator:
    return decoding.open_generator(decoding.hf_run_config(TRAINED, list(overrides)), hf_dir=TRAINED, **kwargs)


_GENERATORS: dict[tuple, decoding.Generator] = {}


def _trained(overrides=()) -> decoding.Generator:
    key = tuple(overrides)
    if key not in _GENERATORS:
        _GENERATORS[key] = _hf(overrides)
    return _GENERATORS[key]


@pytest.mark.skipif(not TRAINED.is_dir(), reason="tests/fixtures/hf/trained is made by scripts/make_hf_fixture.py")
def test_greedy_continuations_equal_transformers_generate_token_for_token():
    """The fixture's four prompts as one left-padded batch, and the first alone: 32 greedy
    tokens each equal transformers' ``generate(do_sample=False)``; the references hold many
    distinct tokens, so a model that repeats one token could not pass."""
    ref = np.load(TRAINED / "reference.npz")
    gen = _trained()
    prompts = decoding.encode(gen, [str(p) for p in ref["generate_prompts"]])
    for ids, row, mask in zip(prompts, ref["generate_inputs"], ref["generate_mask"]):
        assert ids.tolist() == row[mask.astype(bool)].tolist()  # meshpar's tokenizer made transformers' inputs
    n = ref["generate_tokens"].shape[1]
    batch = decoding.generate(gen, prompts, n, stop_at_eos=False)
    single = decoding.generate(gen, prompts[:1], n, stop_at_eos=False)
    assert [t.tolist() for t in batch.tokens] == ref["generate_tokens"].tolist()
    assert single.tokens[0].tolist() == ref["generate_single"].tolist()
    distinct = [len(set(row.tolist())) for row in ref["generate_tokens"]]
    assert min(distinct) >= 8, distinct


@pytest.mark.skipif(not TRAINED.is_dir(), reason="tests/fixtures/hf/trained is made by scripts/make_hf_fixture.py")
def test_the_same_greedy_continuation_under_every_layout():
    """Data parallel, Mesh TensorFlow's data + model, and the cache's positions split over the
    model axis: the same tokens, and the cache is laid out as each layout says."""
    ref = np.load(TRAINED / "reference.npz")
    seen = []
    for overrides in LAYOUTS:
        gen = _trained(overrides)
        prompts = decoding.encode(gen, [str(p) for p in ref["generate_prompts"]])
        seen.append([t.tolist() for t in decoding.generate(gen, prompts, 24, stop_at_eos=False).tokens])
    assert seen[0] == seen[1] == seen[2]
    assert len({t for row in seen[0] for t in row}) >= 8


# -------------------------------------------------------------------------------------------
# A meshpar run: the quickstart's family, trained briefly


TINY = [
    "model.d_model=64", "model.n_heads=4", "model.d_head=16", "model.d_ff=128", "model.n_layers=1",
    "model.max_length=64", "data.length=64", "data.max_bytes=400000", "train.steps=40", "train.batch_size=16",
    "train.log_every=20", "train.eval_every=0", "checkpoint.every=40", "optimizer.warmup_steps=5",
]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("run")
    assert train_cli.main(["--config", "experiments/quickstart.yaml", f"workdir={workdir}", *TINY]) == 0
    return workdir


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = generate.main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_run_continues_its_prompts_under_two_layouts_and_samples_reproducibly(run_dir, tmp_path, capsys):
    """A quickstart-family run continues ``def `` the same greedy way on its own layout and on
    another (the command); sampling gives the same tokens for a seed and other tokens for
    another; top_k 1 and a tiny top_p are greedy."""
    out = {}
    for name, extra in {"own": [], "data8": ["mesh=data:8", "layout=batch:data"]}.items():
        path = tmp_path / f"{name}.json"
        code, stdout, stderr = _cli(["--workdir", str(run_dir), "--prompt", "def ", "--prompt", "x = ",
                                     "--max-new-tokens", "20", "--json", str(path), *extra], capsys)  # fmt: skip
        assert code == 0, stderr
        out[name] = json.loads(path.read_text())
        assert "tokens/s decoding" in stderr and stdout.startswith("── prompt 0 (4 tokens) + 20 new ──\ndef ")
    assert out["own"]["mesh"] == "data:4,model:2" and out["data8"]["mesh"] == "data:8"
    assert out["own"]["tokens"] == out["data8"]["tokens"]
    assert all(len(t) == 20 for t in out["own"]["tokens"])

    gen = decoding.open_generator(*decoding.run_config(run_dir, []))
    prompts = decoding.encode(gen, ["def ", "x = "])

    def tokens(**how):
        return [t.tolist() for t in decoding.generate(gen, prompts, 20, decoding.Sampling(**how)).tokens]

    assert tokens() == out["own"]["tokens"]
    assert tokens(temperature=1.0, seed=1) == tokens(temperature=1.0, seed=1) != tokens(temperature=1.0, seed=2)
    assert tokens(temperature=1.0, seed=1) != out["own"]["tokens"]
    assert tokens(temperature=1.0, top_k=1) == tokens(temperature=1.0, top_p=1e-6) == out["own"]["tokens"]
    # each prompt draws with its own key: the same samples on 8 batch rows as on 4
    other = decoding.open_generator(*decoding.run_config(run_dir, ["mesh=data:8", "layout=batch:data"]))
    sampled = decoding.generate(other, prompts, 20, decoding.Sampling(temperature=1.0, seed=1)).tokens
    assert [t.tolist() for t in sampled] == tokens(temperature=1.0, seed=1)


def test_a_batch_file_holds_one_prompt_per_line_or_a_json_string(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text('def \n\n"import os\\nimport sys\\n"\nclass A:\n')
    assert generate.read_batch_file(path) == ["def ", "import os\nimport sys\n", "class A:"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--prompt", "x" * 65],
            "config error: --prompt: prompt 0 is 65 tokens, longer than the model's max_length 64",
        ),
        (
            ["--prompt", "def ", "--max-new-tokens", "61"],
            "config error: --max-new-tokens: 61 new tokens after a prompt of 4 make 65",
        ),
        (
            ["--prompt-ids", "1,256,3"],
            "config error: --prompt: prompt 0 holds token id 256, outside the vocabulary [0, 256)",
        ),
        (["--prompt-ids", "1,x"], "config error: --prompt-ids: '1,x' is not a list of integer token ids"),
        (["--prompt", "a", "--max-new-tokens", "8", "--top-p", "0"], "config error: --top-p: must be in (0, 1]"),
        (
            ["--prompt", "a", "mesh=data:1,model:8", "layout=heads:model"],
            "config error: layout: dim 'heads' of parameter",
        ),
        (["--prompt", "a", "model.n_layers=2"], "config error: model.n_layers: 2 in the config but 1 in"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(run_dir, capsys, args, expected):
    code, stdout, stderr = _cli(["--workdir", str(run_dir), *args], capsys)
    assert code == 2 and stdout == ""
    assert stderr.startswith(expected) and stderr.count("\n") == 1, stderr


def test_a_workdir_without_a_checkpoint_is_one_line(tmp_path, capsys):
    code, _, stderr = _cli(["--workdir", str(tmp_path), "--prompt", "def "], capsys)
    assert (
        code == 2
        and stderr.startswith(f"checkpoint error: {tmp_path} holds no committed checkpoint")
        and stderr.count("\n") == 1
    )


def test_sampling_keeps_to_the_top_k_and_the_nucleus():
    """Thousands of draws: top_k never leaves the k largest logits, top_p never leaves the
    smallest set holding p of the probability, and plain sampling reaches beyond both."""
    logits = jnp.log(jnp.asarray([[0.4, 0.3, 0.15, 0.1, 0.05]] * 4000))
    keys = jax.random.key(0)
    draws = {
        name: np.asarray(decoding.sample(logits, keys, decoding.Sampling(temperature=1.0, **kw)))
        for name, kw in {"all": {}, "k2": {"top_k": 2}, "p06": {"top_p": 0.6}, "p075": {"top_p": 0.75}}.items()
    }
    assert set(draws["all"]) == {0, 1, 2, 3, 4}
    assert set(draws["k2"]) == {0, 1}
    assert set(draws["p06"]) == {0, 1}  # 0.4 < 0.6: the second is needed, 0.7 ≥ 0.6: not the third
    assert set(draws["p075"]) == {0, 1, 2}
    assert abs((draws["k2"] == 0).mean() - 0.4 / 0.7) < 0.03  # renormalised among the kept


@pytest.mark.skipif(not TRAINED.is_dir(), reason="tests/fixtures/hf/trained is made by scripts/make_hf_fixture.py")
def test_the_command_continues_a_hugging_face_folder_and_stops_at_its_end_token(tmp_path, capsys):
    """``--hf`` under Mesh TensorFlow's layout gives transformers' continuation; with an
    end-of-sequence id that the continuation makes, a prompt ends at its first one (kept), the
    others run on, and ``--ignore-eos`` keeps them all."""
    ref = np.load(TRAINED / "reference.npz")
    path = tmp_path / "out.json"
    args = ["--hf", str(TRAINED), "--prompt", "def ", "--max-new-tokens", "32", "--json", str(path)]
    code, stdout, stderr = _cli([*args, "mesh=data:4,model:2", f"layout={MTF}"], capsys)
    assert code == 0, stderr
    out = json.loads(path.read_text())
    assert out["tokens"] == [ref["generate_single"].tolist()] and out["mesh"] == "data:4,model:2"
    assert out["prompts"] == ["def "] and out["prompt_tokens"] == [2]  # the prompts' texts, not their count
    assert stdout.startswith("── prompt 0 (2 tokens) + 32 new ──\ndef ")

    gen = _trained()
    prompts = decoding.encode(gen, [str(p) for p in ref["generate_prompts"]])
    end = int(ref["generate_tokens"][0, 5])  # made by row 0 at its 6th token
    stopped = decoding.generate(dataclasses.replace(gen, eos=(end,), programs={}), prompts, 32).tokens
    for row, made in zip(ref["generate_tokens"], stopped):
        hits = np.flatnonzero(row == end)
        assert made.tolist() == (row[: hits[0] + 1] if hits.size else row).tolist()
    assert len(stopped[0]) <= 6
    kept = decoding.generate(dataclasses.replace(gen, eos=(end,)), prompts, 32, stop_at_eos=False).tokens
    assert [t.tolist() for t in kept] == ref["generate_tokens"].tolist()


# -------------------------------------------------------------------------------------------
# Prompts that are not UTF-8, and a --json that cannot be written

BYTE_LEVEL = FIXTURES / "untied_f32"  # a Llama of vocabulary 256 without tokenizer.json: the byte tokenizer


def test_a_prompt_that_is_not_utf8_goes_to_a_byte_level_model_byte_for_byte(tmp_path, capsys):
    """``--prompt "$(printf 'a\\xff\\xfe')"`` reaches Python as surrogate escapes; a byte-level
    model is given the bytes themselves, from the command line and from a batch file alike,
    and the shown prompt holds U+FFFD where a byte is not UTF-8 (the ids keep the bytes)."""
    batch = tmp_path / "prompts.txt"
    batch.write_bytes(b"x\xfey\n")
    path = tmp_path / "out.json"
    code, stdout, stderr = _cli(["--hf", str(BYTE_LEVEL), "--prompt", "a\udcff\udcfe", "--batch-file", str(batch),
                                 "--max-new-tokens", "4", "--json", str(path)], capsys)  # fmt: skip
    assert code == 0, stderr
    assert json.loads(path.read_text())["prompt_ids"] == [[97, 255, 254], [120, 254, 121]]
    assert stdout.startswith("── prompt 0 (3 tokens) + 4 new ──\na\ufffd\ufffd")
    assert "── prompt 1 (3 tokens) + 4 new ──\nx\ufffdy" in stdout


@pytest.mark.skipif(not TRAINED.is_dir(), reason="tests/fixtures/hf/trained is made by scripts/make_hf_fixture.py")
def test_a_prompt_that_is_not_utf8_is_one_line_for_a_tokenizer_that_reads_text(tmp_path, capsys):
    """The command run as a shell runs it, the prompt's bytes in argv: one line naming the
    argument, the prompt, the byte and its offset; exit 2; nothing generated. The same for a
    batch file's line."""
    tokenizer = TRAINED / "tokenizer.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, "-m", "meshpar.generate", "--hf", str(TRAINED), "--prompt", "ok", "--prompt", b"a\xff\xfe"]
    result = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"config error: --prompt: prompt 1 is not valid UTF-8: byte 0xff at offset 1 (tokenizer {tokenizer} "
        "reads text; give UTF-8, or token ids with --prompt-ids)\n"
    )
    batch = tmp_path / "prompts.txt"
    batch.write_bytes(b"fine\n\nab\xfe\n")
    code, stdout, stderr = _cli(["--hf", str(TRAINED), "--prompt", "ok", "--batch-file", str(batch)], capsys)
    assert (code, stdout) == (2, "")
    assert stderr == (
        f"config error: --batch-file: {batch}:3 (prompt 2) is not valid UTF-8: byte 0xfe at offset 2 "
        f"(tokenizer {tokenizer} reads text; give UTF-8, or token ids with --prompt-ids)\n"
    )


def test_a_json_path_in_a_missing_folder_is_one_line_before_anything_is_generated(tmp_path, capsys):
    path = tmp_path / "missing_dir" / "x.json"
    code, stdout, stderr = _cli(["--hf", str(BYTE_LEVEL), "--prompt", "def ", "--json", str(path)], capsys)
    assert (code, stdout) == (2, "")
    assert stderr == f"output error: cannot write --json {path}: folder {path.parent} does not exist\n"
    code, stdout, stderr = _cli(["--hf", str(BYTE_LEVEL), "--prompt", "def ", "--json", str(tmp_path)], capsys)
    assert (code, stdout, stderr) == (2, "", f"output error: cannot write --json {tmp_path}: it is a folder\n")


def test_a_json_write_that_fails_after_generating_keeps_the_text(tmp_path, capsys, monkeypatch):
    """A write that fails once the continuations are made (a full disk): they are on stdout,
    the error is one line, exit 2, and no partial file is left."""

    def full_disk(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(generate.os, "replace", full_disk)
    path = tmp_path / "x.json"
    args = ["--hf", str(BYTE_LEVEL), "--prompt", "def ", "--max-new-tokens", "4", "--json", str(path)]
    code, stdout, stderr = _cli(args, capsys)
    assert code == 2
    assert stdout.startswith("── prompt 0 (4 tokens) + 4 new ──\ndef ")
    assert stderr.splitlines()[-1] == (
        f"output error: cannot write --json {path}: No space left on device (the continuations are printed above)"
    )
    assert list(tmp_path.iterdir()) == []
