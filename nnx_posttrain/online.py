"""Online RL: GRPO (and its loss types), RLOO, PPO, online DPO.

Each step of an online algorithm starts from a batch of prompts and a *rollout*:

    prompts --sampler--> completions --reward functions--> rewards --> advantages
            (KV cache, compiled once)       (text, TRL signature)     (group / leave-one-out / GAE)

then the one training loop (``nnx_posttrain.train``) takes an optimizer step on the rollout batch,
with a loss from ``nnx_posttrain.rl_losses``. With ``num_iterations`` > 1 a rollout is reused for
that many optimizer steps (the log-probs of the policy that generated it are kept as
``old_logps``); checkpoints are written only between rollouts, so a resumed run regenerates
nothing and continues exactly (the sampling RNG of step s is derived from the seed and s).

``--batching.batch-size`` counts completions per optimizer step (TRL's convention): each step
draws ``batch_size / num_generations`` prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import keras
import numpy as np
from flax import nnx

from nnx_posttrain import data, model, rewards as rewards_lib
from nnx_posttrain.losses import dpo as pl  # import line only: pl.dpo is the function
from nnx_posttrain.losses import rl
from nnx_posttrain.algorithms import Algorithm
from nnx_posttrain.preference import Reference


# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass
class SamplingConfig:
    """What every online algorithm shares: generation and rewards."""

    num_generations: int = 8
    """Completions sampled per prompt (a GRPO / RLOO group)."""
    max_completion_length: int = 8
    """Generated tokens per completion at most."""
    temperature: float = 1.0
    """Sampling temperature (log-probs in the loss use the same temperature, as TRL)."""
    top_k: int = 0
    """Sample from the k most likely tokens only; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1.0 = off."""
    rewards: str = "exact_match"
    """Reward functions, comma-separated: built-in names (exact_match, format, length), 'module:function', or a reward-model run directory."""
    reward_weights: str | None = None
    """Comma-separated weights of the reward functions (default: all 1)."""
    num_iterations: int = 1
    """Optimizer steps per rollout (TRL's num_iterations / PPO epochs); old log-probs are kept."""
    mask_truncated_completions: bool = False
    """Completions cut at max_completion_length (no stop token) carry no loss."""
    reference: Reference = "auto"
    """Reference for the KL term: lora_base (LoRA on), copy (full fine-tuning), auto picks."""


@dataclasses.dataclass
class GRPOConfig(SamplingConfig):
    """Group Relative Policy Optimization (Shao et al. 2024) and its variants."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """Token aggregation: grpo (per-sequence mean), bnpo (per micro-batch token mean), dr_grpo (sum / (sequences x max length)), dapo (token mean over the batch; TRL's default)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)."""
    epsilon: float = 0.2
    """Lower clipping range of the ratio."""
    epsilon_high: float | None = None
    """Upper clipping range (DAPO's clip-higher, e.g. 0.28); default: epsilon."""
    beta: float = 0.0
    """Weight of the KL penalty (k3 estimator) to the reference; 0 needs no reference."""


@dataclasses.dataclass
class RLOOConfig(GRPOConfig):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024): baseline = the group's other rewards; the
    KL to the reference (beta) is subtracted from the reward, as TRL's RLOOTrainer."""

    num_generations: int = 4
    beta: float = 0.05
    normalize_advantages: bool = False
    """Whiten the advantages over the batch."""


@dataclasses.dataclass
class PPOConfig(SamplingConfig):
    """PPO with a value head on the policy's backbone, GAE, clipped value loss and a per-token
    KL penalty in the reward (Ouyang et al. 2022; TRL's PPOTrainer)."""

    num_generations: int = 1
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    kl_coef: float = 0.05
    """Per-token KL penalty in the reward."""
    whiten_advantages: bool = True
    missing_eos_penalty: float | None = None
    """Subtracted from the score of a completion with no stop token."""


@dataclasses.dataclass
class OnlineDPOConfig(SamplingConfig):
    """Online DPO (Guo et al. 2024): two samples per prompt, ranked by the reward, DPO loss."""

    num_generations: int = 2
    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"


# ----------------------------------------------------------------------------- the base


class OnlineAlgorithm(Algorithm):
    """Generates its own training batches from prompts (see the module docstring)."""

    data_kind = "prompt_only"
    online = True

    # -- set-up

    def setup(self, module):
        if not self.needs_reference():
            return  # reference-free: no second copy of the weights
        super().setup(self.policy(module))
        if self.reference_mode == "precompute":
            raise SystemExit(f"{self.name}: --algo.reference precompute does not apply to online "
                             "methods (the completions are new at every step); use lora_base or copy")

    def needs_reference(self) -> bool:
        return bool(getattr(self.cfg, "beta", 0.0))

    def policy(self, module):
        """The language model inside the trained module."""
        return module

    @property
    def logprob_temperature(self) -> float:
        """Log-probs are those of the sampling distribution, softmax(logits / temperature), as
        the sampler reports them (temperature 0 samples greedily: the plain distribution)."""
        return self.cfg.temperature or 1.0

    def prompts_per_step(self, batch_size: int) -> int:
        c, g = self.cfg, self.cfg.num_generations
        problems = [f"--algo.{name.replace('_', '-')} must be {rule}, got {getattr(c, name)}"
                    for name, ok, rule in (
                        ("num_generations", g >= 1, ">= 1"),
                        ("max_completion_length", c.max_completion_length >= 1, ">= 1"),
                        ("temperature", c.temperature >= 0, ">= 0"),
                        ("top_k", c.top_k >= 0, ">= 0"),
                        ("top_p", 0 < c.top_p <= 1, "in (0, 1]"),
                        ("num_iterations", c.num_iterations >= 1, ">= 1"))
                    if not ok]
        if problems:
            raise SystemExit("invalid configuration:\n  " + "\n  ".join(problems))
        if batch_size % g:
            raise SystemExit(f"--batching.batch-size {batch_size} must be a multiple of "
                             f"--algo.num-generations {g}")
        return batch_size // g

    def fresh(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) starts with a new rollout."""
        return (step - 1) % self.cfg.num_iterations == 0

    def attach(self, lm, graphdef, params, frozen, train_src, seed: int, merge):
        """Called by the loop once the model is split: what the rollouts need. ``merge`` is
        ``train.merge`` (graphdef, params, frozen) -> (module, reference module or None)."""
        from nnx_posttrain.sampling import generate, sampler

        self.lm, self.train_src, self.seed, self._merge = lm, train_src, seed, merge
        self.graphdef = graphdef
        self.reward_fns = rewards_lib.resolve(self.cfg.rewards)
        self.reward_weights = rewards_lib.weights(self.cfg.reward_weights, len(self.reward_fns))
        self.stop_ids = jnp.asarray(generate.stop_ids(lm), jnp.int32)
        policy_graphdef, _ = self.policy_view(graphdef, params, frozen["model"])
        self._sample = sampler.make_sampler(policy_graphdef, self.cfg.max_completion_length,
                                            top_k=self.cfg.top_k)
        self._logps_jit = jax.jit(self._rollout_logps, static_argnums=(5, 6))

    # -- the rollout

    def rollout(self, step: int, state: dict, frozen: dict, prompts: dict) -> tuple[dict, dict]:
        """Prompts batch -> (training batch of numpy arrays, host metrics)."""
        c, g = self.cfg, self.cfg.num_generations
        prompt_ids = np.repeat(np.asarray(prompts["prompt_ids"]), g, axis=0)
        prompt_mask = np.repeat(np.asarray(prompts["prompt_mask"]), g, axis=0)
        index = np.repeat(np.asarray(prompts["index"]), g, axis=0)
        _, states = self.policy_view(self.graphdef, state["params"], frozen["model"])
        rng = jax.random.fold_in(jax.random.key(self.seed), step)
        out = jax.device_get(self._sample(tuple(states), prompt_ids, prompt_mask, rng,
                                          jnp.float32(c.temperature), jnp.float32(c.top_p),
                                          self.stop_ids))
        completion_ids = np.asarray(out["completion_ids"])
        completion_mask = np.asarray(out["completion_mask"]).astype(np.int32)
        finished = np.asarray(out["finished"]).astype(bool)
        texts = self._texts(completion_ids, completion_mask)
        scores, metrics = self._rewards(prompt_ids, prompt_mask, completion_ids, completion_mask,
                                        texts, index)
        loss_mask = completion_mask * (finished[:, None] if c.mask_truncated_completions else 1)
        width = prompt_ids.shape[1]
        batch = {
            "input_ids": np.concatenate([prompt_ids, completion_ids], axis=1),
            "attention_mask": np.concatenate([prompt_mask, completion_mask], axis=1),
            "loss_mask": np.concatenate([np.zeros_like(prompt_mask), loss_mask], axis=1),
            # only the completion's positions go through the vocabulary projection
            "positions": np.broadcast_to(np.arange(width, width + completion_ids.shape[1],
                                                   dtype=np.int32), completion_ids.shape).copy(),
        }
        metrics.update(_completion_metrics(completion_mask, finished))
        batch, extra = self.make_batch(batch, scores, finished, state, frozen)
        metrics.update(extra)
        return batch, metrics

    def _texts(self, ids, mask) -> list[str]:
        stops = set(np.asarray(self.stop_ids).tolist())
        decode = self.lm.tokenizer.decode
        return [decode([int(t) for t, m in zip(row, mrow) if m and int(t) not in stops])
                for row, mrow in zip(ids, mask)]

    def _rewards(self, prompt_ids, prompt_mask, completion_ids, completion_mask, texts, index):
        """[B] weighted reward sum (NaN-ignoring, as TRL) and the per-function metrics."""
        records = data.extra_columns(self.train_src, index, exclude=())
        columns = {k: [r.get(k) for r in records] for k in {k for r in records for k in r}}
        prompts = columns.pop("prompt", [None] * len(texts))
        per_fn = np.zeros((len(texts), len(self.reward_fns)), np.float32)
        metrics = {}
        for j, (name, fn) in enumerate(self.reward_fns):
            if getattr(fn, "needs_tokens", False):
                values = fn.score_tokens(*_right_aligned(prompt_ids, prompt_mask,
                                                         completion_ids, completion_mask))
            else:
                values = fn(prompts=prompts, completions=texts, **columns)
            per_fn[:, j] = [np.nan if v is None else float(v) for v in values]
            applies = per_fn[:, j][np.isfinite(per_fn[:, j])]
            metrics[f"rewards/{name}/mean"] = float(applies.mean()) if len(applies) else np.nan
            metrics[f"rewards/{name}/std"] = float(applies.std()) if len(applies) else np.nan
        total = np.nansum(per_fn * self.reward_weights[None, :], axis=1)
        groups = total.reshape(-1, self.cfg.num_generations)
        metrics["reward"] = float(total.mean())
        metrics["reward_std"] = (float(groups.std(axis=1, ddof=1).mean()) if groups.shape[1] > 1
                                 else 0.0)
        metrics["frac_reward_zero_std"] = float((groups.std(axis=1) == 0).mean())
        return total, metrics

    def _rollout_logps(self, params, frozen, ids, att, positions, with_old: bool, with_ref: bool):
        """Per-token log-probs of the rollout under the current policy (``old_logps``) and the
        reference (``ref_logps``), at the sampling temperature, without gradient."""
        module, reference = self._merge(self.graphdef, params, frozen)
        policy = self.policy(module)
        fwd = lambda m: model.token_logprobs(m, ids, att, self.logprob_chunk,
                                             temperature=self.logprob_temperature,
                                             positions=positions)
        out = {}
        if with_old:
            out["old_logps"] = fwd(policy)
        if with_ref:
            out["ref_logps"] = self.reference(
                policy, None if reference is None else self.policy(reference), None, fwd)
        return out

    def _logps_for(self, batch, state, frozen, with_old, with_ref) -> dict:
        if not (with_old or with_ref):
            return {}
        out = self._logps_jit(state["params"], frozen, batch["input_ids"], batch["attention_mask"],
                              batch["positions"], with_old, with_ref)
        return {k: np.asarray(v) for k, v in jax.device_get(out).items()}

    def make_batch(self, batch, scores, finished, state, frozen) -> tuple[dict, dict]:
        raise NotImplementedError

    def _policy_logps(self, module, batch, with_entropy=True):
        return model.token_logprobs(self.policy(module), batch["input_ids"], batch["attention_mask"],
                                    self.logprob_chunk, with_entropy=with_entropy,
                                    temperature=self.logprob_temperature,
                                    positions=batch.get("positions"))


def _right_aligned(prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Left-padded prompt + completion -> right-padded rows (for models reading the last token)."""
    ids = np.concatenate([prompt_ids, completion_ids], axis=1)
    mask = np.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
    out = np.zeros_like(ids)
    out_mask = np.zeros_like(ids, dtype=np.int32)
    for i in range(len(ids)):
        row = ids[i][mask[i]]
        out[i, : len(row)] = row
        out_mask[i, : len(row)] = 1
    return out, out_mask


def _completion_metrics(mask, finished) -> dict:
    lengths = mask.sum(axis=1).astype(np.float32)
    done = lengths[finished]
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(1.0 - finished.mean()),
        "completions/mean_terminated_length": float(done.mean()) if len(done) else 0.0,
    }


