"""``nnx-posttrain eval RUN_DIR --tasks T1,T2``: a run's checkpoint through lm-evaluation-harness
(``lm_eval.simple_evaluate`` with ``harness.lm.NNXLM``), its results written into the run.

Tasks are lm-eval's by name (their data must be in the local Hugging Face cache on an offline
machine), a user's task YAML files (``--include-path DIR``, e.g. ``dataset_path: json`` with
local ``data_files``), or ``nnx_arithmetic``: the built-in task's held-out problems, answered
greedily with the chat template and scored by exact match, stripped (the training evaluation's
``exact_match`` on the same problems, tests/test_harness.py).

Results: ``RUN_DIR/lm_eval/step_<S>.json`` (lm-eval's result JSON: ``results``, ``configs``,
``versions``, ``n-samples``, ...), shown by ``nnx-posttrain compare`` beside the training metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from pathlib import Path

from nnx_posttrain import data, errors, runs

ARITHMETIC = "nnx_arithmetic"


def require():
    """lm-eval's package, or a ``ConfigError`` naming the extra that installs it."""
    try:
        import lm_eval
    except ImportError:
        raise errors.ConfigError("evaluation with lm-evaluation-harness needs its package: "
                                 "pip install -e \".[eval]\" (or pip install lm_eval)") from None
    return lm_eval


def arithmetic_task(directory: Path, limit: int | None = None) -> dict:
    """The ``nnx_arithmetic`` task's lm-eval config, its data (the built-in held-out problems:
    question, answer) written as JSON lines under ``directory``."""
    from nnx_posttrain import tasks

    tasks.register()  # the built-in task's records
    src = data.source("builtin", "eval", builtin="prompt_only")
    path = Path(directory) / f"{ARITHMETIC}.jsonl"
    path.write_text("".join(json.dumps({"question": src[i]["prompt"][0]["content"],
                                        "answer": src[i]["answer"]}) + "\n"
                            for i in range(len(src))))
    return {"task": ARITHMETIC, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(path)}}, "test_split": "test",
            "output_type": "generate_until", "doc_to_text": "{{question}}",
            "doc_to_target": "{{answer}}", "num_fewshot": 0,
            "generation_kwargs": {"until": [], "max_gen_toks": 8, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                             "higher_is_better": True,
                             "regexes_to_ignore": [r"^\s+", r"\s+$"]}],
            "metadata": {"version": 1.0}}


@functools.lru_cache(maxsize=8)
def _manager(include_path: str | None, include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def task_manager(include_path: str | None = None, tasks: tuple[str, ...] | None = None):
    """lm-eval's task index: the user's folder and lm-eval's own tasks (indexing those ~14,700
    files takes ~7 s: skipped when ``tasks`` are all ``nnx_arithmetic`` or the folder's).
    Kept per process."""
    if include_path is not None and not Path(include_path).is_dir():
        raise errors.ConfigError(f"--include-path {include_path}: no such directory")
    if tasks is not None:
        own = _manager(include_path, False)
        if all(t == ARITHMETIC or t in set(own.all_tasks) for t in tasks):
            return own
    return _manager(include_path, True)


def check_tasks(tasks: list[str], manager, include_path: str | None = None) -> None:
    """Before the model loads: ``ConfigError`` naming the tasks lm-eval does not know (with the
    YAML errors of ``include_path``'s files that lm-eval skipped: a task in one of them is
    unknown), and ``DataError`` naming a task's local data file that does not exist."""
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t != ARITHMETIC and t not in known]
    if unknown:
        unreadable = unreadable_task_files(include_path)
        raise errors.ConfigError(
            f"--tasks: unknown to lm-evaluation-harness: {', '.join(unknown)} (a task, group or "
            f"tag name; {ARITHMETIC} is the built-in task; your own YAML files: --include-path)"
            + "".join(f"\n  {path}: not read: {why}" for path, why in unreadable))
    for name in tasks:
        for task, path, files in _local_data(manager, name):
            missing = [f for f in files if not Path(f).expanduser().exists()]
            if missing:
                raise errors.DataError(
                    f"--tasks {name}: task {task!r} ({path}) reads {missing[0]}, which does not "
                    "exist (its dataset_kwargs.data_files); a relative path is read from the "
                    "current directory")


