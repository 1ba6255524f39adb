"""The one training loop, for every algorithm.

    state = {params (trainable variables), opt_state, step}   frozen variables stay outside
    step(state, frozen, batch) -> (state, metrics)            jax.jit over nnx.split / nnx.merge

The step compiles once (fixed batch shape), donates the state, accumulates gradients over
micro-batches with a scan (token-weighted, so the update equals the one large batch), clips,
and applies AdamW with warm-up and decay. Metrics are fetched from the device only when logged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from nnx_posttrain import config as config_lib
from nnx_posttrain import checkpoint, data, model, sharding
from nnx_posttrain.sampling import generate
from nnx_posttrain.metrics_log import MetricsLog


# ----------------------------------------------------------------------------- optimizer


def schedule(cfg: config_lib.OptimConfig, total_steps: int) -> optax.Schedule:
    peak, warm = cfg.learning_rate, max(cfg.warmup_steps, 0)
    decay_steps = max(total_steps - warm, 1)
    end = peak * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if not warm:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), decay], [warm])


def optimizer(cfg: config_lib.OptimConfig, total_steps: int):
    lr = schedule(cfg, total_steps)
    parts = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
    parts.append(optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*parts), lr


# ----------------------------------------------------------------------------- the step


def _sum_tree(a, b):
    return jax.tree.map(jnp.add, a, b)


def merge(graphdef, params, frozen):
    """(module, reference module or None) from the trainable ``params`` and ``frozen`` =
    {"model": frozen variables, "reference": a frozen copy of the trainable ones, or None}."""
    module = nnx.merge(graphdef, params, frozen["model"])
    ref = frozen.get("reference")
    return module, (None if ref is None else nnx.merge(graphdef, ref, frozen["model"]))


def metric_means(metrics: dict) -> dict:
    """name -> sum / count; NaN where nothing was counted (e.g. no rejected example in a batch)."""
    return {
        name: jnp.where(c > 0, s / jnp.where(c > 0, c, 1.0), jnp.nan) for name, (s, c) in metrics.items()
    }


def make_train_step(graphdef, loss_fn, tx, lr_schedule):
    """step(state, frozen, batch) -> (state, metrics). ``batch`` leaves are [accum, micro, ...];
    ``loss_fn(module, micro_batch, reference_module)``; ``frozen`` as in ``merge``."""

    def micro_loss(params, frozen, micro_batch):
        total, weight, metrics = loss_fn(*_with_batch(merge(graphdef, params, frozen), micro_batch))
        return total, (weight, metrics)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state, frozen, batch):
        params = state["params"]
        first = jax.tree.map(lambda x: x[0], batch)
        shapes = jax.eval_shape(grad_fn, params, frozen, first)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

        def accumulate(carry, micro_batch):
            (total, (weight, metrics)), grads = grad_fn(params, frozen, micro_batch)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            return _sum_tree(carry, ((total, (weight, metrics)), grads)), None

        ((total, (weight, metrics)), grads), _ = jax.lax.scan(accumulate, zeros, batch)
        denom = jnp.maximum(weight, 1e-9)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
        new_state = {
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state["rng"]))[0]),
        }
        out = metric_means(metrics)
        out.update(grad_norm=grad_norm, learning_rate=lr_schedule(state["step"]))
        return new_state, out

    return step


def init_state(params, tx, seed: int) -> dict:
    """The training state: one tree, checkpointed as a whole."""
    return {
        "params": params,
        "opt_state": tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": jax.random.key_data(jax.random.key(seed)),
    }


def _with_batch(modules, batch):
    module, reference = modules
    return module, batch, reference


def make_eval_step(graphdef, loss_fn):
    """eval(params, frozen, batch) -> (total, weight, metric sums): summed, divided by the caller."""

    def evaluate(params, frozen, batch):
        return loss_fn(*_with_batch(merge(graphdef, params, frozen), batch))

    return evaluate


# ----------------------------------------------------------------------------- mesh


def initialize_distributed(cfg: config_lib.MeshConfig) -> bool:
    """``jax.distributed.initialize`` when configured (``--mesh.distributed``, the coordinator /
    process options, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID). Must run
    before anything else touches JAX's devices. Returns whether this is a multi-process run."""
    env = os.environ
    address = cfg.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    num = cfg.num_processes if cfg.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
    wanted = cfg.distributed == "on" or (
        cfg.distributed == "auto" and (address is not None or (num or 1) > 1))
    if not wanted or jax.distributed.is_initialized():
        return jax.distributed.is_initialized()
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
    return True


