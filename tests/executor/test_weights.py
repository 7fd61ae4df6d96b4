"""Initial weights shared through a file (``autoplace.executor.weights``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.errors import AutoplaceError
from autoplace.executor import run_plan
from autoplace.executor.runner import capture_graph
from autoplace.executor.weights import load_workload, save_weights
from autoplace.plan import ParallelConfig, Plan


@pytest.mark.parametrize("name", ["gpt-tiny", "gnmt-2", "branchy-mlp"])
def test_loaded_weights_equal_a_normal_build(tmp_path, name):
    spec = {"spec": name, "options": {}, "seed": 5}
    wl = workloads.get(name, seed=5)
    path = save_weights(wl.model, tmp_path / "w.pt")
    got = load_workload(spec, path)
    a, b = wl.model.state_dict(), got.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # non-persistent buffers too (gpt's positions)
    assert all(torch.equal(x, y) for (_, x), (_, y) in
               zip(wl.model.named_buffers(), got.model.named_buffers()))
    assert not any(t.is_meta for t in got.model.parameters())
    # the copy-on-write mapping is writable and leaves the file as it was
    with torch.no_grad():
        next(got.model.parameters()).add_(1.0)
    again = load_workload(spec, path)
    assert torch.equal(next(again.model.parameters()), next(wl.model.parameters()))


def test_tied_parameters_stay_tied(tmp_path, monkeypatch):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

    wl = workloads.get("gpt-tiny")
    monkeypatch.setattr(wl, "model", Tied())
    path = save_weights(wl.model, tmp_path / "w.pt")

    import autoplace.executor.weights as w

    with torch.device("meta"):
        meta = Tied()
    monkeypatch.setattr(workloads, "get", lambda *a, **k: type("W", (), {"model": meta})())
    got = w.load_workload({"spec": "x"}, path)
    assert got.model.a.weight is got.model.b.weight
    assert torch.equal(got.model.a.weight, wl.model.a.weight)


def test_bad_files_are_refused(tmp_path):
    spec = {"spec": "gpt-tiny", "options": {}}
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(AutoplaceError, match="cannot read weights file"):
        load_workload(spec, junk)
    other = tmp_path / "other.pt"
    torch.save({"x": torch.zeros(1)}, other)
    with pytest.raises(AutoplaceError, match="not an autoplace weights file"):
        load_workload(spec, other)
    mlp = save_weights(workloads.get("branchy-mlp").model, tmp_path / "mlp.pt")
    with pytest.raises(AutoplaceError, match="does not match gpt-tiny"):
        load_workload(spec, mlp)


def test_multi_process_run_from_a_weights_file_trains_the_same(tmp_path):
    """Two gloo ranks reading the weights file reach the reference's losses, and without
    a reference (each rank trains the model it loaded, uncopied) the same losses again."""
    wl = workloads.get("gpt-tiny")
    graph = capture_graph(wl)
    n = len(graph.order)
    plan = Plan.from_groups(graph, {op: min(1, 2 * i // n) for i, op in enumerate(graph.order)},
                            [0, 1], parallel=ParallelConfig(pipeline=2, microbatches=2))
    path = save_weights(wl.model, tmp_path / "w.pt")
    r = run_plan(plan, wl, cluster=preset("cpu-x2"), steps=3, warmup=1,
                 weights_file=str(path))
    assert r.ok, r.error
    assert r.max_loss_rel_diff < 1e-4, (r.loss, r.reference_loss)
    assert r.extra["init_s"] >= 0 and r.extra["build_s"] > 0
    again = run_plan(plan, wl, cluster=preset("cpu-x2"), steps=3, warmup=1,
                     weights_file=str(path), reference=False)
    assert again.ok, again.error
    assert again.loss == pytest.approx(r.loss, rel=1e-6)
