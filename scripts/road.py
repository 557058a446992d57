"""The road a config travels from ``python -m meshpar.train`` to its first train step, measured.

Runs what the train command runs (``loop.train(experiment.build(cfg))``) in this process on a
config (one step, nothing saved) with
a profile hook that records every call of a project function given the config or an object
carrying it (one of its sections, the built step, the experiment), until the first train step
is called. Over that sequence of files it counts:

- **files** and **folders** the config passes through;
- **climbs**: moves to a file on a higher floor than the one before (the floors of
  ``tests/test_structure.py``'s ``FLOORS``, the table of docs/code-map.md): a road that only
  goes down has none;
- **returns**: moves back into a file the road had already left.

Besides the road, from the code alone: the imports that run up the floors (the check of
``tests/test_structure.py``) and the largest modules. ``--repo DIR`` measures another checkout
of the project (an older commit, say) with the same floors table, so two trees compare on the
same terms. Prints a table; ``--json PATH`` writes the figures.

    python scripts/road.py
    git worktree add ../before <commit> && python scripts/road.py --repo ../before
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))  # the floors table and the import graph of tests/test_structure.py
from tests import test_structure as structure  # noqa: E402

STEPS = ["train.steps=1", "train.eval_every=0", "checkpoint.every=0", "train.progress=false"]


def carries(value, cfg, sections: set[int]) -> bool:
    """Whether `value` is the config, one of its sections, or an object holding the config."""
    if value is cfg or id(value) in sections:
        return True
    held = getattr(type(value), "__dataclass_fields__", None)
    return bool(held) and ("cfg" in held or "step" in held) and _held(value, cfg)


def _held(value, cfg) -> bool:
    own = vars(value) if hasattr(value, "__dict__") else {}
    if own.get("cfg") is cfg:
        return True
    step = own.get("step")
    return step is not None and getattr(step, "cfg", None) is cfg


def trace_road(repo: pathlib.Path, config: str, overrides: list[str]) -> list[str]:
    """The project files (relative paths) of the calls that carry the config, in call order,
    up to the first train step."""
    from meshpar.configuration import config as config_lib
    from meshpar.run import experiment, loop

    cfg = config_lib.load(config, [*overrides, *STEPS, f"workdir={tempfile.mkdtemp(prefix='road-')}"])
    sections = {id(getattr(cfg, f)) for f in cfg.__dataclass_fields__}
    roots = tuple(str(repo / p) + os.sep for p in ("meshpar", "input_pipeline"))
    road: list[str] = []

    class FirstStep(Exception):
        pass

    def hook(frame, event, _):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(roots):
            return
        path = str(pathlib.Path(code.co_filename).relative_to(repo))
        if code.co_name == "step" and path == os.path.join("meshpar", "run", "experiment.py"):
            raise FirstStep  # the run's compiled train step: the end of the road
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(carries(frame.f_locals.get(n), cfg, sections) for n in names):
            road.append(path)

    sys.setprofile(hook)
    try:
        loop.train(experiment.build(cfg))
    except FirstStep:
        pass
    finally:
        sys.setprofile(None)
    return road


def module_of(path: str) -> str:
    return ".".join(pathlib.Path(path).with_suffix("").parts).removesuffix(".__init__")


def measure(road: list[str]) -> dict:
    """Files, folders, climbs and returns of a road (see the module docstring)."""
    moves = [p for i, p in enumerate(road) if i == 0 or p != road[i - 1]]
    floors = [structure.floor_of(module_of(p)) for p in moves]
    climbs = sum(1 for a, b in zip(floors, floors[1:]) if b > a)
    seen, returns = set(), 0
    for i, p in enumerate(moves):
        returns += p in seen and i > 0
        seen.add(p)
    folders = {str(pathlib.Path(p).parent) for p in moves}
    return {"files": len(set(moves)), "folders": len(folders), "moves": len(moves) - 1, "climbs": climbs,
            "returns": returns}  # fmt: skip


def static(repo: pathlib.Path) -> dict:
    """Imports that run up the floors, and the five largest modules (lines)."""
    structure.REPO = repo
    graph, _ = structure.import_graph()
    sizes = {
        str(p.relative_to(repo)): len(p.read_text().splitlines()) for p in [*(repo / "meshpar").rglob("*.py")]
    }  # fmt: skip
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    return {"imports_up": structure.climbs(graph), "largest": largest, "modules": len(sizes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=str(HERE), help="the checkout to measure (default: this one)")
    parser.add_argument("--config", default="experiments/quickstart.yaml")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    repo = pathlib.Path(args.repo).resolve()
    os.chdir(repo)
    sys.path.insert(0, str(repo))  # that checkout's meshpar, before any installed one
    for name in [m for m in sys.modules if m == "meshpar" or m.startswith(("meshpar.", "input_pipeline"))]:
        del sys.modules[name]
    road = trace_road(repo, args.config, args.overrides)
    out = {"repo": str(repo), "config": args.config, "road": measure(road), **static(repo)}
    r = out["road"]
    print(f"road from the train command to the first step ({args.config}, {repo}):")
    print(f"  {r['files']} files in {r['folders']} folders, {r['moves']} moves, {r['climbs']} climbs back up, "
          f"{r['returns']} returns to a file already left")  # fmt: skip
    print(f"  imports that run up the floors: {len(out['imports_up'])}")
    for line in out["imports_up"]:
        print(f"    {line}")
    print(f"  {out['modules']} modules; the largest: " + ", ".join(f"{p} {n}" for p, n in out["largest"]))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({**out, "files_in_order": road}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
