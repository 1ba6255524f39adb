"""Losses: pure functions of arrays and of their options. No model, no I/O; imports jax and
``nnx_posttrain.errors`` only.

Each loss family owns a frozen options dataclass (TRL's names and defaults, checked when made,
``ConfigError`` naming the option and the fix: :class:`.common.Options`); an algorithm's settings
are its family's options, so each option and its default is written once, here. A loss takes
``(arrays, options)``: a ``NamedTuple`` of arrays and the options.

- :mod:`.sft`: ``sft``, the next-token NLL on the loss tokens;
- :mod:`.dpo`: ``DPOOptions``, ``dpo``: DPO and its family (every ``loss_type`` of TRL 1.16's
  DPOTrainer and weighted combinations), f-divergences, WPO's weights, LD-DPO's split; the table
  of per-pair terms is :mod:`.dpo_terms`;
- :mod:`.preference`: the reference-free pairwise losses (``SimPOOptions``/``simpo``,
  ``CPOOptions``/``cpo``, ``ORPOOptions``/``orpo``, AlphaPO's rewards);
- :mod:`.kto`: ``KTOOptions``, ``kto``; :mod:`.reward`: ``RewardOptions``, ``reward_bt`` (the
  Bradley-Terry reward-model loss);
- :mod:`.grpo`: ``GRPOOptions``, GRPO's policy losses (every TRL 1.16 ``loss_type``, a table
  registered by name); :mod:`.rloo`: ``RLOOOptions``, RLOO's; :mod:`.rl`: online RL
  advantages (group, GDPO, leave-one-out), whitening, GAE, ``PPOOptions`` and PPO's rewards and
  loss;
- :mod:`.distill`: ``DistillOptions``, the generalized JSD of distillation (``divergence``,
  ``gkd``);
- :mod:`.common`: the shared conventions, ``Options``, ``Pairs`` and helpers.

Every loss returns ``(total, weight, metrics)``: ``total`` the loss *summed* over its unit
(tokens, pairs, examples), ``weight`` how many units were summed, so that ``total / weight`` is
the mean, and ``metrics`` ``name -> (sum, count)``. Summing all of them over micro-batches before
dividing gives exactly the large-batch mean (see :mod:`.common`).

Import the submodules (``from nnx_posttrain.losses.dpo import dpo``, ``from nnx_posttrain.losses
import rl``): their functions are not re-exported here, since ``sft`` and ``dpo`` are also the
names of their modules.
"""

from nnx_posttrain.losses import (common, distill, dpo, dpo_terms, grpo, kto, preference, reward,
                                  rl, rloo, sft)

__all__ = ["common", "distill", "dpo", "dpo_terms", "grpo", "kto", "preference", "reward", "rl",
           "rloo", "sft"]
