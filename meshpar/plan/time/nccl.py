"""Collectives across nodes, priced the way NCCL's own tuner prices them: a ring (and, for an
all-reduce, a tree) through the nodes' NVLink and their network cards, whichever is faster.

A collective whose device group spans several nodes (:class:`Span`: how many nodes, how many of
the group's devices on each) runs as NCCL runs it: rings that cross NVLink inside a node and one
network card between nodes, all of a node's cards carrying the rings of the groups that share it.
Its bus bandwidth is the slower of the node's NVLink ring and the group's share of the node's
network cards (every group of the collective runs at once, so a group with `per_node` devices on
a node of `gpus_per_node` gets ``per_node / gpus_per_node`` of the node's cards). Latency:
NCCL's model, Simple protocol, per algorithm: a ring pays one step per rank (NVLink steps at the
NVLink figure, steps that leave a node at the network's), a tree twice the chain inside a node
plus log2(nodes) network hops. The constants are NCCL's (``src/graph/tuning.cc``, cited below);
the bandwidths are the machine's and the network's files'. The spec: docs/time-model.md
("Clusters").
"""

from __future__ import annotations

import dataclasses
import math

# NVIDIA/nccl src/graph/tuning.cc (commit 01afd20a77b5804e0ecf1042509dd9d20ebf9e93), Simple
# protocol, µs: baseLat (Ring 8.4, Tree 0), hwLat NVLink (Ring 3.4, Tree 28), hwLat NET (Ring
# 9.6, Tree 50); the ring all-reduce's latency × 1.9 across nodes once a message reaches
# nRanks/16 × 64 KiB ("plateau effect of ring"); a tree's bus bandwidth 0.9 of the ring's and
# its algorithm bandwidth half its bus bandwidth.
RING_BASE_S, RING_NVLINK_S, RING_NET_S = 8.4e-6, 3.4e-6, 9.6e-6
TREE_NVLINK_S, TREE_NET_S = 28e-6, 50e-6
RING_PLATEAU, PLATEAU_BYTES_PER_RANK = 1.9, 65536 / 16
TREE_BUS_SHARE, TREE_ALG_RATIO = 0.9, 0.5


@dataclasses.dataclass(frozen=True)
class Span:
    """How a collective's device group lies over the nodes, and the bandwidths it gets."""

    nodes: int  # nodes the group spans
    per_node: int  # the group's devices on each of them
    network_bps: float  # bytes/s (one direction) of the node's network cards this group gets
    nvlink_bps: float  # ring bus bandwidth inside a node, bytes/s

    @property
    def bus_bps(self) -> float:
        """Bus bandwidth of a ring through the group: its slowest hop."""
        return min(self.network_bps, self.nvlink_bps) if self.per_node > 1 else self.network_bps


def _ring_latency(steps: int, inter_steps: int) -> float:
    return RING_BASE_S + (steps - inter_steps) * RING_NVLINK_S + inter_steps * RING_NET_S


def allreduce_seconds(nbytes: float, span: Span, factor: float, steps: int, inter_steps: int) -> float:
    """One all-reduce of `nbytes` per device: the faster of NCCL's ring (each device sending
    `factor` × its bytes in `steps` steps, `inter_steps` of them between nodes) and its tree."""
    n = span.nodes * span.per_node
    ring_latency = _ring_latency(steps, inter_steps)
    if nbytes >= n * PLATEAU_BYTES_PER_RANK:
        ring_latency *= RING_PLATEAU
    ring = ring_latency + nbytes * factor / span.bus_bps
    tree_latency = 2 * ((span.per_node - 1) * TREE_NVLINK_S + math.log2(span.nodes) * TREE_NET_S)
    tree = tree_latency + nbytes / (span.bus_bps * TREE_BUS_SHARE * TREE_ALG_RATIO)
    return min(ring, tree)


def seconds(kind: str, nbytes: float, span: Span, ring: tuple[float, int], inter_steps: int) -> float:
    """One collective of `kind` over a group laid over nodes as `span`; `nbytes` is the HLO
    buffer per device (an all-gather's: the gathered result; a reduce-scatter's: its input);
    `ring`: the share of its bytes each device sends and the steps of a ring over the group
    (:func:`meshpar.plan.cost.ring`), `inter_steps` those of a ring over its nodes."""
    factor, steps = ring
    if span.nodes * span.per_node <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all-reduce":
        return allreduce_seconds(nbytes, span, factor, steps, inter_steps)
    if kind in ("all-gather", "reduce-scatter"):  # NCCL runs both as rings only
        return _ring_latency(steps, inter_steps) + nbytes * factor / span.bus_bps
    per_device = span.network_bps / span.per_node
    if kind == "all-to-all":  # the part bound for other nodes leaves through this device's share of the cards
        n = span.nodes * span.per_node
        leaving, inside = nbytes * (n - span.per_node) / n, nbytes * (span.per_node - 1) / n
        return RING_BASE_S + RING_NET_S + max(leaving / per_device, inside / span.nvlink_bps)
    # collective-permute: each device sends its buffer to one peer, across the network
    return RING_BASE_S + RING_NET_S + nbytes / per_device
