"""The one adapter between KerasHub and the rest of the code.

Nothing else in the package knows KerasHub internals. A ``LanguageModel`` holds:

- ``task``: the KerasHub ``CausalLM`` (kept for ``save_to_preset`` and KerasHub's own tools);
- ``module``: the ``nnx.Module`` that training splits, differentiates and merges (the backbone);
- ``tokenizer``: a ``Tokenizer`` with plain ``encode``/``decode`` over Python ints;
- ``chat_format``: the name of the family's chat template (see ``nnx_posttrain.chat``).

and provides the trainable-variable filter, LoRA, and per-token log-probabilities computed in
float32 without materialising ``[batch, length, vocab]`` logits at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import keras
import keras_hub
import numpy as np
from flax import nnx

from nnx_posttrain import tokenizer as builtin_tokenizer

# Short names -> KerasHub preset handles (checked against keras_hub.models.CausalLM.presets).
PRESETS = {
    "gemma_2b": "gemma_2b_en",
    "gemma_7b": "gemma_7b_en",
    "gemma_2b_it": "gemma_instruct_2b_en",
    "gemma2_2b": "gemma2_2b_en",
    "gemma2_9b": "gemma2_9b_en",
    "gemma3_270m": "gemma3_270m",
    "gemma3_1b": "gemma3_1b",
    "llama3_8b": "llama3_8b_en",
    "llama3.2_1b": "llama3.2_1b",
    "llama3.2_3b": "llama3.2_3b",
    "qwen2.5_0.5b": "qwen2.5_0.5b_en",
    "qwen2.5_7b": "qwen2.5_7b_en",
    "qwen3_0.6b": "qwen3_0.6b_en",
    "mistral_7b": "mistral_7b_en",
}

# Built-in configurations: Gemma architectures with the project's own SentencePiece tokenizer.
TINY = {
    "gemma_tiny": dict(
        num_layers=4, num_query_heads=4, num_key_value_heads=1, hidden_dim=128,
        intermediate_dim=512, head_dim=32,
    ),
    # Gemma 2 features: attention and final-logit soft caps, post norms, sliding window.
    "gemma2_tiny": dict(
        num_layers=4, num_query_heads=4, num_key_value_heads=2, hidden_dim=128,
        intermediate_dim=512, head_dim=32, query_head_dim_normalize=True,
        use_post_ffw_norm=True, use_post_attention_norm=True, attention_logit_soft_cap=50.0,
        final_logit_soft_cap=30.0, use_sliding_window_attention=True, sliding_window_size=32,
    ),
    "gemma_micro": dict(  # for fast tests
        num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=32,
        intermediate_dim=64, head_dim=16,
    ),
}

# Layer names KerasHub's decoder families give their linear projections.
ATTENTION_LAYERS = ("query", "key", "value", "attention_output")
LORA_TARGETS = {
    "qv": ("query", "value"),  # KerasHub's own default
    "attention": ATTENTION_LAYERS,
    "all-linear": None,  # every Dense / EinsumDense of the decoder blocks
}

DTYPES = {"float32": "float32", "bfloat16": "mixed_bfloat16", "bfloat16-params": "bfloat16"}


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what to do."""


class Tokenizer:
    """Plain-Python view of a KerasHub tokenizer: encode to / decode from lists of ints.

    SentencePiece tokenizers (Gemma, Mistral, the built-in one) run through the ``sentencepiece``
    package directly: fast, and picklable for data-loading worker processes.
    """

    def __init__(self, keras_tokenizer):
        self.keras_tokenizer = keras_tokenizer
        proto = getattr(keras_tokenizer, "proto", None)
        self._sp = None
        if proto is not None:
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        self.bos_id = _token_id(keras_tokenizer, "start_token_id")
        self.eos_id = _token_id(keras_tokenizer, "end_token_id")
        pad = _token_id(keras_tokenizer, "pad_token_id")
        self.pad_id = pad if pad is not None else (self.eos_id or 0)
        self.vocab_size = int(keras_tokenizer.vocabulary_size())

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._sp is not None:
            return self._sp.encode(text)
        return [int(t) for t in keras.ops.convert_to_numpy(self.keras_tokenizer.tokenize(text))]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._sp is not None:
            return self._sp.decode(ids)
        return str(keras.ops.convert_to_numpy(self.keras_tokenizer.detokenize(ids)).item().decode())

    def token_id(self, piece: str) -> int | None:
        """Id of a single special piece (e.g. '<end_of_turn>'), or None if it is not one token."""
        ids = self.encode(piece)
        return ids[0] if len(ids) == 1 else None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["keras_tokenizer"] = None  # TensorFlow-backed; workers only need the fast path
        if self._sp is not None:
            state["_sp"] = self._sp.serialized_model_proto()
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if isinstance(self._sp, bytes):
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_proto=self._sp)


