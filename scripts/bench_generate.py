"""Text generation with the key/value cache against a baseline without it: greedy tokens per
second, and whether the two make the same tokens.

For each run and each batch size B (B copies of one prompt, so all rows are the same length and
nothing is padded), in this one process, on the run's mesh and layout (or the overrides'):

- ``cached``: :func:`meshpar.run.decoding.generate`, greedy, N new tokens, the end-of-sequence stop
  off: one jitted prefill, then one jitted decode step per token with the cache donated;
- ``baseline``: the same greedy generation without a cache: each new token is one jitted full
  forward pass of the same model (the same parameters, mesh and the run's own layout) over a
  fixed window of prompt + N positions, the tokens so far right-padded (the causal mask makes
  the padding irrelevant), the next token the argmax of the logits at the last real position,
  written into the window on the device. Its first call is its "prefill". It dispatches each
  step before waiting for the one before it, so at most two are in flight, as meshpar's train
  loop does: with simulated CPU devices, more in flight can deadlock XLA's CPU collectives
  (observed here: the uncached steps dispatched all at once aborted after the 40 s rendezvous
  timeout); the devices still never wait on the host.

Both are compiled and run once (warm-up), then timed ``--repeats`` times, in rounds of one run
of each, the order reversed every other round (a slow drift of the machine falls on both alike).
Reported per row, medians over the repeats, wall clock (``time.perf_counter``; compilation not
counted): the prefill ms, decode tokens/s = B·(N−1) / the seconds of the N−1 later tokens,
overall tokens/s = B·N / (prefill + decode), and the ratio cached / baseline of both. Rows are
padded to a multiple of the mesh axes ``batch`` is split over (copies of the prompt), as
``generate`` pads them, in both arms; only the B asked for are counted.

Target: the cached decode is faster than the baseline's (ratio > 1) in every row, and the two
make the same tokens; exit 1 naming the row that misses, else 0; 2 with one line for a config
error (as ``python -m meshpar.generate``). Prints a table and writes JSON.

    python scripts/bench_generate.py --workdir runs/quickstart --workdir runs/llama_tiny
    python scripts/bench_generate.py --workdir runs/quickstart --batch 1,8 --new-tokens 64 --repeats 3 \\
        --json runs/bench_generate.json mesh=data:8 layout=batch:data

Every run's mesh must need the same number of devices: on CPU the simulated devices are set up
once, when the first run's generator opens (nothing here starts JAX's backend before that).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import common
import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workdir", type=pathlib.Path, action="append", required=True, help="a run's workdir (repeat for several)"
    )
    p.add_argument("--prompt", default="def ", help="the prompt every row continues")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes (copies of the prompt)")
    p.add_argument("--new-tokens", type=int, default=64, help="N: new tokens per row")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", "--out", dest="out", default="runs/bench_generate.json", help="where the JSON goes")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides for every run, as for meshpar.generate",
    )
    return p.parse_intermixed_args(argv)


def baseline_step(gen, rows: int, window: int):
    """The compiled uncached step ``(params, tokens [rows, window], last) → (tokens, token)``:
    one full forward pass over the window, the greedy token after position ``last`` written at
    ``last + 1`` (the tokens donated), and a ``token [rows]`` for the first of them (on the run's
    own layout: the window is a training-like sequence)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from meshpar.sharding import layout as layout_lib

    layout, mesh, graphdef = gen.layout, gen.mesh, gen.graphdef

    def step(params, tokens, last):
        with layout_lib.activate(layout, mesh):
            logits = nnx.merge(graphdef, params)(tokens)  # [rows, window, vocab] float32
            at = jax.lax.dynamic_index_in_dim(logits, last, axis=1, keepdims=False)  # [rows, vocab]
            token = jnp.argmax(at, axis=-1).astype(jnp.int32)
            write = jnp.minimum(last + 1, window - 1)  # the last token has no later slot to fill
            tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, write))
            return tokens, token

    token_sharding = layout.sharding(mesh, ("batch", "length"))
    batch = layout.sharding(mesh, ("batch",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params_sharding = jax.tree.map(lambda x: x.sharding, gen.params)
    jitted = jax.jit(step, in_shardings=(params_sharding, token_sharding, replicated),
                     out_shardings=(token_sharding, batch), donate_argnums=1)  # fmt: skip
    tokens = jax.ShapeDtypeStruct((rows, window), jnp.int32, sharding=token_sharding)
    return jitted.lower(gen.params, tokens, jnp.int32(0)).compile(), token_sharding


def run_baseline(gen, step, token_sharding, prompt: np.ndarray, rows: int, window: int, new: int):
    """One uncached greedy generation: (first-token seconds, later-tokens seconds, tokens [rows, new])."""
    import jax
    import jax.numpy as jnp

    tokens = np.zeros((rows, window), np.int32)
    tokens[:, : len(prompt)] = prompt
    tokens = jax.device_put(tokens, token_sharding)
    lasts = [jnp.int32(len(prompt) - 1 + i) for i in range(new)]  # placed before the clock starts
    jax.block_until_ready(lasts)
    t0 = time.perf_counter()
    tokens, token = step(gen.params, tokens, lasts[0])
    token.block_until_ready()
    t1 = time.perf_counter()
    for last in lasts[1:]:
        previous = token
        tokens, token = step(gen.params, tokens, last)
        previous.block_until_ready()  # at most two steps in flight (see the module docstring)
    jax.block_until_ready((tokens, token))
    t2 = time.perf_counter()
    made = np.asarray(tokens)[:, len(prompt) : len(prompt) + new]
    return t1 - t0, t2 - t1, made


def bench_row(gen, prompt: np.ndarray, b: int, new: int, repeats: int) -> dict:
    from meshpar.run import decoding

    rows = -(-b // gen.layout.axis_size("batch")) * gen.layout.axis_size("batch")
    length_split = gen.layout.axis_size("length")
    window = -(-(len(prompt) + new) // length_split) * length_split
    prompts = [prompt] * b
    greedy = decoding.Sampling()

    started = time.perf_counter()
    step, token_sharding = baseline_step(gen, rows, window)
    baseline_compile_s = time.perf_counter() - started

    def cached():
        r = decoding.generate(gen, prompts, new, greedy, stop_at_eos=False)
        return r.prefill_s, r.decode_s, np.stack(r.tokens), r

    def baseline():
        first, later, made = run_baseline(gen, step, token_sharding, prompt, rows, window, new)
        return first, later, made[:b], None

    warm = cached()  # compiles the prefill and the decode step, then runs them once
    compile_s = warm[3].compile_s
    baseline()
    runs = {"cached": [], "baseline": []}
    arms = {"cached": cached, "baseline": baseline}
    for i in range(repeats):
        for arm in ("cached", "baseline") if i % 2 == 0 else ("baseline", "cached"):
            runs[arm].append(arms[arm]())
    out = {"batch": b, "rows": rows, "prompt_tokens": len(prompt), "new_tokens": new, "cache_slots": warm[3].slots,
           "window": window, "compile_s": {"cached": compile_s, "baseline": baseline_compile_s}}  # fmt: skip
    for arm, made in runs.items():
        prefill = [r[0] for r in made]
        decode = [r[1] for r in made]
        out[arm] = {
            "prefill_ms": statistics.median(prefill) * 1e3,
            "decode_s": statistics.median(decode),
            "decode_tokens_per_s": statistics.median(b * (new - 1) / d for d in decode) if new > 1 else float("nan"),
            "tokens_per_s": statistics.median(b * new / (p + d) for p, d in zip(prefill, decode)),
            "prefill_s_each": prefill,
            "decode_s_each": decode,
        }
    tokens_cached = [r[2] for r in runs["cached"]]
    tokens_base = [r[2] for r in runs["baseline"]]
    same = all(np.array_equal(t, tokens_base[0]) for t in tokens_cached + tokens_base)
    out["same_tokens"] = same
    if not same:
        a, c = tokens_cached[0], tokens_base[0]
        diff = np.argwhere(a != c)
        out["first_difference"] = {"row": int(diff[0][0]), "token": int(diff[0][1])} if len(diff) else None
    out["tokens"] = tokens_cached[0][0].tolist()
    out["text"] = gen.tokenizer.decode(out["tokens"])
    out["decode_ratio"] = out["cached"]["decode_tokens_per_s"] / out["baseline"]["decode_tokens_per_s"]
    out["overall_ratio"] = out["cached"]["tokens_per_s"] / out["baseline"]["tokens_per_s"]
    return out


def bench_run(workdir: pathlib.Path, args, batches: list[int]) -> dict:
    from meshpar.run import decoding

    cfg, saved = decoding.run_config(workdir, args.overrides)
    gen = decoding.open_generator(cfg, run=saved)  # makes the mesh: the first thing to start JAX's backend
    (prompt,) = decoding.encode(gen, [args.prompt])
    out = {
        "workdir": str(workdir),
        "model": cfg.model.name,
        "source": gen.source,
        "mesh": ",".join(f"{a}:{n}" for a, n in gen.mesh.shape.items()),
        "layout": str(gen.layout),
        "decode_layout": str(gen.decode_layout),
        "prompt": args.prompt,
        "prompt_ids": prompt.tolist(),
        "rows": [],
    }
    for b in batches:
        out["rows"].append(bench_row(gen, prompt, b, args.new_tokens, args.repeats))
        print(f"{workdir} B={b}: done", file=sys.stderr)
    return out


def print_table(results: list[dict]) -> None:
    columns = [("run", "<20"), ("model", "<11"), ("B", ">3d"), ("rows", ">4d"), ("prompt", ">6d"), ("N", ">4d"),
               ("prefill ms", ">10.1f"), ("cached dec tok/s", ">16,.0f"), ("cached tok/s", ">12,.0f"),
               ("base prefill ms", ">15.1f"), ("base dec tok/s", ">14,.0f"), ("base tok/s", ">10,.0f"),
               ("dec ratio", ">9.2f"), ("all ratio", ">9.2f"), ("same", ">4")]  # fmt: skip
    rows = [
        [pathlib.Path(res["workdir"]).name, res["model"], r["batch"], r["rows"], r["prompt_tokens"], r["new_tokens"],
         r["cached"]["prefill_ms"], r["cached"]["decode_tokens_per_s"], r["cached"]["tokens_per_s"],
         r["baseline"]["prefill_ms"], r["baseline"]["decode_tokens_per_s"], r["baseline"]["tokens_per_s"],
         r["decode_ratio"], r["overall_ratio"], "yes" if r["same_tokens"] else "no"]
        for res in results for r in res["rows"]
    ]  # fmt: skip
    print(common.table(columns, rows))


def main(argv=None) -> int:
    args = parse_args(argv)
    from meshpar.configuration import errors

    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    if args.new_tokens < 2 or args.repeats < 1 or not batches or min(batches) < 1:
        print(
            "bench_generate: --new-tokens must be >= 2 (a decode step to time), --repeats and every --batch >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        results = [bench_run(w, args, batches) for w in args.workdir]
    except Exception as e:  # noqa: BLE001 — a config error is one line (exit 2); anything else re-raised
        return errors.report(e)
    import jax

    device = jax.devices()[0]
    for res in results:
        print(f"{res['workdir']}: {res['source']}; mesh {res['mesh']}, layout {res['layout']} "
              f"(decode layout {res['decode_layout']}); prompt {res['prompt']!r} ({len(res['prompt_ids'])} tokens)")  # fmt: skip
    print(f"greedy, medians of {args.repeats} repeats after a warm-up; tokens/s wall clock, compilation not counted; "
          f"{device.platform}, {jax.device_count()} devices, jax {jax.__version__}")  # fmt: skip
    print_table(results)
    failed = []
    for res in results:
        for r in res["rows"]:
            name = f"{res['workdir']} B={r['batch']}"
            if not r["same_tokens"]:
                failed.append(
                    f"{name}: the cached and baseline greedy tokens differ (first at {r['first_difference']})"
                )
            if not r["decode_ratio"] > 1:
                failed.append(f"{name}: cached decode {r['cached']['decode_tokens_per_s']:,.0f} tokens/s is not faster than "
                              f"the baseline's {r['baseline']['decode_tokens_per_s']:,.0f} (ratio {r['decode_ratio']:.2f})")  # fmt: skip
    same = all(r["same_tokens"] for res in results for r in res["rows"])
    print(f"same tokens: {'yes' if same else 'no'}")
    target = "cached decode tokens/s > baseline decode tokens/s (ratio > 1) in every row, and the same greedy tokens"
    for line in failed:
        print(f"target missed: {line}")
    if not failed:
        print(f"target held: {target}")
    out = common.write_json(args.out, {
        "platform": device.platform, "devices": jax.device_count(), "jax": jax.__version__, "cpus": os.cpu_count(),
        "timing": "wall clock (time.perf_counter), medians over repeats after a warm-up run, compilation not counted",
        "sampling": "greedy", "repeats": args.repeats, "new_tokens": args.new_tokens, "batches": batches,
        "overrides": list(args.overrides), "target": target, "target_held": not failed, "failures": failed,
        "same_tokens": same, "results": results,
    }, indent=1)  # fmt: skip
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
