"""Grain pipelines: endless shuffled (optionally mixed, optionally packed) training batches with
exact resume, fixed eval batches, the held-out prompts and answers of exact-match evaluation, and
``Indexed``, the transform wrapper that keeps a record's index in its example."""

from __future__ import annotations

import grain
import numpy as np

from nnx_posttrain import chat
from nnx_posttrain.data import images
from nnx_posttrain.data.errors import DataError
from nnx_posttrain.data.formats import detect_format, preference_parts
from nnx_posttrain.data.sources import Mixture


class Indexed:
    """A transform that also keeps the record's index in its source (``index``), so per-example
    data computed before training (precomputed reference log-probs) can be joined to batches.

    It reads the record's ``_index``, which ``train_batches`` / ``eval_batches`` attach to every
    record (``_IndexedSource``), into the example as ``index`` (an ``np.int64``; -1 when the record
    has none); ``kind`` is the wrapped transform's."""

    def __init__(self, transform):
        self.transform = transform
        self.kind = transform.kind

    def __call__(self, record):
        return dict(self.transform(record), index=np.int64(record.get("_index", -1)))


class _IndexedSource:
    """A source whose records carry ``_index`` (offset + index), the record's index in the source
    given to ``train_batches``: what ``TokenizePrompt`` and ``Indexed`` put in an example's
    ``index``. (It wraps a source and adds a record field; ``Indexed`` wraps a transform and
    reads that field into the example.)"""

    def __init__(self, src, offset: int = 0):
        self.src, self.offset = src, offset

    def __len__(self):
        return len(self.src)

    def __getitem__(self, index):
        return dict(self.src[index], _index=self.offset + int(index))


def _part_seed(seed: int, part: int) -> int:
    return int(np.random.SeedSequence([seed, part]).generate_state(1)[0])


def records_dataset(src, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """An endless ``MapDataset`` of records: shuffled by ``seed`` and reshuffled every epoch; a
    ``Mixture`` shuffles and repeats each part on its own, then mixes them by weight."""
    if isinstance(src, Mixture):
        parts = []
        for k, part in enumerate(src.sources):
            ds = grain.MapDataset.source(_IndexedSource(part, int(src._offsets[k])))
            if shuffle:
                ds = ds.shuffle(seed=_part_seed(seed, k))
            parts.append(ds.repeat(None))
        return grain.MapDataset.mix(parts, src.weights)
    ds = grain.MapDataset.source(_IndexedSource(src))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(None)


def train_batches(src, transform, batch_size: int, seed: int, shuffle: bool = True,
                  num_workers: int = 0) -> grain.DatasetIterator:
    """Endless iterator of batches (dicts of ``[batch_size, ...]`` arrays), epoch after epoch.

    The order depends on ``seed`` only (each epoch reshuffled); a batch may span two epochs. The
    iterator's ``get_state()`` / ``set_state()`` save and restore its position exactly.
    ``num_workers > 0`` tokenizes in that many Grain worker processes (same batches, same order);
    call ``close()`` on the iterator when done with it.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    ds = records_dataset(src, seed, shuffle).map(transform).batch(batch_size, drop_remainder=True)
    if num_workers == 0:  # a few threads, a few batches ahead (Grain's default is 500 batches)
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=8)))
    from absl import flags  # Grain reads its absl flags; this program has no absl command line

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    # each worker makes every num_workers-th batch, one at a time, up to 2 ahead
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=1))
    return iter(it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers,
                                                             per_worker_buffer_size=2)))


def _unpad(example: dict) -> dict:
    """A padded SFT example -> its real tokens (what packing needs); ``truncated`` rides along as
    a sequence whose first element is the flag, so a packed row sums its examples' flags."""
    n = int(example["attention_mask"].sum())
    flag = np.zeros(n, np.int32)
    flag[:1] = example["truncated"]
    return {"input_ids": example["input_ids"][:n], "loss_mask": example["loss_mask"][:n],
            "truncated": flag}


def _packed_row(row: dict) -> dict:
    segments = row["input_ids_segment_ids"].astype(np.int32)
    loss_mask = row["loss_mask"] * (row["input_ids_positions"] > 0)  # never predict across examples
    return {
        "input_ids": row["input_ids"].astype(np.int32),
        "attention_mask": (segments > 0).astype(np.int32),
        "loss_mask": loss_mask.astype(np.float32),
        "segment_ids": segments,
        "truncated": np.int32(row["truncated"].sum()),
    }


def packed_train_batches(src, transform, batch_size: int, seed: int, shuffle: bool = True,
                         num_workers: int = 0) -> grain.DatasetIterator:
    """Like ``train_batches`` for SFT, with several examples packed into each ``max_length`` row
    (Grain's first-fit packing): ``segment_ids`` number the examples of a row (0 = padding), and
    the model's attention never crosses them (``model.hidden_states``)."""
    if getattr(transform, "kind", "sft") != "sft":
        raise ValueError("packing applies to SFT data only")
    if getattr(transform, "images", None) is not None:  # deliberately, as TRL
        raise DataError(
            "--batching.packing: packing does not carry images (a vision model's rows keep their "
            "examples' pixel values one a row); TRL 1.16 refuses it too (SFTTrainer: \"Packing "
            "is not supported for vision datasets. Please set `packing=False`\"). Train a vision "
            "model unpacked: leave out --batching.packing")
    length = transform.max_length
    ds = records_dataset(src, seed, shuffle).map(transform).map(_unpad)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=4 if not num_workers else 1,
                                              prefetch_buffer_size=8))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"input_ids": length, "loss_mask": length, "truncated": length},
        num_packing_bins=batch_size, seed=seed, shuffle_bins=shuffle,
    )
    ds = ds.map(_packed_row).batch(batch_size, drop_remainder=True)
    if num_workers:
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers,
                                                         per_worker_buffer_size=2))
    return iter(ds)