def _env_int(name):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def mesh_shape(cfg: config_lib.MeshConfig, n_devices: int) -> dict[str, int]:
    """{data, fsdp, tensor} sizes for ``n_devices``, the -1 axis taking the rest; SystemExit with
    the reason when they do not multiply to the device count."""
    sizes = {"data": cfg.data, "fsdp": cfg.fsdp, "tensor": cfg.tensor}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    rest = [k for k, v in sizes.items() if v == -1]
    if rest:
        if n_devices % fixed:
            raise SystemExit(f"mesh {sizes}: {n_devices} device(s) do not divide by the fixed axes' "
                             f"product {fixed}")
        sizes[rest[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise SystemExit(
            f"mesh data={sizes['data']} x fsdp={sizes['fsdp']} x tensor={sizes['tensor']} = "
            f"{math.prod(sizes.values())} devices, but {n_devices} are available "
            f"({jax.process_count()} process(es)); the product must equal the device count "
            "(set one axis to -1 to take the rest)"
        )
    return sizes


def make_mesh(cfg: config_lib.MeshConfig) -> Mesh:
    """The (data, fsdp, tensor) mesh over every device of every process. Tensor-parallel
    neighbours are adjacent devices (same host / fast links), then fsdp, then data."""
    devices = jax.devices()
    sizes = mesh_shape(cfg, len(devices))
    shape = tuple(sizes[a] for a in sharding.AXES)
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices)
    except Exception:  # noqa: BLE001 - CPU / odd topologies: the plain order is fine
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, sharding.AXES)


