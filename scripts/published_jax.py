"""Published JAX steps on GPU clusters (``jax_gpu_*.csv``) as meshpar configs on meshpar clusters.

Each row (MaxText or Paxml; columns in the published set's README) becomes:

* the model: ``llama`` (RoPE, RMSNorm, SwiGLU, untied, ``kv_heads``) or Megatron-style GPT in
  ``transformer`` (learned positions, GELU MLP, tied), the row's shapes, float32 parameters with
  bf16 compute, its attention (cuDNN's fused attention for every flash/TE row, XLA's otherwise),
  its layers scanned unless its notes say ``scan_layers=false``;
* the layout: mesh ``data:DP,fsdp:FSDP`` (the data axis across nodes, FSDP within, as the
  sources' ``dcn``/``ici`` split them), the batch over both, parameters ``embed:fsdp``;
* its remat policy by the framework's own name (``model.remat``; MaxText's ``custom`` save list as
  ``model.remat_save``);
* its XLA flags, read from its notes (:func:`flags`) into the config's ``xla.flags``, exactly
  those (``xla.gpu_defaults: false``; a flag the installed jaxlib no longer has is left out);
* its cluster: the GPU's node kind × ``nodes`` × the network its ``network`` column names;
* an ``fp8`` row: its MLP and attention projections as FP8 dots (``model.fp8``: :data:`FP8_KINDS`),
  its fp8 recipe's combine thresholds; beside it its bf16 twin where the rows hold none and its
  source states the bf16 step (:data:`BF16_STEPS`, :func:`twins`).

A row meshpar cannot plan yet (tensor or pipeline parallelism, experts) keeps the reason, and is
reported with a null prediction.
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
import re

from meshpar.backend import xla_flags

COLUMNS = ("id", "framework", "model", "family", "layers", "d_model", "heads", "kv_heads", "d_ff", "vocab", "experts",
           "gpu", "gpus", "nodes", "network", "seq", "global_batch", "precision", "dp", "fsdp", "tp", "ep", "pp",
           "remat", "attention", "step_s", "notes")  # fmt: skip
INTEGERS = ("layers", "d_model", "heads", "kv_heads", "d_ff", "vocab", "experts", "gpus", "nodes", "seq",
            "global_batch", "dp", "fsdp", "tp", "ep", "pp")  # fmt: skip
# The GPU column → meshpar's node kind (one node of 8).
NODE_KINDS = (("H200", "h200-sxm-8"), ("H100", "h100-sxm-8"), ("A100", "a100-sxm-8"))
# The network column (the vendors' words) → meshpar's network file; the first match wins.
NETWORKS = (("A3 Ultra", "gcp-a3-ultra-roce"), ("TCPXO", "gcp-a3-mega-tcpxo"), ("A3 Mega", "gcp-a3-mega-tcpxo"),
            ("TCPX", "gcp-a3-tcpx"), ("DGX A100", "hdr-ib"), ("HDR", "hdr-ib"), ("DGX H100", "ndr-ib"),
            ("NDR", "ndr-ib"))  # fmt: skip
MAXTEXT_SAVES = {"q": "query_proj", "k": "key_proj", "v": "value_proj", "qkv": "qkv_proj", "out": "out_proj",
                 "mlpwo": "mlpwo", "mlpwi": "mlpwi", "context": "context"}  # fmt: skip
MIB, GIB = 1 << 20, 1 << 30
# An fp8 row's FP8 dots (docs/fp8.md): MaxText's quantization=fp8 makes the decoder layers' dense
# projections Flax FP8 dots (Fp8DotGeneralOp on the MLP's and attention's DenseGeneral), Transformer
# Engine's FP8 layers the QKV, output and MLP GEMMs; in both the embedding, the logits and
# attention's scores and values stay bf16, and FSDP gathers the weights in bf16 (the dot quantizes
# after the gather), so model.fp8_gather stays off. Both scale by delayed scaling: Flax's
# Fp8DotGeneralOp keeps an amax history (amax_history_length 1024) per operand, and Transformer
# Engine's DelayedScaling recipe the same (amax_history_len 1024, its default), as meshpar's
# model.fp8_scaling delayed (model.fp8_history's default 1024).
FP8_KINDS = ["mlp", "attention"]
# The bf16 step of an fp8 row's run that no row holds, as its source states it: fp8 row id -> s.
# mx10: NVIDIA/dgxc-benchmarking maxtext/README_70b.md @ 35a9aecc (mx10's source), its BF16 table
# "Maxtext LLama2 70b BF16", 64x H100 (FSDP=64 GBS=128): 6.999 s per step.
BF16_STEPS = {"mx10": 6.999}
# A row's work, the same for an fp8 row and its bf16 partner: framework, model, GPU, GPUs, seq, batch.
WORK = ("framework", "model", "gpu", "gpus", "seq", "global_batch")


class InputError(Exception):
    """A published-row file or folder that cannot be read as this script needs it."""


@dataclasses.dataclass(frozen=True)
class Row:
    source: str  # "vtrain" | "jax"
    name: str  # one line naming the row
    group: str  # rows of one model and batch on one machine
    topology: str  # the node kind (or a whole machine)
    config: dict  # the meshpar config (a plain mapping, as a YAML file would hold)
    measured_s: float
    id: str = ""
    nodes: int | None = None  # a cluster of this many nodes of `topology`
    network: str | None = None
    series: str = ""  # rows of the same work per GPU on growing node counts (weak scaling)
    unplannable: str = ""  # why meshpar cannot plan this row yet ("" if it can)
    precision: str = "bf16"  # the matmuls' precision: bf16 | fp8
    work: str = ""  # the same for an fp8 row and its bf16 partner (WORK)
    twin: bool = False  # a bf16 step its source states but no row holds (BF16_STEPS)


def _bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*(GiB|MiB|bytes)?", text.strip())
    if not m:
        raise ValueError(text)
    return int(m.group(1)) * {"GiB": GIB, "MiB": MIB}.get(m.group(2) or "bytes", 1)


def _thresholds(notes: str, nodes: int, precision: str) -> dict:
    """Combine thresholds as the notes give them: ``AR/AG combine=1GiB``, ``AR combine=512MiB
    AG=512MiB RS=8MiB``, ``AR=2GiB AG=2GiB RS=32MiB (<64 nodes) or 16MiB (>=64 nodes)``,
    ``AR combine threshold 51200 bytes``; where the notes give ``fp8 thresholds:``, those for an
    fp8 row and the text before them for a bf16 one."""
    text = notes
    if "fp8 thresholds:" in notes:
        before, after = notes.split("fp8 thresholds:", 1)
        text = after if precision == "fp8" else before
    names = {"AR": "xla_gpu_all_reduce_combine_threshold_bytes", "AG": "xla_gpu_all_gather_combine_threshold_bytes",
             "RS": "xla_gpu_reduce_scatter_combine_threshold_bytes"}  # fmt: skip
    out = {}
    size = r"(\d+\s*(?:GiB|MiB|bytes)?)"
    for kinds, value, _ in re.findall(
        rf"\b((?:AR|AG|RS)(?:/(?:AR|AG|RS))*)\s*(?:combine)?(?:\s*threshold)?\s*[= ]\s*{size}(\s*\(<64 nodes\))?", text
    ):  # noqa: E501
        for kind in kinds.split("/"):
            out.setdefault(names[kind], _bytes(value))
    large = re.search(rf"RS={size}\s*\(<64 nodes\) or {size}\s*\(>=64 nodes\)", text)
    if large and nodes >= 64:
        out[names["RS"]] = _bytes(large.group(2))
    return out


# Words in a row's notes → the XLA flags they stand for (values as XLA reads them).
_SWITCHES = (
    (r"LHS(=true| on)", {"xla_gpu_enable_latency_hiding_scheduler": True}),
    (r"triton_gemm=false", {"xla_gpu_enable_triton_gemm": False}),
    (r"highest_priority_async_stream", {"xla_gpu_enable_highest_priority_async_stream": True}),
    (r"pipelined (?:AG/RS/AR|collectives)", {"xla_gpu_enable_pipelined_all_gather": True,
                                             "xla_gpu_enable_pipelined_reduce_scatter": True,
                                             "xla_gpu_enable_pipelined_all_reduce": True}),
    (r"while[_ -]loop[_ -]double[_ -]buffering(?!=false)", {"xla_gpu_enable_while_loop_double_buffering": True}),
    (r"combine_by_dim=false", {"xla_gpu_enable_all_gather_combine_by_dim": False,
                               "xla_gpu_enable_reduce_scatter_combine_by_dim": False}),
    (r"rematerialization (?:pass )?disabled|xla_disable_hlo_passes=rematerialization",
     {"xla_disable_hlo_passes": "rematerialization"}),
)  # fmt: skip


def flags(notes: str, nodes: int, precision: str = "bf16") -> dict:
    """The XLA flags a row's notes say its run used (in `precision`)."""
    out = {}
    for pattern, values in _SWITCHES:
        if re.search(pattern, notes):
            out.update(values)
    out.update(_thresholds(notes, nodes, precision))
    return out


