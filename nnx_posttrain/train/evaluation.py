"""Evaluation during a run: the algorithm's loss on held-out batches, and exact match of greedy
answers to held-out prompts (for algorithms whose module is a language model).

Per-problem exact match goes to ``<run_dir>/exact_match.jsonl``, one line per evaluation:
``{"step", "exact_match", "keys", "correct"}`` with ``keys[i]`` a CRC-32 (hex) of held-out prompt
i's text and ``correct[i]`` 1 or 0, so that runs can be compared problem by problem (paired
bootstrap, ``tools.preference_table``)."""

from __future__ import annotations

import json
import math
import zlib

import jax

from nnx_posttrain import data
from nnx_posttrain.sampling import generate
from nnx_posttrain.train.mesh import shard_batch
from nnx_posttrain.train.step import _sum_tree, metric_means


class Evaluator:
    """``evaluator(params, frozen) -> {metric: value}`` ({} when there is no eval data)."""

    def __init__(self, run, algorithm, loss_batches: list[dict], eval_step, mesh, states):
        """``loss_batches``: prepared held-out batches (``Inputs.eval``); ``eval_step``: the
        jitted ``step.make_eval_step``; ``states``: (params, frozen model) to build the greedy
        decoder's graph from."""
        self.run, self.algorithm, self.eval_step, self.mesh = run, algorithm, eval_step, mesh
        self.batches = loss_batches
        self.enabled = run.eval_src is not None
        cfg = run.cfg
        self.pairs, self.greedy = [], None
        if self.enabled and algorithm.generates and cfg.eval.exact_match:
            self.pairs = data.prompts_and_answers(run.eval_src, run.lm.chat_format,
                                                  cfg.eval.exact_match)
            graphdef = algorithm.policy_view(run.graphdef, *states)[0]
            self.greedy = generate.make_greedy(graphdef, cfg.eval.max_new_tokens)
        self.is_nll = algorithm.data_kind == "sft"  # SFT's loss is the mean NLL per token

    def __call__(self, params, frozen, step: int | None = None) -> dict:
        """The eval metrics; with ``step``, per-problem exact match is appended to the run's
        ``exact_match.jsonl``."""
        if not self.enabled:
            return {}
        sums = None
        for batch in self.batches:
            sharded = jax.tree.map(lambda x: x[0], shard_batch(batch, self.mesh, 1))
            out = self.eval_step(params, frozen, sharded)
            sums = out if sums is None else _sum_tree(sums, out)
        result = {}
        if sums is not None:
            _, _, metrics = jax.device_get(sums)
            result = {k: float(v) for k, v in metric_means(metrics).items()}
        if self.pairs:
            states = self.algorithm.policy_view(self.run.graphdef, params, frozen["model"])[1]
            accuracy, completions = generate.exact_match(self.run.lm, self.greedy, states,
                                                         self.pairs, self.run.cfg.eval.max_new_tokens)
            result["exact_match"] = accuracy
            if step is not None and jax.process_index() == 0:
                self._write_per_problem(step, accuracy, completions)
        if self.is_nll and math.isfinite(result["loss"]):
            result["perplexity"] = math.exp(min(result["loss"], 50.0))
        return result

    def _write_per_problem(self, step, accuracy, completions):
        keys = [f"{zlib.crc32(''.join(text for text, _ in segs).encode()):08x}"
                for segs, _ in self.pairs]  # as tools.seeds.prompt_key
        correct = [int(c.strip() == ref.strip()) for c, (_, ref) in zip(completions, self.pairs)]
        with (self.run.run_dir / "exact_match.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "exact_match": accuracy, "keys": keys,
                                "correct": correct}) + "\n")
