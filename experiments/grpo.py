"""GRPO: group-relative advantages over num_generations samples per prompt, clipped policy loss.

With no arguments: starts from the default SFT run (runs/sft) and trains on the built-in task's
prompts with the exact-match reward (1 when the answer is the correct sum).

    python -m experiments.grpo --algo.loss-type dr_grpo --algo.scale-rewards none
    python -m experiments.grpo --algo.beta 0.04 --algo.num-iterations 2 --algo.epsilon-high 0.28
    python -m experiments.grpo --model gemma_2b --data prompts.jsonl --lora.rank 8 \
        --algo.rewards my_rewards:correctness,format --algo.reward-weights 1,0.2

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``grpo``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/grpo.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("grpo"))
