"""The candidates of the ``auto`` search (:mod:`autoplace.search.auto`): every plan worth
measuring, simulated.

A *row* is one simulated plan as :func:`autoplace.search.compare.compare` lists it
(``planner``, ``plan``, ``sim_step_time_s``, ``oom``, ``error``, ``peak_memory_bytes``); a
*candidate* is a row the search may measure (``planner``, ``plan``, ``sim``, ``family``,
``sim_peak``), to which the search adds what it learns (``tried``, ``measured``, ...).

The rows are every baseline planner's plan, the best of every hybrid family, the plans
given (a policy's, the pre-trained GNN's), the hand-written options, the per-block recipes
and, on GPUs, their compiled and CUDA-graphed twins. The candidates are the distinct rows
that fit, fastest simulated first. While measuring, the search derives more from a
measured one: its microbatch variants, its twin with an FSDP2 unit per module, and, for a
compiled one near the memory cap, its eager twin to measure first.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from autoplace.errors import AutoplaceError, PlanError
from autoplace.plan import Plan
from autoplace.planners.manual import hand_written, lever_plans
from autoplace.planners.pipeline_dp import hybrid_candidates, hybrid_family
from autoplace.policies import train
from autoplace.search.compare import compare
from autoplace.search.families import family, signature
from autoplace.sim import simulate

__all__ = [
    "TIGHT_MEMORY",
    "candidate",
    "compiled_rows",
    "compile_work",
    "compiled_twin",
    "eager_first",
    "feasible_candidates",
    "graphed_rows",
    "hybrid_rows",
    "least_compile",
    "microbatch_variants",
    "sim_row",
    "simulated_rows",
    "units_twin",
]

#: a plan simulated over a device's usable memory by at most this factor is a candidate
#: while its family's memory was not measured: the simulated peaks of measured plans were
#: 0.7-1.3x the measured ones (2x H200, docs/simulator.md); an out-of-memory run costs a few
#: seconds and is remembered. On 2x H200 under gpt-1b's 16 GiB cap ZeRO-2 simulated
#: 16.2 GiB and measured 14.5 GiB (FSDP2: 14.7 and 13.1 GiB).
TIGHT_MEMORY = 1.10
#: a compiled plan's eager twin stands for its memory (``eager_first``) while simulated to
#: hold at most this much more: the simulator's peak is deterministic, so twins of one
#: layout simulate equal unless compiling changes what is kept (1%: rounding)
TWIN_PEAK_SLACK = 1.01


def sim_row(graph: Any, cluster: Any, name: str, plan: Plan) -> dict[str, Any]:
    """A candidate row like :func:`autoplace.search.compare.compare`'s for a plan made elsewhere."""
    r = simulate(graph, plan, cluster)
    return {"planner": name, "plan": plan, "sim_step_time_s": r.step_time_s, "oom": r.oom,
            "error": None, "peak_memory_bytes": r.peak_memory_bytes}


def candidate(row: dict[str, Any]) -> dict[str, Any]:
    """A search candidate from a simulated row (:func:`sim_row`, or compare's)."""
    return {"planner": row["planner"], "plan": row["plan"], "sim": row["sim_step_time_s"],
            "family": family(row["plan"]), "sim_peak": max(row.get("peak_memory_bytes") or [0.0])}


