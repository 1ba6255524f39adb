"""What a resume may change: every setting of a run is in its checkpoints' record; a resume
compares the command's settings with them and refuses any difference it is not told to accept.

    record = {"algorithm", "config" (every setting), "data_signature" (train and eval data:
              names, sizes, content hashes), "model_record" (checkpoint.model_record), "step"}

Each setting is in one of four classes (the README's table under *Checkpoints and exact
resume* lists them):

- ``IGNORED``: where and how the run is laid out, not what it computes (the run directory, the
  mesh, Grain workers); never compared;
- ``ANNOUNCED``: how long, how often, what is evaluated, how memory is traded for time (remat,
  log-prob chunks, gradient accumulation: the same update); accepted, printed and recorded in
  ``history.jsonl`` — raising ``--steps`` is how a finished run continues;
- ``ALLOWED``: the size of the update (learning rate, its floor, weight decay, clipping); accepted
  only when ``--resume-changed`` names them, and recorded;
- everything else is refused, with the reason: the algorithm and its settings, the model, the
  data and how it is batched and tokenized, the seed, the optimizer's form. The saved optimizer
  state, data position or reference would then be meaningless: that is a new run
  (``--init-from`` the old one).

A setting in none of the tables (a new option) is refused until it is classified here (a test
checks that every option is).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from nnx_posttrain import checkpoint, errors, model
from nnx_posttrain import config as config_lib
from nnx_posttrain import data
from nnx_posttrain.checkpoint import CheckpointMismatchError
from nnx_posttrain.train import rundir

IGNORED = {
    "run_dir", "resume", "eval_only", "resume_changed", "memory_check", "mesh.*",
    "batching.num_workers", "checkpoint.async_save", "algo_name", "config", "resolved_from",
    "report_to",
    "host_allocator", "compile_cache",
}
ANNOUNCED = {
    "steps", "log_every", "logprob_chunk", "remat", "attention", "scan_layers", "eval_data", "eval.*", "checkpoint.*",
    "batching.grad_accum", "optim.on_nonfinite",
}
ALLOWED = {"optim.learning_rate", "optim.min_lr_ratio", "optim.weight_decay", "optim.max_grad_norm"}
REFUSED = {
    "algorithm": "a run's algorithm is fixed",
    "algo.*": "the algorithm's settings shape its loss and its batches",
    "model": "the saved weights are of the run's model",
    "dtype": "the saved weights are of the run's precision",
    "quantize": "the LoRA factors were trained over the run's quantized (or not) base",
    "lora.*": "the saved weights are of the run's LoRA configuration",
    "train_vision": "the saved trainable weights hold the vision tower or not",
    "init_from": "the starting weights (and the reference model) come from it",
    "chat_format": "the chat template decides the tokens of every conversational record",
    "seed": "the seed fixes the data order and the initial weights",
    "data": "the saved data position is a position in the run's data",
    "batching.batch_size": "the saved data position counts batches of the run's size",
    "batching.*": "the saved data position is in records batched and tokenized as before",
    "optim.schedule": "the learning-rate schedule is part of the optimizer's state",
    "optim.warmup_steps": "the learning-rate schedule is part of the optimizer's state",
    "optim.*": "AdamW's moments were accumulated with the run's settings",
}


def _rule(key: str, table) -> str | None:
    """The entry of ``table`` for ``key``: itself, else its group (``optim.*``)."""
    if key in table:
        return key
    group = key.split(".")[0] + ".*"
    return group if group in table else None


def classify(key: str) -> tuple[str, str]:
    """('ignored' | 'announced' | 'allowed' | 'refused', reason) of a setting."""
    if _rule(key, IGNORED):
        return "ignored", ""
    if _rule(key, ANNOUNCED):
        return "announced", ""
    if _rule(key, ALLOWED):
        return "allowed", ""
    rule = _rule(key, REFUSED)
    if rule:
        return "refused", REFUSED[rule]
    return "refused", "a setting not classified for resume (nnx_posttrain/train/resume.py)"


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def allowed_keys(option: str) -> set[str]:
    """``--resume-changed`` -> setting names ('optim.learning-rate' and '--steps' are accepted;
    a group name, 'eval', stands for its settings), refused with a message when one is not a
    setting or not one a resume may change."""
    keys = {k.strip().lstrip("-").replace("-", "_") for k in option.split(",") if k.strip()}
    known = set(flatten(config_lib.to_dict(config_lib.Config())))
    for key in sorted(keys):
        group = key not in known and any(k.startswith(key + ".") for k in known)
        # the algorithm's settings are not in the base config: judged by their group alone
        if key not in known and not group and not key.startswith("algo.") and key != "algorithm":
            close = _suggest(key, known)
            raise errors.ConfigError(
                f"--resume-changed {key}: not a setting"
                + (f" (did you mean {close}?)" if close else "") + "; it names "
                + ", ".join(sorted(ALLOWED)) + " (others need no naming: "
                + ", ".join(sorted(ANNOUNCED)) + ")")
        kind, reason = classify(key + ".*" if group else key)
        if kind in ("allowed", "announced", "ignored"):
            continue
        raise errors.ConfigError(f"--resume-changed {key}: a resume cannot change it ({reason})")
    return keys


def _suggest(key: str, known: set[str]) -> str | None:
    """The setting ``key`` most likely abbreviates (``optim.lr``: its letters in order in the
    name, the same first letter, ``optim.learning_rate``), else the closest spelling."""
    group, _, name = key.rpartition(".")
    for candidate in sorted(known, key=lambda k: (k not in ALLOWED, k)):
        cgroup, _, cname = candidate.rpartition(".")
        it = iter(cname)
        if cgroup == group and name and cname[0] == name[0] and all(ch in it for ch in name):
            return candidate
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return close[0] if close else None


def run_record(cfg, algorithm) -> dict:
    """The part of a checkpoint's record that describes the run (not the model's variables)."""
    return {"algorithm": algorithm.name, "config": config_lib.to_dict(cfg),
            "data_signature": {"train": data.signature(cfg.data),
                               "eval": data.signature(cfg.eval_data)}}


def _plain(value):
    return json.loads(json.dumps(value))  # tuples -> lists, as the saved record has them


def differences(saved: dict, current: dict) -> dict[str, list]:
    """{setting: [checkpoint's value, this command's]} of every compared setting that differs."""
    if saved.get("algorithm") not in (None, current["algorithm"]):
        # another algorithm: its settings differ too; the algorithm is the difference
        return {"algorithm": [saved["algorithm"], current["algorithm"]]}
    old, new = flatten(saved.get("config", {})), flatten(_plain(current["config"]))
    signatures = saved.get("data_signature"), current["data_signature"]
    if signatures[0] is not None:  # the data are compared by content, not by path
        old.pop("data", None), new.pop("data", None), old.pop("eval_data", None)
        new.pop("eval_data", None)
        for split, key in (("train", "data"), ("eval", "eval_data")):
            if _plain(signatures[1][split]) != signatures[0].get(split):
                old[key] = saved["config"].get(key)
                new[key] = current["config"].get(key)
                if old[key] == new[key]:  # same path, other content
                    old[key], new[key] = f"{old[key]} (as it was)", f"{new[key]} (changed since)"
    for flat in (old, new):  # --dtype auto and the dtype it resolves to are the same setting
        if "dtype" in flat and "model" in flat:
            flat["dtype"] = model.resolve_dtype(flat["model"], flat["dtype"],
                                                bool(flat.get("lora.rank")))
    out = {}
    for key in sorted(set(old) | set(new)):
        if key in old and key in new and old[key] != new[key] and classify(key)[0] != "ignored":
            out[key] = [old[key], new[key]]
    return out


def check(saved: dict, current: dict, allowed: set[str], where: str, run_dir) -> dict:
    """The accepted changes ({setting: [before, after]}) of a resume from the checkpoint whose
    record is ``saved`` (announced and named ones); ``CheckpointMismatchError`` listing every
    difference if one is refused or not named in ``--resume-changed``."""
    if "model_record" in saved and saved.get("algorithm") in (None, current["algorithm"]):
        problems = checkpoint.model_problems(saved["model_record"],
                                             checkpoint.model_settings(_plain(current["config"])))
        if problems:  # another model: what matters first (the other settings follow from it)
            raise CheckpointMismatchError(str(checkpoint.mismatch(where, problems))
                                          + _how_to_go_on(run_dir))
    changes = differences(saved, current)
    lines, accepted = [], {}
    for key, (old, new) in changes.items():
        kind, reason = classify(key)
        if key == "optim.max_grad_norm" and (old == 0) != (new == 0):
            kind, reason = "refused", "clipping on / off changes the optimizer state's form"
        named = key in allowed or key.split(".")[0] in allowed
        if kind == "announced" or (kind == "allowed" and named):
            accepted[key] = [old, new]
            continue
        hint = (f"allowed with --resume-changed {key}" if kind == "allowed"
                else f"refused: {reason}")
        lines.append(f"{key}: {old!r} -> {new!r} ({hint})")
    if lines:
        raise CheckpointMismatchError(
            f"checkpoint {where} was written with other settings than this command's:\n  "
            + "\n  ".join(lines) + _how_to_go_on(run_dir, any("allowed with" in line
                                                             for line in lines)))
    return accepted


def _how_to_go_on(run_dir, nameable: bool = False) -> str:
    return ("\nRun the same command as before to resume it"
            + (", or name the allowed changes with --resume-changed" if nameable else "")
            + f"; or start a new run in another --run-dir (--init-from {run_dir} starts from "
            "its weights, where the model is the same).")


def check_config_edit(run_dir, cfg) -> None:
    """``CheckpointMismatchError`` when ``config.json`` was edited since the run wrote it (as
    ``history.jsonl`` recorded it) and this command's settings differ from the edit: a resume
    rewrites the file, which would drop the edit without a word. The edit counts once the command
    carries it (``--config`` the file, or the same flags); a setting a resume may not change is
    then refused or allowed as any other."""
    path = Path(run_dir) / "config.json"
    written = rundir.written_config(run_dir)
    if written is None or not path.is_file():
        return
    how = (f"A resume runs with the command's settings and rewrites {path.name}: to run with "
           f"the edit, pass --config {path} (a setting a resume may not change then also needs "
           "--resume-changed, or a new --run-dir); to drop it, undo the edit.")
    try:
        edited = flatten(json.loads(path.read_text()))
    except (ValueError, AttributeError) as exc:
        raise CheckpointMismatchError(f"{path} was edited since the run wrote it and is no "
                                      f"longer a JSON object ({exc}). {how}") from None
    written, mine = flatten(written), flatten(_plain(config_lib.to_dict(cfg)))
    lines = [f"{key}: the run wrote {_shown(written, key)}, the file has {_shown(edited, key)}, "
             f"this command {_shown(mine, key)}"
             for key in sorted(set(edited) | set(written))
             if _shown(edited, key) != _shown(written, key) and classify(key)[0] != "ignored"
             and _shown(mine, key) != _shown(edited, key)]
    if lines:
        raise CheckpointMismatchError(f"{path} was edited since the run wrote it, and this "
                                      "command's settings differ from the edit:\n  "
                                      + "\n  ".join(lines)
                                      + f"\n{how}")


def _shown(flat: dict, key: str) -> str:
    return repr(flat[key]) if key in flat else "nothing"
