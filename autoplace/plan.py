"""Plan: the one exchange format between planners, the simulator and the executor.

A plan says, for one replica of the model:

* ``groups``: op name -> group id (groups are numbered ``0 .. G-1``);
* ``placement``: group id -> *local* device index in ``0 .. devices_per_replica-1``;
* ``parallel``: the hybrid split (:class:`ParallelConfig`);
* ``recompute``: group ids whose activations are recomputed in backward
  (``torch.utils.checkpoint``); ``selective``: group ids recomputed selectively (the
  outputs of matmuls, convolutions and attention saved, the cheap rest recomputed);
* ``parallel.compile``: every run of one group's ops compiled with ``torch.compile``
  (with groups that are a model's blocks, a compile per block as torchtitan does);
* ``priority``: optional, one integer per group: among the ops ready on one device, those
  of the group with the lower priority are issued first (the execution order a policy or
  planner chooses; empty = the graph's topological order).

Device numbering. With ``parallel.data = d``, replica ``r`` uses cluster devices
``r * k + local`` for ``local`` in ``0 .. k-1`` where ``k = max(placement) + 1``; with
``parallel.tensor = t > 1`` each local device is ``t`` cluster devices (tensor-parallel
ranks ``(r * k + local) * t + j``, ``j`` in ``0 .. t-1``: a tensor group is contiguous, on
one node where it fits).
With ``parallel.pipeline = p > 1`` the placement must use exactly devices
``0 .. p-1``, each holding one contiguous run of ops in topological order, in
order (stage ``s`` on local device ``s``); every stage runs in its own process
under ``torch.distributed.pipelining``. With ``pipeline == 1`` and several local
devices, the replica runs in one process (any DAG placement; microbatches flow
through it); with ``parallel.graphs`` (one process, ``data == 1``) each run of ops on one
device replays as a CUDA graph on GPUs. ``parallel.shard_units`` (sharded plans only)
picks FSDP2's units: ``blocks`` (the default) or ``modules``. ``parallel.offload``
(``shard="fsdp"`` only) keeps the parameters, gradients and optimizer state on the host
(FSDP2's ``CPUOffloadPolicy``, the optimizer stepping on the CPU); with it ``data == 1`` is
a valid sharded plan: FSDP2 on one rank, the model streamed through one GPU unit by unit.

JSON (``"format": "autoplace.plan/1"``), never pickle::

    {"format": "autoplace.plan/1",
     "groups": {"op": 0, ...}, "placement": [0, 1, ...],
     "parallel": {"data": 1, "pipeline": 1, "microbatches": 1,
                  "schedule": "gpipe", "shard": "none"},   # + "graphs": true when on,
                                                           # + "shard_units": "modules"
                                                           # + "offload": true when on
                                                           # + "sequence_parallel": true
     "recompute": [3, 4], "selective": [5],                 # "selective" when not empty
     "priority": [0, 2, 1],                                 # when not empty
     "model": {"spec": "gpt-tiny", "options": {}, "fingerprint": "...", "num_ops": 123},
     "cluster": {...}, "predicted": {...} | null, "measured": {...} | null,
     "planner": {"name": "expert", ...}}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplace.errors import PlanError
from autoplace.files import write_atomic
from autoplace.parallel_config import SCHEDULES, SHARD_MODES, SHARD_UNITS, ParallelConfig
from autoplace.plan_validation import validate_plan

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.graph import OpGraph

__all__ = ["ParallelConfig", "Plan", "PLAN_FORMAT", "SCHEDULES", "SHARD_MODES", "SHARD_UNITS"]

PLAN_FORMAT = "autoplace.plan/1"
_TOP_KEYS = {"format", "groups", "placement", "parallel", "recompute", "selective", "priority",
             "model",
             "cluster",
             "predicted", "measured", "planner"}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Op groups, a device per group, and the hybrid split. See the module docstring."""

    groups: dict[str, int]
    placement: tuple[int, ...]
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: frozenset[int] = frozenset()
    selective: frozenset[int] = frozenset()
    priority: tuple[int, ...] = ()
    model: dict[str, Any] = field(default_factory=dict)
    cluster: dict[str, Any] = field(default_factory=dict)
    predicted: dict[str, Any] | None = None
    measured: dict[str, Any] | None = None
    planner: dict[str, Any] = field(default_factory=dict)

    # ---------------------------------------------------------------- builders
    @classmethod
    def from_assignment(
        cls,
        graph: OpGraph,
        device_of_op: dict[str, int],
        *,
        parallel: ParallelConfig | None = None,
        planner: str = "manual",
        cluster: Cluster | None = None,
        **planner_info: Any,
    ) -> Plan:
        """A plan with one group per distinct device (ops in topological order)."""
        missing = [op.name for op in graph if op.name not in device_of_op]
        if missing:
            raise PlanError(f"assignment misses {len(missing)} ops, e.g. {missing[:3]}")
        devices = sorted(set(device_of_op.values()))
        gid = {d: i for i, d in enumerate(devices)}
        return cls(
            groups={op.name: gid[device_of_op[op.name]] for op in graph},
            placement=tuple(devices),
            parallel=parallel or ParallelConfig(),
            model=model_info(graph),
            cluster=cluster.summary() if cluster is not None else {},
            planner={"name": planner, **planner_info},
        )

    @classmethod
    def from_groups(
        cls,
        graph: OpGraph,
        groups: dict[str, int],
        placement: list[int] | tuple[int, ...],
        *,
        parallel: ParallelConfig | None = None,
        recompute: set[int] | frozenset[int] = frozenset(),
        selective: set[int] | frozenset[int] = frozenset(),
        priority: tuple[int, ...] | list[int] = (),
        planner: str = "manual",
        cluster: Cluster | None = None,
        **planner_info: Any,
    ) -> Plan:
        """A plan from a grouping and a device per group."""
        return cls(
            groups=dict(groups),
            placement=tuple(int(d) for d in placement),
            parallel=parallel or ParallelConfig(),
            recompute=frozenset(recompute),
            selective=frozenset(selective),
            priority=tuple(int(x) for x in priority),
            model=model_info(graph),
            cluster=cluster.summary() if cluster is not None else {},
            planner={"name": planner, **planner_info},
        )

    @classmethod
    def single(cls, graph: OpGraph, device: int = 0, **kw: Any) -> Plan:
        """Everything on one device."""
        return cls.from_assignment(graph, {op.name: device for op in graph}, **kw)

    # ----------------------------------------------------------------- queries
    @property
    def num_groups(self) -> int:
        return len(self.placement)

    @property
    def devices_per_replica(self) -> int:
        return (max(self.placement) + 1) if self.placement else 1

    @property
    def num_devices(self) -> int:
        """Devices the plan needs: replicas x devices per replica x tensor degree."""
        return self.parallel.data * self.devices_per_replica * self.parallel.tensor

    def device_of(self, op: str) -> int:
        """Local device index of ``op``."""
        return self.placement[self.groups[op]]

    def device_map(self) -> dict[str, int]:
        """op name -> local device index."""
        return {op: self.placement[g] for op, g in self.groups.items()}

    def replica_devices(self, replica: int) -> list[int]:
        """Cluster device indices used by ``replica`` (each local device's tensor group)."""
        k, t = self.devices_per_replica, self.parallel.tensor
        return [(replica * k + i) * t + j for i in range(k) for j in range(t)]

    def with_parallel(self, **changes: Any) -> Plan:
        return replace(self, parallel=replace(self.parallel, **changes))

    def with_predicted(self, predicted: dict[str, Any] | None) -> Plan:
        return replace(self, predicted=predicted)

    def with_measured(self, measured: dict[str, Any] | None) -> Plan:
        return replace(self, measured=measured)

    def split(self) -> str:
        """The hybrid split in a few words: ``"2-device placement mb=4"``, ``"dp=2/zero2"``."""
        text = self.parallel.describe()
        k = self.devices_per_replica
        if k > 1 and self.parallel.pipeline == 1:
            place = f"{k}-device placement"
            text = place if text == "single" else f"{place} {text}"
        return text

    def describe(self) -> str:
        used = sorted(set(self.placement))
        return (
            f"{self.planner.get('name', '?')}: {self.num_groups} groups on devices {used}, "
            f"{self.split()}"
        )

    # ---------------------------------------------------------------- validate
    def validate(self, graph: OpGraph, cluster: Cluster | None = None) -> None:
        """Raise :class:`PlanError` naming the first way this plan does not fit."""
        validate_plan(self, graph, cluster)

    # -------------------------------------------------------------------- json
    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "groups": dict(self.groups),
            "placement": list(self.placement),
            "parallel": self.parallel.to_json(),
            "recompute": sorted(self.recompute),
            **({"selective": sorted(self.selective)} if self.selective else {}),
            **({"priority": list(self.priority)} if self.priority else {}),
            "model": self.model,
            "cluster": self.cluster,
            "predicted": self.predicted,
            "measured": self.measured,
            "planner": self.planner,
        }

    @classmethod
    def from_json(cls, data: Any) -> Plan:
        """A plan from parsed JSON; raises :class:`PlanError` on anything malformed."""
        if not isinstance(data, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(
                f"not an autoplace plan: \"format\" is {data.get('format')!r}, "
                f"expected {PLAN_FORMAT!r}"
            )
        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise PlanError(f"unknown keys in plan: {sorted(unknown)}")
        groups = data.get("groups")
        if not isinstance(groups, dict) or not groups:
            raise PlanError("\"groups\" must be a non-empty object of op name -> group id")
        for k, v in groups.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise PlanError(f"group of op {k!r} must be an integer, got {v!r}")
        placement = data.get("placement")
        if not isinstance(placement, list) or not placement:
            raise PlanError("\"placement\" must be a non-empty list of device indices")
        for i, d in enumerate(placement):
            if not isinstance(d, int) or isinstance(d, bool):
                raise PlanError(f"placement of group {i} must be an integer, got {d!r}")
            if d < 0:
                raise PlanError(f"placement of group {i} is {d}: device indices are >= 0")
        recompute, selective = (data.get(key, []) for key in ("recompute", "selective"))
        for key, ids in (("recompute", recompute), ("selective", selective)):
            if not isinstance(ids, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in ids
            ):
                raise PlanError(f"\"{key}\" must be a list of group ids")
        priority = data.get("priority", [])
        if not isinstance(priority, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in priority
        ):
            raise PlanError("\"priority\" must be a list of integers, one per group")
        for key in ("model", "cluster", "planner"):
            if not isinstance(data.get(key, {}), dict):
                raise PlanError(f"\"{key}\" must be an object")
        for key in ("predicted", "measured"):
            if data.get(key) is not None and not isinstance(data[key], dict):
                raise PlanError(f"\"{key}\" must be an object or null")
        model = data.get("model", {})
        if "spec" in model and not isinstance(model["spec"], str):
            raise PlanError(f"model.spec must be a string, got {model['spec']!r}")
        if not isinstance(model.get("options", {}), dict):
            raise PlanError("model.options must be an object of workload options")
        seed = model.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise PlanError(f"model.seed must be an integer, got {seed!r}")
        parallel = ParallelConfig.from_json(data.get("parallel", {}))
        try:
            plan = cls(
                groups={str(k): v for k, v in groups.items()},
                placement=tuple(placement),
                parallel=parallel,
                recompute=frozenset(recompute),
                selective=frozenset(selective),
                priority=tuple(priority),
                model=dict(data.get("model", {})),
                cluster=dict(data.get("cluster", {})),
                predicted=data.get("predicted"),
                measured=data.get("measured"),
                planner=dict(data.get("planner", {})),
            )
        except TypeError as e:
            raise PlanError(f"plan is malformed: {e}") from None
        g = plan.num_groups
        bad = [gid for gid in groups.values() if not 0 <= gid < g]
        if bad:
            raise PlanError(f"group id {bad[0]} is out of range: placement has {g} groups")
        return plan

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON atomically (a crash never leaves half a file)."""
        write_atomic(path, json.dumps(self.to_json(), indent=1, default=_json_default))

    @classmethod
    def loads(cls, text: str | bytes) -> Plan:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None
        return cls.from_json(data)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan file; raises :class:`PlanError` naming the problem."""
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise PlanError(f"cannot read plan file {path}: {e.strerror or e}") from None
        try:
            return cls.loads(raw)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None


def model_info(graph: OpGraph) -> dict[str, Any]:
    """The ``model`` block of a plan for ``graph`` (spec and options from the capture)."""
    info = dict(getattr(graph, "spec", None) or {})
    info.setdefault("spec", graph.name)
    info.setdefault("options", {})
    info["fingerprint"] = graph.fingerprint
    info["num_ops"] = len(graph)
    return info


def strict_json(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None: JSON has no infinity or NaN,
    and reports written with ``allow_nan=False`` stay readable by any JSON parser."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
