"""A plan over several nodes: two torchrun agents on this machine act as two nodes of one
CPU each, meeting at a c10d rendezvous over loopback (gloo)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autoplace.cluster import Cluster, preset
from autoplace.errors import AutoplaceError
from autoplace.executor.lifetime import pid_alive
from autoplace.executor.nodes import NodeLaunch, node_layout
from autoplace.plan import ParallelConfig, Plan
from tests.reliability._run import ROOT, cli

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="parent-death signals are Linux's")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> set[int]:
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> dict[str, Path]:
    """Two nodes of one CPU each, and gpt-tiny plans for them: dp=2 and pp=2."""
    d = tmp_path_factory.mktemp("nodes")
    cluster = d / "cluster.json"
    Cluster.multi_node("cpu-x1-n2", preset("cpu-x1").devices[0], 1, 2, alpha_s=50e-6,
                       bandwidth=5e9).save(cluster)
    out = {"cluster": cluster}
    for name, planner in (("ddp", "ddp"), ("pp", "pipeline")):
        path = d / f"{name}.json"
        p = cli("plan", "--model", "gpt-tiny", "--cluster", str(cluster), "--planner", planner,
                "-o", str(path))
        assert p.returncode == 0, p.stderr
        out[name] = path
    return out


class _Node:
    """One node's ``autoplace run`` as a subprocess, its output collected as it comes."""

    def __init__(self, plan: Path, cluster: Path, rank: int, port: int, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autoplace.cli", "run", str(plan), "--cluster", str(cluster),
             "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _run_two(plan: Path, cluster: Path, *args: str, timeout: float = 150) -> list[_Node]:
    port = _free_port()
    nodes = [_Node(plan, cluster, 0, port, *args)]
    time.sleep(0.5)  # node 0 first: its agent serves the rendezvous
    nodes.append(_Node(plan, cluster, 1, port, *args))
    try:
        for n in nodes:
            n.wait(timeout)
    finally:
        for n in nodes:
            n.stop()
    return nodes


@pytest.mark.parametrize("kind", ["ddp", "pp"])
def test_two_nodes_train_as_the_unpartitioned_model(two_nodes, tmp_path, kind):
    reports = [tmp_path / f"report{i}.json" for i in range(2)]
    port = _free_port()
    nodes = [_Node(two_nodes[kind], two_nodes["cluster"], i, port, "--steps", "4",
                   "--report", str(reports[i])) for i in range(2)]
    try:
        rcs = [n.wait(150) for n in nodes]
    finally:
        for n in nodes:
            n.stop()
    assert rcs == [0, 0], [n.text[-3000:] for n in nodes]
    written = [json.loads(r.read_text()) for r in reports if r.exists()]
    assert len(written) == 1, "global rank 0's node writes the one report"
    report = written[0]
    assert len(report["loss"]) == 4 and len(report["reference_loss"]) == 4
    assert report["loss"] == pytest.approx(report["reference_loss"], rel=1e-5)
    others = [n for n, r in zip(nodes, reports) if not r.exists()]
    assert "global rank 0 ran on another node" in others[0].text


def test_a_killed_agent_ends_the_run_on_every_node_and_it_resumes(two_nodes, tmp_path):
    ckpt = tmp_path / "ckpt"
    port = _free_port()
    args = ("--steps", "60", "--checkpoint-dir", str(ckpt))
    nodes = [_Node(two_nodes["ddp"], two_nodes["cluster"], 0, port, *args)]
    time.sleep(0.5)
    nodes.append(_Node(two_nodes["ddp"], two_nodes["cluster"], 1, port, *args))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
                "step 3:" in n.text for n in nodes):
            time.sleep(0.1)
        assert any("step 3:" in n.text for n in nodes), [n.text[-2000:] for n in nodes]
        spawned = _descendants(nodes[0].proc.pid) | _descendants(nodes[1].proc.pid)
        agent = [p for p in _descendants(nodes[1].proc.pid)
                 if "torch.distributed.run" in _cmdline(p)]
        assert len(agent) == 1, [_cmdline(p) for p in spawned]
        os.kill(agent[0], signal.SIGKILL)
        t0 = time.monotonic()
        rcs = [n.wait(60) for n in nodes]
        took = time.monotonic() - t0
    finally:
        for n in nodes:
            n.stop()
    assert all(rc != 0 for rc in rcs), rcs
    assert took < 60
    errors = [line for n in nodes for line in n.lines if line.startswith("autoplace: error:")]
    assert any("the run over 2 nodes failed on node" in e for e in errors), \
        [n.text[-2000:] for n in nodes]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(pid_alive(p) for p in spawned):
        time.sleep(0.2)
    assert not [p for p in spawned if pid_alive(p)], "processes outlived the run"
    done = int((ckpt / "latest").read_text().split("-")[1])
    assert 3 <= done < 60

    report = tmp_path / "resumed.json"
    resumed = _run_two(two_nodes["ddp"], two_nodes["cluster"], "--steps", str(done + 3),
                       "--checkpoint-dir", str(ckpt), "--resume", "--report", str(report))
    assert [n.proc.returncode for n in resumed] == [0, 0], [n.text[-3000:] for n in resumed]
    r = json.loads(report.read_text())
    assert r["extra"]["start_step"] == done and len(r["loss"]) == 3
    # the resumed steps train as the unpartitioned model does at those steps
    assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5)


