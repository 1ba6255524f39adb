"""Gemma 4's tool calls (chat format ``gemma4``) read back as its template writes them.

A call is ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` (the template's
``format_argument``: keys bare, strings between ``<|"|>`` quotes, numbers, ``true`` / ``false`` /
``null``, lists ``[...]``, objects ``{...}``; whitespace between them, which the template never
writes, is read past); a turn writes one or more, then ``<|tool_response>``, where the model
stops for the results (``chat.CALL_END``). The template writes every call so: a turn that stops
anywhere else (``<turn|>``) has answered, and whatever it wrote calls nothing.
"""

from __future__ import annotations

import re

from nnx_posttrain.agents.malformed import Malformed

_Q = '<|"|>'  # Gemma 4's string quote
END = "<|tool_response>"  # where a calling turn stops
_BLOCK = re.compile(r"<\|tool_call>(.*?)(<tool_call\|>|$)", re.DOTALL)
_CALL = re.compile(r"call:([^{}<>\s]+)(\{.*\})", re.DOTALL)
_BARE = re.compile(r"[^,\]}]*")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None}


def parse(text: str) -> list[dict]:
    """The calls ({'name', 'arguments'}) of a turn that stops at ``<|tool_response>`` (kept at
    the end of ``text``); [] for any other turn; ``Malformed`` for a call that cannot be read."""
    if not text.endswith(END):
        return []
    calls = []
    for body, end in _BLOCK.findall(text[:-len(END)]):
        if not end:
            raise Malformed("a <|tool_call> block is not closed by <tool_call|>")
        match = _CALL.fullmatch(body)
        if not match:
            raise Malformed("a <|tool_call> block must be call:NAME{arguments}")
        name = match.group(1)
        reader = _Reader(match.group(2), name)
        calls.append({"name": name, "arguments": reader.whole()})
    if not calls:
        raise Malformed("the turn stops at <|tool_response> but has no <|tool_call> block")
    return calls


def _scalar(bare: str, fail):
    """A bare value: a number, ``true``, ``false`` or ``null``."""
    if bare in _WORDS:
        return _WORDS[bare]
    match = _NUMBER.fullmatch(bare)
    if not match:
        fail(f"{bare!r} is not a value (a string is written between {_Q} quotes)")
    return float(bare) if match.group(1) or match.group(2) else int(bare)


class _Reader:
    """The arguments of one call, read left to right (``whole``)."""

    def __init__(self, text: str, name: str):
        self.text, self.at, self.name = text, 0, name

    def fail(self, what: str):
        raise Malformed(f"tool call {self.name!r}: {what}")

    def whole(self) -> dict:
        value = self.value()
        if self.at != len(self.text):
            self.fail(f"unexpected {self.text[self.at:self.at + 20]!r} after the arguments")
        return value

    def skip(self) -> None:
        """Past whitespace (the template writes none; a model may)."""
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def value(self):
        self.skip()
        text, at = self.text, self.at
        if text.startswith(_Q, at):
            end = text.find(_Q, at + len(_Q))
            if end < 0:
                self.fail(f"a string is not closed by {_Q}")
            self.at = end + len(_Q)
            return text[at + len(_Q):end]
        if text.startswith("{", at):
            return self.items("}", keyed=True)
        if text.startswith("[", at):
            return self.items("]", keyed=False)
        bare = _BARE.match(text, at).group()
        self.at = at + len(bare)
        return _scalar(bare.rstrip(), self.fail)

    def key(self) -> str:
        self.skip()
        colon = self.text.find(":", self.at)
        key = self.text[self.at:colon].rstrip() if colon >= 0 else ""
        if not key or any(c in key for c in ",{}[]"):
            self.fail(f"expected 'key:' at {self.text[self.at:self.at + 20]!r}")
        self.at = colon + 1
        return key.removeprefix(_Q).removesuffix(_Q)

    def items(self, close: str, keyed: bool):
        """An object (``keyed``) or a list, from its opening bracket to ``close``."""
        self.at += 1
        out = {} if keyed else []
        self.skip()
        if self.text.startswith(close, self.at):
            self.at += 1
            return out
        while True:
            if keyed:
                key = self.key()
                out[key] = self.value()
            else:
                out.append(self.value())
            self.skip()
            if self.text.startswith(close, self.at):
                self.at += 1
                return out
            if not self.text.startswith(",", self.at):
                self.fail(f"expected ',' or {close!r} at {self.text[self.at:self.at + 20]!r}")
            self.at += 1
