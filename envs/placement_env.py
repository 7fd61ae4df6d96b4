"""PlacementEnv: place op groups on devices (and pick the hybrid split); reward from step time.

Modes:

* ``oneshot``: one action places every group and picks the hybrid split; the
  episode is one step (``terminated=True``). Action ``MultiDiscrete([D] * max_groups
  + [n_data, n_pipeline, n_microbatches])``: a device per group (entries of padded
  groups are ignored), then indices into ``data_options``, ``pipeline_options`` and
  ``microbatch_options``. How the split reads the devices:

  - data degree ``d``: each replica has ``k = D // d`` local devices; a group's
    device is its action entry modulo ``k``.
  - pipeline ``p > 1``: a group's stage is the running maximum, over groups in
    topological order, of its device modulo ``p`` (so stages are contiguous and in
    order). If that does not give every stage ``0..p-1`` a run of ops in
    topological order, or there are fewer microbatches than stages, the plan is
    invalid: it gets the failing signal and ``info["error"]`` says why. Groups that
    are not intervals of placement order (``grouping="branch"``) take the running
    maximum per op in placement order instead, and the plan then has one group per
    stage. :meth:`PlacementEnv.valid_splits` lists the splits that can be valid.

  With ``levers`` (``"priority"``, ``"recompute"``, ``"compile"``) the action also picks,
  per group, an issue priority (``Plan.priority``, ``priority_levels`` levels) and
  activation checkpointing none / full / selective (``Plan.recompute`` /
  ``Plan.selective``), and plan-wide ``parallel.compile``: the layout is
  :mod:`autoplace.envs.levers` (``env.action_layout``). The reward prices them as it
  prices the placement (recompute trades memory for backward time; the simulator prices
  a compiled piece as eager, the real backend measures it). Under a pipeline split a
  stage takes the recompute choice most of its groups make, and priorities are dropped
  (a pipeline's order is its schedule's).

* ``incremental`` (Placeto, Addanki et al. 2019): groups are visited one per step
  in topological order, ``passes`` times; action ``Discrete(D)`` is the device for
  the focused group (``focus`` in the observation). The split is fixed to the first
  entry of each option list. Reward is the improvement of the score (below) over
  the previous placement, so an episode's return is score(final) - score(initial).

Score of a valid plan with step time ``t`` (``t1`` = the step time of everything on
device 0 with memory caps lifted, from the same backend), with ``r = min(t / t1,
max_slowdown)``: ``"neg_sqrt"`` (default) ``-sqrt(r)``; ``"improvement"`` ``1 - r``;
``"neg_time"`` ``-r``. Valid scores are thus bounded below by the *floor*, the score at
``r = max_slowdown`` (default 100: ``-10`` under ``neg_sqrt``, ``-99`` under
``improvement``, ``-100`` under ``neg_time``): every plan 100x slower than one device or
worse scores the floor. A plan that runs out of memory, is invalid, or crashes scores
``fail_reward``, strictly below every valid plan: by default ``floor - 1`` (``-11``
under ``neg_sqrt``). An explicit ``fail_reward`` at or above the floor raises the floor
to ``fail_reward + 1`` (valid plans are clipped there), so the order always holds.
``env.config.fail_reward`` and ``env.score_floor`` hold the values in use.

Actions follow the action space exactly: an action outside it (a device number out of
range, the wrong length, floats) raises :class:`InvalidActionError` (a ``ValueError``),
as Gymnasium's own environments do; nothing is taken modulo the device count except as
the data split above describes for actions inside the space.

``info`` after a step: ``step_time_s`` (``inf`` when nothing ran), ``peak_memory_bytes``
(per device), ``oom``, ``error`` (None or why it failed), ``backend``, ``measured``
(True only for a successful real measurement), ``plan`` (Plan JSON), ``score``,
``single_device_step_time_s``; real backend also ``allocated_bytes`` and
``reserved_bytes`` (per GPU in the worker after the run). Observation layout:
:mod:`autoplace.envs.observation`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from autoplace.cluster import Cluster, resolve
from autoplace.costs import estimate_costs
from autoplace.errors import AutoplaceError, PlanError
from autoplace.graph import OpGraph
from autoplace.grouping import coarsen, group_costs, placement_order
from autoplace.plan import ParallelConfig, Plan, model_info

from .backends import Backend, Measurement, make_backend
from .config import EnvConfig, check_config, resolve_workload
from .levers import ActionLayout, InvalidActionError, Levers, plan_levers
from .observation import group_edges, group_features, observation_space
from .render import gantt_rgb, placement_table

__all__ = ["InvalidActionError", "PlacementEnv"]

_MEMORY_AFTER = ("allocated_bytes", "reserved_bytes")  # real backend: GPU memory after a run

class PlacementEnv(gym.Env[dict[str, np.ndarray], np.ndarray]):
    """Place a model's op groups on a cluster's devices; see the module docstring.

    Args:
        workload: zoo name, ``module:factory`` or a Workload (needed by ``backend="real"``).
        graph: an OpGraph to place (default: captured from ``workload``).
        cluster: preset name, JSON path, ``"detect"`` or a Cluster.
        render_mode: None, ``"ansi"`` or ``"rgb_array"``.
        **options: fields of :class:`EnvConfig`.
    """

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 1}

    def __init__(
        self,
        workload: Any = None,
        graph: OpGraph | None = None,
        cluster: str | Cluster = "cpu-x2",
        *,
        render_mode: str | None = None,
        **options: Any,
    ) -> None:
        valid = [f.name for f in dataclasses.fields(EnvConfig)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise AutoplaceError(f"unknown PlacementEnv option(s) {unknown}; valid: {valid}")
        for key in ("data_options", "pipeline_options", "microbatch_options", "levers"):
            if key in options:
                options[key] = tuple(x if key == "levers" else int(x) for x in options[key])
        cfg = EnvConfig(**options)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise AutoplaceError(f"unknown render_mode {render_mode!r}; valid: ansi, rgb_array")
        self.render_mode = render_mode
        self.cluster = resolve(cluster, cfg.memory_cap)
        self.num_devices = d = self.cluster.num_devices
        check_config(cfg, d)
        # valid scores are >= the floor; the failing signal is strictly below it
        floor = _shape(cfg.reward, float(cfg.max_slowdown))
        if cfg.fail_reward is None:
            fail = floor - 1.0
        else:
            fail = float(cfg.fail_reward)
            floor = max(floor, fail + 1.0)
        self.score_floor = floor
        self.config = cfg = dataclasses.replace(cfg, fail_reward=fail)
        self.data_options = cfg.data_options
        self.pipeline_options = cfg.pipeline_options
        self.microbatch_options = cfg.microbatch_options

        workload_spec, self.graph = resolve_workload(workload, graph, cfg)
        estimate_costs(self.graph, self.cluster)  # fills only the device kinds it lacks
        self.groups = coarsen(self.graph, cfg.max_groups, method=cfg.grouping)
        self.num_groups = g = max(self.groups.values()) + 1
        # group of every op in placement order; groups that are not intervals of that
        # order (grouping="branch") get their pipeline stages per op (see _decode)
        self._order = placement_order(self.graph)
        self._gid_in_order = np.array([self.groups[n] for n in self._order], dtype=np.int64)
        self._interval_groups = bool(np.all(np.diff(self._gid_in_order) >= 0))
        kind = next((k for k in self.cluster.device_kinds if self.graph.has_costs(k)), None)
        self._sums = group_costs(self.graph, self.groups, kind)
        edges, _ = group_edges(self.graph, self.groups)
        max_edges = cfg.max_edges if cfg.max_edges is not None else max(4 * cfg.max_groups,
                                                                          len(edges))
        if len(edges) > max_edges:
            raise AutoplaceError(f"the group graph has {len(edges)} edges but max_edges is "
                                 f"{max_edges}; raise max_edges")
        feats = group_features(self.graph, self.groups, kind)
        self._features = np.zeros((cfg.max_groups, feats.shape[1]), dtype=np.float32)
        self._features[:g] = feats
        self._edge_index = np.zeros((2, max_edges), dtype=np.int64)
        self._edge_index[:, : len(edges)] = edges.T
        self._edge_mask = np.zeros(max_edges, dtype=np.int8)
        self._edge_mask[: len(edges)] = 1
        self._node_mask = np.zeros(cfg.max_groups, dtype=np.int8)
        self._node_mask[:g] = 1

        self.incremental = cfg.mode == "incremental"
        self.observation_space = observation_space(cfg.max_groups, max_edges, d,
                                                    incremental=self.incremental)
        #: where each choice sits in a oneshot action (autoplace.envs.levers)
        self.action_layout = ActionLayout.of(
            cfg.max_groups, d, (len(self.data_options), len(self.pipeline_options),
                                len(self.microbatch_options)), cfg.levers, cfg.priority_levels)
        if self.incremental:
            self.action_space = spaces.Discrete(d)
        else:
            self.action_space = spaces.MultiDiscrete(self.action_layout.nvec())

        self._model_info = model_info(self.graph)
        self._cluster_info = self.cluster.summary()
        self.backend: Backend = make_backend(
            cfg.backend, graph=self.graph, cluster=self.cluster, workload=workload_spec,
            cache_size=cfg.cache_size, steps=cfg.steps, warmup=cfg.warmup,
            timeout_s=cfg.timeout_s, threads=cfg.worker_threads,
            real_cache_size=cfg.real_cache_size, oom_margin=cfg.oom_margin)
        self._sim = self.backend if cfg.backend == "sim" else None
        self._single_time_s: float | None = None
        self._placement = np.zeros(g, dtype=np.int64)
        self._parallel = self._split(0, 0, 0)
        self._levers = Levers()
        self._step_in_episode = 0
        self._score: float | None = None
        self._last: dict[str, Any] | None = None
        self._spec: Any = None
        self._stages: np.ndarray | None = None

    # ---------------------------------------------------------------- gym API
    @property
    def spec(self) -> Any:
        """The EnvSpec; measured step times vary, so the real backend is nondeterministic."""
        s = getattr(self, "_spec", None)
        if s is not None and self.config.backend == "real" and not s.nondeterministic:
            s = dataclasses.replace(s, nondeterministic=True)
        return s

    @spec.setter
    def spec(self, value: Any) -> None:
        self._spec = value

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Start an episode; ``options={"placement": [...]}`` sets the initial placement."""
        super().reset(seed=seed)
        g, d = self.num_groups, self.num_devices
        if options and options.get("placement") is not None:
            p = np.asarray(options["placement"], dtype=np.int64)[:g]
            if p.shape != (g,) or p.min() < 0 or p.max() >= d:
                raise AutoplaceError(f"reset placement must be {g} devices in 0..{d - 1}")
            self._placement = p.copy()
        elif self.config.initial_placement == "random":
            self._placement = self.np_random.integers(0, d, size=g, dtype=np.int64)
        else:
            self._placement = np.zeros(g, dtype=np.int64)
        self._parallel = self._split(0, 0, 0)
        self._levers = Levers()
        self._step_in_episode = 0
        self._score = None
        self._last = None
        info = {"backend": self.backend.name, "num_groups": g, "num_devices": d,
                "plan": _plan_json(self._plan(self._placement, self._parallel))}
        return self._observation(), info

    def step(
        self, action: Any
    ) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        g = self.num_groups
        self._check_action(action)
        if self.incremental:
            if self._score is None:  # score of the initial placement, on the first step
                self._score = self._score_of(self._evaluate(self._placement, self._parallel)[0])
            focus = self._step_in_episode % g
            self._placement = self._placement.copy()
            self._placement[focus] = int(action)
            m, plan, error = self._evaluate(self._placement, self._parallel)
            score = self._score_of(m)
            reward = score - self._score
            self._score = score
            self._step_in_episode += 1
            terminated = self._step_in_episode >= self.config.passes * g
        else:
            a = np.asarray(action, dtype=np.int64)
            self._stages = None
            placement, parallel, levers, error = self._decode(a)
            self._placement, self._parallel, self._levers = placement, parallel, levers
            stages = self._stages if error is None and parallel.pipeline > 1 else None
            m, plan, error = self._evaluate(placement, parallel, error, stages, levers)
            score = reward = self._score_of(m)
            self._step_in_episode += 1
            terminated = True
        info = {
            "step_time_s": float(m.step_time_s),
            "peak_memory_bytes": [int(b) for b in m.peak_memory_bytes],
            "oom": bool(m.oom),
            "error": error,
            "backend": self.backend.name,
            "measured": bool(m.measured),
            "plan": _plan_json(plan),
            "score": float(score),
            "single_device_step_time_s": float(self.single_device_step_time_s),
            **{k: list(v) for k, v in m.extra.items() if k in _MEMORY_AFTER},
        }
        self._last = {**info, "reward": float(reward)}
        return self._observation(), float(reward), bool(terminated), False, info

    def render(self) -> str | np.ndarray | None:
        if self.render_mode == "ansi":
            ops: list[list[str]] = [[] for _ in range(self.num_groups)]
            for name in self.graph.order:
                ops[self.groups[name]].append(name)
            names = [dev.name for dev in self.cluster.devices]
            return placement_table(ops, self._placement, self._sums["fwd_time_s"],
                                   self._sums["param_bytes"], names, self._last)
        if self.render_mode == "rgb_array":
            plan = self._plan(self._placement, self._parallel, levers=self._levers)
            result = self._simulator().timeline(plan)
            title = f"{self.graph.name} on {self.cluster.name}: {plan.parallel.describe()}, " \
                    f"{result.step_time_s * 1e3:.2f} ms (simulated)"
            return gantt_rgb(result.timeline, title)
        return None

    def close(self) -> None:
        self.backend.close()
        if self._sim is not None and self._sim is not self.backend:
            self._sim.close()

    def valid_splits(self) -> list[tuple[int, int, int]]:
        """Option indices ``(data, pipeline, microbatches)`` of the hybrid splits an oneshot
        action can use: ``data * pipeline`` devices at most, and at least as many
        microbatches as stages (others always fail). ``[(0, 0, 0)]`` in incremental mode."""
        if self.incremental:
            return [(0, 0, 0)]
        out = []
        for i, data in enumerate(self.data_options):
            for j, pipe in enumerate(self.pipeline_options):
                for k, micro in enumerate(self.microbatch_options):
                    if pipe <= self.num_devices // data and (pipe == 1 or micro >= pipe):
                        out.append((i, j, k))
        return out

    # ------------------------------------------------------------ internals
    @property
    def single_device_step_time_s(self) -> float:
        """Step time of the whole graph on device 0, memory caps lifted: the reward's normaliser.

        Real backend: measured; where even the uncapped device runs out of memory, the
        simulator's estimate is used instead.
        """
        if self._single_time_s is None:
            # without memory caps: a cap constrains plans, not the reference speed
            plan = Plan.single(self.graph, cluster=self.cluster)
            m = self.backend.evaluate(plan, uncapped=True)
            if not math.isfinite(m.step_time_s) or m.step_time_s <= 0:
                m = self._simulator().evaluate(plan)  # the model does not fit one device
            self._single_time_s = float(m.step_time_s)
        return self._single_time_s

    def _simulator(self) -> Any:
        if self._sim is None:
            self._sim = make_backend("sim", graph=self.graph, cluster=self.cluster,
                                     cache_size=self.config.cache_size)
        return self._sim

    def _split(self, i_data: int, i_pipe: int, i_micro: int) -> ParallelConfig:
        return ParallelConfig(data=self.data_options[i_data],
                              pipeline=self.pipeline_options[i_pipe],
                              microbatches=self.microbatch_options[i_micro],
                              schedule=self.config.schedule)

    def _decode(self, a: np.ndarray) -> tuple[np.ndarray, ParallelConfig, Levers, str | None]:
        """Placement, split and levers of a oneshot action (see the module docstring)."""
        g = self.num_groups
        devices, (i_data, i_pipe, i_micro), levers = self.action_layout.decode(a, g)
        data = self.data_options[i_data]
        pipe = self.pipeline_options[i_pipe]
        micro = self.microbatch_options[i_micro]
        local = devices % (self.num_devices // data)
        if pipe > 1:
            local = local % pipe
            if self._interval_groups:
                local = np.maximum.accumulate(local)
            else:  # per-op running maximum in placement order; a group keeps its last stage
                stage = np.maximum.accumulate(local[self._gid_in_order])
                last = np.zeros(g, dtype=np.int64)
                np.maximum.at(last, self._gid_in_order, stage)
                local = last
        try:
            parallel = self._split(i_data, i_pipe, i_micro)
        except PlanError as e:
            fallback = ParallelConfig(data=data, pipeline=1, microbatches=micro,
                                      schedule=self.config.schedule, compile=levers.compile)
            return local, fallback, levers, str(e)
        if pipe > 1 and not self._interval_groups:
            self._stages = np.maximum.accumulate((devices % (self.num_devices // data)
                                                  % pipe)[self._gid_in_order])
        if levers.compile:
            parallel = dataclasses.replace(parallel, compile=True)
        return local, parallel, levers, None

    def _plan(self, placement: np.ndarray, parallel: ParallelConfig,
              stages: np.ndarray | None = None, levers: Levers | None = None) -> Plan:
        lv = levers or Levers()
        info = {"model": self._model_info, "cluster": self._cluster_info,
                "planner": {"name": "env", "mode": self.config.mode}}
        if stages is not None:  # pipeline over non-interval groups: one group per stage
            full, selective, _ = plan_levers(lv, [int(s) for s in stages], parallel.pipeline,
                                             [self.groups[n] for n in self._order])
            return Plan(groups={name: int(s) for name, s in zip(self._order, stages)},
                        placement=tuple(range(int(stages.max()) + 1)), parallel=parallel,
                        recompute=full, selective=selective, **info)
        full, selective, priority = plan_levers(lv, [int(x) for x in placement],
                                                parallel.pipeline)
        return Plan(groups=self.groups, placement=tuple(int(x) for x in placement),
                    parallel=parallel, recompute=full, selective=selective, priority=priority,
                    **info)

    def _evaluate(
        self, placement: np.ndarray, parallel: ParallelConfig, error: str | None = None,
        stages: np.ndarray | None = None, levers: Levers | None = None,
    ) -> tuple[Measurement, Plan, str | None]:
        plan = self._plan(placement, parallel, stages, levers)
        if error is None and (parallel.data > 1 or parallel.pipeline > 1):
            try:
                plan.validate(self.graph, self.cluster)
            except PlanError as e:
                error = f"invalid plan: {e}"
        if error is not None:
            return Measurement.failure(error, self.num_devices), plan, error
        if stages is not None:  # the plan's placement alone does not identify it
            m = self.backend.evaluate(plan, key=("stages", stages.tobytes(), parallel,
                                                 plan.recompute, plan.selective))
        else:
            m = self.backend.evaluate(plan)
        return m, plan, m.error

    def _check_action(self, action: Any) -> None:
        """Raise :class:`InvalidActionError` unless ``action`` is in the action space."""
        space = self.action_space
        if self.incremental:
            ok = not isinstance(action, (bool, np.bool_)) and space.contains(action)
            if not ok:
                raise InvalidActionError(
                    f"action {action!r} is not in the action space {space}: an integer device "
                    f"number in 0..{self.num_devices - 1}")
            return
        self.action_layout.check(action)

    def _score_of(self, m: Measurement) -> float:
        if m.failed or not math.isfinite(m.step_time_s):
            return float(self.config.fail_reward)
        r = min(m.step_time_s / self.single_device_step_time_s, float(self.config.max_slowdown))
        return max(_shape(self.config.reward, r), self.score_floor)

    def _observation(self) -> dict[str, np.ndarray]:
        mg = self.config.max_groups
        placement = np.zeros(mg, dtype=np.int64)
        placement[: self.num_groups] = self._placement
        obs = {
            "edge_index": self._edge_index.copy(),
            "edge_mask": self._edge_mask.copy(),
            "node_features": self._features.copy(),
            "node_mask": self._node_mask.copy(),
            "placement": placement,
        }
        if self.incremental:
            focus = np.zeros(mg, dtype=np.int64)
            focus[self._step_in_episode % self.num_groups] = 1
            obs["focus"] = focus
        return dict(sorted(obs.items()))


def _shape(reward: str, r: float) -> float:
    """The score of a step-time ratio ``r`` under the reward kind (module docstring)."""
    if reward == "neg_sqrt":
        return -math.sqrt(r)
    if reward == "improvement":
        return 1.0 - r
    return -r


def _plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as JSON sharing no object with the env (users keep what infos hold)."""
    d = plan.to_json()
    for key in ("model", "cluster", "planner"):
        d[key] = copy.deepcopy(d[key])
    return d