def remat(text: str) -> dict:
    """The row's remat policy as ``model`` settings: the framework's name, or MaxText's
    ``custom`` with its save list (``custom (q/k/v/qkv/out proj + mlpwo saved on device)``)."""
    if text.startswith("custom"):
        listed = re.findall(r"[a-z]+", text[text.index("(") : text.index("saved")].replace("proj", ""))
        return {"remat": "custom", "remat_save": [MAXTEXT_SAVES[w] for w in listed if w in MAXTEXT_SAVES]}
    if "SAVE_NOTHING" in text:
        return {"remat": "SAVE_NOTHING"}
    return {"remat": re.match(r"[A-Za-z_]+", text).group(0)}


def _lookup(table, text: str, what: str, path: str) -> str:
    for words, name in table:
        if words in text:
            return name
    raise InputError(f"{path}: {what} {text!r} is none meshpar knows")


def _model(r: dict, n: dict) -> dict:
    attention = "xla" if r["attention"].startswith("xla") else "cudnn"
    common = {"n_layers": n["layers"], "d_model": n["d_model"], "n_heads": n["heads"], "d_ff": n["d_ff"],
              "d_head": n["d_model"] // n["heads"], "vocab_size": n["vocab"], "max_length": n["seq"],
              "param_dtype": "float32", "compute_dtype": "bfloat16", "attention": attention,
              "scan_layers": "scan_layers=false" not in r["notes"], **remat(r["remat"])}  # fmt: skip
    if r["precision"] == "fp8":
        common.update(fp8=FP8_KINDS, fp8_scaling="delayed")
    if r["family"] == "llama":
        return {"name": "llama", "n_kv_heads": n["kv_heads"], **common}
    return {"name": "transformer", "positions": "learned", "tie_embeddings": True, **common}


