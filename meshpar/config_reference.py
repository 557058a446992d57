"""The config reference, rendered from the config dataclasses and the comments in their source.

``python -m meshpar.config_reference`` prints it (Markdown); the docs build renders it as the
page ``config-reference.md`` on every build (the mkdocs hook ``docs/hooks/config_reference.py``),
so the page is never a file that can drift from the code. Every key is listed dotted, with its
type, default, allowed values (``Literal`` choices; ``min`` / ``max`` from the field's metadata,
see :func:`meshpar.configuration.schema.at_least` and :func:`meshpar.configuration.schema.between`) and its comment.

The comment convention, which :func:`missing` checks (a test keeps it at none missing):

- A field's **own** comment is the block of ``#`` lines directly above it, a ``#`` comment at
  the end of its line(s), or both.
- A block of ``#`` lines above a field also opens a **group**: the fields right after it that
  have no comment of their own belong to it, up to the first blank line, the first field with a
  comment of its own, or anything else in the class body. ``DataConfig``'s ``# synthetic: …``
  block documents the four fields below it this way.
- A field with neither is missing its comment.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from meshpar.configuration.config import Config
from meshpar.models import MODELS
from meshpar.sharding import layout as layout_lib


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    name: str
    own: str  # the field's own comment ("" = none)
    group: str  # the comment of the group it belongs to, when it has no own comment ("" = none)
    head: str  # the field whose comment block opened its group (its own name when it opens one)


def _comment_text(lines: list[str]) -> str:
    return " ".join(line.strip().removeprefix("#").strip() for line in lines).strip()


def field_docs(cls: type, source: str | None = None) -> list[FieldDoc]:
    """The comment of every field of dataclass `cls`, in order, by the convention above.

    A field is documented where it is declared: one that `cls` inherits, in the source of the
    base that declares it (a group never reaches from one class's fields into another's; a field
    declared again lower down takes that declaration's comment). `source` is the source of `cls`
    itself (default: read with :func:`inspect.getsource`, as each base's always is); a test
    passes an edited one to check that removing a comment is noticed.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    found: dict[str, FieldDoc] = {}
    for base in reversed(cls.__mro__):
        # the fields `base` declares in its own body, in that order
        declared = [n for n in inspect.get_annotations(base) if n in fields] if dataclasses.is_dataclass(base) else []
        if declared:
            own_source = source if base is cls else None
            found.update((d.name, d) for d in _declared_docs(base, declared, own_source))
    return [found[f.name] for f in dataclasses.fields(cls)]


def _declared_docs(cls: type, names: list[str], source: str | None) -> list[FieldDoc]:
    """The comments of the fields `names` that `cls`'s own body declares (see :func:`field_docs`)."""
    source = textwrap.dedent(source if source is not None else inspect.getsource(cls))
    lines = source.splitlines()
    full, trailing = set(), {}  # line numbers (1-based) of whole-line comments; line → trailing text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            if lines[row - 1][:col].strip():
                trailing[row] = tok.string
            else:
                full.add(row)
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs, previous, group = [], None, None  # previous statement of the body; the open group
    for stmt in node.body:
        is_field = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id in names
        if not is_field:
            previous, group = stmt, None
            continue
        name = stmt.target.id
        row, block = stmt.lineno - 1, []
        while row in full:
            block.insert(0, lines[row - 1])
            row -= 1
        own_lines = [*block, *(trailing[r] for r in range(stmt.lineno, stmt.end_lineno + 1) if r in trailing)]
        own = _comment_text(own_lines)
        # Right after the previous field: no blank line, comment or other statement between them.
        adjacent = previous is not None and stmt.lineno == previous.end_lineno + 1
        if own:
            docs.append(FieldDoc(name, own, "", name))
            group = (own, name) if block else None
        elif group is not None and adjacent:
            docs.append(FieldDoc(name, "", group[0], group[1]))
        else:
            docs.append(FieldDoc(name, "", "", ""))
            group = None
        previous = stmt
    found = [d.name for d in docs]
    if found != names:
        raise ValueError(f"{cls.__qualname__}: fields {names} but its source defines {found}")
    return docs


def sections() -> Iterator[tuple[str, type]]:
    """Every config dataclass with its dotted prefix: Config's sections (nested ones too), then
    each model family's config under ``model``."""

    def walk(cls: type, prefix: str) -> Iterator[tuple[str, type]]:
        yield prefix, cls
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name], f"{prefix}.{f.name}" if prefix else f.name)

    yield from walk(Config, "")
    for family in MODELS.values():
        yield "model", family.config


def missing(classes: list[tuple[str, type]] | None = None) -> list[str]:
    """Keys with no comment of their own and no group's, as ``dotted.key (Class)`` (default:
    every config key, the model families' included)."""
    out = []
    for prefix, cls in classes if classes is not None else sections():
        for doc in field_docs(cls):
            if not doc.own and not doc.group:
                out.append(f"{prefix + '.' if prefix else ''}{doc.name} ({cls.__qualname__})")
    return out


# ---------------------------------------------------------------------------- rendering

# The three keys that a config writes as strings and meshpar parses (meshpar.sharding.mesh, meshpar.sharding.layout).
SPECIAL = {
    "mesh": ("mesh string or mapping", lambda v: ",".join(f"{a}:{n}" for a, n in v)),
    "layout": ("rules string or mapping", layout_lib.format_rules),
    "param_layout": ("rules string or mapping", layout_lib.format_rules),
}


