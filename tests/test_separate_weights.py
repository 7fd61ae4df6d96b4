"""Recurrent modules on separate weight tensors, as FSDP2 / ZeRO-2 gather them: the
profile's variant of the module (:func:`autoplace.profile.separate_weights`), the record
(``separate_weights_extra_s``) and the simulator, which charges it to sharded plans only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from autoplace import profile as pr
from autoplace.cluster import preset
from autoplace.graph import OpGraph, OpNode
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate


def test_separate_weights_copy_has_a_storage_per_weight_and_computes_the_same():
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16, num_layers=2)
    sep = pr.separate_weights(lstm)
    ptrs = {w.untyped_storage().data_ptr() for w in sep._flat_weights}
    assert len(ptrs) == len(sep._flat_weights) == len(sep._flat_weights_names)
    assert all(a is getattr(sep, n) for a, n in zip(sep._flat_weights, sep._flat_weights_names))
    assert not sep._weights_have_changed()  # its forward will not re-flatten them
    x = torch.randn(5, 3, 8)
    torch.testing.assert_close(sep(x)[0], lstm(x)[0])
    for a, b in zip(sep.parameters(), lstm.parameters()):  # copies, not the module's own
        assert a.data_ptr() != b.data_ptr()


def test_extra_of_separate_weights_times_forward_and_backward():
    """Against a flat reference of zeros the extra is the separate variant's own times:
    every one of the four measured (backward included), none negative."""
    lstm = nn.LSTM(8, 16)
    x = torch.randn(5, 3, 8, requires_grad=True)
    extra = pr._separate_weights_extra(lstm, (x,), {}, [x], (0.0, 0.0, 0.0, 0.0),
                                       torch.device("cpu"), 2)
    assert len(extra) == 4 and all(e > 0 for e in extra)
    # never below zero: a flat reference slower than the copy gives 0
    slow = pr._separate_weights_extra(lstm, (x,), {}, [x], (1.0, 1.0, 1.0, 1.0),
                                      torch.device("cpu"), 2)
    assert slow == [0.0, 0.0, 0.0, 0.0]


def test_cpu_profile_records_no_extra_and_a_record_with_one_applies_it(tmp_path):
    from autoplace import workloads
    from autoplace.capture import capture_workload

    wl = workloads.get("rnnlm")
    g = capture_workload(wl)
    rec = pr._measure(g, wl.example_inputs(g.batch_size, "cpu"), torch.device("cpu"), 2,
                      True, None)
    assert "separate_weights_extra_s" not in rec  # cuDNN's compaction: GPUs only
    rnn = [op.name for op in g if op.kind in ("LSTM", "GRU", "RNN")]
    assert rnn
    rec["separate_weights_extra_s"] = {rnn[0]: [1e-3, 2e-3, 3e-3, 4e-3]}
    pr._apply(g, "h200", rec)
    extra = g.separate_weights_extras("h200")
    i = g.order.index(rnn[0])
    assert extra[i].tolist() == [1e-3, 2e-3, 3e-3, 4e-3]
    assert np.count_nonzero(extra) == 4
    back = OpGraph.from_json(g.to_json())  # kept in the graph's JSON
    assert back.separate_weights_extras("h200")[i].tolist() == [1e-3, 2e-3, 3e-3, 4e-3]
    pr._apply(g, "h200", {k: v for k, v in rec.items() if k != "separate_weights_extra_s"})
    assert not g.separate_weights_extras("h200").any()  # a newer record without: none


def lstm_chain(n: int, extra: list[float] | None) -> OpGraph:
    nbytes = 2**20
    nodes = []
    for i in range(n):
        op = OpNode(name=f"op{i}", kind="LSTM", module_path=f"layers.{i}", output_bytes=nbytes,
                    param_bytes=nbytes, param_names=(f"layers.{i}.weight_ih_l0",),
                    activation_bytes=nbytes, fwd_time_s={"h200": 1e-3},
                    bwd_time_s={"h200": 2e-3}, fwd_host_s={"h200": 1e-4},
                    bwd_host_s={"h200": 1e-4})
        if extra is not None:
            op.separate_weights_extra_s["h200"] = list(extra)
        nodes.append(op)
    return OpGraph("lstms", nodes, [(f"op{i}", f"op{i + 1}", nbytes) for i in range(n - 1)])


@pytest.mark.parametrize("extra", [[1e-3, 1e-3, 0.0, 0.0], [0.0, 0.0, 2e-3, 3e-3]])
def test_only_sharded_plans_pay_the_extra(extra):
    """Device extras lengthen the ops, host extras the issue of them (here more than the
    device time: the step becomes host-bound); DDP and one-process placements run the
    module's own flat weights and pay nothing."""
    cl = preset("h200x2")
    plain, paying = lstm_chain(6, None), lstm_chain(6, extra)
    n = len(plain)

    def plans(g):
        one = {op.name: 0 for op in g}
        return {
            "ddp": Plan.from_assignment(g, one, parallel=ParallelConfig(data=2)),
            "fsdp": Plan.from_assignment(g, one, parallel=ParallelConfig(data=2, shard="fsdp")),
            "zero2": Plan.from_assignment(g, one,
                                          parallel=ParallelConfig(data=2, shard="zero2")),
            "split": Plan.from_assignment(g, {op.name: int(i >= n // 2)
                                              for i, op in enumerate(g)}),
        }

    a = {k: simulate(plain, p, cl).step_time_s for k, p in plans(plain).items()}
    b = {k: simulate(paying, p, cl).step_time_s for k, p in plans(paying).items()}
    assert b["ddp"] == pytest.approx(a["ddp"]) and b["split"] == pytest.approx(a["split"])
    for k in ("fsdp", "zero2"):
        if extra[0]:  # every op longer on the device's critical chain
            assert b[k] - a[k] == pytest.approx(n * (extra[0] + extra[1]), rel=1e-6), k
        else:  # the host issues forward, then backward: the step at least their sum
            assert b[k] > a[k] and b[k] >= n * (1e-4 + extra[2] + 1e-4 + extra[3]), k


needs_gpu = [pytest.mark.gpu,
             pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@needs_gpu[0]
@needs_gpu[1]
def test_cudnn_compacts_the_separate_copy_at_every_call():
    """The stand-in is what it stands for: cuDNN warns that its weights "need to be
    compacted at every call", and not for the module's own flat weights."""
    import warnings

    lstm = nn.LSTM(32, 64).cuda()
    sep = pr.separate_weights(lstm)
    x = torch.randn(7, 4, 32, device="cuda")
    for mod, expect in ((lstm, False), (sep, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mod(x)[0].sum().backward()
            torch.cuda.synchronize()
        assert any("contiguous chunk" in str(w.message) for w in caught) is expect


@needs_gpu[0]
@needs_gpu[1]
def test_gpu_profile_records_what_separate_weights_add_to_recurrent_modules():
    from autoplace import workloads
    from autoplace.capture import capture_workload

    wl = workloads.get("rnnlm")
    g = capture_workload(wl)
    rec = pr._measure(g, wl.example_inputs(g.batch_size, "cpu"), torch.device("cuda:0"), 3,
                      True, None)
    rnn = {op.name for op in g if op.kind in ("LSTM", "GRU", "RNN")}
    assert rnn and set(rec["separate_weights_extra_s"]) == rnn
    for extra in rec["separate_weights_extra_s"].values():
        assert len(extra) == 4 and min(extra) >= 0.0
        assert extra[2] > 0.0  # copying the weights at every forward costs host time
