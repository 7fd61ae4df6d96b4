"""The pre-trained GNN shipped with the package: its weights and card, zero-shot placement,
the memory-pressure features, a short fine-tune, and ``autoplace plan --planner pretrained``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from autoplace import planners, workloads
from autoplace.capture import capture_workload
from autoplace.cluster import resolve
from autoplace.errors import AutoplaceError
from autoplace.plan import Plan
from autoplace.policies import GNNPolicy
from autoplace.policies.pretrained import (
    CARD_PATH,
    DEVICE_COUNTS,
    EXTRA_FEATURES,
    WEIGHTS_PATH,
    card,
    finetune_pretrained,
    load_pretrained,
    make_env,
    place_pretrained,
)
from autoplace.sim import simulate
from tests.helpers.cli_process import run_cli


@pytest.fixture(scope="module")
def graph():
    return capture_workload(workloads.get("gpt-tiny", device="meta"))


def test_shipped_weights_load_with_weights_only():
    assert WEIGHTS_PATH.stat().st_size < 2 * 2**20
    state = torch.load(WEIGHTS_PATH, map_location="cpu", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert {k.split(".")[0] for k in state} == {f"devices{d}" for d in DEVICE_COUNTS}
    info = card()
    assert info["held_out_families"] and not set(info["held_out_families"]) & set(
        info["data"]["families"])
    for d in DEVICE_COUNTS:
        policy = load_pretrained(d)
        assert isinstance(policy, GNNPolicy) and policy.num_devices == d and not policy.training
        own = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(f"devices{d}.")}
        assert torch.equal(policy.state_dict()["head.2.weight"], own["head.2.weight"])
        assert info["results"][f"devices{d}"]["updates"] > 0
    assert "train_pretrained.py" in info["command"] and CARD_PATH.is_file()


def test_other_device_counts_are_refused_with_the_valid_ones():
    with pytest.raises(AutoplaceError, match=r"places on 2, 4, 8 devices, not 3"):
        load_pretrained(3)


def test_zero_shot_is_valid_and_under_a_second(graph):
    cluster = resolve("h100x2")
    place_pretrained(graph, cluster)  # first call pays for imports and caches
    plan = place_pretrained(graph, cluster, seed=1)
    assert plan.planner["name"] == "pretrained" and not plan.planner["failed"]
    assert plan.planner["search_time_s"] < 1.0 and plan.planner["scored"] >= 1
    plan.validate(graph, cluster)
    res = simulate(graph, plan, cluster)
    assert not res.oom and res.step_time_s == pytest.approx(plan.predicted["step_time_s"])
    # the time left after the fixed plans goes to more of the policy's samples: a longer
    # limit scores more plans, and the greedy plans alone are far fewer
    short = place_pretrained(graph, cluster, seed=1, time_limit_s=0.0)
    greedy = place_pretrained(graph, cluster, seed=1, samples=0)
    assert greedy.planner["scored"] < short.planner["scored"] < plan.planner["scored"]
    assert plan.predicted["step_time_s"] <= short.predicted["step_time_s"]


def test_memory_pressure_features_follow_the_cap(graph):
    free = make_env(graph, "h100x2")
    cluster = free.unwrapped.cluster
    peak = max(simulate(graph, Plan.single(graph, cluster=cluster), cluster).peak_memory_bytes)
    capped = make_env(graph, "h100x2", memory_cap=int(peak / 3))
    f = len(EXTRA_FEATURES)
    for env, fits in ((free, 1.0), (capped, 0.0)):
        obs, _ = env.reset(seed=0)
        assert env.observation_space.contains(obs)
        real = obs["node_mask"].astype(bool)
        extra = obs["node_features"][:, -f:]
        assert np.all(extra[real, 1] == fits) and np.all(extra[~real] == 0)
    assert capped.memory_ratio == pytest.approx(3.0, rel=0.01) and free.memory_ratio < 1
    obs_c, _ = capped.reset(seed=0)
    assert obs_c["node_features"][0, -2] == pytest.approx(2.0, rel=0.01)  # log2(1 + 3)


def test_finetune_is_never_slower_than_zero_shot(graph):
    res = finetune_pretrained(graph, "h100x4", budget="3", seed=0, batch_size=4)
    assert res.step_time_s <= res.zero_shot_step_time_s
    assert res.plan.planner["name"] == "pretrained+finetune"
    assert res.plan.planner["source"].split(" + ")[0] in ("zero-shot", "warm-start", "finetune")
    assert len(res.history["best_step_time_s"]) == 3 and res.warm_start["done"]


def test_zero_shot_tries_sharding_a_data_parallel_plan():
    """gpt-small on two CPUs: the best plan is data parallel with ZeRO-2 (the hybrid DP's);
    the env cannot express a shard mode, so the zero-shot search adds it."""
    graph = capture_workload(workloads.get("gpt-small", device="meta"))
    cluster = resolve("cpu-x2")
    plan = place_pretrained(graph, cluster)
    hybrid = simulate(graph, planners.get("hybrid-dp")(graph, cluster), cluster)
    assert hybrid.step_time_s < simulate(graph, planners.get("ddp")(graph, cluster),
                                         cluster).step_time_s
    assert plan.parallel.shard != "none"
    assert plan.predicted["step_time_s"] <= hybrid.step_time_s * 1.0001


def test_cli_planner_pretrained(tmp_path):
    out = tmp_path / "plan.json"
    p = run_cli("plan", "--model", "gpt-tiny", "--cluster", "h100x4", "--planner", "pretrained",
                "-o", str(out), timeout=300)
    assert p.returncode == 0, p.stderr
    plan = json.loads(out.read_text())
    assert plan["planner"]["name"] == "pretrained" and plan["predicted"]["step_time_s"] > 0
    listed = run_cli("plan", "--list", timeout=300)
    assert "pretrained" in listed.stdout.split()
    bad = run_cli("plan", "--model", "gpt-tiny", "--cluster", "h100x1", "--planner",
                  "pretrained", "-o", str(tmp_path / "x.json"), timeout=300)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "not 1" in bad.stderr and not (tmp_path / "x.json").exists()


def test_on_gpus_the_zero_shot_and_finetuned_plans_are_also_tried_compiled(graph, monkeypatch):
    """The shipped policy has no compile lever: on GPUs the search compiles its best plans
    on the simulator (faster there for gpt-tiny once its pieces' calls are free), on CPUs
    it never does."""
    from autoplace.sim import compiled

    monkeypatch.setattr(compiled, "COMPILED_CALL_HOST_S", 0.0)
    plan = place_pretrained(graph, "h100x4")
    eager = simulate(graph, plan.with_parallel(compile=False), resolve("h100x4"))
    assert plan.parallel.compile and plan.predicted["step_time_s"] < eager.step_time_s
    tuned = finetune_pretrained(graph, "h100x4", budget="2", seed=0, batch_size=4)
    assert tuned.plan.parallel.compile
    assert tuned.step_time_s <= plan.predicted["step_time_s"]
    assert not place_pretrained(graph, "cpu-x2").parallel.compile