def unreadable_task_files(include_path: str | None) -> list[tuple[Path, str]]:
    """(file, the first lines of its error) of ``include_path``'s YAML task files that lm-eval
    cannot read (it skips them without a word: their tasks are then unknown)."""
    if include_path is None:
        return []
    from lm_eval.tasks._yaml_loader import load_yaml

    out = []
    for path in sorted(Path(include_path).rglob("*.yaml")):
        try:
            load_yaml(path, resolve_func=False)
        except Exception as exc:  # noqa: BLE001 - YAML's errors and lm-eval's: said by file
            out.append((path, " ".join(str(exc).split())[:300]))
    return out


LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # datasets' builders of local files


def _local_data(manager, name: str, seen=None):
    """(task, its YAML file, the local data files it names) of task, group or tag ``name`` and
    the tasks under it: what a ``dataset_path: json`` (csv, ...) task reads."""
    seen = set() if seen is None else seen
    entry = manager.task_index.get(name)
    if entry is None or name in seen:
        return
    seen.add(name)
    cfg = entry.cfg or {}
    for child in [*entry.tags, *(t for t in _as_list(cfg.get("task")) if isinstance(t, str)
                                 and "group" in cfg)]:
        yield from _local_data(manager, child, seen)
    if "group" in cfg or cfg.get("dataset_path") not in LOCAL_BUILDERS:
        return
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    listed = [f for v in (files.values() if isinstance(files, dict) else [files])
              for f in _as_list(v)]
    yield name, entry.yaml_path, [f for f in listed if isinstance(f, str) and "://" not in f
                                  and not any(c in f for c in "*?[")]


def _as_list(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """How ``evaluate`` runs lm-eval: ``limit`` documents per task (a count, or a fraction
    below 1; None: all), the checkpoint ``step`` (default: the latest), ``include_path`` (a
    folder of the user's task YAML files), ``batch_size``, ``apply_chat_template`` (prompts in
    the run's chat template, as it was trained), ``num_fewshot`` (None: the task's)."""

    limit: int | float | None = None
    step: int | None = None
    include_path: str | None = None
    batch_size: int = 16
    apply_chat_template: bool = True
    num_fewshot: int | None = None


def evaluate(run_dir, tasks: list[str], how: Evaluation = Evaluation(), echo=print) -> dict:
    """lm-eval's results of ``run_dir``'s checkpoint ``how.step`` (default: the latest) on
    ``tasks``, also written to ``run_dir/lm_eval/step_<S>.json`` (whose path is under
    ``"path"``)."""
    lm_eval = require()
    from lm_eval.utils import handle_non_serializable

    from nnx_posttrain.harness.lm import NNXLM

    if not tasks:
        raise errors.ConfigError("--tasks: give at least one task")
    runs.check_policy(run_dir)
    manager = task_manager(how.include_path, tuple(tasks))
    check_tasks(tasks, manager, how.include_path)
    run = runs.load(run_dir, how.step, echo=echo)
    lm = NNXLM(run.lm, run.policy(), name=str(run_dir), batch_size=how.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        specs = [arithmetic_task(Path(tmp)) if t == ARITHMETIC else t for t in tasks]
        try:
            results = lm_eval.simple_evaluate(
                model=lm, tasks=specs, limit=how.limit, task_manager=manager,
                num_fewshot=how.num_fewshot, apply_chat_template=how.apply_chat_template,
                log_samples=False, batch_size=how.batch_size)
        except (FileNotFoundError, ConnectionError) as exc:  # a task's data: not here, offline
            raise errors.DataError(
                f"--tasks {','.join(tasks)}: lm-eval could not read a task's data "
                f"({type(exc).__name__}: {str(exc).strip()[:300]}); an offline machine reads "
                "a task's data from the Hugging Face cache or local files") from None
    results["nnx_posttrain"] = {"run_dir": str(run_dir), "step": run.step,
                                "apply_chat_template": how.apply_chat_template,
                                "limit": how.limit}
    out = Path(run_dir) / "lm_eval" / f"step_{run.step}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
    results["path"] = out
    return results


def scores(results: dict) -> list[tuple[str, str, float, float | None]]:
    """(task, metric, value, standard error) rows of lm-eval's ``results`` block."""
    rows = []
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if key in ("alias", "sample_len") or "_stderr," in key \
                    or not isinstance(value, (int, float)):
                continue
            name, _, filt = key.partition(",")
            stderr = metrics.get(f"{name}_stderr,{filt}")
            rows.append((task, name, float(value),
                         float(stderr) if isinstance(stderr, (int, float)) else None))
    return rows
