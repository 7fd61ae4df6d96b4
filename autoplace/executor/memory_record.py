"""What the CUDA caching allocator did over one training step, when a run asks
(``autoplace run --memory DIR``, :attr:`RunOptions.memory_dir`).

The allocator's own history (``torch.cuda.memory._record_memory_history``, Python stacks)
is recorded over one step of each rank (:func:`recorded_step`: the last warm-up step, so
that no timed step is slowed by the recording). Per rank it writes the snapshot
(``memory-rank<R>.pickle``: drop it on https://pytorch.org/memory_viz) and a summary
(``memory-rank<R>.json``) per device:

- ``allocated_peak_bytes`` and what was alive then, by where it was allocated
  (:func:`source`): the static state allocated before the step, FSDP's buffers,
  recomputation, the optimizer, compiled code, the backward, the model's forward; and
  the allocation sites holding most of it (``largest_at_peak``, :func:`site`: bytes,
  blocks and the largest block per site);
- ``reserved_peak_bytes`` and the memory reserved per CUDA stream at that moment and at
  each stream's own peak: a block freed on one stream is not reused by another's
  allocations (FSDP2 all-gathers and reduce-scatters on streams of their own), so reserved
  memory can reach a cap while the allocated peak stays well below it;
- ``ooms`` (allocations that failed, each followed by a retry that frees the cache).
"""
from __future__ import annotations

import os
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from autoplace.files import write_json_atomic

__all__ = ["MAX_ENTRIES", "MemoryRecorder", "recorded_step", "site", "source", "summarize"]

#: most allocator events kept (a gpt-1b step on one rank makes tens of thousands)
MAX_ENTRIES = 2_000_000

#: where a block was allocated, by the first frame (innermost first) under one of these
#: paths; the first match wins
SOURCES = (
    ("torch/distributed/fsdp/", "fsdp"),
    ("torch/utils/checkpoint", "recompute"),
    ("torch/optim/", "optimizer"),
    ("torch/_inductor/", "compiled"),
    ("torch/_functorch/", "compiled"),
    ("torch/distributed/pipelining/", "pipelining"),
    ("torch/nn/parallel/distributed", "ddp"),
    ("torch/distributed/tensor/", "dtensor"),
)


def source(frames: list[dict[str, Any]]) -> str:
    """Where a block was allocated: a :data:`SOURCES` name (``fsdp:<function>`` for
    FSDP), ``backward`` for autograd's engine, else ``forward`` (the model's own code
    under the executor), ``other``, or ``unknown`` without a Python frame (what the
    backward allocates on autograd's own thread)."""
    names = [(str(f.get("filename", "")).replace("\\", "/"), str(f.get("name", "")))
             for f in frames]
    for fname, func in names:
        for prefix, label in SOURCES:
            if prefix in fname:
                return f"fsdp:{func}" if label == "fsdp" else label
    if any("torch/autograd/" in fname for fname, _ in names):
        return "backward"
    if any("/autoplace/" in fname for fname, _ in names):
        return "forward"
    return "other" if names else "unknown"


#: allocation sites listed in ``largest_at_peak``
TOP_SITES = 20


def site(frames: list[dict[str, Any]]) -> str:
    """Where a block was allocated, finer than :func:`source`: the innermost frame (the
    library call that allocated it) and the innermost frame outside torch (the model's
    line or the executor's), ``file:line function`` each; ``autograd engine`` for a block
    the backward's C++ thread allocated with no Python frame."""
    if not frames:
        return "autograd engine"

    def where(f: dict[str, Any]) -> str:
        name = str(f.get("filename", "")).replace("\\", "/").rsplit("/", 1)[-1]
        return f"{name}:{f.get('line', '?')} {f.get('name', '')}"

    outer = next((f for f in frames if "/torch/" not in str(f.get("filename", ""))
                  .replace("\\", "/")), None)
    inner = where(frames[0])
    return inner if outer is None or outer is frames[0] else f"{inner} < {where(outer)}"


