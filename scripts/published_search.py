"""The layout search against a published group's measured layouts (``validate_published.py --search``)."""

from __future__ import annotations

import json
import math
import time

from published_jax import Row


def megatron_layout(option, microbatches: int, batch: int, devices: int) -> tuple[int, int, int, int] | None:
    """A search choice as Megatron's (TP, DP, PP, micro batch), or None where it is not one of
    Megatron's layouts (FSDP, the batch and the model dims on one axis, or devices left idle)."""
    sizes = option.sizes
    dp = math.prod(sizes[a] for a in option.batch)
    tp = sizes.get("model", 1) if option.model else 1
    pp = sizes.get("stage", 1) if option.stage else 1
    if dp * tp * pp != devices or (option.fsdp and dp > 1) or (tp > 1 and "model" in option.batch):
        return None
    return tp, dp, pp, batch // (dp * microbatches)


def row_layout(row: Row) -> tuple[int, int, int, int]:
    """A published row's (TP, DP, PP, micro batch), from the meshpar config it became."""
    mesh = dict(tuple(a.split(":")) for a in row.config["mesh"].split(","))
    tp, dp, pp = (int(mesh.get(a, 1)) for a in ("model", "data", "stage"))
    train = row.config["train"]
    return tp, dp, pp, train["batch_size"] // (dp * train["microbatches"])


def _layout_name(key: tuple[int, int, int, int] | None) -> str:
    return "not one of Megatron's layouts" if key is None else "TP{} DP{} PP{} micro {}".format(*key)


def search_group(rows: list[Row]) -> dict:
    """``python -m meshpar.plan --search`` for a group's model and global batch on its machine,
    from plain data parallelism (mesh ``data:<GPUs>``, ``batch:data``, one microbatch: no measured
    layout is the config's own): its recommendation, the group's measured times of that layout
    (TP, DP, PP) at each micro batch, and the first layout in its ranking measured at its own
    micro batch, each against the group's fastest."""
    from meshpar.configuration import config as config_lib
    from meshpar.plan import topology
    from meshpar.plan.search import layouts as search

    gpus = int(rows[0].group.split("x")[0])
    raw = json.loads(json.dumps(rows[0].config))
    raw.update(mesh=f"data:{gpus}", layout="batch:data", train={**raw["train"], "microbatches": 1})
    raw.pop("pipeline", None)
    cfg = config_lib.from_dict(raw)
    started = time.perf_counter()
    result = search.search(cfg, topology.load(rows[0].topology), gpus)
    measured = {row_layout(r): r.measured_s for r in rows}
    fastest = min(measured.values())
    ranked = [(r, megatron_layout(r.option, r.cfg.train.microbatches, cfg.train.batch_size, gpus))
              for r in result.rows if r.fits]  # fmt: skip
    out = {"group": rows[0].group, "seconds": time.perf_counter() - started, "fastest_s": fastest}
    if not ranked:
        return out
    best, key = ranked[0]
    same = {k[3]: t for k, t in measured.items() if key is not None and k[:3] == key[:3]}  # by micro batch
    out.update(recommended=" ".join(best.overrides), recommended_layout=_layout_name(key),
               recommended_measured_s=measured.get(key), layout_measured={str(m): same[m] for m in sorted(same)},
               layout_slower_by=min(same.values()) / fastest - 1 if same else None)  # fmt: skip
    for i, (r, k) in enumerate(ranked):
        if k in measured:
            out.update(first_measured=_layout_name(k), first_measured_rank=i + 1,
                       first_measured_s=measured[k], slower_by=measured[k] / fastest - 1)  # fmt: skip
            break
    return out
