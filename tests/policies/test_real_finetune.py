"""A simulator-trained policy continued on measured step times (CPU devices, gpt-tiny)."""

from __future__ import annotations

import json
import math

import pytest

from autoplace.errors import AutoplaceError
from autoplace.plan import Plan

pytest.importorskip("autoplace.executor")
pytest.importorskip("autoplace.zoo.gpt")

from autoplace.envs import PlacementEnv  # noqa: E402
from autoplace.envs.backends import RealBackend  # noqa: E402
from autoplace.policies import train  # noqa: E402
from autoplace.policies.finetune import carry, rescale_score  # noqa: E402

#: real runs of gpt-tiny on two CPU devices: two steps (one timed), one thread
REAL = {"steps": 2, "warmup": 1, "worker_threads": 1, "workload_options": {"batch_size": 4}}
SMALL = dict(policy="gnn", max_groups=4, progress=False, batch_size=4,
             policy_options={"hidden": 16})


def _scalars(tb) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"]}


def test_sim_then_real_switches_corrects_and_keeps_the_measured_best(tmp_path):
    res = train("gpt-tiny", "cpu-x2", backend="sim,real", budget="6up", real_share=0.34,
                out_dir=tmp_path, real_batch_size=2, env_options=REAL, **SMALL)
    # 4 updates on the simulator, then 2 on measured step times with the same policy
    assert res.history["stage"] == [0.0] * 4 + [1.0] * 2
    assert res.history["episodes"] == [4.0, 8.0, 12.0, 16.0, 18.0, 20.0]
    stages = json.loads((tmp_path / "finetune.json").read_text())
    assert stages["faster"] == res.stages["faster"] in ("sim", "real")
    switch = stages["switch"]
    one = switch["single_device"]
    assert one["measured_step_time_s"] > 0 and one["ratio"] == pytest.approx(
        one["measured_step_time_s"] / one["simulated_step_time_s"])
    measured = [p for p in switch["plans"] if p["measured_step_time_s"] is not None]
    assert switch["plans"][0]["source"] == "simulator stage's best" and measured
    for p in measured:  # ratio and reward factor as defined, per split
        assert p["ratio"] == pytest.approx(p["measured_step_time_s"] / p["simulated_step_time_s"])
        assert p["reward_factor"] == pytest.approx(p["ratio"] / one["ratio"])
        assert p["split"] in switch["ratios"]
    assert set(switch["baseline_factors"]) and all(f > 0 for f in
                                                   switch["baseline_factors"].values())
    tb = _scalars(tmp_path / "tb")
    assert tb["switch/single_device_ratio"] == pytest.approx(one["ratio"], rel=1e-5)
    assert any(tag.startswith("switch/ratio/") for tag in tb)

    # the result is the measured best of both stages, and says which stage found it
    sim_s, real_s = stages["sim"]["measured_step_time_s"], stages["real"]["measured_step_time_s"]
    plan = Plan.load(tmp_path / "best_plan.json")
    assert plan.measured["step_time_s"] == res.best_step_time_s
    assert res.best_step_time_s <= min(x for x in (sim_s, real_s) if x is not None)
    assert res.best_step_time_s == min(p["measured_step_time_s"] for p in measured) \
        or res.best_step_time_s == real_s
    if stages["faster"] == "real":
        assert real_s < sim_s
    else:
        assert real_s is None or real_s >= sim_s
    sim_plan = Plan.load(tmp_path / "sim" / "best_plan.json")  # the simulator stage's own
    assert sim_plan.predicted["step_time_s"] == stages["sim"]["simulated_step_time_s"]
    assert stages["real"]["plans_measured"] >= 1 and stages["real"]["episodes"] == 4

    # resumed with a larger budget: the real stage goes on, the switch is not measured again
    more = train("gpt-tiny", "cpu-x2", backend="sim,real", budget="9up", real_share=0.34,
                 out_dir=tmp_path, real_batch_size=2, env_options=REAL, resume=True, **SMALL)
    assert more.history["stage"] == [0.0] * 4 + [1.0] * 3
    assert more.history["reward_mean"][:6] == res.history["reward_mean"]
    assert more.stages["switch"] == switch and more.best_step_time_s <= res.best_step_time_s


def _env(**kw) -> PlacementEnv:
    return PlacementEnv(workload="gpt-tiny", cluster="cpu-x2", backend="sim", max_groups=4,
                        **kw)


