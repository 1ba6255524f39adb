"""The tool-calling loop of a rollout (TRL 1.16's ``_tool_call_loop``), on this package's sampler.

Every row is sampled once from its prompt. Then, up to ``max_iterations`` times: each row whose
last turn ended (a stop token: in Gemma 4 and harmony the calling turn's own, ``chat.CALL_END``)
with a tool call has its calls run (``toolset.Episode.call``; a call that cannot be read is a
failed call whose error the model reads), the results' tokens
(``calls.continuation``: tool messages and the next generation prompt) are appended, and the rows
with results continue from their whole context, prompt + everything so far, in one sampler call
(the prefix is recomputed: the KV cache is not kept between turns). Tool-result tokens carry no
loss (``tool_mask`` 0) and are not counted as the model's length. ``max_completion_length`` counts
every token after the prompt: a result that would leave no room ends its row (TRL drops it too),
and a continuation stops at the room left.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nnx_posttrain import chat
from nnx_posttrain.agents import calls as calls_lib
from nnx_posttrain.sampling import sampler


@dataclasses.dataclass
class Exchange:
    """A batch of tool-calling rollouts: ``completion_ids`` / ``completion_mask`` / ``tool_mask``
    [B, N] (the mask covers every token after the prompt, the tool mask is 0 on tool results),
    ``finished`` [B] (the last turn produced a stop token), ``messages`` (each row's completion
    as chat messages: assistant turns with their ``tool_calls``, ``tool`` results), ``calls`` and
    ``failures`` (tool calls of the batch, and those that failed)."""

    completion_ids: np.ndarray
    completion_mask: np.ndarray
    tool_mask: np.ndarray
    finished: np.ndarray
    messages: list[list[dict]]
    calls: int
    failures: int


def _turn(out: dict, row: int, stops: set, kept: int | None) -> tuple[list[int], list, bool]:
    """(generated ids, ids to decode: the stop removed unless it is ``kept``, finished) of one
    row of a sampler output."""
    ids = [int(t) for t, m in zip(out["completion_ids"][row], out["completion_mask"][row]) if m]
    return ids, [t for t in ids if t not in stops or t == kept], bool(out["finished"][row])


@dataclasses.dataclass
class _Rows:
    """What the loop has of every row so far: its generated and result tokens (``seqs``), which of
    them are the model's (``tool_mask`` 1) or a tool result's (0), its messages, and the calls
    made and failed over all rows."""

    seqs: list
    tool_mask: list
    messages: list
    counts: dict


class ToolLoop:
    """``ToolLoop(lm, n, max_iterations)(sample, prompts, episodes) -> Exchange``: ``sample(ids,
    mask, budget, turn)`` is a sampler call on left-padded arrays (numpy outputs; ``turn``
    numbers the calls, for the random key); ``prompts`` the rows' prompt ids (BOS included);
    ``max_iterations`` None: no limit but the length."""

    def __init__(self, lm, max_new_tokens: int, max_iterations: int | None):
        # no limit: until the room runs out (every turn takes at least one token)
        self.lm, self.n = lm, max_new_tokens
        self.max_iterations = max_new_tokens if max_iterations is None else max_iterations
        self.stops = set(sampler.stop_ids(lm))
        self.call_end = chat.CALL_END.get(lm.chat_format)  # kept in the text that parse reads
        self.call_end_id = lm.tokenizer.token_id(self.call_end) if self.call_end else None

    def __call__(self, sample, prompts: list[list[int]], episodes) -> Exchange:
        tok, n, rows = self.lm.tokenizer, self.n, len(prompts)
        ids, mask = sampler.pad_prompts(prompts, tok.pad_id)
        out = sample(ids, mask, np.full(rows, n, np.int32), 0)
        state = _Rows([[] for _ in prompts], [[] for _ in prompts], [[] for _ in prompts],
                      {"calls": 0, "failures": 0})
        seqs, finished = state.seqs, np.zeros(rows, bool)
        pending = list(range(rows))
        for turn in range(self.max_iterations + 1):
            calling = []
            for i in pending:
                generated, kept, finished[i] = _turn(out, i, self.stops, self.call_end_id)
                seqs[i] += generated
                state.tool_mask[i] += [1] * len(generated)
                text = tok.decode(kept)
                if self._act(i, text, finished[i] and turn < self.max_iterations, episodes[i],
                             state):
                    calling.append(i)
            if not calling:
                break
            budget = np.zeros(rows, np.int32)
            context = [list(p) for p in prompts]
            for i in calling:
                context[i] = prompts[i] + seqs[i]
                budget[i] = n - len(seqs[i])
            width = -(-max(map(len, prompts)) // 16) * 16 + n  # one width per batch of prompts
            ids, mask = sampler.pad_prompts(context, tok.pad_id, bucket=width)
            out, pending = sample(ids, mask, budget, turn + 1), calling
        return Exchange(*_pad(seqs, state.tool_mask, n, tok.pad_id), finished, state.messages,
                        state.counts["calls"], state.counts["failures"])

    def _act(self, i, text, may_call, episode, state: _Rows) -> bool:
        """Record row ``i``'s turn; run its calls and append their results when it may call
        and there is room: whether the row continues."""
        fmt, counts = self.lm.chat_format, state.counts
        seqs, messages = state.seqs, state.messages
        try:
            found, error = calls_lib.parse(text, fmt, episode.schemas), None
        except calls_lib.Malformed as exc:
            found, error = [], str(exc)
        if self.call_end:
            text = text.removesuffix(self.call_end)
        messages[i].append({"role": "assistant", "content": text,
                            **({"tool_calls": [{"type": "function", "function": c}
                                               for c in found]} if found else {})})
        if not may_call or not (found or error):
            return False
        results = []
        if error is not None:
            results.append(("unknown", str({"error": f"malformed tool call: {error}"})))
            counts["calls"] += 1
            counts["failures"] += 1
        for call in found[:1] if fmt in calls_lib.ONE_CALL else found:
            content, failed = episode.call(call["name"], call["arguments"])
            results.append((call["name"], content))
            counts["calls"] += 1
            counts["failures"] += int(failed)
        suffix = self.lm.tokenizer.encode(calls_lib.continuation(fmt, results))
        if len(seqs[i]) + len(suffix) >= self.n:  # no room for an answer: the row ends here
            return False
        messages[i] += [{"role": "tool", "name": name, "content": content}
                        for name, content in results]
        seqs[i] += suffix
        state.tool_mask[i] += [0] * len(suffix)
        return True


def _pad(seqs, tool_mask, n, pad_id):
    ids = np.full((len(seqs), n), pad_id, np.int32)
    mask = np.zeros((len(seqs), n), np.int32)
    tmask = np.zeros((len(seqs), n), np.int32)
    for i, (seq, tm) in enumerate(zip(seqs, tool_mask)):
        ids[i, :len(seq)], mask[i, :len(seq)], tmask[i, :len(tm)] = seq, 1, tm
    return ids, mask, tmask
