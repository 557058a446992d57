"""The analytic memory model against XLA's figures for the compiled train step, per config.

    python scripts/validate_memory.py [--generated | --ci | --gpu-ci] [--gpu | --targets h100-sxm-8,...]
                                      [--target 0.10] [--json out.json] [experiments/x.yaml ...]

Two sets of configs. **shipped**: every ``experiments/*.yaml`` and the variants in VARIANTS
(remat, microbatches, a rolled layer loop, pipelines over a stage axis, mixtures of experts: MOE). **generated** (:func:`generated`): the NAMED
configs (each a different way of going wrong, vocabularies far wider than the model among them),
then about three dozen drawn with a fixed seed from the shipped ones, varying the family (Transformer, MLP),
the layout (data parallel, a model split, 2-D, a sequence split, FSDP's ``param_layout``), the
sizes (width, heads, layers, length, hidden widths, batch), ``model.remat``,
``train.microbatches``, the dtypes and the optimizer, over meshes of 8 simulated CPU devices
and fewer; nobody tuned the model on them. Default: both sets; ``--generated``: that set only;
``--ci``: the shipped set and a CI-sized slice of the generated one (:func:`ci_slice`); configs
given as arguments: those alone.

For each: :func:`meshpar.plan.memory.analytic.analytic` (nothing compiled) and the real train step
compiled ahead of time on abstract inputs (:func:`meshpar.step.aot.memory`), MiB per device.
Nothing is allocated and no step runs. XLA sees one step program, so the analytic figures are
compared on what that program holds:

* ``state+batch`` — analytic params + optimizer + one batch's slice, against XLA's argument
  bytes (exact but for the stop flags' 4 bytes);
* ``working set`` — analytic gradients + saved activations + workspace (the larger of the
  backward and the update phase), against XLA's temp bytes (an estimate against a measurement);
* ``step total`` — analytic total without the extra resident batches (prefetched and in
  flight) and the relay's copies, which live outside the step program, against XLA's
  argument + output + temp − alias, with the error; ``plan total`` is the analytic total with
  them.

**XLA:GPU** (``--gpu``: the GPU_TARGETS machines; ``--targets``: the topologies named): the same
step compiled for each machine's GPUs by XLA's GPU compiler, deviceless
(:mod:`meshpar.plan.gpu_target`; the ``gpu-plan`` extra), under both of its GEMM lowerings —
``triton`` (its default: matmuls as Triton GEMM fusions) and ``cublas``
(``xla_gpu_enable_triton_gemm`` off: cuBLAS calls, each with its workspace), the lowering checked
in the compiled program (its GEMM custom calls counted) — against the analytic model for that
platform and lowering (traced as the GPU program is: the layer loop's form, the attention
kernel; each matmul's scratch read from XLA:GPU's lowering of it alone:
:func:`meshpar.plan.time.gemm.matmul_scratch`), step total against XLA's total. A mesh with more
devices than the machine is "n/a"; the table's ✗ marks a miss. ``--gpu-ci``:
GPU_CI, a few small configs on GPU_CI_TARGETS, both lowerings, XLA:GPU only (``--ci`` has the XLA:CPU
rows), for CI with the extra installed.

A row passes when its step total is within ``--target`` (default TARGET) of XLA's, on every
platform compiled for. A config the model declares out of its scope on a platform
(:func:`meshpar.plan.memory.analytic.out_of_scope`) is listed with the reason and counts neither way
(``--beyond-scope``: with the model's figure anyway, to see how far off it is there); a
config that cannot be planned (a config, layout or data error) is one line with the error and
counts as a miss; the JSON has every figure (a row's ``gpu``: per machine and lowering). Exit
status: 1 when any row in scope misses the target, else 0; 2 when XLA:GPU columns were asked
for and its compiler is not installed (one line saying how to install it).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import random
import sys
import time
import warnings

import common

# Mixture of experts (meshpar.models.moe) beyond moe_tiny as shipped: other expert counts, top-1,
# every other layer, capacity factors, the experts split over an axis the batch is not split on
# (each device slices its experts' tokens) and replicated, FSDP; dropless dispatch with the experts
# replicated (top-1 of 16 too); full remat, dropless with the experts split and a stage axis (out
# of scope: their rows say why).
MOE = [
    ["model.moe_experts=4", "model.moe_top_k=1"],
    ["model.moe_every=2", "model.n_layers=4"],
    ["model.moe_capacity_factor=2.0"],
    ["model.moe_experts=16", "model.moe_group_size=64", "model.moe_capacity_factor=1.0"],
    ["layout=batch:data; experts:expert"],
    ["layout=batch:(data,expert)"],
    ["param_layout=embed:data"],
    ["model.remat=full"],
    ["model.moe_dispatch=dropless", "layout=batch:(data,expert)"],
    ["model.moe_dispatch=dropless", "layout=batch:(data,expert)", "model.moe_top_k=1", "model.moe_experts=16"],
    ["model.moe_dispatch=dropless", "model.moe_every=2", "model.n_layers=4"],
    ["mesh=data:2,stage:2,expert:2", "layout=batch:data; layers:stage; experts:expert", "train.microbatches=2"],
]
# The microbatch / remat variants, and the layer loop run as a loop (what accelerators do by default).
VARIANTS = [
    ("experiments/quickstart.yaml", ["train.microbatches=4", "model.remat=full"]),
    ("experiments/quickstart.yaml", ["model.remat=dots"]),
    ("experiments/quickstart.yaml", ["model.remat=full"]),
    ("experiments/transformer_fsdp.yaml", ["train.microbatches=2"]),
    ("experiments/mlp_data_parallel.yaml", ["model.remat=full"]),
    ("experiments/mlp_model_parallel.yaml", ["train.microbatches=4"]),
    ("experiments/quickstart.yaml", ["model.scan_unroll=1"]),
    # a stage axis (meshpar.plan.memory.stage_axis): other layer counts, stages, microbatches, repeats, widths
    ("experiments/transformer_pipeline.yaml", ["train.microbatches=4"]),
    ("experiments/transformer_pipeline.yaml", ["model.n_layers=8"]),
    ("experiments/transformer_pipeline.yaml", ["model.d_model=256", "model.d_ff=1024"]),
    ("experiments/transformer_pipeline.yaml", ["mesh=data:1,stage:4,model:2", "model.n_layers=8"]),
    ("experiments/transformer_pipeline.yaml", ["model.remat=full"]),
    ("experiments/transformer_pipeline.yaml", ["pipeline.schedule=circular", "pipeline.repeats=2", "model.n_layers=8"]),
    ("experiments/transformer_pipeline.yaml", ["mesh=data:2,stage:4,model:1", "train.microbatches=4"]),
    *[("experiments/moe_tiny.yaml", o) for o in MOE],
]
TARGET = 0.10  # |analytic − XLA| / XLA on the step total
GPU_TARGETS = ("h100-sxm-8", "h200-sxm-8")  # --gpu: XLA:GPU columns for these machines
GPU_CI_TARGETS = ("h100-sxm-8",)
# XLA:GPU's GEMM lowerings: its default (Triton GEMM fusions) and cuBLAS's library calls.
LOWERINGS = {"triton": {}, "cublas": {"xla_gpu_enable_triton_gemm": False}}
# What each lowering's GEMMs look like in the compiled program (a custom call's target, a fusion's kind).
GEMM_MARKS = {
    "triton": ("__triton_gemm", "__triton_nested_gemm_fusion"), "cublas": ("__cublas$lt$matmul", "__cublas$gemm"),
}  # fmt: skip
SEED = 20240611  # the generated set: the same configs on every run
GENERATED = 40  # configs in the generated set before its Llama draws (NAMED first, then drawn)
LLAMA_SEED, LLAMA_GENERATED = 20261202, 10  # the generated set's Llama configs
CI_GENERATED = 6  # of which --ci compiles this many, the cheapest of distinct layouts

TRANSFORMER = "experiments/quickstart.yaml"
MLP = "experiments/mlp_data_parallel.yaml"
LLAMA = "experiments/llama_tiny.yaml"
_TEXT = ["data.max_bytes=200000"]  # the element spec is all a compile needs: read little
# Layouts by kind: (mesh, layout, param_layout or None). Sequence splits put `length` on an axis.
TRANSFORMER_LAYOUTS = {
    "data": [("data:8", "batch:data", None), ("data:4", "batch:data", None), ("data:2", "batch:data", None)],
    "model": [("model:8", "d_ff:model; heads:model; vocab:model", None),
              ("model:4", "d_ff:model; heads:model; vocab:model", None),
              ("model:2", "d_ff:model; heads:model; vocab:model", None)],
    "2d": [("data:4,model:2", "batch:data; d_ff:model; heads:model; vocab:model", None),
           ("data:2,model:4", "batch:data; d_ff:model; heads:model; vocab:model", None),
           ("rows:4,cols:2", "embed:rows; d_ff:cols; heads:cols; vocab:cols", None)],
    "sequence": [("data:4,model:2", "batch:data; length:model", None),
                 ("data:2,model:4", "batch:data; length:model", None),
                 ("seq:4", "length:seq", None)],
    "fsdp": [("data:8", "batch:data", "embed:data"),
             ("data:4,model:2", "batch:data; d_ff:model; heads:model; vocab:model", "embed:data"),
             ("data:4", "batch:data", "embed:data; d_ff:data")],
}  # fmt: skip
MLP_LAYOUTS = {
    "data": [("data:8", "batch:data", None), ("data:4", "batch:data", None)],
    "model": [("model:8", "hidden:model", None), ("data:4,model:2", "batch:data; hidden:model", None),
              ("b1:2,b2:2", "pixels:(b1,b2)", None)],
    "2d": [("data:2,model:4", "batch:data; hidden:model", None), ("data:4,model:2", "batch:data; hidden_2:model", None)],
    "fsdp": [("data:8", "batch:data", "hidden:data"), ("data:4,model:2", "batch:data; hidden:model", "pixels:data")],
}  # fmt: skip

# Named first: configs nobody tuned the model on, each a different way of going wrong.
NAMED = [
    # (a) a wider 4-layer Transformer LM on a 2 x 4 mesh
    (TRANSFORMER, ["mesh=data:2,model:4", "model.d_model=256", "model.n_heads=8", "model.d_head=32",
                   "model.d_ff=1024", "model.n_layers=4", "train.batch_size=16", *_TEXT]),
    # (b) FSDP with full remat at length 256
    ("experiments/transformer_fsdp.yaml", ["model.remat=full", "data.length=256", "model.max_length=256", *_TEXT]),
    # (c) a sequence split with gradient accumulation
    (TRANSFORMER, ["layout=batch:data; length:model", "train.microbatches=2", *_TEXT]),
    # (d) a wide MLP on model:8, SGD, batch 1024
    (MLP, ["mesh=model:8", "layout=hidden:model", "model.hidden=[4096,1024]", "optimizer.name=sgd",
           "train.batch_size=1024"]),
    # (e) bfloat16 compute on a 2-D layout
    ("experiments/transformer_2d.yaml", ["model.compute_dtype=bfloat16", *_TEXT]),
    # (f)-(i) a vocabulary far wider than the model: the tables, their gradients and the logits
    # outweigh the layers. (f) FSDP with GPT-2's 50,257 tokens on data:8
    ("experiments/transformer_fsdp.yaml", ["mesh=data:8", "layout=batch:data", "model.vocab_size=50257",
                                           "model.d_model=192", "model.n_heads=6", "model.d_head=32", "model.d_ff=768",
                                           "data.length=96", "model.max_length=96", "train.batch_size=16", *_TEXT]),
    # (g) the same vocabulary data parallel, full remat, the layer loop run as a loop
    ("experiments/transformer_fsdp.yaml", ["mesh=data:4", "layout=batch:data", "param_layout=",
                                           "model.vocab_size=50257", "model.d_model=128", "model.n_heads=4",
                                           "model.d_head=32", "model.d_ff=512", "model.n_layers=3", "data.length=128",
                                           "model.max_length=128", "train.batch_size=16", "model.remat=full", *_TEXT]),
    # (h) a Llama with Llama 2's 32,000 tokens under FSDP, one key/value head, remat dots
    (LLAMA, ["mesh=data:8", "layout=batch:data", "param_layout=embed:data", "model.vocab_size=32000",
             "model.d_model=128", "model.n_heads=4", "model.n_kv_heads=1", "model.d_head=32", "model.d_ff=384",
             "data.length=128", "model.max_length=128", "train.batch_size=16", "model.remat=dots", *_TEXT]),
    # (i) tied embeddings over a vocabulary split 2 ways, 3 layers, gradient accumulation
    (LLAMA, ["model.vocab_size=32000", "model.tie_embeddings=true", "model.n_layers=3", "train.microbatches=2",
             *_TEXT]),
]  # fmt: skip


_TINY = [
    "model.d_model=64",
    "model.n_heads=4",
    "model.d_head=16",
    "model.d_ff=256",
    "model.max_length=64",
    "data.length=64",
    "train.batch_size=16",
    *_TEXT,
]
# --gpu-ci: small configs, each compiled in seconds, the ways the GPU program differs from XLA:CPU's:
# a layer loop that runs as a loop, a data-parallel all-reduce, FSDP's gathers and reduce-scatters.
GPU_CI = [
    (TRANSFORMER, ["model.n_layers=2", *_TINY]),
    (MLP, ["model.hidden=[512,256]", "data.num_features=256", "train.batch_size=256"]),
    ("experiments/transformer_fsdp.yaml", ["model.n_layers=2", "train.microbatches=2", *_TINY]),
]  # fmt: skip


def _transformer(rng: random.Random, kind: str) -> list[str]:
    mesh, layout, params = rng.choice(TRANSFORMER_LAYOUTS[kind])
    axes = {a: int(n) for a, n in (p.split(":") for p in mesh.split(","))}
    split = max(axes.values()) if kind != "data" else 1  # what heads, d_ff and length must divide by
    rows = axes.get("data", 1)
    heads = rng.choice([h for h in (4, 8, 16) if h % split == 0])
    length = rng.choice([64, 128, 256])
    batch = rng.choice([8, 16, 32])
    microbatches = rng.choice([1, 1, 2, 4])
    while batch // rows % microbatches:
        microbatches //= 2
    out = [
        f"mesh={mesh}", f"layout={layout}", f"model.d_model={rng.choice([64, 128, 256])}",
        f"model.n_heads={heads}", f"model.d_head={rng.choice([16, 32])}", f"model.d_ff={rng.choice([256, 512, 1024])}",
        f"model.n_layers={rng.choice([1, 2, 3, 4])}", f"data.length={length}", f"model.max_length={length}",
        f"train.batch_size={batch}", f"train.microbatches={microbatches}",
        f"model.remat={rng.choice(['none', 'none', 'full', 'dots'])}",
        f"optimizer.name={rng.choice(['adamw', 'adamw', 'sgd'])}", *_TEXT,
    ]  # fmt: skip
    if params:
        out.append(f"param_layout={params}")
    if rng.random() < 0.15:
        out.append("model.param_dtype=bfloat16")
    return out


def _mlp(rng: random.Random, kind: str) -> list[str]:
    mesh, layout, params = rng.choice(MLP_LAYOUTS[kind])
    axes = {a: int(n) for a, n in (p.split(":") for p in mesh.split(","))}
    rows = axes.get("data", 1)
    hidden = rng.choice([[512, 256], [1024, 1024], [2048], [256, 256, 256], [4096, 512]])
    batch = rng.choice([64, 256, 1024])
    microbatches = rng.choice([1, 1, 2, 4])
    while batch // rows % microbatches:
        microbatches //= 2
    out = [
        f"mesh={mesh}", f"layout={layout}", f"model.hidden=[{','.join(map(str, hidden))}]",
        f"data.num_features={rng.choice([784, 256, 1024])}", f"train.batch_size={batch}",
        f"train.microbatches={microbatches}", f"model.remat={rng.choice(['none', 'full', 'dots'])}",
        f"optimizer.name={rng.choice(['adamw', 'sgd'])}", f"model.activation={rng.choice(['relu', 'gelu', 'tanh'])}",
    ]  # fmt: skip
    if params:
        out.append(f"param_layout={params}")
    return out


def _llama(rng: random.Random, kind: str) -> list[str]:
    """A Transformer draw (same layouts and sizes) as a Llama: grouped key/value heads (dividing
    the query heads; split with them where they divide, else whole on every device), SwiGLU's
    width, optionally tied embeddings."""
    # d_ff shares SwiGLU's matrices with embed: FSDP may not put both on one axis
    out = [o if o != "param_layout=embed:data; d_ff:data" else "param_layout=embed:data"
           for o in _transformer(rng, kind) if not o.startswith("model.d_ff=")]  # fmt: skip
    heads = int(next(o for o in out if o.startswith("model.n_heads=")).split("=")[1])
    out += [f"model.n_kv_heads={rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0])}",
            f"model.d_ff={rng.choice([192, 384, 768])}", f"model.tie_embeddings={rng.choice(['false', 'true'])}"]  # fmt: skip
    return out


def generated() -> list[tuple[str, list[str]]]:
    """The generated set: NAMED, then configs drawn with SEED, the layout kinds taken in turn;
    then LLAMA_GENERATED Llama configs drawn with their own seed, the same layout kinds in turn."""
    rng = random.Random(SEED)
    kinds = [("transformer", k) for k in TRANSFORMER_LAYOUTS] + [("mlp", k) for k in MLP_LAYOUTS]
    out = list(NAMED)
    while len(out) < GENERATED:
        family, kind = kinds[(len(out) - len(NAMED)) % len(kinds)]
        out.append((TRANSFORMER, _transformer(rng, kind)) if family == "transformer" else (MLP, _mlp(rng, kind)))
    rng = random.Random(LLAMA_SEED)
    out += [
        (LLAMA, _llama(rng, kind)) for kind in itertools.islice(itertools.cycle(TRANSFORMER_LAYOUTS), LLAMA_GENERATED)
    ]
    return out


def _cost(run: tuple[str, list[str]]) -> int:
    """A rough size of a config's compile and step: its widths, depth, length and batch."""
    from meshpar.configuration import config

    try:
        cfg = config.load(*run)
    except ValueError:
        return 0  # a one-line row: cheap
    m, batch = cfg.model, cfg.train.batch_size
    if hasattr(m, "hidden"):
        return sum(m.hidden) * cfg.data.num_features * batch // 64
    return m.d_model * m.n_layers * cfg.data.length * batch * (m.d_ff + 4 * m.n_heads * m.d_head) // 1024


