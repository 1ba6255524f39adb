"""Rollouts with tools and environments (``--algo.tools``, ``--algo.environment``): the prompts
rendered with the tools' schemas (and each environment's ``reset`` text), sampled through the
tool-calling loop (``nnx_posttrain.agents.ToolLoop``), and the environments' ``get_reward`` as
reward functions. ``Rollouts`` (``rollout.py``) uses it when the run has tools."""

from __future__ import annotations

import jax
import numpy as np

from nnx_posttrain import agents, chat, data, errors
from nnx_posttrain.algorithms.online import rewards as rewards_lib
from nnx_posttrain.algorithms.online.generation import Generated
from nnx_posttrain.sampling import sampler


def toolset(cfg) -> agents.Toolset:
    """The run's tools (``--algo.tools``, ``--algo.environment``, ``--algo.tool-timeout``)."""
    return agents.Toolset(cfg.tools, cfg.environment, cfg.tool_timeout)


class EnvironmentReward:
    """An environment's ``get_reward`` as a reward function (TRL's: named after the class, weight
    1): each rollout of that class scored from its instance's state, None for the others."""

    required_columns = ()

    def __init__(self, cls, episodes: list):
        self.cls, self.episodes, self.__name__ = cls, episodes, cls.__name__

    def __call__(self, prompts, completions, **_):
        """Each row's ``get_reward()`` as it returned it (the reward's checks name a value that
        is not a number, and where a ``get_reward`` that raises fails)."""
        if len(self.episodes) != len(completions):  # not the latest rollout's rows
            return [None] * len(completions)
        return [e.environment.get_reward() if type(e.environment) is self.cls else None
                for e in self.episodes]


class ToolRollouts:
    """Prompts -> ``Generated`` through the tool-calling loop (see the module docstring)."""

    def __init__(self, tools: agents.Toolset, lm, cfg, max_prompt_length: int):
        self.tools, self.lm, self.max_prompt_length = tools, lm, max_prompt_length
        if lm.chat_format not in chat.TOOL_FORMATS:
            raise errors.ConfigError(
                f"--algo.tools / --algo.environment: chat format {lm.chat_format!r} has no "
                f"tool-calling format; formats that render one: {', '.join(chat.TOOL_FORMATS)} "
                "(--chat-format)")
        if lm.chat_format not in agents.PARSED_FORMATS:
            raise errors.ConfigError(
                f"--algo.tools / --algo.environment: chat format {lm.chat_format!r} renders tool "
                "calls for training, but the agent loop cannot read them from generated text yet; "
                f"formats it reads: {', '.join(agents.PARSED_FORMATS)} (--chat-format)")
        self.loop = agents.ToolLoop(lm, cfg.max_completion_length,
                                    cfg.max_tool_calling_iterations)
        self.episodes: list = []  # of the latest rollout: the environments' rewards read them

    def reward_functions(self) -> list[tuple[str, object]]:
        return [(name, EnvironmentReward(cls, self.episodes)) for name, cls in
                self.tools.rewarding()]

    def encode(self, record: dict, episode) -> list[int]:
        """A record's prompt with the tools' schemas (after the record's own ``tools`` column; a
        run's tool of the same name is not listed twice),
        the environment's ``reset`` text appended to the last user message; the end kept when
        longer than the prompt limit (BOS first), as the data pipeline keeps it."""
        prompt = record.get("prompt")
        where = record.get("_where", "a record")
        if not isinstance(prompt, list) or not prompt:
            raise errors.DataError(f"{where}: field 'prompt' must be a conversation (a list of "
                                   "messages) for a run with tools: the tools go into its "
                                   "chat template")
        if episode.observation is not None:
            last = prompt[-1]
            prompt = prompt[:-1] + [dict(last, content=last["content"] + episode.observation)]
        own = data.formats.record_tools(record) or []  # the record's tools column first
        named = {t.get("function", {}).get("name") for t in own}
        schemas = own + [t for t in episode.schemas if t["function"]["name"] not in named]
        try:
            segments = chat.render(prompt, self.lm.chat_format, add_generation_prompt=True,
                                   tools=schemas or None)
        except chat.ChatFormatError as exc:
            raise errors.DataError(f"{where}: field 'prompt': {exc}") from None
        ids = sampler.encode_prompt(self.lm, segments)
        limit = self.max_prompt_length
        if len(ids) > limit:
            bos = [ids[0]] if ids[0] == self.lm.tokenizer.bos_id else []
            ids = bos + ids[len(ids) - limit + len(bos):]
        return ids

    def generate(self, sample, src, index) -> Generated:
        """The rollout of the records of ``src`` at ``index`` (one row each); ``sample(ids, mask,
        budget, turn)`` is the policy's sampler call."""
        records = [dict(src[int(i)], _index=int(i)) for i in index]
        episodes = self.tools.open(records)
        self.episodes[:] = episodes
        prompts = [self.encode(r, e) for r, e in zip(records, episodes)]
        exchange = self.loop(sample, prompts, episodes)
        prompt_ids, prompt_mask = sampler.pad_prompts(prompts, self.lm.tokenizer.pad_id)
        texts = [self.lm.tokenizer.decode([int(t) for t, m in zip(row, mask) if m])
                 for row, mask in zip(exchange.completion_ids, exchange.completion_mask)]
        calls = exchange.calls
        metrics = {"tools/call_frequency": calls / len(records),
                   "tools/failure_frequency": exchange.failures / calls if calls else 0.0}
        return Generated(prompt_ids, prompt_mask, exchange.completion_ids,
                         exchange.completion_mask, exchange.completion_mask * exchange.tool_mask,
                         exchange.finished, texts, exchange.messages, metrics)


def held_out_answers(rollouts, states, src, index, batch_size: int = 64):
    """Greedy tool-calling answers to the records of ``src`` at ``index`` (evaluation), scored
    batch by batch while each batch's environments hold their state: (logged texts: the whole
    exchanges, answers: each last assistant message, [B] weighted reward sum, {function: [B]})."""
    sample = rollouts.sampler_call(states, jax.random.key(0), 0.0, 1.0)
    logged, answers, totals, per_fn = [], [], [], {}
    for start in range(0, len(index), batch_size):
        chunk = np.asarray(index[start:start + batch_size])
        count = len(chunk)  # the last batch is padded to the same shape (one compilation)
        chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - count)])
        gen = rollouts.agent.generate(sample, src, chunk)
        total, scores = rollouts.score(src, chunk, gen.completions)
        logged += gen.texts[:count]
        answers += [rewards_lib.text_of(c) for c in gen.conversations[:count]]
        totals.append(total[:count])
        for name, values in scores.items():
            per_fn.setdefault(name, []).append(values[:count])
    return (logged, answers, np.concatenate(totals),
            {name: np.concatenate(v) for name, v in per_fn.items()})
