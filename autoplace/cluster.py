"""Cluster: devices on nodes, memory, and the links between every pair.

A link between devices ``i`` and ``j`` costs ``alpha + nbytes / bandwidth`` seconds
(the alpha-beta model, ``beta = 1 / bandwidth``). Devices sit on nodes
(:mod:`autoplace.topology`): the pair matrices hold NVLink inside a node and the network
between nodes. The cluster also carries what collectives need (per-step latency, bus
bandwidth inside a node, the network's latency and per-GPU bandwidth, gamma for the
reduction); :mod:`autoplace.costs.collectives` prices collectives over that hierarchy the
way NCCL runs them (ring, tree, hierarchical).

This module also names the preset clusters and resolves a cluster from a preset name,
``"detect"`` or a file. A device is :mod:`autoplace.device`, the cluster file
:mod:`autoplace.cluster_json`, memory sizes :mod:`autoplace.byte_sizes`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autoplace.byte_sizes import GiB as GiB
from autoplace.byte_sizes import format_bytes, parse_bytes
from autoplace.cluster_json import CLUSTER_FORMAT as CLUSTER_FORMAT
from autoplace.cluster_json import MAX_FILE_DEVICES as MAX_FILE_DEVICES
from autoplace.cluster_json import cluster_from_json, cluster_to_json
from autoplace.device import Device, check_non_negative, check_positive
from autoplace.errors import AutoplaceError
from autoplace.files import write_json_atomic
from autoplace.topology import (
    CPU_SPEC,
    GPU_HOST_DISPATCH_S,
    GPU_SPECS,
    LINKS,
    NETWORK_ALPHA_S,
    NETWORK_BANDWIDTH,
    NODE_COUNTS,
    check_link_matrices,
    check_nodes,
    link_matrices,
    multi_node_name,
)
from autoplace.topology import gpu_kind as _gpu_kind

__all__ = ["Device", "Cluster", "PRESETS", "preset", "resolve", "parse_bytes", "format_bytes"]


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Devices on nodes, plus link latency/bandwidth for every ordered pair.

    Consecutive devices share a node: device ``i`` is on node ``i // gpus_per_node``.
    The pair matrices are the truth for point-to-point copies; a multi-node cluster's
    are filled from its node structure by :meth:`multi_node` (NVLink inside a node, the
    network between nodes).

    Attributes:
        name: preset name or label.
        devices: the devices, index = device index in plans.
        alpha_s: ``alpha_s[i][j]`` latency of a copy from i to j, seconds.
        bandwidth: ``bandwidth[i][j]`` bytes/s of a copy from i to j.
        gamma_s_per_byte: reduction compute cost per byte in collectives.
        collective_alpha_s: per-step latency of collectives (NCCL launch + sync).
        collective_bandwidth: bus bandwidth collectives reach inside a node, bytes/s
            (None: the slowest link's).
        gpus_per_node: devices per node (None: all on one node; stored as the count).
        network_alpha_s: latency of one message between nodes, seconds.
        network_bandwidth: bytes/s each device's NIC sends to another node.
    """

    name: str
    devices: tuple[Device, ...]
    alpha_s: tuple[tuple[float, ...], ...]
    bandwidth: tuple[tuple[float, ...], ...]
    gamma_s_per_byte: float = 0.0
    collective_alpha_s: float = 10e-6
    collective_bandwidth: float | None = None
    calibration: dict[str, Any] = field(default_factory=dict)
    gpus_per_node: int | None = None
    network_alpha_s: float = NETWORK_ALPHA_S
    network_bandwidth: float = NETWORK_BANDWIDTH

    def __post_init__(self) -> None:
        n = len(self.devices)
        if n == 0:
            raise AutoplaceError("a cluster needs at least one device")
        where = f"cluster {self.name!r}"
        gpn = n if self.gpus_per_node is None else check_nodes(n, self.gpus_per_node, where)
        object.__setattr__(self, "gpus_per_node", gpn)
        check_link_matrices(self.alpha_s, self.bandwidth, n, where)
        check_non_negative(self.network_alpha_s, f"{where}: network_alpha_s")
        check_positive(self.network_bandwidth, f"{where}: network_bandwidth")
        check_non_negative(self.gamma_s_per_byte, f"cluster {self.name!r}: gamma_s_per_byte")
        check_non_negative(self.collective_alpha_s, f"cluster {self.name!r}: collective_alpha_s")
        if self.collective_bandwidth is not None:
            check_positive(self.collective_bandwidth,
                           f"cluster {self.name!r}: collective_bandwidth")
        if not isinstance(self.calibration, dict):
            raise AutoplaceError(f"cluster {self.name!r}: calibration must be an object")

    # ------------------------------------------------------------------ basics
    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        """Number of nodes (hosts)."""
        return self.num_devices // self.gpus_per_node

    def node_of(self, device: int) -> int:
        """The node device ``device`` is on."""
        if not 0 <= device < self.num_devices:
            raise AutoplaceError(f"device {device} is not in cluster {self.name!r} (valid: "
                                 f"0..{self.num_devices - 1})")
        return device // self.gpus_per_node

    def node_devices(self, node: int) -> range:
        """The devices of node ``node``."""
        if not 0 <= node < self.num_nodes:
            raise AutoplaceError(f"node {node} is not in cluster {self.name!r} (valid: "
                                 f"0..{self.num_nodes - 1})")
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    @property
    def device_kinds(self) -> list[str]:
        """Distinct device kinds, in device order."""
        return list(dict.fromkeys(d.kind for d in self.devices))

    @property
    def is_cpu(self) -> bool:
        return all(d.kind == "cpu" for d in self.devices)

    def require_present(self, count: int | None = None, *, what: str = "this") -> None:
        """Raise :class:`AutoplaceError` unless this machine has the first ``count``
        devices (all when None): CUDA present for ``cuda`` devices, with enough GPUs."""
        import torch

        count = self.num_devices if count is None else count
        if count > self.num_devices:
            raise AutoplaceError(f"{what} needs {count} devices, but cluster {self.name!r} "
                                 f"has {self.num_devices}")
        names = [d.name for d in self.devices[:count]]
        cuda = [n for n in names if n.startswith("cuda")]
        if not cuda:
            return
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            raise AutoplaceError(
                f"{what} runs on GPUs ({', '.join(cuda)} of cluster {self.name!r}), but this "
                "machine has no CUDA device (torch.cuda.is_available() is False); use "
                "--cluster detect, or a CPU cluster such as cpu-x2")
        top = max(int(n.split(":")[1]) if ":" in n and n.split(":")[1].isdigit() else 0
                  for n in cuda)
        if top >= have:
            raise AutoplaceError(f"{what} needs GPU {top} (cluster {self.name!r}, {count} "
                                 f"devices), but this machine has {have} GPU(s)")

    def torch_device(self, i: int) -> str:
        """The torch device string of device ``i`` in this process."""
        return self.devices[i].name

    def transfer_time(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` from device ``src`` to ``dst`` (0 on the same device)."""
        if src == dst or nbytes <= 0:
            return 0.0
        return self.alpha_s[src][dst] + nbytes / self.bandwidth[src][dst]

    # ------------------------------------------------------------- variations
    def with_memory_cap(self, cap_bytes: int | None) -> Cluster:
        """The same cluster with every device capped at ``cap_bytes`` (None removes caps)."""
        devs = tuple(replace(d, memory_cap_bytes=cap_bytes) for d in self.devices)
        name = self.name if cap_bytes is None else f"{self.name.split('@')[0]}@{format_bytes(cap_bytes)}"
        return replace(self, devices=devs, name=name)

    def subset(self, indices: list[int]) -> Cluster:
        """The cluster restricted to ``indices`` (renumbered from 0). Devices of several
        nodes must come node by node, as many from each."""
        nodes = [self.node_of(i) for i in indices]
        counts = {n: nodes.count(n) for n in nodes}
        gpn = len(indices) if len(counts) <= 1 else next(iter(counts.values()))
        if len(counts) > 1 and (len(set(counts.values())) > 1 or any(
                nodes[k] != nodes[k - 1] and nodes[k] in nodes[:k] for k in range(1, len(nodes)))):
            raise AutoplaceError(
                f"cannot take devices {indices} of cluster {self.name!r} as a cluster: they "
                f"lie on nodes {nodes}; take the same number from each node, node by node")
        return replace(
            self,
            devices=tuple(self.devices[i] for i in indices),
            alpha_s=tuple(tuple(self.alpha_s[i][j] for j in indices) for i in indices),
            bandwidth=tuple(tuple(self.bandwidth[i][j] for j in indices) for i in indices),
            gpus_per_node=gpn,
        )

    def summary(self) -> dict[str, Any]:
        """What a plan records about the cluster it was made for."""
        out = {
            "name": self.name,
            "num_devices": self.num_devices,
            "device_kinds": [d.kind for d in self.devices],
            "memory_bytes": [d.usable_memory_bytes for d in self.devices],
        }
        if self.num_nodes > 1:
            out["gpus_per_node"] = self.gpus_per_node
        return out

    # -------------------------------------------------------------------- json
    def to_json(self) -> dict[str, Any]:
        """The cluster as JSON: a multi-node cluster built from its node structure as one
        node and a count; any other with its pair matrices in full."""
        return cluster_to_json(self)

    @classmethod
    def from_json(cls, data: Any) -> Cluster:
        """A cluster from parsed JSON; raises :class:`AutoplaceError` naming what is wrong
        (numbers must be JSON numbers, positive and finite where they are rates or sizes)."""
        return cluster_from_json(data, cls)

    def save(self, path: str | Path) -> None:
        """Write the cluster as JSON atomically."""
        write_json_atomic(path, self.to_json(), allow_nan=False)

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        """Read a cluster file; errors name the file and the problem."""
        try:
            data = json.loads(Path(path).read_bytes())
        except (OSError, ValueError, RecursionError) as e:
            raise AutoplaceError(f"cannot read cluster file {path}: {e}") from None
        try:
            return cls.from_json(data)
        except AutoplaceError as e:
            raise AutoplaceError(f"{path}: {e}") from None

    # ---------------------------------------------------------------- builders
    @classmethod
    def uniform(
        cls,
        name: str,
        device: Device,
        n: int,
        *,
        alpha_s: float,
        bandwidth: float,
        collective_bandwidth: float | None = None,
        gamma_s_per_byte: float = 0.0,
        names: list[str] | None = None,
    ) -> Cluster:
        """``n`` copies of ``device`` on one node, fully connected by identical links."""
        devs = tuple(
            replace(device, name=(names[i] if names else device.name.replace("{i}", str(i))))
            for i in range(n)
        )
        a, b = link_matrices(n, n, alpha_s, bandwidth, NETWORK_ALPHA_S, NETWORK_BANDWIDTH)
        return cls(
            name=name,
            devices=devs,
            alpha_s=a,
            bandwidth=b,
            collective_bandwidth=collective_bandwidth,
            gamma_s_per_byte=gamma_s_per_byte,
        )

    @classmethod
    def multi_node(
        cls,
        name: str,
        device: Device,
        gpus_per_node: int,
        num_nodes: int,
        *,
        alpha_s: float,
        bandwidth: float,
        collective_bandwidth: float | None = None,
        network_alpha_s: float = NETWORK_ALPHA_S,
        network_bandwidth: float = NETWORK_BANDWIDTH,
        gamma_s_per_byte: float = 0.0,
    ) -> Cluster:
        """``num_nodes`` nodes of ``gpus_per_node`` copies of ``device``: ``alpha_s`` /
        ``bandwidth`` between two devices of a node (NVLink), the network's between
        nodes. Device names repeat on each node (``cuda:0`` .. ``cuda:{g-1}``): a device
        name is what its process on its own node calls it."""
        if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
            raise AutoplaceError(f"cluster {name!r}: num_nodes must be a positive integer, "
                                 f"got {num_nodes!r}")
        check_nodes(gpus_per_node, gpus_per_node, f"cluster {name!r}")
        node = tuple(replace(device, name=device.name.replace("{i}", str(i)))
                     for i in range(gpus_per_node))
        n = gpus_per_node * num_nodes
        a, b = link_matrices(n, gpus_per_node, alpha_s, bandwidth, network_alpha_s,
                             network_bandwidth)
        return cls(name=name, devices=node * num_nodes, alpha_s=a, bandwidth=b,
                   gpus_per_node=gpus_per_node, collective_bandwidth=collective_bandwidth,
                   network_alpha_s=network_alpha_s, network_bandwidth=network_bandwidth,
                   gamma_s_per_byte=gamma_s_per_byte)

    @classmethod
    def detect(cls) -> Cluster:
        """The devices of this machine: every visible CUDA GPU, else two CPU devices."""
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            n = torch.cuda.device_count()
            props = torch.cuda.get_device_properties(0)
            kind = _gpu_kind(props.name)
            base = _GPU_SPECS.get(kind, _GPU_SPECS["h100"])
            dev = replace(base, name="cuda:{i}", kind=kind, memory_bytes=int(props.total_memory),
                          host_dispatch_s=GPU_HOST_DISPATCH_S)
            link = LINKS.get(kind, LINKS["h100"])
            return cls.uniform(f"detect-{kind}x{n}", dev, n, **link)
        return preset("cpu-x2")

    def __repr__(self) -> str:
        kinds = ",".join(self.device_kinds)
        mem = format_bytes(min(d.usable_memory_bytes for d in self.devices))
        nodes = f"{self.num_nodes} nodes x {self.gpus_per_node}" if self.num_nodes > 1 else ""
        return f"Cluster({self.name!r}, {nodes or self.num_devices}x {kinds}, {mem} each)"


# ------------------------------------------------------------------- presets
_GPU_SPECS: dict[str, Device] = {k: Device(**spec) for k, spec in GPU_SPECS.items()}
_CPU = Device(**CPU_SPEC)


def _gpu_preset(kind: str, n: int) -> Cluster:
    return Cluster.uniform(f"{kind}x{n}", _GPU_SPECS[kind], n, **LINKS[kind])


def _multi_node_preset(kind: str, num_nodes: int) -> Cluster:
    return Cluster.multi_node(multi_node_name(kind, 8, num_nodes), _GPU_SPECS[kind], 8,
                              num_nodes, **LINKS[kind])


def _cpu_preset(n: int) -> Cluster:
    return Cluster.uniform(f"cpu-x{n}", _CPU, n, alpha_s=50e-6, bandwidth=5e9)


PRESETS: dict[str, Any] = {
    **{f"h100x{n}": (lambda n=n: _gpu_preset("h100", n)) for n in (1, 2, 4, 8)},
    **{f"h200x{n}": (lambda n=n: _gpu_preset("h200", n)) for n in (1, 2, 4, 8)},
    **{f"a100x{n}": (lambda n=n: _gpu_preset("a100", n)) for n in (2, 4, 8)},
    **{f"a100-pcie-x{n}": (lambda n=n: _gpu_preset("a100-pcie", n)) for n in (2, 4)},
    **{f"cpu-x{n}": (lambda n=n: _cpu_preset(n)) for n in (1, 2, 4)},
    **{multi_node_name(kind, 8, nodes): (lambda kind=kind, nodes=nodes: _multi_node_preset(
        kind, nodes)) for kind in ("h100", "h100-96", "h200") for nodes in NODE_COUNTS},
}


def preset(name: str) -> Cluster:
    """A named preset cluster; the error lists the valid names."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise AutoplaceError(
            f"unknown cluster preset {name!r}; valid: {', '.join(PRESETS)}, detect, or a JSON path"
        ) from None


def resolve(spec: str | Cluster, memory_cap: str | int | None = None) -> Cluster:
    """A cluster from a preset name, ``"detect"``, or a JSON file path; optionally capped."""
    if isinstance(spec, Cluster):
        cluster = spec
    elif spec == "detect":
        cluster = Cluster.detect()
    elif spec in PRESETS:
        cluster = preset(spec)
    elif spec.endswith(".json") or Path(spec).is_file():
        cluster = Cluster.load(spec)
    else:
        cluster = preset(spec)  # raises with the valid names
    if memory_cap is not None:
        cluster = cluster.with_memory_cap(parse_bytes(memory_cap))
    return cluster
