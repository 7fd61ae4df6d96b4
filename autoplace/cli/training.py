"""``autoplace train``: a placement policy trained with REINFORCE, in a run folder that is
resumed or refused, never overwritten without ``--force``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autoplace.cli.args import ClusterArgs, ModelArgs, opt
from autoplace.cli.common import build_model, cluster_of, ms
from autoplace.errors import AutoplaceError

__all__ = ["COMMANDS"]

#: what a train run leaves in its folder (policies.api.train)


@dataclass(kw_only=True)
class TrainConfig(ModelArgs, ClusterArgs):
    policy: str = opt("seq2seq", "seq2seq, hierarchical or gnn")
    backend: str = opt("sim", "reward backend: sim or real")
    budget: str = opt("2000ep", "training budget: episodes (2000ep), updates (100up) or time (5m)")
    out: str = opt("runs/train", "output directory (checkpoint, TensorBoard, best_plan.json); "
                                 "a folder of an earlier run is resumed (--resume) or replaced "
                                 "(--force)", out="dir")
    max_groups: str = opt("auto", "groups the graph is coarsened to: a number, or auto "
                                  "(from the graph's branch structure)")
    seed: int = opt(0, "random seed")
    resume: bool = opt(False, "resume from the checkpoint in --out")
    force: bool = opt(False, "start over in an --out folder of an earlier run (its "
                             "checkpoint and TensorBoard events are replaced)")

    def check(self) -> None:
        from autoplace.policies.reinforce import parse_budget

        try:
            parse_budget(self.budget)
        except AutoplaceError as e:
            raise AutoplaceError(f"--budget: {e}") from None
        max_groups(self.max_groups)
        from autoplace.policies.api import check_run_folder  # heavy: loaded when used

        try:
            check_run_folder(self.out, resume=self.resume, force=self.force)
        except AutoplaceError as e:
            raise AutoplaceError(f"--out: {e}") from None


def max_groups(text: str) -> int | str:
    """``--max-groups``: a positive number or ``auto``."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise AutoplaceError(f"--max-groups must be a positive number or auto, got {text!r}")
    return n


def cmd_train(cfg: TrainConfig) -> int:
    from autoplace.policies import train

    cluster = cluster_of(cfg.cluster, cfg.memory_cap)
    if cfg.backend == "real":
        cluster.require_present(what="train --backend real (it measures plans)")
    wl = build_model(cfg, device="meta")
    out = Path(cfg.out)
    res = train(wl, cluster, policy=cfg.policy, backend=cfg.backend, budget=cfg.budget,
                out_dir=cfg.out, seed=cfg.seed, max_groups=max_groups(cfg.max_groups),
                resume=cfg.resume, force=cfg.force, progress=True)
    print(f"best plan: {res.best_plan.describe()}, {ms(res.best_step_time_s)} ms -> "
          f"{out / 'best_plan.json'}")
    return 0


COMMANDS = {
    "train": (TrainConfig, cmd_train, "train a placement policy with REINFORCE"),
}
