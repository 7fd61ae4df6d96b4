"""Where each choice sits in a oneshot action, and what the per-group levers make of a plan.

A oneshot action of :class:`~autoplace.envs.PlacementEnv` is one ``MultiDiscrete`` vector.
With the env's ``levers`` option it holds, in this order:

========== ============== ==========================================================
entries    lever          choice
========== ============== ==========================================================
G          (always)       the device of every group
G          ``priority``   every group's issue priority, ``0 .. priority_levels - 1``
                          (``Plan.priority``: lower is issued first on its device)
G          ``recompute``  every group's activation checkpointing: 0 none, 1 full
                          (``Plan.recompute``), 2 selective (``Plan.selective``)
3          (always)       indices into the data, pipeline and microbatch options
1          ``compile``    0 eager, 1 ``parallel.compile`` (every piece compiled)
========== ============== ==========================================================

``G`` is ``max_groups``: entries of padded groups are ignored. Without levers the action is
the devices and the split, as before levers existed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from autoplace.errors import AutoplaceError

__all__ = ["LEVERS", "RECOMPUTE_CHOICES", "ActionLayout", "InvalidActionError", "Levers",
           "check_levers", "compile_pays", "plan_levers"]

#: lever names the env's ``levers`` option takes
LEVERS = ("priority", "recompute", "compile")
#: what a group's recompute entry means, by value
RECOMPUTE_CHOICES = ("none", "full", "selective")


class InvalidActionError(AutoplaceError, ValueError):
    """An action outside the env's action space."""


@dataclass(frozen=True)
class Levers:
    """The lever part of one action, per real group (empty when the lever is off)."""

    priority: tuple[int, ...] = ()
    recompute: tuple[int, ...] = ()  # RECOMPUTE_CHOICES index per group
    compile: bool = False

    def recompute_sets(self) -> tuple[frozenset[int], frozenset[int]]:
        """``(full, selective)`` group ids, as ``Plan.recompute`` / ``Plan.selective``."""
        return (frozenset(g for g, c in enumerate(self.recompute) if c == 1),
                frozenset(g for g, c in enumerate(self.recompute) if c == 2))


def compile_pays(cluster: object) -> bool:
    """Whether ``parallel.compile`` is worth offering on ``cluster``: on GPUs, not on CPUs,
    where inductor's compile outlasts what it saves (the rule anneal's moves follow). A
    cluster without devices (none described) gets False."""
    devices = getattr(cluster, "devices", None) or ()
    return bool(devices) and all(getattr(d, "kind", "cpu") != "cpu" for d in devices)


def check_levers(levers: tuple[str, ...], priority_levels: int, mode: str) -> None:
    """Raise :class:`AutoplaceError` for unknown or repeated levers, levers in incremental
    mode, or fewer than 2 priority levels."""
    unknown = [x for x in levers if x not in LEVERS]
    if unknown:
        raise AutoplaceError(f"unknown lever(s) {unknown}; valid: {', '.join(LEVERS)}")
    if len(set(levers)) != len(levers):
        raise AutoplaceError(f"levers must not repeat, got {list(levers)}")
    if levers and mode != "oneshot":
        raise AutoplaceError(f"levers {list(levers)} are oneshot choices; mode {mode!r} "
                             "places one group per step: use mode='oneshot' or levers=()")
    if not isinstance(priority_levels, int) or isinstance(priority_levels, bool) \
            or priority_levels < 2:
        raise AutoplaceError(f"priority_levels must be an integer >= 2, got {priority_levels!r}")


