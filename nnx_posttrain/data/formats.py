"""Record formats, detected from the columns (``detect_format``) or set explicitly; they follow
TRL's column conventions, and strings and conversations (lists of ``role``/``content`` messages)
both work:

- language modelling: ``text``, or ``messages`` (the loss covers the assistant turns only);
- prompt-completion: ``prompt`` + ``completion`` (the loss covers the completion only);
- preference: ``chosen`` + ``rejected`` with an explicit or implicit ``prompt`` (see
  ``implicit_prompt``);
- unpaired preference: ``prompt`` + ``completion`` + ``label`` (a boolean);
- prompt-only: ``prompt`` alone (for RL; other columns are extras, see ``extra_columns``).

Also here: the checks of a record's fields (errors name the file, line and field) and the split
of a record into prompt and completion segments, each flagged with whether it carries loss.
"""

from __future__ import annotations

import json

from nnx_posttrain import chat
from nnx_posttrain.data.errors import DataError
from nnx_posttrain.data.sources import Mixture, _row_index, source_name

# Data formats (the ``format`` option; "auto" detects them from the columns).
FORMATS = ("language_modeling", "prompt_completion", "preference", "unpaired_preference", "prompt_only")

# What ``detect_format`` returns (finer: a language-modelling record is "messages" or "text").
RECORD_FORMATS = ("messages", "text", "prompt_completion", "preference", "unpaired_preference",
                  "prompt_only")


def _where(record) -> str:
    return record.get("_where", "?")


MAX_DEPTH = 32
"""The deepest nesting of a record's values (a conversation with tool calls and their JSON
arguments is 6-8 levels deep): a deeper record is refused by line, as a bad record."""


def check_values(record: dict) -> None:
    """``DataError`` naming the record and the field for a value nested deeper than
    ``MAX_DEPTH``, or text that cannot be encoded as UTF-8 (a lone surrogate, which a JSON
    ``\\ud800`` escape gives): what the tokenizer could not read is a bad record, refused (or
    skipped with ``--batching.skip-bad``) like any other."""
    stack = [(value, key, 2) for key, value in record.items() if not key.startswith("_")]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise DataError(f"{_where(record)}: field '{path.split('.')[0].split('[')[0]}' is "
                            f"nested deeper than {MAX_DEPTH} levels (nnx_posttrain.data.formats."
                            "MAX_DEPTH): not a record of text")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = value[exc.start:exc.end].encode("unicode_escape").decode()
                raise DataError(f"{_where(record)}: field '{path}' holds text that cannot be "
                                f"encoded as UTF-8 ({exc.reason}: {bad} at character "
                                f"{exc.start + 1})") from None
        elif isinstance(value, dict):
            stack += [(v, f"{path}.{k}", depth + 1) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]


def _columns(record) -> set:
    """Columns that hold a value: a null (a missing value in Parquet / Arrow) counts as absent."""
    return {k for k, v in record.items() if not k.startswith("_") and v is not None}


def detect_format(record: dict) -> str:
    """The record's format from its columns: one of ``RECORD_FORMATS``."""
    keys = _columns(record)
    if {"chosen", "rejected"} <= keys:
        return "preference"
    if {"completion", "label"} <= keys:
        return "unpaired_preference"
    if "messages" in keys:
        return "messages"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if "text" in keys:
        return "text"
    if "prompt" in keys:
        return "prompt_only"
    nulls = sorted(k for k, v in record.items() if not k.startswith("_") and v is None)
    null_note = f" (null: {', '.join(repr(k) for k in nulls)})" if nulls else ""
    raise DataError(
        f"{_where(record)}: cannot tell the format from columns {sorted(keys)}{null_note}; "
        "expected 'messages' or 'text' (language modelling), 'prompt' + 'completion', 'chosen' + "
        "'rejected' (preference), 'prompt' + 'completion' + 'label' (unpaired preference), or "
        "'prompt' alone"
    )


