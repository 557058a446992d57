"""A Hugging Face Llama or Mixtral folder → a run's parameters, each straight into its sharding.

:func:`open` checks everything that can be checked without reading a weight — ``config.json``
against the run's model section (:func:`meshpar.hf.model_config.check_model`), every tensor's name,
shape and dtype kind against what that model has — and fails in one line naming the first
problem; :meth:`Source.load` then reads each tensor once, converts it to the parameter dtype
and places it (:mod:`meshpar.hf.place`), and reports what it cost in host memory.

The bound it keeps: the process's peak resident memory stays below its baseline (taken once
the placement programs are compiled, before the first tensor is read) plus the parameters'
bytes as placed (on a CPU host the devices' memory is the host's) plus twice the largest
tensor (the bytes read, and their converted copy). A Mixtral's experts are tensors of their own
(one expert's matrix each, also where transformers 5 stores them fused: each expert's block is
read on its own), placed into the ``[layers, experts, ...]`` stacks one at a time, so the bound
is the same.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import jax
import numpy as np

from meshpar.configuration.errors import CheckpointError
from meshpar.hf import model_config as hf_config
from meshpar.hf import names, place, reader
from meshpar.models import fp8


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == reader.DTYPES["BF16"]  # ml_dtypes' bfloat16 is of kind 'V'


@dataclasses.dataclass
class Report:
    """What an import read and placed, and its peak host memory against the bound."""

    tensors: int
    files: int
    file_bytes: int  # as stored
    placed_bytes: int  # over all devices, replicas included
    largest_tensor_bytes: int  # the largest tensor, stored or converted
    baseline_rss: int  # high-water resident bytes once compiled, before reading
    peak_rss: int  # high-water resident bytes after placing everything
    seconds: float

    @property
    def bound(self) -> int:
        return self.baseline_rss + self.placed_bytes + 2 * self.largest_tensor_bytes

    def describe(self) -> str:
        mib = 2**20
        return (
            f"peak RSS {self.peak_rss / mib:.2f} MiB = {self.baseline_rss / mib:.2f} before reading + "
            f"{(self.peak_rss - self.baseline_rss) / mib:.2f} (placed {self.placed_bytes / mib:.2f}, "
            f"largest tensor {self.largest_tensor_bytes / mib:.2f}; bound: placed + 2 x largest)"
        )


@dataclasses.dataclass
class Source:
    """A checked Hugging Face folder, ready to load into parameters of `model` (a LlamaConfig)."""

    folder: Path
    model: object
    files: reader.Folder
    tensors: list[names.Tensor]

    def describe(self) -> str:
        n = len(self.files.files)
        stored = len({t.hf for t in self.tensors})
        return f"{self.folder} (Hugging Face, {stored} tensors in {n} safetensors file{'s' * (n > 1)})"

    def load(self, abstract_params, shardings) -> tuple[object, Report]:
        """Parameters shaped as `abstract_params` (an nnx.State of ShapeDtypeStructs), each in its
        sharding from `shardings` (the same structure: a run's ``plan.shardings.params``)."""
        start = time.perf_counter()
        groups = names.by_param(self.tensors)
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
        targets = jax.tree.leaves(shardings)
        paths = [param_path(p) for p, _ in flat]
        weights = [p for p in paths if not fp8.is_history(p)]  # FP8 histories start empty
        if sorted(weights) != sorted(groups):
            raise ValueError(f"the model's parameters {sorted(weights)} are not the checkpoint's {sorted(groups)}")
        placer = place.Placer()
        stacks = {}
        for path, (_, sds), target in zip(paths, flat, targets):
            if not fp8.is_history(path) and groups[path][0].layer is not None:
                stacks[path] = placer.stack(sds.shape, sds.dtype, target, len(groups[path][0].layer))
        placer.compile()
        baseline = place.peak_rss()
        out, largest = [], 0
        for path, (_, sds), target in zip(paths, flat, targets):
            if fp8.is_history(path):
                out.append(placer.put(np.zeros(sds.shape, sds.dtype), target))
                continue
            group = groups[path]
            largest = max(largest, *(self._largest(t, sds.dtype) for t in group))
            if path in stacks:
                out.append(placer.fill(stacks[path], lambda i, g=group, d=sds.dtype: self._read(g[i], d), target))
            else:
                host = self._read(group[0], sds.dtype)
                out.append(placer.put(host, target))
                del host
        jax.block_until_ready(out)
        report = Report(
            tensors=len({t.hf for t in self.tensors}), files=len(self.files.files), file_bytes=self.files.nbytes,
            placed_bytes=sum(place.placed_bytes(x) for x in out), largest_tensor_bytes=largest,
            baseline_rss=baseline, peak_rss=place.peak_rss(), seconds=time.perf_counter() - start,
        )  # fmt: skip
        return jax.tree.unflatten(treedef, out), report

    def _read(self, tensor: names.Tensor, dtype) -> np.ndarray:
        if tensor.part is None:
            stored = self.files.read(tensor.hf)
        else:
            stored = self.files.read_block(tensor.hf, tensor.part, tensor.hf_shape)
        return tensor.to_meshpar(stored, dtype)

    def _largest(self, tensor: names.Tensor, dtype) -> int:
        """The bytes of `tensor` as read (a block of a fused tensor: that block's) or converted."""
        itemsize = self.files.tensors[tensor.hf].dtype.itemsize
        size = math.prod(tensor.hf_shape)
        return size * max(itemsize, np.dtype(dtype).itemsize)


def path_name(path) -> str:
    """A pytree key path as text: ``blocks/wq/value`` (dict keys, attribute names, indices)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def param_path(path) -> str:
    """A parameter's path in an nnx state (``blocks/wq``), without the Variable's ``value``."""
    return path_name(path).removesuffix("/value")


def open(folder: str | Path, model) -> Source:
    """Check `folder` against `model` (a run's model config) without reading a weight: its
    config.json (ConfigError naming the key), then its tensors (CheckpointError naming the
    tensor: missing, not a float, another shape, or one this model has not), a Mixtral's
    experts in either spelling (:func:`meshpar.hf.names.fused`)."""
    folder = Path(folder)
    path = folder / "config.json"
    arch = hf_config.architecture(hf_config.read_json(path), str(path))
    hf_config.check_model(model, arch, str(path))
    files = reader.Folder(folder)
    expected = names.tensors(model, names.fused(files.tensors))
    for t in expected:
        info = files.tensors.get(t.hf)
        if info is None:
            raise CheckpointError(f"{folder}: tensor {t.hf} is missing (meshpar's {t.where()}, {list(t.hf_shape)})")
        if not _is_float(info.dtype):
            raise CheckpointError(f"{folder}: tensor {t.hf} is {info.describe()}, not a float")
        if info.shape != t.stored_shape:
            raise CheckpointError(
                f"{folder}: tensor {t.hf} has shape {list(info.shape)}; this model's {t.where()} needs {list(t.stored_shape)}"
            )
    known = {t.hf for t in expected}
    for name in sorted(files.tensors):
        if name not in known and not names.skipped(name, model):
            raise CheckpointError(
                f"{folder}: tensor {name} ({files.tensors[name].describe()}) is no parameter of this "
                f"{names.kind(model)} ({len(known)} tensors; config.json says what it is)"
            )
    return Source(folder, model, files, expected)