@dataclass(frozen=True)
class ActionLayout:
    """The entries of a oneshot action (module docstring).

    Attributes:
        max_groups: padded group count ``G``.
        num_devices: choices of a device entry.
        split_sizes: option counts of the data, pipeline and microbatch entries.
        priority_levels: choices of a priority entry; 0 when the lever is off.
        recompute_choices: choices of a recompute entry (3); 0 when the lever is off.
        compile_choices: choices of the compile entry (2); 0 when the lever is off.
    """

    max_groups: int
    num_devices: int
    split_sizes: tuple[int, int, int]
    priority_levels: int = 0
    recompute_choices: int = 0
    compile_choices: int = 0

    @classmethod
    def of(cls, max_groups: int, num_devices: int, split_sizes: tuple[int, int, int],
           levers: tuple[str, ...] = (), priority_levels: int = 4) -> ActionLayout:
        """The layout of an env with these levers on."""
        return cls(max_groups=max_groups, num_devices=num_devices,
                   split_sizes=tuple(split_sizes),  # type: ignore[arg-type]
                   priority_levels=priority_levels if "priority" in levers else 0,
                   recompute_choices=len(RECOMPUTE_CHOICES) if "recompute" in levers else 0,
                   compile_choices=2 if "compile" in levers else 0)

    @property
    def slices(self) -> dict[str, slice]:
        """Entry range of every part present: ``device``, ``priority``, ``recompute``,
        ``split``, ``compile``."""
        g, at, out = self.max_groups, 0, {}
        for name, size in (("device", g), ("priority", g if self.priority_levels else 0),
                           ("recompute", g if self.recompute_choices else 0),
                           ("split", 3), ("compile", 1 if self.compile_choices else 0)):
            if size:
                out[name] = slice(at, at + size)
                at += size
        return out

    def nvec(self) -> np.ndarray:
        """The ``MultiDiscrete`` sizes of the action."""
        g = self.max_groups
        parts = [[self.num_devices] * g]
        if self.priority_levels:
            parts.append([self.priority_levels] * g)
        if self.recompute_choices:
            parts.append([self.recompute_choices] * g)
        parts.append(list(self.split_sizes))
        if self.compile_choices:
            parts.append([self.compile_choices])
        return np.array([n for p in parts for n in p], dtype=np.int64)

    def policy_sizes(self) -> dict[str, int]:
        """The lever sizes a policy is built with (``PlacementPolicy`` options); the
        compile entry is part of the policy's plan-wide choices, read from the space."""
        return {"priority_levels": self.priority_levels,
                "recompute_choices": self.recompute_choices}

    def entry(self, i: int) -> str:
        """What action entry ``i`` chooses, for error messages."""
        for name, s in self.slices.items():
            if s.start <= i < s.stop:
                return {"device": "a device number", "priority": "a priority level",
                        "recompute": "a recompute choice (0 none, 1 full, 2 selective)",
                        "split": "an option index", "compile": "0 (eager) or 1 (compile)"}[name]
        return "nothing (past the end)"

    def check(self, action: object) -> None:
        """Raise :class:`InvalidActionError` unless ``action`` is an action of this layout,
        naming the first entry out of range and what it chooses."""
        a = np.asarray(action)
        nvec = self.nvec()
        if a.shape != nvec.shape:
            parts = {"device": "a device per group", "priority": "a priority per group",
                     "recompute": "a recompute choice per group",
                     "split": "the data, pipeline and microbatch option indices",
                     "compile": "compile (0 or 1)"}
            raise InvalidActionError(
                f"action has shape {a.shape}, the action space takes {len(nvec)} entries: "
                + ", then ".join(parts[name] for name in self.slices)
                + f" (max_groups={self.max_groups})")
        if not np.issubdtype(a.dtype, np.integer):
            raise InvalidActionError(f"action entries must be integers, got dtype {a.dtype}")
        bad = np.flatnonzero((a < 0) | (a >= nvec))
        if bad.size:
            i = int(bad[0])
            raise InvalidActionError(
                f"action[{i}] = {int(a[i])} is out of range: it must be {self.entry(i)} in "
                f"0..{nvec[i] - 1} (action space MultiDiscrete({nvec.tolist()}))")

    def encode(self, devices: np.ndarray | list[int], split: tuple[int, ...] = (0, 0, 0),
               levers: Levers | None = None) -> np.ndarray:
        """The action of these choices (groups past ``len(devices)`` are padding)."""
        a = np.zeros(len(self.nvec()), dtype=np.int64)
        s = self.slices
        devices = np.asarray(devices, dtype=np.int64)
        a[s["device"].start: s["device"].start + len(devices)] = devices
        a[s["split"]] = split
        lv = levers or Levers()
        if "priority" in s and lv.priority:
            a[s["priority"].start: s["priority"].start + len(lv.priority)] = lv.priority
        if "recompute" in s and lv.recompute:
            a[s["recompute"].start: s["recompute"].start + len(lv.recompute)] = lv.recompute
        if "compile" in s:
            a[s["compile"]] = int(lv.compile)
        return a

    def decode(self, action: np.ndarray, num_groups: int) -> tuple[np.ndarray, tuple[int, ...],
                                                                   Levers]:
        """``(devices [num_groups], split indices, levers)`` of an action in the space."""
        s = self.slices
        devices = action[s["device"]][:num_groups].astype(np.int64)
        split = tuple(int(x) for x in action[s["split"]])
        levers = Levers(
            priority=tuple(int(x) for x in action[s["priority"]][:num_groups])
            if "priority" in s else (),
            recompute=tuple(int(x) for x in action[s["recompute"]][:num_groups])
            if "recompute" in s else (),
            compile=bool(action[s["compile"]][0]) if "compile" in s else False)
        return devices, split, levers


def plan_levers(levers: Levers, stage_of_group: list[int], pipeline: int,
                op_groups: list[int] | None = None
                ) -> tuple[frozenset[int], frozenset[int], tuple[int, ...]]:
    """``(recompute, selective, priority)`` of a plan from an action's levers.

    ``stage_of_group`` is each group's local device (its stage when ``pipeline > 1``). A
    pipeline stage runs under one recompute mode: it takes the choice most of its groups
    make (ties: the first of none, full, selective), and a pipeline's priorities are
    dropped (its schedule orders it). With ``op_groups`` (each op's env group, placement
    order) the plan's groups are the stages themselves and ``stage_of_group`` is per op.
    """
    choices = list(levers.recompute)
    if op_groups is not None and choices:
        choices = [choices[g] for g in op_groups]
    if pipeline > 1 and choices:
        votes: list[Counter] = [Counter() for _ in range(pipeline)]
        for c, s in zip(choices, stage_of_group):
            votes[s][c] += 1
        mode = [min(v, key=lambda c, v=v: (-v[c], c)) if v else 0 for v in votes]
        choices = mode if op_groups is not None else [mode[s] for s in stage_of_group]
    full, selective = Levers(recompute=tuple(choices)).recompute_sets()
    priority = levers.priority if pipeline == 1 and op_groups is None else ()
    return full, selective, tuple(priority)
