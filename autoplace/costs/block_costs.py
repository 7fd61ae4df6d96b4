"""Checkpointing's host cost per checkpoint call and per op, from a block profiled on the
card (:mod:`autoplace.executor.profile_block`).

A checkpointed region costs the host something per call (``torch.utils.checkpoint``'s
frame: its saved-tensor hooks, the recompute's autograd node, under a selective policy
entering its dispatch mode) and something per op inside (each op's forward issued again;
under the selective policy each op passing the dispatch mode, forward and recompute).
The block profile times the first block alone (``n1`` ops, one call) and the first
``blocks`` blocks in turn (``chain_ops`` ops, ``blocks`` calls), each checkpointed and
not; the two differences are two equations in the two unknowns::

    c + n1 * p              = D1   (one block)
    blocks * c + chain_ops * p = Dm   (the blocks in turn)

Where the blocks all have the first block's size the two equations are one (the chain
is ``blocks`` copies), and the cost is priced per op, as added per block. A model of
blocks of 1-6 ops (a U-Net's convolution stages, pools and upsampling layers) on one
H200: one 6-op block 1.50 ms more checkpointed, the first eight blocks (23 ops) 7.77 ms
more, so 0.49 ms a call and 0.17 ms an op, where priced per op alone a 1-op block cost a
sixth of a 6-op one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHECKPOINT_FORMS", "checkpoint_costs"]

#: a checkpointed form of a profiled block, and the form it is measured against
CHECKPOINT_FORMS = {"full": "eager", "selective": "eager", "compiled_full": "compiled"}


def checkpoint_costs(recompute: dict[str, Any], compiled: dict[str, Any] | None,
                     chain_ops: int | None) -> dict[str, float]:
    """``{form}_host_s`` (per op) and ``{form}_call_host_s`` (per checkpoint call) for each
    form of :data:`CHECKPOINT_FORMS` the record ``recompute`` measured (``compiled``: the
    profile's compiled part, which holds the compiled block's own time), from the one
    block's and the chained blocks' times; ``chain_ops``: the ops of the chained blocks
    (None: unknown, priced per op as added per block). Costs are >= 0."""
    n1 = int(recompute.get("block_ops") or 0)
    blocks = int(recompute.get("blocks") or 1)
    single = {"eager": recompute.get("eager_s"),
              "compiled": (compiled or {}).get("compiled_s")}
    for form in CHECKPOINT_FORMS:
        single[form] = recompute.get(f"{form}_s")
    out: dict[str, float] = {}
    for form, base in CHECKPOINT_FORMS.items():
        if n1 <= 0 or single[form] is None or single[base] is None:
            continue
        d1 = float(single[form]) - float(single[base])
        chained = (recompute.get(f"{form}_blocks_s"), recompute.get(f"{base}_blocks_s"))
        if blocks < 2 or None in chained or not chain_ops or chain_ops <= n1:
            out[f"{form}_host_s"], out[f"{form}_call_host_s"] = max(0.0, d1) / n1, 0.0
            continue
        dm = float(chained[0]) - float(chained[1])
        per_op = (dm - d1) / (chain_ops - n1)  # what each op added past the first block
        det = chain_ops - blocks * n1
        if abs(det) < n1 / 2:  # the blocks are copies of the first: one equation
            p, c = per_op, 0.0
        else:
            p = (dm - blocks * d1) / det
            c = d1 - n1 * p
            if p < 0:  # all of it per call
                p, c = 0.0, (dm - d1) / (blocks - 1)
            elif c < 0:  # all of it per op
                p, c = per_op, 0.0
        out[f"{form}_host_s"], out[f"{form}_call_host_s"] = max(0.0, p), max(0.0, c)
    return out