def simulated_rows(graph: Any, cluster: Any, *, planners: list[str] | None,
                   policy: str | None, budget_s: float, extra_plans: dict[str, Plan] | None,
                   progress: bool, say: Callable[[str], None],
                   ) -> tuple[list[dict[str, Any]], list[tuple[str, tuple]]]:
    """Every plan the search considers, simulated, and the hand-written options among them
    as ``(name, signature)``.

    ``planners`` are the baseline planners (None: all); ``policy``, when given, is trained
    briefly on the simulator (a fifth of ``budget_s``, 10 s at least) and its plan added;
    ``extra_plans`` are plans made elsewhere, by name. A hand-written option the model
    cannot take is said with ``say`` and left out.
    """
    rows = compare(graph, cluster, planners, progress=progress)
    rows += hybrid_rows(graph, cluster)
    extra_plans = dict(extra_plans or {})
    if policy is not None:
        res = train(graph, cluster, policy=policy, backend="sim",
                    budget=f"{max(10.0, 0.2 * budget_s):.0f}s", out_dir=None, progress=progress)
        extra_plans[f"policy:{policy}"] = res.best_plan
    rows += [sim_row(graph, cluster, name, p) for name, p in extra_plans.items()]
    manual: list[tuple[str, tuple]] = []  # the hand-written options: (name, signature)
    try:
        for name, p in hand_written(graph, cluster, levers=False).items():
            rows.append(sim_row(graph, cluster, name, p))
            manual.append((name, signature(p)))
    except AutoplaceError as e:  # e.g. a pipeline the model's batch cannot feed
        say(f"hand-written options: {e}")
    # the per-block recipes (checkpointing, compile) compete as candidates: a compiled one
    # is a family of its own (measured once at least), a checkpointed one is measured where
    # the simulator ranks it (first where nothing else fits)
    rows += [sim_row(graph, cluster, name, p)
             for name, p in lever_plans(graph, cluster).items()]
    rows += compiled_rows(graph, cluster, rows)  # before the graphed twins: not both
    rows += graphed_rows(graph, cluster, rows)
    return rows, manual


def hybrid_rows(graph: Any, cluster: Any) -> list[dict[str, Any]]:
    """The best simulated plan of every ``hybrid-dp`` family (data degree, replica kind,
    stages, shard, schedule) as extra candidates: the search itself returns only its
    single best, and a family the simulator misjudges may hold the measured winner."""
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        cands = hybrid_candidates(graph, cluster)
    except AutoplaceError:
        return rows
    for plan, _step_s, oom in cands:
        fam = hybrid_family(plan)
        if oom or fam in seen:
            continue
        seen.add(fam)
        rows.append(sim_row(graph, cluster, f"hybrid-dp[{fam}]", plan))
    return rows


def _twin_rows(graph: Any, cluster: Any, rows: list[dict[str, Any]], lever: str,
               eligible: Callable[[dict[str, Any], Plan], bool]) -> list[dict[str, Any]]:
    """On GPUs, every eligible plan among ``rows`` again with ``parallel.<lever>`` on (where
    ``ParallelConfig`` allows it), simulated, named ``<planner>+<lever>``."""
    if not all(d.name.startswith("cuda") for d in cluster.devices):
        return []
    out = []
    for r in rows:
        plan = r.get("plan")
        if plan is None or not eligible(r, plan):
            continue
        try:
            twin = plan.with_parallel(**{lever: True})
        except PlanError:
            continue
        out.append(sim_row(graph, cluster, f"{r['planner']}+{lever}", twin))
    return out


