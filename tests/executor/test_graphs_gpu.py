"""CUDA graphs on one GPU: the capture's memory.

Run through the device tool: ``pytest -m gpu tests/executor/test_graphs_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_capture_holds_no_more_than_a_step():
    """A one-piece graphed program whose parameters outweigh its activations: the step that
    captures peaks no higher than the steps that replay (``make_graphed_callables``' own
    warm-up would keep a parameter gradient's worth alive through both captures), and the
    losses are eager's."""
    from autoplace.executor.graphs import GRAPH_WARMUP
    from autoplace.executor.local import _Graphed, build_local
    from autoplace.executor.runner import capture_graph
    from autoplace.lowering import issue_order
    from autoplace.plan import ParallelConfig, Plan
    from autoplace.workloads import Workload

    dev = torch.device("cuda", 0)

    def workload() -> Workload:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(2048, 2048), nn.ReLU())],
                              nn.Linear(2048, 10))
        return Workload(name="wide-mlp", model=model.to(dev),
                        make_batch=lambda bs, device: ((torch.randn(bs, 2048, device=device),),
                                                       torch.randint(0, 10, (bs,), device=device)),
                        loss_fn=nn.functional.cross_entropy, batch_size=8, lr=1e-3)

    losses = {}
    for graphed in (False, True):
        wl = workload()
        g = capture_graph(wl)
        plan = Plan.single(g, parallel=ParallelConfig(graphs=graphed))
        prog = build_local(g.module, plan, [dev], wl.loss_fn, order=issue_order(g, plan),
                           graphs=graphed)
        opt = torch.optim.AdamW(prog.parameters(), lr=wl.lr)
        param_bytes = sum(p.numel() * p.element_size() for p in prog.parameters())
        peaks, out = [], []
        for step in range(GRAPH_WARMUP + 3):
            torch.manual_seed(step)
            x, y = wl.make_batch(wl.batch_size, dev)
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            loss = prog(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(dev)
            peaks.append(torch.cuda.max_memory_allocated(dev))
            out.append(float(loss))
        losses[graphed] = out
        if graphed:
            pieces = [m for m in prog.program.children() if isinstance(m, _Graphed)]
            assert pieces and all(p.failed is None and p._replay is not None for p in pieces)
            capture, replays = peaks[GRAPH_WARMUP], peaks[GRAPH_WARMUP + 1:]
            assert capture <= max(replays) + 0.25 * param_bytes, (capture, replays, param_bytes)
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]),
                               rtol=1e-4, atol=1e-5)
