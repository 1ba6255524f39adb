"""The rollout engine of online RL, and what every online algorithm shares.

Each step of an online algorithm starts from a batch of prompts and a *rollout*:

    prompts --sampler--> completions --reward functions--> rewards --> advantages
            (KV cache, compiled once)       (text, TRL signature)     (group / leave-one-out / GAE)

``Rollouts`` is the batch source the training loop iterates (``algorithms.base.BatchSource``): it
samples with the current policy, scores, and asks the algorithm to turn the scored rollout into
its training batch (``make_batch``). With ``num_iterations`` > 1 a rollout is reused for that many
optimizer steps (the log-probs of the policy that generated it are kept as ``old_logps``);
checkpoints are allowed only between rollouts, so a resumed run regenerates nothing and continues
exactly (the sampling RNG of step s is derived from the seed and s).

``--batching.batch-size`` counts completions per optimizer step (TRL's convention): each step
draws ``batch_size / num_generations`` prompts.
"""

from __future__ import annotations

import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from nnx_posttrain import data, errors, model
from nnx_posttrain.algorithms.base import (AlgorithmBase, HostWindow, Inputs, RunContext,
                                           device_batch)
from nnx_posttrain.algorithms.online import agentic, generation
from nnx_posttrain.algorithms.online import rewards as rewards_lib
from nnx_posttrain.sampling import generate, sampler


