"""Online RL: the rollout engine (``rollout``), reward functions (``rewards``), and the algorithms
that learn from rollouts: GRPO and RLOO (``grpo``), PPO (``ppo``), online DPO (``online_dpo``).
May import model, data, losses, sampling and ``algorithms.base`` / ``reference`` / ``preference``."""

# registered in this order: grpo, rloo, ppo, online_dpo
from nnx_posttrain.algorithms.online.grpo import GRPO, RLOO, GRPOConfig, RLOOConfig  # isort: skip
from nnx_posttrain.algorithms.online.ppo import PPO, PPOConfig  # isort: skip
from nnx_posttrain.algorithms.online.online_dpo import OnlineDPO, OnlineDPOConfig  # isort: skip
from nnx_posttrain.algorithms.online.options import SamplingConfig
from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm, Rollouts

__all__ = ["GRPO", "RLOO", "GRPOConfig", "RLOOConfig", "OnlineDPO", "OnlineDPOConfig", "PPO",
           "PPOConfig", "OnlineAlgorithm", "Rollouts", "SamplingConfig"]
