"""What a run builds before its first step: the model and the validated data."""

from __future__ import annotations

from nnx_posttrain import data, model, runs


def build_model(cfg, algorithm, echo):
    """(language model, trained module) of a run, the algorithm's settings resolved on it."""
    lm, module = runs.build_model(cfg.model, cfg.dtype, cfg.seed, cfg.lora, head=algorithm.head,
                                  init_from=cfg.init_from, remat=cfg.remat == "blocks", echo=echo,
                                  chat_format=cfg.chat_format)
    algorithm.setup(module)
    echo(model.describe(lm) + (f"; reference: {algorithm.reference_mode}"
                               if algorithm.reference_mode else ""))
    return lm, module


def datasets(cfg, lm, algorithm, echo):
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
