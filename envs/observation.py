"""Observations of :class:`~autoplace.envs.PlacementEnv`: padded arrays and a PyG view.

The observation is a ``spaces.Dict`` of fixed-size arrays, so off-the-shelf RL
libraries (SB3's ``MultiInputPolicy``) work unchanged. Keys, sorted as
``spaces.Dict`` sorts them (``G`` = ``max_groups``, ``E`` = ``max_edges``,
``D`` = devices, ``F`` = ``len(GROUP_FEATURES)``):

==============  =======  =========  =====================================================
key             dtype    shape      meaning
==============  =======  =========  =====================================================
edge_index      int64    [2, E]     group-level edges ``src -> dst`` (forward only),
                                    padded with 0
edge_mask       int8     [E]        1 for a real edge, 0 for padding
focus           int64    [G]        incremental mode only: one-hot of the group revisited
node_features   float32  [G, F]     per-group features below, padded rows are 0
node_mask       int8     [G]        1 for a real group, 0 for padding
placement       int64    [G]        current device of each group (0 for padding)
==============  =======  =========  =====================================================

Node features (:data:`GROUP_FEATURES`) are device independent: they do not change
as groups move, only ``placement`` (and ``focus``) do. For group ``g``:

* ``frac_kind_*`` (12): share of the group's ops in each op-kind bucket of
  :data:`autoplace.graph.PYG_FEATURES` (io, matmul, conv, rnn, embedding, norm,
  attention, activation, elementwise, pool, shape, other);
* ``log_mflops``, ``log_out_mib``, ``log_param_mib``, ``log_act_mib``: log1p of the
  group's summed forward MFLOPs, output MiB, parameter MiB, kept-activation MiB;
* ``log_fwd_us``, ``log_bwd_us``: log1p of summed forward / backward µs on the
  cluster's first device kind;
* ``log_num_ops``: log1p of the number of ops;
* ``topo_position``: ``g / (G_real - 1)`` (groups are numbered in topological order);
* ``compute_share``, ``param_share``, ``act_share``: the group's fraction of the
  whole graph's fwd+bwd time, parameter bytes and kept-activation bytes;
* ``log_in_mib``, ``log_out_edge_mib``: log1p MiB flowing into / out of the group
  from / to other groups;
* ``log_in_degree``, ``log_out_degree``: log1p of group-graph degrees.

:func:`obs_to_pyg` turns one observation into a ``torch_geometric.data.Data`` with
``x`` = the real groups' features, ``edge_index`` holding each edge in both
directions (``edge_type`` 0 = forward, 1 = reverse: messages flow source -> target,
so a group hears from its producers and its consumers), ``placement`` and, in
incremental mode, ``focus`` (float). :func:`obs_batch_to_pyg` builds a ``Batch``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from autoplace.graph import OpGraph
from autoplace.grouping import group_costs, group_graph

__all__ = [
    "GROUP_FEATURES", "group_features", "group_edges", "observation_space", "obs_to_pyg",
    "obs_batch_to_pyg",
]

_KIND_COLUMNS = 12  # the one-hot op-kind buckets at the front of OpGraph.node_features

GROUP_FEATURES: tuple[str, ...] = (
    "frac_kind_io", "frac_kind_matmul", "frac_kind_conv", "frac_kind_rnn",
    "frac_kind_embedding", "frac_kind_norm", "frac_kind_attention", "frac_kind_activation",
    "frac_kind_elementwise", "frac_kind_pool", "frac_kind_shape", "frac_kind_other",
    "log_mflops", "log_out_mib", "log_param_mib", "log_act_mib", "log_fwd_us", "log_bwd_us",
    "log_num_ops", "topo_position", "compute_share", "param_share", "act_share",
    "log_in_mib", "log_out_edge_mib", "log_in_degree", "log_out_degree",
)

MiB = 2**20


def group_edges(graph: OpGraph, groups: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Group-level edges ``[E, 2]`` (int64, sorted) and their bytes ``[E]`` (float64)."""
    gg = group_graph(graph, groups)
    pairs = sorted(gg.edges)
    edges = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    nbytes = np.array([gg.edges[u, v]["bytes"] for u, v in pairs], dtype=np.float64)
    return edges, nbytes