def shard_batch(batch: dict, mesh: Mesh, accum: int) -> dict:
    """[batch, ...] host arrays -> [accum, micro, ...] device arrays, micro split over the data
    and fsdp axes (replicated over tensor). Every process holds the whole global batch and
    contributes the rows of its own devices."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        v = v.reshape(accum, v.shape[0] // accum, *v.shape[1:])
        target = NamedSharding(mesh, sharding.batch_spec(v.ndim, leading=1))
        out[k] = jax.make_array_from_callback(v.shape, target, lambda index, v=v: v[index])
    return out


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    train: list[dict]
    eval: list[dict]
    state: dict
    lm: model.LanguageModel
    graphdef: object
    frozen: object
    stopped_by: str | None = None
    algorithm: object = None


class _StopSignals:
    """SIGTERM (TPU VM preemption) and SIGINT: finish the current step, checkpoint, exit.
    A second SIGINT aborts at once."""

    def __init__(self):
        self.received = None

    def __enter__(self):
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def run(cfg: config_lib.Config, algorithm, experiment: str = "run", echo=print) -> RunResult:
    """Train (or, with ``eval_only``, evaluate) per ``cfg``; returns what notebooks and tests use.

    Resumes from the latest complete checkpoint of the run directory when there is one."""
    initialize_distributed(cfg.mesh)  # before anything touches the devices
    run_dir = Path(cfg.run_dir or f"runs/{experiment}")
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint.Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    resume_step = ckpt.latest_step()
    if cfg.resume and resume_step is None:
        raise SystemExit(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
    config_lib.save(cfg, run_dir / "config.json")
    mesh = make_mesh(cfg.mesh)
    b = cfg.batching
    if (b.batch_size // b.grad_accum) % sharding.batch_divisor(mesh):
        raise SystemExit(
            f"micro-batch {b.batch_size // b.grad_accum} does not divide over the "
            f"{sharding.batch_divisor(mesh)} batch shards (--mesh.data x --mesh.fsdp)"
        )

    lm = model.load(cfg.model, dtype=cfg.dtype, seed=cfg.seed)
    if cfg.init_from:
        from nnx_posttrain import runs

        echo(runs.init_weights(lm.module, cfg.init_from))
    if cfg.lora.rank:
        model.enable_lora(lm.module, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
    model.set_remat(lm.module, cfg.remat == "blocks")
    module = algorithm.build_module(lm)
    algorithm.setup(module)
    echo(model.describe(lm) + (f"; reference: {algorithm.reference_mode}"
                               if algorithm.reference_mode else ""))

    train_src, eval_src, transform, skipped = _data(cfg, lm, algorithm, echo)

    graphdef, params, frozen_model = model.split(module)
    tx, lr = optimizer(cfg.optim, cfg.steps)
    def place(tree):  # onto the mesh, each variable sharded by its rule (nnx_posttrain.sharding)
        return sharding.put(tree, sharding.tree_shardings(tree, mesh))

    frozen = place({"model": frozen_model, "reference": None})
    if algorithm.reference_mode == "copy":  # the starting weights, frozen (not donated)
        frozen["reference"] = place(jax.tree.map(jnp.copy, params))
    state = place(init_state(params, tx, cfg.seed))
    record = checkpoint.model_record(cfg, state)
    reference_cache = None
    if algorithm.reference_mode == "precompute":
        reference_cache = _precomputed_reference(cfg, run_dir, algorithm, graphdef, state["params"],
                                                 frozen, train_src, eval_src, transform, echo)
    online = algorithm.online
    if online:  # the data gives prompts; each step's batch is a rollout (nnx_posttrain.online)
        algorithm.attach(lm, graphdef, state["params"], frozen, train_src, cfg.seed, merge)
    if b.packing:
        batches = data.packed_train_batches(train_src, transform, b.batch_size, cfg.seed,
                                            b.shuffle, b.num_workers)
    else:
        rows = algorithm.prompts_per_step(b.batch_size) if online else b.batch_size
        batches = data.train_batches(train_src, _Indexed(transform), rows, cfg.seed,
                                     b.shuffle, b.num_workers)
    if resume_step is not None:
        state, data_state, _ = ckpt.restore(resume_step, checkpoint.abstract(state), record)
        if data_state and not cfg.eval_only:
            batches.set_state(data_state)
        echo(f"resumed from {ckpt.directory / str(resume_step)} (step {resume_step})")
    start = int(state["step"])

    train_step = jax.jit(
        make_train_step(graphdef, algorithm.loss, tx, lr),
        donate_argnums=(0,),
        # pinned: without it the state's shardings drift after an update
        out_shardings=(sharding.tree_shardings(state, mesh), NamedSharding(mesh, P())),
    )
    eval_step = jax.jit(make_eval_step(graphdef, algorithm.loss))
    eval_sets = _eval_sets(cfg, eval_src, transform, lm, graphdef, algorithm,
                           reference_cache and reference_cache["eval"],
                           (state["params"], frozen["model"]))

    log = (MetricsLog(run_dir, keep_until=start if resume_step is not None else None,
                      echo=lambda s: tqdm.write(s) if echo else None)
           if jax.process_index() == 0 else _SecondaryLog())  # process 0 writes the metrics
    result = RunResult(run_dir, [], [], state, lm, graphdef, frozen, algorithm=algorithm)

    def evaluate(step):
        metrics = _evaluate(cfg, lm, state["params"], frozen, eval_step, eval_sets, mesh)
        if metrics:
            result.eval.append(log.log(step, "eval", metrics))
        return metrics

    def save(step, metrics=None):
        saved = {"model_record": record, "config": config_lib.to_dict(cfg), "step": step}
        ckpt.save(step, state, batches.get_state(), saved, metrics=metrics or None)

    try:
        if cfg.eval_only:
            print(json.dumps(evaluate(start), indent=2))
            return result
        if start == 0:
            evaluate(0)
        elif start >= cfg.steps:
            echo(f"{run_dir} is already complete at step {start} (--steps {cfg.steps}); nothing to "
                 "do. Raise --steps to continue training, or choose another --run-dir.")
            return result
        t_last, tokens, pending, compile_seconds = time.perf_counter(), 0, [], None
        rollout, host_metrics = None, []  # online algorithms: the current rollout, its metrics
        bar = tqdm(total=cfg.steps, initial=start, desc=experiment, unit="step", dynamic_ncols=True)
        with _StopSignals() as stop:
            for step in range(start + 1, cfg.steps + 1):
                if online:  # a new rollout, or the current one again (num_iterations)
                    if algorithm.fresh(step):
                        prompts = next(batches)
                        pending.append(int(prompts["truncated"].sum()))
                        rollout, rollout_metrics = algorithm.rollout(step, state, frozen, prompts)
                        host_metrics.append(rollout_metrics)
                    batch = rollout
                else:
                    batch = next(batches)
                    pending.append(int(batch["truncated"].sum()))
                tokens += sum(int(v.sum()) for k, v in batch.items() if k.endswith("attention_mask"))
                batch = _device_batch(algorithm, batch, reference_cache and reference_cache["train"])
                state, metrics = train_step(state, frozen, shard_batch(batch, mesh, b.grad_accum))
                result.state = state
                bar.update(1)
                if step == start + 1:  # the first step compiles: keep it out of the throughput
                    jax.block_until_ready(state)
                    compile_seconds = time.perf_counter() - t_last
                    t_last, tokens = time.perf_counter(), 0
                if step % cfg.log_every == 0 or step == cfg.steps or stop.received:
                    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    now = time.perf_counter()
                    metrics["tokens_per_second"] = tokens / (now - t_last) if tokens else 0.0
                    if compile_seconds is not None:
                        metrics["compile_seconds"], compile_seconds = compile_seconds, None
                    metrics["truncated"] = float(sum(pending))
                    if online:  # the rollouts since the last log (or the one being reused)
                        metrics.update(_means(host_metrics or [rollout_metrics]))
                        host_metrics = []
                    result.train.append(log.log(step, "train", metrics, echo=False))
                    bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['learning_rate']:.2e}")
                    t_last, tokens, pending = time.perf_counter(), 0, []
                eval_metrics = None
                if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.steps:
                    eval_metrics = evaluate(step)
                    t_last = time.perf_counter()  # evaluation time is not training throughput
                every = cfg.checkpoint.every
                # an online algorithm's rollout is reused for num_iterations steps: checkpoints
                # fall between rollouts, so a resumed run starts with a fresh one
                between = not online or algorithm.fresh(step + 1)
                if (((every and step % every == 0) or stop.received) and between
                        or step == cfg.steps):
                    save(step, eval_metrics)
                if stop.received and (between or step == cfg.steps):
                    name = signal.Signals(stop.received).name
                    ckpt.wait()
                    bar.close()
                    echo(f"{name}: saved checkpoint at step {step} in {ckpt.directory}; "
                         "run the same command again to resume")
                    result.stopped_by = name
                    raise SystemExit(128 + stop.received)
        bar.close()
        echo(f"done: {cfg.steps} steps; run directory {run_dir}"
             + (f"; {skipped} bad records were skipped (--batching.skip-bad)" if skipped else ""))
    finally:
        ckpt.close()
        log.close()
        getattr(batches, "close", lambda: None)()  # Grain worker processes, when there are any
    return result


class _SecondaryLog:
    """Metrics of processes other than 0 of a multi-process run: returned, never written."""

    def log(self, step, split, metrics, echo=True):
        return {"step": int(step), "split": split, **{k: float(v) for k, v in metrics.items()}}

    def close(self):
        pass


def _means(rows: list[dict]) -> dict:
    """Per-key mean of host-side metrics (online rollouts) since the last log, NaN-ignoring."""
    out = {}
    for key in sorted({k for r in rows for k in r}):
        values = [r[key] for r in rows if key in r and np.isfinite(r[key])]
        out[key] = float(np.mean(values)) if values else float("nan")
    return out


class _Indexed:
    """A transform that also keeps the record's index in its source (``index``), so per-example
    data computed before training (precomputed reference log-probs) can be joined to batches."""

    def __init__(self, transform):
        self.transform = transform
        self.kind = transform.kind

    def __call__(self, record):
        return dict(self.transform(record), index=np.int64(record.get("_index", -1)))


def _device_batch(algorithm, batch: dict, reference: dict | None) -> dict:
    """Host batch -> what the step reads: bookkeeping removed, precomputed reference joined,
    the algorithm's host-side preparation applied."""
    batch = dict(batch)
    batch.pop("truncated", None)
    index = batch.pop("index", None)
    if reference is not None:
        # a blank row padding the last eval batch (index -1) gets 0, as the model gives it in the
        # other reference modes (its loss mask is all zeros)
        batch.update({k: np.where(index >= 0, v[index], 0).astype(v.dtype)
                      for k, v in reference.items()})
    return algorithm.prepare(batch)


