"""What a checkpoint records to verify itself later: array digests and a manifest of its files.

- **Array digests**, computed on device when a step is saved (an orbax item of the step, so
  committed with it): zstd keeps incompressible bytes raw and unchecksummed, so a damaged float
  can read back without any error; the digest catches it.
- **The file manifest** (``meshpar_manifest.json`` in the step folder): every file of the
  step's items with its size and SHA-256, written after orbax has finished writing the items
  and before it commits the step (orbax's ``post_finalization_callback``; should a later orbax
  call it after the commit, the manifest is written right after it). The manifest carries
  its own digest.

With both, a restore tells apart a checkpoint that is *damaged* (a file missing, shorter, or
other bytes than were written; a manifest that fails its own digest; an array that does not
match its digest) from one that merely *cannot be read* right now (an I/O error, a timeout, a
tensorstore error on files that match the manifest). Only the first is set aside.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from meshpar.sharding import offload

MANIFEST = "meshpar_manifest.json"
# Written by orbax when it commits the step, after the manifest: not part of it.
_COMMIT_FILES = {"_CHECKPOINT_METADATA", "commit_success.txt", MANIFEST}
_CHUNK = 1 << 22


class Damaged(Exception):
    """Verified damage: the step differs from what its records say was written."""


class Unrecorded(Exception):
    """The step has no manifest (its save stopped between orbax's commit and the manifest)."""


# ---------------------------------------------------------------------------------------------
# The file manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: Path) -> list[Path]:
    out = []
    for root, dirs, names in os.walk(step_dir):
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            if not (path.parent == step_dir and name in _COMMIT_FILES):
                out.append(path)
    return out


def _seal(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(step_dir: Path, step: int) -> None:
    """Record every file of `step_dir` (size, SHA-256) in its manifest, written atomically."""
    files = {p.relative_to(step_dir).as_posix(): [p.stat().st_size, _sha256(p)] for p in _files(step_dir)}
    body = {"step": step, "files": files}
    tmp = step_dir / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({**body, "digest": _seal(body)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)


def verify_files(step_dir: Path, step: int) -> None:
    """Check `step_dir` against its manifest. Raises :class:`Damaged` on a difference,
    :class:`Unrecorded` when there is no manifest, and OSError when the files cannot be read
    (then nothing is known either way)."""
    try:
        text = (step_dir / MANIFEST).read_text()
    except FileNotFoundError:
        raise Unrecorded(f"no {MANIFEST}") from None
    try:
        manifest = json.loads(text)
        body = {"step": manifest["step"], "files": manifest["files"]}
        intact = manifest["digest"] == _seal(body)
    except (ValueError, KeyError, TypeError):
        intact = False
    if not intact:
        raise Damaged(f"{MANIFEST} does not match its own digest")
    if body["step"] != step:
        raise Damaged(f"{MANIFEST} is the manifest of step {body['step']}")
    for name, (size, digest) in body["files"].items():
        path = step_dir / name
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise Damaged(f"{name} is missing") from None
        if actual != size:
            raise Damaged(f"{name} has {actual} bytes, {size} were written")
        if _sha256(path) != digest:
            raise Damaged(f"{name} holds other bytes than were written")


# ---------------------------------------------------------------------------------------------
# Array digests


def _digest_one(x: jax.Array) -> jax.Array:
    """Position-weighted sums of the raw bits, mod 2**32: exact integer maths, so the same
    value under any sharding, and computed without a reshape (no resharding traffic)."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * min(x.dtype.itemsize, 4)}")).astype(jnp.uint32)
    idx, stride = jnp.zeros(bits.shape, jnp.uint32), 1
    for axis in reversed(range(bits.ndim)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    w1 = (idx * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)) | jnp.uint32(1)
    w2 = (idx * jnp.uint32(0x85EBCA6B) + jnp.uint32(0xC2B2AE35)) | jnp.uint32(1)
    mixed = bits ^ (bits >> 15) ^ (bits << 7)
    return jnp.stack([jnp.sum(bits * w1, dtype=jnp.uint32), jnp.sum(mixed * w2, dtype=jnp.uint32)])


def _spread(x: Any) -> tuple[NamedSharding | None, bool]:
    """x's sharding, also split over the mesh axes x is replicated on: reaching it is a local
    slice, and each element is then digested once, not once per replica (8x on data:8); and
    whether x lives in pinned host memory (offload), from where it is first moved to the
    devices: one operation cannot mix memory kinds, and the digest is computed on the devices."""
    s = getattr(x, "sharding", None)
    host = offload.on_host(s)
    if not isinstance(s, NamedSharding) or any(t != AxisType.Auto for t in s.mesh.axis_types):
        return (s.with_memory_kind("device") if host else None), host
    spec = [p if isinstance(p, tuple) else (p,) if p else () for p in s.spec] + [()] * (x.ndim - len(s.spec))
    for axis in [a for a in s.mesh.axis_names if s.mesh.shape[a] > 1 and all(a not in p for p in spec)]:
        for d, p in enumerate(spec):
            if x.shape[d] % (math.prod(s.mesh.shape[a] for a in p) * s.mesh.shape[axis]) == 0:
                spec[d] = (*p, axis)  # minor-most: each new block lies inside the device's own block
                break
    spread = NamedSharding(s.mesh, PartitionSpec(*(p or None for p in spec)), memory_kind="device" if host else None)
    return spread, host


def _placed(x: jax.Array, spread: tuple[NamedSharding | None, bool]) -> jax.Array:
    s, host = spread
    if host:
        return jax.device_put(x, s)  # from host memory to the devices, split as `s`
    return x if s is None else jax.lax.with_sharding_constraint(x, s)


@functools.partial(jax.jit, static_argnums=1)
def _digest(leaves: list, spreads: tuple) -> list:
    return [_digest_one(_placed(x, s)) for x, s in zip(leaves, spreads)]


def digest_program(leaves: list) -> jax.stages.Lowered:
    """The digest computation for `leaves` (arrays or ShapeDtypeStructs with shardings), lowered:
    what :func:`array_digests` runs, for the memory plan to compile ahead of time."""
    return _digest.lower(leaves, tuple(_spread(x) for x in leaves))


def array_digests(leaves: list, names: list[str], program: jax.stages.Compiled | None = None) -> dict[str, list[int]]:
    """Leaf name → digest of that array (two uint32), the same under any sharding. `program`:
    :func:`digest_program` for these leaves' shapes and shardings, already compiled."""
    out = jax.device_get(program(leaves) if program is not None else _digest(leaves, tuple(_spread(x) for x in leaves)))
    return {n: [int(v) for v in d] for n, d in zip(names, out)}


def json_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
