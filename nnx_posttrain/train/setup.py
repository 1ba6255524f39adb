"""What a run builds before its first step, the model and the validated data, and the checks
that need them (records with no loss token, --checkpoint.keep-best, --eval-only)."""

from __future__ import annotations

from nnx_posttrain import data, model, runs


def build_model(cfg, algorithm, echo, init_step: int | None = None):
    """(language model, trained module) of a run, the algorithm's settings resolved on it; the
    weights of ``--init-from``'s checkpoint ``init_step`` (default: its latest)."""
    lm, module = runs.build_model(cfg.model, cfg.dtype, cfg.seed, cfg.lora, head=algorithm.head,
                                  init_from=cfg.init_from, remat=cfg.remat == "blocks", echo=echo,
                                  chat_format=cfg.chat_format, init_step=init_step)
    echo(model.set_attention(lm.module, cfg.attention))
    algorithm.setup(module)
    echo(model.describe(lm) + (f"; reference: {algorithm.reference_mode}"
                               if algorithm.reference_mode else ""))
    return lm, module


def sources(cfg, algorithm):
    """(train source, eval source or None), opened before the model loads: a missing file, a bad
    data option or an online run's reward that cannot be found, imported or fed from the data is
    refused in seconds, not after a large model's minutes of loading."""
    kind = algorithm.data_kind
    train_src = data.source(cfg.data, "train", builtin=kind)
    if hasattr(algorithm.cfg, "rewards"):
        from nnx_posttrain.algorithms.online import rewards

        algorithm.prompts_per_step(cfg.batching.batch_size)  # the sampling settings
        rewards.check(algorithm.cfg, train_src, cfg.data)
    eval_spec = cfg.eval_data or ("builtin" if cfg.data == "builtin" else None)
    return train_src, (data.source(eval_spec, "eval", builtin=kind) if eval_spec else None)


def datasets(cfg, lm, algorithm, echo, train_src, eval_src):
    """(train source, eval source or None, transform, bad records skipped) of the opened
    ``sources``, every record validated up front."""
    b = cfg.batching
    kind = algorithm.data_kind
    if kind == "unpaired_preference" and data.data_format(train_src, b.format) == "preference":
        # as TRL's KTOTrainer: each pair, a desirable and an undesirable example
        train_src, eval_src = (data.unpaired(src) if src is not None and data.data_format(
            src, b.format) == "preference" else src for src in (train_src, eval_src))
        echo(f"{cfg.data}: preference pairs read as unpaired examples, as TRL's KTO reads them: "
             "each pair's chosen completion desirable, its rejected one undesirable")
    transform = data.make_transform(train_src, lm.tokenizer, lm.chat_format, b.max_length,
                                    b.truncation, b.max_prompt_length, b.format)
    if b.packing and kind != "sft":
        raise SystemExit(f"error: --batching.packing applies to SFT only, not {algorithm.name}")
    if transform.kind != kind:
        raise SystemExit(
            f"error: {algorithm.name} needs {kind.replace('_', ' ')} records, but {cfg.data} holds "
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
             "no loss token left" + (" (left out)" if report.no_loss_tokens else "")
             + (f", {report.identical_pairs} pairs with chosen == rejected (no preference to "
                "learn)" if report.identical_pairs else "")
             + (f", {report.desirable} desirable / {report.undesirable} undesirable"
                if kind == "unpaired_preference" else "")
             + "".join("\n  skipped: " + m for m in report.bad_examples))
        _check_loss_tokens(name, src, report, cfg, echo)
        if name == "train" and kind == "unpaired_preference":
            _check_label_balance(report, algorithm.cfg, echo)
        sources.append(data.only_good(src, report, drop_no_loss=True))
        skipped += report.bad
    return sources[0], sources[1], transform, skipped


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
        raise SystemExit(f"error: {name} data: none of the {n} records has a token to learn "
                         f"from within the length limits (the first: {first}); {fix}")
    if name == "train" and 2 * empty > n and not cfg.batching.skip_bad:
        raise SystemExit(f"error: {name} data: {empty} of {n} records have no token to learn from "
                         f"within the length limits (the first: {first}); {fix}, or pass "
                         "--batching.skip-bad to train on the other records")
    echo(f"  {name} data: {empty} records with no loss token left are left out (the first: "
         f"{first})")


def _check_label_balance(report, algo_cfg, echo) -> None:
    """KTO's desirable / undesirable balance, with TRL's advice (KTOTrainer): a class missing, or
    weights outside the range where desirable_weight x desirable / (undesirable_weight x
    undesirable) is in [1, 4/3], is warned about (training goes on)."""
    d, u = report.desirable, report.undesirable
    wd, wu = algo_cfg.desirable_weight, algo_cfg.undesirable_weight
    if not (d and u):
        missing = "undesirable" if d else "desirable"
        echo(f"warning: the train data has no {missing} example ({d} desirable / {u} undesirable "
             f"labels): KTO learns from the contrast of both kinds; the {missing} loss term and "
             "its metrics are empty")
        return
    if d == u:
        return
    desirable = (round(u * wu / d, 2), round(u * wu / d * 1.33, 2))
    undesirable = (round(d * wd / u / 1.33, 2), round(d * wd / u, 2))
    if not (desirable[0] <= wd <= desirable[1] or undesirable[0] <= wu <= undesirable[1]):
        echo(f"warning: {d} desirable and {u} undesirable examples, weighted {wd:g} / {wu:g}: as "
             f"TRL advises, set EITHER --algo.desirable-weight in [{desirable[0]:g}, "
             f"{desirable[1]:g}] OR --algo.undesirable-weight in [{undesirable[0]:g}, "
             f"{undesirable[1]:g}] (not both)")


def sequences_per_example(algorithm) -> int:
    """Sequences one example puts through the model (chosen + rejected, completion + KL pair)."""
    return 2 if algorithm.data_kind in ("preference", "unpaired_preference") else 1


def check_evaluation(cfg, algorithm, evaluator, params, frozen) -> None:
    """Before anything runs: --checkpoint.keep-best names a metric the run evaluates, and
    --eval-only has something to evaluate."""
    if cfg.eval_only and not (evaluator.enabled and (evaluator.batches or evaluator.pairs)):
        if not evaluator.enabled:
            raise SystemExit("error: --eval-only: no eval data; pass --eval-data FILE (with "
                             "--data builtin the built-in task's eval split is used)")
        why = ("--eval.exact-match is 0; pass a number of prompts, e.g. --eval.exact-match 200"
               if not cfg.eval.exact_match else
               "the eval data hold no answers to compare with (an 'answer' column with the "
               "prompts, a completion, or the chosen side of a pair)")
        raise SystemExit(
            f"error: --eval-only: nothing to evaluate: {algorithm.name} is evaluated by "
            f"generation (exact match of greedy answers to the eval prompts), and {why}")
    best = cfg.checkpoint.keep_best
    if best and not cfg.eval_only:
        names = evaluator.metric_names(params, frozen) if evaluator.enabled else set()
        if best not in names:
            raise SystemExit(
                f"error: --checkpoint.keep-best {best}: the run never evaluates it; "
                + (f"its eval metrics are {', '.join(sorted(names))}" if names else
                   "it has no eval data (--eval-data)"))
