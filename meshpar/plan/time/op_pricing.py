"""Seconds of one execution of a compute op on a machine: on a GPU from its kernel costs (a GEMM by
shape, fused attention, every other kernel by its bytes or FLOPs, plus the fixed cost of a
launch), elsewhere at the roofline of the machine's FLOP and memory rates.

The spec: docs/time-model.md; the GPU's component costs: :mod:`meshpar.plan.time.kernels`.
"""

from __future__ import annotations

from meshpar.plan import hlo
from meshpar.plan.time import kernels
from meshpar.plan.time.memory_rates import Memory
from meshpar.plan.time.op_bytes import op_bytes
from meshpar.plan.time.work import module_op_costs


def roofline(module: hlo.Module, flop_rate: float, memory: Memory) -> tuple[float, float, float, float]:
    """(seconds, flops, bytes, seconds of the bytes alone) of the program's non-collective ops:
    each op takes the longer of its FLOPs at `flop_rate` and its bytes at `memory`'s rate."""
    seconds = flops_total = bytes_total = memory_s = 0.0
    for op in module_op_costs(module):
        moving = memory.seconds(op.bytes)
        flops_total += op.executions * op.flops
        bytes_total += op.executions * op.bytes
        memory_s += op.executions * moving
        seconds += op.executions * max(op.flops / flop_rate, moving)
    return seconds, flops_total, bytes_total, memory_s


def gpu_op_seconds(module: hlo.Module, topology):
    """Seconds of one execution of a compute op on a GPU from the topology's kernel costs
    (:mod:`meshpar.plan.time.kernels`), and the kernels it launches."""
    costs, sms = topology.kernels, topology.gpu.sm_count
    flops_of = hlo.flops_of(module)
    bandwidth = topology.device_memory_bandwidth * costs.memory_fraction

    def seconds(computation: str, op: hlo.Op) -> tuple[float, int, str]:
        moving = op_bytes(module, computation, op) / bandwidth
        inner = hlo.unwrap(op)
        name = hlo.target(inner)
        gemm = kernels.gemm(module, computation, op)
        if gemm is not None:
            peak = topology.peak(kernels.peak_dtype(gemm.dtype))
            work, component = kernels.gemm_seconds(gemm, peak, sms, costs), "gemm"
        elif name.startswith("__cudnn$fmha"):
            q = hlo.arrays(module.operand_shape(computation, inner, 0))
            peak = topology.peak(kernels.peak_dtype(q[0][0] if q else "bf16"))
            flops = hlo.op_flops(module, computation, op, flops_of)
            blocks = kernels.attention_blocks(module, computation, op)
            work, component = kernels.attention_seconds(flops, blocks, peak, sms, costs), "attention"
        elif name.startswith("__cudnn$conv"):
            flops = hlo.op_flops(module, computation, op, flops_of)
            work, component = flops / (topology.peak("bfloat16") * costs.gemm_fraction), "gemm"
        else:  # elementwise and reductions: CUDA cores
            work = hlo.op_flops(module, computation, op, flops_of) / topology.peak_flops.get("float32", 1.0)
            component = "memory-bound"
        if moving > work:
            component = "memory-bound"
        return costs.launch_s + max(work, moving), 1, component

    return seconds


def roofline_op_seconds(module: hlo.Module, flop_rate: float, rates: Memory):
    """Seconds of one execution of an op at the roofline of the machine's rates (cpu-sim: the
    host's measured matmul and copy rates; no per-kernel cost)."""
    flops_of = hlo.flops_of(module)

    def seconds(computation: str, op: hlo.Op) -> tuple[float, int, str]:
        flops = hlo.op_flops(module, computation, op, flops_of)
        moving = rates.seconds(op_bytes(module, computation, op))
        return max(flops / flop_rate, moving), 1, "flop-bound" if flops / flop_rate >= moving else "memory-bound"

    return seconds
