"""Host time of a copy between two GPUs of one process (``Tensor.to``), forward and backward.

    python scripts/bench_copy_host.py --out bench/results/copy-host.json

The simulator charges each copy between GPUs of a one-process placement
``Device.copy_host_s`` on the host thread that issues it: the forward thread for
``Tensor.to``, the consumer device's autograd thread for the gradient's copy back
(``autoplace.sim.local.backward_issue``). This measures that cost directly: a chain of
``--links`` steps, each a multiply and, in the crossing chain, a copy to the other GPU,
built forward and run backward with nothing waiting for the GPUs inside the timed
calls; the per-copy cost is the crossing chain's host time minus the same-device
chain's, divided by the number of copies. Per tensor size, the median over ``--repeats``
chains (the devices are synchronised between chains, outside the timing).

Without 2 GPUs it runs on the CPU with both ends on the CPU (the copies are no-ops, so
the figure is ~0): a smoke run of the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch


def _sync(devs: list[torch.device]) -> None:
    for d in devs:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def chain_host_s(devs: list[torch.device], links: int, numel: int, cross: bool
                 ) -> tuple[float, float]:
    """Host seconds to build one chain forward and to run its backward."""
    x = torch.randn(numel, device=devs[0], requires_grad=True)
    _sync(devs)
    t0 = time.perf_counter()
    y = x
    for i in range(links):
        y = y * 1.0001
        if cross:
            y = y.to(devs[(i + 1) % 2], non_blocking=True)
    loss = y.sum()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    _sync(devs)
    return t1 - t0, t2 - t1


def measure(devs: list[torch.device], sizes: list[int], links: int, repeats: int
            ) -> list[dict]:
    rows = []
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        for _ in range(3):  # warm-up: allocator, autograd, streams
            chain_host_s(devs, links, numel, True)
            chain_host_s(devs, links, numel, False)
        fx, bx, fs, bs = [], [], [], []
        for _ in range(repeats):  # interleaved
            f, b = chain_host_s(devs, links, numel, True)
            fx.append(f)
            bx.append(b)
            f, b = chain_host_s(devs, links, numel, False)
            fs.append(f)
            bs.append(b)
        med = statistics.median
        rows.append({
            "bytes": nbytes,
            "forward_host_s_per_copy": (med(fx) - med(fs)) / links,
            "backward_host_s_per_copy": (med(bx) - med(bs)) / links,
            "forward_chain_s": {"crossing": med(fx), "same_device": med(fs)},
            "backward_chain_s": {"crossing": med(bx), "same_device": med(bs)},
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--links", type=int, default=50, help="copies per chain")
    ap.add_argument("--repeats", type=int, default=20, help="chains per size and kind")
    ap.add_argument("--sizes", default="65536,1048576,16777216",
                    help="comma-separated tensor sizes in bytes")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x]
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) <= 0 or args.links <= 0 or args.repeats <= 0:
        ap.error("--sizes, --links and --repeats must be positive")
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    devs = ([torch.device("cuda:0"), torch.device("cuda:1")] if gpu
            else [torch.device("cpu"), torch.device("cpu")])
    card = torch.cuda.get_device_name(0) if gpu else "cpu"
    rows = measure(devs, sizes, args.links, args.repeats)
    for r in rows:
        print(f"{card}: {r['bytes'] / 2**20:8.3f} MiB  forward {r['forward_host_s_per_copy'] * 1e6:7.1f} us"
              f"  backward {r['backward_host_s_per_copy'] * 1e6:7.1f} us per copy")
    result = {"benchmark": "copy-host", "card": card, "torch_version": torch.__version__,
              "date": datetime.date.today().isoformat(), "devices": [str(d) for d in devs],
              "links": args.links, "repeats": args.repeats, "sizes": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
