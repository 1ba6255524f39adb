"""Losses: pure functions of arrays. No model, no I/O; imports jax only, nothing of nnx_posttrain.

- :mod:`.sft`: ``sft``, the next-token NLL on the loss tokens;
- :mod:`.dpo`: ``dpo``, DPO and its family (every ``loss_type`` of TRL 1.16's DPOTrainer and
  weighted combinations), f-divergences, WPO's weights, LD-DPO's split; the table of per-pair
  terms is :mod:`.dpo_terms`;
- :mod:`.preference`: the reference-free and unpaired preference losses (``simpo``, ``cpo``,
  ``orpo``, ``kto``, AlphaPO's rewards) and the Bradley-Terry reward-model loss ``reward_bt``;
- :mod:`.rl`: online RL advantages (group, GDPO, leave-one-out), whitening, GAE, PPO's rewards
  and loss; :mod:`.grpo`: GRPO's policy losses (every TRL 1.16 ``loss_type``) and RLOO's;
- :mod:`.distill`: the generalized JSD of distillation (``divergence``, ``gkd``);
- :mod:`.common`: the shared conventions and helpers.

Every loss returns ``(total, weight, metrics)``: ``total`` the loss *summed* over its unit
(tokens, pairs, examples), ``weight`` how many units were summed, so that ``total / weight`` is
the mean, and ``metrics`` ``name -> (sum, count)``. Summing all of them over micro-batches before
dividing gives exactly the large-batch mean (see :mod:`.common`).

Import the submodules (``from nnx_posttrain.losses.dpo import dpo``, ``from nnx_posttrain.losses
import rl``): their functions are not re-exported here, since ``sft`` and ``dpo`` are also the
names of their modules.
"""

from nnx_posttrain.losses import common, distill, dpo, dpo_terms, grpo, preference, rl, sft

__all__ = ["common", "distill", "dpo", "dpo_terms", "grpo", "preference", "rl", "sft"]
