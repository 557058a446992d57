"""meshpar's inputs (meshpar.step.inputs) on a prepared token corpus (``data.source: tokens``) and
with worker processes (``data.workers``): training is the same for every worker count, a run
resumes with another one, and bad data or a lost worker stops the run in one line that names
the file or the worker and the last checkpoint, changing nothing on disk."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from input_pipeline import corpus as corpus_lib
from input_pipeline import text as text_lib
from input_pipeline.batching import HostLoader
from input_pipeline.tokens import TokenSource
from meshpar import train
from meshpar.configuration import config
from meshpar.run.metrics import read_jsonl
from meshpar.step import inputs
from tests.support import script

REPO = Path(__file__).resolve().parents[1]
runs = script("train_runs")

BPE = REPO / "experiments" / "tokenizers" / "stdlib-bpe-2k.json"
LENGTH, BATCH = 32, 16
TINY = f"""
mesh: data:4,model:2
layout: batch:data; d_ff:model; heads:model; vocab:model
model: {{name: transformer, d_model: 32, n_heads: 2, d_head: 16, d_ff: 64, n_layers: 1, max_length: {LENGTH}, vocab_size: VOCAB}}
data: {{source: tokens, path: CORPUS, length: {LENGTH}, eval_split: eval}}
optimizer: {{learning_rate: 0.003, decay_steps: 8}}
train: {{steps: 8, batch_size: {BATCH}, log_every: 1, eval_every: 4, eval_batches: 1, progress: false}}
checkpoint: {{every: 4}}
"""


def _prepare(tmp: Path, tokenizer: str) -> Path:
    """Two packages of the standard library, prepared: a few hundred kB, real code."""
    stdlib = Path(text_lib.stdlib_dir())
    out = tmp / "corpus"
    corpus_lib.prepare(
        tokenizer, [str(stdlib / "json"), str(stdlib / "logging")], str(out), workers=1, eval_fraction=0.2
    )
    return out


@pytest.fixture(scope="module")
def byte_corpus(tmp_path_factory):
    return _prepare(tmp_path_factory.mktemp("bytes"), "byte")


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory):
    return _prepare(tmp_path_factory.mktemp("bpe"), str(BPE))


def _cfg_path(tmp: Path, corpus: Path, vocab: int = 256) -> Path:
    path = tmp / "tiny.yaml"
    path.write_text(TINY.replace("CORPUS", str(corpus)).replace("VOCAB", str(vocab)))
    return path


def _losses(workdir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(workdir / "metrics.jsonl")]


def test_training_is_the_same_for_0_and_2_workers_and_resumes_across_them(byte_corpus, tmp_path):
    path = _cfg_path(tmp_path, byte_corpus)
    ref = tmp_path / "ref"
    summary = train.run(config.load(path, [f"workdir={ref}"]))
    assert summary["final_eval_loss"] is not None
    ref_state, step, _ = runs.load_state(path, ref)
    assert step == 8
    # Saved with 2 workers at step 4, resumed with none; and the other way round.
    for first, then in (("data.workers=2", "data.workers=0"), ("data.workers=0", "data.workers=2")):
        workdir = tmp_path / first
        train.run(config.load(path, [f"workdir={workdir}", first, "train.steps=4"]))
        train.run(config.load(path, [f"workdir={workdir}", then, "checkpoint.resume=auto"]))
        state, step, skipped = runs.load_state(path, workdir)
        identical, n, differ = runs.compare_states(ref_state, state)
        assert step == 8 and not skipped and identical and n == len(ref_state), differ
        assert _losses(workdir) == _losses(ref)


def test_two_processes_rows_assembled_by_workers_make_the_one_process_batch(byte_corpus):
    # Each process of a multi-process run reads its own rows of every global batch (its
    # workers too): together they are the batch one process reads, whatever the worker count.
    from input_pipeline.workers import WorkerBatches

    source = TokenSource(str(byte_corpus), "train", LENGTH)
    whole = HostLoader(source, BATCH, seed=3)
    halves = [HostLoader(source, BATCH, seed=3, rows=slice(i * BATCH // 2, (i + 1) * BATCH // 2)) for i in (0, 1)]
    start = whole.batches_per_epoch - 2  # across an epoch's end
    with (
        WorkerBatches(halves[0], start, start + 4, workers=2) as a,
        WorkerBatches(halves[1], start, start + 4, workers=1) as b,
    ):
        for (step, x), (step_b, y) in zip(a, b):
            assert step == step_b
            np.testing.assert_array_equal(np.concatenate([x["tokens"], y["tokens"]]), whole.batch(step)["tokens"])


def _main(argv: list[str], capsys) -> tuple[int, list[str]]:
    rc = train.main(argv)
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_config_and_data_mistakes_are_one_line(byte_corpus, bpe_corpus, tmp_path, capsys):
    path = _cfg_path(tmp_path, byte_corpus)
    base = ["--config", str(path), f"workdir={tmp_path / 'run'}"]
    cases = {
        "data.path=''": r"config error: data\.path: required when data\.source is tokens",
        f"data.path={tmp_path}": r"data error: .*not a prepared token corpus.*python -m meshpar\.data prepare",
        "data.split=valid": r"data error: .*valid.*(train|eval)",
        "model.vocab_size=200": r"config error: model\.vocab_size: 200 but the corpus .* vocabulary of 256",
        f"data.tokenizer={BPE}": r"config error: data\.tokenizer: .*stdlib-bpe-2k\.json is not the tokenizer the corpus",
        "feed.reuse_buffers=true data.workers=1": r"config error: feed\.reuse_buffers: needs data\.workers: 0",
        "data.workers=300": r"config error: data\.workers",
    }
    for override, pattern in cases.items():
        rc, lines = _main([*base, *override.split()], capsys)
        assert rc == 2 and len(lines) == 1 and re.match(pattern, lines[0]), (override, lines)
    # A corpus prepared with a tokenizer brings it: the run needs no data.tokenizer, and records its digest.
    cfg = config.load(_cfg_path(tmp_path, bpe_corpus, vocab=2048), [f"workdir={tmp_path / 'bpe'}"])
    assert inputs.tokenizer_spec(cfg.data) == str(bpe_corpus / "tokenizer.json")
    assert inputs.tokenizer_sha256(cfg.data) == hashlib.sha256(BPE.read_bytes()).hexdigest()
    assert inputs.element_spec(cfg.data, 0) == {"tokens": ((LENGTH + 1,), np.dtype(np.uint16))}


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_corrupt_token_mid_run_stops_it_naming_the_shard_and_the_last_checkpoint(bpe_corpus, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    shutil.copytree(bpe_corpus, corpus)
    path = _cfg_path(tmp_path, corpus, vocab=2048)
    # The window the run reads first at step 6 (batch 5), found as the loader will find it.
    source = TokenSource(str(corpus), "train", LENGTH)
    window = int(HostLoader(source, BATCH, seed=0).indices(5)[0])
    shard = corpus / source.manifest["splits"]["train"]["shards"][0]["tokens"]
    assert len(source.manifest["splits"]["train"]["shards"]) == 1
    good = shard.read_bytes()
    bad = np.frombuffer(good, np.uint16).copy()
    bad[window * LENGTH + 3] = 60000  # beyond the 2048 of the model (and of the tokenizer)
    shard.write_bytes(bad.tobytes())
    workdir = tmp_path / "run"
    argv = ["--config", str(path), f"workdir={workdir}", "data.verify=false", "data.workers=2"]
    rc, lines = _main(argv, capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert re.fullmatch(rf"data error: {re.escape(str(shard))}: .*60000.*; last checkpoint saved: step 4", lines[0]), (
        lines[0]
    )
    assert (
        runs.committed_steps(workdir / "checkpoints") == [4] and max(runs.logged_steps(workdir)) == 4
    )  # step 5 ran, unsaved
    saved = _tree_digest(workdir / "checkpoints")
    # With verify on (the default), the same shard is refused when the corpus opens, by its checksum.
    rc, lines = _main(["--config", str(path), f"workdir={workdir}", "--resume"], capsys)
    assert rc == 2 and len(lines) == 1 and str(shard) in lines[0] and "sha256" in lines[0], lines
    assert _tree_digest(workdir / "checkpoints") == saved  # nothing on disk changed
    # The shard mended, the run resumes from step 4 and ends as one that never stopped.
    shard.write_bytes(good)
    rc, lines = _main(["--config", str(path), f"workdir={workdir}", "--resume"], capsys)
    assert rc == 0, lines
    ref = tmp_path / "ref"
    train.run(config.load(path, [f"workdir={ref}"]))
    assert _losses(workdir) == _losses(ref)


def _grain_workers(pid: int) -> list[int]:
    """The data workers below the training process `pid` (not multiprocessing's resource tracker)."""
    found = []
    for child in runs.descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "spawn_main" in cmdline:
            found.append(child)
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_a_worker_killed_by_the_os_stops_the_run_naming_it_and_the_last_checkpoint(byte_corpus, tmp_path, env):
    path = _cfg_path(tmp_path, byte_corpus)
    workdir = tmp_path / "run"
    proc = runs.launch(
        path,
        workdir,
        ["data.workers=2", "train.steps=2000", "checkpoint.every=2", "train.eval_every=0"],
        resume=False,
        env=env,
    )
    try:
        runs.wait_for_step(proc, workdir, 3, timeout=300)
        deadline = time.monotonic() + 30
        while len(workers := _grain_workers(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, err[-3000:]
    assert len(lines) == 1 and re.fullmatch(
        rf"data error: data worker [01] of 2 \(pid {workers[1]}\) .*SIGKILL.* step \d+; last checkpoint saved: step \d+",
        lines[0],
    ), lines
    saved = int(lines[0].rsplit(" ", 1)[1])
    assert saved >= 2 and runs.committed_steps(workdir / "checkpoints")[-1] == saved
    assert runs.still_running(runs.descendants(proc.pid) + workers, wait=10) == []
    # The run resumes from there, without workers.
    result = runs.run_to_end(
        path, workdir, [f"train.steps={saved + 2}", "checkpoint.every=2", "train.eval_every=0"], resume=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert max(runs.logged_steps(workdir)) == saved + 2
