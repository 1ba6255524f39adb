"""Algorithms: what a training step computes, as a loss over a batch, and where its batches come
from. ``base`` declares what the loop may call (``Algorithm``, ``BatchSource``); ``registry``
holds every algorithm by name; ``reference`` the reference-model modes; ``sft``, ``preference``
(DPO, SimPO, CPO, ORPO), ``kto``, ``reward``, ``online/`` and ``distill`` the algorithms. May import model, data, losses and sampling — never train.

Importing this package registers every algorithm.
"""

# registers them, in the order they are listed (sft, the preference methods, the online ones)
from nnx_posttrain.algorithms import sft  # noqa: F401  isort: skip
from nnx_posttrain.algorithms import preference  # noqa: F401  isort: skip
from nnx_posttrain.algorithms import kto  # noqa: F401  isort: skip
from nnx_posttrain.algorithms import reward  # noqa: F401  isort: skip
from nnx_posttrain.algorithms import online  # noqa: F401  isort: skip
from nnx_posttrain.algorithms import distill  # noqa: F401  isort: skip
from nnx_posttrain.algorithms.base import (Algorithm, AlgorithmBase, BatchSource, Inputs,
                                           RunContext)
from nnx_posttrain.algorithms.online import (GRPO, PPO, RLOO, GRPOConfig, OnlineDPO,
                                             OnlineDPOConfig, PPOConfig, RLOOConfig)
from nnx_posttrain.algorithms.distill import Distill, DistillConfig
from nnx_posttrain.algorithms.kto import KTO, KTOConfig
from nnx_posttrain.algorithms.preference import (CPO, DPO, ORPO, CPOConfig, DPOConfig, ORPOConfig,
                                                 SimPO, SimPOConfig)
from nnx_posttrain.algorithms.reward import Reward, RewardConfig
from nnx_posttrain.algorithms.registry import ALGORITHMS, get, names, register
from nnx_posttrain.algorithms.sft import SFT, SFTConfig

__all__ = ["Algorithm", "AlgorithmBase", "BatchSource", "Inputs", "RunContext",
           "ALGORITHMS", "get", "names", "register",
           "SFT", "SFTConfig", "DPO", "DPOConfig", "SimPO", "SimPOConfig", "CPO", "CPOConfig",
           "ORPO", "ORPOConfig", "KTO", "KTOConfig", "Reward", "RewardConfig",
           "GRPO", "GRPOConfig", "RLOO", "RLOOConfig", "PPO", "PPOConfig", "OnlineDPO",
           "OnlineDPOConfig", "Distill", "DistillConfig"]
