"""The cluster file (``"format": "autoplace.cluster/1"``): a cluster to JSON and back.

A multi-node cluster built from its node structure is written compactly, as one node
and a count; any other cluster with its pair matrices in full. Reading refuses what is
not a JSON number where a number belongs and names the key that is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

from autoplace.device import Device, is_number
from autoplace.errors import AutoplaceError
from autoplace.plan import strict_json
from autoplace.topology import NETWORK_ALPHA_S, NETWORK_BANDWIDTH, link_matrices, node_json

if TYPE_CHECKING:
    from autoplace.cluster import Cluster

__all__ = ["CLUSTER_FORMAT", "MAX_FILE_DEVICES", "cluster_to_json", "cluster_from_json"]

CLUSTER_FORMAT = "autoplace.cluster/1"
#: Devices a compact cluster file may expand to (its pair matrices grow as the square).
MAX_FILE_DEVICES = 2048


def cluster_to_json(cluster: Cluster) -> dict[str, Any]:
    """The cluster as JSON: a multi-node cluster built from its node structure as one
    node and a count; any other with its pair matrices in full."""
    compact = _node_form(cluster)
    if compact is not None:
        d = {"format": CLUSTER_FORMAT, "name": cluster.name, "nodes": cluster.num_nodes,
             "node": compact}
        for key in ("gamma_s_per_byte", "collective_alpha_s", "collective_bandwidth",
                    "network_alpha_s", "network_bandwidth"):
            d[key] = getattr(cluster, key)
        d["calibration"] = dict(cluster.calibration)
        return d
    d = asdict(cluster)
    d["format"] = CLUSTER_FORMAT
    d["devices"] = [asdict(x) for x in cluster.devices]
    d["alpha_s"] = [list(r) for r in cluster.alpha_s]
    # a device's link to itself is infinitely fast: null in the file (JSON has no inf)
    d["bandwidth"] = strict_json(cluster.bandwidth)
    return d


def _node_form(cluster: Cluster) -> dict[str, Any] | None:
    """Node 0 as the compact form's ``node``, when the whole cluster is that node
    repeated (same devices, matrices as :func:`~autoplace.topology.link_matrices`
    fills them); else None."""
    g, n = cluster.gpus_per_node, cluster.num_devices
    if cluster.num_nodes == 1 or any(cluster.devices[i] != cluster.devices[i % g]
                                     for i in range(n)):
        return None
    intra = (cluster.alpha_s[0][1], cluster.bandwidth[0][1]) if g > 1 else (0.0, 1.0)
    built = link_matrices(n, g, *intra, cluster.network_alpha_s, cluster.network_bandwidth)
    if built != (cluster.alpha_s, cluster.bandwidth):
        return None
    return node_json([asdict(d) for d in cluster.devices[:g]],
                     *(intra if g > 1 else (None, None)))


def cluster_from_json(data: Any, build: Callable[..., Cluster]) -> Cluster:
    """``build(**fields)`` with the cluster's fields read from parsed JSON (``build`` is
    the cluster class); raises :class:`AutoplaceError` naming what is wrong (numbers must
    be JSON numbers, positive and finite where they are rates or sizes)."""
    if not isinstance(data, dict) or data.get("format") != CLUSTER_FORMAT:
        raise AutoplaceError(
            f"not a cluster file: expected a JSON object with \"format\": \"{CLUSTER_FORMAT}\""
        )
    try:
        coll_bw = data.get("collective_bandwidth")
        calibration = data.get("calibration", {})
        if not isinstance(calibration, dict):
            raise AutoplaceError("\"calibration\" must be an object")
        common = dict(
            name=str(data["name"]),
            gamma_s_per_byte=_number(data.get("gamma_s_per_byte", 0.0), "gamma_s_per_byte"),
            collective_alpha_s=_number(data.get("collective_alpha_s", 10e-6),
                                       "collective_alpha_s"),
            collective_bandwidth=None if coll_bw is None else _number(
                coll_bw, "collective_bandwidth"),
            calibration=dict(calibration),
            network_alpha_s=_number(data.get("network_alpha_s", NETWORK_ALPHA_S),
                                    "network_alpha_s"),
            network_bandwidth=_number(data.get("network_bandwidth", NETWORK_BANDWIDTH),
                                      "network_bandwidth"),
        )
        if "nodes" in data:
            return _from_node_json(data, common, build)
        devices = _devices_json(data["devices"])
        matrices = {}
        for key in ("alpha_s", "bandwidth"):
            m = data[key]
            if not isinstance(m, list) or not all(isinstance(r, list) for r in m):
                raise AutoplaceError(f"\"{key}\" must be a list of lists of numbers")
            matrices[key] = tuple(tuple(
                math.inf if (x is None and key == "bandwidth") else _number(x, key)
                for x in r) for r in m)
        return build(devices=devices, alpha_s=matrices["alpha_s"],
                     bandwidth=matrices["bandwidth"],
                     gpus_per_node=data.get("gpus_per_node"), **common)
    except KeyError as e:
        raise AutoplaceError(f"cluster file is malformed: missing key {e}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise AutoplaceError(f"cluster file is malformed: {e}") from None


def _from_node_json(data: dict[str, Any], common: dict[str, Any],
                    build: Callable[..., Cluster]) -> Cluster:
    """The compact form: ``nodes`` copies of ``node``, linked as the topology links them."""
    nodes, node = data["nodes"], data["node"]
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise AutoplaceError(f"\"nodes\" must be a positive integer, got {nodes!r}")
    if not isinstance(node, dict):
        raise AutoplaceError("\"node\" must be an object with \"devices\" (and "
                             "\"link_alpha_s\", \"link_bandwidth\" for two or more)")
    devices = _devices_json(node["devices"])
    g = len(devices)
    if g * nodes > MAX_FILE_DEVICES:
        raise AutoplaceError(f"{nodes} nodes x {g} devices is more than the "
                             f"{MAX_FILE_DEVICES} devices a cluster file may describe")
    link = (0.0, 1.0)
    if g > 1:
        link = (_number(node["link_alpha_s"], "link_alpha_s"),
                _number(node["link_bandwidth"], "link_bandwidth"))
    alpha, bandwidth = link_matrices(g * nodes, g, *link, common["network_alpha_s"],
                                     common["network_bandwidth"])
    return build(devices=devices * nodes, alpha_s=alpha, bandwidth=bandwidth,
                 gpus_per_node=g, **common)


def _number(x: Any, what: str) -> float:
    """``x`` as a float; a string, bool or null is refused (JSON numbers only)."""
    if not is_number(x):
        raise AutoplaceError(f"{what} must be a number, got {x!r}")
    return float(x)


def _devices_json(devices: Any) -> tuple[Device, ...]:
    """Devices from a JSON list of objects; the error names the device and its bad key."""
    valid = {f.name for f in fields(Device)}
    if not isinstance(devices, list) or not devices:
        raise AutoplaceError("\"devices\" must be a non-empty list of objects")
    for i, d in enumerate(devices):
        if not isinstance(d, dict):
            raise AutoplaceError(f"device {i} must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - valid)
        if unknown:
            raise AutoplaceError(f"device {i} has unknown keys {unknown}; valid: "
                                 f"{', '.join(sorted(valid))}")
    return tuple(Device(**d) for d in devices)
