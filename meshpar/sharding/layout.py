"""Layout rules: which mesh axis each logical dimension name is split over.

Mesh TensorFlow's layouts, in JAX. Every tensor carries a tuple of logical dimension names
(`("batch", "hidden")`); a layout such as ``"batch:data; hidden:model"`` maps names onto
mesh axes. A name without a rule is replicated. The model never sees an axis name: it asks
for ``spec(dims)`` (or calls :func:`constrain`) and the layout answers.

Mesh TensorFlow's rule strings are read verbatim (``"batch:b1;hidden:b2"``, separated by ``;``,
``,``, ``.`` or spaces; see :func:`meshpar.sharding.mesh.split_pairs`), and, as there, a rule may name a
dim no tensor has or a mesh axis the mesh lacks: one rule string serves many models and
meshes. A rule's absent axes are left out when specs are built (the rule is dropped when it
names no other); :func:`unused` says, in one line, what of a rule set cannot apply.

A dim may be split over several mesh axes at once, ``batch:(replica,data)``: its
PartitionSpec entry is ``("replica", "data")``, so it is split ``replica × data`` ways, the
first axis major. A second rule set on top of a layout (:meth:`Layout.overlay`) gives the
parameters and optimizer state their own placement (``param_layout``, FSDP / ZeRO-3) while
activations keep the layout's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Collection, Mapping, Sequence

# meshpar.sharding.mesh first: it makes sure a bad JAX_NUM_CPU_DEVICES cannot break `import jax`.
from meshpar.sharding.mesh import name_problem, show_name, split_pairs  # isort: skip

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshpar import jax_compat
from meshpar.sharding import tracing


class LayoutError(ValueError):
    """A layout that cannot be applied: the message is one line and names dims, axes, sizes."""


# A rule's target: one mesh axis, or several (``("replica", "data")``, first axis major).
Axes = str | tuple[str, ...]
Rules = str | Mapping[str, str | Sequence[str]] | tuple[tuple[str, Axes], ...] | None


def format_axes(axes: Axes) -> str:
    """``"data"`` → ``data``; ``("replica", "data")`` → ``(replica,data)``: the rule syntax."""
    return axes if isinstance(axes, str) else f"({','.join(axes)})"


def format_rules(rules: tuple[tuple[str, Axes], ...]) -> str:
    """Parsed rules back to their text, ``batch:(replica,data); d_ff:model`` (parses to the same)."""
    return "; ".join(f"{d}:{format_axes(a)}" for d, a in rules)


def mesh_axes(axes: Axes | None) -> tuple[str, ...]:
    """A rule's (or a PartitionSpec entry's) mesh axes as a tuple: None → ``()``."""
    return () if axes is None else tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _parse_axes(text: str) -> Axes:
    """``data`` → ``"data"``; ``(replica, data)`` → ``("replica", "data")``; ``(data)`` → ``"data"``."""
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        names = tuple(a.strip() for a in text[1:-1].split(","))
        return names[0] if len(names) == 1 else names
    return text


def parse_rules(rules: Rules) -> tuple[tuple[str, Axes], ...]:
    """``"batch:data; hidden:model"`` (or ``{"batch": "data"}``, or parsed pairs) → ``(("batch", "data"), ...)``.

    Rules are separated by ``;``, ``,``, ``.`` or spaces, as in Mesh TensorFlow (``"batch:b1;d_ff:b2"``;
    see :func:`meshpar.sharding.mesh.split_pairs`); spaces around a rule's colon belong to the rule. A dim
    split over several mesh axes names them in parentheses, ``batch:(replica,data)`` (a mapping
    may give a list), and parses to ``("batch", ("replica", "data"))``. Whether an axis exists is
    not checked here (see :meth:`Layout.create`).
    """
    if rules is None:
        return ()
    if isinstance(rules, tuple):
        pairs = [(dim, tuple(axes) if isinstance(axes, list) else axes) for dim, axes in rules]
    elif isinstance(rules, Mapping):
        pairs = []
        for k, v in rules.items():
            if isinstance(v, (list, tuple)):
                axes = tuple(str(a).strip() for a in v)
                pairs.append((str(k).strip(), axes[0] if len(axes) == 1 else axes))
            else:
                pairs.append((str(k).strip(), _parse_axes(str(v))))
    elif isinstance(rules, str):
        pairs = []
        try:
            texts = split_pairs(rules)
        except ValueError as e:
            raise LayoutError(f"rules {rules!r} have {e}") from None
        for rule in texts:
            dim, sep, axis = rule.partition(":")
            if not sep or ":" in axis:
                raise LayoutError(f"rule {rule!r} is not 'dim:axis' (rules are separated by ';', ',', '.' or spaces)")
            pairs.append((dim.strip(), _parse_axes(axis)))
    else:
        raise LayoutError(f"expected a string like 'batch:data; hidden:model' or a mapping, got {type(rules).__name__}")
    # Names are quoted with repr (same text as '...' for plain names), so a name holding a
    # newline or other control character cannot break an error message over lines.
    seen: dict[str, Axes] = {}
    for dim, axes in pairs:
        rule = f"{dim}:{format_axes(axes) if isinstance(axes, (str, tuple)) else axes}"
        names = mesh_axes(axes)
        if not dim or not names or any(a == "" for a in names):
            raise LayoutError(f"rule {rule!r} has an empty dim or axis name")
        # The same names as the mesh's (see meshpar.sharding.mesh.name_problem): an axis name that is no
        # mesh axis would be reported as unknown anyway, but a dim named like no model dim is
        # otherwise never checked.
        for what, name in (("dim", dim), *(("axis", a) for a in names)):
            problem = name_problem(name)
            if problem:
                raise LayoutError(f"{what} name {show_name(name)} in rule {show_name(rule)} {problem}")
        if len(set(names)) < len(names):
            twice = next(a for a in names if names.count(a) > 1)
            raise LayoutError(f"rule {rule!r} names mesh axis {twice!r} twice")
        if dim in seen:
            raise LayoutError(f"dim {dim!r} is mapped twice (to {format_axes(seen[dim])!r} and {format_axes(axes)!r})")
        seen[dim] = axes
    return tuple(pairs)


def on_mesh(rules: Rules, axis_names: Collection[str]) -> tuple[tuple[str, Axes], ...]:
    """The `rules` that can apply on a mesh with axes `axis_names`: each without the axes the mesh
    lacks, and without the rules left with none."""
    out = []
    for dim, axes in parse_rules(rules):
        kept = tuple(a for a in mesh_axes(axes) if a in axis_names)
        if kept:
            out.append((dim, kept[0] if len(kept) == 1 else kept))
    return tuple(out)


def unused(
    rules: Rules, axis_names: Collection[str], dims: Collection[str], no_dim: str = "this model has no dim"
) -> str | None:
    """What in `rules` cannot apply to tensors whose dims are `dims` on a mesh with axes
    `axis_names`, in words (``this model has no dim experts, ensemble; the mesh has no axis
    ensemble``), or None when every rule can. `no_dim` opens the first part."""
    parsed = parse_rules(rules)
    dims_missing = [d for d, _ in parsed if d not in dims]
    axes_missing = list(dict.fromkeys(a for _, axes in parsed for a in mesh_axes(axes) if a not in axis_names))
    parts = [f"{no_dim} {', '.join(dims_missing)}"] if dims_missing else []
    parts += [f"the mesh has no axis {', '.join(axes_missing)}"] if axes_missing else []
    return "; ".join(parts) or None


def applies(rules: Rules, axis_names: Collection[str], dims: Collection[str]) -> bool:
    """Whether some rule of `rules` splits a dim in `dims` on a mesh with axes `axis_names`."""
    return any(dim in dims for dim, _ in on_mesh(rules, axis_names))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Layout rules checked against a mesh shape (``{"data": 4, "model": 2}``)."""

    rules: tuple[tuple[str, Axes], ...]
    axis_sizes: tuple[tuple[str, int], ...]
    # ``param_layout``: rules that parameters and optimizer state follow on top of `rules`
    # (see :attr:`params`); activations never do.
    param_rules: tuple[tuple[str, Axes], ...] = ()

    @classmethod
    def create(cls, rules: Rules, axis_sizes: Mapping[str, int], params: Rules = None) -> Layout:
        """`rules` (and `params`, the ``param_layout``) on a mesh of `axis_sizes`. A mesh axis the
        mesh lacks is left out of its rule, and a rule left with no axis is dropped, as Mesh
        TensorFlow ignores rules whose mesh axis is absent (``batch:(replica,data)`` on a mesh
        without ``replica`` is ``batch:data``): :func:`unused` reports them."""
        return cls(on_mesh(rules, axis_sizes), tuple(axis_sizes.items()), on_mesh(params, axis_sizes))

    @property
    def params(self) -> Layout:
        """Where parameters and optimizer state live: `param_rules` on top of `rules`."""
        return self.overlay(self.param_rules)

    def overlay(self, rules: Rules) -> Layout:
        """This layout with `rules` on top: a dim they name follows them, every other dim keeps
        this layout's rule. ``param_layout`` is applied to parameters this way."""
        extra = Layout.create(rules, dict(self.axis_sizes)).rules
        named = {dim for dim, _ in extra}
        return Layout((*((d, a) for d, a in self.rules if d not in named), *extra), self.axis_sizes)

    def without(self, axes: Collection[str]) -> Layout:
        """This layout as a ``shard_map`` region manual over `axes` sees it: every rule (and
        ``param_layout`` rule) without those axes, a rule left with none dropped. Inside, each
        device holds its own block of a dim split over them, which nothing splits further."""

        def keep(rules):
            out = []
            for dim, a in rules:
                left = tuple(x for x in mesh_axes(a) if x not in axes)
                if left:
                    out.append((dim, left[0] if len(left) == 1 else left))
            return tuple(out)

        return dataclasses.replace(self, rules=keep(self.rules), param_rules=keep(self.param_rules))

    def __str__(self) -> str:
        return format_rules(self.rules)

    def axis(self, dim: str) -> Axes | None:
        """The mesh axis `dim` is split over (a tuple when several), or None when it is replicated."""
        return dict(self.rules).get(dim)

    def axis_size(self, dim: str) -> int:
        """How many ways `dim` is split: the product of its mesh axes' sizes (1 when replicated)."""
        axes = self.axis(dim)
        sizes = dict(self.axis_sizes)
        return 1 if axes is None else math.prod(sizes[a] for a in mesh_axes(axes))

    def spec(self, dims: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for a tensor whose dims are named `dims` (None = an unnamed dim)."""
        used: dict[str, str] = {}
        out = []
        for dim in dims:
            axes = None if dim is None else self.axis(dim)
            if axes is not None:
                for axis in mesh_axes(axes):
                    if axis in used:
                        raise LayoutError(
                            f"dims {used[axis]!r} and {dim!r} of one tensor {tuple(dims)} are both mapped to mesh "
                            f"axis {axis!r}"
                        )
                    used[axis] = dim
            out.append(axes)
        return PartitionSpec(*out)

    def check_shape(self, dims: Sequence[str | None], shape: Sequence[int], what: str = "tensor") -> None:
        """Raise LayoutError unless every split dim of `shape` divides evenly by its axis size."""
        if len(dims) != len(shape):
            raise LayoutError(f"{what} has shape {tuple(shape)} but dims {tuple(dims)}")
        try:
            self.spec(dims)
        except LayoutError as e:
            raise LayoutError(str(e) if what == "tensor" else f"{what}: {e}") from None
        for dim, size in zip(dims, shape):
            n = 1 if dim is None else self.axis_size(dim)
            if size % n:
                axes = self.axis(dim)
                if isinstance(axes, tuple):
                    sizes = dict(self.axis_sizes)
                    split = f"mesh axes {axes} of sizes {'×'.join(str(sizes[a]) for a in axes)} = {n}"
                else:
                    split = f"mesh axis {axes!r} of size {n}"
                raise LayoutError(f"dim {dim!r} of {what} has size {size}, not divisible by {split}")

    def sharding(self, mesh: Mesh, dims: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(mesh, self.spec(dims))


def activate(layout: Layout, mesh: Mesh, params_on_host: bool = False) -> contextlib.AbstractContextManager:
    """Within this block, :func:`constrain` places activations by `layout` on `mesh` (the
    enclosing :class:`meshpar.sharding.tracing.Trace` with these three fields changed).
    `params_on_host`: the parameters the model is given live in pinned host memory, and
    :func:`use` moves each to the devices where the model uses it (see :mod:`meshpar.sharding.offload`)."""
    return tracing.using(layout=layout, mesh=mesh, params_on_host=params_on_host)


def _active() -> tuple[Layout, Mesh] | None:
    """The layout and mesh names are resolved with while a model is traced, or None."""
    trace = tracing.current()
    return None if trace.layout is None else (trace.layout, trace.mesh)


def active_layout() -> Layout | None:
    """The layout of the enclosing trace, or None."""
    return tracing.current().layout


def active_mesh() -> Mesh | None:
    """The mesh of the enclosing trace, or None."""
    active = _active()
    return None if active is None else active[1]


def _sharding(layout: Layout, mesh: Mesh, dims: Sequence[str | None]) -> NamedSharding:
    """`layout`'s sharding of `dims`, over `mesh`, or inside a ``shard_map`` region (a pipeline's
    stages: :mod:`meshpar.sharding.stages`) over the abstract mesh whose manual axes it names, as jax
    requires there; the spec never names a manual axis, as no activation's dim is on it."""
    abstract = jax.sharding.get_abstract_mesh()
    if getattr(abstract, "manual_axes", ()):
        return NamedSharding(abstract, layout.spec(dims))
    return layout.sharding(mesh, dims)


