"""Typed run configuration and its command line.

Every experiment is a ``Config`` with its own defaults; ``tyro`` turns it into a command line where
every field is an option (``--steps 200``, ``--optim.learning-rate 3e-4``, ``--lora.rank 8``),
with the field's docstring as help, and rejects unknown or ill-typed options by name.
The common options (``--model``, ``--data``, ``--run-dir``, ``--steps``, ``--seed``, ``--resume``,
``--eval-only``) are top-level fields, so they have the same names in every experiment.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import tyro


@dataclasses.dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 trains every weight (full fine-tuning)."""
    alpha: float | None = None
    """LoRA alpha (update scale alpha/rank); default: equal to the rank."""
    targets: str = "attention"
    """Layers to adapt: 'qv', 'attention' (q, k, v, o), 'all-linear', or comma-separated layer names."""


@dataclasses.dataclass
class OptimConfig:
    learning_rate: float = 1e-4
    """Peak learning rate of AdamW."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up, down to min_lr_ratio * learning_rate at the last step."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to the peak learning rate."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak (cosine and linear schedules)."""
    weight_decay: float = 0.0
    """Decoupled weight decay of AdamW."""
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""


@dataclasses.dataclass
class DataConfig:
    max_length: int = 64
    """Every sequence is padded or truncated to this many tokens (one compiled shape)."""
    batch_size: int = 16
    """Examples per optimizer step (global, over all devices and accumulation steps)."""
    grad_accum: int = 1
    """Split each batch into this many micro-batches; the update equals the one large batch."""
    truncation: Literal["keep_start", "keep_end"] = "keep_start"
    """Which end of an over-long sequence to keep."""
    packing: bool = False
    """SFT: pack several examples into each max-length row (attention never crosses them)."""
    shuffle: bool = True
    """Shuffle the training data (deterministically, by --seed and epoch)."""
    format: Literal["auto", "language_modeling", "prompt_completion", "preference",
                    "unpaired_preference", "prompt_only"] = "auto"
    """Data format; 'auto' detects it from the columns (text/messages, prompt+completion, chosen+rejected, prompt+completion+label, prompt alone)."""
    max_prompt_length: int | None = None
    """Prompt tokens kept (a longer prompt keeps its end and its BOS); None: no separate limit (prompt-only data: max-length)."""
    skip_bad: bool = False
    """Skip bad records (counted and reported) instead of stopping before training at the first one."""
    num_workers: int = 0
    """Grain worker processes that read and tokenize training data; 0 does it in the training process."""


@dataclasses.dataclass
class EvalConfig:
    every: int = 100
    """Evaluate every this many steps (and at the end); 0 evaluates only at the end."""
    batches: int = 8
    """Held-out batches used for the eval loss; 0 uses the whole eval split."""
    exact_match: int = 200
    """Held-out prompts answered greedily for eval exact-match accuracy; 0 disables it."""
    max_new_tokens: int = 8
    """Generation budget of an exact-match answer."""


@dataclasses.dataclass
class CheckpointConfig:
    every: int = 200
    """Save a checkpoint every this many steps (and always at the end); 0 saves only at the end."""
    keep: int = 3
    """Keep the latest this many checkpoints."""
    keep_best: str | None = None
    """Also keep the best checkpoint by this eval metric (e.g. 'loss', 'exact_match')."""
    best_mode: Literal["min", "max"] = "min"
    """Whether the best --checkpoint.keep-best value is the smallest or the largest."""
    async_save: bool = True
    """Write checkpoints in the background while training continues."""


@dataclasses.dataclass
class MeshConfig:
    """The device mesh (data x fsdp x tensor; the product must equal the number of devices of all
    processes) and, for several hosts, how the processes find each other."""

    data: int = -1
    """Devices on the data-parallel axis (batch split, weights replicated); -1: the devices the other axes leave."""
    fsdp: int = 1
    """Devices on the FSDP axis (batch split, weights / gradients / optimizer state sharded); -1: the rest."""
    tensor: int = 1
    """Devices on the tensor-parallel axis (heads, MLP width and vocabulary split); -1: the rest."""
    distributed: Literal["auto", "on", "off"] = "auto"
    """Multi-process JAX: 'auto' calls jax.distributed.initialize when a coordinator address or more than one process is given (here or by JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); 'on' always calls it (JAX detects TPU pod slices, SLURM, Open MPI itself); 'off' never."""
    coordinator_address: str | None = None
    """host:port of process 0's coordinator (default: $JAX_COORDINATOR_ADDRESS; auto-detected on TPU / SLURM)."""
    num_processes: int | None = None
    """Number of processes (default: $JAX_NUM_PROCESSES; auto-detected on TPU / SLURM)."""
    process_id: int | None = None
    """This process's index, 0 .. num_processes - 1 (default: $JAX_PROCESS_ID; auto-detected on TPU / SLURM)."""

    def problems(self) -> list[str]:
        out = []
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            if size == 0 or size < -1:
                out.append(f"--mesh.{name} must be a positive device count or -1 (the rest), got {size}")
        if sum(size == -1 for size in sizes.values()) > 1:
            out.append("at most one of --mesh.data / --mesh.fsdp / --mesh.tensor may be -1 (the rest), "
                       f"got {sizes}")
        if self.num_processes is not None and self.num_processes < 1:
            out.append(f"--mesh.num-processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and (self.process_id < 0 or (
                self.num_processes is not None and self.process_id >= self.num_processes)):
            out.append(f"--mesh.process-id must be in 0 .. num-processes - 1, got {self.process_id} "
                       f"of {self.num_processes}")
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            out.append(f"--mesh.coordinator-address must be host:port, got {self.coordinator_address!r}")
        return out


