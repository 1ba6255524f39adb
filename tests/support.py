"""Helpers the test modules share: command lines of the micro model, metric readers, and tiny
random backbones of every model family."""

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nnx_posttrain import api, config_files, errors, metrics_log

ROOT = Path(__file__).resolve().parents[1]

# the micro model on short sequences: what most end-to-end tests train
MICRO = ["--model", "gemma_micro", "--batching.max-length", "24"]
# a few quick steps without evaluation, checkpoints at 2 and 4 (the fault tests, the battery)
FAST_STEPS = ["--steps", "4", "--log-every", "1", "--eval.every", "0", "--eval.batches", "1",
              "--eval.exact-match", "0", "--batching.batch-size", "4", "--checkpoint.every", "2"]


def equations(jaxpr):
    """Every equation of ``jaxpr`` and of the programs inside it (a scan's or a loop's body, a
    cond's branches, remat, custom derivatives), depth first."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        yield eqn
        for inner in jaxprs_in_params(eqn.params):
            yield from equations(inner)


def train_run(algorithm: str, *args, recipe: bool = True, echo=print):
    """``nnx-posttrain ALGORITHM ARGS`` in this process, parsed and run as the command does;
    returns what it computed (the ``RunResult``, or ``--eval-only``'s metrics). A problem raises
    its ``UserError``. ``recipe=False``: the defaults of a user's data even on the built-in
    data (no built-in recipe)."""
    from nnx_posttrain import train
    from nnx_posttrain.cli import train_command

    args = [str(a) for a in args]
    cfg = (train_command.config_from(algorithm, args, algorithm) if recipe else
           train_command.parse(api.defaults(algorithm, data="own data"), args))
    with train.prepare(cfg, api.build(cfg), echo) as run:
        return train.evaluate_only(run) if cfg.eval_only else train.train(run)


def refusal(algorithm: str, *args, error=errors.UserError, recipe: bool = True) -> str:
    """The message of the ``error`` that ``train_run(algorithm, *args)`` must raise."""
    with pytest.raises(error) as info:
        train_run(algorithm, *args, recipe=recipe)
    return str(info.value)


def builtin_file(path, builtin: str = "sft", n: int = 8) -> Path:
    """The built-in task's first ``n`` training records in the format ``builtin`` names ('sft',
    'preference', 'unpaired_preference', 'prompt_only') as a JSONL file at ``path``: a run on it
    validates ``n`` records, not the built-in data's 8,600 (through a family's Python BPE
    tokenizer, seconds), and has no eval data (no evaluation). A run on a file gets a user's
    defaults, not the built-in recipe (``tasks/recipes``): pass what the test relies on."""
    import json

    from nnx_posttrain import data

    src = data.source("builtin", "train", builtin=builtin)
    path = Path(path)
    path.write_text("".join(json.dumps({k: v for k, v in src[i].items() if not k.startswith("_")})
                            + "\n" for i in range(n)))
    return path


def bare_config(algorithm, **settings):
    """The common ``Config`` of ``algorithm`` (no algorithm defaults, no recipe) with
    ``settings`` (nested dicts) applied."""
    return config_files.merge(api.config_type(algorithm)(), settings, "test")


def experiment_command(algorithm: str, run_dir, *extra) -> list[str]:
    """``python -m experiments.<algorithm>`` on the micro model, writing ``run_dir``."""
    return [sys.executable, "-m", f"experiments.{algorithm}", *MICRO, "--run-dir", str(run_dir),
            *extra]


def session_xla_flags() -> list[str]:
    """The XLA flags of this test session (``tests/conftest.py``: LLVM optimisation off, the
    older fusion emitters) without a forced CPU device count."""
    import os

    return [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]


def on_cpu_devices(script: str, devices: int, *args: str, timeout: int = 600) -> dict:
    """Run ``script`` (Python source that ends by printing ``RESULT <json>``) in a process of its
    own that sees ``devices`` CPU devices (compiled with the session's flags: it compiles several
    meshes' steps), and return that JSON; the process's stderr on failure."""
    import json
    import os

    env = dict(os.environ, XLA_FLAGS=" ".join([f"--xla_force_host_platform_device_count={devices}",
                                              *session_xla_flags()]))
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def sft_command(run_dir, *args: str) -> subprocess.CompletedProcess:
    """``python -m experiments.sft ARGS --run-dir RUN_DIR`` as a user runs it, its output
    captured: without the suite's forced CPU device count, so that ``--mesh.cpu-devices`` splits
    the CPU as the command does itself."""
    import os

    return subprocess.run([sys.executable, "-m", "experiments.sft", *map(str, args),
                           "--run-dir", str(run_dir)], cwd=ROOT,
                          env=dict(os.environ, XLA_FLAGS=" ".join(session_xla_flags())),
                          capture_output=True,
                          text=True, timeout=600)


def run_command(cmd: list[str], check: bool = True, timeout: int = 600):
    """Run a command from the repository root; with ``check``, fail with its output's tail."""
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def jitted(fn, module):
    """``fn(module, *arrays)`` as one jitted program over the module's state (``nnx.split`` /
    ``nnx.merge``): one trace and compilation (the persistent cache's, on a second session)
    instead of a forward pass dispatched an operation at a time, each operation of a new shape
    traced, lowered and compiled on its own."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(module)
    run = jax.jit(lambda state, *arrays: fn(nnx.merge(graphdef, state), *arrays))
    return lambda *arrays: run(state, *arrays)


def image_logits(module, ids, mask, pixels):
    """``model.full_logits`` with the batch's images (``model.images``): the forward the vision
    tests compare, jitted as one program by ``jitted(image_logits, module)``."""
    from nnx_posttrain import model

    with model.images(pixels):
        return model.full_logits(module, ids, mask)


def records(run_dir, split: str = "train") -> list[dict]:
    """The ``split`` rows of a run's metrics.jsonl."""
    return [r for r in metrics_log.read(run_dir) if r["split"] == split]


def losses(run_dir) -> dict[int, float]:
    """{step: training loss} of a run."""
    return {r["step"]: r["loss"] for r in records(run_dir)}


# ----------------------------------------------------------------------------- model families


def _families():
    """Tiny random backbones of every family (``families``: each family's ``tiny`` variants), each
    with the features its kernels must get right: soft caps and a sliding window (Gemma 2), one kv
    head (Gemma), grouped heads, Qwen's q/k/v biases, Qwen 3's q/k norms, Mistral's banded mask,
    Gemma 3's local / global layers, ..."""
    import keras_hub

    from nnx_posttrain import families

    def builder(family, kwargs):
        return lambda: families.prepare(
            getattr(keras_hub.models, family.backbone)(dtype="float32", **kwargs))

    return {variant: builder(family, kwargs) for family in families.FAMILIES.values()
            for variant, kwargs in family.tiny.items()}


TINY_FAMILIES = _families()
# The variants the per-kernel tests (attention paths, dense projections) parametrise over: every
# one but those whose blocks repeat another's layers exactly (Qwen 3.5 MoE: Qwen 3.5's attention
# and Gated DeltaNet layers; its MoE block is covered by the router and newer-family tests)
KERNEL_FAMILIES = {k: v for k, v in TINY_FAMILIES.items() if k != "qwen3_5_moe"}


def tiny_backbone(family: str):
    """A backbone of ``TINY_FAMILIES`` (seed 0) with random norms and biases (they start at 0 / 1),
    so that every weight matters."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    bb = TINY_FAMILIES[family]()
    for v in bb.weights:
        if "norm" in v.path or "bias" in v.path:
            v.assign(np.random.default_rng(1).normal(size=v.shape).astype("float32") * 0.5)
    return bb


@contextlib.contextmanager
def kerashub_as_written():
    """KerasHub's Qwen 2 / 3 / 3.5 layers apply their sliding window only in their einsum branch, which
    they skip on JAX (``fused_attention_op_available()`` is True there, and the fused branch drops
    the window): the reference is the branch that applies it."""
    from keras_hub.src.models.qwen import qwen_attention
    from keras_hub.src.models.qwen3 import qwen3_attention
    from keras_hub.src.models.qwen3_5 import qwen3_5_attention

    saved = [(m, m.fused_attention_op_available)
             for m in (qwen_attention, qwen3_attention, qwen3_5_attention)]
    try:
        for m, _ in saved:
            m.fused_attention_op_available = lambda: False
        yield
    finally:
        for m, f in saved:
            m.fused_attention_op_available = f


@contextlib.contextmanager
def small_filesystem(path: Path, size_kib: int):
    """A tmpfs of ``size_kib`` KiB mounted at ``path`` for the block: a disk that fills up.
    Needs root (CI has it); skipped, saying so, where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def command_output(capsys, monkeypatch, argv, columns: int = 100, **main_kw) -> tuple:
    """(exit status, stdout, stderr) of ``nnx_posttrain.cli.main(argv, **main_kw)`` in this
    process (``prog`` / ``command_prog`` as the entry points pass them), at a terminal of
    ``columns`` columns: what a help or usage test needs, without a process."""
    from nnx_posttrain import cli

    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("NO_COLOR", "1")
    capsys.readouterr()
    code = cli.main(argv, **main_kw)
    out = capsys.readouterr()
    return code, out.out, out.err


def cli_error(capsys, argv, match: str | None = None, **main_kw) -> str:
    """The stderr of ``nnx_posttrain.cli.main(argv, **main_kw)``, which must refuse the command:
    exit status 1, ``error: MESSAGE`` on stderr (where the regex ``match`` is found, if given)."""
    from nnx_posttrain import cli

    capsys.readouterr()
    code = cli.main(argv, **main_kw)
    err = capsys.readouterr().err
    assert code == 1, (code, err[-3000:])
    assert match is None or re.search(match, err), (match, err[-3000:])
    return err


def vision_model(name: str):
    """The built-in vision model ``name`` (seed 0) with its image spec, as a run loads it."""
    from nnx_posttrain import data, model

    lm = model.load(name, seed=0)
    lm.images = data.ImageSpec.from_preprocessor(lm.task.preprocessor)
    return lm


def tokenized_batch(lm, records_, length: int) -> dict:
    """``records_`` through the training pipeline's ``Tokenize`` (images included), stacked."""
    import numpy as np

    from nnx_posttrain import data

    transform = data.Tokenize(lm.tokenizer, lm.chat_format, length, images=lm.images)
    examples = [transform(r) for r in records_]
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def picture(seed: int, size=(16, 16)):
    """A random ``uint8`` RGB picture of ``size`` (height, width), the same for a seed."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, tuple(size) + (3,), dtype=np.uint8)


def ask(text: str, answer: str, images: int = 1) -> list[dict]:
    """A user turn with ``images`` image parts before ``text``, and the assistant's answer."""
    return [{"role": "user", "content": [{"type": "image"}] * images + [
        {"type": "text", "text": text}]}, {"role": "assistant", "content": answer}]


def image_data_files(root: Path, sizes) -> Path:
    """Four PNG files (``picture(i, sizes[i % 2])``) in ``root`` beside ``sft.jsonl``
    (``messages`` + ``images``) and ``pairs.jsonl`` (``prompt`` / ``chosen`` / ``rejected`` +
    ``images``), the images named relative to the files: TRL's vision formats."""
    import json

    from PIL import Image

    sft, pairs = [], []
    for i in range(4):
        Image.fromarray(picture(i, sizes[i % 2])).save(root / f"{i}.png")
        sft.append({"messages": ask("How many shapes?", str(i)), "images": [f"{i}.png"]})
        pairs.append({"prompt": [{"role": "user", "content": "How many shapes?"}],
                      "chosen": [{"role": "assistant", "content": str(i)}],
                      "rejected": [{"role": "assistant", "content": str(i + 1)}],
                      "images": [f"{i}.png"]})
    for name, rows in (("sft.jsonl", sft), ("pairs.jsonl", pairs)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def one_two_and_no_image_rows() -> list[dict]:
    """Three records: one image, two images, text only (the export checks' batch)."""
    return [{"messages": ask("How many shapes?", "3"), "images": [picture(0)]},
            {"messages": ask("Which one?", "the first", 2), "images": [picture(1), picture(2)]},
            {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                          {"role": "assistant", "content": "5"}]}]


def image_prompt_file(root: Path, count: int = 8) -> Path:
    """TRL's prompt-only vision format (``prompt`` + ``images`` + ``answer``) of the built-in
    image task's first ``count`` problems: ``root/prompts.jsonl``, its pictures (one size) as
    PNG files beside it."""
    import json

    from PIL import Image

    from nnx_posttrain.tasks import shapes

    rows = []
    for i in range(count):
        record = shapes.prompt_record(i)
        Image.fromarray(record["images"][0]).save(root / f"{i}.png")
        rows.append(dict(record, images=[f"{i}.png"]))
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "prompts.jsonl"
