"""Generation: the compiled, batched KV-cache sampler (``sampler``) and greedy evaluation on it
(``generate``: exact match, chat completions).

Runs KerasHub's own cached decoder blocks through the model adapter (``nnx_posttrain.model``) and
renders prompts with ``nnx_posttrain.chat``. It may import only the adapter and config-level
modules (``config``, ``chat``, ``sharding``, ``checkpoint``, ``metrics_log``): never data, losses,
algorithms, train or tasks.
"""

from nnx_posttrain.sampling import capacity, generate, sampler
from nnx_posttrain.sampling.generate import complete_chat, exact_match, greedy_complete, make_greedy
from nnx_posttrain.sampling.sampler import (
    Draw,
    Sampling,
    chat_prompt,
    decode_completions,
    encode_prompt,
    make_sampler,
    pad_prompts,
    sample_ids,
    sample_texts,
    stop_ids,
)

__all__ = [
    "capacity", "generate", "sampler",
    # sampler
    "Draw", "Sampling", "chat_prompt", "decode_completions", "encode_prompt", "make_sampler", "pad_prompts",
    "sample_ids", "sample_texts", "stop_ids",
    # generate
    "complete_chat", "exact_match", "greedy_complete", "make_greedy",
]