def ci_slice(runs: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """CI_GENERATED configs of the generated set: the cheapest of each layout (mesh and rules), cheapest first."""
    seen, out = set(), []
    for run in sorted(runs, key=_cost):
        o = dict(x.split("=", 1) for x in run[1])
        key = (run[0], o.get("layout"), o.get("param_layout"))
        if key not in seen:
            seen.add(key)
            out.append(run)
    return out[:CI_GENERATED]


def _family(run: tuple[str, list[str]]) -> str | None:
    from meshpar.configuration import config

    try:
        return config.load(*run).model.name
    except ValueError:
        return None


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _err(analytic: int, xla: int) -> float:
    return (analytic - xla) / xla if xla else 0.0


def _compare(plan, xla: dict) -> dict:
    """The analytic breakdown against one compiled step's figures (see the module docstring)."""
    c = plan.categories
    pairs = {
        "state+batch": (c["params"] + c["optimizer"] + c["inputs"], xla["argument_bytes"]),
        "working set": (c["grads"] + c["activations"] + c.get("workspace", 0), xla["temp_bytes"]),
        "step total": (_step_total(plan), xla["total_bytes"]),
    }
    return {k: {"analytic_bytes": a, "xla_bytes": x, "error": _err(a, x)} for k, (a, x) in pairs.items()}


def _step_total(plan) -> int:
    """The analytic total less what lives outside the step program (queued batches, the relay's copies)."""
    c = plan.categories
    return plan.total - c["queued_inputs"] - c.get("relay_inputs", 0)


def measure(path: str, overrides: list[str], beyond: bool = False) -> dict:
    """One row: the analytic breakdown against XLA's compiled step, or why there is none; with
    `beyond`, the breakdown where the model says it does not hold too (marked ``beyond_scope``)."""
    import jax

    from meshpar.configuration import config
    from meshpar.plan.memory import analytic as memory
    from meshpar.plan.memory import trace
    from meshpar.step import aot, parts

    cfg = config.load(path, [*overrides, "train.progress=false"])
    row = {"config": path, "overrides": overrides}
    reason = memory.out_of_scope(cfg, jax.default_backend())
    if reason and not beyond:
        return {**row, "out_of_scope": reason}
    if reason:
        row["beyond_scope"] = reason
    step = parts.abstract_step(cfg)
    plan = memory.analytic(step)
    xla = aot.memory(step.compile())
    by_label: dict[str, int] = {}  # saved activations by checkpoint_name tag (else the op that makes them)
    for r in trace.saved_activations(step):
        by_label[r.label] = by_label.get(r.label, 0) + r.total
    return {
        **row, "analytic": plan.categories, "exact": sorted(plan.exact),
        "activations_by_label": dict(sorted(by_label.items(), key=lambda kv: -kv[1])),
        "plan_total_bytes": plan.total, "xla": xla, "compare": _compare(plan, xla),
    }  # fmt: skip


def measure_gpu(path: str, overrides: list[str], name: str) -> dict:
    """The config's step compiled for the GPUs of the topology `name` under each of LOWERINGS,
    against the analytic model for that platform and lowering: ``{"compiled_for", "lowerings":
    {lowering: {"analytic", "step_total_bytes", "xla", "compare", "gemm_calls"}}}``; ``{"n/a": why}``
    when the mesh does not fit the machine, ``{"out_of_scope": why}``, or ``{"error": why}`` (a miss)."""
    from meshpar.backend import compile_cache, xla_flags
    from meshpar.configuration import config
    from meshpar.plan import gpu_target, topology
    from meshpar.plan.memory import analytic as memory
    from meshpar.sharding import mesh as mesh_lib
    from meshpar.step import aot, parts

    try:
        cfg = config.load(path, [*overrides, "train.progress=false"])
    except ValueError as e:
        return {"error": " ".join(str(e).split())}
    topo = topology.load(name)
    target = gpu_target.target(topo, cfg.mesh)
    if target.devices is None:
        try:
            needed = mesh_lib.cpu_device_count(cfg.mesh)
        except mesh_lib.MeshError:
            needed = 0
        why = "mesh larger than the machine" if needed > topo.num_devices else "mesh cannot be laid over the machine"
        return {"n/a": why}
    reason = memory.out_of_scope(cfg, "gpu")
    if reason:
        return {"out_of_scope": reason}
    try:
        step = parts.abstract_step(cfg, devices=target.devices)
        lowered = step.lower()
        out = {"compiled_for": target.compiled_for, "lowerings": {}}
        for lowering, lowering_options in LOWERINGS.items():
            options = {**step.compiler_options, **lowering_options}  # the config's XLA flags, then the lowering's
            plan = memory.analytic(step, compiler_options=options)  # the matmuls' lowering follows the options
            with compile_cache.suspended():  # a compile-only client cannot load cached programs back
                compiled = xla_flags.compile(lowered, options)
            text = compiled.as_text()
            calls = {k: sum(text.count(m) for m in marks) for k, marks in GEMM_MARKS.items()}
            xla = aot.memory(compiled)
            out["lowerings"][lowering] = {
                "analytic": plan.categories, "step_total_bytes": _step_total(plan), "xla": xla,
                "compare": _compare(plan, xla), "gemm_calls": calls,
            }  # fmt: skip
    except (ValueError, RuntimeError) as e:  # a config XLA:GPU or the model refuses (JaxRuntimeError included)
        return {"error": " ".join(str(e).split())}
    return out


def _name(path: str, overrides: list[str]) -> str:
    shown = [o for o in overrides if o not in _TEXT]
    return path.removeprefix("experiments/").removesuffix(".yaml") + "".join(f" {o}" for o in shown)


def _table(title: str, rows: list[dict], target: float):
    from rich.table import Table

    table = Table(title=title)
    for name in ("experiment", "params", "grads", "optimizer", "activations", "workspace", "inputs"):
        table.add_column(name, justify="left" if name == "experiment" else "right", overflow="fold")
    for name in ("state+batch vs argument", "working set vs temp", "step total vs XLA total", "plan total"):
        table.add_column(name, justify="right")
    for r in rows:
        name = _name(r["config"], r["overrides"])
        if "error" in r or "out_of_scope" in r:
            text = f"cannot plan: {r['error']}" if "error" in r else f"out of scope: {r['out_of_scope']}"
            table.add_row(name, text, *[""] * 9)
            continue
        c, cmp = r["analytic"], r["compare"]

        def pair(k, cmp=cmp):
            a, x, e = cmp[k]["analytic_bytes"], cmp[k]["xla_bytes"], cmp[k]["error"]
            mark = " ✗" if k == "step total" and abs(e) > target else ""
            return f"{_mib(a)} / {_mib(x)} ({e:+.1%}){mark}"

        inputs = c["inputs"] + c["queued_inputs"] + c.get("relay_inputs", 0)
        table.add_row(
            name, *(_mib(c.get(k, 0)) for k in ("params", "grads", "optimizer", "activations", "workspace")),
            _mib(inputs), pair("state+batch"), pair("working set"), pair("step total"), _mib(r["plan_total_bytes"]),
        )  # fmt: skip
    return table


def _passes(r: dict, target: float) -> bool | None:
    """True within target, False a miss (or unplannable), None out of scope."""
    if "out_of_scope" in r or "beyond_scope" in r:
        return None
    return "error" not in r and abs(r["compare"]["step total"]["error"]) <= target


def _gpu_columns(targets) -> list[tuple[str, str]]:
    return [(t, lowering) for t in targets for lowering in LOWERINGS]


def _gpu_verdicts(r: dict, targets, target: float) -> dict:
    """(machine, lowering) -> True within target, False a miss (or an error), None n/a or out of scope."""
    out = {}
    for t, lowering in _gpu_columns(targets):
        cell = r.get("gpu", {}).get(t, {})
        if "n/a" in cell or "out_of_scope" in cell:
            out[t, lowering] = None
        elif "error" in cell or "error" in r:
            out[t, lowering] = False
        else:
            out[t, lowering] = abs(cell["lowerings"][lowering]["compare"]["step total"]["error"]) <= target
    return out


def _not_in_effect(cell: dict, lowering: str) -> bool:
    """The cuBLAS lowering asked for, and the compiled program still has Triton GEMMs but no cuBLAS call."""
    calls = cell["lowerings"][lowering]["gemm_calls"]
    return lowering == "cublas" and not calls["cublas"] and calls["triton"] > 0


def _gpu_table(title: str, rows: list[dict], targets, target: float):
    """Step totals, MiB per device: the analytic model and XLA:CPU's, then the analytic model and
    XLA:GPU's for each machine and lowering (the error: analytic − XLA, over XLA)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("experiment", overflow="fold")
    table.add_column("analytic / XLA:CPU", justify="right")
    for t, lowering in _gpu_columns(targets):
        table.add_column(f"{t} {lowering}: analytic / XLA:GPU", justify="right")
    for r in rows:
        name = _name(r["config"], r["overrides"])
        if "error" in r:
            cpu = "cannot plan"
        elif "out_of_scope" in r:
            cpu = "out of scope"
        elif "compare" not in r:
            cpu = "not compiled"
        else:
            cmp = r["compare"]["step total"]
            mark = " ✗" if abs(cmp["error"]) > target else ""
            cpu = f"{_mib(cmp['analytic_bytes'])} / {_mib(cmp['xla_bytes'])} ({cmp['error']:+.1%}){mark}"
        cells = []
        for t, lowering in _gpu_columns(targets):
            cell = r.get("gpu", {}).get(t, {})
            if "n/a" in cell:
                cells.append(f"n/a ({cell['n/a']})")
            elif "out_of_scope" in cell:
                cells.append("out of scope")
            elif "error" in cell:
                cells.append(f"cannot plan: {cell['error'][:60]}")
            else:
                cmp = cell["lowerings"][lowering]["compare"]["step total"]
                mark = " ✗" if abs(cmp["error"]) > target else ""
                mark += " (no cuBLAS call: lowering not in effect)" if _not_in_effect(cell, lowering) else ""
                cells.append(f"{_mib(cmp['analytic_bytes'])} / {_mib(cmp['xla_bytes'])} ({cmp['error']:+.1%}){mark}")
        table.add_row(name, cpu, *cells)
    return table


def _spread(errors: list[float]) -> str:
    return f"{min(errors):+.1%}..{max(errors):+.1%}" if errors else "none"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", help="experiment YAMLs (default: the shipped and the generated set)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--generated", action="store_true", help="the generated set only")
    which.add_argument("--ci", action="store_true", help="the shipped set and a CI-sized slice of the generated one")
    which.add_argument(
        "--gpu-ci",
        action="store_true",
        help=f"GPU_CI's configs, XLA:GPU only, for {', '.join(GPU_CI_TARGETS)} (CI, the gpu-plan extra)",
    )
    parser.add_argument("--gpu", action="store_true", help=f"add XLA:GPU columns for {', '.join(GPU_TARGETS)}")
    parser.add_argument("--targets", help="add XLA:GPU columns for these GPU topologies (comma-separated)")
    parser.add_argument("--target", type=float, default=TARGET, help=f"|error| a row may have (default {TARGET})")
    parser.add_argument("--family", help="only the configs of this model family (e.g. llama)")
    parser.add_argument("--json", help="write the rows here as JSON")
    parser.add_argument(
        "--beyond-scope",
        action="store_true",
        help="also give the model's figure where it says it does not hold (counted neither way: how far off it is)",
    )
    args = parser.parse_args(argv)
    targets: tuple[str, ...] = ()
    if args.targets:
        targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    elif args.gpu:
        targets = GPU_TARGETS
    elif args.gpu_ci:
        targets = GPU_CI_TARGETS
    if targets:
        from meshpar.plan import gpu_target

        why = gpu_target.missing()
        if why:
            print(f"XLA:GPU columns asked for: {why}", file=sys.stderr)
            return 2
        # a compile-only client cannot read back what the persistent cache holds: harmless, and said per compile
        warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
    shipped = [(p, []) for p in sorted(glob.glob("experiments/*.yaml"))] + VARIANTS
    if args.configs:
        sets = {"given": [(p, []) for p in args.configs]}
    elif args.generated:
        sets = {"generated": generated()}
    elif args.ci:
        sets = {"shipped": shipped, "generated (CI slice)": ci_slice(generated())}
    elif args.gpu_ci:
        sets = {"GPU CI": GPU_CI}
    else:
        sets = {"shipped": shipped, "generated": generated()}

    from meshpar.configuration import config
    from meshpar.sharding import mesh

    if args.family:
        sets = {k: [r for r in runs if _family(r) == args.family] for k, runs in sets.items()}
    counts = []
    for runs in sets.values():
        for p, o in runs:
            try:
                counts.append(mesh.cpu_device_count(config.load(p, o).mesh))
            except ValueError:  # reported on its row
                pass
    mesh.request_cpu_devices(max(counts, default=1))
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 240)
    start, failed = time.perf_counter(), False
    out = {"target": args.target, "seed": SEED, "gpu_targets": list(targets), "lowerings": LOWERINGS, "sets": {}}
    summary = []
    for title, runs in sets.items():
        rows = []
        for path, overrides in runs:
            try:
                row = (
                    measure(path, overrides, args.beyond_scope)
                    if not args.gpu_ci
                    else {"config": path, "overrides": overrides}
                )
            except ValueError as e:  # ConfigError, LayoutError, MeshError, DataError, a model's refusal
                row = {"config": path, "overrides": overrides, "error": " ".join(str(e).split())}
            if targets:
                row["gpu"] = {t: measure_gpu(path, overrides, t) for t in targets}
            rows.append(row)
        if not args.gpu_ci:  # --gpu-ci: XLA:GPU only (--ci has the XLA:CPU rows)
            verdicts = [_passes(r, args.target) for r in rows]
            scoped = [v for v in verdicts if v is not None]
            failed |= not all(scoped)
            console.print(_table(f"{title}: analytic memory model vs XLA's compiled train step, MiB per device", rows,
                                 args.target))  # fmt: skip
            reasons = sorted({r["out_of_scope"] for r in rows if "out_of_scope" in r})
            cpu_errors = [
                r["compare"]["step total"]["error"] for r in rows if "compare" in r and "beyond_scope" not in r
            ]
            line = f"{title}: {sum(scoped)}/{len(scoped)} within {args.target:.1%} of XLA's total"
            line += f" (XLA:CPU spread {_spread(cpu_errors)})"
            line += f"; out of scope: {len(rows) - len(scoped)}" + (f" ({'; '.join(reasons)})" if reasons else "")
            beyond = [r for r in rows if "beyond_scope" in r and "compare" in r]
            if beyond:  # --beyond-scope: how far off the model is where it says it does not hold
                line += "; beyond its scope: " + ", ".join(
                    f"{_name(r['config'], r['overrides'])} {r['compare']['step total']['error']:+.1%}" for r in beyond
                )
            summary.append(line)
        if targets:
            console.print(_gpu_table(f"{title}: step total, analytic vs XLA:CPU and XLA:GPU, MiB per device", rows,
                                     targets, args.target))  # fmt: skip
            gpu = [_gpu_verdicts(r, targets, args.target) for r in rows]
            for t, lowering in _gpu_columns(targets):
                column = [v[t, lowering] for v in gpu if v[t, lowering] is not None]
                failed |= not all(column)
                errors = [r["gpu"][t]["lowerings"][lowering]["compare"]["step total"]["error"]
                          for r in rows if "lowerings" in r["gpu"][t]]  # fmt: skip
                absent = len(rows) - len(column)
                summary.append(
                    f"{title}: XLA:GPU {t} {lowering}: {sum(column)}/{len(column)} within "
                    f"{args.target:.1%} (spread {_spread(errors)}); n/a or out of scope: {absent}"
                )
            cells = [c for r in rows for c in r["gpu"].values()]
            gpu_reasons = sorted({c.get("out_of_scope") or c.get("n/a") for c in cells} - {None})
            if gpu_reasons:
                summary.append(f"{title}: XLA:GPU n/a or out of scope: {'; '.join(gpu_reasons)}")
        out["sets"][title] = rows
    for line in summary:
        console.print(line)
    console.print(f"{time.perf_counter() - start:.0f} s")
    if args.json:
        common.write_json(args.json, out, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
