"""Evaluation during a run: the algorithm's loss on held-out batches, exact match of greedy
answers to held-out prompts (for algorithms whose module is a language model), and for online
methods the held-out **reward** (the run's reward functions applied to the greedy completions of
the held-out prompts).

Every evaluation keeps its completions (``Evaluator.completions``: prompt, greedy completion,
reference answer, score; and the rewards for online methods), which the loop logs to
``completions.jsonl`` and TensorBoard text, as TRL's ``log_completions``.

Per-problem exact match goes to ``<run_dir>/exact_match.jsonl``, one line per evaluation:
``{"step", "exact_match", "keys", "correct"}`` with ``keys[i]`` a CRC-32 (hex) of held-out prompt
i's text (and its images' pixel values, a vision model's) and ``correct[i]`` 1 or 0, so that runs
can be compared problem by problem (paired bootstrap, ``tools.preference_table``).

A vision model's held-out prompts are sampled with their images (``sampler.ImagePrompts``): the
records' ``images`` as the training forward reads them.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib

import jax
import numpy as np

from nnx_posttrain import chat, data
from nnx_posttrain.algorithms.online.generation import Completions
from nnx_posttrain.data import images
from nnx_posttrain.sampling import generate, sampler
from nnx_posttrain.train.mesh import shard_batch
from nnx_posttrain.train.step import _sum_tree, make_eval_step, metric_means


def scored_data(cfg) -> dict:
    """What an ``--eval-only`` record scored: the eval data as given, a digest of their content
    (``data.signature``: file names, sizes, hashes of both ends) and the settings that decide
    the score."""
    digest = hashlib.sha256(json.dumps(data.signature(cfg.eval_data)).encode()).hexdigest()
    e = cfg.eval
    return {"eval_data": cfg.eval_data, "eval_data_signature": digest[:16],
            "eval_settings": f"batches {e.batches}, exact_match {e.exact_match}, max_new_tokens "
                             f"{e.max_new_tokens}, max_length {cfg.batching.max_length}"}


class Evaluator:
    """``evaluator(params, frozen) -> {metric: value}`` ({} when there is no eval data)."""

    def __init__(self, run, algorithm, inputs, mesh, params):
        """``run``: the algorithm's ``RunContext``; ``inputs``: its ``Inputs`` (the prepared
        held-out batches of the eval loss, and the training batch source, whose ``score`` (the
        rollout engine's reward functions, online methods) gives the held-out reward);
        ``params``: the trainable weights, to build the greedy decoder's graph from."""
        self.run, self.algorithm, self.mesh = run, algorithm, mesh
        self.eval_step = jax.jit(make_eval_step(run.graphdef, algorithm.loss))
        self.batches = inputs.eval
        self.enabled = run.eval_src is not None
        cfg = run.cfg
        self.pairs, self.greedy, self.completions = [], None, []
        self.scorer = getattr(inputs.train, "score", None) if algorithm.generates else None
        self.tool_answers = getattr(inputs.train, "tool_answers", None)  # runs with tools
        self.spec = getattr(run.lm, "images", None)  # a vision model's image handling
        if self.enabled and algorithm.generates and cfg.eval.exact_match:
            # (segs, ref, index, pixel values or None): every held-out prompt, answered or not,
            # for online methods; those with a reference answer for the others
            self.pairs = (held_out_prompts(run.eval_src, run.lm.chat_format, cfg.eval.exact_match,
                                           self.spec) if self.scorer is not None else
                          [(p[0], p[1], None, p[2] if self.spec else None)
                           for p in data.prompts_and_answers(run.eval_src, run.lm.chat_format,
                                                             cfg.eval.exact_match, self.spec)])
            graphdef = algorithm.policy_view(run.graphdef, params, run.frozen["model"])[0]
            longest = max((len(ids) for ids in self._prompt_ids()), default=0)
            sampler.check_generation(run.lm.module, min(64, len(self.pairs)), longest,
                                     cfg.eval.max_new_tokens, "--eval.max-new-tokens",
                                     cfg.memory_check)
            self.greedy = generate.make_greedy(graphdef, cfg.eval.max_new_tokens)

    def metric_names(self, params, frozen) -> set[str]:
        """The names of the metrics a call returns (the loss's traced, not computed)."""
        names = {"exact_match"} if self.pairs else set()
        if self.enabled and self.batches:
            sharded = jax.tree.map(lambda x: x[0], shard_batch(self.batches[0], self.mesh, 1))
            names |= self.algorithm.eval_metric_names(
                set(jax.eval_shape(self.eval_step, params, frozen, sharded)[2]))
        return names

    def __call__(self, params, frozen, step: int | None = None) -> dict:
        """The eval metrics; with ``step``, per-problem exact match is appended to the run's
        ``exact_match.jsonl``."""
        self.completions = []
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
            counted = {k for k, (_, c) in metrics.items() if c > 0}  # as drop_uncounted
            result = {k: float(v) for k, v in metric_means(metrics).items() if k in counted}
        if self.pairs:
            states = self.algorithm.policy_view(self.run.graphdef, params, frozen["model"])[1]
            result.update(self._generate(states))
            if step is not None and "exact_match" in result and jax.process_index() == 0:
                self._write_per_problem(step, result["exact_match"])
        return self.algorithm.eval_metrics(result)

    def _prompt_ids(self) -> list[list[int]]:
        """The held-out prompts' token ids (their image markers expanded to the image tokens)."""
        return [generate.encode_prompt(self.run.lm, images.expand_segments(self.spec, segs))
                for segs, *_ in self.pairs]

    def _prompts(self):
        """The held-out prompts as the sampler reads them: token ids, with their images
        (``sampler.ImagePrompts``) when any has one (a prompt without: a blank image slot)."""
        ids = self._prompt_ids()
        if all(pixels is None for *_, pixels in self.pairs):
            return ids
        blank = self.spec.pixels([])
        return sampler.ImagePrompts(ids, np.stack([blank if pixels is None else pixels
                                                   for *_, pixels in self.pairs]))

    def _generate(self, states) -> dict:
        """Greedy answers to the held-out prompts (with their images): exact match, the held-out
        reward (online methods), and the completion rows to log."""
        lm, prompts = self.run.lm, self._prompts()
        rows = [{"prompt": "".join(text for text, _ in segs), "reference": ref}
                for segs, ref, *_ in self.pairs]
        self.keys = [prompt_key(row["prompt"], pixels) for row, (*_, pixels)
                     in zip(rows, self.pairs)]
        out = {}
        if self.scorer is None:
            texts = sampler.sample_ids(lm, self.greedy, states, prompts, sampler.GREEDY,
                                       batch_size=min(64, len(self.pairs)))
            hits = [c.strip() == ref.strip() for c, (_, ref, *_) in zip(texts, self.pairs)]
            out["exact_match"], logged = float(np.mean(hits)) if hits else 0.0, texts
        else:
            index = np.asarray([i for _, _, i, _ in self.pairs])
            if self.tool_answers is not None:  # the tool-calling loop, greedy
                logged, texts, total, per_fn = self.tool_answers(states, self.run.eval_src, index)
            else:
                texts, ids = _greedy_with_ids(lm, self.greedy, states, prompts)
                total, per_fn = self.scorer(self.run.eval_src, index, Completions(texts, *ids))
                logged = texts
            for j, row in enumerate(rows):
                row["reward"] = float(total[j])
                row.update({f"rewards/{name}": float(v[j]) for name, v in per_fn.items()})
            out["reward"] = float(np.mean(total))
            for name, values in per_fn.items():
                applies = values[np.isfinite(values)]
                out[f"rewards/{name}/mean"] = float(applies.mean()) if len(applies) else math.nan
            answered = [c.strip() == r.strip() for c, (_, r, *_) in zip(texts, self.pairs)
                        if isinstance(r, str)]
            if answered:
                out["exact_match"] = float(np.mean(answered))
        for row, text, shown in zip(rows, texts, logged):
            row["completion"] = shown
            if isinstance(row["reference"], str):
                row["score"] = float(text.strip() == row["reference"].strip())
        self.completions = rows
        return out

    def _write_per_problem(self, step, accuracy):
        scored = [(row, key) for row, key in zip(self.completions, self.keys) if "score" in row]
        keys = [key for _, key in scored]
        with (self.run.run_dir / "exact_match.jsonl").open("a") as f:
            f.write(json.dumps({"step": int(step), "exact_match": accuracy, "keys": keys,
                                "correct": [int(row["score"]) for row, _ in scored]}) + "\n")


def held_out_prompts(src, chat_format: str, limit: int, spec=None) -> list[tuple]:
    """(prompt segments, reference answer or None, record index, pixel values or None) of the
    first ``limit`` held-out records that have a ``prompt`` (a string or a conversation); the
    reference is the ``answer`` column, as exact match reads it for prompt-only data; the pixel
    values are those of the record's images (a vision model's ``spec``), None without any."""
    out = []
    for i in range(len(src)):
        if len(out) >= limit:
            break
        if src[i].get("prompt") is None:
            continue
        record, arrays = images.prepare(src[i], chat_format, spec)
        prompt = record["prompt"]
        segs = (chat.render(prompt, chat_format, add_generation_prompt=True)
                if isinstance(prompt, list) else [(prompt, False)])
        answer = record.get("answer")
        out.append((segs, answer if isinstance(answer, str) else None, i,
                    spec.pixels(arrays) if arrays else None))
    return out


def _greedy_with_ids(lm, greedy, states, prompts, batch_size: int = 64):
    """Greedy completions (text) and (prompt ids, prompt mask, completion ids, completion mask)
    of prompts (token ids, or ``sampler.ImagePrompts``), batched as ``sampler.sample_ids`` does
    (one prompt width, fixed batch shape)."""
    pixels = None
    if isinstance(prompts, sampler.ImagePrompts):
        prompts, pixels = prompts.ids, np.asarray(prompts.pixel_values, np.float32)
    stops = np.asarray(sampler.stop_ids(lm), np.int32)
    batch_size = min(batch_size, len(prompts))
    width = -(-max(len(p) for p in prompts) // 16) * 16
    texts, parts = [], []
    for b, start in enumerate(range(0, len(prompts), batch_size)):
        count = len(prompts[start:start + batch_size])
        rows = list(range(start, start + count)) + [start + count - 1] * (batch_size - count)
        ids, mask = sampler.pad_prompts([prompts[r] for r in rows], lm.tokenizer.pad_id,
                                        bucket=width)
        result = jax.device_get(greedy(tuple(states), ids, mask,
                                       jax.random.fold_in(jax.random.key(0), b),
                                       sampler.Draw(0.0, 1.0, stops),
                                       None if pixels is None else pixels[rows]))
        texts += sampler.decode_completions(lm, result, stops)[:count]
        parts.append((ids[:count], mask[:count], np.asarray(result["completion_ids"])[:count],
                      np.asarray(result["completion_mask"]).astype(np.int32)[:count]))
    return texts, tuple(np.concatenate(arrays) for arrays in zip(*parts))


def prompt_key(text: str, pixels=None) -> str:
    """A held-out prompt's key in exact_match.jsonl: CRC-32 (hex) of its rendered text, and of
    its images' pixel values (float32) when it has any."""
    crc = zlib.crc32(text.encode())
    if pixels is not None:
        crc = zlib.crc32(np.ascontiguousarray(pixels, np.float32).tobytes(), crc)
    return f"{crc:08x}"
