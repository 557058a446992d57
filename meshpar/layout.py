"""Layout rules: which mesh axis each logical dimension name is split over.

Mesh TensorFlow's layouts, in JAX. Every tensor carries a tuple of logical dimension names
(`("batch", "hidden")`); a layout such as ``"batch:data; hidden:model"`` maps names onto
mesh axes. A name without a rule is replicated. The model never sees an axis name: it asks
for ``spec(dims)`` (or calls :func:`constrain`) and the layout answers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

# meshpar.mesh first: it makes sure a bad JAX_NUM_CPU_DEVICES cannot break `import jax`.
from meshpar.mesh import name_problem, show_name  # isort: skip

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


class LayoutError(ValueError):
    """A layout that cannot be applied: the message is one line and names dims, axes, sizes."""


Rules = str | Mapping[str, str] | tuple[tuple[str, str], ...] | None


def parse_rules(rules: Rules) -> tuple[tuple[str, str], ...]:
    """``"batch:data; hidden:model"`` (or ``{"batch": "data"}``, or parsed pairs) → ``(("batch", "data"), ...)``.

    Rules are separated by ``;`` (Mesh TensorFlow's separator) or ``,``.
    """
    if rules is None:
        return ()
    if isinstance(rules, tuple):
        pairs = list(rules)
    elif isinstance(rules, Mapping):
        pairs = [(str(k).strip(), str(v).strip()) for k, v in rules.items()]
    elif isinstance(rules, str):
        pairs = []
        for rule in rules.replace(",", ";").split(";"):
            if not rule.strip():
                continue
            dim, sep, axis = rule.partition(":")
            if not sep or ":" in axis:
                raise LayoutError(f"rule {rule.strip()!r} is not 'dim:axis'")
            pairs.append((dim.strip(), axis.strip()))
    else:
        raise LayoutError(f"expected a string like 'batch:data; hidden:model' or a mapping, got {type(rules).__name__}")
    # Names are quoted with repr (same text as '...' for plain names), so a name holding a
    # newline or other control character cannot break an error message over lines.
    seen: dict[str, str] = {}
    for dim, axis in pairs:
        if not dim or not axis:
            raise LayoutError(f"rule {f'{dim}:{axis}'!r} has an empty dim or axis name")
        # The same names as the mesh's (see meshpar.mesh.name_problem): an axis name that is no
        # mesh axis would be reported as unknown anyway, but a dim named like no model dim is
        # otherwise never checked.
        for what, name in (("dim", dim), ("axis", axis)):
            problem = name_problem(name)
            if problem:
                raise LayoutError(f"{what} name {show_name(name)} in rule {show_name(f'{dim}:{axis}')} {problem}")
        if dim in seen:
            raise LayoutError(f"dim {dim!r} is mapped twice (to {seen[dim]!r} and {axis!r})")
        seen[dim] = axis
    return tuple(pairs)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Layout rules checked against a mesh shape (``{"data": 4, "model": 2}``)."""

    rules: tuple[tuple[str, str], ...]
    axis_sizes: tuple[tuple[str, int], ...]

    @classmethod
    def create(cls, rules: Rules, axis_sizes: Mapping[str, int]) -> "Layout":
        parsed = parse_rules(rules)
        for dim, axis in parsed:
            if axis not in axis_sizes:
                known = ", ".join(repr(a) for a in axis_sizes)
                raise LayoutError(f"dim {dim!r} is mapped to unknown mesh axis {axis!r} (mesh axes: {known})")
        return cls(parsed, tuple(axis_sizes.items()))

    def __str__(self) -> str:
        return "; ".join(f"{d}:{a}" for d, a in self.rules)

    def axis(self, dim: str) -> str | None:
        """The mesh axis `dim` is split over, or None when it is replicated."""
        return dict(self.rules).get(dim)

    def axis_size(self, dim: str) -> int:
        """How many ways `dim` is split (1 when replicated)."""
        axis = self.axis(dim)
        return 1 if axis is None else dict(self.axis_sizes)[axis]

    def spec(self, dims: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for a tensor whose dims are named `dims` (None = an unnamed dim)."""
        used: dict[str, str] = {}
        out = []
        for dim in dims:
            axis = None if dim is None else self.axis(dim)
            if axis is not None:
                if axis in used:
                    raise LayoutError(
                        f"dims {used[axis]!r} and {dim!r} of one tensor {tuple(dims)} are both mapped to mesh axis {axis!r}"
                    )
                used[axis] = dim
            out.append(axis)
        return PartitionSpec(*out)

    def check_shape(self, dims: Sequence[str | None], shape: Sequence[int], what: str = "tensor") -> None:
        """Raise LayoutError unless every split dim of `shape` divides evenly by its axis size."""
        if len(dims) != len(shape):
            raise LayoutError(f"{what} has shape {tuple(shape)} but dims {tuple(dims)}")
        self.spec(dims)
        for dim, size in zip(dims, shape):
            n = 1 if dim is None else self.axis_size(dim)
            if size % n:
                raise LayoutError(
                    f"dim {dim!r} of {what} has size {size}, not divisible by mesh axis {self.axis(dim)!r} of size {n}"
                )

    def sharding(self, mesh: Mesh, dims: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(mesh, self.spec(dims))


# The layout and mesh that `constrain` resolves names with while a model is traced.
_ACTIVE: contextvars.ContextVar[tuple[Layout, Mesh] | None] = contextvars.ContextVar("meshpar_layout", default=None)


@contextlib.contextmanager
def activate(layout: Layout, mesh: Mesh) -> Iterator[None]:
    """Within this block, :func:`constrain` places activations by `layout` on `mesh`."""
    token = _ACTIVE.set((layout, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, dims: Sequence[str | None]) -> jax.Array:
    """Sharding constraint in logical names: ``constrain(h, ("batch", "hidden"))``.

    Outside :func:`activate` (e.g. a model used on one device) this is the identity, so model
    code never branches on whether it is distributed.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    layout, mesh = active
    layout.check_shape(dims, x.shape, what=f"activation {tuple(dims)}")  # at trace time: free
    return jax.lax.with_sharding_constraint(x, layout.sharding(mesh, dims))
