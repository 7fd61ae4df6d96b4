"""Which modules FSDP2 shards as units of their own (executor.data.wrap_data_parallel)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autoplace.executor.data import fsdp_units_rule, wrap_data_parallel


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 16)
        self.tied = nn.Linear(8, 8)
        self.tied_too = nn.Linear(8, 8)
        self.tied_too.weight = self.tied.weight  # shared: must stay in the root group

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.tied_too(self.tied(h)))


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _units(shard: str, mesh) -> dict[str, bool]:
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    model = Net()
    program = fx.symbolic_trace(model)
    wrap_data_parallel(program, model, shard, mesh=mesh)
    return {name: isinstance(mod, FSDPModule) for name, mod in program.named_modules()
            if name in ("embed", "head", "tied", "tied_too", "blocks.0.fc", "blocks.1.norm")}


def test_fsdp_gives_other_modules_units_of_their_own(mesh):
    assert _units("fsdp", mesh) == {"embed": True, "head": True, "tied": False,
                                    "tied_too": False, "blocks.0.fc": True,
                                    "blocks.1.norm": True}


def test_zero2_keeps_blocks_and_root(mesh, monkeypatch):
    assert _units("zero2", mesh) == {"embed": False, "head": False, "tied": False,
                                     "tied_too": False, "blocks.0.fc": True,
                                     "blocks.1.norm": True}
    monkeypatch.setenv("AUTOPLACE_FSDP_UNITS", "modules")
    assert _units("zero2", mesh)["head"] is True


def test_units_rule_from_the_environment(monkeypatch):
    assert fsdp_units_rule("fsdp") == "modules" and fsdp_units_rule("zero2") == "blocks"
    monkeypatch.setenv("AUTOPLACE_FSDP_UNITS", "blocks")
    assert fsdp_units_rule("fsdp") == "blocks"
    monkeypatch.setenv("AUTOPLACE_FSDP_UNITS", "layers")
    with pytest.raises(ValueError, match="valid: blocks, modules"):
        fsdp_units_rule("fsdp")


def test_bench_fsdp_units_runs_both_rules(tmp_path):
    """scripts/bench_fsdp_units.py on CPU: both rules run and train alike."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "units.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_fsdp_units.py"
    subprocess.run([sys.executable, str(script), "--out", str(out), "--scenarios", "tiny",
                    "--rounds", "1", "--steps", "3", "--plans", "fsdp"], check=True,
                   capture_output=True, timeout=300)
    rows = json.loads(out.read_text())
    assert [(r["plan"], r["units"]) for r in rows] == [("fsdp", "blocks"), ("fsdp", "modules")]
    assert all(r["error"] is None and len(r["step_times_s"]) == 1 for r in rows)
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5)
