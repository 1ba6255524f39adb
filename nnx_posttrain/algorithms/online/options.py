"""The options every online algorithm shares (``--algo.*``): generation, rewards, tools."""

from __future__ import annotations

import dataclasses

from nnx_posttrain.algorithms.reference import Reference


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """What every online algorithm shares: generation and rewards."""

    num_generations: int = 8
    """Completions sampled per prompt (a GRPO / RLOO group)."""
    max_completion_length: int = 512
    """Generated tokens per completion at most (TRL's default)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs in the loss use the same temperature, as TRL)."""
    top_k: int = 0
    """Sample from the k most likely tokens only; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1.0 = off."""
    rewards: str = ""
    """Reward functions, comma-separated (required; the built-in task's recipe uses exact_match): built-in names (exact_match: needs an 'answer' column, format, length), 'module:function' with TRL's signature, or a reward-model run directory."""
    reward_weights: str | None = None
    """Comma-separated weights of the reward functions (default: all 1)."""
    num_iterations: int = 1
    """Optimizer steps per rollout (TRL's num_iterations / PPO epochs); old log-probs are kept."""
    mask_truncated_completions: bool = False
    """Completions cut at max_completion_length (no stop token) carry no loss."""
    reference: Reference = "auto"
    """Reference for the KL term: lora_base (LoRA on), copy (full fine-tuning), auto picks."""
    log_completions: int = 8
    """Completions of the latest rollout logged (completions.jsonl, TensorBoard text, W&B) with their rewards at every logged step, as TRL's log_completions; 0: none."""
    tools: str = ""
    """Functions the model may call, comma-separated 'module:function' (type hints and a Google-style docstring give the schema in the prompt); GRPO and RLOO (docs/agents.md)."""
    environment: str = ""
    """An environment class 'module:Class' (one instance per rollout: reset(**record), its public methods are tools, get_reward() an optional reward), or 'name=module:Class,...' chosen by an 'environment' column."""
    max_tool_calling_iterations: int | None = None
    """Tool-calling turns per rollout at most; default: until max_completion_length is used up."""
    tool_timeout: float = 10.0
    """Seconds a tool call may run; past it the call fails (its error is the model's result)."""
