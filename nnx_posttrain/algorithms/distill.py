"""Distillation: a frozen teacher's next-token distributions into the student, on the student's
own samples (on-policy, TRL 1.16's ``DistillationTrainer``) and on the dataset's completions
(GKD's mixing, ``--algo.lmbda``).

The teacher (``--algo.teacher``: a built-in model, a KerasHub preset or local directory, or one
of our run directories) is loaded once, frozen, kept in ``--algo.teacher-dtype`` and laid out on
the mesh by the same rules as the student; it has no optimizer state and is never checkpointed
(a resume loads it again, and refuses another teacher). Student and teacher must share their
tokenizer. With probability ``lmbda`` per batch of SFT records, the student samples new
completions from the same prompts (everything before the first completion token) with the run's
current weights; else the batch keeps the dataset's completions or, with ``seq_kd``, gets the
teacher's greedy ones. The loss is ``losses.distill`` on the completion
tokens, both models' vocabulary projections a chunk of positions at a time.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_posttrain import agents, config as config_lib, errors, model
from nnx_posttrain.algorithms.base import (AlgorithmBase, DatasetBatches, Inputs,
                                           RunContext, eval_loss_batches, merged)
from nnx_posttrain.losses.common import out_of_range
from nnx_posttrain.losses.distill import DistillOptions, divergence, gkd
from nnx_posttrain.losses.router import RouterOptions, with_router_aux
from nnx_posttrain.sampling import generate, sampler


@dataclasses.dataclass(frozen=True)
class DistillConfig(DistillOptions, RouterOptions):
    """Distillation: a frozen teacher's token distributions into the student (generalized JSD, on-policy and offline).

    A mixture-of-experts student adds its router load-balancing loss (not the teacher's)."""

    teacher: str = ""
    """The teacher: a built-in model, a KerasHub preset or local directory, or a run directory of ours (its latest checkpoint, or --algo.teacher-step; LoRA applied). It must share the student's tokenizer."""
    teacher_step: int | None = None
    """A run directory teacher's checkpoint step (default: its latest)."""
    teacher_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """The teacher's weights and compute (bfloat16 halves its memory; a float32 student is fine with it). A run directory teacher keeps its run's dtype."""
    lmbda: float = 1.0
    """Fraction of batches whose completions the student samples (on-policy; TRL's core = 1.0); the rest keep the dataset's (GKD's lmbda)."""
    seq_kd: bool = False
    """Sequence-level KD (Kim & Rush 2016, GKD's seq_kd): the batches the student does not sample get the teacher's greedy completions instead of the dataset's."""
    max_completion_length: int = 512
    """Most tokens the student (or, with --algo.seq-kd, the teacher) generates per completion (TRL's max_completion_length); cut at --batching.max-length."""
    top_k: int = 0
    """The student samples from its k most likely tokens only; 0 = off."""
    top_p: float = 1.0
    """The student's nucleus sampling threshold; 1.0 = off."""
    tools: str = ""
    """Functions the sampling model may call, 'module:function,...' (as GRPO's; the schemas come from the data's 'tools' column, in its prompts): the samples are tool-calling exchanges, the results out of the loss."""
    max_tool_calling_iterations: int | None = None
    """Tool-calling turns per sample at most; default: until max_completion_length is used up."""
    tool_timeout: float = 10.0
    """Seconds a tool call may run; past it the call fails (its error is the model's result)."""

    def problems(self) -> list[str]:
        return DistillOptions.problems(self) + RouterOptions.problems(self) + [
            problem for name, ok, rule in (
                ("lmbda", 0.0 <= self.lmbda <= 1.0, "in [0, 1]"),
                ("top_k", self.top_k >= 0, ">= 0"),
                ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
                ("max_completion_length", self.max_completion_length >= 1, ">= 1"),
                ("tool_timeout", self.tool_timeout > 0, "> 0"))
            for problem in out_of_range(self, name, ok, rule)]


@dataclasses.dataclass
class DistillRunConfig(config_lib.Config):
    """A Distill run's settings: the common ones, Distill's own under ``algo``."""

    algo: DistillConfig = dataclasses.field(default_factory=DistillConfig)


class Distill(AlgorithmBase):
    name = "distill"
    Config = DistillConfig
    RunConfig = DistillRunConfig
    data_kind = "sft"
    sequences_per_example = 2  # the student's forward and the teacher's
    defaults = dict(optim=dict(learning_rate=1e-6))  # TRL's DistillationConfig
    plannable = False
    plannable_not = ("the teacher is a second model loaded beside the student and its batches "
                     "mix sampled completions; plan the student's SFT step, and the teacher's "
                     "weights in --algo.teacher-dtype on top")

    def check(self, run_cfg) -> None:
        super().check(run_cfg)
        c, problems = self.cfg, []
        if not c.teacher:
            problems.append("--algo.teacher is required (a model name, a preset directory or a run "
                            "directory)")
        elif ("/" in c.teacher and "://" not in c.teacher) and not Path(c.teacher).exists():
            problems.append(f"--algo.teacher {c.teacher}: no such directory"
                            + (" (the built-in recipe's teacher is the default GRPO run: run "
                               "`python -m experiments.sft` and `python -m experiments.grpo` "
                               "first, or pass --algo.teacher)"
                               if c.teacher == "runs/grpo" else ""))
        agents.Toolset(c.tools)  # importable, documented: before the model loads
        if problems:
            raise errors.ConfigError("; ".join(problems))

    def partner(self, lm, echo, load_run):
        """The teacher's frozen state (its graphdef kept here, for the loss), after checking it
        shares the student's tokenizer: its tokenizer alone first, then the loaded model."""
        c = self.cfg
        trained = _run_config(c.teacher)
        name = trained["model"] if trained else c.teacher
        _check_chat_formats(lm.chat_format, model.chat_format_of(
            name, trained.get("chat_format") if trained else None), c.teacher)
        early = model.load_tokenizer(name)
        if early is not None:
            _check_tokenizers(lm, early, None, c.teacher)
        if trained:
            run = load_run(c.teacher, c.teacher_step, echo=echo)
            teacher_lm, module = run.lm, run.policy()
            echo(f"teacher: {c.teacher} checkpoint {run.step}")
        else:
            teacher_lm = model.load(c.teacher, dtype=self._teacher_dtype())
            module = teacher_lm.module
            echo(f"teacher: {model.describe(teacher_lm)} ({c.teacher_dtype})")
        _check_chat_formats(lm.chat_format, teacher_lm.chat_format, c.teacher)
        _check_tokenizers(lm, teacher_lm.tokenizer, teacher_lm.module, c.teacher)
        _frozen(teacher_lm.module)
        self.teacher_graphdef, state = nnx.split(module)
        return state

    def partner_bytes(self) -> int | None:
        """The teacher's weights in memory, from its files (a preset or Hugging Face directory,
        or the local model a run directory trained), before it loads."""
        trained = _run_config(self.cfg.teacher)
        if trained:
            name = trained.get("model", "")
            return model.weights_bytes(name, model.resolve_dtype(
                name, trained.get("dtype", "float32"), bool(trained.get("lora", {}).get("rank"))))
        return model.weights_bytes(self.cfg.teacher, self._teacher_dtype())

    def _teacher_dtype(self) -> str:
        """The ``model.DTYPES`` name a teacher by name or directory is loaded in."""
        return "bfloat16-params" if self.cfg.teacher_dtype == "bfloat16" else "float32"

    def loss(self, module, batch, teacher_state):
        teacher = nnx.merge(self.teacher_graphdef, teacher_state)
        c = self.cfg
        # TRL's DistillationTrainer / GKDTrainer do not add it: transformers' convention
        with model.routers_captured(module, c.router_aux_loss_coef) as routers:  # the student's
            div, entropy = model.paired_terms(
                (module, teacher), batch["input_ids"], batch["attention_mask"],
                lambda s, t: divergence(s, t, c), self.logprob_chunk,
                positions=batch.get("positions"))
        return with_router_aux(gkd(div, entropy, batch["loss_mask"]), routers.routed())

    def inputs(self, run: RunContext, params) -> Inputs:
        return Inputs(MixedBatches(self, run, params), eval_loss_batches(self, run))


def _frozen(backbone) -> None:
    """Every teacher weight a constant of the step; on CPU, 16-bit weights read a decoder block
    at a time (``model.frozen``: XLA:CPU would otherwise hold a float32 copy of them all)."""
    backbone.trainable = False
    for variable in backbone.weights:  # the layers' flag does not reach their variables
        variable.trainable = False
    sixteen_bits = any(str(v.dtype) in ("bfloat16", "float16") for v in backbone.weights)
    model.set_remat(backbone, False, lazy_frozen=sixteen_bits and jax.default_backend() == "cpu")


def _run_config(teacher: str) -> dict | None:
    """The saved settings of a run directory teacher (None: not a run directory)."""
    saved = Path(teacher) / "config.json"
    if (Path(teacher) / "checkpoints").is_dir() and saved.is_file():
        return json.loads(saved.read_text())
    return None


def _check_chat_formats(student: str, teacher: str | None, name: str) -> None:
    """Refuse a teacher of another chat format (None: not known yet)."""
    if teacher is not None and student != teacher:
        raise errors.ModelError(
            f"--algo.teacher {name}: its chat format is {teacher}, the student's {student}: the "
            "two models would read the same tokens as different conversations (pass "
            "--chat-format so that they agree)")


def _check_tokenizers(student, tokenizer, module, name: str) -> None:
    """Refuse a teacher whose tokenizer (and, once loaded, ``module``'s embedding rows) is not
    the student's."""
    probe = "The teacher and the student: 12 + 30 = 42."
    same = (student.tokenizer.vocab_size == tokenizer.vocab_size
            and student.tokenizer.encode(probe) == tokenizer.encode(probe)
            and (module is None or int(student.module.token_embedding.input_dim)
                 == int(module.token_embedding.input_dim)))
    if not same:
        raise errors.ModelError(
            f"--algo.teacher {name}: its tokenizer is not the student's (vocabularies of "
            f"{tokenizer.vocab_size:,} and {student.tokenizer.vocab_size:,} tokens, or "
            "other ids for the same text): distillation compares the two models' distributions "
            "token by token, so both need the same vocabulary")


class MixedBatches(DatasetBatches):
    """The dataset's SFT batches; with probability ``lmbda`` per step (by seed and step, so a
    resumed run draws the same), their completions replaced by the student's samples, and
    otherwise, with ``seq_kd``, by the teacher's greedy completions."""

    WINDOW = ("truncated", "lengths", "drawn")

    def __init__(self, algorithm: Distill, run: RunContext, params):
        super().__init__(algorithm, run)
        c, b = algorithm.cfg, run.cfg.batching
        self.lm, self.seed, self.length = run.lm, run.cfg.seed, b.max_length
        self.graphdef, self.frozen = run.graphdef, run.frozen
        self.toolset = agents.Toolset(c.tools, timeout=c.tool_timeout)
        self.loop = (agents.ToolLoop(run.lm, c.max_completion_length,
                                     c.max_tool_calling_iterations)
                     if self.toolset.enabled else None)
        context = b.max_length + (c.max_completion_length if self.loop else 0)
        sampler.check_generation(run.lm.module, b.batch_size, context, c.max_completion_length,
                                 "--algo.max-completion-length", run.cfg.memory_check)
        policy_graphdef, _ = algorithm.policy_view(run.graphdef, params, run.frozen["model"])
        pad_id = run.lm.tokenizer.pad_id
        self.sample = sampler.make_sampler(policy_graphdef, c.max_completion_length, top_k=c.top_k,
                                           pad_id=pad_id)
        self.teacher_sample = (sampler.make_sampler(algorithm.teacher_graphdef,
                                                    c.max_completion_length, pad_id=pad_id)
                               if c.seq_kd else None)
        self.stop_ids = jnp.asarray(generate.stop_ids(run.lm), jnp.int32)
        self.lengths, self.drawn = [], []

    def next(self, step, state):
        batch = super().next(step, state)
        c = self.algorithm.cfg
        on_policy = np.random.default_rng([self.seed, step]).random() < c.lmbda
        self.drawn.append(float(on_policy))
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        if on_policy:
            _, states = self.algorithm.policy_view(self.graphdef, state["params"],
                                                   self.frozen["model"])
            return self._completed(batch, lambda p, m, budget, turn: self.sample(
                tuple(states), p, m, jax.random.fold_in(key, turn) if turn else key,
                sampler.Draw(jnp.float32(c.temperature), jnp.float32(c.top_p), self.stop_ids,
                             self.lm.tokenizer.vocab_size, budget)))
        if c.seq_kd:  # greedy: the teacher's mode, as sequence-level KD approximates it
            return self._completed(batch, lambda p, m, budget, turn: self.teacher_sample(
                (self.frozen["partner"],), p, m, key, sampler.Draw(
                    jnp.float32(0.0), jnp.float32(1.0), self.stop_ids,
                    self.lm.tokenizer.vocab_size, budget)))
        return batch

    def _generated(self, prompts, generate_from) -> list[tuple[np.ndarray, np.ndarray]]:
        """(completion ids, loss mask) of each prompt: one sampler call, or with tools the
        tool-calling loop (the results' tokens out of the loss)."""
        def sample(ids, mask, budget, turn):
            return jax.device_get(generate_from(ids, mask, budget, turn))
        if self.loop is not None:
            ex = self.loop(sample, prompts, self.toolset.open([{} for _ in prompts]))
            return [(row[m > 0], learn[m > 0]) for row, m, learn in
                    zip(ex.completion_ids, ex.completion_mask, ex.tool_mask)]
        prompt_ids, prompt_mask = sampler.pad_prompts(prompts, self.lm.tokenizer.pad_id)
        out = sample(prompt_ids, prompt_mask, None, 0)
        return [(np.asarray(row)[m.astype(bool)], np.ones(int(m.sum()), np.int32))
                for row, m in zip(out["completion_ids"], np.asarray(out["completion_mask"]))]

    def _completed(self, batch: dict, generate_from) -> dict:
        """``batch`` with each row's completion replaced by what ``generate_from(prompt_ids,
        prompt_mask, budget, turn)`` (a sampler call) generates from its prompt (cut at
        --batching.max-length)."""
        ids, loss_mask = np.asarray(batch["input_ids"]), np.asarray(batch["loss_mask"])
        starts = np.where(loss_mask.any(axis=1), loss_mask.argmax(axis=1), 0)
        prompts = [[int(t) for t in row[:max(int(s), 1)]] for row, s in zip(ids, starts)]
        rows = np.full_like(ids, self.lm.tokenizer.pad_id)
        attention, mask = np.zeros_like(ids), np.zeros_like(loss_mask)
        for i, (prompt, (completion, learn)) in enumerate(
                zip(prompts, self._generated(prompts, generate_from))):
            row = np.concatenate([prompt, completion])[:self.length]
            rows[i, :len(row)], attention[i, :len(row)] = row, 1
            mask[i, len(prompt):len(row)] = learn[:len(row) - len(prompt)]
            self.lengths.append(int(mask[i].sum()))
        return dict(batch, input_ids=rows, attention_mask=attention, loss_mask=mask)

    def host_metrics(self):
        out = super().host_metrics()
        if self.lengths:
            lengths = np.asarray(self.lengths, np.float64)
            out.update({"completions/mean_length": float(lengths.mean()),
                        "completions/min_length": float(lengths.min()),
                        "completions/max_length": float(lengths.max())})
        if self.drawn:
            out["on_policy"] = float(np.mean(self.drawn))
        self.lengths, self.drawn = [], []
        return out
