"""Backends that turn a plan into a step time: the simulator, or real devices.

* ``sim``: :func:`autoplace.sim.simulate` (deterministic; results are cached by plan).
* ``real``: :func:`autoplace.executor.execute` inside a persistent measuring worker
  subprocess (:mod:`autoplace.envs.real_worker`) that keeps the model between
  episodes and reports the median of ``steps - warmup`` timed steps. An
  out-of-memory error is a result; a crashed worker is restarted and the
  measurement retried once; a hung run is killed after ``timeout_s``. Measuring takes
  seconds, so two options save runs: ``cache_size`` remembers measured plans (a plan
  sampled again reuses its result, marked ``extra["cached"]``), and ``oom_margin``
  reports a plan out of memory without running it when the simulator puts its peak
  above ``oom_margin`` times a device's usable memory (``extra["skipped"]``). A plan whose
  split does not divide the workload's batch size (when its options name one) fails
  without running too.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from autoplace.cluster import Cluster
from autoplace.errors import AutoplaceError, PlanError
from autoplace.graph import OpGraph
from autoplace.plan import Plan

__all__ = ["Measurement", "Backend", "SimBackend", "RealBackend", "BACKENDS", "make_backend",
           "plan_key"]


@dataclass(kw_only=True)
class Measurement:
    """What a backend says about one plan.

    Attributes:
        step_time_s: step time in seconds (``inf`` when nothing could be timed).
        peak_memory_bytes: peak memory per cluster device.
        oom: True when a device ran out of memory.
        error: why the plan failed (out of memory, invalid, crashed), else None.
        measured: True when the time was measured on devices, False when simulated.
        extra: backend details (``allocated_bytes``, ``reserved_bytes`` per GPU after a
            real run, ``worker_restarts``, ``step_times_s``; ``lower_bound_s`` from the sim).
    """

    step_time_s: float
    peak_memory_bytes: list[int] = field(default_factory=list)
    oom: bool = False
    error: str | None = None
    measured: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.oom or self.error is not None

    @classmethod
    def failure(cls, error: str, num_devices: int, *, oom: bool = False) -> Measurement:
        return cls(step_time_s=math.inf, peak_memory_bytes=[0] * num_devices, oom=oom,
                   error=error)


class Backend(Protocol):
    name: str

    def evaluate(self, plan: Plan, *, uncapped: bool = False, key: Any = None) -> Measurement:
        """Step time of ``plan``; ``uncapped`` lifts the cluster's memory caps (reference runs);
        ``key`` identifies the plan in a cache (default: its placement and split)."""
        ...

    def close(self) -> None: ...


def plan_key(plan: Plan) -> tuple:
    """What identifies a plan among those of one env (they share its grouping): placement,
    split and levers. The backends' caches key on it unless the caller gives a key."""
    return (plan.placement, plan.parallel, plan.priority, plan.recompute, plan.selective)


class SimBackend:
    """Step times from the simulator, cached by plan (it is deterministic).

    Args:
        graph: the graph plans are made for.
        cluster: the cluster to simulate.
        cache_size: plans remembered (0 disables the cache).
    """

    name = "sim"

    def __init__(self, graph: OpGraph, cluster: Cluster, *, cache_size: int = 4096) -> None:
        from autoplace.sim import simulate

        self._simulate = simulate
        self.graph, self.cluster, self.cache_size = graph, cluster, cache_size
        self._cache: OrderedDict[tuple, Measurement] = OrderedDict()

    def evaluate(self, plan: Plan, *, uncapped: bool = False, key: Any = None) -> Measurement:
        # the simulator times a plan whether or not it fits, so ``uncapped`` changes nothing;
        # plans of one env share its grouping, so placement, split and levers identify them
        # unless the caller says otherwise
        if key is None:
            key = plan_key(plan)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return _copy(hit)
        res = self._simulate(self.graph, plan, self.cluster)
        oom_devices = list(getattr(res, "oom_devices", []))
        m = Measurement(
            step_time_s=float(res.step_time_s),
            peak_memory_bytes=[int(b) for b in res.peak_memory_bytes],
            oom=bool(res.oom),
            error=f"out of memory on device(s) {oom_devices}" if res.oom else None,
            extra={"lower_bound_s": float(getattr(res, "lower_bound_s", 0.0))},
        )
        if self.cache_size > 0:
            self._cache[key] = m
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return _copy(m)

    def timeline(self, plan: Plan) -> Any:
        """The simulated :class:`SimResult` of ``plan`` with its timeline."""
        return self._simulate(self.graph, plan, self.cluster, timeline=True)

    def close(self) -> None:
        self._cache.clear()


