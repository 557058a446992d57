"""Which of a model's FP8 dots XLA compiled into FP8 GEMMs, read from the compiled train step.

A dot meant to be FP8 (:mod:`meshpar.models.fp8`: model.fp8's kinds) runs under the jax name
``fp8_<kind>_<weight>``, which XLA keeps in each op's ``op_name`` metadata; its two backward
products carry ``transpose(jvp(...))`` after that name. Each GEMM of the program (a cuBLAS call,
a fusion holding a dot: Triton's, cuDNN's, or a bare dot) whose matrix product carries such a name
is one FP8 dot as run: *emitted* when both its matrix operands are 8-bit floats (XLA:GPU's
``__cublas$lt$matmul$f8``, or a fusion whose dot reads FP8), else *fallen back* (a bf16 or f32
GEMM on the dequantized values: the speed of FP8 lost, its rounding kept).

Where FP8 runs (docs/fp8.md):

- a GPU with FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper): checked, dot by dot;
- an older GPU (an A100: 8.0): refused before anything compiles (:func:`refuse`), one line naming
  model.fp8 and the GPU: XLA would run every FP8 dot as a dequantized bf16 GEMM;
- XLA:CPU (or a plan compiled on this host's CPU as a GPU's stand-in): *emulated*: the operands
  are rounded to FP8, the products run in the compute dtype, and the plan says so in one line.
"""

from __future__ import annotations

import dataclasses
import re

from meshpar import models
from meshpar.configuration.config import ConfigError
from meshpar.models import fp8 as fp8_lib
from meshpar.plan import gpu_target, hlo

# NVIDIA, CUDA C++ Programming Guide, "Compute Capabilities" (FP8 tensor-core MMA: sm_89 Ada and
# sm_90 Hopper onward); XLA:GPU's GEMM rewriter emits FP8 cuBLASLt calls from 8.9 on.
FP8_CAPABILITY = (8, 9)
# The cuBLASLt FP8 GEMM XLA:GPU emits (its GemmRewriter's kCublasLtMatmulF8CallTarget).
CUBLAS_F8 = "__cublas$lt$matmul$f8"
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Dot:
    """One GEMM of the compiled program that runs a dot meant to be FP8."""

    name: str  # the dot's label: "<kind>_<weight>", e.g. "mlp_w_up"
    direction: str  # "forward" or "backward"
    emitted: bool  # both matrix operands are 8-bit floats: an FP8 GEMM
    kernel: str  # what runs it: a custom-call target, a fusion kind, "dot"
    operands: tuple[str, ...]  # element types of its two matrix operands
    op: str  # the op's name in the program

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"operands": list(self.operands)}


@dataclasses.dataclass(frozen=True)
class Check:
    """A compiled step's FP8 dots: checked (a GPU with FP8 tensor cores) or emulated (XLA:CPU)."""

    kinds: tuple[str, ...]  # model.fp8
    mode: str  # "checked" or "emulated"
    compiled_for: str
    dots: tuple[Dot, ...]

    @property
    def emitted(self) -> int:
        return sum(d.emitted for d in self.dots)

    def count(self, direction: str) -> int:
        return sum(d.direction == direction for d in self.dots)

    @property
    def fallen_back(self) -> tuple[Dot, ...]:
        return tuple(d for d in self.dots if not d.emitted)

    def lines(self) -> list[str]:
        """What the plan prints: one line, and one more per dot that fell back."""
        split = f"forward {self.count('forward')}, backward {self.count('backward')}"
        if self.mode == "emulated":
            return [f"FP8 dots: emulated on {self.compiled_for}: operands rounded to FP8 (e4m3 forward, e5m2 "
                    f"gradients), the {len(self.dots)} dots ({split}) computed in the compute dtype; no FP8 "
                    "GEMMs on this backend"]  # fmt: skip
        if not self.dots:
            return ["FP8 dots: none found in the compiled program (no GEMM's op_name carries an fp8 scope)"]
        kernels = sorted({d.kernel for d in self.dots if d.emitted})
        head = (f"FP8 dots: {self.emitted} of {len(self.dots)} emitted as FP8 GEMMs ({split}"
                f"{'; ' + ', '.join(kernels) if kernels else ''})")  # fmt: skip
        return [head] + [
            f"FP8 dot {d.name} ({d.direction}) fell back: {d.kernel} on {'×'.join(d.operands)} operands ({d.op})"
            for d in self.fallen_back
        ]

    def to_json(self) -> dict:
        return {
            "kinds": list(self.kinds), "mode": self.mode, "compiled_for": self.compiled_for,
            "meant": len(self.dots), "emitted": self.emitted, "forward": self.count("forward"),
            "backward": self.count("backward"), "dots": [d.to_json() for d in self.dots],
        }  # fmt: skip


def _scope(op_name: str) -> tuple[str, str] | None:
    """(the dot's label, forward or backward) of an op_name under an FP8 dot's jax name, or None."""
    parts = op_name.split("/")
    for i, part in enumerate(parts):
        if part == fp8_lib.SCOPE or part.startswith(fp8_lib.SCOPE + "_"):
            backward = any("transpose(" in p for p in parts[i + 1 :])
            return part.removeprefix(fp8_lib.SCOPE).lstrip("_") or fp8_lib.SCOPE, "backward" if backward else "forward"
    return None