def _token_id(tok, attr):
    value = getattr(tok, attr, None)
    return None if value is None else int(value)


@dataclasses.dataclass
class LanguageModel:
    task: keras_hub.models.CausalLM
    tokenizer: Tokenizer
    chat_format: str
    name: str

    @property
    def module(self) -> nnx.Module:
        """The NNX module that training operates on (the backbone, with LoRA when enabled)."""
        return self.task.backbone


def chat_format_for(backbone) -> str:
    """The chat template family of a KerasHub backbone, from its class name."""
    name = type(backbone).__name__.lower()
    if name.startswith("gemma"):
        return "gemma"
    if name.startswith("llama3"):
        return "llama3"
    if name.startswith("qwen"):
        return "chatml"
    if name.startswith("mistral"):
        return "mistral"
    return "chatml"


def _nnx_ready(task: keras_hub.models.CausalLM) -> keras_hub.models.CausalLM:
    """Make ``nnx.state`` / ``nnx.split`` work on a KerasHub task.

    Keras keeps ``_compiled_trainable_state``, a dict keyed by layer objects, on every model; NNX
    sorts dict keys when it flattens a graph and fails with "'<' not supported between instances
    of 'GemmaBackbone' and 'GemmaCausalLM'". We never ``compile()`` the task, so the dict is unused.
    """
    if hasattr(task, "_compiled_trainable_state"):
        del task._compiled_trainable_state
    return task


def is_local_model(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))