def _why_not(n: dict, r: dict) -> str:
    if r["precision"] not in ("bf16", "fp8"):
        return f"{r['precision']} matmuls: not mapped from these rows (bf16, fp8)"
    if n["tp"] > 1 or n["pp"] > 1 or n["ep"] > 1 or n["experts"]:
        return "tensor, pipeline or expert parallelism: not mapped from these rows yet"
    return ""


def read(path: pathlib.Path, columns: tuple[str, ...], nonempty: tuple[str, ...] = ()) -> list[dict]:
    """A published CSV's rows, as mappings; a column missing, or one of `nonempty` empty in a row,
    is an InputError naming it."""
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in columns if c not in (reader.fieldnames or [])]
            if missing:
                raise InputError(f"{path.name}: column {missing[0]!r} is missing (expected {', '.join(columns)})")
            rows = list(reader)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    for i, r in enumerate(rows, 2):
        for c in nonempty:
            if r.get(c) in (None, ""):
                raise InputError(f"{path.name}: line {i}: column {c!r} is empty")
    return rows


def _row(r: dict, path: str, line: int, twin: bool = False) -> Row:
    """One CSV row (`r`, at `line` of `path`) as a meshpar config on its cluster."""
    try:
        n = {c: int(r[c] or 0) for c in INTEGERS}
        measured = float(r["step_s"])
    except ValueError as e:
        raise InputError(f"{path}: line {line}: {e}") from None
    if n["dp"] * n["fsdp"] * n["tp"] * n["ep"] * n["pp"] != n["gpus"] or n["gpus"] % n["nodes"]:
        raise InputError(
            f"{path}: line {line}: dp x fsdp x tp x ep x pp is not gpus {n['gpus']} over {n['nodes']} nodes"
        )
    node = _lookup(NODE_KINDS, r["gpu"], "gpu", path)
    network = _lookup(NETWORKS, r["network"], "network", path)
    mesh = ",".join(f"{a}:{s}" for a, s in (("data", n["dp"]), ("fsdp", n["fsdp"])) if s > 1) or "data:1"
    batch = "(data,fsdp)" if n["dp"] > 1 and n["fsdp"] > 1 else "fsdp" if n["fsdp"] > 1 else "data"
    cfg = {"mesh": mesh, "layout": f"batch:{batch}", "model": _model(r, n),
           "data": {"source": "text", "length": n["seq"]},
           "train": {"steps": 1, "batch_size": n["global_batch"], "microbatches": 1},
           "xla": xla_flags.section(xla_flags.known(flags(r["notes"], n["nodes"], r["precision"]))[0])}  # fmt: skip
    if n["fsdp"] > 1:
        cfg["param_layout"] = "embed:fsdp"
    name = f"{r['id']} {r['framework']} {r['model']} {n['gpus']}x{r['gpu'].split('-')[0].split(' ')[0]} dp{n['dp']} fsdp{n['fsdp']} {r['precision']}"  # noqa: E501
    policy = cfg["model"]["remat"] + ":" + ",".join(cfg["model"].get("remat_save", []))
    series = (
        ""
        if twin
        else f"{r['framework']} {r['model']} {node} {r['precision']} seq{n['seq']} {n['global_batch'] // n['gpus']}/gpu fsdp{n['fsdp'] if n['dp'] > 1 else 'all'} {policy}"
    )  # noqa: E501
    work = " ".join(str(r[c]) for c in WORK)
    return Row("jax", name, name, node, cfg, measured, r["id"], n["nodes"], network, series, _why_not(n, r),
               r["precision"], work, twin)  # fmt: skip


