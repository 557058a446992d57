"""Which devices a collective of a compiled program joins, and which mesh axes those groups span.

A collective's groups come from its ``replica_groups`` (explicit, iota or mesh-axes form) or
``source_target_pairs``, as partition indices; partition i is the i-th device of the mesh in
row-major order. The spec: docs/time-model.md.
"""

from __future__ import annotations

import math
import re

import numpy as np

from meshpar.plan import hlo


def mesh_shape(mesh) -> dict[str, int]:
    """Axis name → size, of a mesh or of such a dict."""
    return dict(mesh.shape) if not isinstance(mesh, dict) else dict(mesh)


def _iota_groups(text: str) -> list[list[int]] | None:
    """``[G,S]<=[dims]`` or ``[G,S]<=[dims]T(perm)``: iota over dims, transposed, reshaped."""
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not m:
        return None
    shape, dims = hlo.ints(m.group(1)), hlo.ints(m.group(2))
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose(hlo.ints(m.group(3)))
    return ids.reshape(-1, shape[-1]).tolist()


def _mesh_groups(text: str) -> list[list[int]] | None:
    """``mesh['a'=4,'b'=2] {'b'}`` (optionally ``device_ids=([4,2]T(1,0))``): the devices that
    differ only along the listed axes form a group."""
    m = re.match(r"mesh\[([^\]]*)\](?:\s*,?\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", text)
    if not m:
        return None
    axes = re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    n = math.prod(sizes)
    if m.group(2):
        order = _iota_groups(f"[{n}]<={m.group(2)}" if m.group(2).startswith("[") else "")
        ids = np.asarray(order if order is not None else hlo.ints(m.group(2))).reshape(sizes)
    else:
        ids = np.arange(n).reshape(sizes)
    listed = [names.index(a) for a in re.findall(r"'?([\w.\-]+)'?", m.group(3)) if a in names]
    rest = [i for i in range(len(names)) if i not in listed]
    return ids.transpose(rest + listed).reshape(-1, math.prod(sizes[i] for i in listed)).tolist()


def groups(op: hlo.Op, num_devices: int) -> list[list[int]]:
    """The device groups (partition indices) of a collective."""
    pairs = re.search(r"source_target_pairs=(\{(?:\{[\d,\s]*\},?\s*)*\})", op.attrs)
    if pairs:
        return [hlo.ints(p) for p in re.findall(r"\{([\d,\s]*)\}", pairs.group(1)[1:-1])]
    m = re.search(r"replica_groups=", op.attrs)
    if not m:
        return [list(range(num_devices))]
    text = op.attrs[m.end() :]
    if text.startswith("{"):
        inner = text[: hlo.closing(text, 0)][1:-1]
        found = [hlo.ints(g) for g in re.findall(r"\{([\d,\s]*)\}", inner)]
        return [g for g in found if g] or [list(range(num_devices))]
    found = _iota_groups(text) or _mesh_groups(text)
    if found is None:
        raise ValueError(f"unknown replica_groups form in {op.name}: {text[:80]}")
    return found


def axes(device_groups: list[list[int]], shape: dict[str, int]) -> str:
    """The mesh axes along which the members of the groups differ, as "a" or "a,b"."""
    names, sizes = list(shape), list(shape.values())
    total = math.prod(sizes)
    spanned = set()
    for group in device_groups:
        coords = [np.unravel_index(d % total, sizes) for d in group]
        for i, name in enumerate(names):
            if len({c[i] for c in coords}) > 1:
                spanned.add(name)
    return ",".join(n for n in names if n in spanned)