def platform() -> str:
    """The platform the model being traced is compiled for: that of the active mesh's devices
    (a compile target's, e.g. a GPU's compile-only devices on a host without one), else the
    default backend's. Backend-dependent choices made at trace time (a layer loop's form, the
    attention implementation) ask this, so that they follow the target, not the host."""
    active = _active()
    if active is not None:
        return active[1].devices.flat[0].platform
    return jax.default_backend()


def compile_only() -> bool:
    """Whether the active mesh's devices are a compile-only target (nothing can run on them)."""
    active = _active()
    if active is None:
        return False
    return jax_compat.compile_only_device(active[1].devices.flat[0])


def same_split(a: str, b: str) -> bool:
    """Whether the active layout splits dims `a` and `b` over the same mesh axes (True when no
    layout is active: nothing is split)."""
    active = _active()
    return active is None or active[0].axis(a) == active[0].axis(b)


def use(w: jax.Array, dims: Sequence[str | None], dtype=None) -> jax.Array:
    """A parameter where the model computes with it: cast to `dtype` (the compute dtype; None
    keeps its own) where it is stored, then placed by the active (activation) layout.

    Under a ``param_layout`` that splits a weight further (FSDP) this is where it is gathered,
    inside the layer scan when the model uses it there, and where its gradient is reduced back
    (by :func:`_gathered` where the batch is split over an axis the parameter is not, such as a
    hybrid layout's data axis). The cast is pinned to the parameter's own placement first: left
    alone, XLA's partitioner moves the gather in front of the cast, and a bfloat16 model's
    gathers would move float32.
    """
    active = _active()
    if active is not None and tracing.current().params_on_host:
        # Offloaded parameters: moved to the devices first, in the parameter's own split (a
        # layer of a scanned stack is sliced in host memory by the loop, then moved here).
        layout, mesh = active
        w = jax.device_put(w, layout.params.sharding(mesh, dims).with_memory_kind("device"))
    cast = dtype is not None and w.dtype != dtype
    if cast:
        w = w.astype(dtype)
    if active is None or not active[0].param_rules:
        return constrain(w, dims)  # placed where it is stored already: nothing to gather
    layout, mesh = active
    _placing(layout, w, dims)
    own, used = _sharding(layout.params, mesh, dims), _sharding(layout, mesh, dims)
    if _summed_apart(layout, own, used):
        return _gathered(w, own, used)
    # Every axis the gradient is a partial sum over is one the parameter is split over: jax's
    # own transpose is left as it is (an all-reduce over those axes and this device's slice of
    # it, which XLA:GPU makes one reduce-scatter).
    if cast:
        w = jax.lax.with_sharding_constraint(w, own)
    return jax.lax.with_sharding_constraint(w, used)