@dataclasses.dataclass
class Config:
    """A training run. Algorithm-specific settings live under ``algo``."""

    model: str = "gemma_tiny"
    """Model: built-in config (gemma_tiny, gemma2_tiny, gemma_micro), short name (gemma_2b, llama3_8b, ...), KerasHub preset or kaggle:// / hf:// handle, or a local preset / Hugging Face directory."""
    data: str = "builtin"
    """Training data: 'builtin' (the arithmetic task) or a .jsonl file."""
    eval_data: str | None = None
    """Held-out data (.jsonl); default: the built-in task's eval split when --data builtin, else none."""
    init_from: str | None = None
    """Start from the weights of this run directory's latest checkpoint (e.g. runs/sft) instead of the model's own."""
    run_dir: str = ""
    """Run directory; default runs/<experiment>."""
    steps: int = 600
    """Optimizer steps."""
    seed: int = 0
    """Seed of everything random in a run: weight initialisation (built-in models), LoRA and scalar-head init, data order, rollout sampling. The same seed gives the same run."""
    resume: bool = False
    """Continue from the latest checkpoint in --run-dir (also automatic when it has checkpoints); fails if there is none."""
    eval_only: bool = False
    """Evaluate the model on the eval data without training; print the metrics as JSON."""
    dtype: Literal["float32", "bfloat16", "bfloat16-params"] = "float32"
    """float32; bfloat16 = bfloat16 compute with float32 weights; bfloat16-params = both bfloat16."""
    log_every: int = 10
    """Log training metrics every this many steps."""
    logprob_chunk: int = 128
    """Sequence positions per chunk when computing log-probs (bounds the logits in memory); 0: the whole sequence at once, no recomputation."""
    remat: Literal["none", "blocks"] = "none"
    """Rematerialisation: 'blocks' recomputes each decoder block's activations in the backward pass (less memory, ~1/3 more compute)."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    batching: DataConfig = dataclasses.field(default_factory=DataConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    algo: Any = None
    """Algorithm settings (a dataclass per algorithm)."""

    def validate(self) -> "Config":
        problems = []
        if self.steps < 0:
            problems.append(f"--steps must be >= 0, got {self.steps}")
        b = self.batching
        if b.batch_size <= 0 or b.grad_accum <= 0 or b.batch_size % b.grad_accum:
            problems.append(
                f"--batching.batch-size ({b.batch_size}) must be a positive multiple of "
                f"--batching.grad-accum ({b.grad_accum})"
            )
        if b.max_length < 2:
            problems.append(f"--batching.max-length must be >= 2, got {b.max_length}")
        if b.num_workers < 0:
            problems.append(f"--batching.num-workers must be >= 0, got {b.num_workers}")
        if b.max_prompt_length is not None and b.max_prompt_length < 1:
            problems.append(f"--batching.max-prompt-length must be >= 1, got {b.max_prompt_length}")
        if self.lora.rank < 0:
            problems.append(f"--lora.rank must be >= 0, got {self.lora.rank}")
        if self.optim.learning_rate < 0:
            problems.append("--optim.learning-rate must be >= 0")
        if self.logprob_chunk < 0:
            problems.append(f"--logprob-chunk must be >= 0 (0: no chunking), got {self.logprob_chunk}")
        if self.log_every <= 0:
            problems.append("--log-every must be positive")
        problems.extend(self.mesh.problems())
        if problems:
            raise SystemExit("invalid configuration:\n  " + "\n  ".join(problems))
        return self


def parse(default: Config, args: list[str] | None = None, description: str | None = None) -> Config:
    """Command line -> Config, starting from an experiment's defaults."""
    cfg = tyro.cli(type(default), default=default, args=args, description=description)
    return cfg.validate()


def to_dict(cfg: Config) -> dict:
    out = dataclasses.asdict(cfg)
    out["algo_name"] = type(cfg.algo).__name__ if cfg.algo is not None else None
    return out


def save(cfg: Config, path: Path) -> None:
    path.write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")
