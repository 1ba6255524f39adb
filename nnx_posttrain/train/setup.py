"""What a run builds before its first step, the model and the validated data, and the checks
that need them (records with no loss token, --checkpoint.keep-best, --eval-only). What differs
between algorithms is asked of the algorithm (``algorithms.base.AlgorithmBase``)."""

from __future__ import annotations

import dataclasses

from nnx_posttrain import data, errors, model, runs, sharding


def settings_for_data(cfg, algorithm, echo):
    """``cfg`` checked by the algorithm (before any data or model loads) and with the settings
    that depend on the data resolved (``algorithm.settings_for_data``)."""
    algorithm.check(cfg)
    return algorithm.settings_for_data(cfg, echo)


def build_model(cfg, algorithm, echo, init_step: int | None = None, abstract: bool = False,
                platform: str | None = None):
    """(language model, trained module) of a run, the algorithm's settings resolved on it; the
    weights of ``--init-from``'s checkpoint ``init_step`` (default: its latest). ``abstract``:
    built without weights (``runs.build_model``) for a step that will run on ``platform``
    (default: this process's). ``ConfigError`` where ``--mesh.expert`` cannot split the model's
    experts (``sharding.check_experts``)."""
    lm, module = runs.build_model(runs.ModelSpec.of(cfg, algorithm.head, init_step), echo,
                                  abstract, platform)
    sharding.check_experts(cfg.mesh.expert, lm.module, cfg.model)
    echo(model.set_attention(lm.module, cfg.attention, platform=platform))
    echo(model.set_scan(lm.module, cfg.scan_layers))
    algorithm.setup(module)
    echo(model.describe(lm) + (f"; reference: {algorithm.reference_mode}"
                               if algorithm.reference_mode else ""))
    return lm, module


@dataclasses.dataclass
class Datasets:
    train: object
    eval: object  # None without eval data
    transform: object
    skipped: int  # bad records skipped (--batching.skip-bad)


def datasets(cfg, lm, algorithm, echo, train_src, eval_src) -> Datasets:
    """The opened sources read as the algorithm reads them, tokenized, every record validated
    up front (bad ones refused, or skipped with --batching.skip-bad)."""
    b = cfg.batching
    train_src, eval_src = algorithm.read_data(cfg, train_src, eval_src, echo)
    transform = data.make_transform(train_src, lm, b.max_length, b.truncation,
                                    b.max_prompt_length, b.format)
    algorithm.check_records(cfg, transform, train_src)
    kept, skipped = {}, 0
    for name, src in (("train", train_src), ("eval", eval_src)):
        if src is None or (cfg.eval_only and name == "train"):
            kept[name] = src
            continue
        report = data.validate(src, transform, skip_bad=b.skip_bad)
        echo(_report_line(name, report, cfg, algorithm))
        _check_loss_tokens(name, src, report, cfg, echo)
        if name == "train":
            algorithm.check_train_data(report, echo)
        kept[name] = data.only_good(src, report, drop_no_loss=True)
        skipped += report.bad
    return Datasets(kept["train"], kept["eval"], transform, skipped)


def _report_line(name, report, cfg, algorithm) -> str:
    return (f"{name} data: {report.records} records, {report.bad} bad (skipped), "
            f"{report.truncated} truncated to {cfg.batching.max_length} tokens, "
            f"{report.no_loss_tokens} with no loss token left"
            + (" (left out)" if report.no_loss_tokens else "")
            + (f", {report.identical_pairs} pairs with chosen == rejected (no preference to "
               "learn)" if report.identical_pairs else "")
            + algorithm.describe_data(report)
            + "".join("\n  skipped: " + m for m in report.bad_examples))


def _check_loss_tokens(name, src, report, cfg, echo) -> None:
    """Records left with no loss token (a prompt longer than the length limits) are left out;
    none left, or (training, without --batching.skip-bad) more than half of them, is refused:
    the length settings do not fit the data."""
    n, empty = len(report.good_indices), report.no_loss_tokens
    if not empty:
        return
    first = src[int(report.no_loss_indices[0])].get("_where", "record 0")
    fix = (f"raise --batching.max-length ({cfg.batching.max_length})"
           + (f" or --batching.max-prompt-length ({cfg.batching.max_prompt_length})"
              if cfg.batching.max_prompt_length else "")
           + ", or shorten the prompts")
    if empty == n:
        raise errors.DataError(f"{name} data: none of the {n} records has a token to learn "
                               f"from within the length limits (the first: {first}); {fix}")
    if name == "train" and 2 * empty > n and not cfg.batching.skip_bad:
        raise errors.DataError(
            f"{name} data: {empty} of {n} records have no token to learn from within the length "
            f"limits (the first: {first}); {fix}, or pass --batching.skip-bad to train on the "
            "other records")
    echo(f"  {name} data: {empty} records with no loss token left are left out (the first: "
         f"{first})")


def check_evaluation(cfg, algorithm, evaluator, params, frozen) -> None:
    """Before anything runs: --checkpoint.keep-best names a metric the run evaluates, and
    --eval-only has something to evaluate."""
    if cfg.eval_only and not (evaluator.enabled and (evaluator.batches or evaluator.pairs)):
        if not evaluator.enabled:
            raise errors.ConfigError("--eval-only: no eval data; pass --eval-data FILE (with "
                                     "--data builtin the built-in task's eval split is used)")
        why = ("--eval.exact-match is 0; pass a number of prompts, e.g. --eval.exact-match 200"
               if not cfg.eval.exact_match else
               "the eval data hold no answers to compare with (an 'answer' column with the "
               "prompts, a completion, or the chosen side of a pair)")
        raise errors.ConfigError(
            f"--eval-only: nothing to evaluate: {algorithm.name} is evaluated by "
            f"generation (exact match of greedy answers to the eval prompts), and {why}")
    best = cfg.checkpoint.keep_best
    if best and not cfg.eval_only:
        names = evaluator.metric_names(params, frozen) if evaluator.enabled else set()
        if best not in names:
            raise errors.ConfigError(
                f"--checkpoint.keep-best {best}: the run never evaluates it; "
                + (f"its eval metrics are {', '.join(sorted(names))}" if names else
                   "it has no eval data (--eval-data)"))
