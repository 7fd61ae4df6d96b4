"""Which modules FSDP2 shards as units of their own: the lowering's rule
(lowering.fsdp_unit_keys), applied by executor.data.wrap_data_parallel and read by the
simulator."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autoplace.capture import capture
from autoplace.errors import PlanError
from autoplace.executor.data import wrap_data_parallel
from autoplace.lowering import ROOT_UNIT, fsdp_unit_keys
from autoplace.plan import ParallelConfig
from autoplace.sim.model import fsdp_units, graph_arrays


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.down = nn.Sequential(nn.Linear(8, 8))  # a list inside a block (resnet's downsample)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x))) + self.down(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.leaves = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))  # GNMT's LSTMs
        self.head = nn.Linear(8, 16)
        self.tied = nn.Linear(8, 8)
        self.tied_too = nn.Linear(8, 8)
        self.tied_too.weight = self.tied.weight  # shared: must stay in the root group

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        for leaf in self.leaves:
            h = leaf(h)
        return self.head(self.tied_too(self.tied(h)))


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _units(shard: str, mesh, units: str = "blocks") -> dict[str, bool]:
    """Which modules are FSDP2 units' members, and (``groups``) which share one unit."""
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    graph = capture(Net(), (torch.randint(0, 16, (4, 3)),))
    program = graph.module
    keys = dict(zip(graph.order, fsdp_unit_keys(graph, units)))
    wrap_data_parallel(program, {op.target: keys[op.name] for op in graph.ops
                                 if keys[op.name] != ROOT_UNIT}, shard, mesh=mesh)
    mods = dict(program.named_modules())
    out = {name: isinstance(mods[name], FSDPModule) for name in NAMES}
    state = {n: id(mods[n]._get_fsdp_state()) for n in NAMES if out[n]}
    out["groups"] = sorted(sorted(n for n in state if state[n] == s) for s in set(state.values()))
    return out


NAMES = ("embed", "head", "tied", "tied_too", "blocks.0.fc", "blocks.0.down.0", "blocks.1.norm",
         "leaves.0", "leaves.1")
BLOCKS = {"embed": False, "head": False, "tied": False, "tied_too": False,
          "blocks.0.fc": True, "blocks.0.down.0": True, "blocks.1.norm": True,
          "leaves.0": True, "leaves.1": True,
          # a block claims the lists inside it; a list's child that is itself a called
          # module is a unit of its own
          "groups": [["blocks.0.down.0", "blocks.0.fc"], ["blocks.1.norm"], ["leaves.0"],
                     ["leaves.1"]]}


@pytest.mark.parametrize("shard", ["fsdp", "zero2"])
def test_blocks_and_root(mesh, shard):
    assert _units(shard, mesh) == BLOCKS


@pytest.mark.parametrize("shard", ["fsdp", "zero2"])
def test_modules_give_other_modules_units_of_their_own(mesh, shard):
    # shared parameters stay in the root group
    assert _units(shard, mesh, "modules") == {
        **BLOCKS, "embed": True, "head": True,
        "groups": sorted([*BLOCKS["groups"], ["embed"], ["head"]])}


@pytest.mark.parametrize("units", ["blocks", "modules"])
def test_the_simulator_reads_the_same_units(units):
    """The simulator's units are the executor's: one per unit key, the root's first."""
    graph = capture(Net(), (torch.randint(0, 16, (4, 3)),))
    ga = graph_arrays(graph)
    fu = fsdp_units(ga, [0] * ga.n, 1, units)
    keys = fsdp_unit_keys(graph, units)
    members = {}
    for i in range(ga.n):
        if fu.unit_of[i] >= 0:
            members.setdefault(fu.unit_of[i], set()).add(keys[i])
    assert all(len(k) == 1 for k in members.values())  # a unit never mixes two keys
    assert fu.root[0] and members[0] == {ROOT_UNIT} and sum(fu.root) == 1
    n_keys = len({k for i, k in enumerate(keys) if ga.param_bytes[i] > 0})
    assert len(fu.unit_bytes) == n_keys
    assert sum(fu.unit_bytes) == pytest.approx(float(ga.param_bytes.sum()))


def test_plan_field():
    par = ParallelConfig(data=2, shard="fsdp", shard_units="modules")
    assert par.to_json()["shard_units"] == "modules"
    assert ParallelConfig.from_json(par.to_json()) == par
    assert "shard_units" not in ParallelConfig(data=2, shard="fsdp").to_json()
    assert par.describe() == "dp=2/fsdp/modules"
    with pytest.raises(PlanError, match="valid: blocks, modules"):
        ParallelConfig(data=2, shard="fsdp", shard_units="layers")
    with pytest.raises(PlanError, match="only to a sharded plan"):
        ParallelConfig(data=2, shard_units="modules")


