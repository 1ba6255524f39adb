"""PPO with a value head on the policy's backbone."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_posttrain import config as config_lib, model
from nnx_posttrain.algorithms.base import ONLINE_DATA, merged
from nnx_posttrain.algorithms.online.options import SamplingConfig
from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm, rollout_rows
from nnx_posttrain.losses import rl
from nnx_posttrain.losses.rl import PPOInputs, PPOOptions, ppo_loss, ppo_rewards
from nnx_posttrain.losses.router import RouterOptions, with_router_aux


@dataclasses.dataclass(frozen=True)
class PPOConfig(SamplingConfig, PPOOptions, RouterOptions):
    """PPO with a value head on the policy's backbone, GAE, clipped value loss and a per-token
    KL penalty in the reward (Ouyang et al. 2022; TRL's PPOTrainer); a mixture-of-experts policy
    adds its router load-balancing loss."""

    num_generations: int = 1

    def problems(self) -> list[str]:
        return PPOOptions.problems(self) + RouterOptions.problems(self)


@dataclasses.dataclass
class PPORunConfig(config_lib.Config):
    """A PPO run's settings: the common ones, PPO's own under ``algo``."""

    algo: PPOConfig = dataclasses.field(default_factory=PPOConfig)


class PPO(OnlineAlgorithm):
    name = "ppo"
    Config = PPOConfig
    RunConfig = PPORunConfig
    defaults = merged(ONLINE_DATA, optim=dict(learning_rate=3e-6))  # TRL's PPOTrainer
    head = "value"  # nnx_posttrain.model.heads.PolicyWithValue
    reads_images = True  # TRL's prompt-only vision format: rollouts, log-probs, values read them

    def needs_reference(self):
        return bool(self.cfg.kl_coef)

    def policy(self, module):
        return module.backbone

    def policy_view(self, graphdef, params, frozen_model):
        backbone_graphdef, *states = nnx.split(nnx.merge(graphdef, params, frozen_model).backbone)
        return backbone_graphdef, tuple(states)

    def attach(self, rollouts):
        # the rollout's log-probs and values under the generating policy, without gradient,
        # reading the rows' images as the training step's forward does
        def forward(module, reference, rows):
            with model.images(rows.get("pixel_values")):
                return module.logps_and_values(rows["input_ids"], rows["attention_mask"],
                                               self.logprob_chunk, self.logprob_temperature,
                                               positions=rows["positions"])
        self._logps_and_values = rollouts.compile(forward)

    def make_batch(self, batch, scores, finished, rollouts, state):
        c = self.cfg
        mask = batch["loss_mask"].astype(np.float32)
        old_logps, old_values = (np.asarray(x) for x in jax.device_get(
            self._logps_and_values(state, rollout_rows(batch))))
        scores = scores.astype(np.float32)
        if c.missing_eos_penalty is not None:
            scores = scores - c.missing_eos_penalty * (~finished)
        # TRL's: the sampled completions' negative log-likelihood, and how many ended with EOS
        metrics = {"objective/scores": float(scores.mean()),
                   "objective/entropy": float((-old_logps * mask).sum(axis=1).mean()),
                   "val/num_eos_tokens": float(np.sum(finished))}
        ref = (rollouts.logps(batch, state, False, True)["ref_logps"]
               if self.reference_mode is not None else None)
        per_token, kl = (np.asarray(x) for x in ppo_rewards(scores, old_logps, ref, mask, c))
        if ref is not None:
            metrics["objective/kl"] = float(kl.sum(axis=1).mean())
            metrics["objective/non_score_reward"] = float(-c.kl_coef * kl.sum(axis=1).mean())
        metrics["objective/rlhf_reward"] = float(per_token.sum(axis=1).mean())
        if c.whiten_rewards:  # TRL's masked_whiten(rewards, shift_mean=False)
            per_token = np.asarray(rl.whiten(jnp.asarray(per_token), jnp.asarray(mask),
                                             shift_mean=False)) * mask
        adv, returns = rl.gae(jnp.asarray(per_token), jnp.asarray(old_values), jnp.asarray(mask),
                              c.gamma, c.lam)
        if c.whiten_advantages:
            adv = rl.whiten(adv, jnp.asarray(mask)) * mask
        batch.update(old_logps=old_logps, old_values=old_values, advantages=np.asarray(adv),
                     returns=np.asarray(returns))
        return batch, metrics

    def loss(self, module, batch, reference=None):
        c = self.cfg
        # TRL's PPOTrainer does not add it: transformers' convention (output_router_logits on)
        with model.routers_captured(self.policy(module), c.router_aux_loss_coef) as routers:
            (logps, entropy), values = module.logps_and_values(
                batch["input_ids"], batch["attention_mask"], self.logprob_chunk,
                self.logprob_temperature, with_entropy=True, positions=batch.get("positions"))
        inputs = PPOInputs(logps, batch["old_logps"], batch["advantages"], batch["returns"],
                           values, batch["old_values"], batch["loss_mask"], entropy)
        return with_router_aux(ppo_loss(inputs, c), routers.routed())