def _data(cfg, lm, algorithm, echo):
    """(train source, eval source or None, transform, bad records skipped), every record
    validated up front."""
    b = cfg.batching
    kind = algorithm.data_kind
    train_src = data.source(cfg.data, "train", builtin=kind)
    eval_spec = cfg.eval_data or ("builtin" if cfg.data == "builtin" else None)
    eval_src = data.source(eval_spec, "eval", builtin=kind) if eval_spec else None
    transform = data.make_transform(train_src, lm.tokenizer, lm.chat_format, b.max_length,
                                    b.truncation, b.max_prompt_length, b.format)
    if b.packing and kind != "sft":
        raise SystemExit(f"--batching.packing applies to SFT only, not {algorithm.name}")
    if transform.kind != kind:
        raise SystemExit(
            f"{algorithm.name} trains on {kind.replace('_', ' ')} data, but {cfg.data} holds "
            f"{transform.kind.replace('_', ' ')} records (columns of the first record: "
            f"{sorted(k for k in train_src[0] if not k.startswith('_'))})"
        )
    sources, skipped = [], 0
    for name, src in (("train", train_src), ("eval", eval_src)):
        if src is None or (cfg.eval_only and name == "train"):
            sources.append(src)
            continue
        report = data.validate(src, transform, skip_bad=b.skip_bad)
        echo(f"{name} data: {report.records} records, {report.bad} bad (skipped), "
             f"{report.truncated} truncated to {b.max_length} tokens, {report.no_loss_tokens} with "
             "no loss token left" + "".join("\n  skipped: " + m for m in report.bad_examples))
        sources.append(data.only_good(src, report))
        skipped += report.bad
    return sources[0], sources[1], transform, skipped