def _pieced_units(mesh, *, recompute: bool, compile_: bool, one_group: bool = False):
    """FSDP2's units over a program built in pieces (checkpointed and/or compiled
    blocks), as ``build_rank`` builds it: (unit members' types, the program's pieces)."""
    from torch.distributed.fsdp import FSDPModule

    from autoplace.cluster import preset
    from autoplace.executor.local import build_local
    from autoplace.lowering import block_groups, lower
    from autoplace.plan import Plan

    torch.manual_seed(0)
    graph = capture(Net(), (torch.randint(0, 16, (4, 3)),))
    groups = {op: 0 for op in graph.order} if one_group else block_groups(graph)
    blocks = sorted(set(groups.values()) - {groups[graph.order[0]]})
    plan = Plan.from_groups(graph, groups, [0] * (max(groups.values()) + 1),
                            recompute=set(blocks) if recompute else set(),
                            parallel=ParallelConfig(data=2, shard="fsdp", compile=compile_))
    low = lower(graph, plan, preset("h200x2"), device_type="cpu")
    prog = build_local(graph.module, plan, [torch.device("cpu")], lambda out, t: out.sum(),
                       order=list(low.order), cuts=low.piece_cuts(graph))
    wrap_data_parallel(prog, low.module_units(graph), "fsdp", mesh=mesh)
    sharded = [type(m).__name__ for m in prog.modules()
               if isinstance(m, FSDPModule) and m is not prog]
    pieces = [n for n, _ in prog.program.named_children() if n.startswith(("_piece", "_rec"))]
    return sharded, pieces


@pytest.mark.parametrize("compile_", [False, True])
def test_a_checkpointed_block_is_sharded_whole_as_torchtitan_does(mesh, compile_):
    """fully_shard(checkpoint(block)): the unit's hooks run around the checkpoint (and the
    compiled graph), not inside; before, the pieces' renamed modules matched no unit and
    the whole model was one all-gather (a 1B GPT's peak 2.4 GiB over the simulated one)."""
    sharded, pieces = _pieced_units(mesh, recompute=True, compile_=compile_)
    kind = "FSDPCompiledPiece" if compile_ else "FSDPPiece"
    assert sharded == [kind] * 4  # the two blocks and the two leaves, each checkpointed
    # recomputed: the blocks, the leaves and the head's group, whose piece holds the
    # root's (tied) parameters and stays in the root's unit
    assert sum(p.startswith("_rec") for p in pieces) == 5


def test_a_compiled_group_is_cut_at_its_units(mesh):
    """One group compiled: a piece per unit, each block's compiled graph sharded whole
    (torchtitan compiles each block); the root's ops form pieces of the root's."""
    sharded, pieces = _pieced_units(mesh, recompute=False, compile_=True, one_group=True)
    assert sharded.count("FSDPCompiledPiece") == 4, sharded  # 2 blocks, 2 leaves
    assert len(pieces) >= 5  # and the root's embedding and head on either side


def test_a_piece_holding_an_rnn_stays_in_the_root_unit(mesh):
    """GNMT's checkpointed LSTM layers, sharded whole, failed in the recomputation on
    GPUs; their pieces stay in the root's unit, uncheckpointed LSTMs units of their own."""
    from torch.distributed.fsdp import FSDPModule

    from autoplace import workloads
    from autoplace.cluster import preset
    from autoplace.executor.local import build_local
    from autoplace.executor.runner import capture_graph
    from autoplace.lowering import lower
    from autoplace.planners.manual import lever_plans
    from autoplace.planners.pipeline_dp import fsdp

    cluster = preset("h200x2")
    for checkpointed, kinds in ((False, ["FSDPLSTM"] * 4), (True, [])):
        wl = workloads.get("gnmt-2")  # a model of its own for each
        graph = capture_graph(wl)
        plan = lever_plans(graph, cluster)["fsdp+checkpoint-blocks+compile"].with_parallel(
            compile=False) if checkpointed else fsdp(graph, cluster)
        low = lower(graph, plan, cluster, device_type="cpu")
        prog = build_local(graph.module, plan, [torch.device("cpu")], wl.loss_fn,
                           order=list(low.order), cuts=low.piece_cuts(graph))
        wrap_data_parallel(prog, low.module_units(graph), "fsdp", mesh=mesh)
        assert [type(m).__name__ for m in prog.modules()
                if isinstance(m, FSDPModule) and m is not prog] == kinds


def test_ddp_keeps_the_buckets_it_made_first(mesh):
    """DDP's replica keeps the gradient buckets it made at construction: had it rebuilt them
    after the first step, the first ones would live on through the second step, a second
    copy of the gradients at that step's peak (one H200, GNMT-4: 4.68 GiB in that step,
    4.02 in the others; bench/results/2026-11-30-h200x1-ddp-bucket-memory). The gradients
    stay views of the buckets."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    ddp = wrap_data_parallel(model, {}, "none")
    opt = torch.optim.AdamW(ddp.parameters())
    for _ in range(3):
        ddp(torch.randn(4, 8)).sum().backward()
        buckets = {p.grad.untyped_storage().data_ptr() for p in ddp.parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    info = ddp._get_ddp_logging_data()
    assert info["gradient_as_bucket_view"] and not info["has_rebuilt_buckets"]
    assert len(buckets) == 1  # one 25 MB bucket holds every gradient of this small model
