"""The env's lever choices: per-group issue priority and recompute, plan-wide compile."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from autoplace.cluster import resolve
from autoplace.envs import InvalidActionError, PlacementEnv
from autoplace.envs.levers import ActionLayout, Levers, compile_pays
from autoplace.errors import AutoplaceError
from autoplace.plan import Plan
from autoplace.sim import simulate

ALL = ("priority", "recompute", "compile")


def _env(memory_cap=None) -> PlacementEnv:
    return PlacementEnv(workload="gpt-tiny", cluster="cpu-x2", max_groups=8, levers=ALL,
                        pipeline_options=(1, 2), microbatch_options=(1, 2),
                        memory_cap=memory_cap)


@pytest.fixture(scope="module")
def tiny_env():
    """gpt-tiny, every lever, a pipeline option; capped halfway between the one-device
    plan's simulated peak without recompute and with every group recomputed (3.13 and
    2.63 MB with the current memory model), so that only recompute fits one device."""
    free = _env()
    layout, g, peaks = free.action_layout, free.num_groups, []
    for choice in (0, 1):
        free.reset(seed=0)
        *_, info = free.step(layout.encode([0] * g, levers=Levers(recompute=(choice,) * g)))
        peaks.append(max(info["peak_memory_bytes"]))
    free.close()
    assert peaks[1] < 0.95 * peaks[0]  # recompute frees memory on this model
    env = _env(memory_cap=(peaks[0] + peaks[1]) // 2)
    yield env
    env.close()


def test_default_action_space_is_unchanged(graph):
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8)
    assert env.action_space.nvec.tolist() == [2] * 8 + [1, 1, 1]
    assert env.action_layout.policy_sizes() == {"priority_levels": 0, "recompute_choices": 0}


def test_lever_layout_and_env_checker(graph):
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8, levers=ALL,
                       priority_levels=3, data_options=(1, 2))
    assert env.action_space.nvec.tolist() == [2] * 8 + [3] * 8 + [3] * 8 + [2, 1, 1] + [2]
    assert list(env.action_layout.slices) == ["device", "priority", "recompute", "split",
                                              "compile"]
    check_env(env, skip_render_check=True)
    only = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8, levers=("recompute",))
    assert only.action_space.nvec.tolist() == [2] * 8 + [3] * 8 + [1, 1, 1]
    check_env(only, skip_render_check=True)


def test_recompute_is_priced_under_a_memory_cap(tiny_env):
    env, layout, g = tiny_env, tiny_env.action_layout, tiny_env.num_groups
    outcomes = {}
    for choice in (0, 1):
        env.reset(seed=0)
        _, r, term, trunc, info = env.step(layout.encode([0] * g, levers=Levers(
            recompute=(choice,) * g)))
        assert term and trunc is False
        outcomes[choice] = (r, info)
    assert outcomes[0][1]["oom"] and outcomes[0][0] == env.config.fail_reward
    r, info = outcomes[1]
    assert not info["oom"] and r > env.score_floor
    assert info["plan"]["recompute"] == list(range(g))
    # the reward is the simulator's step time of the plan the info shows
    plan = Plan.from_json(info["plan"])
    assert info["step_time_s"] == pytest.approx(simulate(env.graph, plan, env.cluster).step_time_s)
    assert info["step_time_s"] > env.single_device_step_time_s  # recompute costs time


def test_priority_selective_and_compile_reach_the_plan(tiny_env):
    env, layout, g = tiny_env, tiny_env.action_layout, tiny_env.num_groups
    prio = tuple(int(x) for x in np.arange(g)[::-1] % 4)
    recompute = tuple([2, 1] * g)[:g]
    env.reset(seed=0)
    _, _, _, _, info = env.step(layout.encode([0, 1] * (g // 2) + [0] * (g % 2), levers=Levers(
        priority=prio, recompute=recompute, compile=True)))
    plan = Plan.from_json(info["plan"])
    assert plan.priority == prio
    assert plan.selective == {i for i in range(g) if recompute[i] == 2}
    assert plan.recompute == {i for i in range(g) if recompute[i] == 1}
    assert plan.parallel.compile
    assert info["step_time_s"] == pytest.approx(simulate(env.graph, plan, env.cluster).step_time_s)


def test_priorities_are_told_apart_by_the_cache(tiny_env):
    """Two plans equal but for their priorities are simulated each, not served from the
    cache: a placement where some priority changes the step time."""
    env, layout, g = tiny_env, tiny_env.action_layout, tiny_env.num_groups
    devices = [i % 2 for i in range(g)]
    times = set()
    rng = np.random.default_rng(0)
    for _ in range(12):
        env.reset(seed=0)
        prio = tuple(int(x) for x in rng.integers(0, 4, g))
        _, _, _, _, info = env.step(layout.encode(devices, (0, 0, 1), Levers(
            priority=prio, recompute=(1,) * g)))
        assert info["plan"]["priority"] == list(prio)
        times.add(round(info["step_time_s"], 12))
    assert len(times) > 1


def test_a_pipeline_recomputes_whole_stages_and_drops_priorities(tiny_env):
    env, layout, g = tiny_env, tiny_env.action_layout, tiny_env.num_groups
    devices = [0] * (g // 2) + [1] * (g - g // 2)
    recompute = (1,) * (g // 2 - 1) + (0,) + (2,) * (g - g // 2)  # stage 0 mostly full
    env.reset(seed=0)
    _, _, _, _, info = env.step(layout.encode(devices, (0, 1, 1), Levers(
        priority=(3,) * g, recompute=recompute)))
    assert info["error"] is None or "memory" in info["error"]
    plan = Plan.from_json(info["plan"])
    assert plan.parallel.pipeline == 2 and plan.priority == ()
    assert plan.recompute == set(range(g // 2)) and plan.selective == set(range(g // 2, g))


def test_actions_and_options_out_of_range_are_named(tiny_env, graph):
    layout, g = tiny_env.action_layout, tiny_env.action_layout.max_groups
    tiny_env.reset(seed=0)
    bad = layout.encode([0] * tiny_env.num_groups)
    bad[g] = 4  # the first priority entry
    with pytest.raises(InvalidActionError, match=r"action\[8\] = 4 .* a priority level in 0..3"):
        tiny_env.step(bad)
    with pytest.raises(InvalidActionError, match="a recompute choice per group"):
        tiny_env.step(bad[:-1])
    with pytest.raises(AutoplaceError, match="unknown lever.*valid: priority, recompute, compile"):
        PlacementEnv(graph=graph, cluster="cpu-x2", levers=("checkpoint",))
    with pytest.raises(AutoplaceError, match="mode='oneshot'"):
        PlacementEnv(graph=graph, cluster="cpu-x2", mode="incremental", levers=("priority",))
    with pytest.raises(AutoplaceError, match="priority_levels must be an integer >= 2"):
        PlacementEnv(graph=graph, cluster="cpu-x2", levers=("priority",), priority_levels=1)


def test_layout_round_trip():
    layout = ActionLayout.of(5, 3, (2, 1, 4), ALL, priority_levels=4)
    lv = Levers(priority=(3, 0, 1), recompute=(2, 0, 1), compile=True)
    a = layout.encode([2, 1, 0], (1, 0, 3), lv)
    layout.check(a)
    devices, split, back = layout.decode(a, 3)
    assert devices.tolist() == [2, 1, 0] and split == (1, 0, 3) and back == lv


def test_compile_is_offered_on_gpus_only():
    assert compile_pays(resolve("h100x4")) and compile_pays(resolve("a100x2"))
    assert not compile_pays(resolve("cpu-x2"))
    assert not compile_pays(object())  # nothing described: not offered