class OnlineAlgorithm(AlgorithmBase):
    """Generates its own training batches from prompts (see the module docstring). Subclasses
    give ``make_batch`` (scored rollout -> training batch) and ``loss``."""

    data_kind = "prompt_only"
    sequences_per_example = 1
    min_generations = 1  # completions per prompt the method needs (GRPO's, RLOO's groups: 2)
    runs_tools = False  # whether the rollouts may call tools (--algo.tools, --algo.environment)
    reads_images = False  # whether its prompts may hold images (the rollout and loss read them)

    def __init__(self, cfg, logprob_chunk: int | None = None):
        super().__init__(cfg, logprob_chunk)
        self.toolset = agentic.toolset(cfg)  # imported and checked before the model loads
        if self.toolset.enabled and not self.runs_tools:
            raise errors.ConfigError(f"{self.name} does not run tools (--algo.tools, "
                                     "--algo.environment): GRPO and RLOO do")
        if not cfg.rewards.strip() and not self.toolset.rewarding():
            raise errors.ConfigError(
                f"{self.name} needs --algo.rewards: the functions that score each "
                "completion, comma-separated: 'module:function' (TRL's signature f(prompts, "
                "completions, **columns) -> list[float | None]; the data's other columns arrive "
                "by name), a built-in (exact_match: the completion's first integer equals the "
                "'answer' column; format; length), or a reward-model run directory. The built-in "
                "task's recipe (--data builtin) uses exact_match.")

    def check(self, run_cfg) -> None:
        """The sampling settings, before anything loads (one ``ConfigError`` listing all)."""
        super().check(run_cfg)
        problems = self.problems()
        g = self.cfg.num_generations
        if g >= 1 and run_cfg.batching.batch_size % g:
            problems.append(f"--batching.batch-size {run_cfg.batching.batch_size} must be a "
                            f"multiple of --algo.num-generations {g}")
        if problems:
            raise errors.ConfigError("invalid configuration:\n  " + "\n  ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with the algorithm's settings (subclasses add their own)."""
        c, g, least = self.cfg, self.cfg.num_generations, self.min_generations
        return [f"--algo.{name.replace('_', '-')} must be {rule}, got {getattr(c, name)}"
                for name, ok, rule in (
                    ("num_generations", g >= least, f">= {least}" + (
                        " (the advantages compare each completion with the other ones of "
                        "its prompt)" if least > 1 else "")),
                    ("max_completion_length", c.max_completion_length >= 1, ">= 1"),
                    ("temperature", c.temperature >= 0, ">= 0"),
                    ("top_k", c.top_k >= 0, ">= 0"),
                    ("top_p", 0 < c.top_p <= 1, "in (0, 1]"),
                    ("num_iterations", c.num_iterations >= 1, ">= 1"),
                    ("max_tool_calling_iterations", (c.max_tool_calling_iterations or 0) >= 0,
                     ">= 0"),
                    ("tool_timeout", c.tool_timeout > 0, "> 0"))
                if not ok]

    def open_sources(self, run_cfg):
        """The sources, and the reward functions checked against them (found, importable, the
        columns they read present)."""
        train, held_out = super().open_sources(run_cfg)
        if self.cfg.rewards.strip():  # else the environments score (checked in __init__)
            rewards_lib.check(self.cfg, train, run_cfg.data)
        for i in range(min(len(train), 100) if self.toolset.enabled else 0):
            self.toolset.check_record(train[i])  # multi-environment runs: the class it names
            if "prompt" in train[i] and not isinstance(train[i]["prompt"], list):
                raise errors.DataError(f"{train[i].get('_where', f'record {i}')}: field 'prompt' "
                                       "must be a conversation (a list of messages) for a run "
                                       "with tools: the tools go into its chat template")
        return train, held_out

    def settings_for_data(self, run_cfg, echo):
        """Held-out prompts are kept whatever their columns: their greedy answers are scored by
        the run's rewards (exact match only where there is an answer)."""
        return run_cfg

    def setup(self, module):
        if not self.needs_reference():
            return  # reference-free: no second copy of the weights
        super().setup(self.policy(module))
        if self.reference_mode == "precompute":
            raise errors.ConfigError(
                f"{self.name}: --algo.reference precompute does not apply to online methods "
                "(the completions are new at every step); use lora_base or copy")

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
        """Prompts per optimizer step (``batch_size`` counts completions)."""
        return batch_size // self.cfg.num_generations

    def inputs(self, run: RunContext, params) -> Inputs:
        # the loss needs rollouts: held-out data is evaluated by generation only
        return Inputs(Rollouts(self, run, params), [])

    def attach(self, rollouts: "Rollouts") -> None:
        """Called once the rollout engine exists (compile extra rollout-time forwards here)."""

    def make_batch(self, batch, scores, finished, rollouts: "Rollouts", state) -> tuple[dict, dict]:
        """A scored rollout (``batch`` of numpy arrays, ``scores`` [B], ``finished`` [B]) ->
        (training batch, host metrics)."""
        raise NotImplementedError

    def policy_logps(self, module, batch, with_entropy=True):
        projection = model.Projection(self.logprob_chunk, self.logprob_temperature,
                                      entropy=with_entropy)
        return model.token_logprobs(self.policy(module), batch["input_ids"],
                                    batch["attention_mask"], projection, batch.get("positions"))


def rollout_rows(batch: dict) -> dict:
    """The arrays of a rollout batch its log-probs are computed from (with its images)."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "positions", "pixel_values")
            if k in batch}


class Rollouts(HostWindow):
    """The batch source of online algorithms: prompts -> rollout -> training batch, reused for
    ``num_iterations`` steps."""

    WINDOW = ("truncated", "since_log")  # not the seconds: a resumed run times its own steps

    def __init__(self, algorithm: OnlineAlgorithm, run: RunContext, params):
        cfg, b, c = run.cfg, run.cfg.batching, algorithm.cfg
        self.algorithm, self.lm, self.train_src, self.seed = algorithm, run.lm, run.train_src, cfg.seed
        self.graphdef, self.frozen = run.graphdef, run.frozen
        self.reward_fns = rewards_lib.resolve(c.rewards, run.load_run) if c.rewards.strip() else []
        self.reward_weights = rewards_lib.weights(c.reward_weights, len(self.reward_fns))
        self.agent = None
        if algorithm.toolset.enabled:  # environments' rewards: weight 1, as TRL
            self.agent = agentic.ToolRollouts(algorithm.toolset, run.lm, c,
                                              b.max_prompt_length or b.max_length)
            extra = self.agent.reward_functions()
            self.reward_fns += extra
            self.reward_weights = np.concatenate([self.reward_weights, np.ones(len(extra))])
        if len(run.train_src):  # before the first rollout: the rewards' columns are there
            rewards_lib.check_columns(self.reward_fns, data.extra_columns(run.train_src, [0],
                                                                          exclude=())[0],
                                      cfg.data)
        self.stop_ids = jnp.asarray(generate.stop_ids(run.lm), jnp.int32)
        policy_graphdef, _ = algorithm.policy_view(run.graphdef, params, run.frozen["model"])
        context = (b.max_prompt_length or b.max_length) + (  # a tool turn's context is longer
            c.max_completion_length if self.agent else 0)
        sampler.check_generation(run.lm.module, b.batch_size, context, c.max_completion_length,
                                 "--algo.max-completion-length", cfg.memory_check)
        self._sample = sampler.make_sampler(policy_graphdef, c.max_completion_length, top_k=c.top_k,
                                            pad_id=run.lm.tokenizer.pad_id)
        self._logps_jit = jax.jit(self._rollout_logps, static_argnums=(3, 4))
        algorithm.attach(self)
        self.prompts = data.train_batches(run.train_src, data.Indexed(run.transform),
                                          algorithm.prompts_per_step(b.batch_size), cfg.seed,
                                          b.shuffle, b.num_workers)
        self.current, self.since_log, self.truncated, self.sample = None, [], 0, []
        # what TRL passes rewards as trainer_state: the optimizer steps done, of how many
        self.trainer_state = types.SimpleNamespace(global_step=0, max_steps=cfg.steps)
        self.rewards_per_func = None  # of the latest rollout (for make_batch)
        self.seconds = {"rollout": 0.0, "update": 0.0, "steps": 0, "updates": 0}
        self._last = None  # when the previous rollout ended

    # -- the batch source

    def fresh(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) starts with a new rollout."""
        return (step - 1) % self.algorithm.cfg.num_iterations == 0

    def next(self, step, state):
        # The time between two calls is the update(s) of the steps in between: wait for the
        # state they produce (the dispatch is asynchronous) before timing the rollout.
        jax.block_until_ready(state["params"])
        now = time.perf_counter()
        if self._last is not None:
            self.seconds["update"] += now - self._last
            self.seconds["updates"] += 1
        if self.fresh(step) or self.current is None:
            self.trainer_state.global_step = step - 1
            prompts = next(self.prompts)
            self.truncated += int(prompts["truncated"].sum())
            self.current = self.rollout(step, state, prompts)
            self.since_log.append(self.current[1])
        self._last = time.perf_counter()
        self.seconds["rollout"] += self._last - now
        self.seconds["steps"] += 1
        return self.current[0]

    def to_device(self, batch):
        return device_batch(self.algorithm, batch)

    def host_metrics(self):
        """``truncated`` prompts, the means of the rollouts since the last call (or of the
        rollout being reused), and the seconds per step spent generating and scoring
        (``time/rollout``) and in the optimizer update (``time/update``, the previous steps'
        updates: everything between two rollouts, the first step's compilation included)."""
        out = {"truncated": float(self.truncated)}
        out.update(generation.means(self.since_log or [self.current[1]]))
        t = self.seconds
        out["time/rollout"] = t["rollout"] / max(t["steps"], 1)
        if t["updates"]:
            out["time/update"] = t["update"] / t["updates"]
        self.since_log, self.truncated = [], 0
        self.seconds = {"rollout": 0.0, "update": 0.0, "steps": 0, "updates": 0}
        return out

    def logged_completions(self) -> list[dict]:
        """A sample of the latest rollout (``--algo.log-completions`` rows: prompt, completion,
        rewards, advantage), once per rollout."""
        out, self.sample = self.sample, []
        return out

    def checkpoint_ok(self, step):
        return self.fresh(step + 1)

    def get_state(self):
        return self.prompts.get_state()

    def set_state(self, state):
        self.prompts.set_state(state)

    def close(self):
        getattr(self.prompts, "close", lambda: None)()

    # -- the rollout

    def compile(self, fn):
        """``fn(module, reference_module, *arrays)`` jitted over the training state: returns
        ``f(state, *arrays)`` (without gradient: rollout-time forwards)."""
        def run(params, frozen, *arrays):
            module, reference = model.merge(self.graphdef, params, frozen)
            return fn(module, reference, *arrays)

        jitted = jax.jit(run)
        return lambda state, *arrays: jitted(state["params"], self.frozen, *arrays)

    @property
    def tool_answers(self):
        """``f(states, src, index)``: greedy tool-calling answers, scored (evaluation of a run
        with tools: ``agentic.held_out_answers``); None without tools."""
        if self.agent is None:
            return None
        return lambda states, src, index: agentic.held_out_answers(self, states, src, index)

    def sampler_call(self, states, rng, temperature, top_p):
        """``sample(ids, mask, budget, turn)``: the policy's sampler on host arrays (turn t draws
        with ``rng`` folded with t; turn 0 with ``rng`` itself)."""
        def sample(ids, mask, budget, turn, pixel_values=None):
            key = rng if turn == 0 else jax.random.fold_in(rng, turn)
            return jax.device_get(self._sample(tuple(states), ids, mask, key, sampler.Draw(
                jnp.float32(temperature), jnp.float32(top_p), self.stop_ids,
                self.lm.tokenizer.vocab_size, budget), pixel_values))
        return sample

    def generate(self, states, rng, prompts: dict, g: int) -> generation.Generated:
        """The rollout's sequences: ``g`` completions of each prompt of the batch."""
        c = self.algorithm.cfg
        sample = self.sampler_call(states, rng, c.temperature, c.top_p)
        index = np.repeat(np.asarray(prompts["index"]), g, axis=0)
        pixels = generation.prompt_pixels(self.algorithm, prompts, g, self.agent is not None)
        if self.agent is not None:
            return self.agent.generate(sample, self.train_src, index)
        prompt_ids = np.repeat(np.asarray(prompts["prompt_ids"]), g, axis=0)
        prompt_mask = np.repeat(np.asarray(prompts["prompt_mask"]), g, axis=0)
        out = sample(prompt_ids, prompt_mask, None, 0, pixels)
        ids, mask = np.asarray(out["completion_ids"]), np.asarray(out["completion_mask"])
        return generation.Generated(prompt_ids, prompt_mask, ids, mask.astype(np.int32),
                                    mask.astype(np.int32), np.asarray(out["finished"]).astype(bool),
                                    self._texts(ids, mask), pixel_values=pixels)

    def rollout(self, step: int, state: dict, prompts: dict) -> tuple[dict, dict]:
        """Prompts batch -> (training batch of numpy arrays, host metrics)."""
        algo = self.algorithm
        c, g = algo.cfg, algo.cfg.num_generations
        index = np.repeat(np.asarray(prompts["index"]), g, axis=0)
        _, states = algo.policy_view(self.graphdef, state["params"], self.frozen["model"])
        rng = jax.random.fold_in(jax.random.key(self.seed), step)
        gen = self.generate(states, rng, prompts, g)
        scores, metrics, per_fn = self._rewards(gen, index)
        finished = gen.finished
        # tool results carry no loss and are out of the ratios (TRL's tool_mask)
        loss_mask = gen.model_mask * (finished[:, None] if c.mask_truncated_completions else 1)
        width, shape = gen.prompt_ids.shape[1], gen.completion_ids.shape
        batch = {
            "input_ids": np.concatenate([gen.prompt_ids, gen.completion_ids], axis=1),
            "attention_mask": np.concatenate([gen.prompt_mask, gen.completion_mask], axis=1),
            "loss_mask": np.concatenate([np.zeros_like(gen.prompt_mask), loss_mask], axis=1),
            # only the completion's positions go through the vocabulary projection
            "positions": np.broadcast_to(np.arange(width, width + shape[1], dtype=np.int32),
                                         shape).copy(),
        }
        if gen.pixel_values is not None:  # each completion's prompt images: the forward's too
            batch["pixel_values"] = gen.pixel_values
        metrics.update(generation.completion_metrics(gen.model_mask, finished), **gen.metrics)
        batch, extra = algo.make_batch(batch, scores, finished, self, state)
        metrics.update(extra)
        self.sample = self._sample_rows(gen, scores, per_fn, batch.get("advantages"))
        return batch, metrics

    def _sample_rows(self, gen, scores, per_fn, advantages):
        rows = []
        for i in range(min(self.algorithm.cfg.log_completions, len(gen.texts))):
            row = {"prompt": self.lm.tokenizer.decode(
                       [int(t) for t, m in zip(gen.prompt_ids[i], gen.prompt_mask[i]) if m]),
                   "completion": gen.texts[i], "reward": float(scores[i])}
            row.update({f"rewards/{name}": float(v[i]) for name, v in per_fn.items()})
            if advantages is not None and np.ndim(advantages) == 1:
                row["advantage"] = float(advantages[i])
            rows.append(row)
        return rows

    def _texts(self, ids, mask) -> list[str]:
        return generation.decode_texts(self.lm, np.asarray(self.stop_ids), ids, mask)

    def score(self, src, index, completions):
        """``completions`` (``generation.Completions``) of the records of ``src`` at ``index``
        -> ([B] weighted reward sum, {function name: [B] rewards, NaN where it does not apply})
        (``rewards.score_batch``). Rollouts score with it, and evaluation scores greedy answers
        to held-out prompts."""
        return rewards_lib.score_batch(self.reward_fns, self.reward_weights, src, index,
                                       completions, self.trainer_state)

    def _rewards(self, gen, index):
        """[B] weighted reward sum, the per-function metrics, the per-function rewards."""
        total, per_fn = self.score(self.train_src, index, gen.completions)
        metrics = {}
        for name, values in per_fn.items():
            applies = values[np.isfinite(values)]
            metrics[f"rewards/{name}/mean"] = float(applies.mean()) if len(applies) else np.nan
            metrics[f"rewards/{name}/std"] = float(applies.std()) if len(applies) else np.nan
        # [B, functions], NaN where a function returned None
        self.rewards_per_func = np.stack([per_fn[name] for name, _ in self.reward_fns], axis=1)
        if np.isnan(self.rewards_per_func).all():  # TRL warns too; shown once per run
            warnings.warn(
                f"no completion of the batch got a reward: {', '.join(per_fn)} returned None (or "
                "NaN) for every completion, so this step learns nothing (are the rewards' "
                "columns those of the data?)", RuntimeWarning, stacklevel=2)
        groups = total.reshape(-1, self.algorithm.cfg.num_generations)
        metrics["reward"] = float(total.mean())
        if groups.shape[1] > 1:  # within-group spreads (PPO's groups of one have none)
            metrics["reward_std"] = float(groups.std(axis=1, ddof=1).mean())
            metrics["frac_reward_zero_std"] = float((groups.std(axis=1) == 0).mean())
        return total, metrics, per_fn

    def _rollout_logps(self, params, frozen, rows: dict, with_old: bool, with_ref: bool):
        """Per-token log-probs of the rollout's ``rows`` (``input_ids``, ``attention_mask``,
        ``positions``) under the current policy (``old_logps``) and the reference
        (``ref_logps``), at the sampling temperature, without gradient."""
        algo = self.algorithm
        module, reference = model.merge(self.graphdef, params, frozen)
        policy = algo.policy(module)
        projection = model.Projection(algo.logprob_chunk, algo.logprob_temperature)
        def fwd(m):
            with model.images(rows.get("pixel_values")):  # as the training step's forward
                return model.token_logprobs(m, rows["input_ids"], rows["attention_mask"],
                                            projection, rows["positions"])
        out = {}
        if with_old:
            out["old_logps"] = fwd(policy)
        if with_ref:
            out["ref_logps"] = algo.reference(
                policy, None if reference is None else algo.policy(reference), fwd)
        return out

    def logps(self, batch, state, with_old: bool, with_ref: bool) -> dict:
        """``old_logps`` and / or ``ref_logps`` of a rollout batch, as numpy arrays."""
        if not (with_old or with_ref):
            return {}
        out = self._logps_jit(state["params"], self.frozen, rollout_rows(batch), with_old,
                              with_ref)
        return {k: np.asarray(v) for k, v in jax.device_get(out).items()}
