"""Will a step fit? A rough estimate of what training still has to allocate once the model is
loaded, compared with the memory available, before anything compiles (``--memory-check``).

Per device, in bytes (``b`` sequences per micro-batch and device — twice the examples for
preference pairs, chosen and rejected — ``s`` = ``--batching.max-length``, ``L`` layers, ``h``
hidden size, ``a`` query heads, ``e`` bytes per activation: 4 in float32, 2 in bfloat16):

- gradients and AdamW's two moments: 12 bytes per trainable parameter (float32), sharded over
  fsdp x tensor (a mixture of experts' stacked experts also over ``--mesh.expert``); a frozen
  reference copy (``--algo.reference copy``): the trainable weights again;
- activations kept for the backward pass (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", per layer ``s*b*h*(34 + 5*a*s/h)`` bytes at 16 bits,
  no flash attention): ``L * s * b * (34*h + 5*a*s) * e / 2``; with ``--remat blocks`` each block
  keeps only its input (``L * s * b * h * e``) plus one block's activations;
- the vocabulary projection of one ``--logprob-chunk`` (all ``s`` positions when 0, and by
  default while they fit ``model.logprobs.logits_budget()``): logits,
  log-softmax and their gradient in float32, ``3 * 4 * b * chunk * vocab``;
- where the decoder blocks run as one scan (``--scan-layers``, ``model.layer_scan``): their
  weights stacked, one more copy of every block's variables, sharded as they are.

``--eval-only`` counts one layer's forward activations and the projection only. The rollout
sampler's KV cache and XLA's own buffers are not counted: the check refuses only settings that
clearly cannot fit (a ``max_length`` of a million tokens, say), not borderline ones.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from nnx_posttrain import errors, model, sharding
from nnx_posttrain.model import device_memory
from nnx_posttrain.model.device_memory import GiB
from nnx_posttrain.model.logprobs import chunk_positions
from nnx_posttrain.train import flops as flops_lib


def _per_device(params, mesh_shape: dict) -> tuple[int, int]:
    """(elements, bytes) of ``params`` one device holds: divided by fsdp x tensor (as if every
    weight divided), a mixture of experts' stacked experts also by the expert axis."""
    shards = mesh_shape.get("fsdp", 1) * mesh_shape.get("tensor", 1)
    expert = mesh_shape.get("expert", 1)
    elements = nbytes = 0
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        x = leaf.value if isinstance(leaf, nnx.Variable) else leaf
        n = int(np.prod(x.shape))
        if expert > 1 and isinstance(leaf, nnx.Variable) and \
                sharding.logical_axes(leaf.path, len(x.shape))[:1] == ("expert",):
            n //= expert
        elements, nbytes = elements + n, nbytes + n * x.dtype.itemsize
    return elements // shards, nbytes // shards