def load(name: str, dtype: str = "float32", seed: int = 0) -> LanguageModel:
    """Load ``name``: a built-in tiny config, a short name, a KerasHub handle or a local directory.

    Local directories may be KerasHub presets (what ``save_to_preset`` writes) or Hugging Face
    checkpoints (config.json + safetensors), which KerasHub converts itself.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    policy = DTYPES[dtype]
    if name in TINY:
        keras.utils.set_random_seed(seed)
        tok = keras_hub.models.GemmaTokenizer(proto=builtin_tokenizer.builtin_proto())
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=tok.vocabulary_size(), dtype=policy, **TINY[name]
        )
        preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tok)
        task = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor)
    else:
        handle = PRESETS.get(name, name)
        if is_local_model(handle):
            handle = str(Path(handle).expanduser().resolve())
        elif not (handle.startswith(("kaggle://", "hf://", "modelscope://", "gs://"))
                  or handle in keras_hub.models.CausalLM.presets):
            raise ModelLoadError(
                f"unknown model {name!r}: not a built-in config ({', '.join(TINY)}), a short name "
                f"({', '.join(PRESETS)}), a KerasHub preset name, a kaggle:// or hf:// handle, or "
                "an existing local directory"
            )
        task = _from_preset(name, handle, policy)
    _warm_up(task.backbone)
    return LanguageModel(
        task=_nnx_ready(task),
        tokenizer=Tokenizer(_tokenizer_of(task, name)),
        chat_format=chat_format_for(task.backbone),
        name=name,
    )


def _tokenizer_of(task, name):
    if task.preprocessor is None or getattr(task.preprocessor, "tokenizer", None) is None:
        raise ModelLoadError(f"model {name!r} has no tokenizer: the preset must include one")
    return task.preprocessor.tokenizer


def _from_preset(name: str, handle: str, policy: str):
    try:
        return keras_hub.models.CausalLM.from_preset(handle, dtype=policy)
    except Exception as exc:  # noqa: BLE001 - any failure inside KerasHub becomes one clear message
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        local = is_local_model(handle)
        if local:
            advice = (
                "The directory must be a KerasHub preset (written by save_to_preset: "
                "config.json, metadata.json, model.weights.h5, tokenizer assets) or a Hugging Face "
                "checkpoint of a family KerasHub converts (config.json, *.safetensors, tokenizer)."
            )
        else:
            advice = (
                "Downloading a preset needs network access to Kaggle or Hugging Face and, for "
                "gated models (Gemma, Llama), an accepted licence and credentials: KAGGLE_USERNAME "
                "and KAGGLE_KEY, or HF_TOKEN. Offline, download the preset on a connected machine "
                "and pass its local directory: --model /path/to/preset."
            )
        raise ModelLoadError(
            f"could not load model {name!r} (KerasHub handle {handle!r}): "
            f"{type(exc).__name__}: {first_line}\n{advice}"
        ) from None


def _warm_up(backbone) -> None:
    """One eager call: Keras flips build/bookkeeping flags on the first call, which would otherwise
    happen inside the first trace and cost a second compilation."""
    ids = jnp.zeros((1, 4), jnp.int32)
    backbone({"token_ids": ids, "padding_mask": jnp.ones_like(ids)})


# ----------------------------------------------------------------------------- trainable filter


def trainable_filter(path, value) -> bool:
    """NNX filter selecting trainable Keras variables.

    Keras variables are ``nnx.Variable`` subclasses but not ``nnx.Param``: filtering on
    ``nnx.Param`` selects nothing and would silently train nothing.
    """
    return isinstance(value, keras.Variable) and value.trainable


def split(module: nnx.Module):
    """(graphdef, trainable state, frozen state); fails loudly if nothing is trainable."""
    graphdef, trainable, frozen = nnx.split(module, trainable_filter, ...)
    if not jax.tree_util.tree_leaves(trainable):
        raise ValueError("the trainable-variable filter selected no variable: nothing would train")
    return graphdef, trainable, frozen


def named_variables(state) -> dict[str, jax.Array]:
    """{Keras variable path (e.g. 'decoder_block_0/attention/query/kernel'): array} of a state."""
    return {v.path: v.value for _, v in nnx.to_flat_state(state)}


def count_params(state) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(state))


# ----------------------------------------------------------------------------- LoRA


def enable_lora(module, rank: int, alpha: float | None = None, targets: str = "attention") -> list[str]:
    """Freeze every weight and add LoRA factors (scale alpha / rank) to the target layers.

    ``targets``: 'qv' (KerasHub's default), 'attention' (q, k, v, o), 'all-linear' (every Dense
    or EinsumDense of the decoder blocks), or comma-separated layer names. Returns the paths of
    the adapted layers; raises if none matched.
    """
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    names = LORA_TARGETS[targets] if targets in LORA_TARGETS else tuple(
        t.strip() for t in targets.split(",") if t.strip()
    )
    layers = [layer for layer in module._flatten_layers(include_self=False)]
    for layer in layers:
        layer.trainable = False
    adapted = []
    for layer in layers:
        if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
            continue
        if names is not None and layer.name not in names:
            continue
        layer.trainable = True
        layer.enable_lora(rank, lora_alpha=alpha)
        adapted.append(layer.path)
    if not adapted:
        raise ValueError(
            f"LoRA targets {targets!r} matched no Dense/EinsumDense layer of {type(module).__name__}"
        )
    return adapted


@contextlib.contextmanager
def lora_disabled(module):
    """Within the block, LoRA layers compute with their base kernel only: the reference model of
    preference and RL methods, with no second copy of the weights."""
    layers = [l for l in module._flatten_layers(include_self=False) if getattr(l, "lora_enabled", False)]
    if not layers:
        raise ValueError("lora_disabled: the model has no LoRA layer (use a 'copy' reference)")
    for layer in layers:
        object.__setattr__(layer, "lora_enabled", False)
    try:
        yield
    finally:
        for layer in layers:
            object.__setattr__(layer, "lora_enabled", True)


def has_lora(module) -> bool:
    return any(getattr(l, "lora_enabled", False) for l in module._flatten_layers(include_self=False))


# ----------------------------------------------------------------------------- log-probabilities


# The method each KerasHub decoder block uses to build its [batch, query, key] attention mask:
# Gemma / Gemma 3 blocks, and Llama / Llama 3 / Mistral / Qwen / Qwen 3 decoders.
_MASK_METHODS = ("_compute_attention_mask", "_compute_self_attention_mask")


def segment_attention_mask(segment_ids):
    """[batch, T, T] causal mask that never crosses examples of a packed row (segment 0 = padding;
    a padding query sees itself only, so no softmax row is empty)."""
    seg = segment_ids
    t = seg.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    return ((same & causal) | jnp.eye(t, dtype=bool)[None]).astype(jnp.int32)


@contextlib.contextmanager
def _attention_mask_override(module, mask):
    """Make every decoder block use ``mask`` instead of its causal + padding mask.

    KerasHub backbones accept only a [batch, T] padding mask; packed rows need a block-diagonal
    one. The blocks' mask method is shadowed on the instances for the duration of the call."""
    blocks = decoder_blocks(module)  # not module.transformer_layers: see decoder_blocks
    names = [n for n in _MASK_METHODS if hasattr(type(blocks[0]), n)]
    if not names:
        raise NotImplementedError(f"packed sequences are not supported for {type(module).__name__}")

    def masked(*args, **kwargs):
        return mask

    for block in blocks:
        object.__setattr__(block, names[0], masked)
    try:
        yield
    finally:
        for block in blocks:
            object.__delattr__(block, names[0])


