"""Profile records: cached as JSON per (graph fingerprint, device kind), and applied to
a graph's ops. Records written before the fixed parts existed still load, without them."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autoplace.files import write_json_atomic
from autoplace.graph import OpGraph

__all__ = ["PROFILE_FORMAT", "apply_by_name", "apply_cached", "record_block"]

PROFILE_FORMAT = "autoplace.profile/1"


def _apply(graph: OpGraph, kind: str, cached: dict[str, Any]) -> None:
    """Set every op's ``kind`` times from a profile record and note where they came from."""
    ff, bf = cached.get("fwd_fixed_s") or {}, cached.get("bwd_fixed_s") or {}
    hf, hb = cached.get("fwd_host_s") or {}, cached.get("bwd_host_s") or {}
    hff, hbf = cached.get("fwd_host_fixed_s") or {}, cached.get("bwd_host_fixed_s") or {}
    for op in graph:
        op.fwd_time_s[kind] = float(cached["fwd_time_s"][op.name])
        op.bwd_time_s[kind] = float(cached["bwd_time_s"][op.name])
        # fixed parts where the record has them (older records have none: the simulator
        # then uses the launch overhead); never keep those of an earlier profile
        if op.name in ff and op.name in bf:
            op.fwd_fixed_s[kind] = min(float(ff[op.name]), op.fwd_time_s[kind])
            op.bwd_fixed_s[kind] = min(float(bf[op.name]), op.bwd_time_s[kind])
        else:
            op.fwd_fixed_s.pop(kind, None)
            op.bwd_fixed_s.pop(kind, None)
        for full, fixed, whole, part in ((hf, hff, op.fwd_host_s, op.fwd_host_fixed_s),
                                         (hb, hbf, op.bwd_host_s, op.bwd_host_fixed_s)):
            # host times: GPU records of this format on (older ones: host_dispatch_s)
            if op.name in hf and op.name in hb:
                whole[kind] = float(full[op.name])
            else:
                whole.pop(kind, None)
            if kind in whole and op.name in fixed:
                part[kind] = min(float(fixed[op.name]), whole[kind])
            else:
                part.pop(kind, None)
    info = dict(getattr(graph, "profile_info", None) or {})
    info[kind] = {k: cached[k] for k in ("calibration", "device", "torch_version",
                                         "fixed_parts", "batch_size", "small_batch", "share",
                                         "small_calibration", "compiled", "recompute", "graphs",
                                         "optimizer")
                  if k in cached}
    info[kind].setdefault("fixed_parts", "absent: the profile record predates them")
    graph.profile_info = info


def apply_cached(graph: OpGraph, cache_dir: str | Path, kinds: Sequence[str]) -> list[str]:
    """Fill ``graph``'s op times from profiles cached in ``cache_dir``; return the kinds found.

    Needs no parameters (a meta-device graph works): the cache is keyed by the graph's
    fingerprint and the device kind.
    """
    found = []
    for kind in dict.fromkeys(kinds):
        cached = _load(cache_dir, graph, kind)
        if cached is None:
            continue
        _apply(graph, kind, cached)
        found.append(kind)
    return found


def _cache_path(cache_dir: str | Path, graph: OpGraph, kind: str) -> Path:
    return Path(cache_dir) / f"{graph.fingerprint}-{kind}.json"


def _load(cache_dir: str | Path | None, graph: OpGraph, kind: str) -> dict[str, Any] | None:
    if cache_dir is None:
        return None
    path = _cache_path(cache_dir, graph, kind)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if _valid_record(data, graph) else None


def _valid_record(data: Any, graph: OpGraph) -> bool:
    """Whether a cached profile is this graph's, with a time (finite, >= 0) for every op;
    optional parts (fixed and host times) are objects of such numbers when present."""
    def times(d: Any, every: bool) -> bool:
        if not isinstance(d, dict):
            return False
        values = [d.get(op) for op in graph.order] if every else list(d.values())
        return all(isinstance(x, (int, float)) and not isinstance(x, bool)
                   and math.isfinite(x) and x >= 0 for x in values)

    return (isinstance(data, dict) and data.get("format") == PROFILE_FORMAT
            and data.get("fingerprint") == graph.fingerprint
            and times(data.get("fwd_time_s"), True) and times(data.get("bwd_time_s"), True)
            and all(data.get(k) is None or times(data[k], False) for k in (
                "fwd_fixed_s", "bwd_fixed_s", "fwd_host_s", "bwd_host_s", "fwd_host_fixed_s",
                "bwd_host_fixed_s"))
            and all(data.get(k) is None or _valid_block(data[k], BLOCK_KEYS[k])
                    for k in BLOCK_KEYS))


#: a block measurement's parts (``autoplace.executor.profile_block``) and the numbers in
#: each that the simulator reads
BLOCK_KEYS = {"compiled": ("fused_time",), "recompute": ("full_host_s", "selective_host_s"),
              "graphs": ("device_share",)}


def _valid_block(rec: Any, keys: Sequence[str]) -> bool:
    """Whether a block measurement has the numbers the simulator reads, finite and >= 0
    (a compiled factor > 0)."""
    return isinstance(rec, dict) and all(
        isinstance(rec.get(k), (int, float)) and not isinstance(rec.get(k), bool)
        and math.isfinite(rec[k]) and rec[k] >= 0 and (k != "fused_time" or rec[k] > 0)
        for k in keys)


def record_block(cache_dir: str | Path, graph: OpGraph, kind: str,
                 parts: dict[str, Any]) -> bool:
    """Add a block measurement's parts (``compiled``, ``recompute``, ``graphs``; None: not
    measured)
    to ``graph``'s cached profile record for ``kind`` (written atomically); False when
    there is no record to add them to or a part is malformed."""
    data = _load(cache_dir, graph, kind)
    parts = {k: v for k, v in parts.items() if v is not None}
    if data is None or not all(k in BLOCK_KEYS and _valid_block(v, BLOCK_KEYS[k])
                               for k, v in parts.items()):
        return False
    _save(cache_dir, graph, kind, {**data, **parts})
    return True


def _save(cache_dir: str | Path | None, graph: OpGraph, kind: str, data: dict) -> None:
    if cache_dir is None:
        return
    path = _cache_path(cache_dir, graph, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)


def apply_by_name(graph: OpGraph, record: dict[str, Any], kind: str, cluster: Any) -> int:
    """Apply a profile ``record`` of device ``kind`` to ``graph`` by op name, where its
    fingerprint differs (an exported graph captured by another torch version holds other
    view ops): every op the record times must be in ``graph``; ``graph``'s other ops get
    estimated costs on ``cluster``. Returns how many were estimated.

    Raises:
        ValueError: the record times an op ``graph`` does not have.
    """
    from autoplace.costs.estimate import estimate_costs

    names = {op.name for op in graph}
    extra = sorted(set(record["fwd_time_s"]) - names)
    if extra:
        raise ValueError(f"the {kind} profile times {len(extra)} ops graph "
                         f"{graph.fingerprint} does not have, e.g. {extra[:3]}")
    estimate_costs(graph, cluster)
    rec = {**record, "fwd_time_s": dict(record["fwd_time_s"]),
           "bwd_time_s": dict(record["bwd_time_s"])}
    missing = [op for op in graph if op.name not in rec["fwd_time_s"]]
    for op in missing:
        rec["fwd_time_s"][op.name] = op.fwd_time_s[kind]
        rec["bwd_time_s"][op.name] = op.bwd_time_s[kind]
    _apply(graph, kind, rec)
    return len(missing)

