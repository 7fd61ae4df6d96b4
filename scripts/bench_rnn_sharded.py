"""What an LSTM call costs on the weights FSDP2 and ZeRO-2 hand it, on one GPU or several.

    python scripts/bench_rnn_sharded.py --out rnn-sharded.json

Why: FSDP2 on GNMT-4 measures 1.3-1.5x what the simulator predicts, and a trace showed
the step host-bound in its LSTM calls. One guess was that FSDP2's gathered parameters,
separate tensors, leave cuDNN to copy an LSTM's weights into one flat buffer at every call
(as one-process placements did before ``executor.local.reflatten_rnns``). This script
measures one LSTM at GNMT-4's size (hidden 1024, 50 steps, a data-parallel replica's 64
sequences), forward and backward (device time from CUDA events, host time to issue the
calls), as

* ``flat``: the module's own weights, one flat buffer (DDP, one-process placements),
* ``separate``: a copy whose weights are a storage each (the guess),
* ``fsdp2`` / ``zero2``: under ``fully_shard`` on a one-rank NCCL group, resharded after
  forward (FSDP) or not (ZeRO-2): FSDP2's gathers and hooks included,

and records whether cuDNN warned that the weights "need to be compacted at every call".
Writes JSON (``--out``) and prints a table. Alone it runs one rank on GPU 0; under
``torchrun --nproc-per-node N`` every rank runs the same and FSDP2 shards over the N GPUs
(rank 0 reports). On 2x H200 (session 26,
``bench/results/raw/2026-11-28-h200-s26-rnn-sharded.json``) FSDP2 was not compacted: the
guess was wrong, and FSDP2's own per-unit work is what it adds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn


def separate_weights(module: nn.RNNBase) -> nn.RNNBase:
    """A copy of recurrent ``module`` whose weights are a storage each, not views of the one
    flat buffer ``flatten_parameters`` makes (cuDNN then copies them at every call)."""
    sep = copy.deepcopy(module)
    for name in sep._flat_weights_names:
        w = getattr(sep, name, None)
        if isinstance(w, torch.Tensor):
            # RNNBase.__setattr__ keeps _flat_weights pointing at what is set here
            setattr(sep, name, nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad))
    # its forward re-flattens weights it sees changed: mark these as seen
    sep._flat_weight_refs = [weakref.ref(w) if w is not None else None
                             for w in sep._flat_weights]
    return sep


def timed(step, dev: torch.device, iters: int, rounds: int) -> dict[str, float]:
    """Fastest round's device ms and median host ms per call of ``step`` (which returns
    the issue seconds of its forward and backward)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize(dev)
    dev_ms, host_f, host_b = [], [], []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        a.record()
        hf = hb = 0.0
        for _ in range(iters):
            f, bw = step()
            hf, hb = hf + f, hb + bw
        b.record()
        b.synchronize()
        dev_ms.append(a.elapsed_time(b) / iters)
        host_f.append(hf / iters * 1e3)
        host_b.append(hb / iters * 1e3)
    return {"step_ms": min(dev_ms), "fwd_host_ms": statistics.median(host_f),
            "bwd_host_ms": statistics.median(host_b)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50, help="sequence length")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if "RANK" in os.environ:  # under torchrun: one rank per GPU, FSDP2 over all of them
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        rank, world, dev = 0, 1, torch.device("cuda:0")
        torch.cuda.set_device(dev)
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = dist.device_mesh.init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    x = torch.randn(args.steps, args.batch, args.hidden, device=dev, requires_grad=True)
    base = nn.LSTM(args.hidden, args.hidden).to(dev)

    def variants():
        yield "flat", base
        yield "separate", separate_weights(base)
        for name, reshard in (("fsdp2", True), ("zero2", False)):
            holder = nn.Sequential(separate_weights(base)).to(dev)  # fresh weights' copy
            fully_shard(holder[0], mesh=mesh, reshard_after_forward=reshard)
            fully_shard(holder, mesh=mesh, reshard_after_forward=reshard)
            yield name, holder

    rows = {}
    for name, mod in variants():
        def step(mod=mod):
            t0 = time.perf_counter()
            out = mod(x)
            y = out[0] if isinstance(out, tuple) else out
            t1 = time.perf_counter()
            y.sum().backward()
            t2 = time.perf_counter()
            return t1 - t0, t2 - t1

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.synchronize(dev)
        compacted = any("contiguous chunk" in str(w.message) for w in caught)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows[name] = {**timed(step, dev, args.iters, args.rounds), "compacted": compacted}
        r = rows[name]
        if rank == 0:
            print(f"{name:9s} step {r['step_ms']:7.3f} ms  host fwd {r['fwd_host_ms']:6.3f} "
                  f"bwd {r['bwd_host_ms']:6.3f} ms  compacted at every call: {compacted}",
                  flush=True)
    dist.destroy_process_group()
    result = {"card": torch.cuda.get_device_name(dev), "torch_version": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "world_size": world, "hidden": args.hidden,
              "seq": args.steps, "batch": args.batch, "rows": rows}
    if args.out and rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
