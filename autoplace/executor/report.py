"""RunReport: what one executed training run measured, as JSON."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autoplace.files import write_atomic

__all__ = ["RunReport", "max_rel_diff"]


@dataclass(kw_only=True)
class RunReport:
    """Measurements of a training run under a plan.

    Attributes:
        step_time_s: median step time after warm-up, seconds (NaN if no step was timed).
        step_times_s: every timed step (after warm-up), seconds.
        samples_per_s: global batch size / ``step_time_s``.
        peak_memory_bytes: peak allocated memory per cluster device the plan used
            (0 on CPU, where it is not measured).
        loss: training loss of every step (global mean over the batch).
        reference_loss: loss of the unpartitioned single-device reference on the
            same batches, per step (empty when the reference was skipped).
        max_loss_rel_diff: max over steps of ``|loss - ref| / max(|ref|, 1e-12)``
            (None without a reference).
        devices: torch device strings the plan ran on (cluster order).
        device_names: human names of those devices (``"NVIDIA H100 80GB HBM3"``).
        torch_version: ``torch.__version__`` of the run.
        oom: True when a device ran out of memory.
        oom_device: the device that ran out, when known.
        error: a message when the run failed (OOM, a killed rank ...), else None.
        plan: short description of the plan that ran.
        global_batch_size: samples per step.
        steps: steps run (warm-up included).
        warmup: steps not timed.
        extra: anything else a caller wants recorded; on CUDA devices ``"allocator"``:
            per cluster device index (a string), what the timed steps cost the caching
            allocator (``alloc_retries``, ``device_allocs``, ``device_frees``) and its
            peak reserved memory (``reserved_peak_bytes``).
    """

    step_time_s: float = float("nan")
    step_times_s: list[float] = field(default_factory=list)
    samples_per_s: float = 0.0
    peak_memory_bytes: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    reference_loss: list[float] = field(default_factory=list)
    max_loss_rel_diff: float | None = None
    devices: list[str] = field(default_factory=list)
    device_names: list[str] = field(default_factory=list)
    torch_version: str = ""
    oom: bool = False
    oom_device: str | None = None
    error: str | None = None
    plan: str = ""
    global_batch_size: int = 0
    steps: int = 0
    warmup: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the run finished without an error."""
        return self.error is None

    def finish(self) -> RunReport:
        """Fill the derived fields (median, throughput, loss difference)."""
        if self.step_times_s:
            self.step_time_s = float(statistics.median(self.step_times_s))
            if self.step_time_s > 0:
                self.samples_per_s = self.global_batch_size / self.step_time_s
        if self.reference_loss and self.loss:
            self.max_loss_rel_diff = max_rel_diff(self.loss, self.reference_loss)
        bad = next((i for i, x in enumerate(self.loss) if not math.isfinite(x)), None)
        if self.error is None and bad is not None:  # never a success with a NaN loss
            step = bad + int(self.extra.get("start_step", 0))
            self.error = f"the loss is {self.loss[bad]} at step {step}: training diverged"
        return self

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("step_time_s", "max_loss_rel_diff"):
            v = d[k]
            if isinstance(v, float) and not math.isfinite(v):  # NaN, inf are not JSON
                d[k] = None
        for k in ("loss", "reference_loss"):
            d[k] = [x if math.isfinite(x) else None for x in d[k]]
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunReport:
        data = dict(data)
        if data.get("step_time_s") is None:
            data["step_time_s"] = float("nan")
        for k in ("loss", "reference_loss"):  # a non-finite loss is written as null
            if isinstance(data.get(k), list):
                data[k] = [math.nan if x is None else x for x in data[k]]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @property
    def allocator_retries(self) -> int:
        """The caching allocator's retries during the timed steps, over every device
        (``extra["allocator"]``, from :func:`autoplace.executor.build.allocator_delta`):
        more than zero means the plan ran into its memory cap, freeing the allocator's
        cache and synchronising the device each time. 0 where not measured (CPU)."""
        return sum(int(d.get("alloc_retries", 0))
                   for d in self.extra.get("allocator", {}).values())

    @property
    def reserved_peak_bytes(self) -> int | None:
        """The allocator's largest peak reserved memory (allocated + cached) of a device
        (``extra["allocator"]``); None where not measured (CPU)."""
        reserved = [int(d["reserved_peak_bytes"]) for d in
                    self.extra.get("allocator", {}).values() if "reserved_peak_bytes" in d]
        return max(reserved) if reserved else None

    def save(self, path: str | Path) -> None:
        """Write the report as JSON atomically."""
        write_atomic(path, self.dumps())

    def summary(self) -> str:
        """One line for humans."""
        if self.error:
            return f"{self.plan}: FAILED: {self.error}"
        diff = "" if self.max_loss_rel_diff is None else f", loss rel diff {self.max_loss_rel_diff:.2e}"
        mem = "/".join(f"{b / 2**30:.1f}" for b in self.peak_memory_bytes)
        retries = (f", {self.allocator_retries} allocator retries (at the memory cap)"
                   if self.allocator_retries else "")
        comp = self.extra.get("compile")
        compiled = "" if not comp else (
            f", {comp['pieces']} compiled pieces ({comp['kinds']} graphs, warm-up "
            f"{comp.get('warmup_overhead_s', comp['compile_s']):.1f} s"
            + (f"; {len(comp['failed'])} ran eager: {comp['failed'][0]}" if comp["failed"]
               else "") + ")")
        return (
            f"{self.plan}: {self.step_time_s * 1e3:.1f} ms/step, {self.samples_per_s:.1f} samples/s, "
            f"peak {mem} GiB{diff}{retries}{compiled}"
        )


def max_rel_diff(loss: list[float], reference: list[float]) -> float:
    """Largest relative difference between two loss curves (over their common steps)."""
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(loss, reference)]
    if any(not math.isfinite(d) for d in diffs):  # a NaN loss is not 0 apart from anything
        return math.inf
    return max(diffs) if diffs else 0.0