def _fused_dot(module: hlo.Module, computation: str) -> tuple[str, hlo.Op] | None:
    """The dot of a fused computation, through nested fusions: (its computation, the dot)."""
    for op in module.computations.get(computation, []):
        if op.opcode in ("dot", "scaled-dot"):
            return computation, op
        if op.opcode == "fusion":
            found = next((d for c in hlo.called(op) if (d := _fused_dot(module, c))), None)
            if found:
                return found
    return None


def _gemm(module: hlo.Module, computation: str, op: hlo.Op) -> tuple[str, hlo.Op, str] | None:
    """A GEMM op: (the computation of its matrix product, that product, the kernel), or None."""
    op = hlo.unwrap(op)
    if op.opcode == "custom-call" and hlo.target(op).startswith("__cublas$"):
        return computation, op, hlo.target(op)
    if op.opcode in ("dot", "scaled-dot"):
        return computation, op, op.opcode
    if op.opcode == "fusion" and hlo.called(op):
        found = _fused_dot(module, hlo.called(op)[0])
        if found:
            return found[0], found[1], hlo.fusion_kind(op) or "fusion"
    return None


def _executed(module: hlo.Module) -> list[str]:
    """The computations whose ops run as kernels: all but fusions' bodies."""
    fused = {c for ops in module.computations.values() for op in ops if op.opcode == "fusion" for c in hlo.called(op)}
    return [c for c in module.computations if c not in fused]


def dots(text: str) -> list[Dot]:
    """Every GEMM of a compiled program (its HLO text) that runs a dot meant to be FP8."""
    module = hlo.parse(text)
    out = []
    for computation in _executed(module):
        for op in module.computations[computation]:
            found = _gemm(module, computation, op)
            name = found and _OP_NAME.search(found[1].attrs)
            scope = name and _scope(name.group(1))
            if not scope:
                continue
            where, product, kernel = found
            types = tuple((hlo.arrays(module.operand_shape(where, product, i)) or [("?", ())])[0][0] for i in (0, 1))
            out.append(Dot(*scope, all(t.startswith("f8") for t in types), kernel, types, op.name))
    return sorted(out, key=lambda d: (d.name, d.direction != "forward", d.op))


def check(kinds, compiled, platform: str, compiled_for: str) -> Check | None:
    """The FP8 dots of a compiled train step (`compiled`, or its HLO text) of a model with FP8
    dots of `kinds`, compiled for `platform` (``gpu``: checked, else emulated); None without FP8."""
    if not kinds:
        return None
    mode = "checked" if platform == "gpu" else "emulated"
    return Check(tuple(kinds), mode, compiled_for, tuple(dots(hlo.text(compiled))))


def capability(text) -> tuple[int, int] | None:
    """A compute capability ("9.0", or (9, 0)) as (major, minor); None when not one."""
    if isinstance(text, tuple):
        return text
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(text or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def refuse(model_cfg, gpu: str, compute_capability) -> None:
    """ConfigError (``model.fp8``, one line) when the model has FP8 dots and the GPU `gpu` of
    `compute_capability` has no FP8 tensor cores; nothing otherwise."""
    traits = models.traits(model_cfg)
    cc = capability(compute_capability)
    if traits.fp8 and cc is not None and cc < FP8_CAPABILITY:
        raise ConfigError(
            traits.key("fp8"),
            f"{gpu} (compute capability {cc[0]}.{cc[1]}) has no FP8 tensor cores "
            f"({FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later: H100, H200)",
        )


def refuse_machine(cfg, topo) -> None:
    """:func:`refuse` for the GPU of a named machine (a machine without one: nothing)."""
    if topo is not None and topo.gpu is not None:
        refuse(cfg.model, topo.gpu.name, topo.gpu.compute_capability)


def refuse_device(cfg, device) -> None:
    """:func:`refuse` for a GPU device (this host's, or a compile-only one; others: nothing)."""
    if device.platform == "gpu":
        refuse(cfg.model, device.device_kind, getattr(device, "compute_capability", None))


def weighed_kinds(cfg, topo) -> tuple[str, ...]:
    """The kinds of dot ``--weigh-fp8`` compiles the search's best layouts with: the MLP's and
    the attention projections', and the experts' under capacity dispatch (dropless dispatch's
    ragged dots have no FP8 GEMM). ConfigError (``--weigh-fp8``) unless `topo` is a GPU machine
    with FP8 tensor cores whose programs XLA's GPU compiler here compiles: elsewhere FP8 dots
    are emulated, and their time says nothing of FP8's."""
    gpu = getattr(topo, "gpu", None)
    if gpu is None:
        raise ConfigError("--weigh-fp8", f"{topo.name} is not a GPU machine: FP8 dots would be emulated")
    cc = capability(gpu.compute_capability)
    if cc is not None and cc < FP8_CAPABILITY:
        raise ConfigError("--weigh-fp8", f"{gpu.name} (compute capability {cc[0]}.{cc[1]}) has no FP8 tensor cores")
    why = gpu_target.missing()
    if why:
        raise ConfigError("--weigh-fp8", f"FP8 is weighed on XLA:GPU's program, and {why}")
    experts = models.traits(cfg.model).experts and getattr(cfg.model, "moe_dispatch", "capacity") == "capacity"
    return ("mlp", "attention", *(("experts",) if experts else ()))