def twins(raw: list[dict]) -> list[dict]:
    """The bf16 twin of each fp8 row of :data:`BF16_STEPS`, as a CSV row: the bf16 row of the same
    framework, model, GPU, sequence and batch per GPU (its recipe: remat, XLA flags), on the fp8
    row's GPUs, nodes, mesh and global batch, measured as :data:`BF16_STEPS` says. An fp8 row with
    no such bf16 row has no twin."""
    out = []
    same = ("framework", "model", "gpu", "seq")
    for r in raw:
        if r["precision"] != "fp8" or r["id"] not in BF16_STEPS:
            continue
        per_gpu = int(r["global_batch"]) / int(r["gpus"])
        recipe = [b for b in raw if b["precision"] == "bf16" and all(b[c] == r[c] for c in same)
                  and int(b["global_batch"]) / int(b["gpus"]) == per_gpu]  # fmt: skip
        if recipe:
            scale = ("gpus", "nodes", "network", "dp", "fsdp", "tp", "ep", "pp", "parallelism", "global_batch")
            out.append({**recipe[0], **{c: r[c] for c in scale}, "id": f"{r['id']}-bf16",
                        "step_s": str(BF16_STEPS[r["id"]])})  # fmt: skip
    return out


def rows(path: pathlib.Path) -> list[Row]:
    """The rows of one ``jax_gpu_*.csv``, and the bf16 twins of its fp8 rows (:func:`twins`)."""
    raw = read(path, COLUMNS, ("id", "gpu", "gpus", "nodes", "step_s"))
    out = [_row(r, path.name, i) for i, r in enumerate(raw, 2)]
    return out + [_row(r, path.name, 0, twin=True) for r in twins(raw)]
