"""The project's structure.

- The commands (``python -m`` entry points, :data:`COMMANDS`) are only commands: library code
  (``meshpar/``, ``input_pipeline/``) and scripts never import them; tests may, to run them.
- ``meshpar/train.py`` defines nothing but the command (``run``, ``main``).
- No import cycle among the project's modules, imports inside functions counted, and no
  project module imported inside a function.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# meshpar.config_reference also runs as a command, but is library code too: the docs build's
# hook (docs/hooks/config_reference.py) imports it.
COMMANDS = {
    "meshpar.train",
    "meshpar.compare_feeding",
    "meshpar.plan.__main__",
    "meshpar.convert",
    "meshpar.generate",
    "meshpar.data",
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_no_library_module_or_script_imports_a_command():
    users = {}
    for path in [*REPO.glob("meshpar/**/*.py"), *REPO.glob("input_pipeline/*.py"), *REPO.glob("scripts/*.py")]:
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if module in COMMANDS:
            continue
        hit = _imports(path) & COMMANDS
        if hit:
            users[module] = sorted(hit)
    assert not users, f"library code importing a command module: {users}"


def test_every_listed_command_is_a_command():
    for module in COMMANDS:
        path = REPO.joinpath(*module.split(".")).with_suffix(".py")
        assert path.name == "__main__.py" or 'if __name__ == "__main__":' in path.read_text(), module


def test_the_train_command_defines_only_the_command():
    tree = ast.parse((REPO / "meshpar" / "train.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert defined == {"run", "main"}, defined


# ---------------------------------------------------------------------------------------------
# Import structure: no cycle among the project's modules, imports inside functions counted, and
# no project module imported inside a function (a lazy import is how a cycle hides).

PACKAGES = ("meshpar", "input_pipeline")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _resolve(name: str, modules: dict) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """module → the project modules it imports (anywhere in it), and every import of a project
    module inside a function as (module, line, imported)."""
    modules = _modules()
    graph, local = {}, []
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        in_function = {
            id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
        }
        graph[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            hit = {_resolve(t, modules) for t in targets} - {None, module}
            graph[module] |= hit
            if hit and id(node) in in_function:
                local += [(module, node.lineno, h) for h in sorted(hit)]
    return graph, local


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_project_modules_counting_imports_inside_functions():
    graph, _ = import_graph()
    assert len(graph) > 50  # every module was read
    assert cycles(graph) == []


def test_no_project_module_is_imported_inside_a_function():
    _, local = import_graph()
    assert local == [], "imports of project modules inside functions (move them to the top): " + ", ".join(
        f"{m}:{line} imports {h}" for m, line, h in local
    )


# ---------------------------------------------------------------------------------------------
# Floors (docs/code-map.md): an import only ever goes down, or stays on its floor. The most
# specific prefix names a module's floor; a module no prefix names fails the test, so a new
# folder is given its floor when it is made.

FLOORS = (
    # ground: version shims, the jaxpr walker, how a config section is declared, the input pipeline
    ("input_pipeline", 0),
    ("meshpar.jax_compat", 0),
    ("meshpar.jaxprs", 0),
    ("meshpar.configuration.schema", 0),
    # the process's back end, and sharding (mesh, layout, stages, offload, the trace context)
    ("meshpar.backend", 1),
    ("meshpar.sharding", 1),
    ("meshpar", 1),  # the package's face: it sets up the back end on import
    # model families and data sources
    ("meshpar.models", 2),
    ("meshpar.sources", 2),
    # configuration: sections, loading, the cross-section checks, the one-line errors
    ("meshpar.configuration", 3),
    # checkpoints, Hugging Face formats, processes
    ("meshpar.checkpoints", 4),
    ("meshpar.hf", 4),
    ("meshpar.processes", 4),
    # building a step: config → mesh, layout, state plan, jitted steps, compiled programs, inputs
    ("meshpar.step", 5),
    # the planner: judges a built step and its compiled programs
    ("meshpar.plan", 6),
    # running an experiment: where its state comes from, the loop, metrics, generation
    ("meshpar.run", 7),
    # the commands
    ("meshpar.plan.__main__", 8),
    *((f"meshpar.{c}", 8) for c in ("train", "generate", "convert", "data", "compare_feeding", "config_reference")),
)


def floor_of(module: str, floors=FLOORS) -> int | None:
    best = max((p for p, _ in floors if module == p or module.startswith(p + ".")), key=len, default=None)
    return dict(floors)[best] if best is not None else None


def climbs(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """Every import that runs up the floors, as 'importer (floor) -> imported (floor)'."""
    out = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            if floor_of(target, floors) > floor_of(module, floors):
                out.append(f"{module} ({floor_of(module, floors)}) -> {target} ({floor_of(target, floors)})")
    return out


def test_the_floor_check_finds_an_import_that_runs_up():
    floors = (("low", 0), ("high", 1), ("high.command", 2))
    graph = {"high.a": {"low.b"}, "low.b": {"high.a"}, "high.command": {"high.a"}}
    assert climbs(graph, floors) == ["low.b (0) -> high.a (1)"]
    assert floor_of("high.command.x", floors) == 2 and floor_of("elsewhere", floors) is None


def test_every_module_has_a_floor_and_no_import_runs_up_the_floors():
    graph, _ = import_graph()
    assert [m for m in graph if floor_of(m) is None] == []
    assert climbs(graph) == []