# ----------------------------------------------------------------------------- GRPO, RLOO


class GRPO(OnlineAlgorithm):
    name = "grpo"
    Config = GRPOConfig

    def advantages(self, scores, batch):
        return rl.group_advantages(scores, self.cfg.num_generations, self.cfg.scale_rewards)

    def make_batch(self, batch, scores, finished, state, frozen):
        c = self.cfg
        batch.update(self._logps_for(batch, state, frozen, c.num_iterations > 1,
                                     self.reference_mode is not None))
        batch["advantages"] = np.asarray(self.advantages(scores, batch), np.float32)
        return batch, {}

    def loss(self, module, batch, reference=None):
        c = self.cfg
        logps, entropy = self._policy_logps(module, batch)
        old = batch.get("old_logps")
        old = jax.lax.stop_gradient(logps) if old is None else old
        return rl.clipped_policy_loss(
            logps, old, batch["advantages"], batch["loss_mask"], epsilon=c.epsilon,
            epsilon_high=c.epsilon_high, beta=c.beta if "ref_logps" in batch else 0.0,
            ref_logps=batch.get("ref_logps"),
            loss_type=c.loss_type, max_completion_length=c.max_completion_length, entropies=entropy,
        )


class RLOO(GRPO):
    """The KL to the reference enters the reward (sequence sum of log pi_old - log pi_ref), not
    the loss (the batch carries no ``ref_logps``, so GRPO's loss adds no KL term)."""

    name = "rloo"
    Config = RLOOConfig

    def make_batch(self, batch, scores, finished, state, frozen):
        with_ref = self.reference_mode is not None
        logps = self._logps_for(batch, state, frozen, True, with_ref)
        metrics = {}
        if with_ref:
            mask = batch["loss_mask"].astype(np.float32)
            kl = ((logps["old_logps"] - logps["ref_logps"]) * mask).sum(axis=1)
            scores = scores - self.cfg.beta * kl
            metrics["kl"] = float(kl.mean())
        adv = rl.leave_one_out_advantages(scores, self.cfg.num_generations)
        if self.cfg.normalize_advantages:
            adv = rl.whiten(adv)
        if self.cfg.num_iterations > 1:
            batch["old_logps"] = logps["old_logps"]
        batch["advantages"] = np.asarray(adv, np.float32)
        return batch, metrics