def test_carry_rescales_baselines_per_split_and_takes_the_fastest_measured_plan():
    env = _env(data_options=(1, 2), microbatch_options=(1, 2))
    try:
        t1 = env.single_device_step_time_s
        plan = Plan.single(env.graph).to_json()
        record = {"reward_factor": 2.0, "plans": [
            {"source": "simulator stage's best", "reward_factor": 4.0, "parallel": {
                "data": 2, "pipeline": 1, "microbatches": 1}, "measured_step_time_s": 3 * t1,
             "simulated_step_time_s": t1, "json": plan},
            {"source": "sampled", "reward_factor": 0.25, "parallel": {
                "data": 1, "pipeline": 1, "microbatches": 2}, "measured_step_time_s": 2 * t1,
             "simulated_step_time_s": 1.5 * t1, "json": plan}]}
        state = {"baselines": {"g": [-1.0, -2.0], "g#split0-0-1": [-1.0],
                               "g#split1-0-0": [-1.0], "g#split1-0-1": [-1.0],
                               "g#split0-0-0": [env.config.fail_reward]},
                 "best": {"g": {"plan": "{}"}}, "policy_state": {}}
        out = carry(state, record, env, "g", {"name": "gnn"})
        assert record["baseline_factors"] == {"g": 4.0, "g#split0-0-1": 0.25,
                                              "g#split1-0-0": 4.0, "g#split1-0-1": 2.0,
                                              "g#split0-0-0": 2.0}
        # neg_sqrt: a score -sqrt(r) becomes -sqrt(k r); failed scores keep their value
        assert out["baselines"]["g"] == pytest.approx([-2.0, -4.0])
        assert out["baselines"]["g#split0-0-1"] == pytest.approx([-0.5])
        assert out["baselines"]["g#split0-0-0"] == [env.config.fail_reward]
        best = out["best"]["g"]
        assert best["step_time_s"] == 2 * t1 and best["reward"] == pytest.approx(-math.sqrt(2))
        carried = Plan.loads(best["plan"])
        assert carried.measured["step_time_s"] == 2 * t1
        assert carried.predicted["step_time_s"] == 1.5 * t1
        assert state["baselines"]["g"] == [-1.0, -2.0], "the input state is left as it was"
        assert rescale_score(-3.0, 1e6, env) == env.score_floor  # clipped at the floor
    finally:
        env.close()


def test_real_backend_reuses_measurements_and_skips_predicted_oom():
    env = _env()
    try:
        graph, cluster = env.graph, env.cluster
        plan = Plan.single(graph)
        spec = {"spec": "gpt-tiny", "options": {"batch_size": 4}, "seed": 0}
        capped = RealBackend(spec, cluster.with_memory_cap(2**20), steps=2, warmup=1,
                             threads=1, graph=graph, oom_margin=1.25, cache_size=8)
        m = capped.evaluate(plan)
        assert m.oom and m.extra["skipped"] and "not run" in m.error
        assert capped.worker_pid is None and capped.counts["skipped"] == 1
        capped.close()
        real = RealBackend(spec, cluster, steps=2, warmup=1, threads=1, graph=graph,
                           oom_margin=1.25, cache_size=8)
        try:
            first = real.evaluate(plan)
            again = real.evaluate(plan)
            assert first.measured and again.measured and "cached" not in first.extra
            assert again.extra["cached"] and again.step_time_s == first.step_time_s
            assert real.counts == {"measured": 1, "cached": 1, "skipped": 0}
            bad = real.evaluate(plan.with_parallel(microbatches=8))
            assert bad.failed and "not run" in bad.error and real.counts["skipped"] == 1
        finally:
            real.close()
        with pytest.raises(AutoplaceError, match="oom_margin must be"):
            RealBackend(spec, cluster, graph=graph, oom_margin=0.5)
    finally:
        env.close()


def test_init_continues_a_sim_checkpoint_on_real_and_refuses_a_mismatch(tmp_path):
    sim_dir = tmp_path / "sim-only"
    train("gpt-tiny", "cpu-x2", budget="2up", out_dir=sim_dir, env_options=REAL, **SMALL)
    init = sim_dir / "checkpoint.pt"
    res = train("gpt-tiny", "cpu-x2", backend="real", budget="1up", init=init,
                out_dir=tmp_path / "real", real_batch_size=2, max_groups=4, progress=False,
                batch_size=4, real_top_plans=2)
    assert res.stages["switch"]["plans"][0]["source"] == "simulator stage's best"
    assert res.best_plan.measured["step_time_s"] == res.best_step_time_s < math.inf
    assert res.warm_start["done"] is False and len(res.history["reward_mean"]) == 1

    with pytest.raises(AutoplaceError, match="trained on cluster 'cpu-x2'"):
        train("gpt-tiny", "cpu-x1", budget="1up", init=init, progress=False)
    with pytest.raises(AutoplaceError, match=r"trained with levers \[\]"):
        train("gpt-tiny", "cpu-x2", budget="1up", init=init, progress=False,
              env_options={"levers": ("recompute",)})
    with pytest.raises(AutoplaceError, match="was trained on graph"):
        train("branchy-mlp", "cpu-x2", budget="1up", init=init, progress=False)
    with pytest.raises(AutoplaceError, match="holds a 'gnn' policy, not 'seq2seq'"):
        train("gpt-tiny", "cpu-x2", policy="seq2seq", budget="1up", init=init, progress=False)
    with pytest.raises(AutoplaceError, match="real_share must be"):
        train("gpt-tiny", "cpu-x2", backend="sim,real", real_share=1.0, progress=False)
