"""The hybrid split of a plan: data, pipeline, microbatches, sharding, tensor parallelism.

:class:`ParallelConfig` is the ``parallel`` block of a plan file (see :mod:`autoplace.plan`):
it checks on construction that its fields fit together, and reads and writes that block's
JSON (fields at their defaults are left out, so older plans load unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplace.errors import PlanError

__all__ = ["ParallelConfig", "SCHEDULES", "SHARD_MODES", "SHARD_UNITS"]

SCHEDULES = ("gpipe", "1f1b")
SHARD_MODES = ("none", "zero2", "fsdp")
#: FSDP2 units of a sharded plan (executor.data.wrap_data_parallel)
SHARD_UNITS = ("blocks", "modules")


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
        shard_optimizer: ZeRO-1 under DDP: each replica keeps the AdamW state of ``1 /
            data`` of the parameters and updates only those, then broadcasts them to the
            others (``torch.distributed.optim.ZeroRedundancyOptimizer``); gradients and
            parameters stay whole. Only with ``shard="none"``, ``data > 1``,
            ``pipeline == 1`` and ``tensor == 1``.
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
    shard_optimizer: bool = False

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
        if not isinstance(self.shard_optimizer, bool):
            raise PlanError("parallel.shard_optimizer must be true or false, got "
                            f"{self.shard_optimizer!r}")
        if self.shard_optimizer:
            self._check_shard_optimizer()
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

    def _check_shard_optimizer(self) -> None:
        for name, bad, valid in (("shard", self.shard != "none", "'none'"),
                                 ("data", self.data < 2, "2 or more"),
                                 ("pipeline", self.pipeline > 1, "1"),
                                 ("tensor", self.tensor > 1, "1")):
            if bad:
                raise PlanError(f"parallel.shard_optimizer (ZeRO-1: DDP replicas sharing out "
                                f"the AdamW state) needs parallel.{name} = {valid}, got "
                                f"{getattr(self, name)!r}; zero2 and fsdp shard the optimizer "
                                "state already")

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
        if self.shard_optimizer:  # likewise
            out["shard_optimizer"] = True
        return out

    @classmethod
    def from_json(cls, d: Any) -> ParallelConfig:
        if not isinstance(d, dict):
            raise PlanError(f"\"parallel\" must be an object, got {type(d).__name__}")
        unknown = set(d) - {"data", "pipeline", "microbatches", "schedule", "shard", "graphs",
                            "shard_units", "compile", "tensor", "replicate", "offload",
                            "sequence_parallel", "shard_optimizer"}
        if unknown:
            raise PlanError(f"unknown keys in \"parallel\": {sorted(unknown)}")
        return cls(**d)

    def describe(self) -> str:
        parts = []
        if self.data > 1:
            parts.append(f"dp={self.data}" + ("" if self.shard == "none" else f"/{self.shard}")
                         + ("/zero1" if self.shard_optimizer else "")
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
