"""``autoplace train``: a placement policy trained with REINFORCE, in a run folder that is
resumed or refused, never overwritten without ``--force``. ``--backend sim,real`` trains
on the simulator, then continues the same policy on measured step times; ``--init`` starts
from an earlier run's checkpoint."""

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
    policy: str | None = opt(None, "seq2seq, hierarchical or gnn (default: seq2seq, or the "
                                   "--init checkpoint's)")
    backend: str = opt("sim", "reward backend: sim, real, or sim,real (the simulator, then "
                              "the same policy on measured step times)")
    real_share: str = opt("0.3", "with --backend sim,real: the share of --budget (its unit: "
                                 "updates, episodes or time) spent on measured step times")
    init: str | None = opt(None, "start from this checkpoint.pt of an earlier run (same model, "
                                 "cluster and levers); a simulator-trained one continued with "
                                 "--backend real is corrected as sim,real is at its switch")
    levers: str = opt("", "env levers the policy also picks, comma-separated: priority, "
                          "recompute, compile (on one device, with microbatches, the choices)")
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
        from autoplace.policies.api import BACKENDS

        if self.backend not in BACKENDS:
            raise AutoplaceError(f"--backend {self.backend!r}: valid: {', '.join(BACKENDS)}")
        real_share(self.real_share)
        if self.init is not None and not Path(self.init).is_file():
            raise AutoplaceError(f"--init {self.init}: no such file (autoplace train writes "
                                 "DIR/checkpoint.pt)")
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


def real_share(text: str) -> float:
    """``--real-share``: a number between 0 and 1 (exclusive)."""
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0 < share < 1:
        raise AutoplaceError(f"--real-share must be a number between 0 and 1, got {text!r}")
    return share


def cmd_train(cfg: TrainConfig) -> int:
    from autoplace.policies import train

    cluster = cluster_of(cfg.cluster, cfg.memory_cap)
    if cfg.backend != "sim":
        cluster.require_present(what=f"train --backend {cfg.backend} (it measures plans)")
    wl = build_model(cfg, device="meta")
    out = Path(cfg.out)
    levers = tuple(x.strip() for x in cfg.levers.split(",") if x.strip())
    res = train(wl, cluster, policy=cfg.policy, backend=cfg.backend, budget=cfg.budget,
                out_dir=cfg.out, seed=cfg.seed, max_groups=max_groups(cfg.max_groups),
                resume=cfg.resume, force=cfg.force, progress=True, init=cfg.init,
                real_share=real_share(cfg.real_share), env_options={"levers": levers} if levers else None)
    stages = res.stages
    if stages:
        switch = stages["switch"]
        print("measured/simulated at the switch: " + ", ".join(
            f"{split} {ratio:.2f}x" for split, ratio in switch["ratios"].items())
            + f" (one device {switch['single_device']['ratio']:.2f}x)")
        print(f"simulator stage's best: {stages['sim']['plan']}, "
              f"{ms(stages['sim']['simulated_step_time_s'])} ms simulated, "
              f"{ms(stages['sim']['measured_step_time_s'])} ms measured")
        print(f"real stage's best: {stages['real']['plan']}, "
              f"{ms(stages['real']['measured_step_time_s'])} ms measured")
        print(f"faster: {stages['faster'] or '-'} ({stages['why']})")
    what = "measured" if res.best_plan.measured else "simulated"
    print(f"best plan: {res.best_plan.describe()}, {ms(res.best_step_time_s)} ms {what} -> "
          f"{out / 'best_plan.json'}")
    return 0


COMMANDS = {
    "train": (TrainConfig, cmd_train, "train a placement policy with REINFORCE"),
}