def hidden_states(module, token_ids, padding_mask, segment_ids=None):
    """Final hidden states. With ``segment_ids`` (packed rows), attention stays within each
    example. Positions are not restarted per example: every supported family uses rotary
    embeddings, whose attention scores depend only on relative positions within an example."""
    with _remat_scope(module):
        if segment_ids is None:
            return module({"token_ids": token_ids, "padding_mask": padding_mask})
        with _attention_mask_override(module, segment_attention_mask(segment_ids)):
            return module({"token_ids": token_ids,
                           "padding_mask": (segment_ids != 0).astype(jnp.int32)})


def decoder_blocks(module) -> list:
    """The decoder blocks that the backbone's functional graph calls. ``module.transformer_layers``
    is not it after ``nnx.merge``: that list still holds the blocks of the module that was split,
    while the merged graph calls new block objects (those in ``module.layers``)."""
    kind = type(module.transformer_layers[0])
    return [layer for layer in module.layers if isinstance(layer, kind)]


def set_remat(module, enabled: bool) -> None:
    """Rematerialise each decoder block of the backbone ``module`` (``--remat blocks``): the
    backward pass recomputes a block's activations from its input instead of keeping them, so
    activation memory holds one block's internals rather than all of them. A plain attribute,
    kept by ``nnx.split`` / ``nnx.merge``; ``hidden_states`` applies it."""
    object.__setattr__(module, "_nnx_posttrain_remat", bool(enabled))


@contextlib.contextmanager
def _remat_scope(module):
    """While active, each decoder block's ``call`` runs under ``jax.checkpoint`` (when enabled by
    ``set_remat``). Only array arguments are traced; the others (flags, None) stay static."""
    if not getattr(module, "_nnx_posttrain_remat", False):
        yield
        return
    blocks = decoder_blocks(module)

    def checkpointed(call):
        def wrapper(*args, **kwargs):
            leaves, treedef = jax.tree.flatten((args, kwargs))
            where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

            def inner(*arrays):
                full = list(leaves)
                for i, x in zip(where, arrays):
                    full[i] = x
                args, kwargs = jax.tree.unflatten(treedef, full)
                return call(*args, **kwargs)

            return jax.checkpoint(inner)(*(leaves[i] for i in where))
        return wrapper

    for block in blocks:
        object.__setattr__(block, "call", checkpointed(block.call))
    try:
        yield
    finally:
        for block in blocks:
            object.__delattr__(block, "call")


def token_logprobs(module, token_ids, padding_mask, chunk_size: int = 128, with_entropy=False,
                   segment_ids=None, temperature: float = 1.0, positions=None):
    """log p(token_ids[:, t] | token_ids[:, <t]) for every t, float32, shape [batch, length].

    Position 0 has no prediction and is 0. Logits are computed ``chunk_size`` positions at a time
    (and recomputed in the backward pass), so peak memory holds [batch, chunk, vocab], never
    [batch, length, vocab]. With ``with_entropy`` also returns the per-position entropy of the
    predictive distribution. ``segment_ids`` marks the examples of packed rows (see
    ``hidden_states``); the first token of each example has no meaningful prediction and must
    carry no loss. ``temperature`` divides the logits (RL: the sampling distribution).

    ``positions`` [batch, k] (from :func:`scored_positions`) limits the vocabulary projection to
    those positions, the ones that carry loss: the others come back as 0. The projection is the
    largest matmul of a small model; a preference pair's prompt needs none (TRL's fused LM head
    does the same).
    """
    h = hidden_states(module, token_ids, padding_mask, segment_ids)
    return logprobs_from_hidden(module, h, token_ids, chunk_size, with_entropy, temperature,
                                positions)


