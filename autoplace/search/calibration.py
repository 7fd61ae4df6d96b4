"""Measured corrections of the simulator, saved beside the per-op profile.

The simulator's op times come from a profile (or estimates); what it gets wrong is
mostly per execution *family* (FSDP2's all-gathers, torch pipelining's per-microbatch
costs, DDP's bucket overlap). After a plan is executed for real, the ratio of its
measured to simulated step time, and of its measured to simulated peak memory, is a
sample for its family (:func:`autoplace.search.families.family`). A :class:`Calibration` keeps
the samples; a family's factor is the median of its samples' ratios; a family without
samples keeps the simulator's own figures (factor 1.0, for time and memory): what
FSDP2 or pipelining get wrong says nothing about a one-process placement (on 2x H200,
one FSDP2 sample at 2.55x once pushed every unmeasured placement 2.55x down auto's
ranking).

Samples of plans found by searching the simulator itself (annealing, a policy trained
on it: :func:`searched`) do not correct other plans. Such a search finds the plans
whose time the simulator underrates most (the winner's curse), so their error says
little about a planner's plan of the same family: on 4x H200 the annealed placement of
branchy-mlp measured 2.25x its simulated time, m-SCT's 1.23x, and with the annealed
sample applied to every placement auto never measured m-SCT's (11.5 ms, the fastest
plan of the run). A searched plan is corrected by searched samples of its family,
else by its family's other samples.

The file is ``<cache_dir>/<graph fingerprint>-<device kind>x<devices>.calibration.json``
in the profile cache folder, so ``autoplace plan --planner auto`` (which writes it
after every measurement) and ``autoplace compare`` (which reads it) share it. It is
plain JSON; a corrupt or foreign file is ignored with a warning, never trusted.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autoplace.cluster import Cluster
from autoplace.files import write_json_atomic
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.search.families import family

__all__ = ["Calibration", "calibration_path", "searched"]

CALIBRATION_FORMAT = "autoplace-calibration-1"


def calibration_path(cache_dir: str | Path, graph: OpGraph, cluster: Cluster) -> Path:
    """Where the calibration of ``graph`` on ``cluster`` lives in ``cache_dir``.

    A memory cap gets a calibration of its own (``...-cap16GiB``): near a cap the same plan
    runs slower (on 2x H200 ZeRO-2 on gpt-1b measured 167-195 ms at 16 GiB and 90-96 ms
    without a cap), and a factor learned there must not correct uncapped predictions.
    """
    kind = cluster.devices[0].kind
    caps = {d.memory_cap_bytes for d in cluster.devices} - {None}
    cap = f"-cap{min(caps) / 2**30:g}GiB" if caps else ""
    return Path(cache_dir) / (f"{graph.fingerprint}-{kind}x{cluster.num_devices}{cap}"
                              ".calibration.json")


#: Caps within this fraction of each other share a calibration (a cap measured at every run,
#: like the benchmark's "75% of the single GPU's peak", moves by a few MiB from run to run:
#: GNMT-4's 4.37182 and 4.3712 GiB on two 2x H200 machines).
CAP_MATCH_REL = 0.01


def same_cap_regime(path: Path, tag: str = "") -> Path | None:
    """For a capped calibration ``path`` (:func:`calibration_path`'s name) that does not
    exist, the file beside it of the same graph and cluster whose cap is nearest to
    ``path``'s within :data:`CAP_MATCH_REL`, if any; with ``tag``, among the files named
    ``...-cap<G>GiB-<tag>.calibration.json`` (``scripts/bench/replay_suite.py``'s stored ones)."""
    m = re.fullmatch(r"(.+)-cap([0-9.e+-]+)GiB\.calibration\.json", path.name)
    if m is None or not path.parent.is_dir():
        return None
    stem, cap = m.group(1), float(m.group(2))
    suffix = f"-{re.escape(tag)}" if tag else ""
    pat = re.compile(re.escape(stem) + r"-cap([0-9.e+-]+)GiB" + suffix + r"\.calibration\.json")
    best: tuple[float, Path] | None = None
    for other in path.parent.iterdir():
        mo = pat.fullmatch(other.name)
        if mo is None:
            continue
        try:
            rel = abs(float(mo.group(1)) - cap) / cap
        except ValueError:
            continue
        if rel <= CAP_MATCH_REL and (best is None or rel < best[0]):
            best = (rel, other)
    return best[1] if best else None




def _good_sample(s: Any) -> bool:
    """Whether a sample read from a file has what the factors compute with: a family
    name and positive finite times and sizes (or none, where a run measured none)."""
    def positive(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) \
            and math.isfinite(x) and x > 0

    return (isinstance(s, dict) and isinstance(s.get("family"), str)
            and positive(s.get("sim_step_time_s"))
            and all(s.get(k) is None or positive(s[k]) for k in (
                "measured_step_time_s", "sim_peak_bytes", "measured_peak_bytes")))


def _search_name(name: Any) -> bool:
    """Whether a planner name is that of a search of the simulator."""
    return str(name) == "anneal" or str(name).startswith("policy:")


def searched(plan: Plan) -> bool:
    """Whether ``plan`` came from a search of the simulator (simulated annealing, or a
    policy trained on it) rather than from a planner's own rules."""
    info = plan.planner or {}
    return _search_name(info.get("name", "")) or "trainer" in info


def _sample_searched(sample: dict[str, Any]) -> bool:
    """A sample's ``searched`` flag; files written before it existed name the planner
    (auto's candidate names: ``anneal``, ``policy:<name>``)."""
    if "searched" in sample:
        return bool(sample["searched"])
    return _search_name(sample.get("planner", ""))


def _memory_family(fam: str) -> str:
    """The family whose memory a plan of ``fam`` shares: its layout, compiled or not."""
    return fam.replace("+compile", "")


@dataclass
class Calibration:
    """Measured/simulated samples of one graph on one kind of cluster."""

    fingerprint: str
    device_kind: str
    num_devices: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    """One per measured plan: ``family``, ``planner``, ``sim_step_time_s``,
    ``measured_step_time_s``, ``sim_peak_bytes``, ``measured_peak_bytes``, ``time``; from a
    CUDA run also ``measured_reserved_bytes`` (the allocator's peak reserved memory) and
    ``alloc_retries`` (its retries at the memory cap in the timed steps, every device)."""

    @classmethod
    def empty(cls, graph: OpGraph, cluster: Cluster) -> Calibration:
        return cls(graph.fingerprint, cluster.devices[0].kind, cluster.num_devices)

    # ----------------------------------------------------------- factors
    def _ratios(self, key: str, sim_key: str, fam: str | None,
                searched_: bool | None = None, memory: bool = False) -> list[float]:
        """``key / sim_key`` over the samples of ``fam`` (``memory``: of its layout, compiled
        or not: see :meth:`memory_factor`)."""
        same = _memory_family if memory else (lambda f: f)
        return [s[key] / s[sim_key] for s in self.samples
                if (fam is None or same(s["family"]) == same(fam)) and s.get(key)
                and s.get(sim_key) and (searched_ is None or _sample_searched(s) == searched_)]

    def time_factor(self, fam: str, searched_: bool = False) -> float:
        """Measured/simulated step time for plans of family ``fam``: from the samples of
        planners' plans; for a plan found by searching the simulator (``searched_``) from
        searched samples of the family, else from the others."""
        key, sim = "measured_step_time_s", "sim_step_time_s"
        r = self._ratios(key, sim, fam, searched_)
        if not r and searched_:
            r = self._ratios(key, sim, fam, False)
        return statistics.median(r) if r else 1.0

    def memory_factor(self, fam: str) -> float:
        """Measured/simulated peak memory for ``fam`` (1.0 without a sample of it: FSDP2's
        gather buffers or a pipeline's activations say nothing of another family's peak;
        on GNMT-4 under a cap, FSDP2's 1.55x once ruled out every unmeasured placement).
        A layout's compiled and eager plans share it: they hold the same parameters,
        gradients and optimizer state (on 2x H200 under gpt-1b's 16 GiB cap tensor
        parallel compiled and eager both ran out of memory, simulated 6% over it)."""
        r = self._ratios("measured_peak_bytes", "sim_peak_bytes", fam, memory=True)
        return statistics.median(r) if r else 1.0

    def memory_measured(self, fam: str) -> bool:
        """Whether a run of family ``fam``'s layout, compiled or not, measured its peak (or
        ran out of memory)."""
        return bool(self._ratios("measured_peak_bytes", "sim_peak_bytes", fam, memory=True))

    @property
    def time_factors(self) -> dict[str, float]:
        """Per family, the factor of planners' plans; ``"<family> (searched)"`` for plans
        found by searching the simulator where such samples exist."""
        out = {f: self.time_factor(f) for f in sorted({s["family"] for s in self.samples})
               if self._ratios("measured_step_time_s", "sim_step_time_s", f, False)}
        for f in sorted({s["family"] for s in self.samples if _sample_searched(s)}):
            out[f"{f} (searched)"] = self.time_factor(f, True)
        return out

    def step_time(self, plan: Plan, sim_step_time_s: float) -> float:
        """The simulated step time of ``plan`` corrected by its family's factor."""
        return sim_step_time_s * self.time_factor(family(plan), searched(plan))

    def peak_bytes(self, plan: Plan, sim_peak_bytes: float) -> float:
        return sim_peak_bytes * self.memory_factor(family(plan))

    # ----------------------------------------------------------- samples
    def record(self, plan: Plan, planner: str, sim_step_time_s: float, sim_peak_bytes: float,
               report: Any, usable_bytes: float | None = None) -> None:
        """Add a sample: the simulated step time and peak, and a RunReport (or step seconds).

        A run that ran out of memory has no step time; its peak is recorded as just
        above ``usable_bytes`` (the cap it exceeded), a lower bound on the real peak.
        """
        if isinstance(report, (int, float)):
            step, peak, oom = float(report), None, False
        else:
            step = getattr(report, "step_time_s", None)
            peaks = [p for p in (getattr(report, "peak_memory_bytes", None) or []) if p]
            peak = max(peaks) if peaks else None
            oom = bool(getattr(report, "oom", False))
        self.samples.append({
            "family": family(plan), "planner": planner, "parallel": plan.split(),
            "searched": searched(plan),
            "sim_step_time_s": float(sim_step_time_s),
            "measured_step_time_s": None if oom or not step else float(step),
            "sim_peak_bytes": float(sim_peak_bytes) if sim_peak_bytes else None,
            "measured_peak_bytes": (1.05 * usable_bytes if oom and usable_bytes else
                                    None if oom or peak is None else float(peak)),
            "oom": oom, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        })
        reserved = getattr(report, "reserved_peak_bytes", None)
        if reserved is not None:  # what the allocator did (CUDA): data a model of the cap needs
            self.samples[-1]["measured_reserved_bytes"] = float(reserved)
            self.samples[-1]["alloc_retries"] = report.allocator_retries

    # ---------------------------------------------------------------- io
    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"format": CALIBRATION_FORMAT, **asdict(self)})

    @classmethod
    def load(cls, cache_dir: str | Path | None, graph: OpGraph, cluster: Cluster) -> Calibration:
        """The saved calibration for ``graph`` on ``cluster``, or an empty one."""
        empty = cls.empty(graph, cluster)
        if cache_dir is None:
            return empty
        path = calibration_path(cache_dir, graph, cluster)
        if not path.exists():
            path = same_cap_regime(path)
            if path is None:
                return empty
        try:
            data = json.loads(path.read_text())
            ok = (isinstance(data, dict) and data.get("format") == CALIBRATION_FORMAT
                  and data.get("fingerprint") == empty.fingerprint
                  and data.get("device_kind") == empty.device_kind
                  and data.get("num_devices") == empty.num_devices
                  and isinstance(data.get("samples"), list))
            samples = [s for s in data["samples"] if _good_sample(s)] if ok else []
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            ok, samples = False, []
        if not ok:
            print(f"autoplace: warning: ignoring {path}: not a calibration of this graph and "
                  "cluster", file=sys.stderr)
            return empty
        empty.samples = samples
        return empty
