"""A run's model as an lm-evaluation-harness ``LM`` (``NNXLM``), on this package's own JAX
forward and KV-cache sampler: no export to PyTorch.

- ``loglikelihood``: lm-eval's tokenization of (context, continuation) (``TemplateLM``: the pair
  encoded whole, the context's tokens cut off), the sequence cut to its last ``max_length``
  tokens; one jitted forward per batch (``model.token_logprobs`` with the greedy flags, the
  vocabulary projected at the continuation's positions only), rows sorted by length and
  right-padded to a multiple of 16 (few shapes, few compilations);
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens;
- ``generate_until``: the sampler (greedy unless the task asks to sample), ``max_gen_toks`` new
  tokens at most, stopped at the model's stop tokens and cut at the first ``until`` string;
- the chat template: ``apply_chat_template`` renders the conversation with the run's chat format
  (``nnx_posttrain.chat``; its published Jinja text is ``chat_template``).

Every sequence starts with the tokenizer's BOS, as the run trained on them (``tok_encode``).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from nnx_posttrain import chat, model
from nnx_posttrain.sampling import sampler

try:  # the eval extra
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # the module stays importable: ``harness.require`` names the extra
    TemplateLM = object


class NNXLM(TemplateLM):
    """``NNXLM(lm, module, name, batch_size=16, max_length=None)``: ``lm`` the run's
    ``LoadedModel`` (tokenizer, chat format), ``module`` its policy (``runs.load(...).policy()``),
    ``name`` what lm-eval records as the model."""

    def __init__(self, lm, module, name: str, batch_size: int = 16, max_length: int | None = None):
        super().__init__()
        self.lm, self.name, self.batch_size = lm, name, batch_size
        self.graphdef, *self.states = nnx.split(module)
        family = sampler.CONTEXT_LENGTHS.get(type(module).__name__, 2048)
        self.max_length = max_length or min(family, 4096)
        graphdef = self.graphdef

        def scores(states, ids, mask, positions):
            policy = nnx.merge(graphdef, *states)
            return model.token_logprobs(policy, ids, mask, model.Projection(correct=True),
                                        positions=positions)
        self._scores = jax.jit(scores)
        self._samplers = {}

    # -- tokens

    @property
    def eot_token_id(self) -> int:
        return self.lm.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        tok = self.lm.tokenizer
        return tok.bos_id if tok.bos_id is not None else tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_) -> list[int]:
        """Token ids of ``string``, BOS first (unless ``add_special_tokens`` is False, or the
        string already starts with the BOS token's text), as lm-eval's hf backend encodes for
        models trained with a BOS."""
        tok = self.lm.tokenizer
        ids = tok.encode(string)
        if add_special_tokens is not False and tok.bos_id is not None \
                and not (ids and ids[0] == tok.bos_id):
            ids = [tok.bos_id] + ids
        return ids

    def tok_decode(self, ids) -> str:
        return self.lm.tokenizer.decode([int(i) for i in ids])

    @property
    def tokenizer_name(self) -> str:
        return self.name

    def chat_template(self, chat_template=False) -> str | None:
        return chat.hf_template(self.lm.chat_format)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return chat.to_text(chat_history, self.lm.chat_format, add_generation_prompt)

    # -- log-likelihoods

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_):
        """[(log p(continuation | context), greedy)] of (key, context ids, continuation ids)."""
        rows = []
        for _key, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((whole, len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            width = -(-max(len(rows[i][0]) for i in chunk) // 16) * 16
            ids = np.full((self.batch_size, width), self.lm.tokenizer.pad_id, np.int32)
            mask = np.zeros((self.batch_size, width), np.int32)
            scored = np.zeros((self.batch_size, width), np.int32)  # the continuations' tokens
            for j, i in enumerate(chunk):  # the missing rows of the last batch stay padding
                end, n = len(rows[i][0]), rows[i][1]
                ids[j, :end], mask[j, :end], scored[j, end - n:end] = rows[i][0], 1, 1
            # only the continuations' positions through the vocabulary projection
            positions = model.scored_positions(scored)
            logps, correct = jax.device_get(self._scores(
                self.states, ids, mask, None if positions is None else positions[0]))
            for j, i in enumerate(chunk):
                end, n = len(rows[i][0]), rows[i][1]
                out[i] = (float(logps[j, end - n:end].sum()), bool(correct[j, end - n:end].all()))
                if self.cache_hook is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, in disjoint windows of ``max_length`` tokens."""
        windows, owners = [], []
        for r, (string,) in enumerate(req.args for req in requests):
            for window in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string),  # BOS first, as lm-eval's hf does
                    prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, *window))
                owners.append(r)
        totals = [0.0] * len(requests)
        for owner, (logp, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logp
        return totals

    # -- generation

    def _sampler(self, max_new_tokens: int):
        if max_new_tokens not in self._samplers:
            self._samplers[max_new_tokens] = sampler.make_sampler(
                self.graphdef, max_new_tokens, pad_id=self.lm.tokenizer.pad_id)
        return self._samplers[max_new_tokens]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's completion (greedy unless its arguments sample), cut at its first
        ``until`` string; requests with the same generation settings are sampled in batches."""
        groups: dict[tuple, list[int]] = {}
        settings = []
        for i, (context, kwargs) in enumerate(req.args for req in requests):
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            sampling = bool(kwargs.get("do_sample", False))
            key = (int(kwargs.get("max_gen_toks", 256)),
                   float(kwargs.get("temperature", 1.0)) if sampling else 0.0,
                   float(kwargs.get("top_p", 1.0)) if sampling else 1.0)
            settings.append([until] if isinstance(until, str) else list(until))
            groups.setdefault(key, []).append(i)
        out: list = [None] * len(requests)
        for (max_new, temperature, top_p), members in groups.items():
            prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):]
                       for i in members]
            texts = sampler.sample_ids(self.lm, self._sampler(max_new), self.states, prompts,
                                       sampler.Sampling(temperature=temperature, top_p=top_p),
                                       batch_size=min(self.batch_size, len(prompts)))
            for i, text in zip(members, texts):
                for stop in settings[i]:
                    text = text.split(stop)[0] if stop else text
                out[i] = text
                if self.cache_hook is not None:
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out
