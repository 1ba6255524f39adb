"""Typed run configuration: the settings every run has (``Config``), and their validation. Each
algorithm's run config derives from it with ``algo`` typed as the algorithm's own settings
(``algorithms.sft.SFTRunConfig``: the algorithm's ``RunConfig``, ``api.config_type(name)``).

Each field's default here is the one of a run on a user's data (TRL's conventions: sequences of
1,024 tokens, 16 examples per step in micro-batches of 4, warm-up over 10% of the steps, gradient
checkpointing): the first layer of ``ORDER``, written once. An algorithm's ``defaults`` hold only
what differs for it (its trainer's learning rate; the online methods' batches), the built-in
task's recipes what its tiny model needs.

The command line (``nnx_posttrain.cli``, through ``tyro``) makes every field an option
(``--steps 200``, ``--optim.learning-rate 3e-4``, ``--lora.rank 8``) with the field's docstring
as help; the Python API (``nnx_posttrain.configure``) takes the same names as keywords. The
common options (``--model``, ``--data``, ``--run-dir``, ``--steps``, ``--seed``, ``--resume``,
``--eval-only``) are top-level fields, so they have the same names in every algorithm.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Literal

from nnx_posttrain import errors


@dataclasses.dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 trains every weight (full fine-tuning)."""
    alpha: float | None = None
    """LoRA alpha (update scale alpha/rank); default: equal to the rank."""
    targets: str = "attention"
    """Layers to adapt: 'qv', 'attention' (q, k, v, o), 'mlp' (gate, up, down; a mixture of experts': its experts too), 'experts' (a mixture of experts' stacked expert kernels: per-expert factors), 'all-linear' (every Dense layer, not the experts), or comma-separated layer or expert kernel names; a vision model's encoder only where the list names 'projector' (its projection into the language model) or 'vision-attention' (the tower's q, k, v, o), beside those or alone (e.g. 'attention,projector')."""


