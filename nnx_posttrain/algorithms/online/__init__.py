"""Online RL: the rollout engine (``rollout``), reward functions (``rewards``), and the algorithms
that learn from rollouts: GRPO (``grpo``), RLOO (``rloo``), PPO (``ppo``), online DPO
(``online_dpo``). May import model, data, losses, sampling and ``algorithms.base`` /
``reference`` / ``preference``."""

from nnx_posttrain.algorithms.online.grpo import GRPO, GRPOConfig
from nnx_posttrain.algorithms.online.online_dpo import OnlineDPO, OnlineDPOConfig
from nnx_posttrain.algorithms.online.options import SamplingConfig
from nnx_posttrain.algorithms.online.ppo import PPO, PPOConfig
from nnx_posttrain.algorithms.online.rloo import RLOO, RLOOConfig
from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm, Rollouts

__all__ = ["GRPO", "RLOO", "GRPOConfig", "RLOOConfig", "OnlineDPO", "OnlineDPOConfig", "PPO",
           "PPOConfig", "OnlineAlgorithm", "Rollouts", "SamplingConfig"]