# ----------------------------------------------------------------------------- PPO


class PolicyWithValue(nnx.Module):
    """The policy's backbone with a scalar value head (initialised to zero) on its hidden states.

    ``values[:, t]`` estimates the return from token t on, read (like the log-prob of token t)
    from the hidden state of position t - 1."""

    def __init__(self, backbone):
        self.backbone = backbone
        self.value_head = keras.layers.Dense(1, name="value_head", kernel_initializer="zeros")
        self.value_head.build((None, backbone.hidden_dim))

    def logps_and_values(self, ids, att, chunk, temperature, with_entropy=False, positions=None):
        h = model.hidden_states(self.backbone, ids, att)
        values = self.value_head(h)[..., 0].astype(jnp.float32)
        values = jnp.pad(values[:, :-1], ((0, 0), (1, 0)))
        out = model.logprobs_from_hidden(self.backbone, h, ids, chunk, with_entropy, temperature,
                                         positions)
        return out, values


class PPO(OnlineAlgorithm):
    name = "ppo"
    Config = PPOConfig

    def needs_reference(self):
        return bool(self.cfg.kl_coef)

    def build_module(self, lm):
        return PolicyWithValue(lm.module)

    def policy(self, module):
        return module.backbone

    def policy_view(self, graphdef, params, frozen_model):
        backbone_graphdef, *states = nnx.split(nnx.merge(graphdef, params, frozen_model).backbone)
        return backbone_graphdef, tuple(states)

    def attach(self, lm, graphdef, params, frozen, train_src, seed, merge):
        super().attach(lm, graphdef, params, frozen, train_src, seed, merge)
        self._values_jit = jax.jit(self._logps_and_values)

    def _logps_and_values(self, params, frozen, ids, att, positions):
        """The rollout's log-probs and values under the generating policy, without gradient."""
        module, _ = self._merge(self.graphdef, params, frozen)
        return module.logps_and_values(ids, att, self.logprob_chunk, self.logprob_temperature,
                                       positions=positions)

    def make_batch(self, batch, scores, finished, state, frozen):
        c = self.cfg
        ids, att = batch["input_ids"], batch["attention_mask"]
        mask = batch["loss_mask"].astype(np.float32)
        old_logps, old_values = (np.asarray(x) for x in jax.device_get(
            self._values_jit(state["params"], frozen, ids, att, batch["positions"])))
        scores = scores.astype(np.float32)
        if c.missing_eos_penalty is not None:
            scores = scores - c.missing_eos_penalty * (~finished)
        per_token = np.zeros_like(mask)
        metrics = {"objective/scores": float(scores.mean())}
        if self.reference_mode is not None:
            ref = self._logps_for(batch, state, frozen, False, True)["ref_logps"]
            kl = (old_logps - ref) * mask
            per_token -= c.kl_coef * kl
            metrics["objective/kl"] = float(kl.sum(axis=1).mean())
            metrics["objective/non_score_reward"] = float(per_token.sum(axis=1).mean())
        last = np.maximum(mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
        per_token[np.arange(len(scores)), last] += scores * (mask.sum(axis=1) > 0)
        metrics["objective/rlhf_reward"] = float(per_token.sum(axis=1).mean())
        adv, returns = rl.gae(jnp.asarray(per_token), jnp.asarray(old_values), jnp.asarray(mask),
                              c.gamma, c.lam)
        if c.whiten_advantages:
            adv = rl.whiten(adv, jnp.asarray(mask)) * mask
        batch.update(old_logps=old_logps, old_values=old_values, advantages=np.asarray(adv),
                     returns=np.asarray(returns))
        return batch, metrics

    def loss(self, module, batch, reference=None):
        c = self.cfg
        (logps, entropy), values = module.logps_and_values(
            batch["input_ids"], batch["attention_mask"], self.logprob_chunk,
            self.logprob_temperature, with_entropy=True, positions=batch.get("positions"))
        return rl.ppo_loss(logps, batch["old_logps"], batch["advantages"], batch["returns"], values,
                           batch["old_values"], batch["loss_mask"], cliprange=c.cliprange,
                           cliprange_value=c.cliprange_value, vf_coef=c.vf_coef, entropies=entropy)


# ----------------------------------------------------------------------------- online DPO


class OnlineDPO(OnlineAlgorithm):
    """Of each prompt's two samples the higher-reward one is chosen (ties: the first)."""

    name = "online_dpo"
    Config = OnlineDPOConfig

    def needs_reference(self):
        return True

    def prompts_per_step(self, batch_size):
        if self.cfg.num_generations != 2:
            raise SystemExit("online_dpo samples exactly 2 completions per prompt "
                             "(--algo.num-generations 2)")
        return super().prompts_per_step(batch_size)

    def make_batch(self, batch, scores, finished, state, frozen):
        pairs = scores.reshape(-1, 2)
        first_wins = pairs[:, 0] >= pairs[:, 1]
        chosen = np.arange(0, len(scores), 2) + np.where(first_wins, 0, 1)
        rejected = np.arange(0, len(scores), 2) + np.where(first_wins, 1, 0)
        out = {}
        for key in ("input_ids", "attention_mask", "loss_mask", "positions"):
            out[f"chosen_{key}"] = batch[key][chosen]
            out[f"rejected_{key}"] = batch[key][rejected]
        return out, {"objective/scores_margin": float(np.abs(pairs[:, 0] - pairs[:, 1]).mean())}

    def loss(self, module, batch, reference=None):
        from nnx_posttrain.preference import pair_logps

        lp = pair_logps(module, batch, self.logprob_chunk)
        ref = self.reference(module, reference, batch, lambda m: pair_logps(m, batch, self.logprob_chunk))
        return pl.dpo(lp["chosen"], lp["rejected"], ref["chosen"], ref["rejected"],
                      beta=self.cfg.beta, loss_type=self.cfg.loss_type)


ALGORITHMS = {a.name: a for a in (GRPO, RLOO, PPO, OnlineDPO)}
