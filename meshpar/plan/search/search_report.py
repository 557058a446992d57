"""The layout search's results for people: the ranked table, and the chosen layout as an
experiment YAML that ``python -m meshpar.train --config`` runs (:mod:`meshpar.plan.search.layouts`)."""

from __future__ import annotations

import pathlib

import yaml
from rich.table import Table

from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError
from meshpar.plan.report import fmt_bytes
from meshpar.plan.search import layouts as search_lib
from meshpar.plan.time.time_report import fmt_seconds
from meshpar.sharding import layout as layout_lib


def table(result, title: str):
    """The ranked rows as a rich Table: the HLO model's terms where compiled, else the estimate's."""
    own = "; * the config's own layout" if any(r.own for r in result.rows) else ""
    fastest = min((r.step_s for r in result.rows if r.predicted and r.fits), default=0.0)
    tied = [r for r in result.rows if r.predicted and r.fits and r.step_s <= fastest * (1 + search_lib.TIE)]
    tie = f"; tie: within {search_lib.TIE:.0%} of the fastest prediction, fewest collective bytes first"
    caption = search_lib.summary(result) + (tie if len(tied) > 1 else "") + own
    t = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    paging = any(r.estimate.paging_s for r in result.rows)  # unified memory: the pages' stall, a column of its own
    fp8 = any(r.fp8 for r in result.rows)  # FP8 dots in some rows (--weigh-fp8): a column of their own
    for name in ("#", "mesh", "layout", "param_layout", "micro", *(("fp8",) if fp8 else ()), "step", "by", "compute",
                 "collectives", "feed exposed", *(("paging",) if paging else ()), "estimate", "memory/device", "fits"):  # fmt: skip
        t.add_column(name, justify="left" if name in ("mesh", "layout", "param_layout", "by") else "right")
    for i, r in enumerate(result.rows):
        e, p = r.estimate, r.predicted
        terms = (
            (p.compute_s, p.collective_s, p.exposed_feed_s)
            if p
            else (e.compute_s + e.memory_s, e.collective_s, e.exposed_feed_s)
        )
        terms += (e.paging_s,) if paging else ()
        memory_text = fmt_bytes(r.memory_bytes) + (f" (XLA {fmt_bytes(r.xla_bytes)})" if r.xla_bytes else "")
        layout_text = (r.cfg.layout_str or "(replicated)") + (" *" if r.own else "")
        t.add_row(
            str(i + 1) if r.fits else "-", r.cfg.mesh_str, layout_text,
            layout_lib.format_rules(r.cfg.param_layout) or "-", str(r.cfg.train.microbatches),
            *((",".join(r.fp8) or "-",) if fp8 else ()), fmt_seconds(r.step_s),
            ("HLO, tie" if len(tied) > 1 and r in tied else "HLO") if p else "estimate",
            *(fmt_seconds(s) for s in terms), fmt_seconds(e.total_s), memory_text, "yes" if r.fits else "no",
            style="bold" if i == 0 and r.fits else None,
        )  # fmt: skip
    return t


def experiment_yaml(result, config_path: str, overrides, command: str, out_path: str) -> str:
    """The best row as an experiment YAML: the config file with `overrides` applied and its mesh,
    layout and param_layout replaced, its workdir ``runs/<name of out_path>``, and a header that
    says how to run it and where it came from. Raises ConfigError when nothing fits."""
    best = result.best
    if best is None:
        raise ConfigError("--write", "no layout fits: nothing to write")
    raw = config_lib.apply_overrides(config_lib.read(config_path), overrides)
    rest = {k: v for k, v in raw.items() if k not in ("mesh", "layout", "param_layout")}
    chosen = {"mesh": best.cfg.mesh_str, "layout": best.cfg.layout_str}
    if best.cfg.param_layout:
        chosen["param_layout"] = layout_lib.format_rules(best.cfg.param_layout)
    if best.cfg.train.microbatches != raw.get("train", {}).get("microbatches", 1):
        rest["train"] = {**rest.get("train", {}), "microbatches": best.cfg.train.microbatches}
    if best.fp8 != best.given_fp8:  # the search weighed FP8 (--weigh-fp8) and chose it
        rest["model"] = {**rest.get("model", {}), "fp8": list(best.fp8)}
    raw = {**chosen, **rest, "workdir": f"runs/{pathlib.Path(out_path).stem}"}
    config_lib.from_dict(raw)  # what is written loads
    p = best.predicted
    terms = (
        f"compute {fmt_seconds(p.compute_s)}, collectives {fmt_seconds(p.collective_s)}, exposed feed "
        f"{fmt_seconds(p.exposed_feed_s)}"
        if p
        else "analytic estimate, not compiled"
    )
    header = [
        f"python -m meshpar.train --config {out_path}",
        "",
        f"The layout search's choice for {config_path} on {result.topology.name} ({result.num_devices} devices),",
        f"written by: {command}",
        (
            f"mesh {chosen['mesh']}; layout {chosen['layout'] or '(replicated)'}; param_layout "
            f"{chosen.get('param_layout', 'none')}; {best.cfg.train.microbatches} microbatches:"
        ),
        f"predicted step time {fmt_seconds(best.step_s)} ({terms}),",
        (
            f"{fmt_bytes(max(best.memory_bytes, best.xla_bytes or 0))} per device of "
            f"{fmt_bytes(result.capacity.usable_bytes)} usable; first of {result.fitting} layouts that fit "
            f"({result.legal} legal, {result.compiled} compiled)."
        ),
    ]
    text = "".join(f"# {line}".rstrip() + "\n" for line in header)
    return text + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)
