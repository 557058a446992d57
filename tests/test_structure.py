"""The commands are only commands: library code, scripts and tests never import them."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {"meshpar.train", "meshpar.compare_feeding", "meshpar.plan.__main__"}


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


def test_the_train_command_defines_only_the_command():
    tree = ast.parse((REPO / "meshpar" / "train.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert defined == {"run", "main"}, defined