def _precomputed_reference(cfg, run_dir, algorithm, graphdef, params, frozen, train_src, eval_src,
                           transform, echo) -> dict:
    """Reference log-probs of every train and eval example, computed once with the starting
    weights and cached beside the run (``runs/.reference_cache/<fingerprint>.npz``); reused while
    the model, the data and the tokenization are the same."""
    fingerprint = hashlib.sha256(json.dumps({
        "model": cfg.model, "dtype": cfg.dtype, "seed": cfg.seed, "algorithm": algorithm.name,
        "init_from": _init_signature(cfg.init_from),
        "data": [cfg.data, cfg.eval_data, _files_signature(cfg.data), _files_signature(cfg.eval_data)],
        "batching": [cfg.batching.max_length, cfg.batching.max_prompt_length,
                     cfg.batching.truncation, cfg.batching.format, cfg.batching.skip_bad],
        "sizes": [len(train_src), len(eval_src) if eval_src is not None else 0],
    }, sort_keys=True).encode()).hexdigest()[:16]
    path = run_dir.parent / ".reference_cache" / f"{fingerprint}.npz"
    if path.exists():
        with np.load(path) as cached:
            out = {"train": {}, "eval": {}}
            for key in cached.files:
                split, name = key.split("/", 1)
                out[split][name] = cached[key]
        echo(f"reference log-probs: reused {path}")
        return out
    micro = cfg.batching.batch_size // cfg.batching.grad_accum

    @jax.jit
    def reference(params, batch):
        module, _ = merge(graphdef, params, frozen)
        if model.has_lora(module):
            with model.lora_disabled(module):
                return algorithm.reference_logps(module, batch)
        return algorithm.reference_logps(module, batch)

    out = {"train": {}, "eval": {}}
    t0 = time.perf_counter()
    for split, src in (("train", train_src), ("eval", eval_src)):
        if src is None:
            continue
        parts = {}
        for batch in tqdm(data.eval_batches(src, transform, micro), desc=f"reference {split}",
                          unit="batch", leave=False):
            batch = algorithm.prepare({k: v for k, v in batch.items() if k not in ("truncated", "index")})
            for k, v in jax.device_get(reference(params, batch)).items():
                parts.setdefault(k, []).append(np.asarray(v))
        out[split] = {k: np.concatenate(v)[: len(src)] for k, v in parts.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **{f"{s}/{k}": v for s, d in out.items() for k, v in d.items()})
    tmp.replace(path)
    echo(f"reference log-probs: computed in {time.perf_counter() - t0:.1f}s, cached in {path}")
    return out


