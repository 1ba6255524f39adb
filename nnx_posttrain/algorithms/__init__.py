"""Algorithms: what a training step computes, as a loss over a batch, and where its batches come
from. ``base`` declares what the loop may call (``Algorithm``, ``BatchSource``); ``registry``
names every algorithm in one table; ``reference`` the reference-model modes; ``sft``,
``preference`` (DPO, SimPO, CPO, ORPO), ``kto``, ``reward``, ``online/`` and ``distill`` the
algorithms. Each algorithm's settings (``Config``) are its loss family's options
(``nnx_posttrain.losses``) plus its own. May import model, data, losses and sampling — never
train.
"""

from nnx_posttrain.algorithms.base import (Algorithm, AlgorithmBase, BatchSource, Inputs,
                                           RunContext)
from nnx_posttrain.algorithms.distill import Distill, DistillConfig
from nnx_posttrain.algorithms.kto import KTO, KTOConfig
from nnx_posttrain.algorithms.online import (GRPO, PPO, RLOO, GRPOConfig, OnlineDPO,
                                             OnlineDPOConfig, PPOConfig, RLOOConfig)
from nnx_posttrain.algorithms.preference import (CPO, DPO, ORPO, CPOConfig, DPOConfig, ORPOConfig,
                                                 SimPO, SimPOConfig)
from nnx_posttrain.algorithms.registry import ALGORITHMS, get, names
from nnx_posttrain.algorithms.reward import Reward, RewardConfig
from nnx_posttrain.algorithms.sft import SFT, SFTConfig

__all__ = ["Algorithm", "AlgorithmBase", "BatchSource", "Inputs", "RunContext",
           "ALGORITHMS", "get", "names",
           "SFT", "SFTConfig", "DPO", "DPOConfig", "SimPO", "SimPOConfig", "CPO", "CPOConfig",
           "ORPO", "ORPOConfig", "KTO", "KTOConfig", "Reward", "RewardConfig",
           "GRPO", "GRPOConfig", "RLOO", "RLOOConfig", "PPO", "PPOConfig", "OnlineDPO",
           "OnlineDPOConfig", "Distill", "DistillConfig"]