def _summed_apart(layout: Layout, *shardings: NamedSharding) -> set[str]:
    """The mesh axes (of more than one device) the batch is split over and none of `shardings`
    splits a weight over: its gradient, a sum over the batch, is a partial sum over them. A
    ``shard_map`` region's manual axes are left out (each device runs its own program there)."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    batch = layout.axis("batch")
    split = {a for s in shardings for e in s.spec if e is not None for a in mesh_axes(e)}
    sizes = dict(layout.axis_sizes)
    return {a for a in (() if batch is None else mesh_axes(batch)) if sizes[a] > 1} - split - manual


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered(w: jax.Array, own: NamedSharding, used: NamedSharding) -> jax.Array:
    """`w`, in its own placement `own`, gathered to `used` (the activations' layout) for
    compute; its gradient is constrained to `own` only.

    jax's own transpose would constrain the gradient to `used` first: the matmul's gradient is a
    partial sum over every mesh axis the batch is split on, so XLA all-reduces the whole of it
    over all of them and then keeps its own slice. Where the batch is split over an axis the
    weight is not (a hybrid layout: batch over ``(data,fsdp)``, weights over ``fsdp``; FSDP
    within a node, data parallel across nodes) that all-reduce spans both axes, the slow link
    between nodes included, with the whole gradient (XLA:GPU's pass that splits such an
    all-reduce into a reduce-scatter and an all-reduce leaves the layer scan's alone, where the
    weights' gradients are made). Constrained to `own` alone, the partitioner reduce-scatters
    over the weight's own axes and all-reduces only that shard over the rest: each link moves
    no more than the layout needs."""
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(w, own), used)


def _gathered_fwd(w: jax.Array, own: NamedSharding, used: NamedSharding) -> tuple[jax.Array, None]:
    return _gathered(w, own, used), None


def _gathered_bwd(own: NamedSharding, used: NamedSharding, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.with_sharding_constraint(g, own),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def _placing(layout: Layout, x: jax.Array, dims: Sequence[str | None]) -> None:
    """Record `dims` (in the trace's ``seen``, when it collects) and check `x`'s shape against `layout`, at trace
    time, before `x` is placed by it."""
    seen = tracing.current().seen
    if seen is not None:
        seen.update(d for d in dims if d is not None)
    layout.check_shape(dims, x.shape, what=f"activation {tuple(dims)}")  # at trace time: free


def _fully_manual() -> bool:
    """Whether the trace is inside a ``shard_map`` region manual over every axis of its mesh."""
    abstract = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(abstract, "manual_axes", ()))
    return bool(manual) and manual == frozenset(abstract.axis_names)


def constrain(x: jax.Array, dims: Sequence[str | None]) -> jax.Array:
    """Sharding constraint in logical names: ``constrain(h, ("batch", "hidden"))``.

    Outside :func:`activate` (e.g. a model used on one device) this is the identity, so model
    code never branches on whether it is distributed; so it is inside a ``shard_map`` region
    manual over every mesh axis (context-parallel attention, :mod:`meshpar.models.context_parallel`),
    where each device holds its own block and nothing is left to place, its backward pass included.
    """
    active = _active()
    if active is None or _fully_manual():
        return x
    layout, mesh = active
    _placing(layout, x, dims)
    return jax.lax.with_sharding_constraint(x, _sharding(layout, mesh, dims))
