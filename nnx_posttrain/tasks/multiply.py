"""The built-in agentic task: two-digit multiplication, which the tiny model cannot learn to do
in its head but can answer with a ``multiply`` tool.

``write_files(DIR)`` writes the task's data files (a user's data, as any other file;
``python -m tools.agent_table`` writes them and runs the table on them):

- ``sft_tools.jsonl``: demonstrations that use the tool (TRL's columns: ``messages`` with the
  assistant's ``tool_calls``, the ``tool`` result and the answer; ``tools``, the schema);
- ``sft_plain.jsonl``: the same problems answered directly (no tool);
- ``prompts.jsonl`` / ``eval.jsonl``: prompt-only records with the ``answer`` column (GRPO's
  prompts, and the held-out problems, disjoint from the training ones).

Its model, ``gemma_tiny_tools``, is ``gemma_tiny`` with this task's own SentencePiece tokenizer
(``tokenizer_proto``: trained on the rendered conversations, tools block included, so that the
prompt's tool schema is a few dozen tokens rather than hundreds of bytes).
"""

from __future__ import annotations

import functools
import io
import json
import random
from pathlib import Path

import sentencepiece as spm

EVAL_SIZE = 300
_SPLIT_SEED = 4321


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def schema() -> dict:
    from nnx_posttrain.agents import function_schema

    return function_schema(multiply)


def problems(split: str) -> list[tuple[int, int]]:
    """(a, b) pairs, both of two digits: 'eval' (the first ``EVAL_SIZE`` of a fixed shuffle of
    all 8,100) or 'train' (the rest)."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}: expected 'train' or 'eval'")
    return pairs[:EVAL_SIZE] if split == "eval" else pairs[EVAL_SIZE:]


def question(a: int, b: int) -> str:
    return f"What is {a} x {b}?"


def tool_record(a: int, b: int) -> dict:
    """A demonstration that calls the tool, reads its result and answers with it."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return {"messages": [{"role": "user", "content": question(a, b)},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "multiply", "content": str(a * b)},
                         {"role": "assistant", "content": str(a * b)}],
            "tools": [schema()]}


def plain_record(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": question(a, b)},
                         {"role": "assistant", "content": str(a * b)}]}


def prompt_record(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a * b)}


def write_files(out: Path) -> dict[str, Path]:
    """The task's data files under ``out`` (see the module docstring): {name: path}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"sft_tools": (tool_record, "train"), "sft_plain": (plain_record, "train"),
             "prompts": (prompt_record, "train"), "eval": (prompt_record, "eval")}
    paths = {}
    for name, (make, split) in files.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(make(a, b)) + "\n" for a, b in problems(split)))
    return paths


def _corpus() -> list[str]:
    from nnx_posttrain import chat

    pairs = problems("train")[:400]
    tools = [chat.to_text(tool_record(a, b)["messages"], "gemma", tools=[schema()])
             for a, b in pairs]
    return tools + [chat.to_text(plain_record(a, b)["messages"], "gemma") for a, b in pairs]


@functools.cache
def tokenizer_proto() -> bytes:
    """The task's SentencePiece model (Gemma's id layout and turn markers, digits split, byte
    fallback; deterministic)."""
    from nnx_posttrain.tasks.tokenizer import CHAT_TOKENS

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=model, vocab_size=768, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, split_digits=True, pad_id=0, eos_id=1,
        bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", user_defined_symbols=[*CHAT_TOKENS, "\n"],
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, hard_vocab_limit=False, max_sentence_length=8192,
        split_by_whitespace=False, max_sentencepiece_length=32,
        num_threads=1, minloglevel=2)
    return model.getvalue()