@dataclasses.dataclass
class OptimConfig:
    learning_rate: float = 1e-4
    """Peak learning rate of AdamW."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up, down to min_lr_ratio * learning_rate at the last step."""
    warmup_steps: int | None = None
    """Linear warm-up steps from 0 to the peak learning rate; when given (0 included) it wins over --optim.warmup-ratio."""
    warmup_ratio: float = 0.1
    """Linear warm-up over this fraction of --steps (TRL's warmup_ratio), rounded up; used when --optim.warmup-steps is not given."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak (cosine and linear schedules)."""
    weight_decay: float = 0.0
    """Decoupled weight decay of AdamW."""
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is NaN or infinite is never applied; 'stop' ends the run there (exit 1, the kept checkpoints are the last good ones), 'skip' goes on without it (10 such steps in a row stop the run)."""

    def warmup(self, total_steps: int) -> int:
        """Warm-up steps of a run of ``total_steps``: warmup_steps if given, else
        ceil(warmup_ratio * total_steps)."""
        if self.warmup_steps is not None:
            return max(self.warmup_steps, 0)
        return math.ceil(max(self.warmup_ratio, 0.0) * total_steps)


@dataclasses.dataclass
class BatchingConfig:
    """How records become batches (``cfg.batching``, ``--batching.*``): sequence length, batch
    size, accumulation, truncation, packing, order. The data itself is ``cfg.data``."""

    max_length: int = 1024
    """Every sequence is padded or truncated to this many tokens (one compiled shape)."""
    batch_size: int = 16
    """Examples per optimizer step (global, over all devices and accumulation steps)."""
    grad_accum: int = 4
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
    every: int = 200
    """Evaluate every this many steps, and at the start (step 0, unless resuming) and the end; 0:
    at the start and the end only."""
    batches: int = 8
    """Held-out batches used for the eval loss; 0 uses the whole eval split."""
    exact_match: int = 200
    """Held-out prompts answered greedily for eval exact-match accuracy; 0 disables it."""
    max_new_tokens: int = 64
    """Generation budget of an exact-match answer."""


@dataclasses.dataclass
class CheckpointConfig:
    every: int = 200
    """Save a checkpoint every this many steps (and always at the end); 0 saves only at the end."""
    keep: int = 3
    """Keep the latest this many checkpoints (>= 1)."""
    keep_best: str | None = None
    """Also keep the best checkpoint by this eval metric (e.g. 'loss', 'exact_match')."""
    best_mode: Literal["min", "max"] = "min"
    """Whether the best --checkpoint.keep-best value is the smallest or the largest."""
    async_save: bool = True
    """Write checkpoints in the background while training continues."""


@dataclasses.dataclass
class MeshConfig:
    """The device mesh (data x fsdp x expert x tensor; the product must equal the number of devices
    of all processes) and, for several hosts, how the processes find each other."""

    data: int = -1
    """Devices on the data-parallel axis (batch split, weights replicated); -1: the devices the other axes leave."""
    fsdp: int = 1
    """Devices on the FSDP axis (batch split, weights / gradients / optimizer state sharded); -1: the rest."""
    tensor: int = 1
    """Devices on the tensor-parallel axis (heads, MLP width and vocabulary split); -1: the rest."""
    expert: int = 1
    """Devices on the expert axis of a mixture-of-experts model (Qwen3-MoE, Mixtral, GPT-OSS, Gemma 4 26B-A4B): its stacked experts are split over them (each device holds and computes its share of every MoE layer's experts) and the batch is split over them too, as over --mesh.data (the other weights are replicated on it). Must divide the model's expert count; a model without experts refuses more than 1."""
    cpu_devices: int | Literal["auto"] = 1
    """XLA devices the host CPU is split into when JAX runs on it (1: one device whose operations use every core). More than 1: the batch is split over them (data parallelism across cores), which is faster for small models, whose many small operations do not use several cores well (README, Scaling). 'auto': one per core this process may use (the most that divides the micro-batch) for a built-in tiny model on the default mesh in one process, else 1. Set before JAX starts: a process that has already used JAX must have this many CPU devices ('auto' takes what it has). No effect on GPUs / TPUs."""
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
        if not isinstance(self.expert, int) or self.expert < 1:
            out.append(f"--mesh.expert must be a positive device count (it divides the model's "
                       f"experts; no -1), got {self.expert}")
        if self.cpu_devices != "auto" and (not isinstance(self.cpu_devices, int)
                                           or self.cpu_devices < 1):
            out.append(f"--mesh.cpu-devices must be a count >= 1 or 'auto', got {self.cpu_devices!r}")
        if sum(size == -1 for size in sizes.values()) > 1:
            out.append("at most one of --mesh.data / --mesh.fsdp / --mesh.tensor may be -1 (the rest), "
                       f"got {sizes} (--mesh.data is -1 unless set: e.g. --mesh.data 1 --mesh.fsdp -1)")
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
    """Model: built-in config (gemma_tiny, gemma2_tiny, gemma_tiny_half, gemma_micro), short name (gemma_2b, llama3_8b, ...), KerasHub preset or kaggle:// / hf:// handle, or a local preset / Hugging Face directory."""
    data: str = "builtin"
    """Training data: 'builtin' (the arithmetic task); a .jsonl, .parquet or .arrow file; a glob of them ('data/train-*.parquet'); a Hugging Face datasets directory (save_to_disk) or a downloaded Hub dataset folder of Parquet shards; hf://ORG/NAME[:SPLIT] (a Hub dataset, through the local Hub cache); several, comma-separated, concatenated (a,b) or mixed with weights (a:0.7,b:0.3)."""
    eval_data: str | None = None
    """Held-out data, any source --data takes (a directory or hf:// dataset gives its eval / validation / test split); default: the built-in task's eval split when --data builtin, else none."""
    init_from: str | None = None
    """Start from the weights of this run directory's latest checkpoint (e.g. runs/sft) instead of the model's own; '' or None: the model's own."""
    chat_format: str | None = None
    """Chat template of conversational data: default the model family's (gemma, llama3, llama3.1, qwen2.5, qwen3, mistral); another family needs one named here (e.g. chatml)."""
    run_dir: str = ""
    """Run directory; default runs/<experiment>."""
    steps: int = 1000
    """Optimizer steps."""
    seed: int = 0
    """Seed of everything random in a run: weight initialisation (built-in models), LoRA and scalar-head init, data order, rollout sampling. The same seed gives the same run."""
    resume: bool = False
    """Continue from the latest checkpoint in --run-dir (also automatic when it has checkpoints); fails if there is none."""
    eval_only: bool = False
    """Evaluate the model on the eval data without training; print the metrics as JSON."""
    resume_changed: str = ""
    """Settings a resume may change, comma-separated (e.g. 'steps,optim.learning_rate'); any other difference from the checkpoint's settings is refused (README: Checkpoints and exact resume)."""
    memory_check: bool = True
    """Refuse to start when the estimated memory of a step exceeds the memory available."""
    dtype: Literal["auto", "float32", "bfloat16", "bfloat16-params"] = "auto"
    """auto = the checkpoint's own: a 16-bit checkpoint keeps a frozen base in bfloat16 (LoRA factors float32) or trains float32 master weights with bfloat16 compute, anything else (the built-in models) float32; float32; bfloat16 = bfloat16 compute with float32 weights; bfloat16-params = both bfloat16."""
    quantize: Literal["none", "int8"] = "none"
    """int8: the frozen base's weights in int8 (weight-only, Keras' own quantization; compute stays in the model's dtype) under LoRA, which needs --lora.rank > 0 (QLoRA-style); none: as loaded."""
    train_vision: bool = False
    """A vision-language model (Gemma 3 with its vision encoder): its vision tower (and its projection into the language model) trains too, every weight of it, beside the language model's LoRA adapters or weights; default frozen."""
    log_every: int = 10
    """Log training metrics every this many steps."""
    logprob_chunk: int | None = None
    """Sequence positions per chunk of the vocabulary projection, recomputed in the backward pass (bounds the logits in memory); 0: the whole sequence at once, no recomputation; default: at once while a batch's float32 logits take <= 256 MiB (a CPU host) or a sixteenth of the device's memory (an accelerator), else chunks of positions whose logits fit that (multiples of 128)."""
    report_to: str = "tensorboard,jsonl"
    """Where metrics go, comma-separated: tensorboard (runs/<name>/tb), jsonl (metrics.jsonl, completions.jsonl), wandb (Weights & Biases: WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE=offline), or none."""
    config: str | None = None
    """YAML or JSON file of option values (experiments/configs/*.yaml, or a run's config.json); options on the command line override it."""
    remat: Literal["none", "blocks"] = "blocks"
    """Rematerialisation: 'blocks' recomputes each decoder block's activations in the backward pass (less memory, ~1/3 more compute)."""
    host_allocator: Literal["auto", "heap", "default"] = "auto"
    """On CPU, glibc's allocator for XLA's step buffers: 'heap' serves every block from the heap and keeps its freed pages between steps (no page faults per step); 'auto' does that for models whose steps have no block of 32 MB (the built-in tiny ones); 'default' leaves glibc's settings. A GLIBC_TUNABLES set by the user wins."""
    compile_cache: str = "auto"
    """JAX's persistent compilation cache, so that a resume or a second run of the same shapes reads its compiled step instead of compiling it again: auto = the folder .jax_cache beside the run directory (runs/.jax_cache), unless JAX already has one (JAX_COMPILATION_CACHE_DIR); a folder; none = off."""
    attention: Literal["auto", "keras", "xla", "cudnn", "splash"] = "auto"
    """Attention kernel of the training forward: auto = splash on TPU, cuDNN on GPU, the exact XLA formulation otherwise; keras = KerasHub's own. A kernel that cannot do a layer's feature falls back to keras; the run prints the path it took."""
    scan_layers: Literal["auto", "on", "off"] = "off"
    """Run the decoder blocks of the training forward as one jax.lax.scan over their stacked weights: one block is traced and compiled instead of every one (a faster first step: the gemma_2b-shaped headline on a TPU v5e 90.5 -> 38.2 s), for one more copy of the blocks' weights in the step and slower steps (there 0.386 -> 0.473 s: the weights are stacked again for each micro-batch), so it pays for short runs. auto = where the blocks are identical and there are at least 8 of them; on = scan, or refuse naming why the blocks cannot (they differ, a mixture of experts); off (the default) = one block after the other, as KerasHub calls them."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    batching: BatchingConfig = dataclasses.field(default_factory=BatchingConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    algo: None = None
    """The algorithm's settings: none here; each algorithm's run config types it by the algorithm
    (``SFTRunConfig.algo: SFTConfig``, ``api.config_type(name)``)."""

    def validate(self) -> "Config":
        """Every problem of the settings at once, the algorithm's (``algo.problems()``, its loss
        family's checks) included, as one ``ConfigError`` ('invalid configuration'); returns
        ``self``."""
        problems = [f"{option} must be a finite number, got {value}"
                    for option, value in _floats(self) if not math.isfinite(value)]
        if self.steps < 0:
            problems.append(f"--steps must be >= 0, got {self.steps}")
        problems += _batching_problems(self.batching)
        if self.lora.rank < 0:
            problems.append(f"--lora.rank must be >= 0, got {self.lora.rank}")
        problems += _optim_problems(self)
        if self.logprob_chunk is not None and self.logprob_chunk < 0:
            problems.append(f"--logprob-chunk must be >= 0 (0: no chunking), got {self.logprob_chunk}")
        if self.log_every <= 0:
            problems.append("--log-every must be positive")
        if self.quantize != "none" and not self.lora.rank:
            problems.append(f"--quantize {self.quantize} quantizes the frozen base under LoRA: "
                            "pass --lora.rank (full fine-tuning trains the weights it would "
                            "quantize)")
        if self.checkpoint.keep_best == "exact_match" and self.eval.exact_match == 0:
            problems.append("--checkpoint.keep-best exact_match needs exact-match evaluation, but "
                            "--eval.exact-match is 0")
        problems.extend(self.mesh.problems())
        problems.extend(report_problems(self.report_to))
        problems.extend(getattr(self.algo, "problems", list)())
        if problems:
            source = f" (the flags and {self.config})" if self.config else ""
            raise errors.ConfigError(f"invalid configuration{source}:\n  " + "\n  ".join(problems))
        return self


def _batching_problems(b: BatchingConfig) -> list[str]:
    out = []
    if b.batch_size <= 0 or b.grad_accum <= 0 or b.batch_size % b.grad_accum:
        out.append(f"--batching.batch-size ({b.batch_size}) must be a positive multiple of "
                   f"--batching.grad-accum ({b.grad_accum})")
    if b.max_length < 2:
        out.append(f"--batching.max-length must be >= 2, got {b.max_length}")
    if b.num_workers < 0:
        out.append(f"--batching.num-workers must be >= 0, got {b.num_workers}")
    if b.max_prompt_length is not None and b.max_prompt_length < 1:
        out.append(f"--batching.max-prompt-length must be >= 1, got {b.max_prompt_length}")
    return out


def _optim_problems(cfg: Config) -> list[str]:
    """The learning rate, the numbers that must lie in a range, Adam's betas."""
    o = cfg.optim
    out = ["--optim.learning-rate must be >= 0"] if o.learning_rate < 0 else []
    return out + _range_problems(cfg) + [
        f"{option} must be in [0, 1), got {value}"
        for option, value in (("--optim.b1", o.b1), ("--optim.b2", o.b2)) if not 0 <= value < 1]


def _range_problems(cfg: Config) -> list[str]:
    """The numbers that must lie in a range (the ones that are not finite are reported as such)."""
    o, out = cfg.optim, []
    for option, value, low, high in (
        ("--optim.warmup-steps", 0 if o.warmup_steps is None else o.warmup_steps, 0, None),
        ("--optim.warmup-ratio", o.warmup_ratio, 0, 1),
        ("--optim.weight-decay", o.weight_decay, 0, None),
        ("--optim.max-grad-norm", o.max_grad_norm, 0, None),
        ("--optim.eps", o.eps, 0, None),
        ("--optim.min-lr-ratio", o.min_lr_ratio, 0, 1),
        ("--eval.every", cfg.eval.every, 0, None),
        ("--eval.batches", cfg.eval.batches, 0, None),
        ("--eval.exact-match", cfg.eval.exact_match, 0, None),
        ("--eval.max-new-tokens", cfg.eval.max_new_tokens, 1, None),
        ("--checkpoint.every", cfg.checkpoint.every, 0, None),
        ("--checkpoint.keep", cfg.checkpoint.keep, 1, None),
    ):
        if math.isfinite(value) and (value < low or (high is not None and value > high)):
            out.append(f"{option} must be " + (f">= {low}" if high is None else f"in [{low}, {high}]")
                       + f", got {value}")
    return out


ORDER = (
    "the algorithm's defaults for a user's data (TRL's: nnx_posttrain/config.py's, with the "
    "algorithm's `defaults` over them)",
    "the built-in task's recipe, when --data is builtin (the default) or builtin:shapes",
    "the --config file (YAML or JSON)",
    "the settings given: keywords of nnx_posttrain.configure, then flags",
)
"""How a run's settings resolve, first to last (``nnx_posttrain.api.configure``)."""


def resolved_from(cfg: Config) -> list[str]:
    """The layers of ``ORDER`` this config's values came from, first to last, as ``config.json``
    records them."""
    algorithm = "the algorithm" if cfg.algo is None else type(cfg.algo).__name__.removesuffix(
        "Config") + "'s"
    out = [f"{algorithm} defaults for a user's data"]
    if cfg.data == "builtin":
        out.append("the built-in task's recipe (nnx_posttrain/tasks/recipes/)")
    elif cfg.data == "builtin:shapes":
        out.append("the image task's recipe where the algorithm has one "
                   "(nnx_posttrain/tasks/recipes/shapes/)")
    if cfg.config:
        out.append(f"the config file {cfg.config}")
    return out + ["the settings given (keywords, flags)"]


REPORT_TO = ("tensorboard", "jsonl", "wandb", "none")


def report_problems(report_to: str) -> list[str]:
    names = [x.strip() for x in report_to.split(",") if x.strip()]
    bad = [x for x in names if x not in REPORT_TO]
    if bad or not names or ("none" in names and len(names) > 1):
        return [f"--report-to must be a comma-separated list of {', '.join(REPORT_TO[:3])} (or "
                f"none alone), got {report_to!r}"]
    return []


def _floats(cfg, prefix="--"):
    """(option name, value) of every float setting of ``cfg``, nested groups included."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        option = prefix + f.name.replace("_", "-")
        if dataclasses.is_dataclass(value):
            yield from _floats(value, option + ".")
        elif isinstance(value, float):
            yield option, value


def to_dict(cfg: Config) -> dict:
    out = dataclasses.asdict(cfg)
    out["algo_name"] = type(cfg.algo).__name__ if cfg.algo is not None else None
    out["resolved_from"] = resolved_from(cfg)
    return out


def save(cfg: Config, path: Path) -> dict:
    """Write ``path`` atomically (a temporary file renamed over it): a reader never sees half.
    ``--resume`` (an instruction to one command, not a setting of the run) is saved off, so that
    the file repeats the run in another --run-dir. Returns what it wrote, as read back."""
    text = json.dumps(saved(cfg), indent=2, sort_keys=True) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return json.loads(text)


def saved(cfg: Config) -> dict:
    """What ``save`` writes, as JSON reads it back."""
    return json.loads(json.dumps(to_dict(dataclasses.replace(cfg, resume=False))))


def __getattr__(name):  # old names, kept importable with a deprecation message
    if name == "DataConfig":
        import warnings

        warnings.warn("nnx_posttrain.config.DataConfig is now BatchingConfig (cfg.batching); "
                      "the old name will be removed", DeprecationWarning, stacklevel=2)
        return BatchingConfig
    raise AttributeError(f"module 'nnx_posttrain.config' has no attribute {name!r}")