def coarse_format(record_format: str) -> str:
    """'messages' / 'text' -> 'language_modeling'; the other formats are themselves."""
    return "language_modeling" if record_format in ("messages", "text") else record_format


def data_format(src, format: str = "auto", scan: int = 100) -> str:
    """The data's format (one of ``FORMATS``): ``format`` itself unless it is 'auto', else detected
    from the first of the first ``scan`` records that can be read and recognised."""
    if format != "auto":
        if format not in FORMATS:
            raise ValueError(f"unknown data format {format!r}; expected 'auto' or one of {FORMATS}")
        return format
    first_error = None
    for i in range(min(len(src), scan)):
        try:
            return coarse_format(detect_format(src[i]))
        except DataError as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    raise DataError(f"{source_name(src)}: no records")


def _require_str(record, field, allow_empty=False):
    value = record.get(field)
    where = _where(record)
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise DataError(f"{where}: field '{field}' is empty")
    return value


def _value(record, field, allow_empty=False):
    """A prompt / completion value: a string or a list of messages."""
    where = _where(record)
    if record.get(field) is None:
        raise DataError(f"{where}: field '{field}' is missing")
    value = record[field]
    if isinstance(value, str):
        if not allow_empty and not value.strip():
            raise DataError(f"{where}: field '{field}' is empty")
    elif isinstance(value, list):
        if not allow_empty and not value:
            raise DataError(f"{where}: field '{field}' is empty")
    else:
        raise DataError(
            f"{where}: field '{field}' must be a string or a list of messages, got {type(value).__name__}"
        )
    return value


def _same_kind(record, first, second, a, b):
    if isinstance(a, str) != isinstance(b, str):
        raise DataError(
            f"{_where(record)}: fields '{first}' and '{second}' must both be strings or both be lists "
            f"of messages, got {type(a).__name__} and {type(b).__name__}"
        )


def implicit_prompt(chosen, rejected):
    """TRL's implicit prompt: (prompt, chosen, rejected) where the prompt is the longest common
    prefix of chosen and rejected — the common leading messages of two conversations, or the
    common leading characters of two strings (as in TRL's ``extract_prompt``, a space just before
    the point where they differ goes to the completions, where a tokenizer expects it)."""
    n = 0
    limit = min(len(chosen), len(rejected))
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and 0 < n < limit and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def record_tools(record) -> list | None:
    """The record's ``tools`` column (TRL's: the JSON schemas of the functions its conversation
    may call, a list or that list as a JSON string), or None."""
    tools = record.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise DataError(f"{_where(record)}: field 'tools' is a string that is not JSON "
                            f"({exc.msg})") from None
    problem = chat.tools_problem(tools)
    if problem:
        raise DataError(f"{_where(record)}: field 'tools' {problem}")
    return tools


def _empty_assistant_turn(messages) -> bool:
    """An assistant message with neither text nor a tool call: nothing to learn."""
    return any(m.get("role") == "assistant" and not (m.get("content") or "").strip()
               and not m.get("tool_calls") for m in messages)


def _lm_segments(record, fmt, chat_format):
    where = _where(record)
    if fmt == "messages":
        msgs = record["messages"]
        try:
            segs = chat.render(msgs, chat_format, tools=record_tools(record))
        except chat.ChatFormatError as exc:
            raise DataError(f"{where}: field 'messages': {exc}") from None
        if not any(flag for _, flag in segs):
            raise DataError(f"{where}: field 'messages' has no assistant turn to learn from")
        if _empty_assistant_turn(msgs):
            raise DataError(f"{where}: field 'messages' has an empty assistant turn")
        return segs, False
    text = _require_str(record, "text")
    return [(text, True)], True


