"""OpGraph: the planner's intermediate representation of one training step.

One node per captured op (an ``nn.Linear``, ``nn.LSTM`` or ``nn.Conv2d`` is one
node; functional ops such as ``add`` or ``matmul`` are nodes too; model inputs
are nodes of kind ``"input"`` and the model output a node of kind ``"output"``).
Nodes are kept in program order, which is a topological order.

Per node (:class:`OpNode`): op kind, output shapes / dtypes / bytes, parameter
bytes and names, activation bytes kept for backward, forward FLOPs, and forward
and backward time per device kind (filled by :func:`autoplace.costs.estimate_costs`
or :func:`autoplace.costs.profile.profile`), and, where profiled, the part of each that
does not shrink with the batch (``fwd_fixed_s`` / ``bwd_fixed_s``). Per edge: the
bytes of the tensor that flows.

The graph is a :class:`networkx.DiGraph` underneath (``graph.nx``); the node
attribute ``"op"`` holds the :class:`OpNode`, the edge attribute ``"bytes"`` the
tensor size. ``graph.module`` optionally holds the ``torch.fx.GraphModule`` the
graph was captured from (node names equal op names); it is not serialized.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np

from autoplace.errors import AutoplaceError
from autoplace.files import write_json_atomic

__all__ = ["OpNode", "OpGraph", "random_dag", "PYG_FEATURES"]

GRAPH_FORMAT = "autoplace.graph/1"

#: a profiled block's numbers a graph file keeps (``autoplace.executor.profile_block``):
#: the compiled fused ops' factor, checkpointing's host seconds per op and per call, the device share
#: left under CUDA graphs, and the part of ``profile_info[kind]`` each belongs to
BLOCK_PROFILE_KEYS = {"fused_time": "compiled", "full_host_s": "recompute",
                      "selective_host_s": "recompute", "compiled_full_host_s": "recompute",
                      "full_call_host_s": "recompute", "selective_call_host_s": "recompute",
                      "compiled_full_call_host_s": "recompute",
                      "device_share": "graphs", "blocks": "graphs"}


@dataclass(kw_only=True)
class OpNode:
    """One op of the captured graph.

    Attributes:
        name: unique op name (the fx node name).
        kind: op kind: module class name (``"Linear"``), function or method name
            (``"add"``, ``"matmul"``), ``"input"``, ``"output"`` or ``"param"``.
        target: module path for a module call, qualified function name otherwise.
        module_path: dotted path of the innermost ``nn.Module`` the op belongs to
            (``""`` for the root); used by hierarchical grouping.
        output_shapes: shape of every tensor the op outputs.
        output_dtypes: dtype name of every tensor output (``"float32"``).
        output_bytes: total bytes of the outputs.
        param_bytes: bytes of the parameters the op owns.
        param_names: qualified names of those parameters.
        activation_bytes: bytes autograd keeps for the backward pass, each saved tensor
            counted at the first op that saves it.
        shared_saves: ``(op name, bytes)`` of the tensors this op saves too that an earlier
            op's ``activation_bytes`` counts (placed on another device, this op holds its
            own copy).
        flops: forward floating-point operations (a multiply-add counts 2).
        fwd_time_s: forward time in seconds per device kind.
        bwd_time_s: backward time in seconds per device kind.
        fwd_fixed_s: the part of ``fwd_time_s`` that does not shrink with the batch,
            per device kind, where measured (:func:`autoplace.costs.profile.profile` fits it
            from a second run at a smaller batch); absent kinds are unknown and the
            simulator falls back to the device's launch overhead.
        bwd_fixed_s: the same for ``bwd_time_s``.
        fwd_host_s: host seconds to issue the op's forward (Python, dispatcher, autocast
            and kernel launches, not the device's work), per device kind, where profiled
            on a GPU; absent kinds fall back to the device's ``host_dispatch_s``.
        bwd_host_s: the same for the op's backward, issued by the autograd engine.
        fwd_host_fixed_s: the part of ``fwd_host_s`` that does not shrink with the batch
            (fitted like ``fwd_fixed_s``: a cuDNN LSTM launches fewer kernels on a small
            batch); absent: all of it.
        bwd_host_fixed_s: the same for ``bwd_host_s``.
        workspace_bytes: memory the op holds only while it runs, beyond its outputs;
            on the ``output`` op, the peak of the loss's forward and backward
            (:func:`autoplace.capture.loss_workspace_bytes`), which the simulator
            counts as a transient on the device that computes the loss.
    """

    name: str
    kind: str
    target: str = ""
    module_path: str = ""
    output_shapes: tuple[tuple[int, ...], ...] = ()
    output_dtypes: tuple[str, ...] = ()
    output_bytes: int = 0
    param_bytes: int = 0
    param_names: tuple[str, ...] = ()
    activation_bytes: int = 0
    shared_saves: tuple[tuple[str, int], ...] = ()
    flops: float = 0.0
    fwd_time_s: dict[str, float] = field(default_factory=dict)
    bwd_time_s: dict[str, float] = field(default_factory=dict)
    fwd_fixed_s: dict[str, float] = field(default_factory=dict)
    bwd_fixed_s: dict[str, float] = field(default_factory=dict)
    fwd_host_s: dict[str, float] = field(default_factory=dict)
    bwd_host_s: dict[str, float] = field(default_factory=dict)
    fwd_host_fixed_s: dict[str, float] = field(default_factory=dict)
    bwd_host_fixed_s: dict[str, float] = field(default_factory=dict)
    workspace_bytes: int = 0

    @property
    def transient_bytes(self) -> int:
        """Memory the op needs while it runs: its outputs, or its workspace if larger."""
        return max(self.output_bytes, self.workspace_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["output_shapes"] = [list(s) for s in self.output_shapes]
        d["output_dtypes"] = list(self.output_dtypes)
        d["param_names"] = list(self.param_names)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpNode:
        d = dict(d)
        d["output_shapes"] = tuple(tuple(int(x) for x in s) for s in d.get("output_shapes", ()))
        d["output_dtypes"] = tuple(d.get("output_dtypes", ()))
        d["param_names"] = tuple(d.get("param_names", ()))
        d["shared_saves"] = tuple((str(o), int(b)) for o, b in d.get("shared_saves", ()))
        return cls(**d)


class OpGraph:
    """A captured operator graph with costs: nodes in topological (program) order.

    Args:
        name: a label, usually the workload name.
        nodes: ops in a topological order.
        edges: ``(src, dst, bytes)`` triples.
        module: optional ``torch.fx.GraphModule`` whose node names are the op names.
    """

    def __init__(
        self,
        name: str,
        nodes: list[OpNode],
        edges: list[tuple[str, str, int]],
        module: Any = None,
    ) -> None:
        self.name = name
        self.nx = nx.DiGraph()
        for op in nodes:
            if op.name in self.nx:
                raise AutoplaceError(f"duplicate op name {op.name!r} in graph {name!r}")
            self.nx.add_node(op.name, op=op)
        for src, dst, nbytes in edges:
            if src not in self.nx or dst not in self.nx:
                raise AutoplaceError(f"edge {src!r} -> {dst!r} names an op not in the graph")
            if self.nx.has_edge(src, dst):
                self.nx.edges[src, dst]["bytes"] += int(nbytes)
            else:
                self.nx.add_edge(src, dst, bytes=int(nbytes))
        self.order: list[str] = [op.name for op in nodes]
        pos = {n: i for i, n in enumerate(self.order)}
        for src, dst in self.nx.edges:
            if pos[src] >= pos[dst]:
                raise AutoplaceError(
                    f"nodes are not in topological order: {src!r} feeds {dst!r} but comes after it"
                )
        self.index: dict[str, int] = pos
        self.module = module
        #: the dtype autocast trains in (set by capture): FSDP2 gathers parameters in it
        self.autocast_dtype: str | None = None
        #: which tracer made it (set by capture): ``"fx"`` or ``"export"`` (None: unknown)
        self.capture_method: str | None = None
        self._fingerprint: str | None = None

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[OpNode]:
        for n in self.order:
            yield self.nx.nodes[n]["op"]

    def __getitem__(self, name: str) -> OpNode:
        try:
            return self.nx.nodes[name]["op"]
        except KeyError:
            raise AutoplaceError(f"no op named {name!r} in graph {self.name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.nx

    def __repr__(self) -> str:
        return (
            f"OpGraph({self.name!r}, ops={len(self)}, edges={self.nx.number_of_edges()}, "
            f"params={self.param_bytes / 2**20:.1f} MiB, flops={self.flops:.3g})"
        )

    @property
    def ops(self) -> list[OpNode]:
        """Ops in topological order."""
        return list(self)

    def preds(self, name: str) -> list[str]:
        """Producers of ``name``'s inputs, in topological order."""
        return sorted(self.nx.predecessors(name), key=self.index.__getitem__)

    def succs(self, name: str) -> list[str]:
        """Consumers of ``name``'s outputs, in topological order."""
        return sorted(self.nx.successors(name), key=self.index.__getitem__)

    def edge_bytes(self, src: str, dst: str) -> int:
        return int(self.nx.edges[src, dst]["bytes"])

    @property
    def edges(self) -> list[tuple[str, str, int]]:
        """``(src, dst, bytes)`` in topological order of ``src``."""
        out = [(u, v, int(d["bytes"])) for u, v, d in self.nx.edges(data=True)]
        out.sort(key=lambda e: (self.index[e[0]], self.index[e[1]]))
        return out

    @property
    def param_bytes(self) -> int:
        return sum(op.param_bytes for op in self)

    @property
    def flops(self) -> float:
        return float(sum(op.flops for op in self))

    @property
    def activation_bytes(self) -> int:
        return sum(op.activation_bytes for op in self)

    def has_costs(self, device_kind: str) -> bool:
        """True when every op has forward and backward times for ``device_kind``."""
        return all(device_kind in op.fwd_time_s and device_kind in op.bwd_time_s for op in self)

    def fwd_times(self, device_kind: str) -> np.ndarray:
        """Forward seconds per op (topological order) on ``device_kind``."""
        return np.array([op.fwd_time_s.get(device_kind, 0.0) for op in self], dtype=np.float64)

    def bwd_times(self, device_kind: str) -> np.ndarray:
        """Backward seconds per op (topological order) on ``device_kind``."""
        return np.array([op.bwd_time_s.get(device_kind, 0.0) for op in self], dtype=np.float64)

    def fwd_fixed_times(self, device_kind: str) -> np.ndarray:
        """Batch-independent part of each op's forward seconds on ``device_kind`` (NaN where
        unknown)."""
        return np.array([op.fwd_fixed_s.get(device_kind, np.nan) for op in self],
                        dtype=np.float64)

    def bwd_fixed_times(self, device_kind: str) -> np.ndarray:
        """Batch-independent part of each op's backward seconds on ``device_kind`` (NaN
        where unknown)."""
        return np.array([op.bwd_fixed_s.get(device_kind, np.nan) for op in self],
                        dtype=np.float64)

    def fwd_host_times(self, device_kind: str) -> np.ndarray:
        """Host seconds to issue each op's forward on ``device_kind`` (NaN where unknown)."""
        return np.array([op.fwd_host_s.get(device_kind, np.nan) for op in self],
                        dtype=np.float64)

    def bwd_host_times(self, device_kind: str) -> np.ndarray:
        """Host seconds to issue each op's backward on ``device_kind`` (NaN where unknown)."""
        return np.array([op.bwd_host_s.get(device_kind, np.nan) for op in self],
                        dtype=np.float64)

    def host_fixed_times(self, device_kind: str, backward: bool = False) -> np.ndarray:
        """Batch-independent part of each op's host seconds (forward, or backward) on
        ``device_kind`` (NaN where unknown: then all of it)."""
        return np.array([(op.bwd_host_fixed_s if backward else op.fwd_host_fixed_s).get(
            device_kind, np.nan) for op in self], dtype=np.float64)

    # ------------------------------------------------------------ fingerprint
    @property
    def fingerprint(self) -> str:
        """Stable hash of structure, op kinds, shapes, dtypes and parameter sizes (not costs)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for op in self:
                h.update(
                    json.dumps(
                        [op.name, op.kind, op.target, [list(s) for s in op.output_shapes],
                         list(op.output_dtypes), op.param_bytes],
                        separators=(",", ":"),
                    ).encode()
                )
            for u, v, _ in self.edges:
                h.update(f"{u}->{v};".encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    # -------------------------------------------------------------------- json
    def to_json(self) -> dict[str, Any]:
        out = {
            "format": GRAPH_FORMAT,
            "name": self.name,
            "fingerprint": self.fingerprint,
            "nodes": [op.to_dict() for op in self],
            "edges": [list(e) for e in self.edges],
        }
        if self.autocast_dtype:
            out["autocast_dtype"] = self.autocast_dtype
        if self.capture_method:
            out["capture_method"] = self.capture_method
        block = {kind: {k: info[part][k] for k, part in BLOCK_PROFILE_KEYS.items()
                        if isinstance(info.get(part), dict) and k in info[part]}
                 for kind, info in (getattr(self, "profile_info", None) or {}).items()}
        if any(block.values()):  # a profiled block (autoplace.executor.profile_block)
            out["block_profile"] = {k: v for k, v in block.items() if v}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpGraph:
        if not isinstance(data, dict) or data.get("format") != GRAPH_FORMAT:
            raise AutoplaceError(f"not an OpGraph file: expected \"format\": \"{GRAPH_FORMAT}\"")
        if not isinstance(data.get("nodes"), list) or not all(
                isinstance(d, dict) for d in data["nodes"]):
            raise AutoplaceError("OpGraph file is malformed: \"nodes\" must be a list of objects")
        if not isinstance(data.get("edges"), list) or not all(
                isinstance(e, list) and len(e) == 3 for e in data["edges"]):
            raise AutoplaceError("OpGraph file is malformed: \"edges\" must be a list of "
                                 "[source, target, bytes]")
        try:
            nodes = [OpNode.from_dict(d) for d in data["nodes"]]
            edges = [(str(u), str(v), int(b)) for u, v, b in data["edges"]]
            graph = cls(str(data.get("name", "")), nodes, edges)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise AutoplaceError(f"OpGraph file is malformed: {e}") from None
        if data.get("autocast_dtype") in ("bfloat16", "float16"):
            graph.autocast_dtype = data["autocast_dtype"]
        if data.get("capture_method") in ("fx", "export"):
            graph.capture_method = data["capture_method"]
        block = data.get("block_profile")
        if block is not None:
            if not isinstance(block, dict) or not all(
                    isinstance(k, str) and isinstance(v, dict) and all(
                        f in BLOCK_PROFILE_KEYS and isinstance(x, (int, float))
                        and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                        and (f != "fused_time" or x > 0) for f, x in v.items())
                    for k, v in block.items()):
                raise AutoplaceError(
                    "OpGraph file is malformed: \"block_profile\" must map device kinds to "
                    f"objects of non-negative numbers named {', '.join(BLOCK_PROFILE_KEYS)}")
            info: dict[str, dict[str, dict[str, float]]] = {}
            for kind, v in block.items():
                for f, x in v.items():
                    info.setdefault(kind, {}).setdefault(BLOCK_PROFILE_KEYS[f], {})[f] = \
                        float(x)
            graph.profile_info = info
        return graph

    def save(self, path: str | Path) -> None:
        """Write the graph as JSON atomically."""
        write_json_atomic(path, self.to_json(), indent=None)

    @classmethod
    def load(cls, path: str | Path) -> OpGraph:
        try:
            data = json.loads(Path(path).read_bytes())
        except (OSError, ValueError, RecursionError) as e:
            raise AutoplaceError(f"cannot read graph file {path}: {e}") from None
        return cls.from_json(data)

    # ---------------------------------------------------------------- pytorch
    def to_pyg(self, device_kind: str | None = None):
        """The graph as a ``torch_geometric.data.Data``.

        Node features (``x``, float32, one row per op in topological order) are the
        columns named in :data:`PYG_FEATURES`. ``edge_index`` holds forward edges;
        ``edge_attr`` is log1p(MiB) of each edge's tensor. Times are those of
        ``device_kind`` (the first kind with costs when ``None``; zeros if none).
        """
        import torch
        from torch_geometric.data import Data

        x = torch.from_numpy(self.node_features(device_kind))
        src = [self.index[u] for u, _, _ in self.edges]
        dst = [self.index[v] for _, v, _ in self.edges]
        edge_index = torch.tensor([src, dst], dtype=torch.long).reshape(2, -1)
        edge_attr = torch.tensor(
            [[np.log1p(b / 2**20)] for _, _, b in self.edges], dtype=torch.float32
        ).reshape(-1, 1)
        return Data(x=x, edge_index=edge_index, edge_attr=edge_attr, num_nodes=len(self))

    def node_features(self, device_kind: str | None = None) -> np.ndarray:
        """Per-op feature matrix ``[num_ops, len(PYG_FEATURES)]`` (float32)."""
        if device_kind is None:
            first = next(iter(self), None)
            device_kind = next(iter(first.fwd_time_s), None) if first is not None else None
        n = len(self)
        feats = np.zeros((n, len(PYG_FEATURES)), dtype=np.float32)
        for i, op in enumerate(self):
            kind_bucket = _kind_bucket(op.kind)
            feats[i, kind_bucket] = 1.0
            base = len(_KIND_BUCKETS)
            feats[i, base + 0] = np.log1p(op.flops / 1e6)
            feats[i, base + 1] = np.log1p(op.output_bytes / 2**20)
            feats[i, base + 2] = np.log1p(op.param_bytes / 2**20)
            feats[i, base + 3] = np.log1p(op.activation_bytes / 2**20)
            fwd = op.fwd_time_s.get(device_kind, 0.0) if device_kind else 0.0
            bwd = op.bwd_time_s.get(device_kind, 0.0) if device_kind else 0.0
            feats[i, base + 4] = np.log1p(fwd * 1e6)
            feats[i, base + 5] = np.log1p(bwd * 1e6)
            feats[i, base + 6] = i / max(n - 1, 1)
            feats[i, base + 7] = np.log1p(self.nx.in_degree(op.name))
            feats[i, base + 8] = np.log1p(self.nx.out_degree(op.name))
        return feats


_KIND_BUCKETS = (
    ("input", "output", "param"),
    ("Linear", "linear", "addmm", "mm", "matmul", "bmm", "baddbmm", "einsum"),
    ("Conv1d", "Conv2d", "Conv3d", "conv2d", "convolution"),
    ("LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "lstm"),
    ("Embedding", "embedding"),
    ("LayerNorm", "BatchNorm1d", "BatchNorm2d", "GroupNorm", "RMSNorm", "layer_norm", "batch_norm"),
    ("softmax", "Softmax", "log_softmax", "scaled_dot_product_attention", "MultiheadAttention"),
    ("ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "relu", "gelu", "silu", "tanh", "sigmoid"),
    ("add", "mul", "sub", "div", "iadd", "neg", "pow"),
    ("MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"),
    ("cat", "stack", "split", "chunk", "getitem", "view", "reshape", "permute", "transpose",
     "flatten", "contiguous", "size", "getattr", "expand", "unsqueeze", "squeeze"),
)
_BUCKET_OF = {k: i for i, ks in enumerate(_KIND_BUCKETS) for k in ks}


def _kind_bucket(kind: str) -> int:
    """Column of ``kind``'s one-hot bucket; in-place variants (``add_``) share their op's."""
    return _BUCKET_OF.get(kind, _BUCKET_OF.get(kind.rstrip("_"), len(_KIND_BUCKETS)))


#: Column names of :meth:`OpGraph.node_features` / ``to_pyg().x``: a one-hot op-kind
#: bucket (io, matmul, conv, rnn, embedding, norm, attention, activation, elementwise,
#: pool, shape/data movement, other), then log1p of forward MFLOPs, output MiB,
#: parameter MiB, kept-activation MiB, forward µs, backward µs, the op's relative
#: position in topological order, log1p in-degree and log1p out-degree.
PYG_FEATURES: tuple[str, ...] = (
    "kind_io", "kind_matmul", "kind_conv", "kind_rnn", "kind_embedding", "kind_norm",
    "kind_attention", "kind_activation", "kind_elementwise", "kind_pool", "kind_shape",
    "kind_other",
    "log_mflops", "log_out_mib", "log_param_mib", "log_act_mib", "log_fwd_us", "log_bwd_us",
    "topo_position", "log_in_degree", "log_out_degree",
)
assert len(PYG_FEATURES) == len(_KIND_BUCKETS) + 1 + 9


def random_dag(
    num_ops: int,
    *,
    seed: int = 0,
    max_fanin: int = 3,
    locality: int = 8,
    device_kind: str = "cpu",
) -> OpGraph:
    """A random layered DAG with plausible costs, for tests and for training GNN policies.

    Each op reads 1..``max_fanin`` of the ``locality`` ops before it, so the graph
    has long chains with skip connections like real models. Costs are filled for
    ``device_kind`` (fwd 10 µs .. 2 ms, bwd about twice).
    """
    if num_ops < 2:
        raise AutoplaceError(f"random_dag needs num_ops >= 2, got {num_ops}")
    rng = random.Random(seed)
    nodes: list[OpNode] = []
    edges: list[tuple[str, str, int]] = []
    for i in range(num_ops):
        if i == 0:
            kind = "input"
        elif i == num_ops - 1:
            kind = "output"
        else:
            kind = rng.choice(["Linear", "Linear", "Conv2d", "relu", "add", "LayerNorm", "matmul"])
        has_params = kind in ("Linear", "Conv2d", "LayerNorm")
        out_elems = rng.choice([2**k for k in range(12, 20)])
        fwd = 0.0 if kind in ("input", "output") else rng.uniform(1e-5, 2e-3)
        pbytes = rng.choice([2**k for k in range(14, 24)]) if has_params else 0
        nodes.append(
            OpNode(
                name=f"op{i}",
                kind=kind,
                target=kind,
                module_path=f"block{i // 8}",
                output_shapes=((out_elems,),),
                output_dtypes=("float32",),
                output_bytes=4 * out_elems,
                param_bytes=pbytes,
                param_names=(f"op{i}.weight",) if has_params else (),
                activation_bytes=0 if kind in ("input", "output") else 4 * out_elems,
                flops=fwd * 1e12,
                fwd_time_s={device_kind: fwd},
                bwd_time_s={device_kind: fwd * (2.0 if has_params else 1.0)},
            )
        )
        if i > 0:
            lo = max(0, i - locality)
            k = rng.randint(1, min(max_fanin, i - lo))
            srcs = {i - 1} | set(rng.sample(range(lo, i), k)) if i > 1 else {0}
            for s in sorted(srcs):
                if s == num_ops - 1:
                    continue
                edges.append((f"op{s}", f"op{i}", nodes[s].output_bytes))
    # every op but the output must feed something, so the graph has one sink
    fed = {u for u, _, _ in edges}
    for i in range(num_ops - 1):
        if f"op{i}" not in fed:
            edges.append((f"op{i}", f"op{num_ops - 1}", nodes[i].output_bytes))
    return OpGraph(f"random-{num_ops}-{seed}", nodes, edges)