def test_node_counts_that_disagree_are_refused_before_any_work(two_nodes):
    plan = Plan.load(two_nodes["ddp"])
    cluster = Cluster.load(two_nodes["cluster"])
    assert node_layout(plan, cluster) == (2, 1)
    with pytest.raises(AutoplaceError, match=r"--nnodes 3 asks for more nodes .* valid: 1..2"):
        node_layout(plan, cluster, 3)
    with pytest.raises(AutoplaceError, match=r"fills 2 nodes, not --nnodes 1"):
        node_layout(plan, cluster, 1)
    # three processes cannot split over the nodes of a 2 x 2 cluster
    wide = Cluster.multi_node("w", preset("cpu-x1").devices[0], 2, 2, alpha_s=1e-5,
                              bandwidth=1e9)
    three = Plan(groups=plan.groups, placement=plan.placement,
                 parallel=ParallelConfig(data=3))
    with pytest.raises(AutoplaceError, match="3 processes do not split evenly over 2 nodes"):
        node_layout(three, wide)
    with pytest.raises(AutoplaceError, match=r"--node-rank 2 is not a node .*\(valid: 0..1\)"):
        NodeLaunch(nnodes=2, node_rank=2, nproc_per_node=1, rdzv_endpoint="h:1", rdzv_id="x")
    with pytest.raises(AutoplaceError, match="must be HOST:PORT"):
        NodeLaunch(nnodes=2, node_rank=0, nproc_per_node=1, rdzv_endpoint="h", rdzv_id="x")


def test_the_command_prints_each_nodes_command(two_nodes):
    p = cli("run", str(two_nodes["pp"]), "--cluster", str(two_nodes["cluster"]), "--steps", "5",
            "--rdzv-endpoint", "head:29400")
    assert p.returncode == 0, p.stderr
    for n in (0, 1):
        assert (f"node {n}: autoplace run {two_nodes['pp']} --cluster {two_nodes['cluster']} "
                f"--steps 5 --nnodes 2 --node-rank {n} --rdzv-endpoint head:29400") in p.stdout
    assert ("torchrun --nnodes 2 --node-rank N --nproc-per-node 1 --rdzv-backend c10d "
            "--rdzv-endpoint head:29400 --rdzv-id autoplace-") in p.stdout
    p = cli("run", str(two_nodes["pp"]), "--cluster", str(two_nodes["cluster"]),
            "--node-rank", "0")
    assert p.returncode == 2 and "--node-rank needs --rdzv-endpoint" in p.stderr
