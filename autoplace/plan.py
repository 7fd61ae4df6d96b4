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

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.graph import OpGraph

__all__ = ["ParallelConfig", "Plan", "PLAN_FORMAT", "SCHEDULES", "SHARD_MODES", "SHARD_UNITS"]

PLAN_FORMAT = "autoplace.plan/1"
SCHEDULES = ("gpipe", "1f1b")
SHARD_MODES = ("none", "zero2", "fsdp")
#: FSDP2 units of a sharded plan (executor.data.wrap_data_parallel)
SHARD_UNITS = ("blocks", "modules")
_TOP_KEYS = {"format", "groups", "placement", "parallel", "recompute", "selective", "priority",
             "model",
             "cluster",
             "predicted", "measured", "planner"}


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The hybrid split of a plan.

    Attributes:
        data: data-parallel degree (replicas).
        pipeline: pipeline stages run by torch.distributed.pipelining (1 = none).
        microbatches: microbatches per step, per replica.
        schedule: pipeline schedule, ``gpipe`` or ``1f1b``.
        shard: ``none`` (DDP), ``zero2`` (gradients and optimizer state sharded) or
            ``fsdp`` (parameters sharded too); only with ``data > 1``, or ``fsdp``
            with ``offload`` on one device.
        graphs: on GPUs, replay each run of ops on one device of each microbatch as a
            CUDA graph (:func:`autoplace.executor.local.build_local`); only for plans run
            in one process per replica (``pipeline == 1``, ``data == 1``).
        shard_units: FSDP2 units of a sharded plan: ``blocks`` (every child of an
            ``nn.ModuleList`` / ``nn.Sequential``, then the root with the rest) or
            ``modules`` (also every other module holding parameters, embeddings and
            heads, a unit of its own: less memory held, more collectives).
        compile: compile every run of one group's ops (on one device, of one microbatch)
            with ``torch.compile``; not with ``graphs``.
        tensor: tensor-parallel degree: every local device of the placement is a group
            of ``tensor`` GPUs that split the model's Linear pairs Megatron-style
            (column then row), through ``torch.distributed.tensor.parallel``; 1 = none.
        replicate: HSDP: a sharded plan's ``data`` replicas form ``replicate`` groups;
            parameters (``fsdp``) or gradients and optimizer state (``zero2``) are
            sharded within a group and replicated across groups (across nodes, say);
            1 = sharded over all ``data`` replicas.
        offload: FSDP2's ``CPUOffloadPolicy``: the parameter shards, their gradients and
            the optimizer state live on the host, each unit's parameters are copied to
            the GPU before its forward and its backward and its gradients back after, and
            the optimizer steps on the CPU. Only with ``shard="fsdp"``, ``pipeline == 1``,
            ``tensor == 1`` and without ``graphs``; ``data == 1`` is valid with it.
        sequence_parallel: with ``tensor > 1``, the residual stream between the Linear
            pairs (norms, residual adds) runs on ``1 / tensor`` of the sequence on each
            rank of a group (columns all-gather, rows reduce-scatter); not with a pipeline.
    """

    data: int = 1
    pipeline: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"
    shard: str = "none"
    graphs: bool = False
    shard_units: str = "blocks"
    compile: bool = False
    tensor: int = 1
    replicate: int = 1
    offload: bool = False
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("data", "pipeline", "microbatches", "tensor", "replicate"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"parallel.{name} must be an integer >= 1, got {v!r}")
        if self.schedule not in SCHEDULES:
            raise PlanError(
                f"parallel.schedule {self.schedule!r} is not valid; valid: {', '.join(SCHEDULES)}"
            )
        if self.shard not in SHARD_MODES:
            raise PlanError(
                f"parallel.shard {self.shard!r} is not valid; valid: {', '.join(SHARD_MODES)}"
            )
        if not isinstance(self.graphs, bool):
            raise PlanError(f"parallel.graphs must be true or false, got {self.graphs!r}")
        if not isinstance(self.compile, bool):
            raise PlanError(f"parallel.compile must be true or false, got {self.compile!r}")
        if self.compile and self.graphs:
            raise PlanError("parallel.compile and parallel.graphs exclude each other: a "
                            "piece is either compiled or replayed as a CUDA graph")
        if self.shard_units not in SHARD_UNITS:
            raise PlanError(f"parallel.shard_units {self.shard_units!r} is not valid; valid: "
                            f"{', '.join(SHARD_UNITS)}")
        if self.shard_units != "blocks" and self.shard == "none":
            raise PlanError("parallel.shard_units applies only to a sharded plan (shard "
                            f"zero2 or fsdp), got shard={self.shard!r}")
        if self.graphs and (self.pipeline > 1 or self.data > 1):
            raise PlanError(
                "parallel.graphs is valid only for a plan run in one process (pipeline = 1 "
                f"and data = 1), got pipeline={self.pipeline}, data={self.data}"
            )
        if self.graphs and self.tensor > 1:
            raise PlanError("parallel.graphs is valid only for a plan run in one process, "
                            f"got tensor={self.tensor}")
        if self.replicate > 1:
            if self.shard == "none":
                raise PlanError("parallel.replicate (HSDP) applies only to a sharded plan "
                                f"(shard zero2 or fsdp), got shard={self.shard!r}")
            if self.data % self.replicate:
                raise PlanError(f"parallel.replicate={self.replicate} must divide "
                                f"parallel.data={self.data} (replica groups of equal size)")
        if not isinstance(self.offload, bool):
            raise PlanError(f"parallel.offload must be true or false, got {self.offload!r}")
        if self.offload:
            self._check_offload()
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError("parallel.sequence_parallel must be true or false, got "
                            f"{self.sequence_parallel!r}")
        if self.sequence_parallel and (self.tensor == 1 or self.pipeline > 1):
            raise PlanError("parallel.sequence_parallel splits a tensor group's residual "
                            "stream: it needs parallel.tensor > 1 and parallel.pipeline = 1, "
                            f"got tensor={self.tensor}, pipeline={self.pipeline}")
        if self.pipeline > 1 and self.microbatches < self.pipeline:
            raise PlanError(
                f"a {self.pipeline}-stage pipeline needs at least {self.pipeline} microbatches, "
                f"got {self.microbatches}"
            )

    def _check_offload(self) -> None:
        if self.shard != "fsdp":
            raise PlanError("parallel.offload keeps FSDP2's parameter shards on the host: it "
                            f"needs shard='fsdp', got shard={self.shard!r}")
        for name, bad, valid in (("pipeline", self.pipeline > 1, "1"),
                                 ("tensor", self.tensor > 1, "1"),
                                 ("graphs", self.graphs, "false")):
            if bad:
                raise PlanError(f"parallel.offload is valid only with parallel.{name} = "
                                f"{valid}, got {getattr(self, name)!r} (offloaded plans run "
                                "one FSDP2 rank per device, eagerly or compiled)")

    def micro_batch_size(self, batch_size: int) -> int:
        """Samples per microbatch of one replica; raises :class:`PlanError` when a global
        batch of ``batch_size`` does not split into ``data`` replicas x ``microbatches``."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise PlanError(f"the batch size must be an integer >= 1, got {batch_size!r}")
        parts = self.data * self.microbatches
        if batch_size % parts:
            raise PlanError(
                f"a global batch of {batch_size} does not split into {self.data} replica(s) x "
                f"{self.microbatches} microbatch(es) of equal size; use a batch size divisible "
                f"by {parts}, or fewer microbatches")
        return batch_size // parts

    def to_json(self) -> dict[str, Any]:
        out = {"data": self.data, "pipeline": self.pipeline, "microbatches": self.microbatches,
               "schedule": self.schedule, "shard": self.shard}
        if self.graphs:  # written only when on: plans without it read as before
            out["graphs"] = True
        if self.shard_units != "blocks":  # likewise
            out["shard_units"] = self.shard_units
        if self.compile:  # likewise
            out["compile"] = True
        if self.tensor > 1:  # likewise
            out["tensor"] = self.tensor
        if self.replicate > 1:  # likewise
            out["replicate"] = self.replicate
        if self.offload:  # likewise
            out["offload"] = True
        if self.sequence_parallel:  # likewise
            out["sequence_parallel"] = True
        return out

    @classmethod
    def from_json(cls, d: Any) -> ParallelConfig:
        if not isinstance(d, dict):
            raise PlanError(f"\"parallel\" must be an object, got {type(d).__name__}")
        unknown = set(d) - {"data", "pipeline", "microbatches", "schedule", "shard", "graphs",
                            "shard_units", "compile", "tensor", "replicate", "offload",
                            "sequence_parallel"}
        if unknown:
            raise PlanError(f"unknown keys in \"parallel\": {sorted(unknown)}")
        return cls(**d)

    def describe(self) -> str:
        parts = []
        if self.data > 1:
            parts.append(f"dp={self.data}" + ("" if self.shard == "none" else f"/{self.shard}")
                         + ("" if self.replicate == 1 else f"/hsdp{self.replicate}")
                         + ("" if self.shard_units == "blocks" else f"/{self.shard_units}"))
        elif self.shard != "none":  # one sharded rank: FSDP2 with offload
            parts.append(self.shard)
        if self.offload:
            parts.append("offload")
        if self.tensor > 1:
            parts.append(f"tp={self.tensor}" + ("/sp" if self.sequence_parallel else ""))
        if self.pipeline > 1:
            parts.append(f"pp={self.pipeline}/{self.schedule}")
        if self.microbatches > 1:
            parts.append(f"mb={self.microbatches}")
        if self.graphs:
            parts.append("graphs")
        if self.compile:
            parts.append("compile")
        return " ".join(parts) or "single"


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
        fp = self.model.get("fingerprint")
        if fp is not None and fp != graph.fingerprint:
            raise PlanError(
                f"plan was made for another graph: plan fingerprint {fp}, this model's "
                f"{graph.fingerprint} (model {self.model.get('spec', '?')!r}, "
                f"{self.model.get('num_ops', '?')} ops in the plan vs {len(graph)} here)"
            )
        unknown = [op for op in self.groups if op not in graph]
        if unknown:
            raise PlanError(f"plan names {len(unknown)} ops not in the graph, e.g. {unknown[:3]}")
        missing = [op.name for op in graph if op.name not in self.groups]
        if missing:
            raise PlanError(f"plan does not place {len(missing)} ops, e.g. {missing[:3]}")
        g = self.num_groups
        bad = {op: gid for op, gid in self.groups.items() if not (0 <= gid < g)}
        if bad:
            op, gid = next(iter(bad.items()))
            raise PlanError(f"op {op!r} is in group {gid}, but groups are 0..{g - 1}")
        for key, ids in (("recompute", self.recompute), ("selective", self.selective)):
            bad_ids = sorted(x for x in ids if not (0 <= x < g))
            if bad_ids:
                raise PlanError(f"{key} names group {bad_ids[0]}, but groups are 0..{g - 1}")
        if self.priority and len(self.priority) != g:
            raise PlanError(f"priority has {len(self.priority)} entries, but the plan has {g} "
                            "groups: give one integer per group, or none")
        both = sorted(self.recompute & self.selective)
        if both:
            raise PlanError(f"group {both[0]} is in both recompute and selective; a group is "
                            "recomputed whole or selectively, not both")
        if (self.recompute or self.selective) and self.parallel.graphs:
            raise PlanError("parallel.graphs cannot be combined with recompute: a recomputed "
                            "group runs under activation checkpointing, outside any CUDA graph")
        if any(d < 0 for d in self.placement):
            raise PlanError(f"device index {min(self.placement)} is negative")
        if cluster is not None:
            need = self.num_devices
            if need > cluster.num_devices:
                tp = (f" x {self.parallel.tensor} tensor-parallel"
                      if self.parallel.tensor > 1 else "")
                raise PlanError(
                    f"plan needs {need} devices ({self.parallel.data} replicas x "
                    f"{self.devices_per_replica} devices{tp}), but cluster {cluster.name!r} has "
                    f"{cluster.num_devices}: device index {max(self.placement)} is out of range"
                    if self.parallel.data == 1 and not tp
                    else f"plan needs {need} devices ({self.parallel.data} replicas x "
                    f"{self.devices_per_replica} devices{tp}), but cluster {cluster.name!r} has "
                    f"{cluster.num_devices}"
                )
        par = self.parallel
        if par.shard != "none" and par.data == 1 and not par.offload:
            raise PlanError(f"parallel.shard={par.shard!r} needs parallel.data > 1 (or, with "
                            "shard='fsdp', parallel.offload: one rank streaming its parameters "
                            "from the host)")
        if par.shard != "none" and par.pipeline == 1 and self.devices_per_replica > 1:
            raise PlanError(
                f"parallel.shard={par.shard!r} with a replica spread over "
                f"{self.devices_per_replica} devices in one process is not supported (FSDP2 "
                "keeps one device per rank); use shard='none' (DDP) or a pipeline"
            )
        if par.tensor > 1 and par.pipeline == 1 and self.devices_per_replica > 1:
            raise PlanError(
                f"parallel.tensor={par.tensor} with a replica spread over "
                f"{self.devices_per_replica} devices in one process is not supported (a "
                "tensor-parallel rank is one process on one device); use a pipeline")
        if par.pipeline > 1:
            self._validate_chain(graph)
        elif par.microbatches > 1:
            _check_divisible(par.microbatches, "microbatches")

    def _validate_chain(self, graph: OpGraph) -> None:
        p = self.parallel.pipeline
        used = sorted(set(self.placement))
        if used != list(range(p)):
            raise PlanError(
                f"a {p}-stage pipeline must place ops on local devices 0..{p - 1}, "
                f"one stage each; the plan uses devices {used}"
            )
        # model inputs and parameter fetches have no producers: wherever they sit in
        # program order, the stage that holds them receives them, so they are skipped here
        last = -1
        for node in graph:
            if node.kind in ("input", "param"):
                continue
            op, s = node.name, self.device_of(node.name)
            if s < last:
                raise PlanError(
                    f"pipeline stages do not form a chain: op {op!r} is on stage {s} after an op "
                    f"of stage {last} (each stage must be one contiguous run of ops in "
                    f"topological order, stage 0 first)"
                )
            last = s
        for u, v, _ in graph.edges:
            su, sv = self.device_of(u), self.device_of(v)
            if sv < su:
                raise PlanError(
                    f"pipeline stages do not form a chain: {u!r} (stage {su}) feeds "
                    f"{v!r} (stage {sv}), a backward edge"
                )

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


def _check_divisible(n: int, what: str) -> None:
    if n < 1 or not math.isfinite(n):
        raise PlanError(f"{what} must be >= 1")


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
