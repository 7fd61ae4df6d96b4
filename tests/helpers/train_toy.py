"""Train a policy on the toy env (a subprocess of test_reinforce: killed and resumed).

Usage: python -m tests.helpers.train_toy OUT_DIR POLICY UPDATES [--resume]
"""

from __future__ import annotations

import sys

import torch

from autoplace.policies import make, reinforce
from tests.helpers.placement_toy import ToyPlacementEnv

if __name__ == "__main__":
    out_dir, policy, updates = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    envs = [ToyPlacementEnv(step_sleep_s=0.002) for _ in range(8)]
    torch.manual_seed(0)
    pol = make(policy, envs[0].observation_space, envs[0].action_space, hidden=32)
    reinforce(envs, pol, budget=updates, batch_size=8, seed=3, out_dir=out_dir,
              checkpoint_every=2, resume="--resume" in sys.argv, progress=False)
