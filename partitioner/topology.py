"""Pure: the machine as the planner sees it: devices, links per level, and where ranks go.

Two levels: within a node (NVLink; loopback on this machine) and across nodes (InfiniBand).
Rank ``r`` sits on node ``r // devices_per_node``. A stage's replicas average a whole
gradient every batch while neighbouring stages exchange only activations, so
``make_rank_map`` keeps replicas on the fastest level first (``pipedream2bw.pipeline.layout``'s default
placement, which the runtime uses), and the cost model charges each transfer the slowest link it crosses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from pipedream2bw.config import TopologyConfig
from pipedream2bw.errors import ConfigError
from pipedream2bw.pipeline.layout import default_layout

GIB = 2**30


@dataclass(frozen=True)
class Link:
    """A link level: bandwidth (bytes/s) and per-message latency (s)."""

    name: str
    bandwidth: float
    latency: float


LOCAL = Link("local", float("inf"), 0.0)  # two replicas of nothing: w = 1, or a rank talking to itself


def num_devices(topo: TopologyConfig) -> int:
    return topo.nodes * topo.devices_per_node


def intra_link(topo: TopologyConfig) -> Link:
    return Link("intra-node", topo.intra_node_bw_gbps * 1e9, topo.intra_node_latency_us * 1e-6)


def inter_link(topo: TopologyConfig) -> Link:
    return Link("inter-node", topo.inter_node_bw_gbps * 1e9, topo.inter_node_latency_us * 1e-6)


def host_device_bandwidth(topo: TopologyConfig) -> float:
    return topo.host_device_bw_gbps * 1e9


def node_of(topo: TopologyConfig, rank: int) -> int:
    return rank // topo.devices_per_node


def link_between(topo: TopologyConfig, a: int, b: int) -> Link:
    """The link two ranks share: intra-node if on one node, else inter-node."""
    if a == b:
        return LOCAL
    return intra_link(topo) if node_of(topo, a) == node_of(topo, b) else inter_link(topo)


def slowest(links: Sequence[Link]) -> Link:
    return min(links, key=lambda link: (link.bandwidth, -link.latency), default=LOCAL)


def make_rank_map(topo: TopologyConfig, num_stages: int, data_parallel: int) -> List[List[int]]:
    """``rank_map[stage][replica]``: the placement the runtime uses by default
    (``pipedream2bw.pipeline.layout.default_layout``, a node's ranks being its ``devices_per_node``): a stage's
    replicas on one node when ``w`` divides a node's devices (stage-major), else each replica's
    stages on consecutive ranks (replica-major).

    Raises:
        ConfigError: more ranks than the topology has devices.
    """
    d, w = num_stages, data_parallel
    if d * w > num_devices(topo):
        raise ConfigError(
            f"{d} stages x {w} replicas need {d * w} devices but topology {topo.name!r} has {num_devices(topo)}; "
            f"raise topology.nodes or topology.devices_per_node"
        )
    return [list(row) for row in default_layout(d, w, ranks_per_node=topo.devices_per_node).ranks]


def p2p_links(topo: TopologyConfig, rank_map: Sequence[Sequence[int]]) -> List[Link]:
    """``links[s]``: the slowest link between stage s and s+1 over all replicas (d-1 entries)."""
    return [
        slowest([link_between(topo, a, b) for a, b in zip(rank_map[s], rank_map[s + 1])])
        for s in range(len(rank_map) - 1)
    ]


def replica_links(topo: TopologyConfig, rank_map: Sequence[Sequence[int]]) -> List[Link]:
    """``links[s]``: the slowest link among stage s's replicas (what its all-reduce runs over)."""
    return [slowest([link_between(topo, row[0], r) for r in row[1:]]) for row in rank_map]
