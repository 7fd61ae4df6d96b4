"""The built-in model zoo: importing this package registers every zoo workload.

Names (see :func:`autoplace.workloads.names`): ``gpt-tiny``, ``gpt-small``,
``gpt-medium``, ``gpt-1b``, ``rnnlm``, ``gnmt-2``, ``gnmt-4``, ``gnmt-8``,
``inception-v3``, ``resnet50``, ``branchy-mlp``, ``llama3-tiny``, ``llama3-8b``,
``llama3-70b``, ``llama3-405b``. Each takes keyword options: the
fields of its model family's config dataclass plus ``batch_size``, ``lr`` and
``autocast_dtype``; ``autoplace.workloads.ZOO[name][1]`` holds the defaults.

Models here contain no parallelism code, build on the ``meta`` device and trace
with ``torch.fx.symbolic_trace``.
"""

from __future__ import annotations

from autoplace.zoo.gpt import GPT, GPTConfig, gpt_1b, gpt_medium, gpt_small, gpt_tiny, gpt_workload
from autoplace.zoo.inception import (
    InceptionConfig,
    InceptionV3,
    inception_full,
    inception_small,
    inception_workload,
)
from autoplace.zoo.llama import (
    Llama,
    LlamaConfig,
    llama3_8b,
    llama3_70b,
    llama3_405b,
    llama3_tiny,
    llama_workload,
)
from autoplace.zoo.mlp import BranchyMLP, BranchyMLPConfig, branchy_mlp_small, branchy_mlp_workload
from autoplace.zoo.resnet import (
    ResNet,
    ResNetConfig,
    resnet50_full,
    resnet50_small,
    resnet_workload,
)
from autoplace.zoo.rnn import (
    GNMT,
    RNNLM,
    GNMTConfig,
    RNNLMConfig,
    gnmt_paper,
    gnmt_small,
    gnmt_workload,
    rnnlm_small,
    rnnlm_workload,
)

__all__ = [
    "GNMT",
    "GPT",
    "RNNLM",
    "BranchyMLP",
    "InceptionV3",
    "Llama",
    "ResNet",
    "BranchyMLPConfig",
    "GNMTConfig",
    "GPTConfig",
    "InceptionConfig",
    "LlamaConfig",
    "RNNLMConfig",
    "ResNetConfig",
    "branchy_mlp_small",
    "gnmt_paper",
    "gnmt_small",
    "gpt_1b",
    "gpt_medium",
    "gpt_small",
    "gpt_tiny",
    "inception_full",
    "inception_small",
    "llama3_8b",
    "llama3_70b",
    "llama3_405b",
    "llama3_tiny",
    "resnet50_full",
    "resnet50_small",
    "rnnlm_small",
    "branchy_mlp_workload",
    "gnmt_workload",
    "gpt_workload",
    "inception_workload",
    "llama_workload",
    "resnet_workload",
    "rnnlm_workload",
]