def _init_signature(init_from):
    """The starting weights of ``--init-from`` (the cache key's part for them): the run directory
    and the modification time of its checkpoints (a new or removed checkpoint changes it)."""
    if not init_from:
        return None
    checkpoints = Path(init_from) / "checkpoints"
    return [str(Path(init_from).resolve()),
            checkpoints.stat().st_mtime_ns if checkpoints.exists() else None]


def _files_signature(spec):
    """Size and modification time of each local file of a data spec (the cache key's data part)."""
    if not spec:
        return None
    if spec == "builtin":  # the generator's code is the data
        from nnx_posttrain import arithmetic

        return hashlib.sha256(Path(arithmetic.__file__).read_bytes()).hexdigest()
    out = []
    for part in spec.split(","):
        path = Path(part.rsplit(":", 1)[0] if not Path(part).exists() else part)
        if path.exists():
            st = path.stat()
            out.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _eval_sets(cfg, eval_src, transform, lm, graphdef, algorithm, reference, states):
    if eval_src is None:
        return None
    micro = cfg.batching.batch_size // cfg.batching.grad_accum
    batches = data.eval_batches(eval_src, _Indexed(transform), micro, cfg.eval.batches)
    if algorithm.data_kind != "sft" and len(batches) > 1 and (batches[-1]["index"] < 0).any():
        # blank rows count as pairs in preference losses (SFT's have no loss tokens): use full
        # batches only
        batches = batches[:-1]
    batches = [_device_batch(algorithm, batch, reference) for batch in batches]
    if algorithm.online:  # its loss needs rollouts: evaluated by generation only
        batches = []
    pairs, greedy = [], None
    if algorithm.generates and cfg.eval.exact_match:
        pairs = data.prompts_and_answers(eval_src, lm.chat_format, cfg.eval.exact_match)
        view = lambda params, frozen_model: algorithm.policy_view(graphdef, params, frozen_model)
        greedy = (generate.make_greedy(view(*states)[0], cfg.eval.max_new_tokens), view)
    return batches, pairs, greedy, algorithm.data_kind == "sft"


def _evaluate(cfg, lm, params, frozen, eval_step, eval_sets, mesh) -> dict:
    if eval_sets is None:
        return {}
    batches, pairs, greedy, is_nll = eval_sets
    sums = None
    for batch in batches:
        sharded = jax.tree.map(lambda x: x[0], shard_batch(batch, mesh, 1))
        out = eval_step(params, frozen, sharded)
        sums = out if sums is None else _sum_tree(sums, out)
    result = {}
    if sums is not None:
        _, _, metrics = jax.device_get(sums)
        result = {k: float(v) for k, v in metric_means(metrics).items()}
    if pairs:
        greedy, view = greedy
        accuracy, _ = generate.exact_match(
            lm, greedy, view(params, frozen["model"])[1], pairs, cfg.eval.max_new_tokens
        )
        result["exact_match"] = accuracy
    if is_nll and math.isfinite(result["loss"]):  # SFT's loss is the mean NLL per token
        result["perplexity"] = math.exp(min(result["loss"], 50.0))
    return result