def _copy(m: Measurement) -> Measurement:
    return Measurement(step_time_s=m.step_time_s, peak_memory_bytes=list(m.peak_memory_bytes),
                       oom=m.oom, error=m.error, measured=m.measured, extra=dict(m.extra))


class RealBackend:
    """Step times measured by executing the plan in a persistent worker subprocess.

    Args:
        workload: ``{"spec": zoo name or module:factory, "options": {...}, "seed": 0}``.
        cluster: the cluster (its devices must exist on this machine).
        steps: steps per measurement, warm-up included.
        warmup: steps not timed.
        timeout_s: seconds one measurement may take before the worker is killed.
        threads: CPU threads of the worker (``OMP_NUM_THREADS``; None: torch's default).
        graph: the graph plans are made for (needed by ``oom_margin``).
        cache_size: measured plans remembered, by :func:`plan_key` or the caller's key
            (0: every call measures).
        oom_margin: a plan whose simulated peak exceeds ``oom_margin`` times a device's
            usable memory is reported out of memory without running (None: every plan runs).
    """

    name = "real"

    def __init__(
        self,
        workload: dict[str, Any],
        cluster: Cluster,
        *,
        steps: int = 5,
        warmup: int = 2,
        timeout_s: float = 300.0,
        threads: int | None = None,
        graph: OpGraph | None = None,
        cache_size: int = 0,
        oom_margin: float | None = None,
    ) -> None:
        from autoplace.envs.real_worker import MeasuringWorker

        if steps <= warmup:
            raise AutoplaceError(f"real backend: steps ({steps}) must exceed warmup ({warmup})")
        if oom_margin is not None:
            if not (isinstance(oom_margin, (int, float)) and math.isfinite(oom_margin)
                    and oom_margin >= 1.0):
                raise AutoplaceError(f"real backend: oom_margin must be a number >= 1 or None, "
                                     f"got {oom_margin!r}")
            if graph is None:
                raise AutoplaceError("real backend: oom_margin needs the graph to simulate")
        self.workload, self.cluster = workload, cluster
        self.steps, self.warmup, self.timeout_s = steps, warmup, timeout_s
        self.cache_size, self.oom_margin = cache_size, oom_margin
        self._sim = SimBackend(graph, cluster) if oom_margin is not None else None
        self._cache: OrderedDict[tuple, Measurement] = OrderedDict()
        self.worker = MeasuringWorker(
            env={"OMP_NUM_THREADS": str(threads)} if threads is not None else None)
        #: the next request's ``inject`` (test hook: "oom", "hang", "crash"); used once.
        self.inject: str | None = None
        #: plans run on the devices, answered from the cache, and failed without running
        #: (out of memory by the simulator's peak, or a batch that does not split)
        self.counts = {"measured": 0, "cached": 0, "skipped": 0}

    def evaluate(self, plan: Plan, *, uncapped: bool = False, key: Any = None) -> Measurement:
        key = (plan_key(plan) if key is None else key, uncapped)
        hit = self._cache.get(key) if self.inject is None else None
        if hit is not None:
            self._cache.move_to_end(key)
            self.counts["cached"] += 1
            m = _copy(hit)
            m.extra["cached"] = True
            return m
        m = self._unsplittable(plan)
        if m is None and not uncapped:
            m = self._predicted_oom(plan)
        if m is None:
            m = self._measure(plan, uncapped)
            self.counts["measured"] += 1
        else:
            self.counts["skipped"] += 1
        if self.cache_size > 0 and not m.extra.get("timed_out"):
            self._cache[key] = m
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return _copy(m)

    def _unsplittable(self, plan: Plan) -> Measurement | None:
        """A failure without running when the workload's batch size is known and does not
        split into the plan's replicas x microbatches (the run would raise it)."""
        batch = (self.workload.get("options") or {}).get("batch_size")
        if not isinstance(batch, int):
            return None
        try:
            plan.parallel.micro_batch_size(batch)
        except PlanError as e:
            m = Measurement.failure(f"invalid plan (not run): {e}", self.cluster.num_devices)
            m.extra = {"skipped": True}
            return m
        return None

    def _predicted_oom(self, plan: Plan) -> Measurement | None:
        """A failure without running when the simulator's peak is past the margin."""
        if self._sim is None:
            return None
        sim = self._sim.evaluate(plan)
        usable = [d.usable_memory_bytes for d in self.cluster.devices]
        over = [(i, peak) for i, peak in enumerate(sim.peak_memory_bytes)
                if i < len(usable) and peak > self.oom_margin * usable[i]]
        if not over:
            return None
        i, peak = max(over, key=lambda x: x[1] / usable[x[0]])
        m = Measurement.failure(
            f"out of memory (not run): the simulator puts device {i}'s peak at "
            f"{peak / 2**20:.0f} MiB, {peak / usable[i]:.2f}x its usable "
            f"{usable[i] / 2**20:.0f} MiB (oom_margin {self.oom_margin:g})",
            self.cluster.num_devices, oom=True)
        m.peak_memory_bytes = list(sim.peak_memory_bytes)
        m.extra = {"skipped": True}
        return m

    def _measure(self, plan: Plan, uncapped: bool) -> Measurement:
        from autoplace.envs.real_worker import WorkerDied, WorkerTimeout

        cluster = self.cluster.with_memory_cap(None) if uncapped else self.cluster
        request = {"cmd": "measure", "workload": self.workload, "cluster": cluster.to_json(),
                   "plan": plan.to_json(), "steps": self.steps, "warmup": self.warmup,
                   "timeout_s": self.timeout_s, "inject": self.inject}
        self.inject = None
        n = self.cluster.num_devices
        reply = None
        for attempt in range(2):  # a crashed worker is restarted and the plan retried once
            try:
                reply = self.worker.request(request, self.timeout_s)
                break
            except WorkerTimeout as e:
                m = Measurement.failure(str(e), n)
                m.extra = {"timed_out": True}  # never cached: a later try may finish
                return m
            except WorkerDied as e:
                if attempt == 1:
                    return Measurement.failure(f"{e} twice while running this plan", n)
                request["inject"] = None
        assert reply is not None
        extra = {"allocated_bytes": reply.get("allocated_bytes", []),
                 "reserved_bytes": reply.get("reserved_bytes", []),
                 "worker_restarts": self.worker.restarts}
        if not reply.get("ok"):
            m = Measurement.failure(reply.get("error") or "unknown error", n,
                                    oom=bool(reply.get("oom")))
            m.extra = extra
            return m
        report = reply["report"]
        t = report.get("step_time_s")
        peak = [int(b) for b in report.get("peak_memory_bytes") or []]
        peak = (peak + [0] * n)[:n]
        failed = bool(report.get("oom")) or report.get("error") is not None or t is None
        return Measurement(
            step_time_s=float(t) if t is not None else math.inf,
            peak_memory_bytes=peak,
            oom=bool(report.get("oom")),
            error=(report.get("error") or "no step was timed") if failed else None,
            measured=not failed,
            extra={**extra, "step_times_s": report.get("step_times_s", [])},
        )

    @property
    def worker_pid(self) -> int | None:
        """Pid of the running worker process (None before the first measurement)."""
        return self.worker.pid

    def close(self) -> None:
        self.worker.close()
        self._cache.clear()
        if self._sim is not None:
            self._sim.close()


BACKENDS = ("sim", "real")


def make_backend(name: str, **kwargs: Any) -> Backend:
    """A backend by name; the error lists the valid names."""
    if name == "sim":
        return SimBackend(kwargs["graph"], kwargs["cluster"], cache_size=kwargs.get("cache_size", 4096))
    if name == "real":
        return RealBackend(kwargs["workload"], kwargs["cluster"], steps=kwargs.get("steps", 5),
                           warmup=kwargs.get("warmup", 2), timeout_s=kwargs.get("timeout_s", 300.0),
                           threads=kwargs.get("threads"), graph=kwargs.get("graph"),
                           cache_size=kwargs.get("real_cache_size", 0),
                           oom_margin=kwargs.get("oom_margin"))
    raise AutoplaceError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
