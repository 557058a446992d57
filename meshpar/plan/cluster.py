"""Clusters: a node kind × a node count × a network, the machine a multi-node run plans on.

A node kind is a shipped machine file (``h100-sxm-8``); a network is a file in
``meshpar/plan/networks/`` (``ndr-ib``: 8 × 400 Gb/s InfiniBand NDR per node, rail-optimized),
every figure with its source beside it. ``machine("h100-sxm-8", nodes=32)`` is 256 H100s in 32
nodes on the node kind's own network (its file's ``network:``), or on ``network=`` another. Its
devices are numbered node by node, as ``jax.distributed`` lays out a run of one process per node,
so a mesh's last axes lie within a node; a collective whose group spans nodes is priced as NCCL
runs it there (:mod:`meshpar.plan.time.nccl`). The spec: docs/time-model.md ("Clusters").
"""

from __future__ import annotations

import dataclasses
import pathlib

from meshpar.configuration.schema import ConfigError, is_number, parse_yaml
from meshpar.plan import topology
from meshpar.plan.time import nccl

DIR = pathlib.Path(__file__).parent / "networks"
KEYS = ("name", "description", "nics_per_node", "nic_gbps", "efficiency", "source")


@dataclasses.dataclass(frozen=True)
class Network:
    """The network between nodes: each node's cards, and the share of their line rate NCCL reaches."""

    name: str
    description: str
    nics_per_node: int
    nic_gbps: float  # line rate of one card, Gb/s, one direction
    efficiency: float
    source: str = ""

    @property
    def node_bps(self) -> float:
        """Bytes/s one node sends across the network through all its cards, effective."""
        return self.nics_per_node * self.nic_gbps * 1e9 / 8 * self.efficiency


def names() -> list[str]:
    """The shipped network names."""
    return sorted(p.stem for p in DIR.glob("*.yaml"))


def network(name: str) -> Network:
    """A shipped network by name; an unknown name or a malformed file is a one-line ConfigError
    (key ``--network``)."""
    if name not in names():
        raise ConfigError("--network", f"unknown network {name!r} (known: {', '.join(names())})")
    where = f"{name}.yaml"
    spec = parse_yaml((DIR / where).read_text(), where)
    unknown = sorted(set(spec) - set(KEYS)) if isinstance(spec, dict) else ["(not a mapping)"]
    if unknown:
        raise ConfigError("--network", f"{where}: unknown key {unknown[0]!r}")
    for key in ("nics_per_node", "nic_gbps", "efficiency"):
        if not is_number(spec.get(key)) or not spec[key] > 0:
            raise ConfigError("--network", f"{where}.{key}: expected a positive number, got {spec.get(key)!r}")
    if spec["efficiency"] > 1:
        raise ConfigError("--network", f"{where}.efficiency: {spec['efficiency']} is above 1")
    return Network(str(spec.get("name", name)), str(spec.get("description", "")), int(spec["nics_per_node"]),
                   float(spec["nic_gbps"]), float(spec["efficiency"]),
                   str(spec.get("source", "")))  # fmt: skip


def clustered(node: topology.Topology, nodes: int, net: Network) -> topology.Topology:
    """`nodes` nodes of the one-node kind `node` joined by `net`."""
    per_node = node.num_devices
    share = topology.Link(net.node_bps / per_node, nccl.RING_NET_S, "network")  # one device's share of the cards
    return dataclasses.replace(
        node, name=f"{node.name}x{nodes}" if nodes > 1 else node.name, num_devices=per_node * nodes,
        description=f"{nodes} x ({node.description}), {net.description}", hosts=nodes,
        node_link=share if nodes > 1 else None, network=net.name,
        host_groups=tuple(tuple(d + i * per_node for d in g) for i in range(nodes) for g in node.host_groups),
    )  # fmt: skip


def machine(name: str, nodes: int | None = None, network_name: str | None = None, devices: int | None = None):
    """The machine a plan prices on: a shipped machine by name or path (``devices``: see
    :func:`meshpar.plan.topology.load`), as `nodes` of it on `network_name` (default: the node
    kind's own network) when `nodes` is given. A bad node count, a network without a node
    count, or a node kind with no network to default to is a one-line ConfigError."""
    if network_name is not None and nodes is None:
        raise ConfigError("--network", "joins nodes: add --nodes N")
    node = topology.load(name, devices=devices)
    if nodes is None:
        return node
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError("--nodes", f"expected a positive number of nodes, got {nodes!r}")
    if node.gpu is None:
        raise ConfigError("--nodes", f"{node.name} is not a GPU node kind: clusters are of GPU nodes")
    if node.hosts != 1:
        raise ConfigError("--nodes", f"{node.name} is already {node.hosts} nodes: name a one-node machine")
    chosen = network_name or node.network
    if not chosen:
        raise ConfigError("--network", f"{node.name} names no network of its own: add --network ({', '.join(names())})")
    return clustered(node, nodes, network(chosen))