def scored_positions(*loss_masks: np.ndarray) -> list[np.ndarray] | None:
    """Host side: for each [batch, length] loss mask, the positions that carry loss, ascending,
    as a [batch, k] int32 array padded with ``length`` (an index that selects nothing), for
    ``token_logprobs(positions=...)``. One ``k`` for all masks, rounded up to length/8, /4 or /2
    (a few compiled shapes at most); None when some row needs more than half the positions
    (projecting every position is then as cheap)."""
    length = loss_masks[0].shape[1]
    need = max(int((m[:, 1:] > 0).sum(axis=1).max(initial=0)) for m in loss_masks)
    k = next((-(-length // d) for d in (8, 4, 2) if need <= -(-length // d)), None)
    if k is None:
        return None
    out = []
    for mask in loss_masks:
        scored = mask > 0
        scored[:, 0] = False  # position 0 has no prediction
        order = np.argsort(~scored, axis=1, kind="stable")[:, :k]
        out.append(np.where(np.take_along_axis(scored, order, axis=1), order, length)
                   .astype(np.int32))
    return out


def logprobs_from_hidden(module, h, token_ids, chunk_size: int = 128, with_entropy=False,
                         temperature: float = 1.0, positions=None):
    """``token_logprobs`` from the final hidden states ``h`` [batch, length, width] (for models
    that read the hidden states twice, e.g. a policy with a value head)."""
    batch, full_length = token_ids.shape
    if positions is None:
        h, targets = h[:, :-1], token_ids[:, 1:]
    else:  # position t is predicted from the hidden state at t - 1
        clipped = jnp.clip(positions, 1, full_length - 1)
        h = jnp.take_along_axis(h, (clipped - 1)[..., None], axis=1)
        targets = jnp.take_along_axis(token_ids, clipped, axis=1)
    length, width = h.shape[1], h.shape[2]
    chunk = min(chunk_size, length)
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    h = h.reshape(batch, n_chunks, chunk, width).swapaxes(0, 1)
    targets = targets.reshape(batch, n_chunks, chunk).swapaxes(0, 1)
    embedding = module.token_embedding

    @jax.checkpoint
    def one_chunk(args):
        h_c, t_c = args
        logits = embedding(h_c, reverse=True).astype(jnp.float32)
        if temperature != 1.0:
            logits = logits / temperature
        log_z = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
        logp = picked - log_z
        if not with_entropy:
            return logp, jnp.zeros_like(logp)
        probs = jax.nn.softmax(logits, axis=-1)
        entropy = log_z - jnp.sum(probs * logits, axis=-1)
        return logp, entropy

    logp, entropy = jax.lax.map(one_chunk, (h, targets))

    def unchunk(x):
        x = x.swapaxes(0, 1).reshape(batch, n_chunks * chunk)[:, :length]
        if positions is None:
            return jnp.pad(x, ((0, 0), (1, 0)))
        rows = jnp.arange(batch)[:, None]
        return jnp.zeros((batch, full_length), x.dtype).at[rows, positions].set(x, mode="drop")

    if with_entropy:
        return unchunk(logp), unchunk(entropy)
    return unchunk(logp)


def full_logits(module, token_ids, padding_mask):
    """Reference path: the [batch, length, vocab] logits in one piece (tests, short sequences)."""
    h = hidden_states(module, token_ids, padding_mask)
    return module.token_embedding(h, reverse=True).astype(jnp.float32)


def describe(lm: LanguageModel) -> str:
    graph_trainable = nnx.state(lm.module, trainable_filter)
    total = count_params(nnx.state(lm.module))
    trainable = count_params(graph_trainable)
    return (
        f"{lm.name}: {type(lm.module).__name__}, {total:,} parameters, {trainable:,} trainable "
        f"({100 * trainable / max(total, 1):.2f}%), vocab {lm.tokenizer.vocab_size}, chat format "
        f"{lm.chat_format}"
    )
