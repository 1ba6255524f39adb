"""Runs: building a run's model from its settings, and reading a checkpoint back into a live NNX
model in a fresh process (notebooks, tools, ``--init-from``, reward-model rewards)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from nnx_posttrain import checkpoint, config as config_lib, cpu_host, data, errors, model, sharding
from nnx_posttrain import tasks
from nnx_posttrain.algorithms import registry
from nnx_posttrain.model import heads


@dataclasses.dataclass
class LoadedRun:
    run_dir: Path
    config: dict
    step: int
    lm: model.LanguageModel
    state: dict  # params, step, rng — as saved (the optimizer state is not read)
    module: nnx.Module  # the trained model with the checkpoint's weights in it: the backbone, or
    # the algorithm's wrapper around it (a reward model's scalar head, a policy's value head)

    def policy(self) -> nnx.Module:
        """The language model that generates (and is exported): the backbone, a PPO run's
        without its value head (TRL's PPO saves the policy alone). A reward model has none:
        ``NotAPolicyError`` saying how it is used instead."""
        if isinstance(self.module, heads.RewardModel):
            raise NotAPolicyError(self.run_dir)
        if isinstance(self.module, heads.PolicyWithValue):
            return self.module.backbone
        return self.module


class NotAPolicyError(errors.RunDirError, ValueError):
    """A run whose model does not generate (a reward model); the message says how it is used."""

    def __init__(self, run_dir):
        super().__init__(
            f"{run_dir} is a reward model (a scalar head on the backbone): it scores completions "
            f"and does not generate, and only language models are exported. Use it as an online "
            f"run's reward (--algo.rewards {run_dir}), or score token ids with "
            "runs.load(...).module(ids, mask) in a notebook")


def check_policy(run_dir: str | Path) -> dict:
    """``run_dir``'s config, after checking, before anything loads, that its model generates
    (``NotARunError``, ``NotAPolicyError``)."""
    saved = run_config(run_dir)
    if head_of(saved) == "reward":
        raise NotAPolicyError(run_dir)
    return saved


class NotARunError(errors.RunDirError, FileNotFoundError):
    """A directory given as a run that is none (no config.json, or not a run's)."""


class NoCheckpointError(errors.CheckpointError, FileNotFoundError):
    """A run without the checkpoint asked for (none complete, or not that step)."""


def run_config(run_dir: str | Path) -> dict:
    """The settings a run saved (``config.json``); ``NotARunError`` naming the cause for a
    directory without one, a file not JSON, or one not a run's (an exported model's)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        run = Path(run_dir).parent
        if run.name == "checkpoints" and (run.parent / "config.json").is_file():
            raise NotARunError(f"{run_dir}: a checkpoint, not a run directory: give the run, "
                               f"{run.parent} (its latest checkpoint is read; nnx-posttrain sample and "
                               "export take --step N for another)")
        raise NotARunError(f"{run_dir}: not a run directory (no config.json)")
    try:
        saved = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise NotARunError(f"{path}: not JSON ({exc}); a run writes it whole: it was cut or "
                           "edited") from None
    missing = [k for k in ("model", "lora") if not isinstance(saved, dict) or k not in saved]
    if missing:
        raise NotARunError(
            f"{path}: not a run's config.json (no {', '.join(map(repr, missing))}): {run_dir} "
            "is not a training run's directory (an exported model loads with --model DIR)")
    return saved


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a run's model is built from: the model (``--model``), ``dtype`` (``--dtype``),
    ``seed`` (every random initialisation: a built-in model's weights, LoRA, the head),
    ``lora``, the algorithm's scalar ``head`` (if any), ``chat_format``, ``quantize`` ('int8'
    quantizes the frozen base before LoRA is added: ``model.quantize``), ``remat``, the
    weights of ``init_from``'s checkpoint ``init_step`` (default: its latest), ``train_vision``."""

    name: str
    dtype: str = "auto"
    seed: int = 0
    lora: config_lib.LoraConfig = dataclasses.field(default_factory=config_lib.LoraConfig)
    head: str | None = None
    chat_format: str | None = None
    quantize: str = "none"
    remat: bool = False
    init_from: str | None = None
    init_step: int | None = None
    train_vision: bool = False

    @classmethod
    def of(cls, cfg, head: str | None = None, init_step: int | None = None) -> "ModelSpec":
        """The model of run config ``cfg`` (``nnx_posttrain.config.Config``)."""
        return cls(cfg.model, cfg.dtype, cfg.seed, cfg.lora, head, cfg.chat_format, cfg.quantize,
                   cfg.remat == "blocks", cfg.init_from, init_step, cfg.train_vision)


def build_model(spec: ModelSpec, echo=print, abstract: bool = False, platform: str | None = None):
    """(language model, module) of a run (``spec``): the model loaded, the weights of
    ``init_from``'s checkpoint copied in, LoRA added, rematerialisation set, and the algorithm's
    scalar head (if any) on top. ``init_from`` is checked before the model loads (a mismatch
    costs no loading time). ``abstract``: the same model built from its config alone inside
    ``nnx.eval_shape`` (no weight file read, no memory taken: every variable a
    ``jax.ShapeDtypeStruct``; ``init_from``'s weights are not read), for planning a run whose
    step runs on ``platform`` (default: this process's backend). The built-in models are
    registered first (``tasks.register``)."""
    tasks.register()
    platform = platform or jax.default_backend()
    if spec.init_from:
        check_init_from(spec.init_from, spec.name, spec.init_step)
    dtype = model.resolve_dtype(spec.name, spec.dtype, bool(spec.lora.rank))
    float32_factors = spec.dtype == model.AUTO and dtype == "bfloat16-params"
    stored = model.checkpoint_dtype(spec.name) if spec.dtype == model.AUTO else None
    echo(f"{'building' if abstract else 'loading'} model {spec.name} ({dtype}"
         + (", LoRA factors in float32" if float32_factors and spec.lora.rank else "")
         + (f": the checkpoint's {stored}, --dtype auto" if stored else "")
         + (", abstract: no weights" if abstract else "") + ") ...")
    start = time.perf_counter()
    made = {}

    def assemble():
        lm = made["lm"] = model.load(spec.name, dtype=dtype, seed=spec.seed,
                                     chat_format=spec.chat_format, weights=not abstract,
                                     quantize=spec.quantize)
        lm.images = data.ImageSpec.of_model(lm)  # a vision model's, for data.make_transform
        if not abstract:
            echo(f"loaded {spec.name} in {time.perf_counter() - start:.1f} s")
        if spec.init_from and not abstract:
            echo(init_weights(lm.module, spec.init_from, spec.init_step))
        _adapt(lm, spec, float32_factors, echo)
        # XLA:CPU computes bfloat16 matmuls in float32: keep those copies of frozen weights local
        model.set_remat(lm.module, spec.remat,
                        lazy_frozen=dtype != "float32" and platform == "cpu")
        return lm.task, heads.wrap(spec.head, lm.module, seed=spec.seed)

    if not abstract:
        _, module = assemble()
        return made["lm"], module
    task, module = model.eval_shape_task(assemble)  # they share their variables
    return model.outside_the_trace(dataclasses.replace(made["lm"], task=task), module), module


def _adapt(lm, spec: ModelSpec, float32_factors: bool, echo) -> None:
    """``spec``'s int8 quantization of the frozen base, then its LoRA adapters, a vision tower."""
    if spec.quantize != "none":
        echo(f"quantized {model.quantize(lm.module, spec.quantize)} layers to {spec.quantize} "
             "(weights only)")
    lora = spec.lora
    if lora.rank:
        try:
            model.enable_lora(lm.module, lora.rank, lora.alpha, lora.targets, seed=spec.seed,
                              factor_dtype="float32" if float32_factors else None)
        except ValueError as exc:  # targets that name no layer (a UserError says so itself)
            raise exc if isinstance(exc, errors.UserError) else errors.ModelError(
                f"--lora.targets {lora.targets}: {exc}") from None
    model.freeze_tower(lm.module, spec.train_vision)  # a vision encoder: frozen by default


def load(run_dir: str | Path, step: int | None = None, mesh_devices: int = -1,
         echo=print) -> LoadedRun:
    """Load ``run_dir``'s checkpoint ``step`` (default: the newest whole one) into a model built
    from the run's own config, laid out on a mesh of this process's devices. Only the weights (and
    the step and RNG) are read: no optimizer state is built. A run still training there may
    rotate its checkpoints meanwhile, and its newest may be damaged: see ``read_whole``."""
    run_dir = Path(run_dir)
    saved_cfg = run_config(run_dir)
    cpu_host.prefer_cpu()
    cfg = config_lib.Config(
        model=saved_cfg["model"], dtype=saved_cfg["dtype"], seed=saved_cfg["seed"],
        lora=config_lib.LoraConfig(**saved_cfg["lora"]),
        checkpoint=dataclasses.replace(config_lib.CheckpointConfig(), async_save=False),
        chat_format=saved_cfg.get("chat_format"), quantize=saved_cfg.get("quantize", "none"),
    )
    with _reading(run_dir) as ckpt:
        _pick_step(ckpt, run_dir, step)  # a missing checkpoint: before the model is built
        lm, module = build_model(ModelSpec(cfg.model, cfg.dtype, cfg.seed, cfg.lora,
                                           head=head_of(saved_cfg), chat_format=cfg.chat_format,
                                           quantize=cfg.quantize, train_vision=saved_cfg.get(
                                               "train_vision", False)), echo=echo)
        _, params, _ = model.split(module)
        mesh = sharding.make_mesh(config_lib.MeshConfig(data=mesh_devices))
        replicated = NamedSharding(mesh, P())
        template = {"params": params, "step": jnp.zeros((), jnp.int32),
                    "rng": jax.random.key_data(jax.random.key(cfg.seed))}
        abstract, record = (checkpoint.abstract(template, replicated),
                            checkpoint.model_record(cfg, template))
        step, state = read_whole(ckpt, run_dir, step,
                                 lambda k: ckpt.restore_weights(k, abstract, record), echo)
    nnx.update(module, state["params"])
    return LoadedRun(run_dir, saved_cfg, step, lm, state, module)


READ_ATTEMPTS = 5  # newest checkpoints rotated away while read, before giving up


def read_whole(ckpt: checkpoint.Checkpointer, run_dir: Path, step: int | None, read, echo=print):
    """(the step read, ``read(step)``) of checkpoint ``step`` or, without one, of the newest
    whole checkpoint, where a run still training in ``run_dir`` saves and rotates them
    (``--checkpoint.keep``) meanwhile: one removed while it was read gives way to the newest
    again; a newest one that cannot be read (damaged) to the one before it, said with ``echo``
    (a reader leaves it in place; training the run sets it aside). ``NoCheckpointError`` when no
    whole one is left, or a ``step`` asked for was removed; ``CheckpointError`` for a ``step``
    asked for that is damaged. Failures that are not the files' (another model, out of memory)
    pass."""
    damaged: dict[int, str] = {}
    for _ in range(READ_ATTEMPTS):
        chosen = step if step is not None else next(
            (k for k in reversed(_steps(ckpt)) if k not in damaged), None)
        if chosen is None:
            raise _none_whole(run_dir, damaged)
        try:
            return chosen, read(chosen)
        except Exception as exc:  # noqa: BLE001  (Orbax and TensorStore raise many kinds)
            why = checkpoint.damage(exc)
            if why is None:
                raise
            gc.collect()  # the failed read's coroutines finalised while quiet_reads hears them
        where = run_dir / "checkpoints" / str(chosen)
        if _rotated(ckpt, chosen, step is not None, set(damaged)):
            if step is not None:
                raise NoCheckpointError(
                    f"{run_dir / 'checkpoints'}: checkpoint {step} was removed while it was read "
                    "(a run still training there keeps only its last --checkpoint.keep "
                    "checkpoints); read it again with a later --step, or without one")
            continue
        if step is not None:
            raise errors.CheckpointError(
                f"{where} cannot be read ({why}): it is damaged. Read another --step, or none "
                "for the newest whole checkpoint")
        damaged[chosen] = why
        echo(f"checkpoint {where} cannot be read ({why}): it is damaged; reading the one "
             "before it (resuming the run sets it aside)")
    raise NoCheckpointError(
        f"{run_dir / 'checkpoints'}: the run training there removed {READ_ATTEMPTS} checkpoints "
        "in a row while they were read (it saves often and keeps few: --checkpoint.keep); read "
        "it again, or copy the run directory and read the copy")


def _none_whole(run_dir: Path, damaged: dict[int, str]) -> NoCheckpointError:
    said = "; ".join(f"checkpoint {k}: {why}" for k, why in sorted(damaged.items()))
    return NoCheckpointError(f"{run_dir / 'checkpoints'}: no complete checkpoint"
                             + (f" that can be read ({said})" if damaged else ""))


def _steps(ckpt: checkpoint.Checkpointer) -> list[int]:
    """The complete checkpoints' steps as the directory holds them now."""
    def listed():
        ckpt.manager.reload()
        return ckpt.all_steps()
    return _listed(listed)


def _listed(fn):
    """``fn()``, which lists a run's checkpoints: again where a run rotating them removed one
    while it was listed (Orbax lists the folders, then reads each one's metadata)."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return fn()
        except FileNotFoundError:
            if attempt == READ_ATTEMPTS - 1:
                raise
            time.sleep(0.05)


def _rotated(ckpt: checkpoint.Checkpointer, step: int, explicit: bool, damaged: set) -> bool:
    """Whether checkpoint ``step``, whose read failed, was being removed by its run's rotation:
    its folder gone; reading the newest (not ``explicit``), also a newer one saved since, not
    one of those known ``damaged`` (the rotation removes a checkpoint only after saving a newer
    one)."""
    folder = ckpt.directory / str(step)
    for _ in range(10 if explicit else 1):  # a removal under way: its folder goes at the end
        steps = set(_steps(ckpt)) - damaged
        if not folder.exists() or step not in steps or (not explicit and max(steps) > step):
            return True
        if explicit:
            time.sleep(0.1)
    return False


def _pick_step(ckpt, run_dir: Path, step: int | None) -> int:
    """``step``, or the newest complete checkpoint, as the directory holds them now."""
    steps = _steps(ckpt)
    step = (steps[-1] if steps else None) if step is None else step
    if step is None or step not in steps:
        raise NoCheckpointError(
            f"{run_dir / 'checkpoints'}: no complete checkpoint"
            + (f" at step {step}; available: {steps}" if step is not None else ""))
    return step


def head_of(saved_cfg: dict) -> str | None:
    """The scalar head of the algorithm that trained a run (found by its settings' class name)."""
    by_config = {a.Config.__name__: a for a in registry.ALGORITHMS.values()}
    algorithm = by_config.get(saved_cfg.get("algo_name"))
    return None if algorithm is None else algorithm.head


def param_leaves(state) -> dict[str, jax.Array]:
    """{Keras variable path: array} of the trainable variables of a training state."""
    return model.named_variables(state["params"])


def _same_model(a: str, b: str) -> bool:
    """Whether two --model values name the same model (local directories by their real path)."""
    if model.is_local_model(a) and model.is_local_model(b):
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    return a == b


def check_init_from(run_dir: str | Path, name: str, step: int | None = None) -> dict:
    """``run_dir``'s config, after checking, without loading anything, that its weights can
    start a run of model ``name``: a run directory, of the same model, without LoRA, with a
    complete checkpoint (checkpoint ``step``, where a resumed run started from it). Each refusal
    says how to go on."""
    run_dir = Path(run_dir)
    fresh = "--init-from '' to start from the model's own weights"
    if not (run_dir / "config.json").exists() and run_dir.parent.name != "checkpoints":
        raise errors.CheckpointError(
            f"--init-from {run_dir}: not a run directory (no config.json). The built-in recipes "
            "of the preference and online experiments start from the SFT run: run `python -m "
            f"experiments.sft` first, or pass --init-from with another run, or {fresh}.")
    try:
        saved = run_config(run_dir)
    except NotARunError as exc:
        raise errors.CheckpointError(f"--init-from {exc}") from None
    if not _same_model(saved["model"], name):
        raise errors.CheckpointError(
            f"--init-from {run_dir}: that run trained {saved['model']!r}, this run loads "
            f"{name!r}. Pass {fresh}, or --init-from a run of {name!r}, or --model "
            f"{saved['model']!r}.")
    if saved["lora"]["rank"]:
        raise errors.CheckpointError(
            f"--init-from {run_dir}: a LoRA run; export it with LoRA merged first "
            f"(nnx-posttrain export {run_dir} --to DIR, then --model DIR), or {fresh}")
    with _reading(run_dir) as ckpt:
        if not _steps(ckpt):
            raise errors.CheckpointError(
                f"--init-from {run_dir}: no complete checkpoint in "
                f"{run_dir / 'checkpoints'}; {fresh}")
        if step is not None and step not in ckpt.all_steps():
            raise errors.CheckpointError(
                f"--init-from {run_dir}: this run started from its checkpoint at step {step}, "
                f"which is gone (it has {ckpt.all_steps()}): the starting weights and the "
                "reference model cannot be rebuilt as they were. Start a new run (another "
                "--run-dir), or restore that checkpoint.")
    return saved


def _reader(run_dir: str | Path) -> checkpoint.Checkpointer:
    """A checkpointer that reads ``run_dir``'s checkpoints (it writes none: no async saves)."""
    cfg = dataclasses.replace(config_lib.CheckpointConfig(), async_save=False)
    return _listed(lambda: checkpoint.Checkpointer(Path(run_dir) / "checkpoints", cfg))


@contextlib.contextmanager
def _reading(run_dir: Path):
    """A reader of ``run_dir``'s checkpoints (``_reader``), quiet about the files a run still
    training there writes and removes meanwhile (``checkpoint.quiet_reads``); closed at the end."""
    with checkpoint.quiet_reads(Path(run_dir) / "checkpoints"):
        ckpt = _reader(run_dir)
        try:
            yield ckpt
        finally:
            ckpt.close()


def latest_step(run_dir: str | Path | None) -> int | None:
    """The latest complete checkpoint step of run ``run_dir`` (None: no run, no checkpoint)."""
    if not run_dir or not (Path(run_dir) / "checkpoints").is_dir():
        return None
    with _reading(Path(run_dir)) as ckpt:
        steps = _steps(ckpt)
    return steps[-1] if steps else None


def init_weights(module, run_dir: str | Path, step: int | None = None) -> str:
    """Copy the weights of ``run_dir``'s checkpoint ``step`` (default: the latest) into
    ``module`` (same architecture), matching variables by their Keras path. Returns a one-line
    summary."""
    run_dir = Path(run_dir)
    loaded = load(run_dir, step, echo=lambda _: None)
    if loaded.config["lora"]["rank"]:
        raise errors.CheckpointError(
            f"--init-from {run_dir}: a LoRA run; export it with LoRA merged first")
    source = model.named_variables(nnx.state(loaded.module))
    target = {v.path: v for v in module.weights}
    missing = sorted(set(target) - set(source))
    if missing or any(tuple(source[k].shape) != tuple(target[k].shape) for k in target):
        raise errors.CheckpointError(
            f"--init-from {run_dir}: its model ({loaded.config['model']}) does not "
            f"match this one; e.g. {missing[:1] or 'shapes differ'}")
    for path, variable in target.items():
        variable.assign(source[path])
    return f"initialised from {run_dir} (step {loaded.step}, {len(target)} variables)"
