"""The data sources: every value of ``data.source``, one module each, registered here.

A source module defines a :class:`~meshpar.sources.base.Source` subclass: its ``name`` (the
``data.source`` value), the ``data.<key>`` settings it reads (``fields``) and cannot run without
(``required``), its eval split's setting (``eval_key``), whether its examples are token windows
(``token_windows``), its checks, its element spec and how it opens its host-side source (an
``input_pipeline`` class, which never imports meshpar). Nothing else in meshpar looks at the
value of ``data.source``: the config's choices are :func:`names`, and every question about a
source goes to the object :func:`of` returns.

Adding a source: a module beside these (or anywhere: a project's own package) with its
``Source`` subclass, and one line that registers an instance, ``register(mine.Mine())``, run
before the config is loaded. A setting it needs that ``DataConfig`` lacks is a new field there.
"""

from __future__ import annotations

from typing import Any

from meshpar.sources import synthetic, text, tfds, tfds_text, tokens
from meshpar.sources.base import Source

__all__ = ["Source", "get", "names", "of", "register", "unregister"]

_REGISTRY: dict[str, Source] = {}


def register(source: Source) -> Source:
    """Make ``data.source: <source.name>`` mean `source`; returns it."""
    if not source.name or not isinstance(source.name, str):
        raise ValueError(f"a data source needs a name, {type(source).__name__} has {source.name!r}")
    if source.name in _REGISTRY:
        raise ValueError(f"data source {source.name!r} is registered already ({type(_REGISTRY[source.name]).__name__})")
    _REGISTRY[source.name] = source
    return source


def unregister(name: str) -> None:
    """Forget a registered source (a test's, when it ends)."""
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    """The values data.source may take, in the order they were registered."""
    return tuple(_REGISTRY)


def get(name: str) -> Source:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown data source {name!r}") from None


def of(data: Any) -> Source:
    """The source a ``data`` section names."""
    return get(data.source)


register(synthetic.Synthetic())
register(tfds.Tfds())
register(text.Text())
register(tfds_text.TfdsText())
register(tokens.Tokens())