def _prompt_completion(record, pfield, cfield, chat_format, prompt=None, completion=None):
    """(prompt segments, completion segments, add_eos) of a prompt and a completion that are both
    strings or both message lists (read from the record's fields unless given)."""
    where = _where(record)
    if prompt is None:
        prompt = _value(record, pfield, allow_empty=True)
    if completion is None:
        completion = _value(record, cfield)
    _same_kind(record, pfield, cfield, prompt, completion)
    if isinstance(prompt, str):
        return [(prompt, False)] if prompt else [], [(completion, True)], True
    tools = record_tools(record)
    opening = prompt or completion  # the part the tools go with (Llama's first user message)
    for field_name, msgs in ((pfield, prompt), (cfield, completion)):
        if msgs:
            try:
                chat.render(msgs, chat_format, tools=tools if msgs is opening else None)
            except chat.ChatFormatError as exc:
                raise DataError(f"{where}: field '{field_name}': {exc}") from None
    if _empty_assistant_turn(completion):
        raise DataError(f"{where}: field '{cfield}' has an empty assistant turn")
    full = chat.render(prompt + completion, chat_format, tools=tools)
    head = (chat.to_text(prompt, chat_format, add_generation_prompt=True, tools=tools)
            if prompt else "")
    if not "".join(t for t, _ in full).startswith(head):  # the completion opens with no assistant turn
        head = chat.to_text(prompt, chat_format, tools=tools)
    before, after = _cut(full, len(head))
    if not any(flag for _, flag in after):
        raise DataError(f"{where}: field '{cfield}' has no assistant turn to learn from")
    # nothing in the prompt's text carries loss (not even a few-shot assistant turn); after it,
    # the template's own flags (assistant content + end-of-turn marker, not the turn headers)
    return [(t, False) for t, _ in before], after, False


def _cut(segs, n_chars):
    """Segments before and after character ``n_chars`` (a segment across it is split)."""
    before, after, pos = [], [], 0
    for text, flag in segs:
        if pos + len(text) <= n_chars:
            before.append((text, flag))
        elif pos >= n_chars:
            after.append((text, flag))
        else:
            cut = n_chars - pos
            before.append((text[:cut], flag))
            after.append((text[cut:], flag))
        pos += len(text)
    return before, after



def preference_parts(record: dict):
    """(prompt, chosen, rejected) of a preference record, the prompt implicit when absent."""
    where = _where(record)
    chosen, rejected = _value(record, "chosen"), _value(record, "rejected")
    _same_kind(record, "chosen", "rejected", chosen, rejected)
    if record.get("prompt") is not None:
        prompt = _value(record, "prompt", allow_empty=True)
        _same_kind(record, "prompt", "chosen", prompt, chosen)
        return prompt, chosen, rejected
    prompt, chosen, rejected = implicit_prompt(chosen, rejected)
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if not value or (isinstance(value, str) and not value.strip()):
            raise DataError(
                f"{where}: field '{name}' is empty once the implicit prompt (the common start of "
                "'chosen' and 'rejected') is removed; give the prompt in a 'prompt' column"
            )
    return prompt, chosen, rejected


class Unpaired:
    """Preference pairs read as unpaired examples, as TRL's KTOTrainer reads them
    (``maybe_unpair_preference_dataset``): record 2i is pair i's prompt with its chosen completion
    (``label`` true), 2i + 1 the same prompt with its rejected one (false); the pair's other
    columns are kept, and ``_where`` says which side."""

    def __init__(self, src):
        self.src = src

    def __len__(self) -> int:
        return 2 * len(self.src)

    def __getitem__(self, index: int) -> dict:
        index = _row_index(index, len(self), source_name(self.src))
        record = self.src[index // 2]
        prompt, chosen, rejected = preference_parts(record)
        side = "rejected" if index % 2 else "chosen"
        out = {k: v for k, v in record.items() if k not in ("chosen", "rejected", "margin")}
        out.update(prompt=prompt, completion=rejected if index % 2 else chosen,
                   label=not index % 2, _where=f"{_where(record)} ({side})")
        return out

    def __repr__(self):
        return f"Unpaired({self.src!r})"


def unpaired(src):
    """``src`` (preference pairs) as unpaired examples (``Unpaired``); a mixture part by part,
    its weights kept."""
    if isinstance(src, Mixture):
        return Mixture([Unpaired(part) for part in src.sources], src.weights)
    return Unpaired(src)