def eval_batches(src, transform, batch_size: int, limit: int = 0) -> list[dict]:
    """The first ``limit`` full batches of the eval split in order (all when 0); the last partial
    batch is padded with examples whose masks are zero (and ``index`` -1), so every batch has the
    compiled shape."""
    n = len(src) if not limit else min(len(src), limit * batch_size)
    examples = [transform(dict(src[i], _index=i)) for i in range(n)]
    while len(examples) % batch_size:
        blank = {k: (np.full_like(v, -1) if k == "index" else np.zeros_like(v))
                 for k, v in examples[0].items()}
        examples.append(blank)
    return [
        {k: np.stack([e[k] for e in examples[i : i + batch_size]]) for k in examples[0]}
        for i in range(0, len(examples), batch_size)
    ]


def prompts_and_answers(src, chat_format: str, limit: int, spec=None) -> list[tuple]:
    """Held-out (prompt segments, reference answer) pairs for exact-match evaluation; with a
    vision model's ``spec`` (``images.ImageSpec``), (prompt segments, reference answer, pixel
    values [max images, H, W, 3] or None for a record without images): the segments name each
    image with its marker, which ``images.expand_segments`` expands before tokenizing (a
    record with images is refused without a ``spec``: a text model reads none).

    A conversation whose last turn is the assistant's gives (the conversation before it, that
    turn); a prompt/completion record gives (prompt, completion); a preference pair gives
    (prompt, chosen); an unpaired example labelled desirable gives (prompt, completion); a
    prompt-only record with an ``answer`` column gives (prompt, answer). A record of another
    format with an ``answer`` column is compared with its answer, not its completion.
    """
    out = []
    for i in range(len(src)):
        if len(out) >= limit:
            break
        record, arrays = images.prepare(src[i], chat_format, spec)  # content parts as text
        pair = _prompt_and_answer(record, chat_format)
        if pair is not None:
            out.append(pair if spec is None else pair + (spec.pixels(arrays) if arrays else None,))
    return out


def _prompt_and_answer(record: dict, chat_format: str) -> tuple | None:
    """(prompt segments, reference answer) of a record (``prompts_and_answers``), or None."""
    fmt = detect_format(record)
    if fmt == "messages" and record["messages"][-1]["role"] == "assistant":
        prompt = chat.render(record["messages"][:-1], chat_format, add_generation_prompt=True)
        answer = record.get("answer")
        return prompt, record["messages"][-1]["content"] if answer is None else str(answer)
    if fmt == "preference":
        p, c, _ = preference_parts(record)
    elif fmt in ("prompt_completion", "unpaired_preference"):
        if fmt == "unpaired_preference" and not record["label"]:
            return None
        p, c = record["prompt"], record["completion"]
    elif fmt == "prompt_only" and record.get("answer") is not None:
        p, c = record["prompt"], str(record["answer"])
    else:
        return None
    if record.get("answer") is not None:
        c = str(record["answer"])
    if isinstance(p, list):
        answer = c[-1]["content"] if isinstance(c, list) else c
        return chat.render(p, chat_format, add_generation_prompt=True), answer
    return [(p, False)], c if isinstance(c, str) else c[-1]["content"]