def graphed_rows(graph: Any, cluster: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On GPUs, every one-process plan among ``rows`` again with ``parallel.graphs`` (each
    run of ops on one device replayed as a CUDA graph): eager, a host thread issuing every
    op of Inception-v3 limits it; graphed, its two halves measured 36-40 ms against
    44-66 ms eagerly on 2x H200 (docs/executor.md, CUDA graphs). ``ParallelConfig`` says
    which plans run in one process."""
    return _twin_rows(graph, cluster, rows, "graphs", lambda r, plan: not (
        r.get("oom") or plan.recompute or plan.selective or plan.parallel.graphs))


def compiled_rows(graph: Any, cluster: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On GPUs, every plan among ``rows`` again with its pieces compiled
    (``parallel.compile``): the split and the levers chosen together, priced by the
    simulator's compiled costs (:mod:`autoplace.sim.compiled`). Not offloaded plans:
    gpt-1b offloaded and recomputed measured 1825 ms compiled against 650 eager on one
    H200 (docs/simulator.md, offload)."""
    return _twin_rows(graph, cluster, rows, "compile", lambda r, plan: not (
        plan.parallel.compile or plan.parallel.graphs or plan.parallel.offload))


def feasible_candidates(rows: list[dict[str, Any]], usable: float) -> list[dict[str, Any]]:
    """The distinct plans among ``rows`` that fit ``usable`` bytes per device, or exceed it
    by at most :data:`TIGHT_MEMORY`, as candidates, fastest simulated first. Offloaded
    plans (the host's memory, the update on the CPU) only where nothing else fits."""

    def roughly_fits(r: dict[str, Any]) -> bool:
        return not r.get("oom") or max(r.get("peak_memory_bytes") or [0.0]) \
            <= TIGHT_MEMORY * usable

    if any(roughly_fits(r) for r in rows if r.get("plan") is not None
           and not r["plan"].parallel.offload):
        rows = [r for r in rows if r.get("plan") is None or not r["plan"].parallel.offload]

    cands: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for r in sorted((r for r in rows if r.get("plan") is not None and roughly_fits(r)),
                    key=lambda r: r["sim_step_time_s"]):
        sig = signature(r["plan"])
        if sig not in seen:
            seen.add(sig)
            cands.append(candidate(r))
    return cands


def microbatch_variants(c: dict[str, Any], graph: Any, cluster: Any) -> list[dict[str, Any]]:
    """Candidates that differ from ``c`` only by twice or half its microbatch count.

    Only for plans whose microbatches flow through several devices (a one-process
    placement with microbatches, or a pipeline): on one device microbatches only
    accumulate gradients, and a placement without them is no guess about their count.
    The simulator decides this count least reliably (it hinges on host time per op, which
    varies between machines): on one 2x H200 machine under a 16 GiB cap gpt-1b's two
    halves measured 84.7 ms with 4 microbatches against 88.8 ms with 2, on another 129
    against 94 (docs/executor.md).
    """
    plan = c["plan"]
    par = plan.parallel
    if plan.devices_per_replica < 2 or (par.microbatches == 1 and par.pipeline == 1):
        return []
    name = re.sub(r" mb=\d+$", "", c["planner"])
    out = []
    for m in (2 * par.microbatches, par.microbatches // 2):
        if m < 1 or (graph.batch_size and graph.batch_size % (par.data * m)):
            continue
        try:  # simulate validates the plan against the graph and the cluster
            row = sim_row(graph, cluster, f"{name} mb={m}", plan.with_parallel(microbatches=m))
        except AutoplaceError:  # a pipeline needs at least as many microbatches as stages
            continue
        if not row["oom"]:
            out.append(candidate(row))
    return out


def compiled_twin(c: dict[str, Any], by_sig: dict[tuple, dict[str, Any]]
                  ) -> dict[str, Any] | None:
    """``c``'s fastest simulated compiled twin among the candidates (``by_sig``: by plan
    signature): the same ops on the same devices, the same split and the same ops
    recomputed, compiled in whichever pieces (a plan's groups as they are, or the model's
    blocks as the per-block recipes compile them); None where ``c`` is compiled, graphed
    or offloaded, or no such twin is untried and priced faster than ``c``. The
    simulator's compiled costs (:mod:`autoplace.sim.compiled`) err apart from its eager
    ones, so the fastest eager plans' compiled twins are measured rather than ranked: on
    2x H200 under gpt-1b's 16 GiB cap FSDP2 measured 75.3 ms, 0.84x its simulated time,
    and no compiled FSDP2 was tried, their family unmeasured and simulated slower than
    that (suite 2026-11-30-h200x2-suite-gpt1b-capped-outputs)."""
    plan = c["plan"]
    par = plan.parallel
    if par.compile or par.graphs or par.offload:
        return None
    want = signature(plan.with_parallel(compile=True))[:4]  # all but the pieces
    twins = [x for sig, x in by_sig.items()
             if sig[:4] == want and not x.get("tried") and x["sim"] < c["sim"]]
    return min(twins, key=lambda x: x["sim"], default=None)


def units_twin(c: dict[str, Any], graph: Any, cluster: Any) -> dict[str, Any] | None:
    """``c``'s plan with an FSDP2 unit per module holding parameters, where ``c`` is a
    sharded plan with units by blocks (see :data:`autoplace.search.auto.UNITS_NEAR_CAP`)."""
    par = c["plan"].parallel
    if par.shard == "none" or par.shard_units != "blocks":
        return None
    return candidate(sim_row(graph, cluster, f"{c['planner']} by modules",
                             c["plan"].with_parallel(shard_units="modules")))


def eager_first(c: dict[str, Any], by_sig: dict[tuple, dict[str, Any]], cal: Any,
                usable: float) -> dict[str, Any]:
    """The candidate to measure for ``c``: its eager twin first where ``c`` is compiled and
    simulated over the usable memory (a TIGHT_MEMORY candidate) with its layout's memory
    never measured, and the twin is simulated to hold what ``c`` holds. Such twins share
    their memory (``Calibration.memory_factor``) and the eager one answers without a
    compile: on 2x H200 under gpt-1b's 16 GiB cap tensor parallel compiled spent 22 s of a
    30 s budget compiling before it ran out of memory. A twin simulated to hold more (a
    selective region eagerly keeps its weights' bf16 copies, compiled it casts them again:
    gpt-1b's every block selective, 23.8 GiB eagerly and 21.8 compiled on one H200) would
    run out of memory where ``c`` fits, so ``c`` is measured itself."""
    plan = c["plan"]
    if not plan.parallel.compile or cal.memory_measured(family(plan)) \
            or cal.peak_bytes(plan, c["sim_peak"] or 0.0) <= usable:
        return c
    eager = by_sig.get(signature(plan.with_parallel(compile=False)))
    if eager is None or eager.get("tried") \
            or (eager.get("sim_peak") or 0.0) > TWIN_PEAK_SLACK * (c["sim_peak"] or 0.0):
        return c
    return eager


def compile_work(c: dict[str, Any], graph: Any) -> int:
    """The ops ``c``'s plan compiles: those of its distinct pieces, 0 for a plan run eager.

    A piece is a group's ops (:mod:`autoplace.sim.compiled`); pieces of the same ops on
    tensors of the same shapes share one compiled code object in the executor
    (``executor.pieces.canonical_piece``), so each is compiled once. A model's repeated
    blocks compiled a piece each therefore cost one block's compile, the model compiled
    whole every block's: on one H200 a 12-layer Hugging Face Llama's blocks compiled in
    15.3 s of warm-up, while compiled whole it did not start its steps within auto's 60 s
    limit (docs/executor.md, compiled pieces). Cached on ``c``."""
    if "compile_work" in c:
        return c["compile_work"]
    plan = c["plan"]
    work = 0
    if plan.parallel.compile:
        pieces: dict[int, list[tuple]] = {}
        for op in graph.ops:
            group = plan.groups.get(op.name)
            if group is not None:
                pieces.setdefault(group, []).append(
                    (op.kind, tuple(map(tuple, op.output_shapes)), tuple(op.output_dtypes)))
        distinct = {tuple(ops) for ops in pieces.values()}
        work = sum(len(ops) for ops in distinct)
    c["compile_work"] = work
    return work


def least_compile(queue: list[dict[str, Any]], corrected: Callable[[dict[str, Any]], float],
                  graph: Any, within: float) -> dict[str, Any]:
    """The candidate to measure of ``queue`` (sorted by ``corrected``, predicted step time):
    its head, or where the head is compiled, the compiled candidate predicted within
    ``within`` of it that compiles the fewest ops (:func:`compile_work`). A compile spends
    the budget before the plan's first step, and the simulator cannot rank plans a few
    percent apart: the 12-layer Llama compiled whole was simulated 2.4% faster than its
    blocks compiled a piece each, 6.4 times the ops to compile."""
    head = queue[0]
    if not head["plan"].parallel.compile:
        return head
    bound = within * corrected(head)
    near = [c for c in queue if c["plan"].parallel.compile and corrected(c) <= bound]
    return min(near, key=lambda c: (compile_work(c, graph), corrected(c)))
