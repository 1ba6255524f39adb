"""GPT-OSS's tool calls (chat format ``harmony``) read back as the harmony format writes them.

A call is the turn's last message: a header that names its recipient, ``to=functions.NAME``
(before the channel, as the template writes it, ``<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>``, or after it, as the models also write,
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>``), its arguments as a JSON
object, and ``<|call|>``, where the model stops for the result (``chat.CALL_END``); one call per
turn. A turn that stops at ``<|return|>`` has answered and calls nothing. Messages before the
call (analysis, a commentary preamble) are not read.
"""

from __future__ import annotations

import json
import re

from nnx_posttrain.agents.malformed import Malformed

END = "<|call|>"  # where a calling turn stops
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def parse(text: str) -> list[dict]:
    """The call ({'name', 'arguments'}) of a turn that stops at ``<|call|>`` (kept at the end of
    ``text``): [it]; [] for any other turn; ``Malformed`` for a call that cannot be read."""
    if not text.endswith(END):
        return []
    message = text[:-len(END)].rsplit("<|start|>", 1)[-1]
    header, opened, body = message.partition("<|message|>")
    recipient = _RECIPIENT.search(header)
    if recipient is None:
        raise Malformed("a message that ends with <|call|> names its recipient in its header: "
                        "<|channel|>commentary to=functions.NAME json<|message|>{...}<|call|>")
    target = recipient.group(1)
    name = target.removeprefix("functions.")
    if name == target or not name:
        raise Malformed(f"a call goes to functions.NAME, not to {target!r}")
    if not opened:
        raise Malformed(f"tool call {name!r}: its header is not followed by <|message|>")
    try:
        arguments = json.loads(body)
    except json.JSONDecodeError as exc:
        raise Malformed(f"tool call {name!r}: its arguments are not JSON ({exc.msg})") from None
    if not isinstance(arguments, dict):
        raise Malformed(f"tool call {name!r}: its arguments must be a JSON object")
    return [{"name": name, "arguments": arguments}]