def summarize(snapshot: dict[str, Any], device: int) -> dict[str, Any]:
    """The summary of one device of a snapshot taken at the end of the recorded span
    (see the module's doc). Events before the recording started are not in the trace:
    what was allocated then counts as ``before`` (a block of it freed in the span is
    taken off ``before``)."""
    segs = [s for s in snapshot.get("segments", []) if s.get("device") == device]
    traces = snapshot.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    alloc_now = sum(int(s.get("allocated_size", 0)) for s in segs)
    reserved_now: dict[str, int] = defaultdict(int)
    for s in segs:
        reserved_now[str(s.get("stream", 0))] += int(s.get("total_size", 0))

    net_alloc = 0
    net_reserved: dict[str, int] = defaultdict(int)
    for e in trace:
        a, size, stream = e.get("action"), int(e.get("size", 0)), str(e.get("stream", 0))
        if a == "alloc":
            net_alloc += size
        elif a == "free_completed":
            net_alloc -= size
        elif a in ("segment_alloc", "segment_map"):
            net_reserved[stream] += size
        elif a in ("segment_free", "segment_unmap"):
            net_reserved[stream] -= size
    before = alloc_now - net_alloc  # allocated when the recording started
    streams = set(reserved_now) | set(net_reserved)
    reserved = {s: reserved_now.get(s, 0) - net_reserved.get(s, 0) for s in streams}

    live: dict[int, tuple[int, str, str, str]] = {}  # addr -> (size, source, stream, site)
    cur, peak, at_peak, before_live = before, before, None, before
    res_total = sum(reserved.values())
    res_peak, res_at_peak = res_total, dict(reserved)
    stream_peak = dict(reserved)
    ooms = 0
    for e in trace:
        a, size, stream = e.get("action"), int(e.get("size", 0)), str(e.get("stream", 0))
        addr = int(e.get("addr", 0))
        if a == "alloc":
            frames = e.get("frames") or []
            live[addr] = (size, source(frames), stream, site(frames))
            cur += size
            if cur > peak:
                peak, at_peak = cur, (dict(live), before_live)
        elif a == "free_completed":
            cur -= size
            if live.pop(addr, None) is None:
                before_live -= size
        elif a in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"):
            sign = 1 if a in ("segment_alloc", "segment_map") else -1
            reserved[stream] = reserved.get(stream, 0) + sign * size
            res_total += sign * size
            stream_peak[stream] = max(stream_peak.get(stream, 0), reserved[stream])
            if res_total > res_peak:
                res_peak, res_at_peak = res_total, dict(reserved)
        elif a == "oom":
            ooms += 1
    by_source: dict[str, int] = defaultdict(int)
    by_stream: dict[str, int] = defaultdict(int)
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # bytes, blocks, largest
    if at_peak is not None:
        blocks, before_then = at_peak
        by_source["before"] = before_then
        for size, src, stream, where in blocks.values():
            by_source[src] += size
            by_stream[stream] += size
            acc = by_site[where]
            acc[0] += size
            acc[1] += 1
            acc[2] = max(acc[2], size)
    else:
        by_source["before"] = before
    return {
        "device": device,
        "events": len(trace),
        "allocated_before_bytes": before,
        "allocated_peak_bytes": peak,
        "allocated_at_peak_by_source": dict(sorted(by_source.items(), key=lambda kv: -kv[1])),
        "allocated_in_step_at_peak_by_stream": dict(by_stream),
        "largest_at_peak": [
            {"site": k, "bytes": v[0], "blocks": v[1], "largest_block": v[2]}
            for k, v in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:TOP_SITES]],
        "reserved_peak_bytes": res_peak,
        "reserved_at_peak_by_stream": {k: v for k, v in res_at_peak.items() if v},
        "reserved_stream_peaks": {k: v for k, v in stream_peak.items() if v},
        "ooms": ooms,
    }


def recorded_step(start: int, warmup: int) -> int:
    """The step a run's record covers: its last warm-up step where one runs before it
    (the allocator's pools have grown by then, optimizer state and compiled code exist,
    and the timed steps are not slowed by the recording), else the first step past the
    warm-up (the first one run, for a run resumed past it)."""
    return warmup - 1 if warmup - 1 > start else max(start, warmup)


class MemoryRecorder:
    """Records the allocator's history over one step (``first_step``) of a rank's CUDA
    devices and writes a snapshot and its summary (the module's doc). Does nothing
    without ``out_dir`` or CUDA devices."""

    def __init__(self, out_dir: str | None, devices: list[torch.device], rank: int,
                 first_step: int) -> None:
        self.devices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        self.out = Path(out_dir) if out_dir and self.devices else None
        self.rank = rank
        self.first = first_step
        self.on = False
        self.paths: list[str] = []

    def step(self, step: int) -> None:
        """Call before each step: starts at ``first_step``, ends after it."""
        if self.out is None:
            return
        if step == self.first and not self.on:
            # stacks of allocations only (what the summary reads): with ``context="all"``
            # torch 2.11's backward raised a SystemError recomputing a checkpointed region
            # (max pooling, cuDNN's LSTM) while the history was recorded
            torch.cuda.memory._record_memory_history(
                enabled="all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
            self.on = True
        elif self.on and step > self.first:
            self.close()

    def close(self, save: bool = True) -> list[str]:
        """Stop recording; with ``save``, write the files. The paths written."""
        if not self.on:
            return self.paths
        for d in self.devices:
            torch.cuda.synchronize(d)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.on = False
        if not save or self.out is None:
            return self.paths
        self.out.mkdir(parents=True, exist_ok=True)
        pick = self.out / f"memory-rank{self.rank}.pickle"
        tmp = pick.with_name(pick.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:  # the format memory_viz reads; written, never loaded
            pickle.dump(snap, f)
        os.replace(tmp, pick)
        summary = {"rank": self.rank, "step": self.first,
                   "devices": [summarize(snap, d) for d in self.devices]}
        js = self.out / f"memory-rank{self.rank}.json"
        write_json_atomic(js, summary)
        self.paths = [str(js), str(pick)]
        return self.paths
