"""What GNMT-4 holds on a GPU between steps under FSDP2, beyond its parameters and AdamW state.

On 2x H200 GNMT-4's FSDP2, ZeRO-2 and FSDP2-by-modules plans all held 1.335 GiB before a
step where the shards and AdamW state are 0.984 (run memory-record); a gloo run on CPU
holds exactly the shards and the state, so the rest is GPU-side (cuDNN's LSTMs are the
suspect). One process, one GPU, NCCL: the model on the GPU (its LSTMs flattened), every
LSTM and the root sharded with ``fully_shard``, three AdamW steps; prints the allocated
memory after each stage and the largest live CUDA storages between steps.

    python scripts/bench/lstm_fsdp_memory.py [--autocast]

``--autocast`` runs each step's forward and loss under bf16 autocast, as the executor does.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os

import torch
import torch.distributed as dist
from bench_memory_record import GNMT
from torch.distributed.fsdp import fully_shard

from autoplace import workloads

GIB = 2**30


def allocated_gib() -> float:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / GIB


def live_storages() -> list[tuple[float, tuple, str]]:
    """(MiB, shape, type) of every live CUDA storage, largest first."""
    seen: dict[int, tuple[float, tuple, str]] = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                t = o._local_tensor if hasattr(o, "_local_tensor") else o
                st = t.untyped_storage()
                seen[st.data_ptr()] = (st.nbytes() / 2**20, tuple(o.shape), type(o).__name__)
        except (RuntimeError, AttributeError):  # a storage that cannot be read
            continue
    return sorted(seen.values(), key=lambda v: -v[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--autocast", action="store_true", help="bf16 autocast, as the executor")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    wl = workloads.get("gnmt-4", **{**GNMT, "batch_size": 64})  # one of two replicas' share
    model = wl.model
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    lstms = [x for x in model.modules() if isinstance(x, torch.nn.LSTM)]
    lstm = sum(p.numel() * p.element_size() for x in lstms for p in x.parameters()) / GIB
    model.cuda()
    print(f"parameters {params:.3f} GiB (LSTMs {lstm:.3f}); on the GPU: "
          f"{allocated_gib():.3f} GiB allocated", flush=True)
    for x in lstms:
        fully_shard(x)
    fully_shard(model)
    print(f"after fully_shard: {allocated_gib():.3f}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(3):
        xs, y = wl.make_batch(wl.batch_size, "cuda")
        region = (torch.autocast("cuda", dtype=torch.bfloat16) if args.autocast
                  else contextlib.nullcontext())
        with region:
            loss = wl.loss_fn(model(*xs), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"between steps {step} and {step + 1}: {allocated_gib():.3f} GiB allocated "
              f"(parameters + AdamW state: {3 * params:.3f})", flush=True)
    # What each LSTM's cached weight list (``_flat_weights``, which its forward hands to
    # cuDNN) points at, beside the parameters FSDP2 registered on it.
    held = 0
    for x in lstms:
        for name, w in zip(x._flat_weights_names, x._flat_weights):
            p = getattr(x, name)
            if w is not None and w is not p:
                held += w.untyped_storage().nbytes()
    print(f"LSTM weight lists pointing at other tensors than the registered parameters: "
          f"{held / GIB:.3f} GiB of storage (a flat buffer counted once per weight)")
    for x in lstms:
        x._flat_weights = [getattr(x, n) for n in x._flat_weights_names]
    print(f"after refreshing the lists: {allocated_gib():.3f} GiB allocated", flush=True)
    live = live_storages()
    print(f"live CUDA storages: {len(live)}, {sum(v[0] for v in live) / 1024:.3f} GiB")
    for v in live[:12]:
        mib, shape, kind = v
        print(f"  {mib:.1f} MiB {shape} {kind}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