def estimate(cfg, backbone, params, sequences_per_example: int, reference_copy: bool,
             mesh_shape: dict) -> dict[str, int]:
    """{part: bytes per device} still to allocate for a step (see the module docstring)."""
    b = cfg.batching
    batch_shards = sharding.batch_divisor(mesh_shape)
    seqs = max(b.batch_size // b.grad_accum // batch_shards, 1) * sequences_per_example
    s = b.max_length
    layers = int(getattr(backbone, "num_layers", 1))
    hidden = int(getattr(backbone, "hidden_dim", 0))
    heads = int(getattr(backbone, "num_query_heads", None)  # SmolLM3: num_attention_heads
                or getattr(backbone, "num_attention_heads", 1))
    vocab = int(getattr(backbone, "vocabulary_size", 0))
    e = 2 if str(backbone.dtype_policy.compute_dtype) in ("bfloat16", "float16") else 4
    per_layer = s * seqs * (34 * hidden + 5 * heads * s) * e // 2
    chunk = min(chunk_positions(cfg.logprob_chunk, seqs, s, vocab) or s, s)
    out = {"vocabulary projection": 3 * 4 * seqs * chunk * vocab}
    if model.scanning(backbone):
        blocks = [v for block in model.decoder_blocks(backbone) for v in block.weights]
        out["stacked blocks"] = _per_device(blocks, mesh_shape)[1]
    if cfg.eval_only:
        out["activations"] = per_layer
        return out
    trainable, nbytes = _per_device(params, mesh_shape)
    out["gradients + AdamW moments"] = 12 * trainable
    if reference_copy:
        out["reference copy"] = nbytes
    out["activations"] = (layers * s * seqs * hidden * e + per_layer if cfg.remat == "blocks"
                          else layers * per_layer)
    return out


def check(cfg, parts: dict[str, int], echo=print) -> None:
    """``ConfigError`` with the estimate ``parts`` (``estimate``) when a step clearly cannot fit
    in the memory available (``--no-memory-check``: skip)."""
    if not cfg.memory_check:
        return
    free = device_memory.available_bytes()
    if free is None:
        return
    need = sum(parts.values())
    if need <= free:
        return
    shown = ", ".join(f"{k} {v / GiB:,.2f}" for k, v in parts.items())
    raise errors.ConfigError(
        f"a {'forward' if cfg.eval_only else 'training'} step needs an estimated "
        f"{need / GiB:,.2f} GiB more per device, and {free / GiB:,.2f} GiB are free on "
        f"{jax.local_devices()[0].platform} ({shown} GiB; --batching.max-length "
        f"{cfg.batching.max_length}, micro-batch {cfg.batching.batch_size // cfg.batching.grad_accum}"
        "). The cheapest fixes first: " + "; ".join(fixes(cfg, "stacked blocks" in parts))
        + "; or pass --no-memory-check "
        "if the estimate is wrong (see nnx_posttrain/train/memory.py).")


def fixes(cfg, scanning: bool = False) -> list[str]:
    """What would lower a run's memory, cheapest first: the blocks unrolled (``scanning``: they
    run as one scan over a stacked copy of their weights), a smaller frozen base, the
    checkpoint's dtype, a smaller micro-batch, remat, a full fine-tune's adapters or 16-bit
    weights instead, shorter sequences."""
    b, out = cfg.batching, []
    if scanning:
        out.append("--scan-layers off (no stacked copy of the decoder blocks' weights; a slower "
                   "first step)")
    if cfg.lora.rank and cfg.quantize == "none":
        out.append("--quantize int8 (the frozen base in int8)")
    if cfg.dtype == "float32" and model.checkpoint_dtype(cfg.model) in ("bfloat16", "float16"):
        out.append("--dtype auto (the checkpoint's 16-bit weights instead of float32)")
    micro = b.batch_size // b.grad_accum
    if micro > 1 and b.batch_size % (2 * b.grad_accum) == 0:
        out.append(f"--batching.grad-accum {2 * b.grad_accum} (micro-batches of {micro // 2})")
    if cfg.remat != "blocks":
        out.append("--remat blocks")
    if not cfg.lora.rank:
        out.append("--lora.rank 8 (adapters: no optimizer state for the base's weights)")
        if cfg.dtype in ("bfloat16", "auto"):
            out.append("--dtype bfloat16-params (no float32 master copy of the weights)")
    out.append(f"--batching.max-length {max(b.max_length // 2, 1)}")
    return out


def check_weights(cfg, what: str, nbytes: int | None) -> None:
    """``ConfigError`` when ``what``'s weights (``nbytes``, e.g. a teacher about to load) clearly
    cannot fit in the memory available, before they load (``--no-memory-check``: skip)."""
    free = device_memory.available_bytes() if cfg.memory_check and nbytes else None
    if free is None or nbytes <= free:
        return
    raise errors.ConfigError(
        f"{what} needs {nbytes / GiB:,.2f} GiB for its weights, and {free / GiB:,.2f} GiB are "
        f"free on {jax.local_devices()[0].platform}: hold it in a smaller dtype, use a smaller "
        "model, or pass --no-memory-check if the estimate is wrong")


class CheckedStep:
    """The jitted training step, compiled ahead of its first call (the same compilation the call
    would make) so that XLA's own figures for it — temporaries, and outputs not written over
    their inputs — are checked against the memory available before it runs: the part of a
    step's peak that the pre-load estimate can only guess. Calls whose last argument (the batch)
    has the first call's shapes run the compiled step; others the jitted function."""

    def __init__(self, jitted, cfg, echo=print, scanning: bool = False):
        self.jitted, self.cfg, self.echo, self.scanning = jitted, cfg, echo, scanning
        self.compiled = self.shapes = None

    def __call__(self, *args):
        # the state's and the frozen weights' shapes never change within a run: the batch's may
        leaves, tree = jax.tree.flatten(args[-1])
        shapes = (tree, [(tuple(x.shape), str(x.dtype)) for x in leaves])
        if self.compiled is None:
            try:
                self.compiled, self.shapes = self.jitted.lower(*args).compile(), shapes
            except jax.errors.JaxRuntimeError as exc:
                if not device_memory.out_of_memory(exc):
                    raise
                raise errors.ConfigError(self.refusal(exc)) from None
            self.check(self.compiled.memory_analysis(), flops_lib.step_flops(self.compiled))
        return (self.compiled if shapes == self.shapes else self.jitted)(*args)

    def refusal(self, exc) -> str:
        """The message of XLA's refusal to compile a step that does not fit (the TPU
        compiler's, before anything runs), with the cheapest fixes."""
        figures = device_memory.refused_figures(exc)
        need = (f"needs {figures[0] / GiB:,.2f} GiB per device, its inputs included, and "
                f"{figures[1] / GiB:,.2f} GiB are available" if figures else
                "does not fit (" + str(exc).strip().splitlines()[0][:300] + ")")
        return (f"the compiled training step {need} on {jax.local_devices()[0].platform}: XLA "
                "refused to compile it. The cheapest fixes first: "
                + "; ".join(fixes(self.cfg, self.scanning)))

    def check(self, stats, flops: float | None = None) -> None:
        """Echo XLA's figures and the step's estimated peak (the memory held now plus what the
        step adds); ``ConfigError`` when what it adds exceeds the memory free."""
        if stats is None:  # a backend that does not report it
            return
        need = stats.temp_size_in_bytes + max(stats.output_size_in_bytes
                                              - stats.alias_size_in_bytes, 0)
        free, held = device_memory.available_bytes(), device_memory.in_use_bytes()
        self.echo(f"compiled step: {need / GiB:,.2f} GiB per device beyond its inputs "
                  f"(XLA's temporaries {stats.temp_size_in_bytes / GiB:,.2f} GiB)"
                  + (f", {flops:.3e} FLOPs per device and step" if flops else "")
                  + (f", {free / GiB:,.2f} GiB free" if free is not None else ""))
        if held is not None:
            self.echo(f"estimated peak: {(held + need) / GiB:,.2f} GiB per device (held now "
                      f"{held / GiB:,.2f} GiB + the step's {need / GiB:,.2f} GiB)")
        if self.cfg.memory_check and free is not None and need > free:
            raise errors.ConfigError(
                f"the compiled training step needs {need / GiB:,.2f} GiB per device beyond its "
                f"inputs (XLA's figures), and {free / GiB:,.2f} GiB are free on "
                f"{jax.local_devices()[0].platform}: it would run out of memory. The cheapest "
                "fixes first: " + "; ".join(fixes(self.cfg, self.scanning))
                + "; or pass --no-memory-check.")