def type_text(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any"
    if origin is Literal:
        return " or ".join(sorted({type(a).__name__ for a in args}))
    if origin in (types.UnionType, typing.Union):
        return " or ".join("null" if a is type(None) else type_text(a) for a in args)
    if origin is tuple:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return f"mapping of {type_text(args[0])} to {type_text(args[1])}"
    return getattr(tp, "__name__", str(tp))


def value_text(value: Any) -> str:
    """A value as it is written in a config's YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return '""' if not value else value
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{value_text(k)}: {value_text(v)}" for k, v in value.items()) + "}"
    return repr(value)


def allowed_text(tp: Any, metadata: Mapping) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(f"`{value_text(a)}`" for a in typing.get_args(tp))
    lo, hi = metadata.get("min"), metadata.get("max")
    each = "each " if typing.get_origin(tp) is tuple else ""
    if lo is not None and hi is not None:
        return f"{each}{lo} to {hi}"
    if lo is not None:
        return f"{each}≥ {lo}"
    if hi is not None:
        return f"{each}≤ {hi}"
    return ""


def escape(text: str) -> str:
    """Comment text as Markdown: code spans kept, HTML and emphasis characters escaped outside them."""
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        part = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        parts[i] = re.sub(r"([\\*_\[\]])", r"\\\1", part)
    return "".join(parts)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _term(key: str, f: dataclasses.Field, tp: Any) -> str:
    default = _default(f)
    if key in SPECIAL:
        kind, fmt = SPECIAL[key]
        return f"`{key}` · {kind} · default `{fmt(default) or value_text('')}`"
    bits = [f"`{key}`", type_text(tp)]
    if default is not dataclasses.MISSING:
        bits.append(f"default `{value_text(default)}`")
    allowed = allowed_text(tp, f.metadata)
    if allowed:
        bits.append(allowed)
    return " · ".join(bits)


def render_section(cls: type, prefix: str, heading: str, intro: str = "") -> list[str]:
    """One section: `heading`, then each field, or each group of fields, as a definition-list
    entry whose definition is their comment; nested sections follow as subsections."""
    out = [heading, ""]
    if intro:
        out += [_sentence(intro), ""]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    subsections, entries = [], []  # entries: [terms, comment, head]
    for doc in field_docs(cls):
        key = f"{prefix}.{doc.name}" if prefix else doc.name
        tp = hints[doc.name]
        if dataclasses.is_dataclass(tp):
            subsections.append((tp, key, doc.own or doc.group))
        elif key != "model":  # Config.model: one of the families, rendered after the sections
            if doc.own or not doc.group or not entries or doc.head != entries[-1][2]:
                entries.append(([], doc.own or doc.group, doc.head))
            entries[-1][0].append(_term(key, fields[doc.name], tp))
    for terms, comment, _ in entries:
        # Several terms (one per line) may share one definition: a group.
        out += [*terms, f":   {escape(comment) or '(no comment)'}", ""]
    # Top level's sections are its peers (##); a section's own sections (train.profile) nest.
    level = heading.split(" ")[0] + ("#" if prefix else "")
    for tp, key, comment in subsections:
        out += render_section(tp, key, f"{level} `{key}`", comment)
    return out


def _sentence(text: str) -> str:
    """A comment as a sentence of Markdown: capitalised, with a full stop, escaped."""
    text = text.replace("``", "`")  # reStructuredText literals (module docstrings) as code spans
    text = text[:1].upper() + text[1:]
    return escape(text if text.endswith(".") else text + ".")


def render() -> str:
    """The whole reference page (Markdown)."""
    model_doc = next(d for d in field_docs(Config) if d.name == "model")
    convention = (__doc__ or "").split("The comment convention")[1].split(":\n", 1)[1]
    rules = textwrap.dedent(convention).strip().split("\n- ")
    out = [
        "# Config reference",
        "",
        "Every key of an experiment config, generated from the config dataclasses",
        "(`meshpar/configuration/sections.py`, `meshpar/models/`) and the comments in their source each time",
        "the docs are built; `python -m meshpar.config_reference` prints this page. Keys are",
        "dotted: `train.steps` is `steps:` under `train:` in the YAML, and `train.steps=500` on",
        "the command line. Keys listed together share one comment (a group, below). Beyond the",
        "bounds shown, every integer fits 64 bits (step counts and model sizes 2³¹−1) and every",
        "float is a finite float32; checks across keys (a batch that must divide over the mesh, an",
        "offload that needs the layer loop, …) run when a config is loaded and report",
        "`config error: <key>: …`.",
        "",
        "Which comment documents a key:",
        "",
        *("- " + " ".join(rule.split()).removeprefix("- ").replace("``", "`") for rule in rules),
        "",
    ]
    out += render_section(Config, "", "## Top level")
    out += ["## `model`", "", _sentence(model_doc.own), ""]
    for name, family in MODELS.items():
        # The family's module docstring, first paragraph.
        doc = " ".join((sys.modules[family.config.__module__].__doc__ or "").strip().split("\n\n")[0].split())
        out += render_section(family.config, "model", f"### `model.name: {name}`", doc)
    return "\n".join(out) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