def group_features(
    graph: OpGraph, groups: dict[str, int], device_kind: str | None
) -> np.ndarray:
    """Per-group feature matrix ``[G, len(GROUP_FEATURES)]`` (float32); see the module doc."""
    num_groups = max(groups.values()) + 1
    gid = np.array([groups[name] for name in graph.order], dtype=np.int64)
    sums = group_costs(graph, groups, device_kind)
    num_ops = sums["num_ops"]

    kinds = np.zeros((num_groups, _KIND_COLUMNS))
    np.add.at(kinds, gid, graph.node_features(device_kind)[:, :_KIND_COLUMNS])
    kinds /= np.maximum(num_ops, 1)[:, None]

    edges, nbytes = group_edges(graph, groups)
    in_mib = np.bincount(edges[:, 1], weights=nbytes, minlength=num_groups) / MiB
    out_mib = np.bincount(edges[:, 0], weights=nbytes, minlength=num_groups) / MiB
    in_deg = np.bincount(edges[:, 1], minlength=num_groups)
    out_deg = np.bincount(edges[:, 0], minlength=num_groups)

    compute = sums["fwd_time_s"] + sums["bwd_time_s"]
    cols = [
        np.log1p(sums["flops"] / 1e6),
        np.log1p(sums["output_bytes"] / MiB),
        np.log1p(sums["param_bytes"] / MiB),
        np.log1p(sums["activation_bytes"] / MiB),
        np.log1p(sums["fwd_time_s"] * 1e6),
        np.log1p(sums["bwd_time_s"] * 1e6),
        np.log1p(num_ops),
        np.arange(num_groups) / max(num_groups - 1, 1),
        _share(compute),
        _share(sums["param_bytes"]),
        _share(sums["activation_bytes"]),
        np.log1p(in_mib),
        np.log1p(out_mib),
        np.log1p(in_deg),
        np.log1p(out_deg),
    ]
    feats = np.concatenate([kinds, np.stack(cols, axis=1)], axis=1).astype(np.float32)
    assert feats.shape[1] == len(GROUP_FEATURES)
    return feats


def _share(x: np.ndarray) -> np.ndarray:
    total = float(x.sum())
    return x / total if total > 0 else np.zeros_like(x)


def observation_space(
    max_groups: int, max_edges: int, num_devices: int, *, incremental: bool
) -> spaces.Dict:
    """The ``Dict`` space of the observation (see the module docstring)."""
    g, f = max_groups, len(GROUP_FEATURES)
    parts: dict[str, spaces.Space[Any]] = {
        "edge_index": spaces.Box(0, max_groups - 1, shape=(2, max_edges), dtype=np.int64),
        "edge_mask": spaces.MultiBinary(max_edges),
        # features are log1p of sizes and times, shares and positions: all >= 0
        "node_features": spaces.Box(0.0, np.finfo(np.float32).max, shape=(g, f),
                                    dtype=np.float32),
        "node_mask": spaces.MultiBinary(g),
        "placement": spaces.MultiDiscrete(np.full(g, num_devices, dtype=np.int64)),
    }
    if incremental:
        parts["focus"] = spaces.Box(0, 1, shape=(g,), dtype=np.int64)
    return spaces.Dict(parts)


# ------------------------------------------------------------------ PyG view
def obs_to_pyg(obs: Mapping[str, np.ndarray]):
    """One observation as a ``torch_geometric.data.Data`` over its real groups.

    Attributes: ``x`` ``[N, F]`` float32, ``edge_index`` ``[2, 2E]`` (each group edge
    forward then reversed), ``edge_type`` ``[2E]`` (0 forward, 1 reverse),
    ``placement`` ``[N]`` int64, ``focus`` ``[N]`` float32 (incremental mode only),
    ``num_nodes`` = N.
    """
    import torch
    from torch_geometric.data import Data

    n = int(np.asarray(obs["node_mask"]).sum())
    x = torch.as_tensor(np.asarray(obs["node_features"])[:n], dtype=torch.float32)
    emask = np.asarray(obs["edge_mask"]).astype(bool)
    fwd = torch.as_tensor(np.asarray(obs["edge_index"])[:, emask], dtype=torch.long)
    edge_index = torch.cat([fwd, fwd.flip(0)], dim=1)
    e = fwd.shape[1]
    edge_type = torch.cat([torch.zeros(e, dtype=torch.long), torch.ones(e, dtype=torch.long)])
    data = Data(x=x, edge_index=edge_index, edge_type=edge_type, num_nodes=n,
                placement=torch.as_tensor(np.asarray(obs["placement"])[:n], dtype=torch.long))
    if "focus" in obs:
        data.focus = torch.as_tensor(np.asarray(obs["focus"])[:n], dtype=torch.float32)
    return data


def obs_batch_to_pyg(obs: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]]):
    """A ``torch_geometric.data.Batch`` from a list of observations or a batched one.

    A batched observation is what a vector env returns: every array with a leading
    environment dimension.
    """
    from torch_geometric.data import Batch

    if isinstance(obs, Mapping):
        num = len(np.asarray(obs["node_mask"]))
        items = [{k: np.asarray(v)[i] for k, v in obs.items()} for i in range(num)]
    else:
        items = list(obs)
    return Batch.from_data_list([obs_to_pyg(o) for o in items])
